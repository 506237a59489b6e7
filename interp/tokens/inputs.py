"""Inputs: token ids checked against the model, padding, positions of padded rows, tokenization."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["adds_bos", "check_inputs", "pad_ids", "padded_positions", "tokenize", "encode", "tokenizer_left_alone",
           "position_limit", "texts_of", "fix_permissions"]


def position_limit(config) -> int | None:
    """The most positions a model takes: its config's ``max_position_embeddings`` (GPT-2's ``n_positions`` maps
    to it), the size of a learned or fixed position table that torch would index out of range beyond it; None
    where the config names none (relative positions, as in T5)."""
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_inputs(inputs, attention_mask, vocab_size: int, max_positions: int | None, device,
                 to_tokens=None, what: str = "input_ids") -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(input_ids: (b, p), attention_mask: (b, p) or None)`` on ``device`` from ids ``(b, p)``/``(p,)``, a
    mapping with ``input_ids``, or text (through ``to_tokens``); clear errors for anything the model cannot run."""
    if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], str)):
        if to_tokens is None:
            raise ValueError("This model has no tokenizer; pass token ids (b, p) instead of text.")
        inputs = to_tokens(inputs)
    if inputs is None:
        raise TypeError(f"{what} is None; give text, token ids (batch, pos) or a mapping with input_ids (e.g. "
                        "model.to_tokens(text)).")
    if isinstance(inputs, Mapping):
        if "input_ids" not in inputs:
            raise ValueError(f"A mapping of inputs must hold input_ids (and may hold attention_mask); got keys "
                             f"{sorted(map(str, inputs))}. Build one with model.to_batch(text), or pass the ids.")
        attention_mask = inputs.get("attention_mask", attention_mask)
        inputs = inputs["input_ids"]
    try:
        ids = torch.as_tensor(inputs)
    except (TypeError, ValueError, RuntimeError) as error:
        ragged = isinstance(inputs, Sequence) and len({len(r) if isinstance(r, Sequence) else -1 for r in inputs}) > 1
        if ragged:
            raise ValueError(f"{what} rows have different lengths ({[len(r) for r in inputs]}); a batch is a "
                             "rectangle. Pad it with interp.tokens.inputs.pad_ids(rows, left=model.cfg.causal) and pass "
                             "the attention_mask it returns, or give texts to model.to_tokens.") from None
        raise TypeError(f"{what} must be token ids (batch, pos) as a tensor or nested lists of ints; got "
                        f"{type(inputs).__name__} ({error}).") from None
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{what} must be integer token ids of shape (batch, pos); got {ids.dtype} "
                         f"{tuple(ids.shape)}. Cast ids with .long(); a 0/1 or bool mask goes in attention_mask.")
    if ids.numel() == 0:
        raise ValueError(f"Empty input: input_ids has shape {tuple(ids.shape)}; give at least one token.")
    if max_positions is not None and ids.shape[1] > max_positions:
        raise ValueError(f"{what} has {ids.shape[1]} positions but this model takes at most {max_positions} "
                         "(its config's max_position_embeddings); truncate or split it.")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"Token ids must lie in [0, {vocab_size}); got ids from {lo} to {hi}.")
    ids = ids.to(device)
    if attention_mask is not None:
        attention_mask = torch.as_tensor(attention_mask).to(device)
        if attention_mask.ndim == 1:
            attention_mask = attention_mask[None]
        if attention_mask.shape != ids.shape:
            raise ValueError(f"attention_mask must match input_ids {tuple(ids.shape)}; got {tuple(attention_mask.shape)}.")
        if attention_mask.is_floating_point() or attention_mask.is_complex():
            if not bool(torch.isfinite(attention_mask).all()):
                raise ValueError("attention_mask holds NaN or inf; it marks real tokens (nonzero) and padding (0).")
        # As HF reads it: nonzero attends. A mask of 2s must count positions as a mask of 1s does (position ids are
        # its cumulative sum), so it becomes 0/1 here, in the dtype it came in.
        attention_mask = (attention_mask != 0).to(attention_mask.dtype)
        if bool((attention_mask.sum(-1) == 0).any()):
            raise ValueError("attention_mask has a row with no real token; every sequence needs at least one.")
    return ids, attention_mask


