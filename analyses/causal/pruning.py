"""How many heads can go: head importance, pruning curves and structurally pruned models.

Following Michel et al. 2019 ("Are Sixteen Heads Really Better than One?"): a gate xi_h = 1 multiplies each
head's output; a head's importance is E_x |dL(x)/dxi_h|, L2-normalised within each layer. Pruning removes
the least important ``step`` of the remaining heads at a time, recomputing the ranking, and records the
metric. Along the curve heads are zero-ablated, which is exactly what ``prune_model`` computes with smaller
weights (tested to 1e-5).

Every study leaves the model as it found it: weights bit-identical, no hook, no gradient, train/eval mode.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack

import numpy as np
import pandas as pd
import torch

from hooks.names import hook_name
from hooks.points import TORCH_HOOK_TABLES as _HOOK_TABLES
from interp import HookedModel
from interp.runtime import distributed
from interp.runtime.progress import progress
from interp.structure.head_slicing import CONFIG_KEY, kept_heads, plan_layer, slice_heads, slice_sites
from interp.attention.sites import FRONT, head_columns, head_key, is_layered, row_head

from .ablation import Head, _set_values, ablate_heads, ablation_scan, all_heads, check_heads
from ..data.batches import _main_output, batch_of
from .engine import Shard, _arguments, _mean_of_examples, _run, take_rows
from .finite import check_finite, watching
from ..data.metrics import as_metric

__all__ = ["head_importance", "pruning_curve", "curve_summary", "prune_model", "ORDERS"]

ORDERS = ("importance", "ablation", "random")


def _loss_fn(loss, metric=None) -> Callable:
    if loss is None and metric is None:
        raise ValueError("head_importance needs a loss: loss=fn(output, inputs) -> tensor, or a metric from "
                         "analyses.data.metrics such as lm_loss.")
    source = as_metric(loss if loss is not None else metric)
    return source.loss


def head_importance(model, inputs, loss=None, ablated=(), batch_size: int | None = None) -> pd.DataFrame:
    """Michel et al.'s head importance: one row per head with the head's columns (``stack``, ``kind``, ``site``,
    ``layer``, ``head``), ``importance`` (L2-normalised within each site: each layer of each attention kind, as
    Michel et al. normalise encoder, decoder and encoder-decoder attention) and ``importance_raw``
    (E_x |dL(x)/dxi_h|).

    loss: a metric from ``analyses.data.metrics`` (its ``loss``: e.g. ``lm_loss``, ``second_copy_loss``,
    ``embedding_similarity(...)``, ``target_loss()``) or ``fn(output, inputs) -> tensor``: per-example losses
    ``(b,)``, or a scalar taken as their mean. Each sequence has its own gates, so one backward gives every
    example's gradient. ablated: heads zero-ablated throughout (their gate is 0); they get no row.
    batch_size: rows per forward and backward pass (default: all at once). Each row has its own gates, so the
    result is the same (up to float rounding) in less memory: the logits and their gradient are held for
    ``batch_size`` rows only (Gemma 3's 262k-token vocabulary: 0.8 GB per 768-token row, each). It needs a loss
    that is a mean of per-example values (a metric from ``analyses.data.metrics`` or a ``Metric`` subclass).
    Runs in eval mode (no dropout); parameters get no gradient; modes and requires_grad are restored.
    Under torch.distributed (``torchrun``) each rank takes its share of the prompts and every example's gradients
    are gathered, so every rank returns the one-process result; a loss that is not per-example (a plain callable)
    runs whole on every rank.
    """
    return _importance(model, inputs, loss, ablated, batch_size)[0]


def _importance(model, inputs, loss=None, ablated=(), batch_size: int | None = None, metric=None):
    """``head_importance``'s table, and ``metric`` on its forward's output where that is one forward of the whole
    batch in one process (gates of 1 and 0: the run with ``ablated`` zero-ablated; else None)."""
    _loss_fn(loss)  # a clear error without one
    source = as_metric(loss)
    batch = batch_of(model, inputs)
    if batch_size is not None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size is the number of rows per backward pass, a positive int; got {batch_size!r}.")
        if not _mean_of_examples(source):
            raise ValueError(f"batch_size splits the rows, which needs a loss that is a mean of per-example values "
                             f"(a metric from analyses.data.metrics, or a Metric subclass); got {source.name!r}, a plain "
                             "callable of the whole batch. Drop batch_size, or pass such a metric.")
    ablated = set(check_heads(model, ablated, allow_empty=True))
    real = set(model.cfg.heads())  # not the placeholder of a layer pruned empty
    sites = model.cfg.sites
    units = [(hook_name("z", s), [head_key(model, s, h) not in ablated for h in range(s.n_heads)]) for s in sites]
    with Shard(batch, source) as shard:  # this rank's prompts under torch.distributed, else all of them
        mine = torch.arange(shard.n) if shard.index is None else shard.index
        parts = []
        for rows in [mine] if batch_size is None else mine.split(batch_size):
            whole = shard.index is None and len(rows) == shard.n
            part, loss_fn = (batch, source.loss) if whole else (take_rows(batch, rows), source.rows(rows).loss)
            grads, value = _gate_gradients(model, part, loss_fn, units, metric if whole else None)
            parts.append(torch.cat([torch.zeros(len(rows), s.n_heads) if g is None else g.detach().abs().float().cpu()
                                    for g, s in zip(grads, sites)], dim=1))  # (rows, heads of all sites): |dL/dxi_h|
        per_example = shard.gather(torch.cat(parts))  # every rank's examples, in order
    rows = []
    for s, g in zip(sites, per_example.split([s.n_heads for s in sites], dim=1)):
        raw = g.mean(0)  # (h,)
        live = [h for h in range(s.n_heads) if head_key(model, s, h) in real - ablated]
        norm = float(raw[live].norm()) if live else 0.0
        rows += [{**head_columns(model, head_key(model, s, h)), "importance": float(raw[h]) / norm if norm > 0
                  else 0.0, "importance_raw": float(raw[h])} for h in live]
    return pd.DataFrame(rows, columns=[*FRONT, "importance", "importance_raw"]), value


def _gate_gradients(model, batch, loss_fn, units: Sequence[tuple[str, list[bool]]], metric=None) -> tuple:
    """Per unit ``(z hook name, kept: one flag per head)``, d loss / d gate: (b, h) with one gate per example and
    head (None where a unit's gates are unused); a head not kept has its gate at 0. And ``metric`` of the output."""
    b = batch["input_ids"].shape[0]
    gates = {name: torch.ones(b, len(kept), device=model.device, dtype=model.dtype, requires_grad=True)
             for name, kept in units}
    keep = {name: torch.tensor(kept, device=model.device, dtype=model.dtype) for name, kept in units}

    def gate(z, point):  # z: (b, p, h, d), on its layer's device
        return z * (gates[point.name] * keep[point.name]).to(z.device)[:, None, :, None]

    with model.studying(), torch.enable_grad():
        for p in model.hf.parameters():
            p.requires_grad_(False)  # gradients for the gates only; studying() restores the flags
        with model.hooks([([name for name, _ in units], gate)]):
            args, kwargs = _arguments(batch)
            with watching(model, "head_importance's forward"):
                output = model(*args, **kwargs)
            check_finite(model, output, "head_importance's forward")
            value = loss_fn(output, batch)
            with torch.no_grad():
                seen = None if metric is None else metric(output, batch)
        if not isinstance(value, torch.Tensor) or value.ndim > 1 or value.ndim == 1 and value.shape[0] != b:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"The loss must return a scalar or ({b},) per-example losses; got {got}.")
        total = value.sum() if value.ndim == 1 else value * b
        grads = torch.autograd.grad(total, list(gates.values()), allow_unused=True)
        if not bool(torch.isfinite(total)) or any(g is not None and not bool(torch.isfinite(g).all()) for g in grads):
            raise ValueError(f"head_importance: the loss ({float(total.detach()):.4g}) or its gradient is not finite on a "
                             "finite forward: the loss overflows (float16: load with dtype=torch.float32).")
        return grads, seen


def _evaluate(model, batch, metric, pruned: Sequence[Head]) -> float:
    with Shard(batch, metric) as shard, ExitStack() as stack, torch.no_grad():
        batch, local = shard.rows(batch), shard.metric(metric)
        if pruned:
            stack.enter_context(ablate_heads(model, pruned))
        args, kwargs = _arguments(batch)
        return shard.means([local(model(*args, **kwargs), batch)])[0]


def _pick(ranked: Sequence[Head], n: int, remaining: Counter, allow_empty_layers: bool) -> list[Head]:
    """The first ``n`` heads of ``ranked`` whose removal leaves every layer a head (unless allowed)."""
    left, chosen = Counter(remaining), []
    for l, h in ranked:
        if len(chosen) == n:
            break
        if left[l] > 1 or allow_empty_layers:
            chosen.append((l, h))
            left[l] -= 1
    return chosen


def _ranking(model, inputs, metric, loss, order, pruned, candidates, rng, higher_is_better, normalize,
             batch_size=None) -> tuple[list[Head], float | None]:
    """``candidates`` from least to most important, and the metric with ``pruned`` ablated where the ranking's own
    forward gave it (else None)."""
    if order == "random":
        return [candidates[i] for i in rng.permutation(len(candidates))], None
    if order == "importance":
        df, value = _importance(model, inputs, loss=loss if loss is not None else metric, ablated=pruned,
                                batch_size=batch_size, metric=metric)
        column = "importance" if normalize else "importance_raw"
        score = {row_head(model, r): getattr(r, column) for r in df.itertuples()}
    else:
        df = ablation_scan(model, inputs, metric, heads=candidates, ablated=pruned)
        value = float(df["baseline"].iloc[0])  # its baseline: the run with ``pruned`` ablated
        sign = 1.0 if higher_is_better else -1.0  # damage: how much worse the metric gets
        score = {row_head(model, r): -sign * r.delta for r in df.itertuples()}
    return sorted(candidates, key=lambda head: (score[head], head)), value


def pruning_curve(model, inputs, metric, order: str = "importance", step: float = 0.1, seeds: Sequence[int] = (0, 1, 2),
                  loss=None, allow_empty_layers: bool = False, max_fraction: float = 1.0,
                  higher_is_better: bool | None = None, normalize: bool = True,
                  batch_size: int | None = None, sets_per_forward: int | None = None) -> pd.DataFrame:
    """Prune the least important ``step`` of the remaining heads at a time, recording ``metric``.

    Returns one row per step: ``fraction_pruned``, ``heads_pruned``, ``metric``, ``order``, ``seed``.
    order: ``"importance"`` (Michel et al., recomputed on the surviving heads at each step, from ``loss`` or
    the metric's own loss), ``"ablation"`` (each surviving head's single-ablation effect, recomputed at each
    step) or ``"random"`` (one curve per seed in ``seeds``; average them with ``curve_summary``).
    normalize: rank by Michel's per-layer L2-normalised importance (default) or, when False, by the raw
    E|dL/dxi|. Normalising assumes layers matter alike; where they do not (MiniLM's embeddings depend most on
    its last layer) the raw ranking prunes better. batch_size: rows per backward pass of the importance order
    (``head_importance``'s; for large vocabularies). sets_per_forward: the random orders' pruned sets run per forward
    (``engine.scan``'s copies; default: the memory budget's). Each step of the importance and ablation orders is
    evaluated on its ranking's own forward (the same heads ablated), not on a second one.
    Heads are zero-ablated, as ``prune_model`` removes them. The last head of a layer is never pruned unless
    ``allow_empty_layers``. Stops once ``max_fraction`` of the heads are pruned or none is left to prune.
    Under torch.distributed (``torchrun``) every evaluation, importance and ablation scan is split across ranks
    by prompts (as in ``ablation_scan`` and ``head_importance``); every rank ranks and prunes the same heads.

    An encoder-decoder model (``interp.model.seq2seq``) takes a batch with ``decoder_input_ids`` (as
    ``analyses.data.seq2seq.copy_task`` returns) and a metric of that batch (``analyses.data.metrics.target_loss``); its
    heads are ``(site, head)`` pairs, and "layer" above means an attention site (importance is normalised within
    each site; a site keeps its last head unless ``allow_empty_layers``).
    """
    if order not in ORDERS:
        raise ValueError(f"Unknown pruning order {order!r}; use one of {', '.join(ORDERS)}.")
    if not 0 < step <= 1:
        raise ValueError(f"step is the fraction of the remaining heads pruned at each step, in (0, 1]; got {step}.")
    if isinstance(max_fraction, bool) or not isinstance(max_fraction, (int, float)) or not 0 < max_fraction <= 1:
        raise ValueError("max_fraction is the share of all heads after which the curve stops, in (0, 1] (1.0: "
                         f"prune until none is left); got {max_fraction!r}.")
    metric = as_metric(metric, higher_is_better)
    if higher_is_better is None:
        higher_is_better = metric.higher_is_better
    if order == "ablation" and higher_is_better is None:
        raise ValueError("order='ablation' needs to know which way the metric is good: pass higher_is_better.")
    if order == "random" and not len(seeds):
        raise ValueError("order='random' needs at least one seed.")
    batch = batch_of(model, inputs)
    with model.studying():
        df = _curves(model, batch, metric, loss, order, step, seeds, allow_empty_layers, max_fraction,
                     higher_is_better, normalize, batch_size, sets_per_forward)
    df.attrs["metric"] = metric.name  # for plot titles
    return df


def _curves(model, batch, metric, loss, order, step, seeds, allow_empty_layers, max_fraction, higher_is_better,
            normalize, batch_size=None, sets_per_forward=None) -> pd.DataFrame:
    heads, rows, sets = all_heads(model), [], {}
    bar = progress(desc=f"pruning curve ({order})", unit="step")
    for seed in (seeds if order == "random" else [None]):
        rng = np.random.default_rng(seed)
        pruned: list[Head] = []
        sets[seed] = [pruned]  # a random order does not depend on the metric: its sets are evaluated together below
        while True:
            remaining = Counter(l for l, h in heads if (l, h) not in pruned)
            candidates = [head for head in heads if head not in pruned]
            n = max(1, round(step * len(candidates)))
            n = min(n, math.floor(max_fraction * len(heads) + 1e-9) - len(pruned))
            ranked, value = (None, None) if n <= 0 or not candidates else _ranking(
                model, batch, metric, loss, order, sorted(pruned), candidates, rng, higher_is_better, normalize,
                batch_size)  # the importance and ablation orders' forward is this step's evaluation too
            if order != "random":
                rows.append({"fraction_pruned": len(pruned) / len(heads), "heads_pruned": len(pruned), "order": order,
                             "metric": _evaluate(model, batch, metric, pruned) if value is None else value})
            chosen = [] if ranked is None else _pick(ranked, n, remaining, allow_empty_layers)
            if not chosen:
                break
            pruned = pruned + chosen
            sets[seed].append(pruned)
            bar.update()
    bar.close()
    if order == "random":  # several sets per forward, the unpruned model once (ablation._set_values)
        unpruned, values = _set_values(model, batch, metric, [s for seed in seeds for s in sets[seed][1:]],
                                       sets_per_forward)
        values = iter(values)
        rows = [{"fraction_pruned": len(pruned) / len(heads), "heads_pruned": len(pruned), "order": order,
                 "seed": seed, "metric": next(values) if pruned else unpruned}
                for seed in seeds for pruned in sets[seed]]
    df = pd.DataFrame(rows, columns=["fraction_pruned", "heads_pruned", "metric", "order", "seed"])
    df["seed"] = df["seed"].astype("Int64")
    return df


def curve_summary(curves: pd.DataFrame, threshold: float | None = None) -> pd.DataFrame:
    """Per order: the area under the metric-vs-fraction curve (random seeds averaged first, trapezoid rule)
    and, with ``threshold``, the largest fraction pruned before the metric first falls below it."""
    rows = []
    for order, df in curves.groupby("order", sort=False):
        mean = df.groupby("fraction_pruned")["metric"].mean().sort_index()
        x, y = mean.index.to_numpy(float), mean.to_numpy(float)
        row = {"order": order, "area": float(np.trapezoid(y, x)), "max_fraction": float(x[-1]),
               "seeds": int(df["seed"].nunique()) or 1}
        if threshold is not None:
            below = np.flatnonzero(y < threshold)
            if not below.size:
                fraction = x[-1]
            else:  # NaN when even the unpruned model is below the threshold
                fraction = x[below[0] - 1] if below[0] > 0 else float("nan")
            row[f"fraction_at_{threshold:g}"] = float(fraction)
        rows.append(row)
    return pd.DataFrame(rows)


def prune_model(model, heads, allow_empty_layers: bool = False) -> HookedModel:
    """A new ``HookedModel`` without ``heads`` (``(site, head)`` or ``(layer, head)`` pairs in ``model``'s
    numbering; an encoder-decoder model's encoder, decoder and cross-attention sites alike): its q/k/v/o
    weights are sliced, so it is physically smaller, and its output equals the original with those heads
    zero-ablated. The original is untouched.

    Grouped-query attention: a KV head goes only when all its query heads go; when groups keep unequal numbers
    of heads, KV heads are duplicated so each serves the same number (rule in ``interp/structure/head_slicing.py``). A layer
    loses every head only with ``allow_empty_layers=True`` (it keeps one zeroed placeholder head).
    Save with ``pruned.save_pretrained(folder)``; ``interp.load_model(folder)`` rebuilds it (the config
    records the kept heads in ``interp_pruned_heads``).
    """
    heads = check_heads(model, heads)
    if model._registry.active():
        raise ValueError(f"Remove the hooks on {model._registry.active()[:3]} before pruning: prune_model copies "
                         "the model, and torch hooks would be copied with it.")
    if distributed.dispatched(model.hf):
        raise NotImplementedError(
            "prune_model copies the model and slices its weights in memory; this one is placed by a device map "
            f"(accelerate{', with weights offloaded to disk or CPU' if distributed.offloaded(model.hf) else ''}), "
            "which a copy does not carry over. Load it without device_map to prune it, or study the pruned model "
            "with ablate_heads / pruning_curve, which work on it as it is.")
    keep, emptied = _keep(model, heads)
    if emptied and not allow_empty_layers:
        raise ValueError(f"This would prune every head of layer(s) {emptied}. Keep at least one head per layer, or "
                         "pass allow_empty_layers=True (the layer's attention output is then only its bias).")
    hf = copy.deepcopy(model.hf)
    _without_torch_hooks(hf)  # the user's hooks belong to their model: the pruned one starts clean
    if is_layered(model):
        slice_heads(hf, model.structure, keep)
    else:  # an encoder-decoder model: per site (interp.structure.head_slicing.slice_sites)
        slice_sites(hf, keep)
    why = ("its attention module ({}) couples the heads (a norm over all heads' queries, as OLMo2's q_norm) or reads "
           "head counts from the shared config (as Phi-3 does), which per-layer slicing cannot change. Use "
           "ablate_heads to remove these heads instead.").format(
        type(model._attn_modules[0]).__name__)
    try:
        pruned = HookedModel(hf, tokenizer=model.tokenizer, attn=model.attn)
    except RuntimeError as err:
        raise NotImplementedError(f"The pruned {model.cfg.family} model does not run ({err}): {why}") from None
    _check_pruned(model, pruned, heads, why)
    return pruned


def _keep(model, heads) -> tuple[dict, list]:
    """The heads each layer (site, on an encoder-decoder model) keeps after losing ``heads`` (checked, in the model's
    numbering), in the original numbering the config records; and the layers (sites) that lose every head."""
    record = getattr(model.hf.config, CONFIG_KEY, None) or {}
    if is_layered(model):
        original = kept_heads(model.hf.config)
        plans = {layer: plan_layer(model.cfg.n_heads, model.cfg.n_kv_heads, original[layer]) for layer in original}
    else:
        original = {s.name: sorted(int(h) for h in record.get(s.name, range(s.n_heads))) for s in model.cfg.sites}
        plans = {name: plan_layer(max(kept, default=0) + 1, max(kept, default=0) + 1, kept)
                 for name, kept in original.items()}
    keep, emptied = {}, []
    for where in dict.fromkeys(w for w, _ in heads):
        plan = plans[where]
        gone = {plan.q[h] for w, h in heads if w == where and not plan.placeholder}
        keep[where] = [h for h in original[where] if h not in gone]
        if not keep[where] and original[where]:
            emptied.append(where)
    return keep, emptied


def _without_torch_hooks(hf) -> None:
    """Empty every module's forward and backward hook tables (a copy's, never the user's own model)."""
    for module in hf.modules():
        for name in _HOOK_TABLES:
            table = getattr(module, name, None)
            if table:
                setattr(module, name, type(table)())


def _check_pruned(model, pruned, heads, why: str, tol: float = 1e-4) -> None:
    """The pruned model must compute what zero-ablating the heads computes; a model whose attention couples heads
    or reads head counts from the shared config cannot be sliced per layer: refuse it, saying why, instead of
    returning a model that computes something else."""
    ids = torch.randint(min(4, model.cfg.vocab_size - 1), model.cfg.vocab_size, (1, 7),
                        generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": None}
    if any(site.queries == "decoder_input_ids" for site in model.cfg.sites):  # an encoder-decoder model's targets
        batch.update(decoder_input_ids=ids[:, :5], decoder_attention_mask=None)
    with model.studying(), pruned.studying(), torch.no_grad():
        with ablate_heads(model, heads):
            expected = _main_output(_run(model, batch)).float()
        got = _main_output(_run(pruned, batch)).float()
    err = float((got - expected).abs().max())
    if not err <= tol * max(1.0, float(expected.abs().max())):
        raise NotImplementedError(f"Pruning this {model.cfg.family} model does not give the zero-ablated model "
                                  f"(max difference {err:.3g}): {why}")
