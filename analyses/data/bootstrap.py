"""The one bootstrap of the studies' intervals: 95% percentile intervals, items (prompts, windows, trials, tokens)
resampled with replacement by a seeded ``torch.Generator``, so that a seed gives the same interval on every run.

Two forms of the statistic:

- ``mean_interval(values, n_bootstrap, seed)``: the mean over items of ``values: (items, ...)``;
- ``ratio_interval(num, den, n_bootstrap, seed)``: a ratio of per-item sums, ``sum(num) / sum(den)`` (per-prompt
  hit sums over per-prompt counts of scored rows, or a per-prompt effect over a per-prompt baseline), NaN where the
  denominator sums to 0.

A resample is a row of counts (how often each item was drawn, ``resample_counts``), so every statistic is a matrix
product and one set of draws can serve several statistics (``counts=``). ``check_n_bootstrap`` is the one check of
the resample count.

>>> mean, lo, hi = mean_interval(torch.tensor([[0.0], [1.0], [1.0], [0.0]]), n_bootstrap=200, seed=0)
>>> float(mean[0]), bool(0.0 <= lo[0] <= mean[0] <= hi[0] <= 1.0)
(0.5, True)
"""

from __future__ import annotations

import torch

__all__ = ["check_n_bootstrap", "mean_interval", "ratio_interval", "resample_counts"]

_LEVELS = (0.025, 0.975)  # a 95% percentile interval


def check_n_bootstrap(n_bootstrap) -> None:
    """n_bootstrap: a positive integer (True and 2.5 are not)."""
    if isinstance(n_bootstrap, bool) or not isinstance(n_bootstrap, int) or n_bootstrap < 1:
        raise ValueError(f"n_bootstrap must be a positive integer (the resamples behind each 95% interval, e.g. "
                         f"1000); got {n_bootstrap!r}.")


def resample_counts(n_items: int, n_bootstrap: int, seed: int) -> torch.Tensor:
    """(n_bootstrap, n_items) float64: row r counts how often resample r drew each item (items drawn uniformly with
    replacement, ``n_items`` draws per resample, from ``torch.Generator().manual_seed(seed)``)."""
    check_n_bootstrap(n_bootstrap)
    if n_items < 1:
        raise ValueError(f"A bootstrap needs at least one item to resample; got {n_items}.")
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(n_items, (n_bootstrap, n_items), generator=g)
    ones = torch.ones(n_bootstrap, n_items, dtype=torch.float64)
    return torch.zeros(n_bootstrap, n_items, dtype=torch.float64).scatter_add_(1, draws, ones)


def _percentiles(boot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2.5% and 97.5% points over resamples (dim 0), resamples whose statistic is NaN left out."""
    lo_hi = torch.nanquantile(boot, torch.tensor(_LEVELS, dtype=torch.float64), dim=0)
    return lo_hi[0], lo_hi[1]


def _counts_for(n_items: int, n_bootstrap: int, seed: int, counts: torch.Tensor | None) -> torch.Tensor:
    if counts is None:
        return resample_counts(n_items, n_bootstrap, seed)
    if counts.ndim != 2 or counts.shape[1] != n_items:
        raise ValueError(f"counts must be (n_bootstrap, {n_items}) as resample_counts gives; got {tuple(counts.shape)}.")
    return counts


def mean_interval(values: torch.Tensor, n_bootstrap: int = 1000, seed: int = 0,
                  counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean over items of ``values: (items, ...)`` and its 95% percentile bootstrap interval, each ``(...)``
    in float64. counts: resamples to reuse (``resample_counts(items, n_bootstrap, seed)``), else drawn here."""
    values = values.double()
    n = values.shape[0]
    counts = _counts_for(n, n_bootstrap, seed, counts)
    boot = counts @ values.reshape(n, -1) / n  # (n_bootstrap, ...)
    lo, hi = _percentiles(boot)
    return values.mean(0), lo.reshape(values.shape[1:]), hi.reshape(values.shape[1:])


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, NaN where den is 0."""
    return torch.where(den != 0, num / torch.where(den != 0, den, 1.0), torch.nan)


def ratio_interval(num: torch.Tensor, den: torch.Tensor, n_bootstrap: int = 1000, seed: int = 0,
                   counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sum(num) / sum(den)`` over items and its 95% percentile bootstrap interval, each ``(...)`` in float64.
    num: (items, ...); den: (items,) (one denominator per item, shared by every column) or the shape of ``num``.
    NaN where the denominator sums to 0 (no item had a row to score); resamples whose denominator sums to 0 are
    left out of the interval. counts: resamples to reuse, as in ``mean_interval``."""
    num, den = num.double(), den.double()
    n = num.shape[0]
    if den.shape not in ((n,), num.shape):
        raise ValueError(f"den must be (items,) = ({n},) or num's shape {tuple(num.shape)}; got {tuple(den.shape)}.")
    counts = _counts_for(n, n_bootstrap, seed, counts)
    flat = num.reshape(n, -1)
    per_den = den[:, None] if den.ndim == 1 else den.reshape(n, -1)
    value = _ratio(flat.sum(0), per_den.sum(0))
    boot = _ratio(counts @ flat, counts @ per_den)  # (n_bootstrap, ...)
    lo, hi = _percentiles(boot)
    shape = num.shape[1:]
    return value.reshape(shape), lo.reshape(shape), hi.reshape(shape)
