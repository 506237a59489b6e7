"""The page of a head atlas (``analyses.atlas.atlas``): one offline HTML file with the model's identity (weights and
tokenizer digests, versions, settings), every score that ran (definition, threshold, prompts and their digest, the
stability of its ranking, a warning where it is unstable) and those that did not with the reason, the causal check of
each class (its share of the in-context gain against every random draw), and a table of every head, sortable by any
column and filtered by class and layer, each head linked to its head view (a second page, ``NAME_heads.html``, opened
on that head's layer with that head alone). The report's style; no request of any kind.

Stable attributes for tests: ``data-role`` (heads, head, class-filter, layer-filter, count, scores, causal, draw),
``data-layer``, ``data-head``, ``data-site``, ``data-labels``, ``data-sort`` (a column's key), ``data-value``.
"""

from __future__ import annotations

import html
from pathlib import Path

from interp.runtime.files import atomic_write

from ..atlas.atlas import WRITTEN_BY, ours
from .report_page import _CSS

__all__ = ["atlas_page", "write_atlas_pages"]

_MORE_CSS = """
.warn { color: #a33; font-weight: 600; } .bar { display: flex; gap: 1.2rem; align-items: center; flex-wrap: wrap; }
th[data-sort] { cursor: pointer; } th[data-sort]:hover { background: #e8eef6; } small { color: #666; }
tr[hidden] { display: none; } .wide { overflow-x: auto; } code { font-size: 0.85rem; } td.lab { text-align: left; }
"""

_SCRIPT = """
(function () {
  "use strict";
  const table = document.querySelector('[data-role="heads"]');
  const rows = [...table.tBodies[0].rows];
  const cls = document.querySelector('[data-role="class-filter"]');
  const lay = document.querySelector('[data-role="layer-filter"]');
  const count = document.querySelector('[data-role="count"]');
  function filter() {
    let shown = 0;
    for (const r of rows) {
      const ok = (!cls.value || r.dataset.labels.split("+").includes(cls.value)) &&
                 (lay.value === "" || r.dataset.layer === lay.value);
      r.hidden = !ok; shown += ok;
    }
    count.textContent = shown + " of " + rows.length + " heads";
  }
  cls.addEventListener("change", filter); lay.addEventListener("change", filter);
  let key = null, down = true;
  table.querySelectorAll("th[data-sort]").forEach((th, i) => th.addEventListener("click", () => {
    down = key === i ? !down : th.dataset.sort !== "text";  // numbers highest first, text A-Z first
    key = i;
    const value = (r) => r.cells[i].dataset.value;
    const num = th.dataset.sort !== "text";
    rows.sort((a, b) => {
      let x = value(a), y = value(b);
      if (num) { x = x === "" ? -Infinity : +x; y = y === "" ? -Infinity : +y; return down ? y - x : x - y; }
      return down ? y.localeCompare(x) : x.localeCompare(y);
    });
    table.tBodies[0].append(...rows);
    table.querySelectorAll("th[data-sort]").forEach((h) => h.removeAttribute("aria-sort"));
    th.setAttribute("aria-sort", down ? "descending" : "ascending");
  }));
  filter();
})();
"""


def _t(v) -> str:
    """Any value from the atlas file as page text: escaped, whatever its type (a shared file is anyone's)."""
    return html.escape(str(v))


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _n(v, spec: str = "") -> str:
    """A number from the file formatted with ``spec``; anything else in its place shown as escaped text."""
    return format(v, spec) if _is_num(v) else _t(v)


def _fmt(v, digits: int = 3) -> str:
    return "n/a" if v is None else _n(v, f".{digits}f")


def _cell(v) -> str:
    """A table's value: an offset (a whole number) as one, a score with 3 decimals."""
    if not _is_num(v):
        return "n/a" if v is None else _t(v)
    return f"{v:.0f}" if float(v).is_integer() and abs(v) > 1 else f"{v:.3f}"


def _short(digest, missing: str = "none") -> str:
    return missing if not digest else f'<code title="{_t(digest)}">{_t(str(digest)[:16])}</code>'


