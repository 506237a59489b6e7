"""The prompts of the studies: a user's prompts checked into token ids (``prompt_ids``) or padded into one batch
(``prompt_batch``), repeated random tokens, prompts drawn from the bundled corpus of plain English sentences
(``corpus_prompts``, a long ``haystack`` of them), the model's special-token frame and ordinary tokens, and the
inputs and metric of the ablation, pruning and streaming studies (``study_inputs``).

Shared by ``detect_heads`` (``analyses.heads.detect``), the tasks, retrieval heads, the taxonomy, the CLI and the report;
below all of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path

import torch

from interp.tokens.inputs import encode, pad_ids, tokenize

from .metrics import embedding_similarity, lm_loss, second_copy_loss
from .seq2seq import copy_study_inputs, is_seq2seq
from .toy import repeated_sequences

__all__ = ["prompt_ids", "prompt_batch", "repeated_random_tokens", "corpus_prompts", "corpus_sentences", "haystack",
           "refuse_unreadable", "study_inputs"]

CORPUS = Path(__file__).resolve().parent / "sentences.txt"


def prompt_ids(model, prompts) -> list[torch.Tensor]:
    """The user's prompts as a list of 1-D id tensors, checked against the model's positions and vocabulary."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, Mapping):
        ids, mask = torch.as_tensor(prompts["input_ids"]), prompts.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else torch.as_tensor(mask)
        prompts = [row[m.bool()] for row, m in zip(ids.cpu(), mask.cpu())]
    elif isinstance(prompts, torch.Tensor):
        prompts = list(prompts[None] if prompts.ndim == 1 else prompts)
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)) or len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one text or token-id sequence, or None for the defaults.")
    if any(isinstance(p, str) for p in prompts):
        if not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompts mixes texts and token ids; give one kind.")
        blank = [i for i, p in enumerate(prompts) if not p.strip()]
        if blank:
            raise ValueError(f"prompt {blank[0]} is empty or only whitespace ({prompts[blank[0]]!r}); every prompt "
                             "needs some text.")
        if model.tokenizer is None:
            raise ValueError("This model has no tokenizer, so text prompts cannot be scored; give token ids.")
        prompts = tokenize(model.tokenizer, list(prompts))
    out = []
    cfg = model.cfg
    for i, p in enumerate(prompts):
        ids = torch.as_tensor(p).cpu()
        if ids.numel() == 0:
            raise ValueError(f"prompt {i} has no tokens.")
        if ids.ndim != 1 or ids.is_floating_point():
            raise ValueError(f"prompt {i} must be a 1-D sequence of integer token ids; got {ids.dtype} {tuple(ids.shape)}.")
        if len(ids) > cfg.max_positions:
            raise ValueError(f"prompt {i} has {len(ids)} tokens but the model takes at most {cfg.max_positions} "
                             "positions; shorten or split it.")
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {cfg.vocab_size}).")
        out.append(ids.long())
    return out


def repeated_random_tokens(model, n_prompts: int, seq_len: int, generator: torch.Generator,
                           name: str = "seq_len") -> list[torch.Tensor]:
    """Random ordinary tokens ``x`` repeated, framed by the model's start (and end) tokens: ``seq_len`` ids each
    (``name``: what the caller calls that length, in the error for one too short).

    ``x`` holds ceil(m / 2) distinct tokens (m = seq_len minus the special tokens) when the vocabulary allows,
    so each second-copy token has exactly one earlier occurrence (Olsson et al. 2022 use 25 tokens, 4 repeats).
    The frame is what the tokenizer adds to a text ([CLS] ... [SEP] for BERT); a causal model whose tokenizer
    adds nothing, or that has none, gets ``config.bos_token_id`` in front when it has one.
    """
    prefix, suffix = _special_frame(model)
    m = seq_len - len(prefix) - len(suffix)
    if m < 4:
        raise ValueError(f"{name} {seq_len} leaves {m} random tokens after the special ones; use at least "
                         f"{len(prefix) + len(suffix) + 4}.")
    pool = _ordinary_ids(model)
    half = math.ceil(m / 2)
    if half <= len(pool):
        x = torch.stack([pool[torch.randperm(len(pool), generator=generator)[:half]] for _ in range(n_prompts)])
    else:
        x = pool[torch.randint(len(pool), (n_prompts, half), generator=generator)]
    body = torch.cat([x, x], dim=1)[:, :m]  # (n_prompts, m)
    head, tail = torch.tensor(prefix, dtype=torch.long), torch.tensor(suffix, dtype=torch.long)
    return [torch.cat([head, row, tail]) for row in body]


