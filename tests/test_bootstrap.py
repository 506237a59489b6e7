"""The one bootstrap (analyses/data/bootstrap.py, issue 36) gives the numbers of the bootstraps it replaced. Each former
function is kept here, as it was written, as the reference: the taxonomy's mean over items, the IOI scores' ratio of
means, the head scores' ratio of per-prompt sums over per-prompt counts, and retrieval's mean over trials."""

from __future__ import annotations

import pytest
import torch

from analyses.data.bootstrap import check_n_bootstrap, mean_interval, ratio_interval, resample_counts


def _former_taxonomy_bootstrap(hits, n_bootstrap, seed):  # analyses/taxonomy/base.py, bootstrap
    hits = hits.double()
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(hits.shape[0], (n_bootstrap, hits.shape[0]), generator=g)
    counts = torch.zeros(n_bootstrap, hits.shape[0], dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(n_bootstrap, hits.shape[0], dtype=torch.float64))
    boot = counts @ hits / hits.shape[0]
    lo_hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=0)
    return hits.mean(0), lo_hi[0], lo_hi[1]


def _former_ioi_ratio(num, den, n_bootstrap, seed):  # analyses/taxonomy/ioi.py, _ratio_bootstrap
    num, den = num.double(), den.double()
    g = torch.Generator().manual_seed(seed)
    n = num.shape[0]
    draws = torch.randint(n, (n_bootstrap, n), generator=g)
    counts = torch.zeros(n_bootstrap, n, dtype=torch.float64).scatter_add_(1, draws, torch.ones(n_bootstrap, n,
                                                                                                 dtype=torch.float64))
    boot = (counts @ num) / (counts @ den)[:, None]
    lo_hi = torch.nanquantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=0)
    return num.mean(0) / den.mean(), lo_hi[0], lo_hi[1]


def _former_scores_ratio(flat, rows, n_bootstrap, seed):  # analyses/heads/scores.py, Tally.frame (one score)
    def ratio(num, den):
        return torch.where(den > 0, num / den.clamp(min=1), torch.nan)

    n_prompts = flat.shape[0]
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(n_prompts, (n_bootstrap, n_prompts), generator=g)
    weights = torch.zeros(n_bootstrap, n_prompts, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(n_bootstrap, n_prompts, dtype=torch.float64))
    rows = rows.double()
    boot = ratio(weights @ flat, (weights @ rows)[:, None])
    lo_hi = torch.nanquantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=0)
    return ratio(flat.sum(0), rows.sum()), lo_hi[0], lo_hi[1]


def _former_retrieval(per_trial, n_bootstrap, seed):  # analyses/long/retrieval.py, retrieval_heads
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(len(per_trial), (n_bootstrap, len(per_trial)), generator=g)
    boot = per_trial[draws].mean(1)
    lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=0)
    return per_trial.mean(0), lo, hi


@pytest.mark.parametrize("seed", [0, 7])
def test_the_mean_form_equals_the_taxonomy_bootstrap_bit_for_bit(seed):
    hits = (torch.rand(37, 12, generator=torch.Generator().manual_seed(seed)) < 0.3).float()
    hits[:, 3] = 0.0  # a head that never fires: a zero-width interval at 0
    got, want = mean_interval(hits, 500, seed), _former_taxonomy_bootstrap(hits, 500, seed)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert got[1][3] == got[2][3] == 0.0 and bool((got[1] < got[2]).any())


def test_the_mean_form_equals_retrieval_s_mean_over_trials():
    per_trial = torch.rand(9, 2 * 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got, want = mean_interval(per_trial, 300, 5), _former_retrieval(per_trial, 300, 5)
    for a, b in zip(got, want):  # the same draws; a sum of counts times values against a mean of gathered rows
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_the_ratio_form_equals_the_head_scores_ratio_of_sums_over_counts():
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 6, (20,), generator=g)  # scored rows per prompt; some prompts have none
    rows[:3] = 0
    flat = (torch.rand(20, 8, generator=g) * rows[:, None]).round().double()  # hits <= rows
    got, want = ratio_interval(flat, rows, 400, 2), _former_scores_ratio(flat, rows, 400, 2)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    empty = ratio_interval(flat[:3], rows[:3], 50, 0)  # no prompt with a scored row: NaN, not 0
    assert all(bool(t.isnan().all()) for t in empty)


def test_the_ratio_form_equals_the_ioi_ratio_of_means():
    g = torch.Generator().manual_seed(4)
    num, den = torch.randn(32, 6, generator=g), torch.rand(32, generator=g) + 0.5  # a logit difference, > 0
    got, want = ratio_interval(num, den, 400, 9), _former_ioi_ratio(num, den, 400, 9)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # the same resamples, the same ratios
    torch.testing.assert_close(got[0], want[0], rtol=1e-14, atol=0)  # sum/sum against mean/mean: rounding only


def test_one_set_of_draws_serves_several_statistics_and_a_seed_repeats():
    values = torch.rand(15, 4, generator=torch.Generator().manual_seed(0))
    counts = resample_counts(15, 200, 11)
    assert counts.shape == (200, 15) and bool((counts.sum(1) == 15).all())
    assert all(torch.equal(a, b) for a, b in zip(mean_interval(values, counts=counts), mean_interval(values, 200, 11)))
    assert not torch.equal(mean_interval(values, 200, 12)[1], mean_interval(values, 200, 11)[1])


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "10"])
def test_a_bad_resample_count_is_refused_with_what_to_give(bad):
    with pytest.raises(ValueError, match="n_bootstrap must be a positive integer"):
        check_n_bootstrap(bad)
    with pytest.raises(ValueError, match="n_bootstrap must be a positive integer"):
        mean_interval(torch.ones(3, 2), bad)


def test_a_den_of_another_shape_is_refused():
    with pytest.raises(ValueError, match=r"den must be \(items,\)"):
        ratio_interval(torch.ones(4, 3), torch.ones(3))
