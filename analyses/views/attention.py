"""Interactive attention views that work offline: a bertviz-style head view and a grid of every head.

Each view is one piece of HTML: in a notebook its ``_repr_html_``, on disk one page written by ``.save(path)``.
The JavaScript and CSS (``assets/view.js``, ``assets/view.css``: vanilla, no library) and the data (a JSON block)
are inline, so the page makes no request of any kind. The interactive elements carry stable ``data-role``,
``data-layer``, ``data-head`` and ``data-token`` attributes for tests and scripts.

Every model is a list of attention *sites* (``model.cfg.sites``, read by ``runs.py``) and the selector picks one: on
a decoder-only or encoder model the sites are the layers ("layer 3"); an encoder-decoder model's are named in the
page by stack, block and kind ("encoder 0 self", "decoder 0 self", "decoder 0 cross"), ``data-layer`` is the site's
index in ``model.cfg.sites`` and ``data-site`` its name. Encoder self-attention shows source tokens on both sides,
decoder self-attention target tokens, cross-attention target tokens (queries) against source tokens (keys).

Patterns come from ``cache.pattern(layer, heads)``: on the flash path only the heads shown are rebuilt from the
cached q and k, so long prompts never need the eager path. Weights are embedded rounded to 4 decimals (uint16
0..10000, base64); where every weight above the diagonal rounds to 0 (causal models) only the lower triangle is
kept. The weight shown on hover is the pattern's weight to those 4 decimals.

>>> import torch
>>> from hooks import ActivationCache
>>> cache = ActivationCache({"blocks.0.attn.hook_pattern": torch.eye(3)[None, None]})
>>> view = head_view(cache, ["a", "b", "c"])
>>> view.data["layers"], view.data["heads"], view.data["packed"]
([0], [[0]], True)
"""

from __future__ import annotations

import numpy as np
from interp.attention.sites import one_site_per_layer

from ..heads.labels import NO_CLASS
from ..heads import registry
from .common import MAX_BYTES, SCALE, AttentionGrid, HeadView, _b64, _quantise, _window, model_tokens, visible_token
from .runs import SIDES, _Run, places_of, site_indices

__all__ = ["head_view", "attention_grid", "HeadView", "AttentionGrid", "visible_token", "model_tokens"]

LINES_UP_TO = 128  # tokens; longer views open on the heatmap display (lines need a row per token)


# -- public functions ------------------------------------------------------------------------------------
def head_view(source, text_or_tokens=None, layers=None, heads=None, *, window: tuple[int, int] | None = None,
              batch: int = 0, display: str | None = None, title: str | None = None,
              weighting: str = "raw") -> HeadView:
    """bertviz's head view: query tokens on the left, key tokens on the right, a line per weight.

    source: a ``HookedModel`` with ``text_or_tokens`` (a text, token ids ``(p,)`` or ``(b, p)``, or
      ``model.to_batch`` output), run once capturing q and k; or an ``ActivationCache`` from ``run_with_cache``
      (either path) with ``text_or_tokens`` the token strings to label it with (default: positions).
    layers: a layer or layers to offer in the selector (default all), by number or site name (``"blocks.3.attn"``).
      heads: head indices shown in each of them (default all), or ``(layer, head)`` or ``(site, head)`` pairs
      (then ``layers`` follows from them). The view opens on the first head's layer (or the first layer given).
    window: ``(start, stop)``: only positions ``start .. stop - 1`` (slice rules) of a longer prompt; hovering a
      query also shows how much of its weight falls outside the window.
    batch: the sequence of a batch to show; padding is dropped. display: ``"lines"`` or ``"matrix"`` (one
      heatmap per head); default lines up to 128 tokens.
    weighting: ``"raw"`` (the attention weights) or ``"norm"``: norm-weighted attention, each row's share of the
      head's output norm that comes from each key, ``||w_ij v_j W_O|| / sum_k ||w_ik v_k W_O||`` (Kobayashi et al.
      2020; a sink whose value is near zero shows as nothing); needs the model as source. The page says which.

    Encoder-decoder models (T5, BART, ...) show one attention *site* at a time, as others show one layer:
      source: the model with ``text_or_tokens`` one of
        - a ``(source, target)`` pair, each a text, a list of texts, token ids ``(p,)`` or ``(b, p)``: the target
          is what the decoder should produce, fed shifted right as in training (``model.decoder_inputs``), so
          the decoder's tokens are its start token and the target but its last token;
        - a batch dict with ``input_ids`` and ``decoder_input_ids`` (``attention_mask``,
          ``decoder_attention_mask`` optional; ``labels`` instead of ``decoder_input_ids`` are shifted), e.g.
          ``analyses.data.seq2seq.copy_task(model)``: the decoder's tokens are ``decoder_input_ids`` as given;
      or its cache with ``text_or_tokens`` ``(source tokens, target tokens)`` (each token strings, ids
      ``(p,)`` or ``(b, p)``), or the batch dict it was run on, or None (positions).
      layers: sites, as names (``"decoder.blocks.0.cross_attn"``) or indices into ``model.cfg.sites``; heads:
      head indices, or ``(site, head)`` pairs. window is not offered (the source and target are shown whole).
      batch picks the pair; the padding of either side is dropped. Cross-attention shows target tokens
      (queries) on the left and source tokens (keys) on the right.

    In the page: a layer (site) selector, a button per head (its colour; click to hide or show it), hover a
    query token to see where it attends (squares beside each key: one per head, the exact weight on hover),
    hover a key token to see what attends to it.
    """
    if display not in (None, "lines", "matrix"):
        raise ValueError(f"display is 'lines' or 'matrix'; got {display!r}.")
    layers, heads = site_indices(places_of(source), layers, heads)
    run = _Run.of(source, text_or_tokens, batch, _needed_layers(layers, heads), weighting)
    chosen = _choose(run, layers, heads)
    data = _embed(run, chosen, window, "head view")
    sequences = [data[side] for side in SIDES.values()] if "sites" in data else [data]
    data["open"] = _first_layer(layers, heads, chosen)
    data["display"] = display or ("lines" if max(len(s["tokens"]) for s in sequences) <= LINES_UP_TO else "matrix")
    data["title"] = title or f"head view: {run.name}"
    return HeadView(data)


