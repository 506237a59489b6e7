"""Head ablation: replace heads' outputs (their slice of ``hook_z``) and measure what changes.

- **zero**: the head's output is 0 (what structural pruning gives).
- **mean**: its mean over the real tokens of a reference batch (Wang et al. 2022, IOI).
- **resample**: its value on other inputs, position by position (Chan et al. 2022, causal scrubbing).

The edit happens inside the forward pass through ``hook_z`` (before the output projection), so it works
on both attention paths and for grouped-query attention. Nothing on the model changes: hooks live only
for the duration of a ``with`` block or a study, and are removed also when it raises.

``ablation_scan`` ablates every head alone in few forward passes: the batch is replicated, and copy ``i``
ablates head ``i``, as many copies per forward as a memory budget allows.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from contextlib import contextmanager

import pandas as pd
import torch

from .engine import Shard, copies_per_forward, scan
from .metrics import as_metric, batch_of

__all__ = ["Head", "METHODS", "ablate_heads", "ablation_scan", "all_heads", "check_heads"]

Head = tuple[int, int]
METHODS = ("zero", "mean", "resample")


def all_heads(model) -> list[Head]:
    """Every ``(layer, head)`` of the model, layer by layer (a pruned model's own head numbers; the placeholder
    of a layer that lost every head is not a head)."""
    return model.cfg.heads()


def _is_index(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_heads(model, heads, allow_empty: bool = False, kv: bool = False) -> list[Head]:
    """``heads`` as a sorted list of ``(layer, head)`` pairs of integers; clear errors for anything else.

    Only integers are layer and head numbers (Python or NumPy ints, not bools, floats or strings): a float
    such as 1.9 would otherwise be truncated to another head. kv: the pairs name key/value heads (what k and v
    patching address), checked against each layer's key/value head count.
    """
    if isinstance(heads, tuple) and len(heads) == 2 and all(_is_index(x) for x in heads):
        heads = [heads]
    form = "heads must be (layer, head) pairs of integers, e.g. [(0, 1), (1, 3)]"
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Iterable):
        raise ValueError(f"{form}; got {heads!r}.")
    pairs = []
    for pair in heads:
        if not (isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2
                and all(_is_index(x) for x in pair)):
            raise ValueError(f"{form}; got {pair!r} in {heads!r}.")
        pairs.append((int(pair[0]), int(pair[1])))
    if not pairs and not allow_empty:
        raise ValueError("The head list is empty; give at least one (layer, head) pair.")
    cfg = model.cfg
    counts = cfg.kv_heads_per_layer if kv else cfg.heads_per_layer
    for l, h in pairs:
        if not 0 <= l < len(counts):
            raise ValueError(f"Layer {l} is out of range in {(l, h)}: layers run 0..{len(counts) - 1}.")
        if l in cfg.empty_layers:
            raise ValueError(f"Layer {l} has no heads left (it was pruned empty), so {(l, h)} is not a head.")
        if not 0 <= h < counts[l] and kv:
            group = cfg.heads_per_layer[l] // max(1, counts[l])
            raise ValueError(f"Key/value head {h} is out of range in {(l, h)}: k and v are patched per key/value "
                             f"head, and layer {l} has {counts[l]} (0..{counts[l] - 1}), each serving {group} query "
                             f"heads (query head q reads key/value head q // {group}).")
        if not 0 <= h < counts[l]:
            raise ValueError(f"Head {h} is out of range in {(l, h)}: layer {l} has heads 0..{counts[l] - 1}.")
    return sorted(set(pairs))


def _check_method(method: str, reference) -> None:
    if method not in METHODS:
        raise ValueError(f"Unknown ablation method {method!r}; use one of {', '.join(METHODS)}.")
    if method != "zero" and reference is None:
        raise ValueError(f"{method} ablation needs reference inputs (reference=...): the batch whose head outputs "
                         f"{'are averaged' if method == 'mean' else 'replace the originals'}.")


def _z_names(model) -> list[str]:
    return [f"blocks.{l}.attn.hook_z" for l in range(model.cfg.n_layers)]


class _Replacement:
    """What an ablated head's z becomes, per layer: 0, a mean ``(h, d)``, or z on other inputs ``(b, p, h, d)``."""

    def __init__(self, model, method: str, reference=None):
        _check_method(method, reference)
        self.method, self.values = method, {}
        if method == "zero":
            return
        batch = batch_of(model, reference)
        with model.studying(), torch.no_grad():
            _, cache = model.run_with_cache(batch["input_ids"], batch["attention_mask"], names=_z_names(model))
        for layer in range(model.cfg.n_layers):
            z = cache["z", layer]  # (b, p, h, d)
            if method == "mean":
                weights = torch.ones(z.shape[:2], dtype=z.dtype, device=z.device)
                if batch["attention_mask"] is not None:
                    weights = batch["attention_mask"].to(device=z.device, dtype=z.dtype)  # z: on its layer's device
                z = (z * weights[:, :, None, None]).sum((0, 1)) / weights.sum()  # (h, d)
            self.values[layer] = z

    def value(self, layer: int, z: torch.Tensor, copies: int = 1) -> torch.Tensor:
        """A tensor broadcastable to ``z: (copies * b, p, h, d)``."""
        if self.method == "zero":
            return torch.zeros((), dtype=z.dtype, device=z.device)
        value = self.values[layer].to(z.dtype)
        if self.method == "mean":
            return value
        if value.shape[0] * copies != z.shape[0] or value.shape[1:] != z.shape[1:]:
            raise ValueError(
                f"resample ablation replaces z position by position, so the reference inputs must have the shape "
                f"of the inputs: reference z is {tuple(value.shape)}, the model ran on "
                f"{(z.shape[0] // copies, *z.shape[1:])} (batch, pos, heads, d_head)."
            )
        return value.repeat(copies, 1, 1, 1) if copies > 1 else value


