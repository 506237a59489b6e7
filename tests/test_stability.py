"""analyses.data.stability: the halves and the comparison of two rankings that every score's stability is read with."""

import math

import pytest
import torch

from analyses.data.stability import halves, spearman, split_half, stability


def test_spearman_matches_pearson_of_ranks_with_ties():
    a = torch.tensor([1.0, 2.0, 2.0, 3.0, 5.0])
    b = torch.tensor([10.0, 30.0, 20.0, 40.0, 50.0])
    ra = torch.tensor([1.0, 2.5, 2.5, 4.0, 5.0])
    rb = torch.tensor([1.0, 3.0, 2.0, 4.0, 5.0])
    expected = float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])
    assert spearman(a, b) == pytest.approx(expected)
    assert spearman(a, a) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)


def test_spearman_drops_nan_and_is_nan_when_constant():
    assert spearman([1.0, float("nan"), 2.0, 3.0], [1.0, 5.0, 2.0, 3.0]) == pytest.approx(1.0)
    assert math.isnan(spearman([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]))


def test_stability_top_k_and_unstable():
    g = torch.Generator().manual_seed(0)
    truth = torch.rand(50, generator=g)
    s = stability(truth, truth + 1e-3 * torch.rand(50, generator=g), k=10)
    assert s["spearman"] > 0.99 and s["top_k_overlap"] == 1.0 and not s["unstable"]
    s = stability(truth, torch.rand(50, generator=g), k=10)
    assert s["unstable"] and s["top_k_overlap"] < 1.0
    assert stability(truth[:4], truth[:4], k=10)["k"] == 4


def test_halves_are_disjoint_and_cover():
    a, b = halves(7)
    assert sorted(a.tolist() + b.tolist()) == list(range(7)) and not set(a.tolist()) & set(b.tolist())
    with pytest.raises(ValueError, match="at least 2"):
        halves(1)


def test_ties_are_not_broken_by_order_and_constant_halves_rank_nothing():
    zeros = torch.zeros(30)
    s = stability(zeros, zeros, k=10)
    assert math.isnan(s["top_k_overlap"]) and s["unstable"]
    a = torch.tensor([1.0, 0.5, 0.5, 0.5, 0.0, 0.0])  # the 2nd place is a three-way tie
    b = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5])
    assert stability(a, b, k=2)["top_k_overlap"] == pytest.approx(2 / 4)


def test_read_only_numpy_is_accepted_without_warning(recwarn):
    import numpy as np
    x = np.arange(5, dtype=float)
    x.setflags(write=False)
    assert spearman(x, x) == pytest.approx(1.0)
    assert not [w for w in recwarn if "not writable" in str(w.message)]


def test_split_half_means_and_ratios_of_sums():
    g = torch.Generator().manual_seed(1)
    values, den = torch.rand(9, 12, generator=g), torch.rand(9, generator=g) + 0.5
    even, odd = torch.arange(0, 9, 2), torch.arange(1, 9, 2)
    by_hand = stability(values[even].mean(0), values[odd].mean(0))
    assert split_half(values, items="windows") == {**by_hand, "halves": "windows"}
    by_hand = stability(values[even].sum(0) / den[even].sum(), values[odd].sum(0) / den[odd].sum())
    assert split_half(values, den)["spearman"] == pytest.approx(by_hand["spearman"])
    assert split_half(values[:1])["unstable"]
