"""A head view for long sequences (8k-32k tokens) built from ``interp.stats``, never from an n x n matrix.

For one layer it shows, per head: each query row's top-1 key as a point (query across, key down: a previous-token
head draws the diagonal, a sink head the top edge, an induction head a parallel diagonal one copy back), the
weight by distance bucket (0, 1, 2-3, 4-7, ...) for bands of rows, and a zoom window computed exactly
(``exp(scale q.k - lse)`` for the window's rows against the keys just before them). The page is one HTML file with
inline vanilla JavaScript; elements carry ``data-role`` and ``data-head`` attributes for tests.

    view = long_view(model, ids, layer=18, zoom=(8000, 8064))
    view.save("long.html")
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from interp.stats import attention_stats, bucket_labels

__all__ = ["long_view", "LongView"]

_BANDS = 64  # bands of query rows for the distance histograms
_MAX_ZOOM = 256  # rows (and keys) of the exact zoom window


class _Stop(Exception):
    """Raised from the layer's hook: nothing after it is needed."""


@dataclass
class LongView:
    """``data``: what the page embeds (JSON). ``html``: the page; ``save(path)`` writes it."""

    data: dict

    @property
    def html(self) -> str:
        payload = json.dumps(self.data, separators=(",", ":")).replace("</", "<\\/")
        heads = "".join(f'<button data-role="head" data-head="{h}">head {h}</button>'
                        for h in range(self.data["n_heads"]))
        return (f'<!doctype html><html><head><meta charset="utf-8"><title>layer {self.data["layer"]}: '
                f'{self.data["n"]} tokens</title><style>{_CSS}</style></head><body>'
                f'<div class="interp-long" data-view="long"><h3>{html.escape(self.data["title"])}</h3>'
                f'<div class="heads">{heads}</div><div class="row"><canvas data-role="top1" width="480" height="480">'
                f'</canvas><canvas data-role="offsets" width="480" height="480"></canvas>'
                f'<canvas data-role="zoom" width="480" height="480"></canvas></div><div class="row caption">'
                f'<span>top-1 key of each row (query across, key down)</span><span>weight by distance |q - k| '
                f'(across) for bands of rows (down)</span><span>exact weights: rows {self.data["zoom"]["rows"][0]}-'
                f'{self.data["zoom"]["rows"][1] - 1} (down), keys {self.data["zoom"]["keys"][0]}-'
                f'{self.data["zoom"]["keys"][1] - 1} (across)</span></div><p data-role="info"></p></div>'
                f'<script type="application/json" id="long-data">{payload}</script><script>{_JS}</script>'
                f"</body></html>")

    def _repr_html_(self) -> str:
        return self.html

    def save(self, path, overwrite: bool = False) -> Path:
        """One offline page, written whole or not at all; an existing file is replaced only with overwrite=True."""
        from interp.files import atomic_write

        return atomic_write(Path(path), self.html, overwrite=overwrite)


