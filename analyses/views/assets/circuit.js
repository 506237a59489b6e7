/* interp circuit view (analyses/views/circuit_view.py). Vanilla JavaScript, no request: the data is the JSON block
   beside this script. Every string from the data is written with textContent, never as markup. */
(function () {
  "use strict";
  const SVG = "http://www.w3.org/2000/svg";
  const INPUTS = ["q", "k", "v", "mlp", "logits"];
  const DASH = { q: "", k: "5 3", v: "1.5 2.5", mlp: "", logits: "" };
  const PAD = 34, R = 6;  // margin, node radius

  function el(tag, attrs, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function sv(tag, attrs) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    return e;
  }
  const fmt = (v) => (v === null || v === undefined ? "n/a" : v.toFixed(3));

  function faithfulnessAt(curve, n) {  // measured at n, or on the line between the sizes either side
    if (!curve.length) return null;
    for (const [size, f, lo, hi] of curve) if (size === n) return { f, lo, hi, exact: true };
    for (let i = 1; i < curve.length; i++) {
      const [s0, f0] = curve[i - 1], [s1, f1] = curve[i];
      if (s0 < n && n < s1 && f0 !== null && f1 !== null)
        return { f: f0 + (f1 - f0) * (n - s0) / (s1 - s0), between: [s0, s1] };
    }
    return null;
  }

  function draw(root, d) {
    const head = el("div", { class: "cv-title", "data-role": "title" }, d.title);
    const bar = el("div", { class: "cv-bar" });
    const slider = el("input", { type: "range", min: "1", max: String(d.edges.length), value: String(d.top),
                                 step: "1", "data-role": "slider", "aria-label": "edges kept" });
    const count = el("span", { "data-role": "count" });
    const faith = el("span", { "data-role": "faithfulness", class: "cv-faith" });
    bar.append(el("label", {}, "top edges "), slider, count, faith);
    const filters = el("span", { class: "cv-filters" });
    const shownInputs = new Set(INPUTS);
    for (const w of INPUTS) {
      const box = el("input", { type: "checkbox", "data-role": "input-filter", "data-input": w });
      box.checked = true;
      box.addEventListener("change", () => { box.checked ? shownInputs.add(w) : shownInputs.delete(w); update(); });
      const lab = el("label", { class: "cv-filter" });
      lab.append(box, document.createTextNode(" " + w));
      filters.append(lab);
    }
    bar.append(filters);
    const legend = el("div", { class: "cv-legend" },
      "blue: the edge raises the metric, red: lowers it; width: |score|. Into a head: q solid (upper), k dashed " +
      "(middle), v dotted (lower). Hover an edge or a head; click a head for its pattern.");

    const COL = Math.max(46, Math.min(120, 900 / d.columns.length));  // pixels per column and per row: larger for
    const ROW = Math.max(26, Math.min(48, 320 / d.rows));  // a small model
    const px = (x) => PAD + x * COL, py = (y) => PAD + y * ROW;
    const width = px(Math.max(...d.columns.map((c) => c[0]))) + PAD, height = py(d.rows - 1) + PAD + 6;
    const svg = sv("svg", { viewBox: `0 0 ${width} ${height}`, width: String(width), height: String(height),
                             "data-role": "graph", class: "cv-graph" });
    for (const [x, label] of d.columns) {
      const t = sv("text", { x: px(x), y: 14, "text-anchor": "middle", class: "cv-col" });
      t.textContent = label.replace("layer ", "");
      svg.append(t);
    }
    const edgeLayer = sv("g", {}), nodeLayer = sv("g", {});
    svg.append(edgeLayer, nodeLayer);
    const tip = el("div", { class: "cv-tip", "data-role": "tooltip" });
    tip.hidden = true;
    const max = Math.max(1e-30, ...d.edges.map((e) => Math.abs(e[3])));
    const paths = d.edges.map((e, rank) => {
      const [u, t, code, score, y2] = e, a = d.nodes[u], b = d.nodes[t], w = INPUTS[code];
      const x1 = px(a[2]) + R, y1 = py(a[3]), x2 = px(b[2]) - R, yy = py(y2), mid = (x1 + x2) / 2;
      const p = sv("path", { d: `M${x1},${y1} C${mid},${y1} ${mid},${yy} ${x2},${yy}`, class: "cv-edge",
                             stroke: score >= 0 ? "#2166ac" : "#b2182b",
                             "stroke-width": (0.6 + 4.4 * Math.abs(score) / max).toFixed(2),
                             "stroke-dasharray": DASH[w], "data-role": "edge", "data-rank": String(rank + 1),
                             "data-input": w, "data-score": String(score),
                             "data-sign": score >= 0 ? "+" : "-" });
      p.addEventListener("mouseenter", (ev) => show(ev, `${a[0]} → ${w === "mlp" || w === "logits" ? b[0] :
        b[0] + " (" + w + " input)"}: score ${score >= 0 ? "+" : ""}${score.toPrecision(4)}, rank ${rank + 1}`));
      p.addEventListener("mouseleave", hide);
      edgeLayer.append(p);
      return p;
    });
    const circles = d.nodes.map((n, i) => {
      const [name, kind, x, y, labels] = n;
      const c = sv(kind === "head" ? "circle" : "rect", kind === "head"
        ? { cx: px(x), cy: py(y), r: R }
        : { x: px(x) - R, y: py(y) - R, width: 2 * R, height: 2 * R, rx: 2 });
      c.setAttribute("class", `cv-node cv-${kind}`);
      c.setAttribute("data-role", "node");
      c.setAttribute("data-node", name);
      c.setAttribute("data-kind", kind);
      c.addEventListener("mouseenter", (ev) => show(ev, name + (labels ? ` — atlas: ${labels}` : "") +
        (kind === "head" && d.patterns.heads[name] ? " (click: its pattern)" : "")));
      c.addEventListener("mouseleave", hide);
      if (kind === "head") c.addEventListener("click", () => pattern(name));
      nodeLayer.append(c);
      return c;
    });
    const panel = el("div", { class: "cv-pattern", "data-role": "pattern" });
    panel.append(el("p", { class: "cv-note" }, Object.keys(d.patterns.heads).length
      ? "Click a head of the circuit to see its attention pattern on the task's prompt."
      : "No patterns embedded (circuit_view(circuit, model, prompt=...) adds them)."));
    const scroll = el("div", { class: "cv-scroll" });
    scroll.append(svg);
    root.append(head, bar, legend, scroll, tip, panel);

    function show(ev, text) {
      tip.textContent = text;
      tip.hidden = false;
      const box = root.getBoundingClientRect();
      tip.style.left = `${ev.clientX - box.left + 12}px`;
      tip.style.top = `${ev.clientY - box.top + 12}px`;
    }
    function hide() { tip.hidden = true; }

    function update() {
      const n = +slider.value, on = new Set();
      paths.forEach((p, i) => {
        const visible = i < n && shownInputs.has(p.dataset.input);
        p.style.display = visible ? "" : "none";
        if (visible) { on.add(d.edges[i][0]); on.add(d.edges[i][1]); }
      });
      circles.forEach((c, i) => c.classList.toggle("cv-on", on.has(i)));
      count.textContent = `${n} of ${d.edges.length} edges` +
        (d.total_edges ? ` (the model has ${d.total_edges})` : "");
      const f = faithfulnessAt(d.curve, n);
      faith.textContent = f === null ? "faithfulness: not measured at this size"
        : f.exact ? `faithfulness ${fmt(f.f)} [${fmt(f.lo)}, ${fmt(f.hi)}] (measured)`
        : `faithfulness ≈ ${fmt(f.f)} (between the sizes ${f.between[0]} and ${f.between[1]})`;
      faith.dataset.value = f === null ? "" : String(f.f);
    }

    function pattern(name) {
      const b64 = d.patterns.heads[name];
      panel.replaceChildren();
      panel.dataset.node = name;
      if (!b64) {
        panel.append(el("p", { class: "cv-note" }, `${name}: no pattern embedded for this head.`));
        return;
      }
      const w = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0)), toks = d.patterns.tokens, n = toks.length;
      const cell = 16, left = 90, topPad = 64;
      const g = sv("svg", { width: String(left + n * cell + 4), height: String(topPad + n * cell + 4),
                            "data-role": "pattern-grid" });
      toks.forEach((t, i) => {
        const a = sv("text", { x: left - 4, y: topPad + i * cell + cell * 0.7, "text-anchor": "end", class: "cv-tok" });
        a.textContent = t;
        const b = sv("text", { transform: `translate(${left + i * cell + cell * 0.7},${topPad - 4}) rotate(-60)`,
                               class: "cv-tok" });
        b.textContent = t;
        g.append(a, b);
      });
      for (let q = 0; q < n; q++) for (let k = 0; k < n; k++) {
        const v = w[q * n + k] / 255;
        const r = sv("rect", { x: left + k * cell, y: topPad + q * cell, width: cell - 1, height: cell - 1,
                               fill: `rgba(33,102,172,${v.toFixed(3)})`, "data-q": String(q), "data-k": String(k),
                               "data-weight": v.toFixed(3), class: "cv-cell" });
        r.addEventListener("mouseenter", (ev) => show(ev, `${toks[q]} → ${toks[k]}: ${v.toFixed(3)}`));
        r.addEventListener("mouseleave", hide);
        g.append(r);
      }
      const labels = d.nodes.find((m) => m[0] === name)[4];
      panel.append(el("h4", {}, `${name}${labels ? " (" + labels + ")" : ""}: attention on the task's prompt` +
        (d.patterns.skipped ? ` (its last ${n} tokens)` : "")), g);
    }

    slider.addEventListener("input", update);
    update();
  }

  function init(root) {
    if (root.dataset.ready || root.dataset.view !== "circuit") return;
    draw(root, JSON.parse(root.querySelector("script.iv-data").textContent));
    root.dataset.ready = "true";
    root.dataset.readyMs = Math.round(performance.now());
  }

  const me = document.currentScript && document.currentScript.closest(".interp-view");
  if (me) init(me);
  else document.querySelectorAll('.interp-view[data-view="circuit"]:not([data-ready])').forEach(init);
})();