def attention_grid(source, text_or_tokens=None, score: str | None = None, *, scores=None,
                   window: tuple[int, int] | None = None, batch: int = 0, title: str | None = None) -> AttentionGrid:
    """Every layer x head as a thumbnail of its pattern, framed in the colour of a head score; click one to open
    its pattern large (exact weights on hover) with all its scores, intervals and definitions.

    source, text_or_tokens, window, batch: as in ``head_view`` (an encoder-decoder model or cache too: one row
      per site, labelled with its stack, block and kind; a cross-attention thumbnail is target x source).
    scores: a ``detect_heads`` table (``layer``, ``head``, score columns and their ``_lo``/``_hi`` intervals; for
      an encoder-decoder model its table, whose ``site`` column places each row).
      None: with a model, ``detect_heads(model)`` is run (about 16 s on SmolLM2-135M with 2 CPU threads; pass a
      table to reuse one);
      with a cache, thumbnails are not coloured. score: the column coloured first (default the table's first score
      in the registry's order, the most specific first: induction, duplicate_token, previous_token, ...; for an
      encoder-decoder model its first cross-attention score, alignment); the page can switch to any other. A score a head
      has not (a self-attention score of a cross-attention head) leaves its frame grey.
    """
    run = _Run.of(source, text_or_tokens, batch, None)
    if scores is None and run.model is not None:
        from ..heads.detect import detect_heads

        scores = detect_heads(run.model)
    data = _embed(run, _choose(run, None, None), window, "grid")
    data["scores"] = None if scores is None else _score_table(scores, run.places if run.multi else None)
    columns = [] if scores is None else data["scores"]["columns"]
    if score is not None:
        record = registry.of_column(score)
        score = record.label_column if record is not None else score
        if score not in columns:
            raise ValueError(f"score {score!r} is not in the scores table; it has {columns or 'none'}. "
                             "Pass scores=detect_heads(model) to colour by a detect_heads score.")
    cross = [c for c in columns if registry.of_column(c).applies_to("cross")]  # what only a two-stack model has
    data["score"] = score or (cross[0] if run.multi and cross else columns[0] if columns else None)
    data["title"] = title or f"attention grid: {run.name}"
    return AttentionGrid(data)


# -- choosing and packing what a view embeds ----------------------------------------------------------
def _needed_layers(layers, heads) -> list[int] | None:
    """The layers whose q and k a model run must capture (None: all)."""
    if heads is not None and len(heads) and isinstance(heads[0], (tuple, list)):
        return sorted({int(l) for l, _ in heads})
    if layers is None:
        return None
    return [layers] if isinstance(layers, int) else [int(l) for l in layers]


