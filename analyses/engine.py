"""One batching engine for every scan: ablation scans, patching scans, and whatever comes next.

A scan runs the model once per *item* (a head to ablate, a head to patch, a head and position ...). Items share a
forward: the batch is replicated and copy ``i`` gets item ``i``'s hooks, as many copies per forward as a memory
budget allows (``copies_per_forward``). The blocks before an item's first layer are not recomputed: the clean
run's block outputs are replayed (``Prefix``), checked once per scan against a full forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch

from .metrics import Batch, _main_output

__all__ = ["scan", "copies_per_forward", "slice_output"]


def scan(model, batch: Batch, items: Sequence, first_layer: Callable[[object], int],
         hooks_for: Callable[[list, int], list], metric: Callable, per_forward: int,
         base_hooks: Sequence = ()) -> tuple[float, list[float]]:
    """The metric with ``base_hooks`` only (the baseline), then once per item.

    hooks_for(group, copies): the hooks of one forward over ``copies`` copies of the batch, copy ``i`` carrying
    ``group[i]``'s intervention (plus ``base_hooks``, applied in every run). first_layer(item): the first layer
    the item changes. metric(output, batch) -> float, called on each copy's slice of the output.
    Runs under ``model.studying()`` and ``torch.no_grad()``.
    """
    values = []
    with model.studying(), torch.no_grad():
        prefix = Prefix(model)
        with model.hooks(list(base_hooks)), prefix.recording():
            baseline = metric(_run(model, batch), batch)
        b = batch["input_ids"].shape[0]
        for start in range(0, len(items), per_forward):
            group = list(items[start:start + per_forward])
            copies = len(group)
            first = min(first_layer(item) for item in group)
            with model.hooks(hooks_for(group, copies)):
                with prefix.replaying(first, copies):
                    output = _run(model, batch, copies)
                if start == 0 and first > 0:  # check the replay once against a full forward
                    prefix.enabled = _same_output(output, _run(model, batch, copies))
            values += [metric(slice_output(output, i * b, (i + 1) * b, copies * b), batch) for i in range(copies)]
            del output
    return baseline, values


def _same_output(a, b, tol: float = 1e-5) -> bool:
    """Whether two model outputs agree (their main tensor) within ``tol`` relative to its size."""
    x, y = _main_output(a).float(), _main_output(b).float()
    return bool((x - y).abs().max() <= tol * max(1.0, float(y.abs().max())))


def slice_output(output, start: int, stop: int, total: int):
    """Rows ``start:stop`` of every batch-sized tensor in a model output (tuples of tensors included)."""

    def cut(value):
        if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == total:
            return value[start:stop]
        if isinstance(value, tuple):
            return tuple(cut(v) for v in value)
        return value

    if isinstance(output, torch.Tensor):
        return cut(output)
    return type(output)(**{k: cut(v) for k, v in output.items()})


def _run(model, batch: Batch, copies: int = 1):
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if copies > 1:
        ids = ids.repeat(copies, 1)
        mask = None if mask is None else mask.repeat(copies, 1)
    return model(ids, mask)


class Prefix:
    """The block outputs of one run, replayed instead of recomputed for the blocks before the first ablated layer:
    a head's ablation changes nothing before its layer, so a scan of layer l's heads only needs layers l.. again
    (half the work of a full scan on average). Exact: the replayed tensors are the ones those blocks computed."""

    def __init__(self, model):
        self.model, self.outputs = model, {}
        self.enabled = True

    @contextmanager
    def recording(self):
        def keep(layer):
            def hook(module, args, output):
                self.outputs[layer] = output
            return hook

        handles = [block.register_forward_hook(keep(l)) for l, block in enumerate(self.model._blocks)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def replaying(self, first_layer: int, copies: int):
        """Blocks 0..first_layer-1 return block first_layer-1's recorded output (only the last one is read)."""
        skipped = list(self.model._blocks[:first_layer]) if self.enabled else []
        if skipped:
            out = _repeat(self.outputs[first_layer - 1], copies, self.model.device)
            for block in skipped:
                block.forward = lambda *args, **kwargs: out
        try:
            yield
        finally:
            for block in skipped:
                block.__dict__.pop("forward", None)


def _repeat(value, copies: int, device):
    if isinstance(value, torch.Tensor):
        return value.repeat(copies, *([1] * (value.ndim - 1))) if copies > 1 else value
    if isinstance(value, tuple):
        return type(value)(_repeat(v, copies, device) for v in value)
    return value


def copies_per_forward(model, batch: Batch, memory_budget: float | None) -> int:
    """How many copies of the batch fit in ``memory_budget`` bytes of activations (an estimate).

    Per token: the output row (vocab logits or d_model), about 12 x d_model of layer activations alive at once
    (residual, q/k/v, z, MLP), and on the eager path one row of the n x n pattern per head.
    Default budget: 1 GiB on CUDA, where one large forward beats many small ones; 16 MiB on CPU, where a
    forward is compute-bound beyond a few hundred tokens and larger batches only add memory traffic
    (measured in BENCHMARKS.md: batching pays there only for small forwards).
    """
    if memory_budget is None:
        memory_budget = 2**30 if model.device.type == "cuda" else 16 * 2**20
    b, p = batch["input_ids"].shape
    cfg = model.cfg
    has_head = getattr(model.hf, "get_output_embeddings", lambda: None)() is not None
    per_token = (cfg.vocab_size if has_head else cfg.d_model) + 12 * cfg.d_model
    if model.attn == "eager":
        per_token += 2 * max(cfg.heads_per_layer) * p
    per_copy = b * p * per_token * torch.finfo(model.dtype).bits // 8
    return max(1, int(memory_budget // per_copy))


