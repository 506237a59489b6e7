"""One batching engine for every scan: ablation scans, patching scans, and whatever comes next.

A scan runs the model once per *item* (a head to ablate, a head to patch, a head and position ...). Items share a
forward: the batch is replicated and copy ``i`` gets item ``i``'s hooks, as many copies per forward as a memory
budget allows (``copies_per_forward``). The blocks before an item's first layer are not recomputed: the clean
run's block outputs are replayed (``Prefix``), checked once per scan against a full forward.

Across processes (``Shard``): when torch.distributed is initialised, a study runs on this rank's rows of its batch
and combines the per-example metric values of every rank, so that each rank returns what one process computes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext

import torch
import torch.utils.checkpoint

from hooks.points import TORCH_HOOK_TABLES as _HOOK_TABLES
from interp.runtime import distributed
from interp.runtime.progress import progress

from ..data.batches import Batch, _main_output
from .finite import check_finite, finite_copies, warn_non_finite, watching
from ..data.metrics import Metric

__all__ = ["scan", "all_blocks", "copies_per_forward", "kept_logits", "recomputing", "slice_output", "Shard"]


def scan(model, batch: Batch, items: Sequence, first_layer: Callable[[object], int],
         hooks_for: Callable[[list, int], list], metric: Callable, per_forward: int,
         base_hooks: Sequence = (), desc: str | None = None) -> tuple[float, list[float]]:
    """The metric with ``base_hooks`` only (the baseline), then once per item.

    hooks_for(group, copies): the hooks of one forward over ``copies`` copies of the batch, copy ``i`` carrying
    ``group[i]``'s intervention (plus ``base_hooks``, applied in every run). first_layer(item): the first layer
    the item changes. metric(output, batch) -> float, called on each copy's slice of the output (first on the
    baseline's output). desc: the progress bar's label (default "N heads").
    Runs under ``model.studying()`` and ``torch.no_grad()``.

    Non-finite values (``analyses.causal.finite``): NaN anywhere in the baseline run is a ValueError naming its source;
    an item whose run gives a non-finite output gets NaN (whatever the metric made of it), with one warning.
    """
    values, broken = [], []
    keep = kept_logits(model, metric, batch)
    with model.studying(), torch.no_grad():
        prefix = Prefix(model)
        with model.hooks(list(base_hooks)), prefix.recording():
            with watching(model, "The baseline run (no intervention)"):
                output = _run(model, batch, **keep)
            check_finite(model, output, "The baseline run (no intervention)")
            baseline = metric(output, batch)
            del output
        nan = torch.full_like(baseline, float("nan")) if isinstance(baseline, torch.Tensor) else float("nan")
        b = batch["input_ids"].shape[0]
        starts, checked = range(0, len(items), per_forward), False
        for start in progress(starts, total=len(starts), desc=desc or f"{len(items)} heads", unit="forward"):
            group = list(items[start:start + per_forward])
            copies = len(group)
            first = min(first_layer(item) for item in group)
            with model.hooks(hooks_for(group, copies)):
                with prefix.replaying(first, copies):
                    output = _run(model, batch, copies, **keep)
                if first > 0 and prefix.enabled and not checked:  # the first group that replays: check it once
                    checked = True                                 # against a full forward
                    full = _run(model, batch, copies, **keep)
                    prefix.enabled = _same_output(output, full)
                    if not prefix.enabled:  # the replay is off for every later group, and this one's values
                        output = full       # come from the full forward too
            for item, finite, i in zip(group, finite_copies(output, copies), range(copies)):
                value = metric(slice_output(output, i * b, (i + 1) * b, copies * b), batch)  # called on each copy, in
                values.append(value if finite else nan)                                  # order (some metrics keep
                broken += [] if finite else [item]                                       # what they saw)
            del output
    warn_non_finite(broken)
    return baseline, values


def kept_logits(model, metric, batch: Batch) -> dict:
    """``{"logits_to_keep": k}`` for the model's runs when ``metric`` reads only the last k positions of a causal
    LM's logits (``Metric.trailing``): the output layer then runs on those only, the rest of the forward unchanged
    (SmolLM2's output layer is a fifth of its forward). Else ``{}``: the whole output, as before."""
    trailing = getattr(metric, "trailing", None)
    return logits_to_keep(model, batch, trailing(batch) if trailing is not None else None)


def logits_to_keep(model, batch: Batch, k: int | None) -> dict:
    """``{"logits_to_keep": k}`` where the model takes it and it leaves positions out, else ``{}``."""
    if not k or batch.get("decoder_input_ids") is not None or k >= batch["input_ids"].shape[1]:
        return {}
    return {"logits_to_keep": int(k)} if _takes_logits_to_keep(model.hf) else {}


def _takes_logits_to_keep(hf) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(hf.forward).parameters
    except (TypeError, ValueError):
        return False


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


def _arguments(batch: Batch, copies: int = 1) -> tuple[tuple, dict]:
    """``model(*args, **kwargs)`` for ``copies`` copies of a batch: the input ids and mask, and for an
    encoder-decoder batch (one with ``decoder_input_ids``) the decoder's ids and mask as keywords."""

    def repeat(x):
        return x if x is None or copies == 1 else x.repeat(copies, 1)

    kwargs = {}
    if batch.get("decoder_input_ids") is not None:
        kwargs = {"decoder_input_ids": repeat(batch["decoder_input_ids"]),
                  "decoder_attention_mask": repeat(batch.get("decoder_attention_mask"))}
    return (repeat(batch["input_ids"]), repeat(batch.get("attention_mask"))), kwargs


def _run(model, batch: Batch, copies: int = 1, **options):
    """The model on ``copies`` copies of a batch; ``options`` go to the HF forward (``kept_logits``)."""
    args, kwargs = _arguments(batch, copies)
    return model(*args, **kwargs, **options)


class Prefix:
    """The block outputs of one run, replayed instead of recomputed for the blocks before the first ablated layer:
    a head's ablation changes nothing before its layer, so a scan of layer l's heads only needs layers l.. again
    (half the work of a full scan on average). Exact: the replayed tensors are the ones those blocks computed."""

    def __init__(self, model):
        self.model, self.outputs = model, {}
        # an encoder-decoder model's blocks are two stacks (a dict): nothing is replayed there
        self.blocks = [] if isinstance(model._blocks, dict) else list(model._blocks)
        self.enabled = bool(self.blocks)

    @contextmanager
    def recording(self):
        def keep(layer):
            def hook(module, args, output):
                self.outputs[layer] = output
            return hook

        handles = [block.register_forward_hook(keep(l)) for l, block in enumerate(self.blocks)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def replaying(self, first_layer: int, copies: int):
        """Blocks 0..first_layer-1 return block first_layer-1's recorded output (only the last one is read).

        The recorded output is what the block's forward hooks left (ours, such as hook_resid_post, and any torch
        hook of the user's; the recording hook runs after them), so the skipped blocks' hooks must not run again
        on it: their hook tables are emptied for the replay and put back after, and a steering hook is applied
        once, as in a direct run."""
        skipped = self.blocks[:first_layer] if self.enabled else []
        # a block dispatched by accelerate (device_map) has its own forward on the instance: put it back after
        own = [block.__dict__.get("forward") for block in skipped]
        tables = [{name: getattr(block, name) for name in _HOOK_TABLES if hasattr(block, name)} for block in skipped]
        try:  # the blocks are changed inside the try: an interrupt while they are (Ctrl-C, a time limit's signal)
            if skipped:  # must not leave a block replaying a stale output in the user's model
                out = _repeat(self.outputs[first_layer - 1], copies, self.model.device)
                for block in skipped:
                    block.forward = lambda *args, **kwargs: out
                    for name in _HOOK_TABLES:
                        if hasattr(block, name):
                            setattr(block, name, type(getattr(block, name))())
            yield
        finally:
            _put_back(skipped, own)
            for block, table in zip(skipped, tables):
                for name, hooks in table.items():
                    setattr(block, name, hooks)


def all_blocks(model) -> list:
    """The model's blocks in the order they run (an encoder-decoder model's encoder stack, then its decoder's)."""
    return [b for stack in (model._blocks.values() if isinstance(model._blocks, dict) else [model._blocks])
            for b in stack]


@contextmanager
def recomputing(model, enabled: bool = True):
    """Each block of ``model`` keeps only its input for the backward and runs again when the backward reaches it
    (activation checkpointing, torch's non-reentrant ``checkpoint``): a forward with a gradient then holds the
    block inputs plus one block's activations, not every block's. The gradients are the same (the blocks run
    again on the same inputs, deterministically). What runs inside a block runs twice, its hooks too: a hook that
    only reads or edits gives the same values; one that counts its calls sees two."""
    blocks = all_blocks(model) if enabled else []
    own = [block.__dict__.get("forward") for block in blocks]  # accelerate's dispatch: put it back after

    def again(forward):
        def run(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return run

    try:  # changed inside the try: an interrupt must not leave a block checkpointed in the user's model
        for block in blocks:
            block.forward = again(block.forward)
        yield
    finally:
        _put_back(blocks, own)


def _put_back(blocks: list, own: list) -> None:
    """Each block's forward as it was: its class's (``own`` None) or the one on the instance (accelerate's)."""
    for block, forward in zip(blocks, own):
        if forward is None:
            block.__dict__.pop("forward", None)
        else:
            block.forward = forward


def _repeat(value, copies: int, device):
    if isinstance(value, torch.Tensor):
        return value.repeat(copies, *([1] * (value.ndim - 1))) if copies > 1 else value
    if isinstance(value, tuple):
        return type(value)(_repeat(v, copies, device) for v in value)
    return value


def copies_per_forward(model, batch: Batch, memory_budget: float | None, kept: int | None = None) -> int:
    """How many copies of the batch fit in ``memory_budget`` bytes of activations (an estimate).

    Per token: the output row (vocab logits or d_model) on the tokens the model outputs (the last input entry: the
    target of an encoder-decoder model; only the last ``kept`` positions of each row with ``kept_logits``), about 12 x d_model of layer activations alive at once (residual, q/k/v,
    z, MLP), and on the eager path one pattern row per head for each key sequence its sites read.
    Default budget: 1 GiB on CUDA, where one large forward beats many small ones; 16 MiB on CPU, where a
    forward is compute-bound beyond a few hundred tokens and larger batches only add memory traffic
    (measured in BENCHMARKS.md: batching pays there only for small forwards).
    """
    if memory_budget is None:
        memory_budget = 2**30 if model.device.type == "cuda" else 16 * 2**20
    cfg = model.cfg
    has_head = getattr(model.hf, "get_output_embeddings", lambda: None)() is not None
    entries = list(dict.fromkeys(s.queries for s in cfg.sites))  # input_ids, then decoder_input_ids if any
    heads = max(s.n_heads for s in cfg.sites)
    per_copy = 0
    for entry in entries:
        b, p = batch[entry].shape
        per_token = 12 * cfg.d_model
        if model.attn == "eager":
            keys = {s.keys for s in cfg.sites if s.queries == entry}
            per_token += 2 * heads * sum(batch[k].shape[1] for k in keys)
        out = (cfg.vocab_size if has_head else cfg.d_model) if entry == entries[-1] else 0
        per_copy += b * p * per_token + b * min(p, kept or p) * out
    return max(1, int(memory_budget // (per_copy * torch.finfo(model.dtype).bits // 8)))


# -- across processes ------------------------------------------------------------------------------------------
def _mean_of_examples(metric) -> bool:
    """Whether ``metric(output, batch)`` is the mean of ``metric.per_example(output, batch)``, so that the values of
    disjoint rows combine exactly: true of ``analyses.data.metrics``' metrics, false of a plain callable (any function of
    the whole batch)."""
    metric = getattr(metric, "inner", metric)  # patching's scalar_metric wrapper
    return isinstance(metric, Metric) and type(metric).__call__ is Metric.__call__


def _fingerprint(batch: Batch) -> list[int]:
    """Shape, a position-weighted checksum of the ids and the number of real tokens: equal on every rank that has
    the same batch."""
    ids = batch["input_ids"].long().cpu()
    mask = batch["attention_mask"]
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.long).reshape(ids.shape) % 1_000_003
    return [*ids.shape, int((ids * weights).sum()), -1 if mask is None else int(mask.long().sum())]


def take_rows(batch: Batch, index: torch.Tensor) -> Batch:
    """Rows ``index`` of a batch: every per-row tensor (input ids and mask; an encoder-decoder batch's decoder ids,
    mask and labels too) indexed, anything else as it is."""
    n = batch["input_ids"].shape[0]
    index = index.to(batch["input_ids"].device)
    return {key: value[index] if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == n else value
            for key, value in batch.items()}


class _Local(Metric):
    """A metric on one rank's rows: calling it gives their per-example values (b_rank,), which ``Shard.means``
    combines with the other ranks' into the mean one process computes."""

    def __init__(self, metric: Metric):
        self.metric, self.name, self.higher_is_better = metric, metric.name, metric.higher_is_better

    def per_example(self, output, inputs: Batch) -> torch.Tensor:
        return self.metric.per_example(output, inputs)

    def loss(self, output, inputs: Batch) -> torch.Tensor:
        return self.metric.loss(output, inputs)

    def trailing(self, inputs: Batch) -> int | None:
        return self.metric.trailing(inputs)

    def __call__(self, output, inputs: Batch) -> torch.Tensor:
        return self.metric.per_example(output, inputs).float()


class Shard:
    """This process's part of a study's batch when torch.distributed is initialised, else the whole batch.

    A study builds ``Shard(batch, metric)``, runs inside ``with shard:`` on ``shard.rows(batch)`` with
    ``shard.metric(metric)``, and turns what the metric returned into numbers with ``shard.means(values)``:

    - one process (or a metric that is not a mean over examples, which cannot be split exactly: such a study runs
      whole on every rank, with a warning): ``index`` is None, ``rows`` and ``metric`` return their argument, the
      metric returns floats and ``means`` passes them through; nothing changes.
    - sharded: ``index`` holds this rank's rows (contiguous, ``interp.runtime.distributed.shard``), the metric returns each
      row's value and ``means`` gathers every rank's rows in the original order and takes the float32 mean as
      ``Metric.__call__`` does, so every rank gets the single-process numbers (up to the batch-size dependence of
      the kernels, about 1e-7). ``with shard:`` makes an error on one rank reach every rank.

    Every rank must pass the same batch (checked with a fingerprint).
    """

    def __init__(self, batch: Batch, metric=None):
        self.n = batch["input_ids"].shape[0]
        self.index = None
        if not distributed.initialised():
            return
        distributed.check_same(_fingerprint(batch), "inputs")
        if metric is not None and not _mean_of_examples(metric):
            distributed.warn_once(f"metric {getattr(metric, 'name', metric)!r} is not a mean of per-example values "
                                  "(use one from analyses.data.metrics, or a Metric subclass), so it cannot be split across "
                                  "ranks exactly: the study runs whole on every rank.")
            return
        self.index = distributed.shard(self.n)

    def __enter__(self) -> Shard:
        self._together = distributed.failing_together() if self.index is not None else nullcontext()
        self._together.__enter__()
        return self

    def __exit__(self, *exc):
        return self._together.__exit__(*exc)

    def rows(self, batch: Batch | None) -> Batch | None:
        """This rank's rows of a batch of the study's size (inputs, their corrupted or reference twins)."""
        if self.index is None or batch is None:
            return batch
        return take_rows(batch, self.index)

    def metric(self, metric: Metric) -> Metric:
        """The metric on this rank's rows (``Metric.rows``), giving per-example values when sharded."""
        return metric if self.index is None else _Local(metric.rows(self.index))

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """Per-row values ``(b_rank, ...)`` of this rank -> ``(n, ...)`` of all rows in order (unchanged unsharded)."""
        return values if self.index is None else distributed.gather_rows(values, self.index, self.n)

    def means(self, values: Sequence) -> list[float]:
        """What the study's metric returned, as floats: unchanged in one process; sharded, each entry holds this
        rank's per-example values and becomes the mean over every rank's rows (one collective for all)."""
        if self.index is None:
            return [float(v) for v in values]
        table = self.gather(torch.stack([torch.as_tensor(v).float().cpu() for v in values], dim=1))  # (n, k)
        return [float(column.mean()) for column in table.T.contiguous()]
