"""Plots of the studies' tables (importable from ``analyses`` and ``analyses.views``): a score per head
(``head_score_grid``), an ablation scan, a patching effect, the direct logit attribution, pruning curves and
streaming curves (``streaming_curve_plot``). Each draws on ``ax`` (a new figure when None) and returns the Axes; no
text is smaller than ``MIN_FONT``. The per-head grids take an encoder-decoder model's tables too (a ``site``
column): one row per attention site, in the table's order, labelled with its stack, block and kind ("encoder 0
self", "decoder 0 cross"); a score a head has not (a self-attention score of a cross-attention head, NaN in the
table) leaves its cell blank.

>>> import matplotlib; matplotlib.use("Agg")
>>> df = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "induction": [0.1, 0.0, 0.9, 0.2],
...                    "label": ["none", "none", "induction", "none"]})
>>> head_score_grid(df, "induction").get_title()
'induction (framed: labelled induction)'
"""

from __future__ import annotations

import re

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.patches import Rectangle

from interp.attention.sites import one_site_per_layer

from ..heads import registry
from .common import MIN_FONT

_SITE = re.compile(r"(encoder|decoder)\.blocks\.(\d+)\.(attn|cross_attn)")


# -- per-head grids --------------------------------------------------------------------------------------
def _site_label(site: str) -> str:
    """An encoder-decoder attention site in a few words: ``"decoder.blocks.0.cross_attn"`` -> ``"decoder 0 cross"``."""
    found = _SITE.fullmatch(str(site))
    if found is None:
        return str(site)
    stack, block, attn = found.groups()
    return f"{stack} {block} {'cross' if attn == 'cross_attn' else 'self'}"


def _grid(df: pd.DataFrame, column: str) -> pd.DataFrame:
    """layers x heads table of ``column`` (NaN where a pruned layer has fewer heads); for a table with a ``site``
    column, sites x heads in the table's order, indexed by ``_site_label``."""
    where = "layer" if one_site_per_layer(df) else "site"
    missing = [c for c in (where, "head", column) if c not in df]
    if missing:
        raise ValueError(f"The table needs columns {where}, head and {column!r}; it lacks {missing}. "
                         f"Columns: {list(df.columns)}.")
    grid = df.pivot_table(index=where, columns="head", values=column, aggfunc="first", dropna=False)
    if where == "site":  # a row per site even where every value is NaN, in the order the model runs them
        order = list(pd.unique(df["site"]))
        grid = grid.reindex(order)
        grid.index = pd.Index([_site_label(s) for s in order], name="site")
    return grid.astype(float)


def _row_of(grid: pd.DataFrame, r) -> int:
    """The grid row of a table row ``r`` (a namedtuple of the table)."""
    return list(grid.index).index(_site_label(r.site) if grid.index.name == "site" else r.layer)


def _annotation_size(grid: pd.DataFrame) -> float:
    return 9 if grid.shape[1] <= 8 else MIN_FONT


def _cell_points(ax, grid: pd.DataFrame) -> float:
    """Width of one cell in points, leaving a fifth of the axes to the colour bar that seaborn adds."""
    return ax.get_position().width * ax.figure.get_size_inches()[0] * 72 * 0.8 / grid.shape[1]


def _annotates(grid: pd.DataFrame, annotate: bool) -> bool:
    """Cells carry their values up to 16 heads a layer; beyond, text that fits a cell would be under 7.5 pt."""
    return annotate and grid.shape[1] <= 16


def _new_axes(grid: pd.DataFrame):
    layers, heads = grid.shape
    _, ax = plt.subplots(figsize=(min(0.75 * heads + 2.5, 16), min(0.55 * layers + 1.6, 12)), layout="constrained")
    return ax


