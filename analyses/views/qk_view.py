"""One head's query/key attribution (``analyses.explain.qk_attribution``) as a figure: the (query component x key component)
heatmap of the mean score over the pairs, and the upstream components that raise the score most on each side, with
the causal check's drops (the top heads against random heads of the same layers) in the panel titles."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from ..explain.qk_causal import causal_summary
from .common import MIN_FONT

__all__ = ["qk_attribution_plot"]


def _head_of(df: pd.DataFrame, head) -> tuple[str, int]:
    """``(site, head)`` of the head to draw: the only one in the table, or the one named (``(layer, head)`` or
    ``(site, head)``)."""
    heads = list(dict.fromkeys(zip(df["site"], df["head"].astype(int), df["layer"].astype(int))))
    if head is None:
        if len(heads) != 1:
            raise ValueError(f"this table explains {len(heads)} heads; give head=(layer, head) or (site, head), one of "
                             f"{[(s, h) for s, h, _ in heads]}.")
        return heads[0][0], heads[0][1]
    for site, h, layer in heads:
        if (head[0] == site or head[0] == layer) and head[1] == h:
            return site, h
    raise ValueError(f"head {head!r} is not in this table; it explains {[(s, h) for s, h, _ in heads]}.")


def _keep(weight: np.ndarray, top: int) -> list[int]:
    """The ``top`` entries of largest size, in their order."""
    order = np.argsort(-np.abs(weight))[:top]
    return sorted(order.tolist())


def qk_attribution_plot(df: pd.DataFrame, head=None, top: int = 12, figsize=(12.0, 5.5)):
    """A figure of one head of a ``qk_attribution`` table (``head``: needed when it has several): left, the mean
    contribution of each (query component, key component) to the score, the ``top`` components of each side by the
    size of their marginal and the rest summed as ``other``; right, the ``top`` components of each side by their
    term (query-side and key-side bars), titled with the causal check where the table has one."""
    if not isinstance(df, pd.DataFrame) or "query" not in df or "matrices" not in df.attrs:
        raise TypeError("qk_attribution_plot draws the table analyses.qk_attribution returns (with its attrs); got "
                        f"{type(df).__name__}.")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be a positive integer; got {top!r}.")
    site, h = _head_of(df, head)
    matrix = df.attrs["matrices"][f"{site}:{h}"]
    values = np.asarray(matrix["values"], dtype=float)
    rows, cols = _keep(values.sum(1), top), _keep(values.sum(0), top)
    shown = _fold(values, rows, cols)
    row_labels = [matrix["rows"][i] for i in rows] + (["other"] if len(rows) < values.shape[0] else [])
    col_labels = [matrix["cols"][i] for i in cols] + (["other"] if len(cols) < values.shape[1] else [])
    shown = shown[: len(row_labels), : len(col_labels)]
    fig, (left, right) = plt.subplots(1, 2, figsize=figsize, gridspec_kw={"width_ratios": [1.2, 1.0]})
    limit = float(np.abs(shown).max()) or 1.0
    image = left.imshow(shown, cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    left.set_xticks(range(len(col_labels)), col_labels, rotation=90, fontsize=MIN_FONT)
    left.set_yticks(range(len(row_labels)), row_labels, fontsize=MIN_FONT)
    left.set_xlabel("key-side component")
    left.set_ylabel("query-side component")
    left.set_title(f"{site} head {h}: mean score {values.sum():.3g} over {matrix['pairs']} pairs",
                   fontsize=MIN_FONT + 1)
    fig.colorbar(image, ax=left, fraction=0.046, pad=0.04, label="contribution to the score")
    _bars(right, df[(df["site"] == site) & (df["head"] == h)], top)
    summary = causal_summary([r for r in df.attrs.get("causal", []) if r["site"] == site and r["head"] == h])
    if not summary.empty:
        right.set_title("\n".join(f"{r.side} side: removing {r.removed} drops attention {r.top_drop:.3f} (random "
                                  f"{r.random_q05:.3f} to {r.random_q95:.3f})" for r in summary.itertuples()),
                        fontsize=MIN_FONT)
    fig.tight_layout()
    return fig


def _fold(values: np.ndarray, rows: list[int], cols: list[int]) -> np.ndarray:
    """The kept rows and columns, then one ``other`` row and column holding the rest."""
    other_r = [i for i in range(values.shape[0]) if i not in rows]
    other_c = [j for j in range(values.shape[1]) if j not in cols]
    out = np.zeros((len(rows) + 1, len(cols) + 1))
    out[:-1, :-1] = values[np.ix_(rows, cols)]
    out[:-1, -1] = values[np.ix_(rows, other_c)].sum(1) if other_c else 0.0
    out[-1, :-1] = values[np.ix_(other_r, cols)].sum(0) if other_r else 0.0
    out[-1, -1] = values[np.ix_(other_r, other_c)].sum() if other_r and other_c else 0.0
    return out


def _bars(ax, rows: pd.DataFrame, top: int) -> None:
    """Horizontal bars: the ``top`` components by query-side and by key-side term, side by side."""
    parts = []
    for side, colour in (("key", "#c44e52"), ("query", "#4c72b0")):
        best = rows.dropna(subset=[side]).sort_values(side, ascending=False).head(top)
        parts += [(f"{r.label} ({side[0]})", getattr(r, side), colour) for r in best.itertuples()]
    parts = parts[::-1]
    ax.barh(range(len(parts)), [p[1] for p in parts], color=[p[2] for p in parts])
    ax.set_yticks(range(len(parts)), [p[0] for p in parts], fontsize=MIN_FONT)
    ax.axvline(0.0, color="black", linewidth=0.5)
    ax.set_xlabel("term in the score (mean over pairs); (k) key side, (q) query side")
