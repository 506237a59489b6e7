"""Pruning curves that run fewer forwards (issue 40) give the numbers of the one-evaluation-per-step procedure: the
importance and ablation orders read each step's metric off their ranking's own forward, the random orders evaluate
every seed's sets together, several per forward (``ablation._set_values``). The reference below is the procedure
before: rank, prune, and one separate ablated forward per point."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pandas as pd
import pytest
import torch

import interp
from analyses import ablate_heads, ablation_scan, embedding_similarity, head_importance, lm_loss, pruning_curve
from analyses.causal.ablation import _set_values, all_heads
from analyses.causal.pruning import _pick
from tests.tiny import tiny_model

TOL = 1e-5


def _inputs(seed=0, shape=(3, 9)):
    return torch.randint(4, 99, shape, generator=torch.Generator().manual_seed(seed))


def _value(model, inputs, metric, pruned) -> float:
    with ablate_heads(model, pruned) if pruned else torch.no_grad(), torch.no_grad():
        return metric(model(inputs), {"input_ids": inputs, "attention_mask": None})


def _reference(model, inputs, metric, order, step, seed=None) -> list[tuple[int, float]]:
    """(heads pruned, metric) per point, one ablated forward each, ranking as pruning_curve documents it."""
    heads, pruned, points = all_heads(model), [], []
    rng = np.random.default_rng(seed)
    while True:
        points.append((len(pruned), _value(model, inputs, metric, pruned)))
        remaining = Counter(l for l, h in heads if (l, h) not in pruned)
        candidates = [head for head in heads if head not in pruned]
        n = min(max(1, round(step * len(candidates))), math.floor(len(heads) + 1e-9) - len(pruned))
        if n <= 0 or not candidates:
            return points
        if order == "random":
            ranked = [candidates[i] for i in rng.permutation(len(candidates))]
        elif order == "importance":
            df = head_importance(model, inputs, loss=metric, ablated=sorted(pruned))
            score = {(r.layer, r.head): r.importance for r in df.itertuples()}
            ranked = sorted(candidates, key=lambda head: (score[head], head))
        else:
            df = ablation_scan(model, inputs, metric, heads=candidates, ablated=sorted(pruned))
            score = {(r.layer, r.head): r.delta for r in df.itertuples()}  # lm_loss: lower is better
            ranked = sorted(candidates, key=lambda head: (score[head], head))
        chosen = _pick(ranked, n, remaining, False)
        if not chosen:
            return points
        pruned = pruned + chosen


@pytest.mark.parametrize("order", ["importance", "ablation", "random"])
def test_curves_equal_one_evaluation_per_step(order):
    model = interp.load_model(tiny_model("llama", num_hidden_layers=3))
    inputs = _inputs()
    seeds = (0, 1, 2)
    curve = pruning_curve(model, inputs, lm_loss, order=order, step=0.3, seeds=seeds, sets_per_forward=3)
    expected = [(seed, *point) for seed in (seeds if order == "random" else [None])
                for point in _reference(model, inputs, lm_loss, order, 0.3, seed)]
    got = [(None if s is pd.NA else int(s), int(k), float(v))
           for s, k, v in zip(curve["seed"], curve["heads_pruned"], curve["metric"])]
    assert [g[:2] for g in got] == [e[:2] for e in expected]
    assert max(abs(g[2] - e[2]) for g, e in zip(got, expected)) <= TOL
    assert len({round(v, 4) for v in curve["metric"]}) > 2  # pruning changes the metric: equality means something



@pytest.mark.parametrize("per_forward", [1, 3, None])
def test_set_values_equal_each_set_ablated_alone(per_forward):
    model = interp.load_model(tiny_model("gpt2"))
    inputs = _inputs(1)
    sets = [[(0, 1)], [(1, 0), (1, 2)], [(0, 0), (1, 3)], [(1, 1)]]
    for metric in (lm_loss, embedding_similarity(model, inputs)):
        baseline, values = _set_values(model, inputs, metric, sets, per_forward)
        assert abs(baseline - _value(model, inputs, metric, [])) <= TOL
        for heads, value in zip(sets, values):
            assert abs(value - _value(model, inputs, metric, heads)) <= TOL, heads
        assert max(abs(v - baseline) for v in values) > 1e-4