def _first_layer(layers, heads, chosen: dict[int, list[int]]) -> int:
    """The layer (site) a head view opens on: the first head's, else the first layer given (the selector lists them
    in order). A report's view names its strongest head first and opens on it; it opened on the lowest layer of its
    heads (issue 35: titled 18.6, open on 5.6)."""
    if heads is not None and len(heads) and isinstance(heads[0], (tuple, list)):
        return int(heads[0][0])
    if layers is not None and not isinstance(layers, int) and len(layers):
        return int(list(layers)[0])
    return next(iter(chosen))


def _choose(run: _Run, layers, heads) -> dict[int, list[int]]:
    """{layer: heads} to embed, checked against the model's layers and heads."""
    n_layers = len(run.heads_per_layer)
    pairs = heads is not None and len(heads) and isinstance(heads[0], (tuple, list))
    if pairs and layers is not None:
        raise ValueError("Give heads as (layer, head) pairs, or layers= with head indices, not both.")
    if pairs:
        chosen: dict[int, list[int]] = {}
        for l, h in heads:
            chosen.setdefault(int(l), []).append(int(h))
    else:
        layers = run.available if layers is None else [layers] if isinstance(layers, int) else list(layers)
        chosen = {int(l): None for l in layers}
    unit = run.unit
    if not chosen:
        raise ValueError(f"No {unit} to show: give at least one {unit}.")
    for l in list(chosen):
        if not 0 <= l < n_layers or not run.heads_per_layer[l]:
            raise IndexError(f"{unit} {l} is out of range: this model has {unit}s 0..{n_layers - 1}.")
        if l not in run.available:
            raise KeyError(f"The cache has neither q and k nor the pattern of {unit} {l}; capture them "
                           f"(run_with_cache captures every {unit}'s q and k by default).")
        wanted = chosen[l] if pairs else (list(range(run.heads_per_layer[l])) if heads is None else list(heads))
        bad = [h for h in wanted if not 0 <= int(h) < run.heads_per_layer[l]]
        if bad or not wanted:
            raise IndexError(f"head(s) {bad or wanted} out of range: {unit} {l} has heads "
                             f"0..{run.heads_per_layer[l] - 1}.")
        chosen[l] = sorted({int(h) for h in wanted})
    return dict(sorted(chosen.items()))


def _embed(run: _Run, chosen: dict[int, list[int]], window, what: str) -> dict:
    """The data every view embeds: each sequence's tokens, the chosen heads' weights site after site, each
    ``(q, k)`` (the lower triangle alone where nothing above the diagonal is left); windowed, the weight outside."""
    if run.multi and window is not None:
        raise ValueError("window= picks positions of one sequence; an encoder-decoder view shows its source and target "
                         "whole: give shorter inputs, or fewer sites and heads with layers= and heads=.")
    n_total = {e: len(t) for e, t in run.tokens.items()}
    lo, hi = _window(window, n_total["input_ids"]) if not run.multi else (0, None)
    span = lambda e: (lo, hi) if not run.multi else (0, n_total[e])  # noqa: E731
    n = {e: span(e)[1] - span(e)[0] for e in n_total}
    size = 2 * sum(len(h) * n[run.places[l].queries] * n[run.places[l].keys] for l, h in chosen.items()) * 4 / 3
    if size > MAX_BYTES:  # base64 bytes of the full matrices, before a triangle is dropped
        what_tokens = (f"{n['input_ids']} source and {n['decoder_input_ids']} target tokens" if run.multi else
                       f"{sum(len(h) for h in chosen.values())} heads x {n['input_ids']}^2 positions")
        how = "sites and heads with layers= and heads=" if run.multi else "with layers=, heads= or window=(start, stop)"
        raise ValueError(f"This {what} would embed about {size / 1e6:.0f} MB of weights ({what_tokens}); show fewer "
                         f"{how}.")
    shown, outside = [], []
    for layer, heads in chosen.items():
        place, where = run.places[layer], (run.places[layer].name if run.multi else f"layer {layer}")
        pattern = run.pattern(layer, heads)  # (h, q, k)
        (q0, q1), (k0, k1) = span(place.queries), span(place.keys)
        part = pattern[:, q0:q1, k0:k1]
        shown.append(_quantise(part, where, heads))  # (h, q, k) uint16
        if window is not None and (lo, hi) != (0, n_total["input_ids"]):  # each shown query's weight outside
            weight = (pattern[:, lo:hi].sum(-1) - part.sum(-1)).clamp(min=0.0)
            outside.append(_quantise(weight, where, heads))
    if run.multi:  # a triangle per site where that site's pattern is square and nothing above is left
        packed = [bool(w.shape[1] == w.shape[2] and not np.triu(w, 1).any()) for w in shown]
    else:  # one flag for every head
        packed = [not any(np.triu(w, 1).any() for w in shown)] * len(shown)
    flat = [_lower(w) if p else w.reshape(-1) for w, p in zip(shown, packed)]
    data = {"layers": list(chosen), "heads": list(chosen.values()), "scale": SCALE, "weighting": run.weighting,
            "weights": _b64(np.concatenate(flat)),
            "outside": _b64(np.concatenate([o.reshape(-1) for o in outside])) if outside else None}
    if run.multi:
        return {SIDES[e]: {"tokens": t, "positions": list(range(len(t)))} for e, t in run.tokens.items()} | {
            "sites": [{"name": p.name, "stack": p.stack, "block": p.block, "kind": p.kind, "title": p.title,
                       "label": p.label, "query": SIDES[p.queries], "key": SIDES[p.keys]} for p in run.places],
            "window": None, "packed": packed, **data}
    return {"tokens": run.tokens["input_ids"][lo:hi], "positions": list(range(lo, hi)), "length": n_total["input_ids"],
            "window": None if (lo, hi) == (0, n_total["input_ids"]) else [lo, hi], "packed": packed[0], **data}