def texts_of(text) -> list[str]:
    """``text`` (a string or a non-empty list of strings) as a list; a clear error for anything else."""
    texts = [text] if isinstance(text, str) else list(text) if isinstance(text, (list, tuple)) else None
    if texts == []:
        raise ValueError("to_tokens got an empty list; give at least one string.")
    if texts is None or any(not isinstance(t, str) for t in texts):
        raise TypeError(f"to_tokens takes a string or a non-empty list of strings; got {text!r}"
                        f"{'' if isinstance(text, (str, list, tuple)) else f' ({type(text).__name__})'}.")
    return texts


def padded_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``(b, p)`` that count only real tokens (any nonzero mask value): ``cumsum(mask != 0) - 1``, 0 on
    left padding."""
    return ((mask != 0).long().cumsum(-1) - 1).clamp(min=0)


def pad_ids(rows: Sequence[Sequence[int] | torch.Tensor], left: bool, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token-id sequences into ``input_ids: (b, p)`` and ``attention_mask: (b, p)``, padded on the left
    (causal models) or the right (encoders).

    >>> pad_ids([[5, 6, 7], [8]], left=True)
    (tensor([[5, 6, 7],
            [0, 0, 8]]), tensor([[1, 1, 1],
            [0, 0, 1]]))
    """
    rows = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in rows]
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(n - len(r), n) if left else slice(0, len(r))
        ids[i, span], mask[i, span] = r, 1
    return ids, mask


def adds_bos(tokenizer) -> bool:
    """Whether ``tokenizer(text)`` puts a BOS token in front of the text by itself (Llama's does, SmolLM2's not)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos is not None and encode(tokenizer, "a")[:1] == [bos]


def tokenize(tokenizer, texts: list[str], max_length: int | None = None) -> list[list[int]]:
    """Token ids of each text, with the tokenizer's special tokens and no padding. The tokenizer's settings
    are not touched, and its warning about sequences longer than the model is silenced: inputs are checked
    against the model's positions where they are run, with an error that says what to do."""
    return encode(tokenizer, list(texts), truncation=max_length is not None, max_length=max_length)


def encode(tokenizer, text, **kwargs) -> list:
    """``tokenizer(text, **kwargs)["input_ids"]``, leaving the tokenizer as it was (``tokenizer_left_alone``) and
    without its warning about sequences longer than the model. Every tokenizer call of the toolkit goes here."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with tokenizer_left_alone(tokenizer):
            return tokenizer(text, **kwargs)["input_ids"]
    finally:
        hf_logging.set_verbosity(verbosity)


_TOKENIZER_ATTRS = ("padding_side", "truncation_side", "model_max_length", "pad_token")


@contextmanager
def tokenizer_left_alone(tokenizer) -> Iterator[None]:
    """Restore, on exit (also after an exception), what a call of a HF tokenizer changes for good: a fast
    tokenizer's call resets the truncation and padding set on its Rust ``backend_tokenizer``
    (``enable_truncation``/``enable_padding``); and the python-side ``padding_side``, ``truncation_side``,
    ``model_max_length`` and ``pad_token``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = None
    if backend is not None and hasattr(backend, "truncation") and hasattr(backend, "padding"):
        state = (backend.truncation, backend.padding)
    attrs = {a: getattr(tokenizer, a) for a in _TOKENIZER_ATTRS if hasattr(tokenizer, a)}
    try:
        yield
    finally:
        for name, value in attrs.items():
            if getattr(tokenizer, name, None) != value:
                setattr(tokenizer, name, value)
        if state is not None and (backend.truncation, backend.padding) != state:
            truncation, padding = state
            if truncation is None:
                backend.no_truncation()
            else:
                backend.enable_truncation(**truncation)
            if padding is None:
                backend.no_padding()
            else:
                backend.enable_padding(**padding)


def fix_permissions(folder) -> None:
    """Give every file in ``folder`` the mode a new file gets under the process's umask (usually 0644)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in Path(folder).rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)
