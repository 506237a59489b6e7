"""Activation patching and path patching: what a head's activation on a clean input does when it is put into a run
on a corrupted input.

- ``activation_patching`` (Meng et al. 2022; Wang et al. 2022): run the corrupted input with one head's
  activation (its slice of ``hook_z``, or of q, k, v or the pattern) taken from the clean run. Every head (or
  head and position) alone, several per forward through the shared engine (``analyses.causal.engine``).
- ``path_patching`` (Wang et al. 2022; Goldowsky-Dill et al. 2023): the effect of a sender head only through
  chosen receiver heads' q, k or v. The receivers' inputs are recomputed in a run where the sender's output is
  clean and every other head's output is frozen at its corrupted value (MLPs recompute); the metric is read in
  a corrupted run where only the receivers' q, k or v are replaced by those.

Both return ``metric`` (the raw metric with the patch) and ``effect = (patched - corrupted) / (clean -
corrupted)``: 0 is the corrupted run, 1 the clean one. The metric is taken over the whole batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd
import torch

from hooks.names import hook_name
from interp.model.config import real_sites
from interp.attention.sites import FRONT, MASK_OF, check_heads, head_columns, is_layered, site_of

from .ablation import check_per_forward
from .engine import (Prefix, Shard, _arguments, _run, copies_per_forward, kept_logits, logits_to_keep, scan,
                     slice_output)
from .finite import check_finite, finite_copies, warn_non_finite, watching
from ..data.batches import Batch, _main_output, batch_of
from ..data.metrics import Metric, as_metric

__all__ = ["WHAT", "activation_patching", "path_patching", "paired_batches", "scalar_metric"]

WHAT = ("z", "q", "k", "v", "pattern")
# the axes of each activation: (head axis, position axis) in the tensor its hook receives
_AXES = {"z": (2, 1), "q": (2, 1), "k": (2, 1), "v": (2, 1), "pattern": (1, 2)}


def paired_batches(model, clean, corrupted) -> tuple[Batch, Batch]:
    """Clean and corrupted inputs as batches of the same shapes (position i of one stands for position i of the
    other; source and target for an encoder-decoder model) and the same padding."""
    clean, corrupted = batch_of(model, clean), batch_of(model, corrupted)
    for ids, mask in MASK_OF.items():
        if ids not in clean:
            continue
        a, b = clean[ids], corrupted[ids]
        if a.shape != b.shape:
            raise ValueError(f"clean and corrupted {ids} must have the same shape (batch, pos), so that each position "
                             f"of one patches the same position of the other; got {tuple(a.shape)} and "
                             f"{tuple(b.shape)}. Pad or trim them to the same length.")
        ma, mb = clean.get(mask), corrupted.get(mask)
        ma = None if ma is None or bool(ma.all()) else ma
        mb = None if mb is None or bool(mb.all()) else mb
        if (ma is None) != (mb is None) or ma is not None and not torch.equal(ma, mb):
            raise ValueError(f"clean and corrupted inputs must have the same padding ({mask}).")
    return clean, corrupted


class _Scalar(Metric):
    """A metric whose value must be one finite number: a clear error instead of a silent mean."""

    def __init__(self, inner: Metric):
        self.inner, self.name, self.higher_is_better = inner, inner.name, inner.higher_is_better

    def per_example(self, output, inputs):
        return self.inner.per_example(output, inputs)

    def loss(self, output, inputs):
        return self.inner.loss(output, inputs)

    def trailing(self, inputs) -> int | None:
        return self.inner.trailing(inputs)

    def rows(self, index) -> Metric:
        return _Scalar(self.inner.rows(index))

    def __call__(self, output, inputs) -> float:
        try:
            value = self.inner(output, inputs)
        except (ValueError, RuntimeError, TypeError) as err:
            if "one element" in str(err) or "converted to Python scalars" in str(err):
                raise ValueError(f"metric {self.name!r} must return one number (a float or a 0-d tensor); it "
                                 "returned several. Reduce it, e.g. with .mean().") from None
            raise
        if not math.isfinite(value) and _finite_output(output):  # a non-finite output: the study reports it
            raise ValueError(f"metric {self.name!r} returned {value}; it must be a finite number.")
        return value


def _finite_output(output) -> bool:
    """Whether a model output's main tensor is finite (True for anything else, such as the model itself)."""
    try:
        return bool(torch.isfinite(_main_output(output)).all())
    except TypeError:
        return True