def head_score_grid(df: pd.DataFrame, score: str, ax=None, annotate: bool = True, fmt: str = ".2f",
                    cmap: str = "viridis", mark: bool = True, intervals: bool = True, interval_fmt: str = ".3f"):
    """A layers x heads heatmap of one score of ``detect_heads``, each cell annotated with its value (for an
    encoder-decoder model, sites x heads; see the module docstring).

    score: a score column (``induction``, ``previous_token``, ...; ``"positional"`` means
    ``positional_fraction``). Heads whose ``label`` is this score's class are framed in red.
    Fraction scores share the colour scale 0..1 so grids of different models compare.
    intervals: below each value, its 95% bootstrap interval (``<score>_lo`` to ``<score>_hi``), both written with
    ``interval_fmt``, when the table has them and the cells are wide enough (about 0.7 inch); else values only.
    """
    record = registry.of_column(score)
    column = record.label_column if record is not None else score
    grid = _grid(df, column)
    if ax is None:
        ax = _new_axes(grid)
    fraction = registry.is_fraction(column)
    annot, size = _annotates(grid, annotate), _annotation_size(grid)
    if annot and intervals and f"{column}_lo" in df and f"{column}_hi" in df and \
            _cell_points(ax, grid) >= 0.6 * MIN_FONT * len(f"{0:{interval_fmt}}–{0:{interval_fmt}}"):
        lo, hi, f = _grid(df, f"{column}_lo"), _grid(df, f"{column}_hi"), interval_fmt
        cell = lambda v, a, b: "" if v != v else f"{v:{f}}" if a != a else f"{v:{f}}\n{a:{f}}–{b:{f}}"  # noqa: E731
        # by hand, not np.vectorize: its object loop reports a floating-point "invalid" flag that NaN cells raise
        cells = zip(grid.to_numpy(), lo.to_numpy(), hi.to_numpy())
        annot = np.array([[cell(*x) for x in zip(*rows)] for rows in cells], dtype=object)
        size = MIN_FONT
    sns.heatmap(grid, ax=ax, cmap=cmap, vmin=0.0 if fraction else None, vmax=1.0 if fraction else None,
                annot=annot, fmt=fmt if isinstance(annot, bool) else "", annot_kws={"fontsize": size},
                linewidths=0.5, linecolor="white", cbar_kws={"label": column})
    kind = record.gives if record is not None else column
    if mark and "label" in df:
        cols = list(grid.columns)
        labelled = df["label"].map(lambda text: isinstance(text, str) and kind in text.split("+"))
        for r in df[labelled].itertuples():
            # inset, so that neighbouring frames never make an unlabelled cell between them look framed
            ax.add_patch(Rectangle((cols.index(r.head) + 0.08, _row_of(grid, r) + 0.08), 0.84, 0.84, fill=False,
                                   edgecolor="red", linewidth=2.0, clip_on=False))
    _mark_nan_heads(ax, df, grid, size)
    ax.set_xlabel("head")
    ax.set_ylabel(grid.index.name)
    ax.tick_params(axis="y", rotation=0)
    ax.set_title(f"{column} (framed: labelled {kind})" if mark and "label" in df else column)
    return ax


def _mark_nan_heads(ax, df: pd.DataFrame, grid: pd.DataFrame, size: float) -> None:
    """Heads ``detect_heads`` labelled ``"nan"`` (their attention held NaN or inf) as hatched grey cells reading
    "NaN", distinct from a blank cell (no such head) and from any score."""
    if "label" not in df:
        return
    cols = list(grid.columns)
    for r in df[df["label"] == "nan"].itertuples():
        x, y = cols.index(r.head), _row_of(grid, r)
        ax.add_patch(Rectangle((x, y), 1, 1, facecolor="0.85", edgecolor="0.35", hatch="xx", linewidth=0.0,
                               gid="nan-head"))
        ax.text(x + 0.5, y + 0.5, "NaN", ha="center", va="center", fontsize=size, color="black")


