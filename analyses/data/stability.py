"""How stable a head ranking is: a score computed on two disjoint halves of its items (prompts, trials, tokens), and
the two rankings of heads compared (Spearman's rank correlation, and how many of the top ``k`` heads the halves
share). The one home of that comparison and of what "unstable" means; every score's runner reports it in its
table's ``df.attrs["stability"][score]`` and the report and the atlas read it from there.

>>> a = torch.tensor([0.9, 0.8, 0.1, 0.05, 0.0])
>>> s = stability(a, a.flip(0), k=2)
>>> s["spearman"] < 0, s["top_k_overlap"], s["unstable"]
(True, 0.0, True)
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["UNSTABLE_SPEARMAN", "UNSTABLE_OVERLAP", "halves", "spearman", "split_half", "stability"]

# A ranking is called unstable when its halves' Spearman is under this, or they share under this share of their top k.
UNSTABLE_SPEARMAN = 0.8
UNSTABLE_OVERLAP = 0.5


def halves(n_items: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two disjoint halves of ``n_items`` items: even and odd indices (so each half spans every length, depth or
    prompt kind that the items cycle through)."""
    if n_items < 2:
        raise ValueError(f"Two halves need at least 2 items (prompts or trials); got {n_items}.")
    index = torch.arange(n_items)
    return index[0::2], index[1::2]


def _ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (ties share the mean of their ranks), float64."""
    x = x.double()
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(len(x), dtype=torch.float64)
    values, inverse = torch.unique(x, return_inverse=True)
    sums = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, ranks)
    counts = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(ranks))
    return (sums / counts)[inverse]


def _vector(x) -> torch.Tensor:
    """A float64 copy, flat (a read-only numpy array, a pandas Series or a tensor alike)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).flatten()
    return torch.from_numpy(np.array(x, dtype=np.float64)).flatten()


def _top(x: torch.Tensor, k: int) -> set[int]:
    """The indices of the ``k`` largest values, and every index tied with the k-th (a tie is not broken by order)."""
    kth = torch.sort(x, descending=True).values[k - 1]
    return set(torch.nonzero(x >= kth).flatten().tolist())


def spearman(a, b) -> float:
    """Spearman's rank correlation of two equal-length vectors (NaN entries of either dropped; NaN when fewer than
    3 remain or one side is constant)."""
    a, b = _vector(a), _vector(b)
    if a.shape != b.shape:
        raise ValueError(f"spearman needs two vectors of one length; got {tuple(a.shape)} and {tuple(b.shape)}.")
    keep = ~(a.isnan() | b.isnan())
    a, b = a[keep], b[keep]
    if len(a) < 3:
        return math.nan
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = (ra.square().sum() * rb.square().sum()).sqrt()
    return float(ra @ rb / den) if den > 0 else math.nan


def stability(first, second, k: int = 10) -> dict:
    """Compare a score's two halves, one value per head each (NaN heads left out): ``spearman``, ``top_k_overlap``
    (the share of the first half's top ``k`` heads also in the second's; heads tied with the k-th count in the top,
    over the larger of the two tops; NaN when a half is constant; ``k`` is cut to the number of heads), ``k``, and
    ``unstable`` (Spearman under ``UNSTABLE_SPEARMAN`` or overlap under ``UNSTABLE_OVERLAP``)."""
    a, b = _vector(first), _vector(second)
    if a.shape != b.shape:
        raise ValueError(f"stability needs one value per head in each half; got {tuple(a.shape)} and {tuple(b.shape)}.")
    keep = ~(a.isnan() | b.isnan())
    a, b = a[keep], b[keep]
    k = min(int(k), len(a))
    rho = spearman(a, b)
    if k < 1:
        return {"spearman": rho, "top_k_overlap": math.nan, "k": 0, "unstable": True}
    if bool((a == a[0]).all()) or bool((b == b[0]).all()):  # a constant half ranks nothing: no top k to share
        return {"spearman": rho, "top_k_overlap": math.nan, "k": k, "unstable": True}
    top_a, top_b = _top(a, k), _top(b, k)
    overlap = len(top_a & top_b) / max(len(top_a), len(top_b))
    unstable = not (rho >= UNSTABLE_SPEARMAN) or overlap < UNSTABLE_OVERLAP
    return {"spearman": rho, "top_k_overlap": overlap, "k": k, "unstable": bool(unstable)}


def split_half(values: torch.Tensor, den: torch.Tensor | None = None, k: int = 10, items: str = "prompts") -> dict:
    """``stability`` of a score whose per-item values are ``values: (items, heads)``, on the even against the odd
    items: each half's mean (``den`` None) or ratio of sums ``sum(values) / sum(den)`` (``den``: ``(items,)`` or
    ``(items, heads)``, as ``analyses.data.bootstrap.ratio_interval`` takes them); ``"halves"`` names the items. Fewer
    than 2 items: NaN, unstable."""
    if len(values) < 2:
        return {"spearman": math.nan, "top_k_overlap": math.nan, "k": 0, "unstable": True, "halves": items}
    values = values.double()
    parts = []
    for half in halves(len(values)):
        if den is None:
            parts.append(values[half].mean(0))
        else:
            d = den.double()[half].sum(0)
            parts.append(values[half].sum(0) / (d if d.ndim else d.expand(values.shape[1])))
    return {**stability(*parts, k=k), "halves": items}
