"""Circuits chosen from edge scores, and their evaluation by exact edge patching.

- ``select_circuit``: the top-n edges by ``|score|`` (or those at or above a threshold), then the edges whose
  receiver has no path to the metric through the chosen edges dropped (a head whose output reaches no later input
  of the circuit, nor the logits, cannot matter).
- ``faithfulness``: for each size on a grid, the metric with only the circuit's edges clean, every other edge
  corrupted (the clean input run with the complement's edges carrying the corrupted run's sender outputs), as
  ``(m(C) - m(empty)) / (m(full) - m(empty))`` (Hanna et al. 2024; MIB, Mueller et al. 2025), with 95% bootstrap
  intervals over prompts; the complement's curve (every edge clean but the circuit's); random circuits of the same
  sizes (edges drawn uniformly). ``df.attrs`` holds MIB's **CPR** (area under the faithfulness curve over the
  fraction of edges, from the empty circuit at 0 to the full model at 1; higher is better) and **CMD** (area of
  ``|1 - faithfulness|``; lower is better), for the circuits and for the random ones.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from interp.runtime.progress import progress

from ..data.bootstrap import ratio_interval, resample_counts
from ..causal.engine import kept_logits, slice_output
from ..causal.patching import paired_batches, scalar_metric
from .patching import EdgeIndex, circuits_per_forward, patched_runs, source_outputs

__all__ = ["circuit_areas", "faithfulness", "select_circuit"]


def _owners(model, row) -> list[str]:
    """The upstream node names a receiver's input feeds (k, v: every query head of the key/value head's group)."""
    if row.input == "logits":
        return ["logits"]
    if row.input == "mlp":
        return [f"mlp.{row.down_layer}"]
    if row.input == "q":
        return [f"{row.down_site}:{row.down_head}"]
    site = model.sites[row.down_site]
    group = site.n_heads // site.n_kv_heads
    return [f"{row.down_site}:{h}" for h in range(row.down_head * group, (row.down_head + 1) * group)]


def select_circuit(model, scores: pd.DataFrame, edges: int | None = None, threshold: float | None = None) -> pd.DataFrame:
    """The rows of ``scores`` (``edge_attribution``'s frame) of a circuit: the ``edges`` highest ``|score|`` (or
    ``|score| >= threshold``), less those whose receiver has no path to the metric through the chosen edges."""
    if (edges is None) == (threshold is None):
        raise ValueError("Give one of edges (the top-n by |score|) or threshold (|score| at or above it).")
    if edges is not None and (isinstance(edges, bool) or not isinstance(edges, (int, np.integer)) or edges < 0):
        raise ValueError(f"edges must be a non-negative integer; got {edges!r}.")
    if "score" not in scores or "downstream" not in scores:
        raise ValueError("scores must be edge_attribution's frame (with upstream, downstream, input, score columns).")
    order = scores["score"].abs().sort_values(ascending=False, kind="stable")
    chosen = scores.loc[order.index[:edges]] if edges is not None else scores.loc[order.index[order >= threshold]]
    owners = {i: _owners(model, row) for i, row in zip(chosen.index, chosen.itertuples())}
    reaching, grew = {"logits"}, True
    while grew:
        grew = False
        for i, up in zip(chosen.index, chosen["upstream"]):
            if up not in reaching and any(o in reaching for o in owners[i]):
                reaching.add(up)
                grew = True
    return chosen[[any(o in reaching for o in owners[i]) for i in chosen.index]]


def circuit_areas(fractions, values) -> tuple[float, float]:
    """MIB's CPR and CMD: the areas (trapezoids over the fraction of edges) under ``values`` and under ``|1 -
    values|``, with the empty circuit (0, 0) and the full model (1, 1) added at the ends."""
    x = np.concatenate([[0.0], np.asarray(fractions, dtype=float), [1.0]])
    y = np.concatenate([[0.0], np.asarray(values, dtype=float), [1.0]])
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    area = lambda v: float(np.sum((v[1:] + v[:-1]) * np.diff(x)) / 2)  # noqa: E731
    return area(y), area(np.abs(1.0 - y))


def faithfulness(model, clean, corrupted, metric, scores: pd.DataFrame, sizes=(5, 10, 20, 50, 100),
                 n_random: int = 5, seed: int = 0, n_bootstrap: int = 1000,
                 memory_budget: float | None = None) -> pd.DataFrame:
    """The faithfulness curve of the circuits ``select_circuit(model, scores, edges=n)`` for ``n`` in ``sizes``.

    Returns one row per size: ``size`` (asked), ``edges`` (kept), ``fraction`` (of the model's edges),
    ``faithfulness`` with ``lo``/``hi`` (95% bootstrap over prompts), ``complement`` (every edge clean but the
    circuit's) with its interval, ``random`` (the mean over ``n_random`` random circuits of the same number of
    edges), ``random_max`` and the first draw's interval ``random_lo``/``random_hi``. ``df.attrs``: ``cpr``,
    ``cmd``, ``cpr_random``, ``cmd_random``, ``clean``, ``corrupted``, ``forwards_per_point`` (``2 + n_random``
    patched runs of the batch per size, each one forward plus one mask product per receiver),
    ``circuits_per_forward`` (the runs batched into one forward, as copies of the batch, within ``memory_budget``).
    The two unpatched runs (clean, corrupted) are made once per curve.
    """
    metric = scalar_metric(metric)
    clean, corrupted = paired_batches(model, clean, corrupted)
    index = EdgeIndex(model)
    keep = kept_logits(model, metric, clean)
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in sizes]
    insides = []  # per size: the circuit, then n_random random circuits of as many edges (bool over the edges)
    for n in sizes:
        inside = torch.zeros(len(index), dtype=torch.bool)
        inside[index.positions(select_circuit(model, scores, edges=n))] = True
        draws = [torch.zeros(len(index), dtype=torch.bool) for _ in range(n_random)]
        for draw in draws:
            draw[torch.as_tensor(rng.choice(len(index), size=int(inside.sum()), replace=False))] = True
        insides.append([inside, *draws])
    # the runs: per size the circuit (its complement patched), the complement (the circuit patched), the draws
    runs = [patched for inside, *draws in insides for patched in (~inside, inside, *(~d for d in draws))]
    per = circuits_per_forward(model, clean, index, memory_budget, keep.get("logits_to_keep"))
    b = clean["input_ids"].shape[0]
    with model.studying(), torch.no_grad():
        out, _ = source_outputs(model, clean, **keep)
        full = metric.per_example(out, clean).double()
        out, corrupted_nodes = source_outputs(model, corrupted, **keep)
        empty = metric.per_example(out, corrupted).double()
        counts = resample_counts(len(full), n_bootstrap, seed)
        values = []
        for start in progress(range(0, len(runs), per), desc="faithfulness", unit="forward"):
            chosen = torch.stack(runs[start:start + per])
            out = patched_runs(model, clean, corrupted_nodes, chosen, index, **keep)
            for i in range(len(chosen)):
                value = metric.per_example(slice_output(out, i * b, (i + 1) * b, len(chosen) * b), clean).double()
                v, lo, hi = ratio_interval(value - empty, full - empty, counts=counts)
                values.append((float(v), float(lo), float(hi)))
    rows, step = [], 2 + n_random
    for k, (n, (inside, *_)) in enumerate(zip(sizes, insides)):
        f, c, *draws = values[k * step:(k + 1) * step]
        rows.append({"size": n, "edges": int(inside.sum()), "fraction": float(inside.sum()) / len(index),
                     "faithfulness": f[0], "lo": f[1], "hi": f[2],
                     "complement": c[0], "complement_lo": c[1], "complement_hi": c[2],
                     "random": float(np.mean([d[0] for d in draws])) if draws else float("nan"),
                     "random_max": max((d[0] for d in draws), default=float("nan")),
                     "random_lo": draws[0][1] if draws else float("nan"),
                     "random_hi": draws[0][2] if draws else float("nan")})
    df = pd.DataFrame(rows)
    cpr, cmd = circuit_areas(df["fraction"], df["faithfulness"])
    cpr_r, cmd_r = circuit_areas(df["fraction"], df["random"]) if n_random else (float("nan"), float("nan"))
    df.attrs.update(cpr=cpr, cmd=cmd, cpr_random=cpr_r, cmd_random=cmd_r, clean=float(full.mean()),
                    corrupted=float(empty.mean()), forwards_per_point=step, circuits_per_forward=per,
                    total_edges=len(index))
    return df
