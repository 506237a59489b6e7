"""Plots of attention heads: one head's pattern, a score per head, an ablation scan, a pruning curve.

Every function draws on ``ax`` (a new figure when None), returns the Axes, and never calls ``plt.show()``:
they work with the Agg backend, in notebooks and in the report alike.

>>> import matplotlib; matplotlib.use("Agg")
>>> import pandas as pd
>>> df = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "induction": [0.1, 0.0, 0.9, 0.2],
...                    "label": ["none", "none", "induction", "none"]})
>>> head_score_grid(df, "induction").get_title()
'induction (framed: labelled induction)'
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import torch
from matplotlib.patches import Rectangle

__all__ = ["attention_heatmap", "head_score_grid", "ablation_heatmap", "pruning_curve_plot", "patching_heatmap", "dla_bars",
           "clean_token"]

_FRACTION_SCORES = {"previous_token", "next_token", "self", "sink", "duplicate_token", "induction",
                    "positional_fraction"}
_LABEL_OF = {"positional_fraction": "positional"}  # score column -> the label it supports


# -- attention pattern -----------------------------------------------------------------------------------
def clean_token(token: str) -> str:
    """A token string fit for a tick label: BPE space/newline markers made visible, ``$`` escaped (matplotlib
    would read it as mathtext)."""
    token = str(token).replace("Ġ", "␣").replace("▁", "␣").replace("Ċ", "\\n").replace("\n", "\\n")
    return token.replace("$", r"\$")


def attention_heatmap(source, layer: int | None = None, head: int | None = None, text=None, *,
                      tokens: Sequence[str] | None = None, batch: int = 0, window: tuple[int, int] | None = None,
                      ax=None, cmap: str = "viridis", title: str | None = None):
    """One head's attention pattern as a heatmap, queries down, keys across, labelled with their tokens.

    source: what to read the pattern from:
      - an ``ActivationCache`` from ``model.run_with_cache`` (either attention path: on flash the head's
        pattern is rebuilt from the cached q and k); ``batch`` picks the sequence, padding is dropped;
      - a ``HookedModel`` together with ``text`` (a string, or token ids ``(p,)``): it runs the text once;
      - a pattern tensor ``(q, k)`` (``layer``/``head`` then only name the title).
    tokens: tick labels (default: the model's token strings; position numbers for a cache or tensor).
    window: ``(start, stop)``: show only queries and keys in positions ``start .. stop - 1`` (Python slice
      rules, negatives allowed) of a longer sequence. Token labels stay readable up to about 64 tokens.
    Returns the Axes. Attention from a query row to keys outside the window is not shown, so rows of a
    window need not sum to 1.
    """
    pattern, tokens, name = _pattern_of(source, layer, head, text, tokens, batch)
    n = pattern.shape[0]
    lo, hi = (0, n) if window is None else _window(window, n)
    pattern, tokens = pattern[lo:hi, lo:hi], tokens[lo:hi]
    positions = range(lo, hi)
    labels = [clean_token(t) for t in tokens]
    m = len(labels)
    if ax is None:
        side = min(max(4.0, 0.17 * m + 1.8), 16.0)
        _, ax = plt.subplots(figsize=(side + 1.0, side), layout="constrained")
    size = 9 if m <= 24 else 7 if m <= 48 else 5.5 if m <= 80 else 4
    every = max(1, int(np.ceil(m / 100)))  # beyond ~100 tokens, label every k-th
    sns.heatmap(pattern.numpy(), ax=ax, cmap=cmap, vmin=0.0, vmax=float(max(pattern.max(), 1e-6)), square=True,
                cbar_kws={"label": "attention weight", "shrink": 0.6})
    ticks = np.arange(0, m, every)
    ax.set_xticks(ticks + 0.5, [labels[i] for i in ticks], rotation=90, fontsize=size)
    ax.set_yticks(ticks + 0.5, [f"{labels[i]} {positions[i]}" if window is not None else labels[i] for i in ticks],
                  rotation=0, fontsize=size)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    span = "" if window is None else f", positions {lo}..{hi - 1}"
    ax.set_title(title if title is not None else f"{name}{span}")
    return ax


def _pattern_of(source, layer, head, text, tokens, batch) -> tuple[torch.Tensor, list[str], str]:
    """(pattern (q, k) as float32 on CPU, token labels, title)."""
    from hooks import ActivationCache
    from interp import HookedModel

    if isinstance(source, torch.Tensor):
        if source.ndim != 2:
            raise ValueError(f"A pattern tensor must be one head's (q, k); got shape {tuple(source.shape)}. Index it "
                             "first, e.g. cache.pattern(layer, head)[0, 0].")
        pattern = source.detach().float().cpu()
        name = "attention" if layer is None or head is None else f"head {layer}.{head}"
        return pattern, _labels(tokens, pattern.shape[0]), name
    if layer is None or head is None:
        raise ValueError("attention_heatmap needs layer and head, e.g. attention_heatmap(cache, 1, 2).")
    if isinstance(source, HookedModel):
        if text is None:
            raise ValueError("attention_heatmap(model, layer, head, text): give the text (or token ids) to run.")
        _check_head(source.cfg.heads_per_layer, layer, head)
        ids = source._inputs(text)[0][:1]  # one sequence: (1, p)
        names = [f"blocks.{layer}.attn.hook_q", f"blocks.{layer}.attn.hook_k"]
        with torch.no_grad():
            _, cache = source.run_with_cache(ids, names=names)
        pattern = cache.pattern(layer, head)[0, 0].float().cpu()
        if tokens is None:
            tokens = source.to_str_tokens(ids[0])
        return pattern, _labels(tokens, pattern.shape[0]), f"head {layer}.{head}"
    if isinstance(source, ActivationCache):
        if text is not None:
            raise ValueError("text goes with a model; a cache already holds its run. Pass tokens= for labels.")
        if source.meta is not None:
            _check_head([source.meta.heads(l)[0] for l in range(len(source.meta.scaling))], layer, head)
        full = source.pattern(layer, head)  # (b, 1, q, k)
        if not 0 <= batch < full.shape[0]:
            raise IndexError(f"batch {batch} is out of range: the cache holds {full.shape[0]} sequence(s).")
        pattern = full[batch, 0].float().cpu()
        mask = None if source.meta is None else source.meta.attention_mask
        if mask is not None:  # drop padded positions of this sequence
            keep = mask[batch].bool().cpu()
            pattern = pattern[keep][:, keep]
            if tokens is not None and len(tokens) == len(keep):
                tokens = [t for t, k in zip(tokens, keep.tolist()) if k]
        return pattern, _labels(tokens, pattern.shape[0]), f"head {layer}.{head}"
    raise TypeError(f"attention_heatmap reads an ActivationCache, a HookedModel with text, or a (q, k) tensor; "
                    f"got {type(source).__name__}.")


def _check_head(heads_per_layer: Sequence[int], layer: int, head: int) -> None:
    n_layers = len(heads_per_layer)
    if not isinstance(layer, int) or not 0 <= layer < n_layers:
        raise IndexError(f"layer {layer} is out of range: this model has layers 0..{n_layers - 1}.")
    if not isinstance(head, int) or not 0 <= head < heads_per_layer[layer]:
        raise IndexError(f"head {head} is out of range: layer {layer} has heads 0..{heads_per_layer[layer] - 1}.")


def _labels(tokens, n: int) -> list[str]:
    if tokens is None:
        return [str(i) for i in range(n)]
    tokens = list(tokens)
    if len(tokens) != n:
        raise ValueError(f"tokens has {len(tokens)} labels but the pattern has {n} positions.")
    return [str(t) for t in tokens]


def _window(window, n: int) -> tuple[int, int]:
    try:
        lo, hi, _ = slice(*window).indices(n)
    except TypeError:
        raise ValueError(f"window is (start, stop) in positions; got {window!r}.") from None
    if hi - lo < 1:
        raise ValueError(f"window {tuple(window)} selects no position of a sequence of {n}; use start < stop <= {n}.")
    return lo, hi


# -- per-head grids --------------------------------------------------------------------------------------
def _grid(df: pd.DataFrame, column: str) -> pd.DataFrame:
    """layers x heads table of ``column`` (NaN where a pruned layer has fewer heads)."""
    missing = [c for c in ("layer", "head", column) if c not in df]
    if missing:
        raise ValueError(f"The table needs columns layer, head and {column!r}; it lacks {missing}. "
                         f"Columns: {list(df.columns)}.")
    grid = df.pivot_table(index="layer", columns="head", values=column, aggfunc="first", dropna=False)
    return grid.astype(float)


def _annotation_size(grid: pd.DataFrame) -> float:
    return 9 if grid.shape[1] <= 8 else 7 if grid.shape[1] <= 12 else 5.5 if grid.shape[1] <= 16 else 4


def _new_axes(grid: pd.DataFrame):
    layers, heads = grid.shape
    _, ax = plt.subplots(figsize=(min(0.75 * heads + 2.5, 16), min(0.55 * layers + 1.6, 12)), layout="constrained")
    return ax


def head_score_grid(df: pd.DataFrame, score: str, ax=None, annotate: bool = True, fmt: str = ".2f",
                    cmap: str = "viridis", mark: bool = True):
    """A layers x heads heatmap of one score of ``detect_heads``, each cell annotated with its value.

    score: a score column (``induction``, ``previous_token``, ...; ``"positional"`` means
    ``positional_fraction``). Heads whose ``label`` is this score's class are framed in red.
    Fraction scores share the colour scale 0..1 so grids of different models compare.
    """
    column = "positional_fraction" if score == "positional" else score
    grid = _grid(df, column)
    if ax is None:
        ax = _new_axes(grid)
    fraction = column in _FRACTION_SCORES
    sns.heatmap(grid, ax=ax, cmap=cmap, vmin=0.0 if fraction else None, vmax=1.0 if fraction else None,
                annot=annotate, fmt=fmt, annot_kws={"fontsize": _annotation_size(grid)}, linewidths=0.5,
                linecolor="white", cbar_kws={"label": column})
    kind = _LABEL_OF.get(column, column)
    framed = 0
    if mark and "label" in df:
        rows, cols = list(grid.index), list(grid.columns)
        for r in df[df["label"] == kind].itertuples():
            # inset, so that neighbouring frames never make an unlabelled cell between them look framed
            ax.add_patch(Rectangle((cols.index(r.head) + 0.08, rows.index(r.layer) + 0.08), 0.84, 0.84, fill=False,
                                   edgecolor="red", linewidth=2.0, clip_on=False))
            framed += 1
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.tick_params(axis="y", rotation=0)
    ax.set_title(f"{column} (framed: labelled {kind})" if mark and "label" in df else column)
    return ax


def ablation_heatmap(df: pd.DataFrame, value: str = "delta", ax=None, annotate: bool = True, fmt: str = ".2f",
                     cmap: str = "RdBu_r", metric_name: str | None = None):
    """A layers x heads heatmap of an ``ablation_scan``: by default ``delta`` (the metric with the head ablated
    minus the baseline), on a diverging scale centred at 0 (red: the metric went up, blue: down)."""
    grid = _grid(df, value)
    if ax is None:
        ax = _new_axes(grid)
    limit = float(np.nanmax(np.abs(grid.to_numpy()))) if grid.notna().any().any() else 1.0
    center = 0.0 if value == "delta" else None
    sns.heatmap(grid, ax=ax, cmap=cmap, center=center, vmin=-limit if center is not None else None,
                vmax=limit if center is not None else None, annot=annotate, fmt=fmt,
                annot_kws={"fontsize": _annotation_size(grid)}, linewidths=0.5, linecolor="white",
                cbar_kws={"label": value})
    name = metric_name or df.attrs.get("metric", "metric")
    title = f"ablation: {value} of {name}"
    if "baseline" in df and len(df):
        title += f" (baseline {float(df['baseline'].iloc[0]):.3g})"
    ax.set_title(title)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
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
    ax.set_xlim(0, max(float(df["fraction_pruned"].max()), 1e-6))
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    ax.set_title(f"pruning curve: {name}")
    return ax


# -- circuits --------------------------------------------------------------------------------------------
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
    sns.heatmap(grid, ax=ax, cmap=cmap, center=0.0, vmin=-limit, vmax=limit, annot=annotate, fmt=fmt,
                annot_kws={"fontsize": _annotation_size(grid)}, linewidths=0.5, linecolor="white",
                cbar_kws={"label": value})
    what = df.attrs.get("what", "z")
    ax.set_title(title or f"patching {what}: {value} on {df.attrs.get('metric', 'metric')}")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
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
