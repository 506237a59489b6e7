"""What a TransformerLens user types about tokens, the forward pass's return types and generation, on a
``HookedModel``: ``to_tokens`` (a ``(batch, pos)`` LongTensor), ``to_string``, ``to_single_token``,
``to_str_tokens`` (``' cat'``), ``get_token_position``, ``tokens_to_residual_directions``,
``model(tokens, return_type=..., loss_per_token=...)`` and ``generate``.

Conventions (``notebooks/transformerlens.md``): BOS follows the model's tokenizer unless ``prepend_bos`` says
otherwise (TransformerLens prepends one by default, also where the tokenizer never does, as GPT-2's); a list of
strings is padded on the right with the model's pad id, as TransformerLens pads. A bare tensor of ids runs without
a padding mask, except that a row's leading or trailing run of the tokenizer's own pad token is masked where that
token is a dedicated one (not also its BOS, EOS, SEP or CLS). ``model.to_batch(text)`` gives the mapping of ids
and mask (left padding for causal models) that ``to_tokens`` returned before, and every function that takes
tokens takes either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from ..tokens.inputs import adds_bos, encode, pad_ids, texts_of, tokenize
from ..tokens.display import readable_tokens

__all__ = ["TokensMixin", "lm_loss", "pad_mask"]

RETURN_TYPES = ("output", "logits", "loss", "both", None)
_UNSET = object()


def lm_loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None, per_token: bool) -> torch.Tensor:
    """Next-token cross-entropy as TransformerLens computes it: ``(b, p - 1)`` per token, else the mean over
    the predicted tokens whose position and target are both real (``mask``)."""
    log_probs = F.log_softmax(logits.float(), dim=-1)
    predicted = log_probs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # (b, p - 1)
    if mask is not None:
        real = mask[:, :-1].bool() & mask[:, 1:].bool()
        predicted = predicted.masked_fill(~real, 0.0)
        count = real.sum()
    else:
        count = predicted.numel()
    return -predicted if per_token else -predicted.sum() / count


def pad_mask(ids: torch.Tensor, tokenizer) -> torch.Tensor | None:
    """The padding mask of a bare tensor of ids: 0 on each row's leading and trailing run of the tokenizer's pad
    token where it is a dedicated one; None where there is none to mask (or no dedicated pad token)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    special = {getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "sep", "cls")}
    if not isinstance(pad, int) or pad in special:
        return None
    real = ids != pad
    if bool(real.all()) or not bool(real.any(-1).all()):
        return None
    mask = (real.long().cumsum(-1) > 0) & (real.flip(-1).long().cumsum(-1).flip(-1) > 0)
    return mask.long()


