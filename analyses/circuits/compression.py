"""What a compression of heads cuts from a circuit: the circuit's edges that streaming or pruning a set of heads
removes, the faithfulness the circuit keeps without them (exact edge patching), beside the task metric with the
compression itself applied to the model.

Definitions (``compression_cuts``), for a set of query heads and a circuit's edges ``u -> v``:

- **prune** (the heads' outputs zeroed, as ``prune_model`` computes with smaller weights): a pruned head's output node
  is gone, so every edge *from* it is cut; its query reads nothing that reaches the metric any more, so every edge
  into its ``q`` is cut; a key/value head all of whose query heads are pruned is gone too (``prune_model`` drops it),
  so every edge into its ``k`` and ``v`` is cut.
- **stream** (``interp.stream_heads``: each query reads only the first ``sink`` keys and the last ``window`` up to
  itself): a streaming head keeps its output node and its query (a query always reads its own position); what it
  loses are the keys and values more than ``window`` positions back past the sinks. So, on inputs longer than
  ``sink + window`` tokens, every edge into the ``k`` and ``v`` of a key/value head all of whose query heads stream is
  cut; on inputs no longer than that every key is in every query's window and nothing is cut. A streamed edge loses
  only its long-range part; the patched run corrupts it at every position, so its faithfulness is what the circuit
  keeps without the edge altogether (a bound on what streaming takes, not the same quantity).
- **partial**, for both: an edge into the ``k`` or ``v`` of a key/value head some but not all of whose query heads
  are compressed (grouped-query attention): the other query heads of its group still read it whole. Counted apart,
  not cut.

``compression_table`` measures, for named head sets and both methods: the edges cut (of the circuit's), the
faithfulness of the circuit without the cut edges (``(m(C - cut) - m(empty)) / (m(full) - m(empty))``, every edge
outside it carrying the corrupted run's sender outputs, as ``faithfulness``; with a 95% bootstrap interval over
prompts) and without the cut and partial ones, and the task metric on the clean inputs with the compression applied
(heads zero-ablated, or streamed with ``sink`` and ``window``), also as the share of the clean-corrupted gap it keeps.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext

import pandas as pd
import torch

from interp.attention.sites import check_heads
from interp.runtime.progress import progress
from interp.streaming import KVHeadsNote, stream_heads

from ..causal.ablation import ablate_heads
from ..causal.engine import _arguments
from .evaluation import _Evaluation
from .graph import as_edges, edge_frame

__all__ = ["METHODS", "compression_cuts", "compression_table"]

METHODS = ("stream", "prune")


def _check_method(method) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)} (how the heads are compressed); got {method!r}.")
    return method


def _compressed(model, heads, method: str, sink: int, window: int) -> tuple[set, dict]:
    """The compressed query heads as ``{(site, head)}`` and, per ``(site, kv head)``, whether all (True) or only
    some (False) of its query heads are compressed. Heads are checked as ``stream_heads`` (streaming) or
    ``check_heads`` (pruning) check them."""
    if method == "stream":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KVHeadsNote)  # partial groups are this table's own column
            with stream_heads(model, heads, sink=sink, window=window) as s:
                pairs = list(s.heads)
    else:
        pairs = check_heads(model, heads, allow_empty=True)
    sites, queries, groups = model.cfg.sites, set(), {}
    for l, h in pairs:
        site = sites[l]
        queries.add((site.name, h))
        group = site.n_heads // site.n_kv_heads
        groups.setdefault((site.name, h // group), set()).add(h)
    whole = {}
    for (name, g), members in groups.items():
        site = next(s for s in sites if s.name == name)
        whole[(name, g)] = len(members) == site.n_heads // site.n_kv_heads
    return queries, whole


def compression_cuts(model, circuit, heads, method: str, tokens: int | None = None, sink: int = 4,
                     window: int = 256) -> pd.DataFrame:
    """The circuit's edges with what ``method`` (``"stream"`` or ``"prune"``) applied to ``heads`` ((layer, head)
    pairs; an empty list compresses nothing) does to each, by the module's definitions.

    circuit: a frame with ``upstream`` and ``downstream`` columns (``select_circuit``'s) or ``(upstream,
    downstream)`` name pairs. tokens: the inputs' length, needed for ``"stream"`` (nothing is cut at or below
    ``sink + window`` tokens). Returns one row per edge: ``edge_frame``'s columns, ``cut`` and ``partial`` (bool),
    ``why`` (``"output removed"``, ``"query removed"``, ``"key/value head removed"``, ``"long-range keys dropped"``,
    ``"partial"`` or ``""``)."""
    _check_method(method)
    if method == "stream" and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"method='stream' needs tokens, the inputs' length (a positive integer: streaming cuts only "
                         f"keys more than sink + window = {sink} + {window} positions back); got {tokens!r}.")
    edges = as_edges(model, circuit)
    queries, whole = _compressed(model, heads, method, sink, window)
    long = method == "prune" or tokens > sink + window
    why = []
    for u, r in edges:
        reason = ""
        if method == "prune" and u.kind == "head" and (u.site, u.head) in queries:
            reason = "output removed"
        elif method == "prune" and r.input == "q" and (r.site, r.head) in queries:
            reason = "query removed"
        elif r.input in ("k", "v") and (r.site, r.head) in whole and long:
            if whole[(r.site, r.head)]:
                reason = "key/value head removed" if method == "prune" else "long-range keys dropped"
            else:
                reason = "partial"
        why.append(reason)
    df = edge_frame(edges)
    df["partial"] = [w == "partial" for w in why]
    df["cut"] = [w not in ("", "partial") for w in why]
    df["why"] = why
    df.attrs.update(method=method, heads=len(queries), tokens=tokens, sink=sink, window=window)
    return df


def _tokens(batch) -> int:
    mask = batch.get("attention_mask")
    return int(batch["input_ids"].shape[1] if mask is None else mask.sum(1).max())


def _metric_under(ev, heads, method: str, sink: int, window: int) -> float:
    """The metric's mean over the clean inputs with ``heads`` compressed by ``method``."""
    model = ev.model
    args, kwargs = _arguments(ev.clean)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", KVHeadsNote)
        context = (stream_heads(model, heads, sink=sink, window=window) if method == "stream"
                   else ablate_heads(model, heads, "zero") if len(heads) else nullcontext())
        with context:
            out = model(*args, **kwargs, **ev.keep)
    return float(ev.metric.per_example(out, ev.clean).double().mean())