def long_view(model, ids, layer: int, zoom: tuple[int, int] | None = None, n_buckets: int | None = None) -> LongView:
    """The long-sequence view of ``layer`` for one prompt ``ids: (p,)`` (or (1, p)) on the flash path.

    A batch of several rows is refused (the view shows one sequence: pick one with ``ids[i:i+1]``), and so is a
    model with encoder and decoder stacks (``head_view`` shows its sites).

    zoom: (start, stop) query rows shown exactly, at most 256 (default: the last 64 rows). n_buckets: distance
    buckets (default: enough for the prompt's length).
    """
    ids, layer, n_buckets = _checked(model, ids, layer, n_buckets)
    n = len(ids)
    start, stop = zoom if zoom is not None else (max(0, n - 64), n)
    if not 0 <= start < stop <= n or stop - start > _MAX_ZOOM:
        raise ValueError(f"zoom is (start, stop) with 0 <= start < stop <= {n} and at most {_MAX_ZOOM} rows; "
                         f"got {zoom}.")
    attn = model.structure.layer_attn[layer]
    held, out = {}, {}

    def hold(t, hook):
        held[hook.name.rsplit("_", 1)[1]] = t

    def on_lse(lse, hook):  # (b, h, q)
        q, k = held["q"].transpose(1, 2), held["k"].transpose(1, 2)  # (b, h, p, d), (b, g, p, d)
        sinks = None
        if attn.sinks is not None:
            sinks = model.attention_meta().sinks[layer]
        out["stats"] = attention_stats(q, k, attn.scale, lse, causal=attn.causal, window=attn.window,
                                       softcap=attn.softcap, sinks=sinks, n_buckets=n_buckets,
                                       fields=("top_index", "top_weight", "offsets", "entropy", "sink"))
        lo = start if attn.window[0] is None else max(0, start - attn.window[0])
        lo = max(0, min(lo, stop - _MAX_ZOOM))  # keys from lo: up to 256 before the window's last row
        rep = q.shape[1] // k.shape[1]
        s = torch.einsum("bhqd,bhkd->bhqk", q[:, :, start:stop].float(),
                         k.repeat_interleave(rep, 1)[:, :, lo:stop].float()) * attn.scale
        if attn.softcap is not None:
            s = torch.tanh(s / attn.softcap) * attn.softcap
        dist = torch.arange(lo, stop)[None] - torch.arange(start, stop)[:, None]
        allowed = (dist <= 0) if attn.causal else torch.ones_like(dist, dtype=torch.bool)
        if attn.window[0] is not None:
            allowed &= dist >= -attn.window[0]
        w = torch.exp(s.masked_fill(~allowed, float("-inf")) - lse[:, :, start:stop, None].float())
        out["zoom"], out["zoom_keys"] = w[0], lo
        raise _Stop

    names = [f"blocks.{layer}.attn.hook_{kind}" for kind in ("q", "k")]
    with model.studying(), torch.no_grad(), model.hooks([(names, hold), (f"blocks.{layer}.attn.hook_lse", on_lse)]):
        if model.attn != "flash":
            raise ValueError("long_view reads the flash path's logsumexp; call model.set_attn('flash') first.")
        try:
            model(ids[None].to(model.device))
        except _Stop:
            pass
    st = out["stats"]
    h = st.top_index.shape[1]
    bands = torch.linspace(0, n, _BANDS + 1).long()
    band_hist = torch.stack([st.offsets[0, :, a:b].mean(1) if b > a else torch.zeros(h, n_buckets)
                             for a, b in zip(bands[:-1], bands[1:])], 1)  # (h, bands, buckets)
    data = {
        "layer": layer, "n": n, "n_heads": h, "title": f"layer {layer}, {n} tokens: top-1 key per row, weight by "
                                                        f"distance, exact zoom on rows {start}-{stop - 1}",
        "top": [_b64(st.top_index[0, i].clamp(min=0).numpy().astype("<u4")) for i in range(h)],
        "weight": [_b64((st.top_weight[0, i] * 255).round().clamp(0, 255).numpy().astype("u1")) for i in range(h)],
        "buckets": bucket_labels(n_buckets),
        "bands": [[[round(float(x), 4) for x in row] for row in band_hist[i]] for i in range(h)],
        "mean_offsets": [[round(float(x), 4) for x in st.offsets[0, i].mean(0)] for i in range(h)],
        "entropy": [round(float(st.entropy[0, i].mean()), 4) for i in range(h)],
        "sink": [round(float(st.sink[0, i].mean()), 4) for i in range(h)],
        "zoom": {"rows": [start, stop], "keys": [out["zoom_keys"], stop],
                 "weights": [_b64((out["zoom"][i] * 255).round().clamp(0, 255).numpy().astype("u1"))
                             for i in range(h)]},
    }
    return LongView(data)


def _checked(model, ids, layer, n_buckets) -> tuple[torch.Tensor, int, int]:
    """One prompt's ids ``(p,)``, the layer and the number of distance buckets, after checking what was given."""
    from ..seq2seq import is_seq2seq

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