def _ablation_hooks(model, masks: dict[int, torch.Tensor], replacement: _Replacement, copies: int = 1):
    """Hooks on hook_z that swap in the replacement where ``masks[layer]: (rows, h)`` is True.

    rows is 1 (the same heads in every sequence) or the batch size (a different head per copy)."""

    def hook(z, point):
        mask = masks[point.layer].to(z.device)  # (rows, h)
        if mask.shape[0] > 1:
            mask = mask.repeat_interleave(z.shape[0] // mask.shape[0], dim=0)
        return torch.where(mask[:, None, :, None], replacement.value(point.layer, z, copies), z)

    return [(f"blocks.{layer}.attn.hook_z", hook) for layer in sorted(masks)]


def _head_masks(model, groups: Sequence[Iterable[Head]]) -> dict[int, torch.Tensor]:
    """One boolean ``(len(groups), h)`` mask per layer that any group touches: row i marks group i's heads."""
    masks: dict[int, torch.Tensor] = {}
    for row, heads in enumerate(groups):
        for l, h in heads:
            if l not in masks:
                masks[l] = torch.zeros(len(groups), model.cfg.heads_per_layer[l], dtype=torch.bool)
            masks[l][row, h] = True
    return masks


@contextmanager
def ablate_heads(model, heads, method: str = "zero", reference=None):
    """Ablate ``heads`` (``(layer, head)`` pairs) inside a ``with`` block.

    method: ``"zero"``, ``"mean"`` (mean over ``reference``'s real tokens) or ``"resample"`` (z on
    ``reference``, which must have the shape of the inputs the model then runs on). On exit, also after an
    exception, the model is exactly as before.

    >>> import interp, torch
    >>> model = interp.load_model("toy-induction")
    >>> x = torch.randint(1, 64, (1, 20))
    >>> tokens = torch.cat([torch.zeros(1, 1, dtype=torch.long), x, x], dim=1)  # [BOS, x, x]
    >>> with ablate_heads(model, [(1, 0), (1, 1), (1, 3)]):  # the induction heads
    ...     ablated = model(tokens, labels=tokens).loss.item()
    >>> ablated > model(tokens, labels=tokens).loss.item() + 1.0
    True
    """
    if getattr(model, "sites", None) is not None:  # an encoder-decoder model: heads are (site, head) pairs
        from .seq2seq import ablate_seq2seq_heads

        with ablate_seq2seq_heads(model, heads, method, reference):
            yield model
        return
    heads = check_heads(model, heads)
    replacement = _Replacement(model, method, reference)
    with model.hooks(_ablation_hooks(model, _head_masks(model, [heads]), replacement)):
        yield model


def ablation_scan(model, inputs, metric, method: str = "zero", heads=None, reference=None,
                  memory_budget: float | None = None, heads_per_forward: int | None = None, ablated=()) -> pd.DataFrame:
    """The effect of ablating each head alone: one row per head with ``layer``, ``head``, ``metric``,
    ``delta`` (metric - baseline) and ``baseline`` (the metric with no head ablated).

    inputs: text, token ids ``(b, p)`` or a mapping with ``input_ids``/``attention_mask``.
    metric: ``metric(output, inputs) -> float`` (see ``analyses.metrics``), called once per head on that
    head's copy of the batch, exactly as a run with only that head ablated.
    heads: the heads to scan (default all). ablated: heads zero-ablated in every run, baseline included
    (e.g. heads pruned so far). memory_budget: bytes of activations one forward may use (an estimate; default
    1 GiB on CUDA, 16 MiB on CPU, see ``engine.copies_per_forward``); ``heads_per_forward`` overrides it (1 = one
    head per forward).

    Under torch.distributed (``torchrun``) each rank scans its share of the prompts (and of a resample
    reference; a mean reference is averaged whole on every rank) and the per-example values are combined, so every
    rank returns the one-process result. A metric that is not a mean over examples (a plain callable) cannot be
    split: the scan then runs whole on every rank (with a warning).

    An encoder-decoder model (``interp.seq2seq``) is scanned per attention site, heads as ``(site, head)`` pairs:
    see ``analyses.seq2seq.seq2seq_ablation_scan``.
    """
    from .seq2seq import is_seq2seq

    check_per_forward(heads_per_forward)

    if is_seq2seq(model):
        from .seq2seq import seq2seq_ablation_scan

        return seq2seq_ablation_scan(model, inputs, metric, method=method, heads=heads, reference=reference,
                                     memory_budget=memory_budget, heads_per_forward=heads_per_forward, ablated=ablated)
    metric = as_metric(metric)
    batch = batch_of(model, inputs)
    heads = all_heads(model) if heads is None else check_heads(model, heads)
    ablated = check_heads(model, ablated, allow_empty=True)
    with Shard(batch, metric) as shard:  # this rank's prompts under torch.distributed, else all of them
        batch, local = shard.rows(batch), shard.metric(metric)
        if method == "resample" and reference is not None:  # position by position: the same rows as the inputs
            reference = shard.rows(batch_of(model, reference))
        baseline, values = _scan(model, batch, local, method, heads, reference, memory_budget, heads_per_forward,
                                 ablated)
        baseline, *values = shard.means([baseline, *values])
    rows = [{"layer": layer, "head": head, "metric": value, "delta": value - baseline, "baseline": baseline}
            for (layer, head), value in zip(heads, values)]
    df = pd.DataFrame(rows, columns=["layer", "head", "metric", "delta", "baseline"])
    df.attrs.update(metric=metric.name, method=method)  # for plot titles
    return df


def check_per_forward(heads_per_forward) -> None:
    """``heads_per_forward`` of a scan: None (sized to the memory budget) or a positive integer."""
    if heads_per_forward is not None and (isinstance(heads_per_forward, bool) or not isinstance(heads_per_forward, int)
                                          or heads_per_forward < 1):
        raise ValueError("heads_per_forward is how many heads (copies of the batch) one forward runs: a positive "
                         f"integer, or None to size it to the memory budget; got {heads_per_forward!r}.")


def _scan(model, batch, metric, method, heads, reference, memory_budget, heads_per_forward, ablated):
    replacement = _Replacement(model, method, reference)
    zero = _Replacement(model, "zero")
    if heads_per_forward is None:
        heads_per_forward = copies_per_forward(model, batch, memory_budget)
    base = _head_masks(model, [ablated]) if ablated else {}

    def hooks_for(group, copies):
        hooks = _ablation_hooks(model, base, zero, copies) if ablated else []  # zero first, then the scanned head
        return hooks + _ablation_hooks(model, _head_masks(model, [[head] for head in group]), replacement, copies)

    return scan(model, batch, heads, lambda head: head[0], hooks_for, metric, heads_per_forward,
                _ablation_hooks(model, base, zero) if ablated else [])