def corpus_prompts(model, n_prompts: int, seq_len: int, generator: torch.Generator) -> list[torch.Tensor]:
    """``n_prompts`` prompts of whole corpus sentences, drawn without replacement per prompt, up to ``seq_len``
    tokens with the tokenizer's own special tokens (lengths vary, so batches are padded)."""
    tok = model.tokenizer
    sentences = corpus_sentences()
    lengths = [len(x) for x in encode(tok, list(sentences), add_special_tokens=False)]
    n_special = len(encode(tok, "a")) - len(encode(tok, "a", add_special_tokens=False))
    budget = seq_len - n_special
    if budget < 1:
        raise ValueError(f"seq_len {seq_len} leaves no room for text after {n_special} special tokens.")
    texts = []
    for _ in range(n_prompts):
        picked, used = [], 0
        for i in torch.randperm(len(sentences), generator=generator).tolist():
            if picked and used + lengths[i] > budget:
                break
            picked.append(sentences[i])
            used += lengths[i]
        texts.append(" ".join(picked))
    encoded = encode(tok, texts, truncation=True, max_length=seq_len)
    return [torch.tensor(ids, dtype=torch.long) for ids in encoded]


@cache
def corpus_sentences() -> tuple[str, ...]:
    """The bundled corpus: plain English sentences written for this project, one per line."""
    return tuple(line.strip() for line in CORPUS.read_text(encoding="utf-8").splitlines() if line.strip())


def refuse_unreadable(model, ids, what: str, fix: str, limit: float = 0.1) -> None:
    """Refuse text the tokenizer cannot read: more than ``limit`` of ``ids`` (a tensor of any shape, or a list) are
    its unknown token. A score on such prompts (every word the same ``[UNK]``) would mean nothing. ``what`` names
    the text in the message, ``fix`` says what to do instead."""
    tok = model.tokenizer
    unknown = getattr(tok, "unk_token_id", None) if tok is not None else None
    ids = torch.as_tensor(ids)
    if unknown is None or ids.numel() == 0:
        return
    share = float((ids == unknown).double().mean())
    if share > limit:
        raise ValueError(f"{what}: {share:.0%} of its tokens are the tokenizer's unknown token {tok.unk_token!r} (id "
                         f"{unknown}); the tokenizer cannot read this text, so a score on it would mean nothing. "
                         f"{fix}")


def _special_frame(model) -> tuple[list[int], list[int]]:
    tok = model.tokenizer
    if tok is not None:
        framed = encode(tok, "a")
        bare = encode(tok, "a", add_special_tokens=False)
        at = next((i for i in range(len(framed) - len(bare) + 1) if framed[i:i + len(bare)] == bare), None)
        if at is not None:
            prefix, suffix = framed[:at], framed[at + len(bare):]
            if prefix or not model.cfg.causal:
                return prefix, suffix
    bos = getattr(model.hf.config, "bos_token_id", None)
    if model.cfg.causal and isinstance(bos, int) and 0 <= bos < model.cfg.vocab_size:
        return [bos], []
    return [], []


def _ordinary_ids(model) -> torch.Tensor:
    """Token ids other than special ones (config's and tokenizer's, and bracketed names like [unused3])."""
    config, tok = model.hf.config, model.tokenizer
    special: set[int] = set()
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "cls_token_id", "mask_token_id",
                 "unk_token_id", "decoder_start_token_id"):
        value = getattr(config, attr, None)
        special.update([value] if isinstance(value, int) else value if isinstance(value, (list, tuple)) else [])
    limit = model.cfg.vocab_size
    if tok is not None:
        special.update(tok.all_special_ids)
        limit = min(limit, len(tok))
        names = tok.convert_ids_to_tokens(list(range(limit)))
        special.update(i for i, t in enumerate(names)
                       if isinstance(t, str) and len(t) > 2 and (t[0], t[-1]) in (("[", "]"), ("<", ">")))
    keep = torch.tensor([i for i in range(limit) if i not in special], dtype=torch.long)
    if len(keep) < 2:
        raise ValueError(f"The model's vocabulary has {len(keep)} ordinary tokens; random prompts need at least 2.")
    return keep


