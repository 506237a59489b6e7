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

from collections.abc import Iterable, Sequence
from contextlib import contextmanager

import pandas as pd
import torch

from hooks.names import hook_name
from interp.attention.sites import FRONT, all_heads, check_heads, head_columns, site_of

from ..data.batches import batch_of
from .engine import Shard, _arguments, copies_per_forward, kept_logits, scan
from ..data.metrics import as_metric

__all__ = ["Head", "METHODS", "ablate_heads", "ablation_scan", "all_heads", "check_heads"]

Head = tuple[int, int]
METHODS = ("zero", "mean", "resample")


def _check_method(method: str, reference) -> None:
    if method not in METHODS:
        raise ValueError(f"Unknown ablation method {method!r}; use one of {', '.join(METHODS)}.")
    if method != "zero" and reference is None:
        raise ValueError(f"{method} ablation needs reference inputs (reference=...): the batch whose head outputs "
                         f"{'are averaged' if method == 'mean' else 'replace the originals'}.")


class _Replacement:
    """What an ablated head's z becomes, per site: 0, its mean ``(h, e)`` over the real query positions of a
    reference batch (``site.query_mask``: the source's for encoder sites, the target's for decoder self- and
    cross-attention, whose z lives on the target), or its value on the reference position by position
    ``(b, p, h, e)``."""

    def __init__(self, model, method: str, reference=None, sites: Iterable[str] = ()):
        _check_method(method, reference)
        self.method, self.values = method, {}
        sites = list(dict.fromkeys(sites))
        if method == "zero" or not sites:
            return
        batch = batch_of(model, reference)
        args, kwargs = _arguments(batch)
        with model.studying(), torch.no_grad():
            _, cache = model.run_with_cache(*args, names=[hook_name("z", site) for site in sites], **kwargs)
        for site in sites:
            z = cache[hook_name("z", site)]  # (b, p, h, e)
            if method == "mean":
                mask = batch.get(model.sites[site].query_mask)
                weights = torch.ones(z.shape[:2]) if mask is None else mask  # z: on its layer's device
                weights = weights.to(device=z.device, dtype=z.dtype)
                z = (z * weights[:, :, None, None]).sum((0, 1)) / weights.sum()  # (h, e)
            self.values[site] = z

    def value(self, site: str, z: torch.Tensor, copies: int = 1) -> torch.Tensor:
        """A tensor broadcastable to ``z: (copies * b, p, h, e)``."""
        if self.method == "zero":
            return torch.zeros((), dtype=z.dtype, device=z.device)
        value = self.values[site].to(device=z.device, dtype=z.dtype)
        if self.method == "mean":
            return value
        if value.shape[0] * copies != z.shape[0] or value.shape[1:] != z.shape[1:]:
            raise ValueError(
                f"resample ablation replaces z position by position, so the reference inputs must have the shape "
                f"of the inputs: at {site} reference z is {tuple(value.shape)}, the model ran on "
                f"{(z.shape[0] // copies, *z.shape[1:])} (batch, pos, heads, d_head)."
            )
        return value.repeat(copies, 1, 1, 1) if copies > 1 else value


def _site_masks(model, groups: Sequence[Iterable]) -> dict[str, torch.Tensor]:
    """One boolean ``(len(groups), h)`` mask per site that any group touches: row i marks group i's heads."""
    masks: dict[str, torch.Tensor] = {}
    for row, heads in enumerate(groups):
        for head in heads:
            site = site_of(model, head)
            if site.name not in masks:
                masks[site.name] = torch.zeros(len(groups), site.n_heads, dtype=torch.bool)
            masks[site.name][row, head[1]] = True
    return masks