_OWN = '<span class="muted">drawn by its runner from the seed (no digest recorded)</span>'


def _head_name(h: dict) -> str:
    return f"{int(h['layer'])}.{h['head']}" if h.get("layer") is not None else f"{h['site']}.{h['head']}"


def _stability(s) -> str:
    if not s:
        return '<span class="muted">not reported by its runner</span>'
    text = (f"Spearman {_fmt(s.get('spearman'), 2)}, top-{_t(s.get('k'))} overlap {_fmt(s.get('top_k_overlap'), 2)}")
    return f'<span class="warn">unstable: {text}</span>' if s.get("unstable") else text


def _scores_html(atlas: dict) -> str:
    rows = []
    for name, r in atlas["scores"].items():
        threshold = ("no label" if r.get("threshold") is None
                     else f"{_n(r['threshold'], 'g')} on <code>{_t(r.get('column'))}</code>")
        cite = f" ({_t(r['citation'])})" if r.get("citation") else ""
        rows.append(f'<tr data-score="{_t(name)}"><td class="text"><b>{_t(name)}</b></td>'
                    f'<td class="text definition">{_t(r.get("definition", ""))}{cite}</td><td>{threshold}</td>'
                    f'<td class="text definition">{_t(str(r.get("inputs") or ""))}<br>'
                    f'{_short(r.get("prompt_sha256"), _OWN)}</td><td class="text">{_stability(r.get("stability"))}</td></tr>')
    skipped = "".join(f"<li><b>{_t(n)}</b>: {_t(why)}</li>" for n, why in atlas["not_run"].items())
    return (f'<table data-role="scores"><tr><th class="text">score</th><th class="text">what it measures</th>'
            f'<th class="text">threshold</th><th class="text">prompts (sha256 of their token ids)</th>'
            f'<th class="text">stability (two halves of its items)</th></tr>{"".join(rows)}</table>'
            + (f"<details><summary>Scores not run ({len(atlas['not_run'])})</summary><ul>{skipped}</ul></details>"
               if skipped else ""))


def _strip(share, draws) -> str:
    """An inline SVG: each random draw's share (grey) and the class's (red) on 0..100% of the gain."""
    values = [v for v in [share, *draws] if v is not None]
    lo, hi = min([0.0, *values]), max([1.0, *values])
    x = lambda v: 6 + 228 * (v - lo) / (hi - lo)  # noqa: E731
    dots = "".join(f'<circle data-role="draw" data-value="{v:.4f}" cx="{x(v):.1f}" cy="10" r="4" fill="#999" '
                   f'fill-opacity="0.6"><title>random draw: {v * 100:.1f}%</title></circle>'
                   for v in draws if v is not None)
    mark = (f'<circle cx="{x(share):.1f}" cy="10" r="5" fill="#c0392b"><title>the class: {share * 100:.1f}%'
            f'</title></circle>' if share is not None else "")
    return (f'<svg width="240" height="20" role="img" aria-label="shares of the gain removed">'
            f'<line x1="{x(0):.1f}" x2="{x(1):.1f}" y1="10" y2="10" stroke="#ccc"/>{dots}{mark}</svg>')