def ablation_heatmap(df: pd.DataFrame, value: str = "delta", ax=None, annotate: bool = True, fmt: str = ".2f",
                     cmap: str = "RdBu_r", metric_name: str | None = None):
    """A layers x heads heatmap of an ``ablation_scan``: by default ``delta`` (the metric with the head ablated
    minus the baseline), on a diverging scale centred at 0 (red: the metric went up, blue: down). A table with a
    ``site`` column (an encoder-decoder model's) has a row per site."""
    grid = _grid(df, value)
    if ax is None:
        ax = _new_axes(grid)
    limit = float(np.nanmax(np.abs(grid.to_numpy()))) if grid.notna().any().any() else 1.0
    center = 0.0 if value == "delta" else None
    sns.heatmap(grid, ax=ax, cmap=cmap, center=center, vmin=-limit if center is not None else None,
                vmax=limit if center is not None else None, annot=_annotates(grid, annotate), fmt=fmt,
                annot_kws={"fontsize": _annotation_size(grid)}, linewidths=0.5, linecolor="white",
                cbar_kws={"label": value})
    name = metric_name or df.attrs.get("metric", "metric")
    title = f"ablation: {value} of {name}"
    if "baseline" in df and len(df):
        title += f" (baseline {float(df['baseline'].iloc[0]):.3g})"
    ax.set_title(title)
    ax.set_xlabel("head")
    ax.set_ylabel(grid.index.name)
    ax.tick_params(axis="y", rotation=0)
    return ax


# -- pruning curve ---------------------------------------------------------------------------------------
_ORDER_STYLE = {"importance": ("C0", "-", "o"), "ablation": ("C2", "-", "s"), "random": ("0.35", "--", None)}


def pruning_curve_plot(df: pd.DataFrame, ax=None, metric_name: str | None = None, threshold: float | None = None):
    """The metric against the fraction of heads pruned, one line per order (``pruning_curve`` rows).

    An order with several seeds (random) is drawn as its mean, with the range over seeds shaded.
    threshold: draw a horizontal reference line (e.g. 0.95 similarity).
    """
    missing = [c for c in ("fraction_pruned", "metric", "order") if c not in df]
    if missing:
        raise ValueError(f"pruning_curve_plot needs pruning_curve's columns; the table lacks {missing}.")
    if not len(df):
        raise ValueError("pruning_curve_plot got an empty table.")
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    for i, (order, part) in enumerate(df.groupby("order", sort=False)):
        color, style, marker = _ORDER_STYLE.get(order, (f"C{i + 3}", "-", "o"))
        stats = part.groupby("fraction_pruned")["metric"].agg(["mean", "min", "max", "count"]).sort_index()
        n_seeds = int(part["seed"].nunique()) if "seed" in part else 1
        label = order if n_seeds <= 1 else f"{order} (mean of {n_seeds} seeds, range shaded)"
        ax.plot(stats.index, stats["mean"], color=color, linestyle=style, marker=marker, markersize=4, label=label)
        if n_seeds > 1:
            ax.fill_between(stats.index, stats["min"], stats["max"], color=color, alpha=0.2, linewidth=0)
    if threshold is not None:
        ax.axhline(threshold, color="0.6", linewidth=0.8, linestyle=":")
    name = metric_name or df.attrs.get("metric", "metric")
    ax.set_xlabel("fraction of heads pruned")
    ax.set_ylabel(name)
    # a margin either side: at xlim = (0, last step) the last markers were cut in half and the curves and band ran
    # into the right edge as if they went on (issue 35)
    lo, hi = float(df["fraction_pruned"].min()), float(df["fraction_pruned"].max())
    pad = 0.03 * max(hi - lo, 0.1)
    ax.set_xlim(lo - pad, hi + pad)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    ax.set_title(f"pruning curve: {name}")
    return ax