def _ablation_hooks(masks: dict[str, torch.Tensor], replacement: _Replacement, copies: int = 1) -> list:
    """Hooks on each site's hook_z that swap in the replacement where ``masks[site]: (rows, h)`` is True (rows: 1,
    the same heads in every sequence, or the number of copies, a different head per copy)."""

    def hook_for(site):
        def hook(z, point):
            mask = masks[site].to(z.device)  # (rows, h)
            if mask.shape[0] > 1:
                mask = mask.repeat_interleave(z.shape[0] // mask.shape[0], dim=0)
            return torch.where(mask[:, None, :, None], replacement.value(site, z, copies), z)
        return hook

    return [(hook_name("z", site), hook_for(site)) for site in masks]


@contextmanager
def ablate_heads(model, heads, method: str = "zero", reference=None):
    """Ablate ``heads`` inside a ``with`` block: ``(layer, head)`` or ``(site, head)`` pairs (``interp.attention.sites``).

    method: ``"zero"``, ``"mean"`` (mean over ``reference``'s real query positions) or ``"resample"`` (z on
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
    heads = check_heads(model, heads)
    replacement = _Replacement(model, method, reference, [site_of(model, head).name for head in heads])
    with model.hooks(_ablation_hooks(_site_masks(model, [heads]), replacement)):
        yield model


def ablation_scan(model, inputs, metric, method: str = "zero", heads=None, reference=None,
                  memory_budget: float | None = None, heads_per_forward: int | None = None, ablated=()) -> pd.DataFrame:
    """The effect of ablating each head alone: one row per head with the head's columns (``stack``, ``kind``,
    ``site``, ``layer``, ``head``: ``interp.attention.sites.FRONT``), ``metric``, ``delta`` (metric - baseline) and
    ``baseline`` (the metric with no head ablated). The same study and columns on every kind of model.

    inputs: text, token ids ``(b, p)`` or a mapping with ``input_ids``/``attention_mask`` (an encoder-decoder
    model: a batch with ``decoder_input_ids`` too, as ``analyses.data.seq2seq.copy_task`` returns; ``batch_of``).
    metric: ``metric(output, inputs) -> float`` (see ``analyses.data.metrics``), called once per head on that
    head's copy of the batch, exactly as a run with only that head ablated.
    heads: the heads to scan (default all). ablated: heads zero-ablated in every run, baseline included
    (e.g. heads pruned so far). memory_budget: bytes of activations one forward may use (an estimate; default
    1 GiB on CUDA, 16 MiB on CPU, see ``engine.copies_per_forward``); ``heads_per_forward`` overrides it (1 = one
    head per forward).

    Under torch.distributed (``torchrun``) each rank scans its share of the prompts (and of a resample
    reference; a mean reference is averaged whole on every rank) and the per-example values are combined, so every
    rank returns the one-process result. A metric that is not a mean over examples (a plain callable) cannot be
    split: the scan then runs whole on every rank (with a warning).
    """
    check_per_forward(heads_per_forward)
    metric = as_metric(metric)
    batch = batch_of(model, inputs)
    heads = all_heads(model) if heads is None else check_heads(model, heads)
    ablated = check_heads(model, ablated, allow_empty=True)
    with Shard(batch, metric) as shard:  # this rank's prompts under torch.distributed, else all of them
        batch, local = shard.rows(batch), shard.metric(metric)
        if method == "resample" and reference is not None:  # position by position: the same rows as the inputs
            reference = shard.rows(batch_of(model, reference))
        replacement = _Replacement(model, method, reference, [site_of(model, head).name for head in heads])
        zero = _Replacement(model, "zero")
        base = _site_masks(model, [ablated]) if ablated else {}
        kept = kept_logits(model, local, batch).get("logits_to_keep")  # what the scan's runs compute (engine.scan)
        per_forward = heads_per_forward or copies_per_forward(model, batch, memory_budget, kept)

        def hooks_for(group, copies):  # the zero-ablated heads first, then each copy's scanned head
            return (_ablation_hooks(base, zero, copies)
                    + _ablation_hooks(_site_masks(model, [[head] for head in group]), replacement, copies))

        baseline, values = scan(model, batch, heads, lambda head: site_of(model, head).block, hooks_for, local,
                                per_forward, _ablation_hooks(base, zero))
        baseline, *values = shard.means([baseline, *values])
    rows = [{**head_columns(model, head), "metric": value, "delta": value - baseline, "baseline": baseline}
            for head, value in zip(heads, values)]
    df = pd.DataFrame(rows, columns=[*FRONT, "metric", "delta", "baseline"])
    df.attrs.update(metric=metric.name, method=method)  # for plot titles
    return df


def _set_values(model, inputs, metric, sets: Sequence[Sequence[Head]], per_forward: int | None = None
                ) -> tuple[float, list[float]]:
    """The metric with no head ablated, and with each set of heads zero-ablated together: ``per_forward`` sets per
    forward (default: the memory budget's copies), each from its set's first layer on (``engine.scan``)."""
    metric, batch = as_metric(metric), batch_of(model, inputs)
    zero = _Replacement(model, "zero")
    with Shard(batch, metric) as shard:
        batch, local = shard.rows(batch), shard.metric(metric)
        kept = kept_logits(model, local, batch).get("logits_to_keep")
        baseline, values = scan(model, batch, list(sets), lambda heads: min(site_of(model, h).block for h in heads),
                                lambda group, copies: _ablation_hooks(_site_masks(model, group), zero, copies), local,
                                per_forward or copies_per_forward(model, batch, None, kept), desc=f"{len(sets)} sets")
        baseline, *values = shard.means([baseline, *values])
    return baseline, values


def check_per_forward(heads_per_forward) -> None:
    """``heads_per_forward`` of a scan: None (sized to the memory budget) or a positive integer."""
    if heads_per_forward is not None and (isinstance(heads_per_forward, bool) or not isinstance(heads_per_forward, int)
                                          or heads_per_forward < 1):
        raise ValueError("heads_per_forward is how many heads (copies of the batch) one forward runs: a positive "
                         f"integer, or None to size it to the memory budget; got {heads_per_forward!r}.")