def _causal_html(causal: dict) -> str:
    if "rows" not in causal:
        return f'<p class="muted" data-role="causal">Not run: {_t(causal.get("not_run", ""))}.</p>'
    rows = []
    for r in causal["rows"]:
        draws = [v for v in r["random_share"] if v is not None]
        beaten = sum(r["share"] is not None and r["share"] > v for v in draws)
        spread = ", ".join(f"{v * 100:.0f}" for v in sorted(draws))
        rows.append(f'<tr data-class="{_t(r["class"])}"><td class="text"><b>{_t(r["class"])}</b>'
                    f'</td><td class="text">{_t(", ".join(map(str, r["heads"])))}</td>'
                    f'<td>{_fmt(r["share"] * 100 if r["share"] is not None else None, 1)}%</td>'
                    f'<td class="text definition">{spread}%</td><td>{beaten} of {len(draws)}</td>'
                    f'<td>{_strip(r["share"], draws)}</td>{_own_test_html(r)}</tr>')
    return (f'<p>Each class\'s strongest heads (at most 8) zero-ablated together, against {_t(causal["draws"])} draws of '
            f'as many random heads from the same layers, on {_t(causal["task"])}: the share of the '
            f'in-context gain (first-copy loss {_fmt(causal["first_copy_loss"])} minus second-copy loss '
            f'{_fmt(causal["second_copy_loss"])}) that the ablation removes.</p>'
            '<table data-role="causal"><tr><th class="text">class</th><th class="text">heads ablated</th>'
            '<th>share removed</th><th class="text">random draws, sorted (%)</th><th>draws it beats</th>'
            f'<th class="text">class (red) and draws (grey)</th><th class="text">on the behaviour it is named for'
            f'</th></tr>{"".join(rows)}</table>')


def _own_test_html(r: dict) -> str:
    """The class's check on its own behaviour (``analyses.atlas.class_ablation.own_task``): the verdict, and the effect
    against the random draws' where it was measured."""
    test, verdict = r.get("own_test"), r.get("verdict", "")
    numbers = ""
    if test and test.get("clean") is not None:
        draws = [v for v in test["random_effect"] if v == v]
        numbers = (f' (effect on {_t(test["measure"])}: {_fmt(test["effect"], 3)}; random '
                   f'{_fmt(min(draws), 3) if draws else "n/a"} to {_fmt(max(draws), 3) if draws else "n/a"})')
    confirmed = {True: "yes", False: "no", None: "none"}[r.get("confirmed")]
    return (f'<td class="text definition" data-role="verdict" data-confirmed="{confirmed}">{_t(verdict)}'
            f'{numbers}</td>')


def _heads_html(atlas: dict, heads_page: str | None) -> str:
    columns = list(dict.fromkeys(c for h in atlas["heads"] for c in h["values"]))
    classes = sorted({c for h in atlas["heads"] for c in h["labels"].split("+") if c})
    layers = sorted({int(h["layer"]) for h in atlas["heads"] if h.get("layer") is not None})
    head = ('<th class="text" data-sort="text">head</th><th data-sort="number">layer</th>'
            '<th class="text" data-sort="text">label</th><th class="text" data-sort="text">classes</th>'
            + "".join(f'<th data-sort="number">{_t(c)}</th>' for c in columns))
    body = []
    for h in atlas["heads"]:
        name = _head_name(h)
        layer = "" if h.get("layer") is None else int(h["layer"])
        link = (f'<a href="{_t(heads_page)}#layer={layer}&amp;head={_t(h["head"])}" title="its head view">'
                f'{_t(name)}</a>' if heads_page and layer != "" else _t(name))
        cells = [f'<td class="text" data-value="{_t(name)}">{link}</td>',
                 f'<td data-value="{layer}">{layer}</td>',
                 f'<td class="text lab" data-value="{_t(h["label"])}">{_t(h["label"])}</td>',
                 f'<td class="text lab" data-value="{_t(h["labels"])}">{_t(h["labels"])}</td>']
        for c in columns:
            e = h["values"].get(c) or {}
            v = e.get("value")
            interval = (f' <small>[{_fmt(e["lo"])}, {_fmt(e["hi"])}]</small>'
                        if e.get("lo") is not None and e.get("hi") is not None else "")
            cells.append(f'<td data-value="{"" if v is None else _n(v, ".6g")}">{_cell(v)}{interval}</td>')
        body.append(f'<tr data-role="head" data-site="{_t(h["site"])}" data-layer="{layer}" '
                    f'data-head="{_t(h["head"])}" data-labels="{_t(h["labels"])}">{"".join(cells)}</tr>')
    options = "".join(f'<option value="{_t(c)}">{_t(c)}</option>' for c in classes)
    layer_options = "".join(f'<option value="{layer}">{layer}</option>' for layer in layers)
    return (f'<div class="bar"><label>class <select data-role="class-filter"><option value="">any</option>{options}'
            f'</select></label><label>layer <select data-role="layer-filter"><option value="">any</option>'
            f'{layer_options}</select></label><span data-role="count" class="muted"></span>'
            '<span class="muted">click a column to sort; a head opens its head view</span></div>'
            f'<div class="wide"><table data-role="heads"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody>'
            '</table></div>')


