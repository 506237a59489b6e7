"""What the long view shows, computed for one layer of one long prompt (8k-32k tokens) on the flash path, never
from an n x n matrix: ``long_stats`` runs one per-site pass (``interp.attention.site_pass``) that stops after the layer.

Per head: each query row's top-1 key and its weight, the weight by distance bucket (0, 1, 2-3, 4-7, ...) for bands of
rows, the mean entropy and weight on the first token (``interp.attention.stats``), a zoom window of exact weights
(``exp(scale q.k - lse)`` for the window's rows against the keys just before them), and every registered
target-rule head score of the layer's heads on this prompt (``analyses.heads.registry``: ours and a user's, each the mean
weight on its targets over the rows that have one). ``analyses.views.long_view`` draws it.
"""

from __future__ import annotations

import base64

import numpy as np
import torch

from interp.lens.circuits import output_grams
from interp.attention.site_pass import WEIGHTINGS, each_site
from interp.attention.stats import bucket_labels

from ..heads import registry
from ..heads.labels import site_kind
from ..heads.scores import rule_pairs

__all__ = ["long_stats"]

_BANDS = 64  # bands of query rows for the distance histograms
_MAX_ZOOM = 256  # rows (and keys) of the exact zoom window


def long_stats(model, ids, layer: int, zoom: tuple[int, int] | None = None, n_buckets: int | None = None,
               scores=None, weighting: str = "raw") -> dict:
    """The long view's data for ``layer`` and one prompt ``ids: (p,)`` (or (1, p)), on the flash path.

    A batch of several rows is refused (the view shows one sequence: pick one with ``ids[i:i+1]``), and so is a
    model with encoder and decoder stacks (``head_view`` shows its sites). zoom: (start, stop) query rows shown
    exactly, at most 256 (default: the last 64 rows). n_buckets: distance buckets (default: enough for the prompt's
    length). scores: registered target-rule scores to compute on the prompt (default: every one that applies).
    weighting: ``"raw"`` or ``"norm"``: everything read on norm-weighted attention, each key's share of the head's
    output norm (``SiteRead.norm_stats``, ``weights(..., weighting="norm")``), still O(n)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting is one of {WEIGHTINGS} (the attention weights, or norm-weighted attention); "
                         f"got {weighting!r}.")
    norm = weighting == "norm"
    ids, layer, n_buckets = _checked(model, ids, layer, n_buckets)
    n = len(ids)
    start, stop = zoom if zoom is not None else (max(0, n - 64), n)
    if not 0 <= start < stop <= n or stop - start > _MAX_ZOOM:
        raise ValueError(f"zoom is (start, stop) with 0 <= start < stop <= {n} and at most {_MAX_ZOOM} rows; "
                         f"got {zoom}.")
    site = model.cfg.sites[layer]
    records = _records(scores, site_kind(site))
    batch = {"input_ids": ids[None].to(model.device), "attention_mask": None}
    out = {}

    def visit(read) -> None:
        out["stats"] = (read.norm_stats if norm else read.stats)(
            n_buckets=n_buckets, fields=("top_index", "top_weight", "offsets", "entropy", "sink"))
        before = read.window[0]
        lo = start if before is None else max(0, start - before)
        lo = max(0, min(lo, stop - _MAX_ZOOM))  # keys from lo: up to 256 before the window's last row
        rows, keys = torch.meshgrid(torch.arange(start, stop), torch.arange(lo, stop), indexing="ij")
        w = read.weights(torch.zeros(rows.numel(), dtype=torch.long), rows.flatten(), keys.flatten(),
                         weighting)  # (r*k, h)
        out["zoom"], out["zoom_keys"] = w.T.reshape(-1, stop - start, stop - lo).cpu(), lo
        valid = read.query_valid.cpu()
        out["scores"] = {}
        for r in records:
            pairs = rule_pairs(r, batch["input_ids"], valid, batch["input_ids"], valid, site.causal, model.tokenizer)
            rows_with = int(pairs.rows.sum())
            weight = read.weights(pairs.b, pairs.q, pairs.k, weighting).double().sum(0).cpu()
            out["scores"][r.name] = [round(float(x) / rows_with, 4) if rows_with else None for x in weight]

    with model.studying(), torch.no_grad():
        if model.attn != "flash":
            raise ValueError("long_view reads the flash path's logsumexp; call model.set_attn('flash') first.")
        each_site(model, batch, visit, [layer], value_norms=output_grams(model, [layer]) if norm else None)
    st = out["stats"]
    h = st.top_index.shape[1]
    bands = torch.linspace(0, n, _BANDS + 1).long()
    band_hist = torch.stack([st.offsets[0, :, a:b].mean(1) if b > a else torch.zeros(h, n_buckets)
                             for a, b in zip(bands[:-1], bands[1:])], 1)  # (h, bands, buckets)
    return {
        "layer": layer, "n": n, "n_heads": h, "weighting": weighting,
        "title": f"layer {layer}, {n} tokens{', norm-weighted attention' if norm else ''}: top-1 key per row, "
                 f"weight by distance, exact zoom on rows {start}-{stop - 1}",
        "top": [_b64(st.top_index[0, i].clamp(min=0).numpy().astype("<u4")) for i in range(h)],
        "weight": [_b64((st.top_weight[0, i] * 255).round().clamp(0, 255).numpy().astype("u1")) for i in range(h)],
        "buckets": bucket_labels(n_buckets),
        "bands": [[[round(float(x), 4) for x in row] for row in band_hist[i]] for i in range(h)],
        "mean_offsets": [[round(float(x), 4) for x in st.offsets[0, i].mean(0)] for i in range(h)],
        "entropy": [round(float(st.entropy[0, i].mean()), 4) for i in range(h)],
        "sink": [round(float(st.sink[0, i].mean()), 4) for i in range(h)],
        "scores": out["scores"],
        "definitions": {r.name: r.definition for r in records},
        "zoom": {"rows": [start, stop], "keys": [out["zoom_keys"], stop],
                 "weights": [_b64((out["zoom"][i] * 255).round().clamp(0, 255).numpy().astype("u1"))
                             for i in range(h)]},
    }


def _records(scores, kind: str) -> list:
    """The target-rule scores to compute on the prompt: the named ones, or every one that applies to the site."""
    if scores is None:
        return registry.scores(("target",), kind)
    records = [registry.score(name) for name in ([scores] if isinstance(scores, str) else scores)]
    wrong = [r.name for r in records if r.how != "target" or not r.applies_to(kind)]
    if wrong:
        raise ValueError(f"The long view computes target-rule scores of this layer's {kind} heads; {wrong} are not "
                         f"such scores. It takes {list(registry.names(('target',), kind))}.")
    return records


def _checked(model, ids, layer, n_buckets) -> tuple[torch.Tensor, int, int]:
    """One prompt's ids ``(p,)``, the layer and the number of distance buckets, after checking what was given."""
    from ..data.seq2seq import is_seq2seq  # noqa: PLC0415

    if is_seq2seq(model):
        raise ValueError("long_view shows one layer of a model with one self-attention site per layer (decoder-only "
                         "or encoder); this model has encoder and decoder stacks. Use head_view(model, (source, "
                         "target)) to see its sites.")
    try:
        ids = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"long_view takes one prompt's token ids, (p,) or (1, p); got {type(ids).__name__}.") from None
    if ids.numel() == 0:
        raise ValueError(f"long_view was given no tokens (the ids are empty, shape {tuple(ids.shape)}); give the ids "
                         "of a prompt of at least one token.")
    if ids.ndim == 2 and ids.shape[0] != 1:
        raise ValueError(f"long_view shows one prompt: give one row of ids, (p,) or (1, p); got {ids.shape[0]} rows "
                         f"{tuple(ids.shape)}. Pick one with ids[i:i+1].")
    if ids.ndim not in (1, 2) or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"long_view takes integer token ids of one prompt, (p,) or (1, p); got a {ids.dtype} tensor "
                        f"of shape {tuple(ids.shape)}.")
    ids = ids.reshape(-1)
    n_layers = model.cfg.n_layers
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < n_layers:
        raise ValueError(f"layer must be a whole number in 0..{n_layers - 1}; got {layer!r}.")
    if n_buckets is None:
        return ids, int(layer), max(2, len(ids) - 1).bit_length() + 1
    if isinstance(n_buckets, bool) or not isinstance(n_buckets, (int, np.integer)) or n_buckets < 2:
        raise ValueError(f"n_buckets is a whole number of distance buckets, at least 2 (distance 0 and the rest), "
                         f"or None (enough for the prompt's length); got {n_buckets!r}.")
    return ids, int(layer), int(n_buckets)


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii")