# -- circuits --------------------------------------------------------------------------------------------
def streaming_curve_plot(df: pd.DataFrame, ax=None):
    """The metric against the fraction of heads streaming, one line per order (random seeds: mean, range shaded),
    with the KV-cache fraction on a second axis."""
    missing = [c for c in ("fraction_streaming", "metric", "order", "kv_fraction") if c not in df]
    if missing or not len(df):
        raise ValueError(f"streaming_curve_plot needs streaming_curve's rows; the table lacks {missing or 'rows'}.")
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    for i, (order, part) in enumerate(df.groupby("order", sort=False)):
        stats = part.groupby("fraction_streaming")["metric"].agg(["mean", "min", "max"]).sort_index()
        n_seeds = int(part["seed"].nunique())
        label = order if n_seeds <= 1 else f"{order} (mean of {n_seeds} seeds, range shaded)"
        ax.plot(stats.index, stats["mean"], color=f"C{i}", marker="o", markersize=4, label=label)
        if n_seeds > 1:
            ax.fill_between(stats.index, stats["min"], stats["max"], color=f"C{i}", alpha=0.2, linewidth=0)
    kv = df.groupby("fraction_streaming")["kv_fraction"].mean().sort_index()
    twin = ax.twinx()
    twin.plot(kv.index, kv.values, color="0.5", linestyle=":", label="KV cache (share of full)")
    twin.set_ylim(0, 1.05)
    twin.set_ylabel(f"KV cache at {df.attrs.get('kv_tokens', '?')} tokens (share of full)")
    ax.set_xlabel(f"fraction of heads streaming (sink {df.attrs.get('sink')}, window {df.attrs.get('window')})")
    ax.set_ylabel(df.attrs.get("metric", "metric"))
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, loc="upper left")
    ax.set_title("streaming curve")
    return ax


def patching_heatmap(df: pd.DataFrame, value: str = "effect", ax=None, annotate: bool = True, fmt: str = ".2f",
                     cmap: str = "RdBu_r", title: str | None = None):
    """A layers x heads heatmap of ``activation_patching``, ``attribution_patching`` or ``path_patching``
    (``by="head"``): by default the normalised ``effect`` (0: the corrupted run, 1: the clean run), diverging at
    0 so that heads that push the other way show blue."""
    if "pos" in df:
        raise ValueError("patching_heatmap draws by='head' results; sum or select positions first, e.g. "
                         "df.groupby(['layer', 'head'], as_index=False)['effect'].sum().")
    grid = _grid(df, value)
    if ax is None:
        ax = _new_axes(grid)
    limit = float(np.nanmax(np.abs(grid.to_numpy()))) if grid.notna().any().any() else 1.0
    limit = limit or 1.0
    sns.heatmap(grid, ax=ax, cmap=cmap, center=0.0, vmin=-limit, vmax=limit, annot=_annotates(grid, annotate),
                fmt=fmt, annot_kws={"fontsize": _annotation_size(grid)}, linewidths=0.5, linecolor="white",
                cbar_kws={"label": value})
    what = df.attrs.get("what", "z")
    ax.set_title(title or f"patching {what}: {value} on {df.attrs.get('metric', 'metric')}")
    ax.set_xlabel("head")
    ax.set_ylabel(grid.index.name or "layer")
    ax.tick_params(axis="y", rotation=0)
    return ax


def dla_bars(df: pd.DataFrame, top: int = 20, ax=None, title: str | None = None):
    """The ``top`` components of a ``direct_logit_attribution`` by size, as horizontal bars (red: towards the
    answer, blue: against it)."""
    names = [("embed" if c == "embed" else f"head {l}.{h}" if c == "head" else f"mlp {l}" if c == "mlp" else c)
             for c, l, h in zip(df["component"], df["layer"], df["head"])]
    values = df["attribution"].to_numpy(dtype=float)
    order = np.argsort(-np.abs(values))[:top][::-1]
    if ax is None:
        _, ax = plt.subplots(figsize=(6.0, 0.3 * len(order) + 1.2), layout="constrained")
    ax.barh([names[i] for i in order], values[order], color=["#b2182b" if values[i] > 0 else "#2166ac" for i in order])
    ax.axvline(0.0, color="0.3", lw=0.8)
    target = "logit difference" if df.attrs.get("wrong") is not None else "logit"
    ax.set_xlabel(f"direct contribution to the {target}")
    ax.set_title(title or f"direct logit attribution ({target} {df.attrs.get('logit', float('nan')):.2f})")
    return ax