def scalar_metric(metric) -> Metric:
    """``metric`` as a ``Metric`` whose calls must give one finite number."""
    return _Scalar(as_metric(metric))


def _items(model, what: str, by: str, heads, batch: Batch) -> list[tuple]:
    """What one patching run patches: ``(site, head[, pos])`` (key/value heads for k and v); ``pos`` runs over the
    site's query positions, or its key positions for k and v (source positions in cross-attention)."""
    if by not in ("head", "head_pos"):
        raise ValueError(f"by must be 'head' or 'head_pos'; got {by!r}.")
    kv = what in ("k", "v")  # one key/value head serves several query heads
    if heads is not None:
        units = [(site_of(model, u).name, u[1]) for u in check_heads(model, heads, kv=kv)]
    else:  # every head (key/value head) of every site that has real heads (not a layer pruned empty)
        units = [(s.name, g) for s in real_sites(model) for g in range(s.n_kv_heads if kv else s.n_heads)]
    if by == "head":
        return units
    entry = {name: batch[(model.sites[name].keys if kv else model.sites[name].queries)].shape[1]
             for name in dict.fromkeys(site for site, _ in units)}
    return [(site, h, p) for site, h in units for p in range(entry[site])]


def _patch_hooks(what: str, group: list[tuple], clean: dict, copies: int) -> list:
    """Hooks that put ``clean[layer]`` into copy i's slice for ``group[i]`` (a (layer, head[, pos]) item, or a
    (site, head[, pos]) one: ``hook_name`` names the hook of either)."""
    head_axis, pos_axis = _AXES[what]
    by_layer: dict[int, list[tuple[int, tuple]]] = {}
    for i, item in enumerate(group):
        by_layer.setdefault(item[0], []).append((i, item))

    def hook_for(layer, entries):
        def hook(act, point):  # z, q, k, v: (n, p, h, d); pattern: (n, h, q, k)
            b = act.shape[0] // copies
            mask = torch.zeros(*act.shape[:3], 1, dtype=torch.bool, device=act.device)
            for i, item in entries:
                index = [slice(i * b, (i + 1) * b), slice(None), slice(None)]
                index[head_axis] = item[1]
                if len(item) == 3:
                    index[pos_axis] = item[2]
                mask[tuple(index)] = True
            source = clean[layer].to(act.dtype).repeat(copies, *([1] * (act.ndim - 1)))
            return torch.where(mask, source, act)

        return hook

    return [(hook_name(what, layer), hook_for(layer, entries)) for layer, entries in by_layer.items()]


def activation_patching(model, clean, corrupted, metric, by: str = "head", what: str = "z", heads=None,
                        memory_budget: float | None = None, heads_per_forward: int | None = None) -> pd.DataFrame:
    """Patch each head's clean activation into the corrupted run, one head (or head and position) at a time.

    clean, corrupted: inputs of the same shape (text, token ids ``(b, p)`` or a mapping with ``input_ids``);
    position i of the clean input stands for position i of the corrupted one. metric: ``metric(output, inputs)
    -> float`` over the whole batch (``analyses.data.metrics``, e.g. ``logit_difference``). by: ``"head"`` or
    ``"head_pos"``. what: ``"z"`` (the head's output, default), ``"q"``, ``"k"``, ``"v"`` (for k and v the rows
    are key/value heads, each serving several query heads under GQA) or ``"pattern"`` (eager path only).
    heads: the heads to patch (default all). memory_budget, heads_per_forward: as in ``ablation_scan``.

    Returns one row per head (and position): the head's columns (``stack``, ``kind``, ``site``, ``layer``,
    ``head``), ``pos`` (a query position; a key position for k and v, a source position for cross-attention
    keys), ``metric``, ``effect``; ``df.attrs`` holds the clean and corrupted metric values.

    Every kind of model: an encoder-decoder model's batches hold ``decoder_input_ids`` too (a corrupted source
    changes encoder and cross-attention heads, a corrupted target decoder heads); the metric is taken on the
    corrupted batch, so give it fixed targets (``target_loss(clean["labels"])``) when the labels differ.

    Under torch.distributed (``torchrun``) each rank patches its share of the prompts and the per-example metric
    values are combined, so every rank returns the one-process result; this needs a metric that is a mean over
    examples (``analyses.data.metrics``). Any other metric is a function of the whole batch, which cannot be split: the
    study then runs whole on every rank (with a warning).

    """
    check_per_forward(heads_per_forward)
    if what not in WHAT:
        raise ValueError(f"what must be one of {', '.join(WHAT)}; got {what!r}.")
    if what == "pattern" and model.attn != "eager":
        raise ValueError("Patching patterns needs the eager path (the flash path never builds them): call "
                         "model.set_attn('eager') first, or patch 'q' and 'k'.")
    metric = scalar_metric(metric)
    clean, corrupted = paired_batches(model, clean, corrupted)
    items = _items(model, what, by, heads, clean)
    names = [hook_name(what, site) for site in dict.fromkeys(item[0] for item in items)]
    with Shard(corrupted, metric) as shard:  # this rank's prompts under torch.distributed, else all of them
        clean, corrupted, local = shard.rows(clean), shard.rows(corrupted), shard.metric(metric)
        keep = kept_logits(model, local, clean)  # the logits the metric reads, and no others
        with model.studying(), torch.no_grad():
            args, kwargs = _arguments(clean)
            with watching(model, "The clean run"):
                output, cache = model.run_with_cache(*args, names=names, **kwargs, **keep)
            check_finite(model, output, "The clean run")
            clean_value = local(output, clean)
        sources = {name.rsplit(".", 1)[0]: cache[name] for name in names}
        if heads_per_forward is None:
            heads_per_forward = copies_per_forward(model, corrupted, memory_budget, keep.get("logits_to_keep"))
        corrupted_value, values = scan(
            model, corrupted, items, lambda item: model.sites[item[0]].block,
            lambda group, copies: _patch_hooks(what, group, sources, copies),
            local, heads_per_forward)
        clean_value, corrupted_value, *values = shard.means([clean_value, corrupted_value, *values])
    return _frame(model, items, values, clean_value, corrupted_value, metric, by, what)