def atlas_page(atlas: dict, heads_page: str | None = None) -> str:
    """The atlas as one offline HTML page; ``heads_page``: the file name of its head view (linked from each head)."""
    m, v, s = atlas["model"], atlas["versions"], atlas["settings"]
    title = f"Head atlas: {m['name']}"
    unstable = [n for n, r in atlas["scores"].items() if (r.get("stability") or {}).get("unstable")]
    warning = (f'<p class="warn">Unstable rankings (two halves of the items disagree): {_t(", ".join(unstable))}. '
               "Read these scores' top heads as candidates.</p>" if unstable else "")
    cost = atlas.get("cost", {})
    needle = f" haystacks of up to {_t(s['context'])} tokens," if any(
        r.get("prompts") == "needle" for r in atlas["scores"].values()) else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="generator" content="{WRITTEN_BY}">
<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">
<title>{_t(title)}</title><style>{_CSS}{_MORE_CSS}</style></head><body>
<h1>{_t(title)}</h1>
<p class="muted">{_n(m['parameters'], ',')} parameters, {_t(m['heads'])} heads in {_t(m['sites'])} attention sites
({_t(m['class'])}); atlas schema {_t(atlas['schema'])}, written {_t(str(atlas.get('created', '')))}
by interp {_t(v['interp'])}, transformers {_t(v['transformers'])}, torch {_t(v['torch'])},
{_t(v['attn'])} attention, {_t(s['dtype'])} on {_t(s['device'])};
{_t(cost.get('cpu_s', 'n/a'))} s of CPU time on {_t(cost.get('threads', 'n/a'))} thread(s).</p>
<p class="muted">weights sha256 {_short(m['weights_sha256'])}, tokenizer sha256 {_short(m['tokenizer_sha256'])};
seed {_t(s['seed'])}, {_t(s['n_prompts'])} prompts of {_t(s['seq_len'])} tokens,{needle}
{_t(s['n_bootstrap'])} bootstrap resamples (95% intervals in brackets), {_t(s['draws'])} random draws per class.
Compare with another run: <code>interp atlas diff THIS.json OTHER.json</code>.</p>
{warning}
<h2 id="scores">Scores</h2>
{_scores_html(atlas)}
<h2 id="causal">Does each class do what its name says?</h2>
{_causal_html(atlas['causal'])}
<h2 id="heads">Heads</h2>
{_heads_html(atlas, heads_page)}
<script>{_SCRIPT}</script>
</body></html>
"""


def write_atlas_pages(model, atlas: dict, folder: str | Path, name: str, overwrite: bool = False,
                      text=None) -> list[Path]:
    """Write ``NAME.html`` (the atlas page) and ``NAME_heads.html`` (a head view of every head on ``text``, default
    the report's example prompt) into ``folder``. With ``overwrite`` only pages we wrote are replaced."""
    from .attention import head_view
    from .report import example_prompt

    folder = Path(folder)
    page, heads = folder / f"{name}.html", folder / f"{name}_heads.html"
    for path in (page, heads):
        if path.exists() and overwrite and not ours(path):
            raise FileExistsError(f"{str(path)!r} exists and is not a page interp atlas wrote; it is not replaced, "
                                  "even with --force: move it away or choose another --out.")
    view = head_view(model, text if text is not None else example_prompt(model),
                     title=f"{atlas['model']['name']}: every head (from its atlas)")
    generator = f'<meta name="generator" content="{WRITTEN_BY}">'
    atomic_write(heads, view.page().replace('<meta charset="utf-8">', f'<meta charset="utf-8">{generator}', 1),
                 overwrite=overwrite)
    atomic_write(page, atlas_page(atlas, heads.name), overwrite=overwrite)
    return [page, heads]