def _lower(weights: np.ndarray) -> np.ndarray:
    """The lower triangle (diagonal included) of each head's square ``(q, q)`` weights, head after head."""
    rows, cols = np.tril_indices(weights.shape[1])
    return weights[:, rows, cols].reshape(-1)


def _score_table(df, sites=None) -> dict:
    """Scores, intervals and labels of every head in a detect_heads table, with each score's one-line
    definition and threshold. sites: an encoder-decoder model's sites; its table's ``site`` column places a row
    at that site's index."""
    where = "site" if sites is not None else "layer"
    missing = [c for c in (where, "head") if c not in df]
    every = [c for c in registry.columns() if registry.of_column(c).how in ("target", "argmax")]
    columns = [c for c in registry.columns() if c in df]  # every registered score the table has, ours or a user's
    if missing or not columns:
        table = "detect_heads (of this encoder-decoder model)" if sites is not None else "detect_heads"
        raise ValueError(f"scores must be a {table} table with {where}, head and score columns "
                         f"{columns or every}; got columns {list(df.columns)}.")
    if sites is None and not one_site_per_layer(df):
        raise ValueError("These scores are an encoder-decoder model's (they have a site column); this view is of a "
                         "decoder-only or encoder model.")
    index = None if sites is None else {s.name: i for i, s in enumerate(sites)}
    thresholds = {**registry.DEFAULT_THRESHOLDS, **df.attrs.get("thresholds", {})}
    kind = {c: registry.of_column(c).name for c in columns}
    definitions = dict(registry.SCORE_DEFINITIONS)
    values = {}
    for r in df.to_dict(orient="records"):
        entry = {c: [_num(r[c]), _num(r.get(f"{c}_lo")), _num(r.get(f"{c}_hi"))] for c in columns}
        for offset in (f"{registry.of_column(c).name}_offset" for c in columns):
            if offset in r and _num(r[offset]) is not None:  # NaN on heads of the other kind
                entry[offset] = int(r[offset])
        labels = r.get("labels", r.get("label"))
        if not isinstance(labels, str) and isinstance(r.get("label"), str) and r["label"] not in NO_CLASS:
            labels = r["label"]  # a table without a labels column (an older CSV): its primary label
        entry["labels"] = labels if isinstance(labels, str) else ""  # a CSV reads an empty label as NaN
        if index is not None and r["site"] not in index:
            raise ValueError(f"scores name site {r['site']!r}, which this model has not; its sites: {list(index)}.")
        values[f"{index[r['site']] if index is not None else int(r['layer'])}.{int(r['head'])}"] = entry
    inputs = df.attrs.get("inputs") or {}
    return {"columns": columns, "values": values,
            "definitions": {c: definitions.get(kind[c], "") for c in columns},
            "thresholds": {c: thresholds.get(kind[c]) for c in columns},
            "inputs": {c: inputs.get(kind[c], "") for c in columns}}


def _num(value) -> float | None:
    if value is None:
        return None
    value = float(value)
    return None if value != value else round(value, 4)