def _frame(model, items, values, clean_value, corrupted_value, metric, by, what) -> pd.DataFrame:
    """A head table: the head's columns (``interp.attention.sites.FRONT``; items are (site or layer, head[, pos])), ``pos``
    for ``by="head_pos"``, ``metric`` and ``effect``."""
    span = clean_value - corrupted_value
    rows = [{**head_columns(model, item[:2]), **({"pos": item[2]} if by == "head_pos" else {}), "metric": v,
             "effect": (v - corrupted_value) / span if span else float("nan")} for item, v in zip(items, values)]
    df = pd.DataFrame(rows, columns=[*FRONT, *(["pos"] if by == "head_pos" else []), "metric", "effect"])
    df.attrs.update(metric=metric.name, clean=clean_value, corrupted=corrupted_value, what=what, by=by)
    return df


def path_patching(model, clean, corrupted, receivers, metric, senders=None, via: str = "q",
                  heads_per_forward: int | None = None) -> pd.DataFrame:
    """The effect of each sender head on the metric only through the receivers' ``via`` (``"q"``, ``"k"`` or
    ``"v"``): Wang et al. 2022's path patching.

    For each sender alone: (1) a corrupted run in which the sender's output is its clean output and every other
    head's output is frozen at its corrupted value (MLPs recompute) gives the receivers' q, k or v; (2) a
    corrupted run with only the receivers' q, k or v replaced by those gives the metric. receivers: heads
    (``(layer, head)`` or ``(site, head)``; for k and v under GQA, a receiver's key/value head, shared by its
    group, is replaced). senders: heads whose site runs before the last receiver's (default: all of them).

    Every kind of model: on an encoder-decoder model sites run in call order (the encoder's, then each decoder
    block's self- and cross-attention), so encoder heads send into decoder and cross-attention receivers (a
    cross-attention head's k and v read the encoder's output).

    Returns one row per sender: the head's columns, ``metric``, ``effect`` (0 corrupted, 1 clean).
    """
    if via not in ("q", "k", "v"):
        raise ValueError(f"via must be 'q', 'k' or 'v'; got {via!r}.")
    check_per_forward(heads_per_forward)
    metric = scalar_metric(metric)
    clean, corrupted = paired_batches(model, clean, corrupted)
    receivers = check_heads(model, receivers)
    order = {s.name: i for i, s in enumerate(model.cfg.sites)}
    rank = {head: order[site_of(model, head).name] for head in model.cfg.heads()}
    last = max(rank[r] for r in receivers)
    last_name = f"layer {last}" if is_layered(model) else f"site {model.cfg.sites[last].name}"
    senders = [h for h in model.cfg.heads() if rank[h] < last] if senders is None else check_heads(model, senders)
    if not senders:
        raise ValueError(f"No head sits before the receivers' last {last_name} ({receivers}), so nothing can "
                         "send through them: choose receivers in a later layer.")
    late = [s for s in senders if rank[s] >= last]
    if late:
        raise ValueError(f"Senders must sit before the receivers' last {last_name}; got {late}.")
    z_names = [hook_name("z", s) for s in real_sites(model)]  # not a site pruned empty
    targets = sorted({(site_of(model, r).name, r[1] if via == "q" else
                       r[1] // (site_of(model, r).n_heads // site_of(model, r).n_kv_heads)) for r in receivers},
                     key=lambda t: (order[t[0]], t[1]))
    first_target = min(model.sites[site].block for site, _ in targets)
    keep = kept_logits(model, metric, corrupted)  # the logits the metric reads, and no others
    with model.studying(), torch.no_grad():
        caches, value = {}, {}
        for which, batch in (("clean", clean), ("corrupted", corrupted)):
            args, kwargs = _arguments(batch)
            with watching(model, f"The {which} run"):
                out, caches[which] = model.run_with_cache(*args, names=z_names, **kwargs, **keep)
            check_finite(model, out, f"The {which} run")
            value[which] = metric(out, batch)
        (clean_cache, corrupted_cache), (clean_value, corrupted_value) = caches.values(), value.values()
        per_forward = heads_per_forward or copies_per_forward(model, corrupted, None, keep.get("logits_to_keep"))
        prefix = Prefix(model)
        with prefix.recording():
            _run(model, corrupted, **keep)
        b = corrupted["input_ids"].shape[0]
        values, broken = [], []
        for start in range(0, len(senders), per_forward):
            group = [(site_of(model, h).name, h[1]) for h in senders[start:start + per_forward]]
            copies = len(group)
            patched = _receiver_inputs(model, corrupted, group, copies, clean_cache, corrupted_cache, z_names, via,
                                       {site for site, _ in targets}, prefix)
            with model.hooks(_receiver_hooks(via, targets, patched)), prefix.replaying(first_target, copies):
                output = _run(model, corrupted, copies, **keep)
            for sender, finite, i in zip(senders[start:start + per_forward], finite_copies(output, copies),
                                         range(copies)):
                values.append(metric(slice_output(output, i * b, (i + 1) * b, copies * b), corrupted) if finite
                              else float("nan"))
                broken += [] if finite else [sender]
        warn_non_finite(broken)
    df = _frame(model, senders, values, clean_value, corrupted_value, metric, "head", f"z through the receivers' {via}")
    df.attrs.update(receivers=receivers, via=via)
    return df


def _receiver_inputs(model, batch, group, copies, clean_cache, corrupted_cache, z_names, via, sites, prefix):
    """Run (1) for a group of ``(site, head)`` senders: copy i has sender i's clean output, every other head frozen
    at its corrupted output; returns each receiver site's ``via`` activation over all copies."""
    captured: dict[str, torch.Tensor] = {}

    def freeze(z, point):
        site, rows = point.name.rsplit(".", 1)[0], z.shape[0] // copies
        frozen = corrupted_cache[point.name].repeat(copies, 1, 1, 1).to(z.dtype)
        for i, (sender, head) in enumerate(group):
            if sender == site:
                frozen[i * rows:(i + 1) * rows, :, head] = clean_cache[point.name][:, :, head].to(z.dtype)
        return frozen

    def keep(act, point):
        captured[point.name.rsplit(".", 1)[0]] = act

    hooks = [(z_names, freeze), ([hook_name(via, site) for site in sites], keep)]
    with model.hooks(hooks), prefix.replaying(min(model.sites[site].block for site, _ in group), copies):
        _run(model, batch, copies, **logits_to_keep(model, batch, 1))  # only the receivers' inputs are read
    return captured


def _receiver_hooks(via: str, targets: Sequence[tuple[str, int]], patched: dict[str, torch.Tensor]) -> list:
    by_site: dict[str, list[int]] = {}
    for site, head in targets:
        by_site.setdefault(site, []).append(head)

    def hook_for(site, heads):
        def hook(act, point):
            if site not in patched:  # every sender of this group runs after this receiver (the replay started
                return act           # after it): the receiver's input is the corrupted run's, as computed here
            act = act.clone()
            act[:, :, heads] = patched[site][:, :, heads].to(act.dtype)
            return act
        return hook

    return [(hook_name(via, site), hook_for(site, heads)) for site, heads in by_site.items()]
