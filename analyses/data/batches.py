"""A study's batch: what ``batch_of`` makes of a study's inputs (text, token ids or a mapping) for the model's sites,
and the tensor a model's output is read from (``_main_output``). Below the metrics and every study."""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch

from interp.attention.sites import MASK_OF

__all__ = ["Batch", "batch_of", "check_position", "unpadded_rows"]

Batch = dict  # {"input_ids": (b, p) int64, "attention_mask": (b, p) or None}


def batch_of(model, inputs) -> Batch:
    """Normalise a study's inputs into a batch on the model's device: ``{"input_ids": (b, p), "attention_mask":
    (b, p) or None}`` from text (tokenized with ``model.to_batch``), token ids ``(b, p)``/``(p,)`` or a mapping.

    What a batch holds is what the model's sites read (``site.queries``/``site.keys``): a model with a decoder stack
    fed separately (encoder-decoder) also needs ``decoder_input_ids`` and takes ``decoder_attention_mask`` (teacher
    forcing, as ``analyses.data.seq2seq.copy_task`` returns); other entries (``labels``) are kept as given."""
    if any(s.queries == "decoder_input_ids" for s in model.cfg.sites):
        return _two_stack_batch(model, inputs)
    if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], str)):
        inputs = model.to_batch(inputs)
    if isinstance(inputs, Mapping):
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    else:
        ids, mask = inputs, None
    ids = torch.as_tensor(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.numel() == 0:
        raise ValueError(f"inputs must be text, token ids (batch, pos) or a mapping with input_ids; got shape "
                         f"{tuple(ids.shape)}.")
    ids = ids.to(model.device)
    if mask is not None:
        mask = torch.as_tensor(mask).to(model.device).reshape(ids.shape)
        if bool(mask.all()):
            mask = None  # no padding: let the model take its unmasked path
    return {"input_ids": ids, "attention_mask": mask}


def _two_stack_batch(model, inputs) -> Batch:
    if not isinstance(inputs, Mapping) or inputs.get("input_ids") is None or inputs.get("decoder_input_ids") is None:
        got = f"a mapping with keys {sorted(inputs)}" if isinstance(inputs, Mapping) else type(inputs).__name__
        raise ValueError("An encoder-decoder study takes a batch {input_ids, attention_mask, decoder_input_ids, "
                         f"decoder_attention_mask}} (as copy_task(model) returns); got {got}. The teacher-forced "
                         "decoder inputs are the targets shifted right: model.decoder_inputs(labels).")
    batch = {k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    for ids, mask in (("input_ids", "attention_mask"), ("decoder_input_ids", "decoder_attention_mask")):
        batch[ids] = torch.as_tensor(batch[ids], device=model.device)
        batch.setdefault(mask, None)
        if batch[ids].ndim != 2 or batch[ids].numel() == 0:
            raise ValueError(f"{ids} must be token ids (batch, pos); got shape {tuple(batch[ids].shape)}.")
        if batch[mask] is not None:
            batch[mask] = torch.as_tensor(batch[mask], device=model.device)
            if batch[mask].shape != batch[ids].shape:
                raise ValueError(f"{mask} must have the shape of {ids} {tuple(batch[ids].shape)}; got "
                                 f"{tuple(batch[mask].shape)}.")
    if batch["decoder_input_ids"].shape[0] != batch["input_ids"].shape[0]:
        raise ValueError(f"input_ids and decoder_input_ids must have one row per example; got "
                         f"{batch['input_ids'].shape[0]} and {batch['decoder_input_ids'].shape[0]} rows.")
    return batch


def _main_output(output) -> torch.Tensor:
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if value is not None:
            return value
    if isinstance(output, torch.Tensor):
        return output
    raise TypeError(f"Expected a model output with logits or last_hidden_state; got {type(output).__name__}.")


def _mask(inputs: Batch) -> torch.Tensor:
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    return torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()


def check_position(position, n_pos: int, what: str = "position") -> int:
    """A position of the (padded) batch, Python-style: ``-n_pos <= position < n_pos`` (negative counts from the
    end); anything else, a float or a position past the end, is refused rather than wrapped around or truncated."""
    try:
        index = None if isinstance(position, bool) else operator.index(position)
    except TypeError:
        index = None
    if index is None or not -n_pos <= index < n_pos:
        raise ValueError(f"{what} must be an integer in [-{n_pos}, {n_pos}) (the batch has {n_pos} positions; "
                         f"-1 is the last); got {position!r}.")
    return index


def unpadded_rows(batch: Batch) -> list[dict]:
    """A padded batch as one dict of 1-D id tensors per row (``input_ids``, and ``decoder_input_ids`` where the batch
    has them), each entry cut to its real tokens."""
    rows = []
    for r in range(batch["input_ids"].shape[0]):
        row = {}
        for entry, mask_name in MASK_OF.items():
            if batch.get(entry) is not None:
                ids, mask = batch[entry][r].cpu(), batch.get(mask_name)
                row[entry] = ids if mask is None else ids[mask[r].cpu().bool()]
        rows.append(row)
    return rows
