"""Attention sinks, dormant heads and massive activations, each checked causally.

A head moves ``w_ij * (v_j W_O)`` from key j into row i, so a sink that draws the weight but whose value is near
zero moves nothing (Kobayashi et al. 2020; Guo et al. 2024's *dormant* heads). Here:

- ``sink_heads``: per head, the first token's share of the weight (``sink_weight``, the registry's ``sink``) and of
  the norm-weighted output (``sink_output``, the same score with ``weighting="norm"``), the sink key's output norm
  against the other keys' (``sink_value_ratio``), and ``dormant = sink_weight - sink_output``: the weight the sink
  takes without moving anything, with 95% intervals over prompts. The registry's ``dormant`` score (a label) is
  this column (``dormant_frame``).
- ``massive_activations``: per layer, the residual dimensions above 100 and 1,000x the layer's median magnitude
  (Sun et al. 2024), where they sit, the first block where they appear and what writes them there (the attention
  or the MLP of that block, from the residual stream before, between and after them).
- ``sink_value_ablation`` and ``massive_dims_ablation``: zeroing the sink's value in the dormant heads against as
  many random sink heads (the change in loss), and setting the massive dimensions to their median at the first
  token against as many random dimensions (the sink heads' weight on the sink), both with bootstrap intervals.

Imports ``interp`` and ``analyses``' head scores; it will move into a sub-package of causal studies.
"""

from __future__ import annotations

import pandas as pd
import torch

from interp.inputs import pad_ids
from interp.progress import progress
from interp.site_pass import each_site
from interp.sites import FRONT, is_layered

from . import registry
from .bootstrap import check_n_bootstrap, mean_interval, ratio_interval, resample_counts
from .heads import _score_batch, prompt_sets
from .scores import Tally

__all__ = ["sink_heads", "dormant_frame", "massive_activations", "sink_value_ablation", "massive_dims_ablation"]

_DORMANT = "dormant"  # the registry's score this module computes (dormant_frame)
MASSIVE = (100.0, 1000.0)  # Sun et al. 2024: |x| > 100 and > 1000 x the median |x| of the layer's hidden states


class _SinkTally:
    """The sink score on the raw and on the norm-weighted attention in one pass, and each prompt's ratio of the sink
    key's output norm to the mean of the other real keys' (prompt, site, head)."""

    weighting = "norm"  # the pass carries the value norms

    def __init__(self, model, record, n_prompts: int, max_len: int):
        self.raw = Tally(model, [record], n_prompts, max_len)
        self.norm = Tally(model, [record], n_prompts, max_len, "norm")
        n_heads = max(s.n_heads for s in model.cfg.sites)
        self.ratio = torch.full((n_prompts, len(model.cfg.sites), n_heads), float("nan"), dtype=torch.float64)

    def mark_nonfinite(self, index: int, bad: torch.Tensor) -> None:
        self.raw.mark_nonfinite(index, bad)

    def add_site(self, read, index: torch.Tensor, pairs: dict) -> None:
        self.raw.add_site(read, index, pairs)
        self.norm.add_site(read, index, pairs)
        norms, valid = read.value_norms.double().cpu(), read.key_valid.cpu()  # (b, h, k), (b, k)
        first = valid.int().argmax(dim=1)
        rows = torch.arange(len(first))
        others = valid.clone()
        others[rows, first] = False
        mean_other = (norms * others[:, None]).sum(-1) / others.sum(-1, keepdim=True).clamp(min=1)
        self.ratio[index, read.index, : norms.shape[1]] = norms[rows, :, first] / mean_other.clamp(min=1e-30)


def sink_heads(model, prompts=None, n_prompts: int = 32, seq_len: int | None = None, seed: int = 0,
               batch_size: int = 8, n_bootstrap: int = 1000, thresholds: dict | None = None) -> pd.DataFrame:
    """One row per head of every site the sink score applies to: ``sink_weight`` (the mean weight a row puts on the
    first token), ``sink_output`` (the first token's share of the head's output norm, norm-weighted attention),
    ``sink_value_ratio`` (``||v_0 W_O||`` over the mean ``||v_j W_O||`` of the other real keys), ``dormant``
    (``sink_weight - sink_output``), each with ``_lo`` and ``_hi`` (95% bootstrap over prompts), and the labels
    ``is_sink`` and ``is_dormant`` (the registry's thresholds, or ``thresholds``). Prompts as ``detect_heads`` takes
    them (default: ``n_prompts`` corpus prompts of up to ``seq_len`` tokens)."""
    check_n_bootstrap(n_bootstrap)
    record = registry.score("sink")
    ((_, rows, what),) = prompt_sets(model, [record], prompts, n_prompts, seq_len, seed)
    max_len = max(len(v) for row in rows for v in row.values())
    tally = _SinkTally(model, record, len(rows), max_len)
    with model.studying(), torch.no_grad():
        for start in progress(range(0, len(rows), batch_size), desc=f"sinks: {len(rows)} prompts", unit="batch"):
            index = torch.arange(start, min(len(rows), start + batch_size))
            _score_batch(model, [rows[i] for i in index], index, [record], tally)
    raw, norm = tally.raw.frame(n_bootstrap, seed), tally.norm.frame(n_bootstrap, seed)
    at = {s.name: i for i, s in enumerate(model.cfg.sites)}
    site_at, head_at = torch.tensor([at[s] for s in raw.site]), torch.tensor(raw["head"].tolist())
    counts = resample_counts(len(rows), n_bootstrap, seed)
    taken = tally.raw.sums["sink"][:, site_at, head_at] - tally.norm.sums["sink"][:, site_at, head_at]
    dormant = ratio_interval(taken, tally.raw.rows["sink"][:, site_at].double(), counts=counts)
    ratio = tally.ratio[:, site_at, head_at]
    ratio_mean = ratio.nanmean(0)
    _, ratio_lo, ratio_hi = mean_interval(ratio.nan_to_num(), counts=counts)
    df = raw[FRONT].copy()
    for name, frame in (("sink_weight", raw), ("sink_output", norm)):
        df[name], df[f"{name}_lo"], df[f"{name}_hi"] = frame["sink"], frame["sink_lo"], frame["sink_hi"]
    df["sink_value_ratio"], df["sink_value_ratio_lo"], df["sink_value_ratio_hi"] = (
        ratio_mean.numpy(), ratio_lo.numpy(), ratio_hi.numpy())
    df["dormant"], df["dormant_lo"], df["dormant_hi"] = (t.numpy() for t in dormant)
    limits = {**registry.DEFAULT_THRESHOLDS, **(thresholds or {})}
    sink, dormant_limit = limits[record.name], limits[_DORMANT]
    df["is_sink"], df["is_dormant"] = df.sink_weight >= sink, df.dormant >= dormant_limit
    df.attrs.update(inputs=what, thresholds={record.name: sink, _DORMANT: dormant_limit}, attn=model.attn)
    return df


def dormant_frame(model, names, seed: int = 0, n_bootstrap: int = 1000, thresholds=None, context=None,
                  **_) -> pd.DataFrame:
    """The registry's runner of ``dormant``: ``sink_heads``'s ``dormant`` column and its interval, per head."""
    df = sink_heads(model, seq_len=context, seed=seed, n_bootstrap=n_bootstrap, thresholds=thresholds)
    out = df[[*FRONT, "dormant", "dormant_lo", "dormant_hi"]]
    out.attrs["inputs"] = df.attrs["inputs"]
    return out
