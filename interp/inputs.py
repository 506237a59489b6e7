"""Inputs: token ids checked against the model, padding, positions of padded rows, tokenization."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

__all__ = ["check_inputs", "pad_ids", "padded_positions", "tokenize", "fix_permissions"]


def check_inputs(inputs, attention_mask, vocab_size: int, max_positions: int | None, device,
                 to_tokens=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(input_ids: (b, p), attention_mask: (b, p) or None)`` on ``device`` from ids ``(b, p)``/``(p,)``, a
    mapping with ``input_ids``, or text (through ``to_tokens``); clear errors for anything the model cannot run."""
    if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], str)):
        if to_tokens is None:
            raise ValueError("This model has no tokenizer; pass token ids (b, p) instead of text.")
        inputs = to_tokens(inputs)
    if isinstance(inputs, Mapping):
        attention_mask = inputs.get("attention_mask", attention_mask)
        inputs = inputs["input_ids"]
    ids = torch.as_tensor(inputs)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.is_floating_point():
        raise ValueError(f"input_ids must be integer token ids of shape (batch, pos); got {ids.dtype} {tuple(ids.shape)}.")
    if ids.numel() == 0:
        raise ValueError(f"Empty input: input_ids has shape {tuple(ids.shape)}; give at least one token.")
    if max_positions is not None and ids.shape[1] > max_positions:
        raise ValueError(f"Input has {ids.shape[1]} positions but this model takes at most {max_positions} "
                         "(max_position_embeddings); truncate or split it.")
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
        if bool((attention_mask.sum(-1) == 0).any()):
            raise ValueError("attention_mask has a row with no real token; every sequence needs at least one.")
    return ids, attention_mask


def padded_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``(b, p)`` that count only real tokens: ``cumsum(mask) - 1``, 0 on left padding."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


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


def tokenize(tokenizer, texts: list[str], max_length: int | None = None) -> list[list[int]]:
    """Token ids of each text, with the tokenizer's special tokens and no padding. The tokenizer's settings
    are not touched, and its warning about sequences longer than the model is silenced: inputs are checked
    against the model's positions where they are run, with an error that says what to do."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return tokenizer(list(texts), truncation=max_length is not None, max_length=max_length)["input_ids"]
    finally:
        hf_logging.set_verbosity(verbosity)


def fix_permissions(folder) -> None:
    """Give every file in ``folder`` the mode a new file gets under the process's umask (usually 0644)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in Path(folder).rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)