_CSS = """body{font:13px sans-serif;margin:12px}.row{display:flex;gap:8px;flex-wrap:wrap}
canvas{border:1px solid #ccc;background:#fff}.caption span{width:482px;color:#444}
button{margin:2px}button.on{background:#246;color:#fff}"""

_JS = r"""
(function () {
  const data = JSON.parse(document.getElementById("long-data").textContent);
  const bytes = (s) => Uint8Array.from(atob(s), (c) => c.charCodeAt(0));
  const u32 = (s) => new Uint32Array(bytes(s).buffer);
  const root = document.querySelector('[data-view="long"]');
  const canvas = (role) => root.querySelector(`[data-role="${role}"]`);
  function top1(h) {  // each row's top-1 key as a point: query across, key down
    const c = canvas("top1"), g = c.getContext("2d"), n = data.n, top = u32(data.top[h]), w = bytes(data.weight[h]);
    g.clearRect(0, 0, c.width, c.height);
    const size = Math.max(2, c.width / n);
    for (let q = 0; q < n; q++) {
      g.fillStyle = `rgba(20,20,160,${(40 + w[q] * 0.84) / 255})`;
      g.fillRect(q * c.width / n, top[q] * c.height / n, size, size);
    }
  }
  function offsets(h) {  // rows in bands (down) x distance buckets (across), darker = more weight
    const c = canvas("offsets"), g = c.getContext("2d"), bands = data.bands[h], nb = data.buckets.length;
    g.clearRect(0, 0, c.width, c.height);
    const bw = c.width / nb, bh = (c.height - 20) / bands.length;
    bands.forEach((row, r) => row.forEach((v, b) => {
      g.fillStyle = `rgba(200,60,20,${Math.min(1, v)})`; g.fillRect(b * bw, r * bh, bw, bh);
    }));
    g.fillStyle = "#000"; g.font = "9px sans-serif";
    // crowded (long prompts: 16+ buckets): each bucket's lower bound, 1024 and up in k ("2-3" -> "2", 2048-4095 -> "2k")
    const low = (label) => { const v = +label.match(/\d+/)[0]; return (label.startsWith(">") ? "\u2265" : "") +
      (v >= 1024 ? v / 1024 + "k" : String(v)); };
    const crowded = Math.max(...data.buckets.map((l) => l.length)) * 5 > bw;
    data.buckets.forEach((label, b) => g.fillText(crowded ? low(label) : label, b * bw + 1, c.height - 6));
  }
  function zoom(h) {  // the exact weights of the zoom window's rows against the keys before them
    const c = canvas("zoom"), g = c.getContext("2d"), z = data.zoom, w = bytes(z.weights[h]);
    const rows = z.rows[1] - z.rows[0], keys = z.keys[1] - z.keys[0];
    g.clearRect(0, 0, c.width, c.height);
    const cw = c.width / keys, ch = c.height / rows;
    for (let r = 0; r < rows; r++) for (let k = 0; k < keys; k++) {
      const v = w[r * keys + k]; if (!v) continue;
      g.fillStyle = `rgba(20,60,200,${v / 255})`; g.fillRect(k * cw, r * ch, Math.max(cw, 1), Math.max(ch, 1));
    }
  }
  function show(h) {
    root.querySelectorAll('[data-role="head"]').forEach((b) => b.classList.toggle("on", +b.dataset.head === h));
    top1(h); offsets(h); zoom(h);
    root.querySelector('[data-role="info"]').textContent =
      `head ${h}: mean entropy ${data.entropy[h]} nats, weight on the first token ${data.sink[h]}, ` +
      `weight by distance ${data.mean_offsets[h].map((v, i) => data.buckets[i] + ": " + v).join(", ")}`;
  }
  root.querySelectorAll('[data-role="head"]').forEach((b) => b.addEventListener("click", () => show(+b.dataset.head)));
  show(0);
})();
"""