def compression_table(model, clean, corrupted, metric, circuit, sets: dict, methods=METHODS, sink: int = 4,
                      window: int = 256, n_bootstrap: int = 1000, seed: int = 0,
                      memory_budget: float | None = None) -> pd.DataFrame:
    """For each named head set of ``sets`` (``{name: [(layer, head), ...]}``) and each method of ``methods``: what it
    cuts from ``circuit`` (``compression_cuts``, at the clean inputs' length) and what the circuit and the model keep.

    Returns one row per (set, method): ``set``, ``method``, ``heads`` (query heads compressed), ``edges`` (the
    circuit's), ``edges_cut``, ``edges_partial``, ``faithfulness`` (the whole circuit's), ``kept`` with ``kept_lo``
    / ``kept_hi`` (95% bootstrap over prompts; the circuit without the cut edges), ``kept_partial`` (without the cut
    and the partial ones), ``metric`` (the task metric's mean on the clean inputs with the heads compressed) and
    ``metric_kept`` (``(metric - corrupted) / (clean - corrupted)``: the share of the gap the compressed model keeps).
    ``df.attrs``: ``clean``, ``corrupted`` (the unpatched runs' metric), ``tokens``, ``sink``, ``window``,
    ``total_edges``. All patched runs of the table share the two unpatched runs, several per forward."""
    methods = [_check_method(m) for m in methods]
    if not isinstance(sets, dict) or not sets:
        raise ValueError(f"sets must be a non-empty dict {{name: [(layer, head), ...]}}; got {type(sets).__name__}.")
    rows, masks = [], []
    with model.studying():
        ev = _Evaluation(model, clean, corrupted, metric, memory_budget, n_bootstrap, seed)
        tokens = _tokens(ev.clean)
        inside = ev.inside(edge_frame(as_edges(model, circuit)))
        masks.append(~inside)
        for name, heads in progress(list(sets.items()), desc="compressed runs", unit="set"):
            for method in methods:
                cuts = compression_cuts(model, circuit, heads, method, tokens, sink, window)
                cut, either = ev.inside(cuts[cuts["cut"]]), ev.inside(cuts[cuts["cut"] | cuts["partial"]])
                masks += [~(inside & ~cut), ~(inside & ~either)]
                rows.append({"set": name, "method": method, "heads": cuts.attrs["heads"], "edges": len(cuts),
                             "edges_cut": int(cuts["cut"].sum()), "edges_partial": int(cuts["partial"].sum()),
                             "metric": _metric_under(ev, heads, method, sink, window)})
        values = ev(masks, desc="compression")
    whole, clean_m, corrupted_m = values[0][0], float(ev.full.mean()), float(ev.empty.mean())
    for k, row in enumerate(rows):
        kept, kept_partial = values[1 + 2 * k], values[2 + 2 * k]
        row.update(faithfulness=whole, kept=kept[0], kept_lo=kept[1], kept_hi=kept[2], kept_partial=kept_partial[0],
                   metric_kept=(row["metric"] - corrupted_m) / (clean_m - corrupted_m))
    columns = ["set", "method", "heads", "edges", "edges_cut", "edges_partial", "faithfulness", "kept", "kept_lo",
               "kept_hi", "kept_partial", "metric", "metric_kept"]
    df = pd.DataFrame(rows, columns=columns)
    df.attrs.update(clean=clean_m, corrupted=corrupted_m, tokens=tokens, sink=sink, window=window,
                    total_edges=len(ev.index))
    return df
