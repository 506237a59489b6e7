"""Plots of attention heads: one head's pattern (``attention_heatmap``) and ``save_figure``, which writes PNG, SVG
or PDF (vector, for papers). The plots of the studies' tables (a score per head, an ablation scan, a pruning
curve, ...) are in ``study_plots``.

Every function draws on ``ax`` (a new figure when None), returns the Axes, and never calls ``plt.show()``:
they work with the Agg backend, in notebooks and in the report alike. No text is smaller than 7.5 pt, which is
10.4 px where a figure is shown at 100 px per inch (the report shows 2x PNGs at that size); grids too dense for
that leave their cells unannotated.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import seaborn as sns
import torch
from matplotlib.figure import FigureBase

from hooks.names import hook_name

from .common import MIN_FONT, _window, model_tokens
from .fonts import clean_token, token_labels

__all__ = ["attention_heatmap", "save_figure"]

FORMATS = ("png", "svg", "pdf")


# -- attention pattern -----------------------------------------------------------------------------------
def _is_index(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def attention_heatmap(source, layer: int | None = None, head: int | None = None, text=None, *,
                      tokens: Sequence[str] | None = None, batch: int = 0, window: tuple[int, int] | None = None,
                      ax=None, cmap: str = "viridis", title: str | None = None,
                      key_tokens: Sequence[str] | None = None):
    """One head's attention pattern as a heatmap, queries down, keys across, labelled with their tokens.

    source: what to read the pattern from:
      - an ``ActivationCache`` from ``model.run_with_cache`` (either attention path: on flash the head's
        pattern is rebuilt from the cached q and k); ``batch`` picks the sequence, padding is dropped;
      - a ``HookedModel`` together with ``text`` (a string, or token ids ``(p,)``): it runs the text once; the
        model-first order of the other views works too, ``attention_heatmap(model, text, layer, head)``;
      - a pattern tensor ``(q, k)`` (``layer``/``head`` then only name the title).
    tokens: tick labels (default: the model's token strings; position numbers for a cache or tensor).
    window: ``(start, stop)``: show only queries and keys in positions ``start .. stop - 1`` (Python slice
      rules, negatives allowed) of a longer sequence. Token labels stay readable up to about 64 tokens.
    key_tokens: with a ``(q, k)`` tensor whose keys are another sequence than its queries (an encoder-decoder
      model's cross-attention: target queries, source keys), the keys' labels; ``tokens`` label the queries.
    Returns the Axes. Attention from a query row to keys outside the window is not shown, so rows of a
    window need not sum to 1.
    """
    if layer is not None and not _is_index(layer):  # the model-first order of head_view: (model, text, layer, head)
        text, layer, head = layer, head, text
    for what, value in (("layer", layer), ("head", head)):
        if value is not None and not _is_index(value):
            shown = repr(value) if len(repr(value)) < 60 else repr(value)[:57] + "..."
            raise TypeError(f"attention_heatmap(source, text, layer, head) or (source, layer, head, text=...): {what} "
                            f"must be an integer; got {type(value).__name__} {shown}.")
    pattern, tokens, name = _pattern_of(source, layer, head, text, tokens, batch)
    if not bool(torch.isfinite(pattern).all()):
        raise ValueError(f"The attention pattern of {name} holds NaN or inf: the model computed non-finite values "
                         "(check its weights and inputs, or the dtype's range). A heatmap would draw them as "
                         "weights or leave them blank.")
    if key_tokens is not None or pattern.shape[0] != pattern.shape[1]:  # queries and keys of two sequences
        if key_tokens is None or window is not None:
            raise ValueError(f"A ({pattern.shape[0]}, {pattern.shape[1]}) pattern has queries and keys of two "
                             "sequences: label its keys with key_tokens= (window= is for one sequence).")
        keys = _labels(key_tokens, pattern.shape[1])
    n = pattern.shape[0]
    lo, hi = _window(window, n)
    pattern, tokens = (pattern[lo:hi, lo:hi], tokens[lo:hi]) if key_tokens is None else (pattern, tokens)
    positions = range(lo, hi)
    labels, families = token_labels(clean_token(t) for t in tokens)  # fonts that draw them; \uXXXX where none does
    key_labels, key_families = (labels, families) if key_tokens is None else \
        token_labels(clean_token(t) for t in keys)
    m = max(len(labels), len(key_labels))
    if ax is None:
        side = min(max(4.0, 0.17 * m + 1.8), 16.0)
        _, ax = plt.subplots(figsize=(side + 1.0, side), layout="constrained")
    size = 9 if m <= 24 else MIN_FONT
    sns.heatmap(pattern.numpy(), ax=ax, cmap=cmap, vmin=0.0, vmax=float(max(pattern.max(), 1e-6)), square=True,
                cbar_kws={"label": "attention weight", "shrink": 0.6})
    every = _label_step(ax, m, size)  # label every k-th token where rows are too thin for their labels
    ticks, key_ticks = np.arange(0, len(labels), every), np.arange(0, len(key_labels), every)
    ax.set_xticks(key_ticks + 0.5, [key_labels[i] for i in key_ticks], rotation=90, fontsize=size,
                  fontfamily=key_families)
    ax.set_yticks(ticks + 0.5, [f"{labels[i]} {positions[i]}" if window is not None else labels[i] for i in ticks],
                  rotation=0, fontsize=size, fontfamily=families)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    span = "" if window is None else f", positions {lo}..{hi - 1}"
    ax.set_title(title if title is not None else f"{name}{span}")
    return ax


def _label_step(ax, m: int, size: float) -> int:
    """Label every k-th of ``m`` rows so that labels of ``size`` points do not overlap on ``ax`` (square cells)."""
    box = ax.get_position()
    width, height = ax.figure.get_size_inches()
    cell = min(box.width * width, box.height * height) * 72 / m  # points per row, before labels take room
    return max(1, int(np.ceil(1.3 * size / cell)))


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
        names = [hook_name("q", layer), hook_name("k", layer)]
        with source.studying(), torch.no_grad():  # eval mode, the RNG untouched: no dropout in the pattern drawn
            _, cache = source.run_with_cache(ids, names=names)
        pattern = cache.pattern(layer, head)[0, 0].float().cpu()
        if tokens is None:
            tokens = model_tokens(source, ids[0])
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


# -- files -----------------------------------------------------------------------------------------------
def save_figure(figure, path, fmt: str | None = None, dpi: int = 200, overwrite: bool = False) -> Path:
    """Write a figure (or the figure of an Axes) as PNG (``dpi`` pixels per inch), SVG or PDF (vector, for papers).

    fmt: ``"png"``, ``"svg"`` or ``"pdf"``; default the file's suffix. Returns the path written. The file is written
    whole or not at all; an existing one is replaced only with ``overwrite=True``.
    """
    path = Path(path)
    fig = figure if isinstance(figure, FigureBase) else figure.figure  # a figure, or an Axes on one
    fmt = (fmt or path.suffix.lstrip(".")).lower()
    if fmt not in FORMATS:
        raise ValueError(f"Figures are saved as {', '.join(FORMATS)}; got {fmt or 'no suffix'!r} for {str(path)!r}.")
    from interp.runtime.files import atomic_write, refuse_overwrite

    refuse_overwrite(path, overwrite)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=dpi, bbox_inches="tight")
    return atomic_write(path, buffer.getvalue(), overwrite=overwrite)
