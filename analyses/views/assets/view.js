/* interp views: the head view and the attention grid (analyses/views/attention.py).
 *
 * Vanilla JavaScript, no library and no request: the data sits in the view's <script class="iv-data"> block.
 * Weights are integers 0..10000 (4 decimals), base64 uint16 little-endian; "packed" keeps the lower triangle.
 * Stable attributes for tests and scripts: data-role (layer, head, display, query, key, matrix, info, thumb,
 * score, detail, scores, row, sides), data-layer, data-head, data-token (the token's position), data-weight (4
 * decimals). An encoder-decoder model's view ("sites" in the data) has a site where others have a layer:
 * data-layer is its index in model.cfg.sites, data-site its name; its queries and keys come from the source or
 * the target (a cross-attention site: target queries, source keys, so its pattern need not be square).
 */
(function () {
  "use strict";

  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"];
  const VIRIDIS = [[68, 1, 84], [72, 40, 120], [62, 74, 137], [49, 104, 142], [38, 130, 142], [31, 158, 137],
    [53, 183, 121], [109, 205, 89], [180, 222, 44], [253, 231, 37]];  // patterns
  const REDS = [[255, 245, 240], [252, 187, 161], [251, 106, 74], [203, 24, 29], [103, 0, 13]];  // score frames

  function ramp(stops, t) {  // t in 0..1 -> [r, g, b], linear between stops
    t = Math.min(1, Math.max(0, t)) * (stops.length - 1);
    const i = Math.min(stops.length - 2, Math.floor(t)), f = t - i;
    return stops[i].map((c, j) => Math.round(c + f * (stops[i + 1][j] - c)));
  }
  // Heatmap colour of each weight 0..10000: viridis of sqrt(weight), so that small weights still show.
  const LUT = new Uint8ClampedArray(3 * 10001);
  for (let v = 0; v <= 10000; v++) LUT.set(ramp(VIRIDIS, Math.sqrt(v / 10000)), 3 * v);

  const fmt = (v) => (v / 10000).toFixed(4);
  const colour = (h) => PALETTE[h % PALETTE.length];
  const rgba = (hex, a) => `rgba(${[1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16)).join(",")},${a})`;

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function decode(b64) {
    if (!b64) return null;
    const bin = atob(b64), out = new Uint16Array(bin.length >> 1);
    for (let i = 0; i < out.length; i++) out[i] = bin.charCodeAt(2 * i) | (bin.charCodeAt(2 * i + 1) << 8);
    return out;
  }

  // The tokens down each side of a layer, sides(l) = {q, k}, each {tokens, positions}: one sequence for both in a
  // decoder-only or encoder model; in an encoder-decoder model the layer is a site, d.sites[l], whose queries and
  // keys come from d.source or d.target.
  function Sides(d) {
    const one = { tokens: d.tokens, positions: d.positions };
    return d.sites ? (l) => ({ q: d[d.sites[l].query], k: d[d.sites[l].key] }) : () => ({ q: one, k: one });
  }
  // A head in text: "head 1.3"; in an encoder-decoder model "decoder 0 cross head 3".
  const headName = (d, l, h) => (d.sites ? `${d.sites[l].label} head ${h}` : `head ${l}.${h}`);
  // The data-* attributes that name layer l (and its site).
  const where = (d, l) => (d.sites ? { layer: l, site: d.sites[l].name } : { layer: l });

  // Every embedded head's weights: get(layer, head, query, key) -> 0..10000 (indices within the shown tokens).
  // Heads are stored one after another, each (q, k) row-major, or its lower triangle where "packed" (one flag for
  // the view, or one per layer).
  function Weights(d) {
    const sides = Sides(d), w = decode(d.weights), out = decode(d.outside), at = new Map();
    let offset = 0, index = 0;
    d.layers.forEach((l, li) => {
      const nq = sides(l).q.tokens.length, nk = sides(l).k.tokens.length;
      const packed = Array.isArray(d.packed) ? d.packed[li] : d.packed, size = packed ? nq * (nq + 1) / 2 : nq * nk;
      d.heads[li].forEach((h) => { at.set(l + "." + h, { o: offset, i: index++, nk, packed }); offset += size; });
    });
    return {
      sides,
      size: (l) => [sides(l).q.tokens.length, sides(l).k.tokens.length],  // [queries, keys]
      heads: (layer) => d.heads[d.layers.indexOf(layer)],
      get(l, h, q, k) {
        const a = at.get(l + "." + h);
        return a.packed ? (k > q ? 0 : w[a.o + q * (q + 1) / 2 + k]) : w[a.o + q * a.nk + k];
      },
      outside: (l, h, q) => (out ? out[at.get(l + "." + h).i * sides(l).q.tokens.length + q] : 0),
    };
  }

  const label = (seq, i) => `'${seq.tokens[i]}' (${seq.positions[i]})`;
  // The info line of one weight: its text and the data-* attributes tests read.
  function pair(d, W, l, h, q, k, weight) {
    const s = W.sides(l);
    return [`${headName(d, l, h)}: query ${label(s.q, q)} \u2192 key ${label(s.k, k)}: ${weight}`,
      { query: s.q.positions[q], key: s.k.positions[k], weight, ...where(d, l), head: h }];
  }

  // One head as a queries x keys image: queries down, keys across.
  function paint(canvas, W, l, h) {
    const [nq, nk] = W.size(l), ctx = canvas.getContext("2d");
    canvas.width = nk; canvas.height = nq;
    const img = ctx.createImageData(nk, nq);
    for (let q = 0; q < nq; q++) {
      for (let k = 0; k < nk; k++) {
        const p = 4 * (q * nk + k), c = 3 * W.get(l, h, q, k);
        img.data[p] = LUT[c]; img.data[p + 1] = LUT[c + 1]; img.data[p + 2] = LUT[c + 2]; img.data[p + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
  }

  // The side in px of a large heatmap whose longer side has n rows.
  const matrixPx = (n, most) => Math.max(n, Math.min(most, 8 * n));

  // A large heatmap of head (l, h), px along its longer side; hovering a cell reports its query, key and exact
  // weight to `info`.
  function matrix(d, W, l, h, px, info) {
    const wrap = el("figure", { class: "iv-matrix" });
    const canvas = el("canvas", { "data-role": "matrix", "data-layer": l, "data-head": h });
    if (d.sites) canvas.dataset.site = d.sites[l].name;
    const row = el("div", { class: "iv-band" }), col = el("div", { class: "iv-band" });
    paint(canvas, W, l, h);
    const [nq, nk] = W.size(l), n = Math.max(nq, nk), cell = px / n, width = (px * nk) / n, height = (px * nq) / n;
    canvas.style.width = width + "px"; canvas.style.height = height + "px";
    canvas.addEventListener("mousemove", (e) => {
      const r = canvas.getBoundingClientRect();
      const q = Math.min(nq - 1, Math.floor(((e.clientY - r.top) / r.height) * nq));
      const k = Math.min(nk - 1, Math.floor(((e.clientX - r.left) / r.width) * nk));
      Object.assign(row.style, { display: "block", left: 0, top: q * cell + "px", width: width + "px",
        height: cell + "px" });
      Object.assign(col.style, { display: "block", top: 0, left: k * cell + "px", width: cell + "px",
        height: height + "px" });
      const v = W.get(l, h, q, k);
      info(...pair(d, W, l, h, q, k, fmt(v)));
    });
    canvas.addEventListener("mouseleave", () => { row.style.display = col.style.display = "none"; });
    const axes = d.sites ? `queries (${d.sites[l].query}) down, keys (${d.sites[l].key}) across`
      : "queries down, keys across";
    wrap.append(canvas, row, col, el("figcaption", {}, `${headName(d, l, h)}: ${axes}`));
    return wrap;
  }

  function infoLine() {
    const node = el("div", { class: "iv-info", "data-role": "info" });
    const set = (text, attrs) => {
      node.textContent = text;
      for (const k of ["query", "key", "weight", "layer", "site", "head"]) delete node.dataset[k];
      Object.assign(node.dataset, attrs || {});
    };
    return { node, set };
  }

  function legend(text, kind) {
    const bar = el("span", { class: "iv-legend" });
    bar.append(el("span", {}, "0"), el("span", { class: "iv-ramp " + kind }), el("span", {}, "1"));
    bar.append(el("span", {}, text));
    return bar;
  }

  // -- head view ----------------------------------------------------------------------------------------
  function headView(root, d) {
    const W = Weights(d), ROW = 20;
    const on = new Set(d.heads.flat());
    let layer = d.open ?? d.layers[0], hover = null, display = d.display;  // open: the first head's layer
    // a link to the page with #layer=L&head=H (the atlas's links to its heads) opens on layer L with head H alone
    const asked = new URLSearchParams(((typeof location !== "undefined" && location.hash) || "").slice(1));
    if (asked.has("layer") && d.layers.includes(+asked.get("layer"))) {
      layer = +asked.get("layer");
      if (asked.has("head") && W.heads(layer).includes(+asked.get("head"))) { on.clear(); on.add(+asked.get("head")); }
    }
    let S = W.sides(layer), nq = S.q.tokens.length, nk = S.k.tokens.length;  // the shown layer's two sides

    const layerSel = el("select", { "data-role": "layer" });
    d.layers.forEach((l) => layerSel.append(d.sites ? el("option", { value: l, "data-site": d.sites[l].name },
      d.sites[l].label) : el("option", { value: l }, "layer " + l)));
    layerSel.value = layer;
    const displaySel = el("select", { "data-role": "display" });
    displaySel.append(el("option", { value: "lines" }, "lines"), el("option", { value: "matrix" }, "heatmaps"));
    displaySel.value = display;
    const headsBox = el("span", { class: "iv-heads" });
    const bar = el("div", { class: "iv-bar" });
    const lab = (text, node) => { const l = el("label", {}, text + " "); l.append(node); return l; };
    bar.append(lab(d.sites ? "site" : "layer", layerSel), headsBox, lab("display", displaySel));
    const info = infoLine();
    const note = el("div", { class: "iv-note" });
    const sides = el("div", { class: "iv-sides", "data-role": "sides" });  // encoder-decoder: where q and k come from
    const lines = el("div", { class: "iv-lines" }), qCol = el("div", { class: "iv-col", "data-side": "query" });
    const kCol = el("div", { class: "iv-col", "data-side": "key" }), canvas = el("canvas", { class: "iv-canvas" });
    lines.append(qCol, canvas, kCol);
    const matrices = el("div", { class: "iv-matrices" });
    root.append(el("div", { class: "iv-title" }, d.title), bar, note, info.node, ...(d.sites ? [sides] : []), lines,
      matrices);

    const seq = (side) => (side === "query" ? S.q : S.k);

    function token(side, i) {
      const node = el("div", { class: "iv-tok", "data-role": side, "data-token": seq(side).positions[i] });
      node.append(el("span", { class: "iv-text" }, seq(side).tokens[i]));
      const squares = el("span", { class: "iv-squares" });
      W.heads(layer).forEach((h) => squares.append(el("span", { class: "iv-sq", "data-head": h })));
      side === "query" ? node.append(squares) : node.prepend(squares);  // squares line up beside the lines
      return node;
    }

    function build() {  // what depends on the layer: head buttons, token columns, heatmaps
      S = W.sides(layer); nq = S.q.tokens.length; nk = S.k.tokens.length;
      root.dataset.layer = layer;
      if (d.sites) {
        const site = d.sites[layer];
        root.dataset.site = site.name;
        sides.textContent = `${site.label} (${site.title}): queries from the ${site.query} (left), keys from the ` +
          `${site.key} (right)`;
      }
      headsBox.replaceChildren(...W.heads(layer).map((h) => {
        const b = el("button", { type: "button", "data-role": "head", "data-head": h, style: `--c:${colour(h)}`,
          "aria-pressed": on.has(h), title: "show or hide head " + h }, "head " + h);
        b.addEventListener("click", () => { on.has(h) ? on.delete(h) : on.add(h); build(); });
        return b;
      }));
      lines.hidden = display !== "lines";
      matrices.hidden = display !== "matrix";
      if (display === "lines") {
        qCol.replaceChildren(...S.q.tokens.map((_, i) => token("query", i)));
        kCol.replaceChildren(...S.k.tokens.map((_, i) => token("key", i)));
        const dpr = window.devicePixelRatio || 1, rows = Math.max(nq, nk);
        canvas.width = 160 * dpr; canvas.height = rows * ROW * dpr;
        canvas.style.width = "160px"; canvas.style.height = rows * ROW + "px";
      } else {
        const px = matrixPx(Math.max(nq, nk), 480);
        matrices.replaceChildren(...active().map((h) => matrix(d, W, layer, h, px, info.set)));
      }
      render();
    }

    const active = () => W.heads(layer).filter((h) => on.has(h));

    function render() {
      if (display !== "lines") return;
      const ctx = canvas.getContext("2d"), dpr = window.devicePixelRatio || 1, y = (i) => (i + 0.5) * ROW * dpr;
      ctx.clearRect(0, 0, canvas.width, canvas.height);
      ctx.lineWidth = 2 * dpr;
      for (const h of active()) {
        ctx.strokeStyle = colour(h);
        for (let q = 0; q < nq; q++) {
          if (hover && hover.side === "query" && hover.i !== q) continue;
          for (let k = 0; k < nk; k++) {
            if (hover && hover.side === "key" && hover.i !== k) continue;
            const v = W.get(layer, h, q, k);
            if (v < 50) continue;  // under 0.005: invisible
            ctx.globalAlpha = v / 10000;
            ctx.beginPath(); ctx.moveTo(0, y(q)); ctx.lineTo(canvas.width, y(k)); ctx.stroke();
          }
        }
      }
      ctx.globalAlpha = 1;
      // squares beside the other side's tokens: one per head, opacity and data-weight = the weight
      for (const [side, col] of [["query", qCol], ["key", kCol]]) {
        for (const tok of col.children) {
          const i = seq(side).positions.indexOf(+tok.dataset.token);
          tok.classList.toggle("iv-hot", !!hover && hover.side === side && hover.i === i);
          for (const sq of tok.querySelectorAll(".iv-sq")) {
            const h = +sq.dataset.head, shown = hover && hover.side !== side && on.has(h);
            sq.hidden = !on.has(h);
            if (!shown) { sq.style.background = ""; delete sq.dataset.weight; sq.removeAttribute("title"); continue; }
            const v = side === "key" ? W.get(layer, h, hover.i, i) : W.get(layer, h, i, hover.i);
            sq.style.background = rgba(colour(h), v / 10000);
            sq.dataset.weight = fmt(v);
            sq.title = `${headName(d, layer, h)}: ${fmt(v)}`;
          }
        }
      }
    }

    function describe() {
      if (!hover) return info.set("Hover a token: on the left, where it attends; on the right, what attends to it.");
      const i = hover.i, other = seq(hover.side === "query" ? "key" : "query"), parts = active().map((h) => {
        let best = 0, at = 0;
        for (let j = 0; j < other.tokens.length; j++) {
          const v = hover.side === "query" ? W.get(layer, h, i, j) : W.get(layer, h, j, i);
          if (v > best) { best = v; at = j; }
        }
        const out = d.window && hover.side === "query" ? `, outside the window ${fmt(W.outside(layer, h, i))}` : "";
        return `head ${h}: ${label(other, at)} ${fmt(best)}${out}`;
      });
      const what = hover.side === "query" ? "attends most to" : "is attended most by";
      info.set(`${hover.side} ${label(seq(hover.side), i)} ${what}: ${parts.join("; ")}`);
    }

    for (const [side, col] of [["query", qCol], ["key", kCol]]) {
      col.addEventListener("mouseover", (e) => {
        const sq = e.target.closest(".iv-sq"), tok = e.target.closest(".iv-tok");
        if (!tok) return;
        const i = seq(side).positions.indexOf(+tok.dataset.token);
        if (sq && sq.dataset.weight !== undefined) {  // a square: that one weight, exactly
          const [q, k] = side === "key" ? [hover.i, i] : [i, hover.i];
          return info.set(...pair(d, W, layer, +sq.dataset.head, q, k, sq.dataset.weight));
        }
        if (hover && hover.side === side && hover.i === i) return;
        hover = { side, i };
        render(); describe();
      });
    }
    lines.addEventListener("mouseleave", () => { hover = null; render(); describe(); });
    layerSel.addEventListener("change", () => { layer = +layerSel.value; hover = null; build(); describe(); });
    displaySel.addEventListener("change", () => { display = displaySel.value; hover = null; build(); describe(); });

    const span = d.window ? `positions ${d.window[0]}..${d.window[1] - 1} of ${d.length}; ` : "";
    if (d.weighting === "norm") {  // the weights are each key's share of the head's output norm, not the softmax
      root.dataset.weighting = "norm";
      note.append(el("b", { "data-role": "weighting" }, "norm-weighted attention"),
        " (each key's share of the head's output norm, ||w v W_O|| / Σ ||w v W_O||); ");
    }
    note.append(`${span}line opacity = weight; squares beside tokens: one per head, opacity = weight, the exact ` +
      "weight (4 decimals) on hover; heatmaps: ", legend("colour = \u221Aweight", "iv-viridis"));
    build(); describe();
  }

  // -- attention grid -----------------------------------------------------------------------------------
  function grid(root, d) {
    const W = Weights(d), S = d.scores;
    const scoreSel = el("select", { "data-role": "score" });
    scoreSel.append(el("option", { value: "" }, "none"));
    (S ? S.columns : []).forEach((c) => scoreSel.append(el("option", { value: c }, c)));
    scoreSel.value = d.score || "";
    const definition = el("span", { class: "iv-def", "data-role": "definition" });
    const bar = el("div", { class: "iv-bar" }), lab = el("label", {}, "frame colour: ");
    lab.append(scoreSel);
    bar.append(lab, legend("", "iv-reds"), definition);
    const body = el("div", { class: "iv-gridbody" }), table = el("div", { class: "iv-grid" });
    const detail = el("div", { class: "iv-detail", "data-role": "detail" });
    const info = infoLine();
    body.append(table, detail);
    root.append(el("div", { class: "iv-title" }, d.title), bar, body);

    const maxHeads = Math.max(...d.heads.map((h) => h.length));
    table.style.gridTemplateColumns = `auto repeat(${maxHeads}, auto)`;
    table.append(el("span", {}));
    for (let h = 0; h < maxHeads; h++) table.append(el("span", { class: "iv-axis" }, "head " + h));
    const thumbs = [];
    d.layers.forEach((l, li) => {
      const row = el("span", { class: "iv-axis", "data-role": "row", "data-layer": l },
        d.sites ? d.sites[l].label : "layer " + l);
      if (d.sites) { row.dataset.site = d.sites[l].name; row.title = `${d.sites[l].name}: ${d.sites[l].title}`; }
      table.append(row);
      const [nq, nk] = W.size(l), long = Math.max(nq, nk);
      for (let j = 0; j < maxHeads; j++) {
        const h = d.heads[li][j];
        if (h === undefined) { table.append(el("span", {})); continue; }
        const c = el("canvas", { class: "iv-thumb", "data-role": "thumb", "data-layer": l, "data-head": h, tabindex: 0 });
        if (d.sites) c.dataset.site = d.sites[l].name;
        if (nq !== nk) {  // drawn with its aspect: 44 px along the longer side, as square thumbnails are
          c.style.width = (44 * nk) / long + "px"; c.style.height = (44 * nq) / long + "px";
        }
        paint(c, W, l, h);
        c.addEventListener("click", () => open(l, h));
        c.addEventListener("keydown", (e) => {
          if (e.key === "Enter" || e.key === " ") { e.preventDefault(); open(l, h); }
        });
        thumbs.push(c);
        table.append(c);
      }
    });

    const values = (l, h) => (S ? S.values[l + "." + h] : null);  // {score: [value, lo, hi], labels, ...}
    const interval = (x) => (x[1] === null ? "" : `${x[1].toFixed(3)} to ${x[2].toFixed(3)}`);

    function colourBy() {
      const s = scoreSel.value;
      definition.textContent = s ? `${s}: ${S.definitions[s]}; threshold ${S.thresholds[s]}` +
        (S.inputs[s] ? `; on ${S.inputs[s]}` : "") : "no score: frames are grey";
      for (const c of thumbs) {
        const v = values(c.dataset.layer, c.dataset.head), x = s && v ? v[s] : null;
        c.style.borderColor = x && x[0] !== null ? `rgb(${ramp(REDS, x[0]).join(",")})` : "#ddd";
        const score = x && x[0] !== null ? `: ${s} ${x[0].toFixed(3)}` + (x[1] === null ? "" : ` (95% ${interval(x)})`) : "";
        c.title = headName(d, +c.dataset.layer, c.dataset.head) + score + (v && v.labels ? `; labels ${v.labels}` : "");
      }
    }

    function open(l, h) {
      detail.dataset.layer = l; detail.dataset.head = h;
      if (d.sites) detail.dataset.site = d.sites[l].name;
      thumbs.forEach((c) => c.classList.toggle("iv-open", +c.dataset.layer === l && +c.dataset.head === h));
      const v = values(l, h), px = matrixPx(Math.max(...W.size(l)), 420);
      const rows = el("table", { class: "iv-scores", "data-role": "scores" });
      if (v) {
        const head = el("tr", {});
        head.append(...["score", "value", "95% interval", "definition"].map((t) => el("th", {}, t)));
        rows.append(head);
        for (const c of S.columns) {
          const x = v[c], tr = el("tr", { "data-score": c });
          const at = { positional_fraction: v.positional_offset,
            source_positional_fraction: v.source_positional_offset }[c];
          const offset = at !== undefined ? ` (offset ${at})` : "";
          tr.append(el("td", {}, c), el("td", {}, x[0] === null ? "n/a" : x[0].toFixed(3)), el("td", {}, interval(x)),
            el("td", { class: "iv-deftext" }, S.definitions[c] + offset));
          rows.append(tr);
        }
      }
      detail.replaceChildren(el("h4", {}, headName(d, l, h) + (v && v.labels ? `: ${v.labels}` : "")),
        matrix(d, W, l, h, px, info.set), info.node,
        v ? rows : el("p", {}, "No scores given (attention_grid(..., scores=detect_heads(model)))."));
      info.set("Hover the heatmap for a query, a key and the exact weight.");
    }

    scoreSel.addEventListener("change", colourBy);
    colourBy();
    detail.append(el("p", {}, "Click a thumbnail to open that head's pattern and its scores."));
  }

  function init(root) {
    if (root.dataset.ready || !["head", "grid"].includes(root.dataset.view)) return;  // another view's script draws it
    const d = JSON.parse(root.querySelector("script.iv-data").textContent);
    (root.dataset.view === "grid" ? grid : headView)(root, d);
    root.dataset.ready = "true";
    root.dataset.readyMs = Math.round(performance.now());
  }

  const me = document.currentScript && document.currentScript.closest(".interp-view");
  if (me) init(me);
  else document.querySelectorAll(".interp-view:not([data-ready])").forEach(init);
})();
