"""A head view for long sequences (8k-32k tokens) built from ``interp.attention.stats``, never from an n x n matrix.

For one layer it shows, per head: each query row's top-1 key as a point (query across, key down: a previous-token
head draws the diagonal, a sink head the top edge, an induction head a parallel diagonal one copy back), the
weight by distance bucket (0, 1, 2-3, 4-7, ...) for bands of rows, and a zoom window computed exactly
(``exp(scale q.k - lse)`` for the window's rows against the keys just before them). The page is one HTML file with
inline vanilla JavaScript; elements carry ``data-role`` and ``data-head`` attributes for tests.

    view = long_view(model, ids, layer=18, zoom=(8000, 8064))
    view.save("long.html")
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["long_view", "LongView"]

@dataclass
class LongView:
    """``data``: what the page embeds (JSON). ``html``: the page; ``save(path)`` writes it."""

    data: dict

    @property
    def html(self) -> str:
        payload = json.dumps(self.data, separators=(",", ":")).replace("</", "<\\/")
        heads = "".join(f'<button data-role="head" data-head="{h}">head {h}</button>'
                        for h in range(self.data["n_heads"]))
        weighting = html.escape(self.data.get("weighting", "raw"))
        return (f'<!doctype html><html><head><meta charset="utf-8"><title>layer {self.data["layer"]}: '
                f'{self.data["n"]} tokens</title><style>{_CSS}</style></head><body>'
                f'<div class="interp-long" data-view="long" data-weighting="{weighting}">'
                f'<h3>{html.escape(self.data["title"])}</h3>'
                f'<div class="heads">{heads}</div><div class="row"><canvas data-role="top1" width="480" height="480">'
                f'</canvas><canvas data-role="offsets" width="480" height="480"></canvas>'
                f'<canvas data-role="zoom" width="480" height="480"></canvas></div><div class="row caption">'
                f'<span>top-1 key of each row (query across, key down)</span><span>weight by distance |q - k| '
                f'(across) for bands of rows (down)</span><span>exact weights: rows {self.data["zoom"]["rows"][0]}-'
                f'{self.data["zoom"]["rows"][1] - 1} (down), keys {self.data["zoom"]["keys"][0]}-'
                f'{self.data["zoom"]["keys"][1] - 1} (across)</span></div><p data-role="info"></p><p data-role="scores" title="'
                f'{html.escape("; ".join(f"{k}: {v}" for k, v in self.data.get("definitions", {}).items()))}"></p></div>'
                f'<script type="application/json" id="long-data">{payload}</script><script>{_JS}</script>'
                f"</body></html>")

    def _repr_html_(self) -> str:
        return self.html

    def save(self, path, overwrite: bool = False) -> Path:
        """One offline page, written whole or not at all; an existing file is replaced only with overwrite=True."""
        from interp.runtime.files import atomic_write

        return atomic_write(Path(path), self.html, overwrite=overwrite)


def long_view(model, ids, layer: int, zoom: tuple[int, int] | None = None, n_buckets: int | None = None,
              scores=None, weighting: str = "raw") -> LongView:
    """The long-sequence view of ``layer`` for one prompt ``ids: (p,)`` (or (1, p)) on the flash path: the page of
    ``analyses.long.long_context.long_stats`` (arguments there), with each registered head score of the layer's heads
    on this prompt (ours and a user's, ``scores``: names, default every target-rule score that applies).
    weighting: ``"norm"`` shows norm-weighted attention (each key's share of the head's output norm) throughout; the
    page's title says so."""
    from ..long.long_context import long_stats

    return LongView(long_stats(model, ids, layer, zoom=zoom, n_buckets=n_buckets, scores=scores,
                               weighting=weighting))


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
    root.querySelector('[data-role="scores"]').textContent = "head scores on this prompt: " +
      Object.entries(data.scores || {}).map(([name, v]) => `${name} ${v[h] === null ? "n/a" : v[h]}`).join(", ");
  }
  root.querySelectorAll('[data-role="head"]').forEach((b) => b.addEventListener("click", () => show(+b.dataset.head)));
  show(0);
})();
"""