def haystack(tok, n: int, g: torch.Generator) -> list[int]:
    """n tokens of corpus sentences, shuffled and repeated as needed (cut at n): the filler of needle prompts and
    of long streaming inputs. tok: a HF tokenizer; g: the generator that draws the order."""
    sentences = corpus_sentences()
    ids: list[int] = []
    while len(ids) < n:
        for i in torch.randperm(len(sentences), generator=g).tolist():
            ids += tok(" " + sentences[i], add_special_tokens=False)["input_ids"]
            if len(ids) >= n:
                break
    return ids[:n]


def prompt_batch(model, prompts: list) -> dict:
    """Texts or token-id sequences as one padded batch ``{"input_ids", "attention_mask"}``."""
    if prompts and all(isinstance(p, str) for p in prompts):
        return model.to_batch(prompts)
    if not prompts or any(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a non-empty list of texts or of token-id sequences, not a mix.")
    ids, mask = pad_ids(prompts, left=model.cfg.causal, pad_id=model.pad_token_id)
    return {"input_ids": ids.to(model.device), "attention_mask": mask.to(model.device)}


def study_inputs(model, prompts: list | None = None, n: int = 32, seed: int = 0, copy_len: int = 12,
                 same_length: bool = False):
    """Inputs and metric for ablation and pruning studies: ``(inputs, metric, description)``.

    prompts: texts, or token-id sequences (any lengths; a model without a tokenizer takes only these). None:
    the project's sentences for models with a tokenizer, else ``n`` repeated random sequences ``[BOS, x, x]``
    with ``len(x) = copy_len``. same_length: the first ``n`` of the project's sentences that have its most common
    length in tokens, so that no padding is computed (SmolLM2: 14 tokens; the first 4 sentences are 72 positions
    with padding, 62 real), where it has ``n`` such sentences. The metric: second-copy loss on repeated sequences,
    causal LM loss on text, and for encoders the embedding similarity to the unablated model. An encoder-decoder
    model: the copy task or the prompts copied, with the teacher-forced target loss
    (``analyses.data.seq2seq.copy_study_inputs``).
    """
    if is_seq2seq(model):
        return copy_study_inputs(model, prompts, n=n, seed=seed)
    if prompts is None and model.tokenizer is None:
        generator = torch.Generator().manual_seed(seed)
        bos = model.hf.config.bos_token_id
        ids = repeated_sequences(n, copy_len, model.cfg.vocab_size, generator, bos)
        return ids, second_copy_loss, f"{n} repeated random sequences [BOS, x, x], len(x) = {copy_len}"
    what = f"{len(prompts)} given prompts" if prompts is not None else None
    if prompts is None and same_length:
        prompts, what = _same_length_sentences(model, n)
    if prompts is None:
        prompts = list(corpus_sentences()[:n])
        what = f"the first {len(prompts)} of the project's sentences"
    inputs = prompt_batch(model, prompts)
    if model.cfg.causal:
        return inputs, lm_loss, what
    return inputs, embedding_similarity(model, inputs), what


def _same_length_sentences(model, n: int) -> tuple[list | None, str]:
    """The first ``n`` project sentences of the most common token count (ties: the longer), or None where fewer."""
    sentences = list(corpus_sentences())
    lengths = model.to_batch(sentences)["attention_mask"].sum(1).tolist()
    counts = {k: lengths.count(k) for k in set(lengths)}
    common = max(counts, key=lambda k: (counts[k], k))
    if counts[common] < n:
        return None, ""
    chosen = [s for s, k in zip(sentences, lengths) if k == common][:n]
    return chosen, f"the first {n} of the project's sentences that are {common} tokens long (its most common length)"