class TokensMixin:
    """Token helpers, return types and generation of ``HookedModel`` (it keeps ``tokenizer``, ``cfg``, ``device``)."""

    return_type = "output"  # what model(...) returns by default: the HF output (HookedTransformer.from_pretrained: logits)

    # -- text -> ids -------------------------------------------------------------------------------------------
    def _tokenizer(self):
        if self.tokenizer is None:
            raise ValueError("This model has no tokenizer; pass token ids (b, p) instead of text.")
        return self.tokenizer

    def to_batch(self, text: str | Sequence[str], max_length: int | None = None) -> dict[str, torch.Tensor]:
        """Tokenize text into ``{"input_ids": (b, p), "attention_mask": (b, p)}``, padded (left for causal
        models, right for encoders) and on the model's device: what ``to_tokens`` returned before."""
        tokenizer = self._tokenizer()
        rows = tokenize(tokenizer, texts_of(text), max_length=max_length)
        ids, mask = pad_ids(rows, left=self.cfg.causal, pad_id=self.pad_token_id)
        return {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}

    def _rows(self, text, prepend_bos: bool | None, truncate: bool = True) -> list[list[int]]:
        tokenizer = self._tokenizer()
        limit = self.cfg.max_positions if truncate else None
        rows = tokenize(tokenizer, texts_of(text), max_length=limit)
        bos = getattr(tokenizer, "bos_token_id", None)
        added = adds_bos(tokenizer)  # only a BOS the tokenizer added is ours to drop or keep; one in the text stays
        if prepend_bos is True:
            if bos is None:
                raise ValueError("prepend_bos=True, but this model's tokenizer has no BOS token; leave prepend_bos as "
                                 "None to use the tokenizer's own special tokens.")
            rows = [r if added else [bos, *r] for r in rows]
            rows = [r[:limit] if limit else r for r in rows]
        elif prepend_bos is False:
            rows = [r[1:] if added and r[:1] == [bos] and len(r) > 1 else r for r in rows]
        elif prepend_bos is not None:
            raise TypeError(f"prepend_bos is None (the tokenizer's convention), True or False; got {prepend_bos!r}.")
        return rows

    def to_tokens(self, input: str | Sequence[str], prepend_bos: bool | None = None,  # noqa: A002
                  padding_side: str | None = None, move_to_device: bool = True, truncate: bool = True) -> torch.Tensor:
        """Token ids ``(batch, pos)`` as a LongTensor, as TransformerLens returns them. ``prepend_bos``: None keeps
        the tokenizer's special tokens, True puts a BOS first where it is missing, False drops a leading BOS.
        A list of strings is padded on ``padding_side`` ("right", TransformerLens's default, or "left") with
        the model's pad id; ``truncate`` cuts rows to the model's positions."""
        ids, _ = self._padded(input, prepend_bos, padding_side, truncate)
        return ids.to(self.device) if move_to_device else ids

    def _padded(self, input, prepend_bos: bool | None, padding_side: str | None,  # noqa: A002
                truncate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, attention_mask)`` of text as ``to_tokens`` pads it; the mask is what a forward must get."""
        if padding_side not in (None, "right", "left"):
            raise ValueError(f"padding_side is 'right' or 'left'; got {padding_side!r}.")
        rows = self._rows(input, prepend_bos, truncate)
        return pad_ids(rows, left=padding_side == "left", pad_id=self.pad_token_id)

    def _token_ids(self, tokens, what: str) -> torch.Tensor:
        """``tokens`` (ids, a mapping with ``input_ids``) as an integer tensor of ids in the vocabulary; one clear
        line for strings, floats, bools and ids outside ``[0, d_vocab)`` (a tokenizer decodes those to '')."""
        if isinstance(tokens, Mapping):
            tokens = tokens["input_ids"]
        try:
            ids = torch.as_tensor(tokens)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{what} takes token ids (an int, a list of ints or a LongTensor); got {tokens!r}. Text "
                            "goes through model.to_tokens first.") from None
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"{what} takes integer token ids; got {ids.dtype} {tuple(ids.shape)}. Cast with .long().")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.d_vocab):
            raise ValueError(f"{what}: token ids lie in [0, {self.cfg.d_vocab}); got ids from {int(ids.min())} to "
                             f"{int(ids.max())}.")
        return ids

    def to_string(self, tokens) -> str | list[str]:
        """Decode ids: ``(p,)`` or one id -> a string; ``(b, p)`` -> a list of strings."""
        ids, tokenizer = self._token_ids(tokens, "to_string"), self._tokenizer()
        if ids.numel() and int(ids.max()) >= len(tokenizer):
            raise ValueError(f"to_string: id {int(ids.max())} is in the model's vocabulary ({self.cfg.d_vocab}) but "
                             f"past the tokenizer's ({len(tokenizer)} tokens), so it has no text.")
        if ids.ndim == 2:
            return [self.to_string(row) for row in ids]
        return tokenizer.decode(ids.reshape(-1).tolist(), clean_up_tokenization_spaces=False)

    def to_single_token(self, string: str) -> int:
        """The id of a string that is one token (with its leading space: ``" Mary"``)."""
        if not isinstance(string, str):
            raise TypeError(f"to_single_token takes a string of one token (e.g. ' Mary'); got {string!r} "
                            f"({type(string).__name__}). An id is already a token: use it as it is.")
        ids = encode(self._tokenizer(), string, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{string!r} is {len(ids)} tokens ({self.to_str_tokens(torch.tensor(ids))}); "
                             "to_single_token needs one (mind the leading space).")
        return ids[0]

    def to_str_tokens(self, input, prepend_bos: bool | None = None,  # noqa: A002
                      padding_side: str | None = None) -> list[str] | list[list[str]]:
        """Each token as the text it stands for (``' cat'``): of a string, of ids ``(p,)`` or ``(1, p)`` (one
        list), of a batch ``(b, p)`` or a list of strings (a list per row)."""
        if isinstance(input, Mapping):
            input = input["input_ids"]  # noqa: A001
        if isinstance(input, (list, tuple)) and input and all(isinstance(t, str) for t in input):
            return [self.to_str_tokens(t, prepend_bos) for t in input]
        if isinstance(input, (list, tuple)) and any(isinstance(t, str) for t in input):
            raise TypeError(f"to_str_tokens takes a string, a list of strings or token ids; got a list mixing "
                            f"strings and other values: {input!r}.")
        if isinstance(input, str):
            input = self.to_tokens(input, prepend_bos=prepend_bos)[0]  # noqa: A001
        ids = self._token_ids(input, "to_str_tokens")
        if ids.ndim == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.ndim == 2:
            return [self.to_str_tokens(row) for row in ids]
        ids = ids.reshape(-1)
        if self.tokenizer is None:
            return [str(int(i)) for i in ids]
        return readable_tokens(self.tokenizer, ids.tolist())

    def get_token_position(self, single_token: str | int, input, mode: str = "first",  # noqa: A002
                           prepend_bos: bool | None = None, padding_side: str | None = None) -> int:
        """The position of a token (a string of one token, or an id) in a text or a sequence of ids: its
        ``mode="first"`` or ``"last"`` occurrence."""
        if mode not in ("first", "last"):
            raise ValueError(f"mode is 'first' or 'last'; got {mode!r}.")
        if isinstance(input, (list, tuple)) and any(isinstance(t, str) for t in input):
            if len(input) != 1 or not isinstance(input[0], str):
                raise ValueError(f"get_token_position takes one text or one sequence of ids; got a list of "
                                 f"{len(input)}: {input!r}. Call it once per text.")
            input = input[0]  # noqa: A001
        text = isinstance(input, str)
        ids = self.to_tokens(input, prepend_bos, padding_side) if text else self._token_ids(input, "get_token_position")
        if ids.ndim == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"get_token_position takes one sequence; got a batch of {ids.shape[0]}.")
            ids = ids[0]
        token = (self.to_single_token(single_token) if isinstance(single_token, str)
                 else int(self._token_ids(single_token, "get_token_position's token").reshape(-1)[0]))
        hits = (ids == token).nonzero().flatten()
        if not len(hits):
            raise ValueError(f"Token {single_token!r} ({token}) is not in the input {self.to_str_tokens(ids)}.")
        return int(hits[0] if mode == "first" else hits[-1])

    def tokens_to_residual_directions(self, tokens) -> torch.Tensor:
        """The unembedding column of each token (``W_U[:, token]``): ``(m,)`` for one token (an id or a string),
        ``(*tokens.shape, m)`` for a tensor of ids."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        ids = self._token_ids(tokens, "tokens_to_residual_directions").to(self.device)
        return self.W_U[:, ids].movedim(0, -1)

    # -- what the forward pass returns ----------------------------------------------------------------------------
    def _text_kwargs(self, inputs, kwargs: dict):
        """Text tokenized as TransformerLens would when ``prepend_bos`` or ``padding_side`` is given: a mapping with
        the ``attention_mask`` of its padding, so that each padded row computes what it computes alone."""
        prepend_bos, side = kwargs.pop("prepend_bos", None), kwargs.pop("padding_side", None)
        text = isinstance(inputs, str) or isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], str)
        if text and (prepend_bos is not None or side is not None):
            ids, mask = self._padded(inputs, prepend_bos, side)
            return {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        return inputs

    def _returned(self, output, batch: dict, return_type, loss_per_token: bool):
        """``output`` as ``return_type`` asks: "output" (the HF model's own), "logits", "loss" (next-token
        cross-entropy, ``loss_per_token``: ``(b, p - 1)``), "both" (logits, loss) or None."""
        return_type = self.return_type if return_type is _UNSET else return_type
        if return_type not in RETURN_TYPES:
            raise ValueError(f"return_type is one of {RETURN_TYPES}; got {return_type!r}.")
        if return_type == "output":
            return output
        if return_type is None:
            return None
        logits = getattr(output, "logits", None)
        if logits is None:
            raise NotImplementedError(f"{type(self.hf).__name__} has no output layer (no logits), so return_type="
                                      f"{return_type!r} has nothing to return; use return_type='output'.")
        if return_type == "logits":
            return logits
        if not self.cfg.causal or "decoder_input_ids" in batch:
            raise NotImplementedError("return_type='loss' is the next-token loss of a decoder-only language model; "
                                      "this model is not one (pass labels= for the HF model's own loss).")
        loss = lm_loss(logits, batch["input_ids"], batch.get("attention_mask"), loss_per_token)
        return loss if return_type == "loss" else (logits, loss)

    def loss_fn(self, logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                per_token: bool = False) -> torch.Tensor:
        """TransformerLens's ``model.loss_fn``: next-token cross-entropy of ``logits`` on ``tokens``."""
        return lm_loss(logits, torch.as_tensor(tokens, device=logits.device), attention_mask, per_token)

    # -- generation ---------------------------------------------------------------------------------------------
    def _added_bos(self, row: torch.Tensor, text: str) -> int:
        """1 where ``row`` starts with a BOS that tokenizing ``text`` added (TransformerLens's generate drops it from
        the string it returns), else 0: a BOS written in the text stays."""
        tokenizer = self._tokenizer()
        bos, bos_text = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "bos_token", None)
        return int(bos is not None and row[0].item() == bos and not (bos_text and text.startswith(bos_text)))

    def generate(self, input="", max_new_tokens: int = 10, stop_at_eos: bool = True,  # noqa: A002
                 eos_token_id: int | None = None, do_sample: bool = True, top_k: int | None = None,
                 top_p: float | None = None, temperature: float = 1.0, freq_penalty: float = 0.0,
                 prepend_bos: bool | None = None, return_type: str = "input", use_past_kv_cache: bool = True,
                 verbose: bool = False, **_tl_options):
        """Sample ``max_new_tokens`` tokens after ``input`` (a string, a list of strings, or ids ``(b, p)``), as
        TransformerLens's ``generate``: a string back for a string (``return_type="input"``), else ids ``(b, p +
        new)``. Each step runs the whole sequence through the model, so hooks active around the call (``with
        model.hooks(...)``) fire on every position of every step (``use_past_kv_cache`` is accepted and unused).
        ``do_sample=False`` or ``temperature=0``: greedy. Stops when every row has produced EOS."""
        if not self.cfg.causal or getattr(self.hf, "get_output_embeddings", lambda: None)() is None:
            raise NotImplementedError("generate needs a decoder-only language model with an output layer; this model "
                                      "is not one (an encoder-decoder model: use model.hf.generate).")
        if return_type not in ("input", "str", "tokens"):
            raise ValueError(f"return_type is 'input', 'str' or 'tokens'; got {return_type!r}.")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens is a whole number of tokens, 0 or more; got {max_new_tokens!r}.")
        texts = isinstance(input, str) or isinstance(input, (list, tuple)) and bool(input) and isinstance(input[0], str)
        if texts:
            rows = self._rows(input, prepend_bos)
            ids, mask = pad_ids(rows, left=True, pad_id=self.pad_token_id)
        else:
            ids = torch.as_tensor(input["input_ids"] if isinstance(input, Mapping) else input)
            ids = ids[None] if ids.ndim == 1 else ids
            mask = input.get("attention_mask") if isinstance(input, Mapping) else None
            mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask)
        ids, mask = ids.to(self.device), mask.to(self.device)
        eos = eos_token_id if eos_token_id is not None else getattr(self.tokenizer, "eos_token_id", None)
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = self(ids, mask, return_type="logits")[:, -1].float()  # (b, vocab)
                new = _sample(logits, ids, do_sample, top_k, top_p, temperature, freq_penalty)
                if stop_at_eos and eos is not None:
                    new = torch.where(done, torch.full_like(new, eos), new)
                    done |= new == eos
                ids, mask = torch.cat([ids, new[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
                if stop_at_eos and eos is not None and bool(done.all()):
                    break
        if return_type == "tokens" or (return_type == "input" and not texts):
            return ids
        strings = [self.to_string(row[m.bool()][self._added_bos(row[m.bool()], text):])
                   for row, m, text in zip(ids, mask, texts_of(input))]
        return strings[0] if isinstance(input, str) else strings


def _sample(logits: torch.Tensor, ids: torch.Tensor, do_sample: bool, top_k, top_p, temperature: float,
            freq_penalty: float) -> torch.Tensor:
    """One next token per row from the last position's logits ``(b, vocab)``."""
    if not do_sample or temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if freq_penalty:
        counts = torch.zeros_like(logits).scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
        logits = logits - freq_penalty * counts
    if top_k is not None:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1)[:, 0]
