"""The HTML of ``interp report``'s page (``report.py`` computes what it shows): the strongest head of each class with
its score, interval and definition, the interactive grid and head views, the static figures, the studies' tables.
Style inline, figures as data URIs: no request of any kind.
"""

from __future__ import annotations

import html
import time

import pandas as pd

from ..heads import registry
from ..heads.labels import NO_CLASS
from ..data.stability import UNSTABLE_OVERLAP, UNSTABLE_SPEARMAN
from .report_circuit import edge_circuit_html
from .report_story import head_name
from .report_streaming import streaming_html

__all__ = ["page"]

_CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 2rem auto; max-width: 1200px;
       color: #222; line-height: 1.45; padding: 0 1rem; font-size: 15px; }
h1 { margin-bottom: 0.2rem; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; margin-top: 2.2rem; }
table { border-collapse: collapse; font-size: 0.88rem; margin: 0.6rem 0; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.55rem; text-align: right; }
th { background: #f4f4f4; } td.text, th.text { text-align: left; } td { white-space: nowrap; }
td.definition { max-width: 34rem; white-space: normal; }
img { max-width: 100%; height: auto; margin: 0.4rem 0.6rem 0.4rem 0; vertical-align: top; }
figure { display: inline-block; margin: 0.4rem 1rem 0.8rem 0; vertical-align: top; }
figcaption { font-size: 0.85rem; color: #444; max-width: 52rem; }
details { margin: 0.6rem 0; } summary { cursor: pointer; color: #1a4f8b; }
.muted { color: #666; font-size: 0.9rem; }
.side { display: flex; gap: 2rem; align-items: flex-start; } .found { margin: 0.6rem 0; font-size: 0.9rem; }
"""


def _table(df: pd.DataFrame, floatfmt: str = "{:.3f}", classes: dict[str, str] | None = None) -> str:
    classes = classes or {}

    def cell(column, v):
        if isinstance(v, float):
            return f"<td>{floatfmt.format(v)}</td>"
        return f'<td class="text {classes.get(column, "")}">{html.escape(str(v))}</td>'

    head = "".join(f'<th class="text">{html.escape(str(c))}</th>' for c in df.columns)
    rows = "".join("<tr>" + "".join(cell(c, v) for c, v in zip(df.columns, row)) + "</tr>"
                   for row in df.itertuples(index=False))
    return f"<table><tr>{head}</tr>{rows}</table>"


def _inputs_text(inputs: dict | None) -> str:
    """{kind: inputs} as "inputs (kind, kind); ..." """
    groups: dict[str, list[str]] = {}
    for kind, what in (inputs or {}).items():
        groups.setdefault(what, []).append(kind)
    return "; ".join(f"{what} ({', '.join(kinds)})" for what, kinds in groups.items())


_DEFINITIONS = registry.SCORE_DEFINITIONS


def _why_command(summary: dict, kind: str, layer, head: int) -> str:
    """The command that explains one head's attention (``analyses.qk_attribution``) on the pairs of its class: the
    class's target rule where it has one, else each query's top-1 key (MODEL: the model as the report was given it)."""
    record = registry.of_column(kind.split("+")[0])
    pairs = record.name if record is not None and record.how == "target" else "top1"
    return f"interp attribute --model MODEL --qk {layer}.{head} --pairs {pairs}"


def _column(kind: str) -> str:
    """The score column of a class (of a label's primary class): a positional class reads its fraction."""
    record = registry.of_column(kind.split("+")[0])
    return record.label_column if record is not None else kind.split("+")[0]


def _skipped(summary, section: str, title: str, anchor: str) -> str:
    """A section this model cannot have: its heading and one line saying why."""
    why = summary.get("skipped", {}).get(section)
    return f'<h2 id="{anchor}">{title}</h2>\n<p class="muted">Skipped: {html.escape(why)}.</p>' if why else ""


def _interval(lo, hi) -> str:
    return f"{lo:.3f} to {hi:.3f}" if lo == lo and hi == hi else ""


def _strongest_table(strongest: pd.DataFrame, thresholds: dict) -> str:
    """The strongest head of each class, its score with the 95% interval, and what the score measures."""
    top = strongest.groupby("class", sort=False).head(1)
    table = pd.DataFrame({
        "class": top["class"], "head": [head_name(r) for r in top.itertuples()],
        "score": top["score"].astype(float), "95% interval": [_interval(a, b) for a, b in zip(top["lo"], top["hi"])],
        "threshold": [f"{thresholds.get(k, 0):g}" for k in top["class"]], "labels": top["labels"],
        "what the score measures": [_DEFINITIONS.get(k, "") for k in top["class"]]})
    return _table(table, classes={"what the score measures": "definition"})


def _labelled_table(heads: pd.DataFrame) -> str:
    """Every labelled head with the score of its label and that score's interval, strongest first per class."""
    rows = []
    for r in heads[~heads["label"].isin(NO_CLASS)].to_dict(orient="records"):
        column = _column(r["label"])
        rows.append({"label": r["label"], "head": head_name(r), "score": float(r[column]),
                     "95% interval": _interval(r.get(f"{column}_lo", float("nan")), r.get(f"{column}_hi", float("nan"))),
                     "labels": r["labels"]})
    if not rows:
        return "<p>No head passes a threshold.</p>"
    table = pd.DataFrame(rows).sort_values(["label", "score"], ascending=[True, False])
    return _table(table)


def _evidence_html(heads: pd.DataFrame, thresholds: dict) -> str:
    """Where two scores give one class (``induction`` on random tokens, ``induction_text`` on corpus text): a
    sentence with how many heads clear it on all of them, and a table of the heads that clear it on some only, with
    each of the class's scores and its interval (``analyses.heads.labels.label_evidence``)."""
    if "evidence" not in heads:
        return ""
    by_class: dict[str, list] = {}
    for r in registry.labelled():
        if r.label_column in heads:
            by_class.setdefault(r.gives, []).append(r)
    rows, agreed = [], {}
    for row in heads.to_dict(orient="records"):
        for note in filter(None, str(row["evidence"]).split("; ")):
            kind, which = note.split(": ", 1)
            if which in ("both", "all"):
                agreed[kind] = agreed.get(kind, 0) + 1
                continue
            cleared = which.removesuffix(" only").split("+")
            said = {True: [], False: []}
            for r in by_class[kind]:
                c = r.label_column
                interval = _interval(row.get(f"{c}_lo", float("nan")), row.get(f"{c}_hi", float("nan")))
                said[r.name in cleared].append(f"{r.name} {row[c]:.3f} [{interval}], threshold "
                                               f"{thresholds.get(r.name, 0):g}")
            rows.append({"head": head_name(row), "class": kind, "cleared": "; ".join(said[True]),
                         "not cleared": "; ".join(said[False])})
    said = "; ".join(f"{k}: {' and '.join(r.name for r in rs)}, {agreed.get(k, 0)} heads clear every one"
                     for k, rs in by_class.items() if len(rs) > 1)
    text = (f'<p data-role="evidence">Classes that more than one score gives, each on its own prompts '
            f"({html.escape(said)}); a head takes the class when any of them clears its threshold. ")
    if not rows:
        return text + "No head clears one without the other.</p>"
    return text + f"{len(rows)} clear one only (the scores disagree):</p>" + _table(pd.DataFrame(rows))


def _stability_html(stable: dict | None) -> str:
    """One sentence naming the scores whose ranking of heads is unstable between two disjoint halves of their
    prompts or trials (``analyses.data.stability``), or saying that none is."""
    if not stable:
        return ""
    bad = {k: v for k, v in stable.items() if v.get("unstable")}
    if not bad:
        return (f'<p class="muted" data-role="stability">Every ranking of heads checked agrees between two disjoint '
                f"halves of its prompts ({html.escape(', '.join(stable))}).</p>")
    named = "; ".join(f"{k} (halves of its {v.get('halves', 'prompts')}: Spearman {v['spearman']:.2f}, top-{v['k']} "
                      f"overlap {v['top_k_overlap']:.0%})" for k, v in bad.items())
    return (f'<p data-role="stability">Unstable rankings, read them with care (two disjoint halves of the inputs '
            f"rank heads differently: Spearman under {UNSTABLE_SPEARMAN:g} or under {UNSTABLE_OVERLAP:.0%} of the "
            f"top heads shared): {html.escape(named)}.</p>")


def page(summary, heads, strongest, scan, curves, maps, scores, figures, views) -> str:
    """The report's index.html from what ``write_report`` computed; ``figures.img(name, alt)`` embeds a figure."""
    m = summary["model"]
    esc = html.escape
    shown = ("class", "family", "n_layers", "n_encoder_layers", "n_decoder_layers", "n_heads", "n_kv_heads", "d_head",
             "d_model", "block", "attn", "dtype", "n_params", "tokenizer")
    model_rows = pd.DataFrame([(k, str(m[k])) for k in shown if k in m], columns=["property", "value"])
    found = "".join(f"<li>{esc(line)}</li>" for line in summary["structure"])
    thresholds = summary["thresholds"] or {}
    counts = ", ".join(f"{k} {v}" for k, v in summary["label_counts"].items())
    n_labelled = int((~heads["label"].isin(NO_CLASS)).sum())
    kind_of = {s: registry.of_column(s).name for s in scores if registry.of_column(s) is not None}
    intervals = "each cell: the score and, below it, its 95% bootstrap interval over prompts"
    grids = "".join(
        f"<figure>{figures.img(f'grid_{s}', f'{s} score per head')}<figcaption><b>{esc(s)}</b>: "
        f"{esc(_DEFINITIONS.get(kind_of.get(s, s), ''))}; threshold {thresholds.get(kind_of.get(s, s), 0):g}; "
        f"{intervals if s in summary['grids_with_intervals'] else 'each cell: the score'}.</figcaption></figure>"
        for s in scores)
    maps_html = "".join(
        f"<figure>{figures.img(name, f'attention map of {kind} head {l}.{h} on {what}')}<figcaption>{esc(kind)}: "
        f"{esc(_DEFINITIONS.get(kind, ''))}. Why it attends there, split into the upstream parts of its queries and "
        f"keys (QK attribution, with a causal check): <code>{esc(_why_command(summary, kind, l, h))}</code>."
        f"</figcaption></figure>" for kind, l, h, what, name in maps)
    files = ["heads.csv", "ablation.csv", "pruning.csv", "summary.json"] + \
        (["attribution.csv", "dla.csv"] if summary.get("circuits") else []) + \
        (["streaming.csv"] if summary.get("streaming") else [])
    top = pd.DataFrame(summary["most_important_by_ablation"])
    seconds = summary["seconds"]
    formats = ", ".join(summary.get("figure_formats", ["png"]))
    head_views = "".join(views["head_views_html"]) or "<p>No labelled heads to show.</p>"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,"><title>{esc(m.get('name', m['class']))}: attention heads (interp report)</title>
<style>{_CSS}</style></head><body>
<h1 data-role="model-name">{esc(m.get('name', m['class']))}: attention heads</h1>
<p>{esc(m.get('size', ''))}.</p>
<h2 id="findings">Findings</h2>
<ul data-role="findings">{''.join(f'<li>{line}</li>' for line in summary.get('findings', []))}</ul>
<p class="muted">interp report, {esc(time.strftime('%Y-%m-%d %H:%M'))}; attention path {esc(m['attn'])};
torch {esc(summary['versions']['torch'])}, transformers {esc(summary['versions']['transformers'])};
{seconds['total']:.1f} s on {summary['threads']} CPU thread(s). Files:
{', '.join(f'<a href="{f}"><code>{f}</code></a>' for f in files)}; figures in <code>figures/</code> ({esc(formats)}).
The model's internals (what discovery found) are at the end of the page.</p>

<h2 id="classes">Strongest head of each class</h2>
<p>Each class's highest-scoring head, its score with the 95% bootstrap interval over prompts, and what the score
measures; <b>labels</b> lists every class a head clears, most specific first (the first is its primary label).
Label counts: {esc(counts)}. Inputs: {esc(_inputs_text(summary['head_inputs']))}.</p>
{_strongest_table(strongest, thresholds) if len(strongest) else '<p>No head passes a threshold.</p>'}
<details><summary>All {n_labelled} labelled heads</summary>{_labelled_table(heads)}</details>
{_evidence_html(heads, thresholds)}{_stability_html(heads.attrs.get("stability"))}
<p class="muted">Every head with every score and interval: <a href="heads.csv"><code>heads.csv</code></a>.</p>

{_class_ablation_html(summary.get("class_ablation")) or _skipped(summary, "class_ablation",
 "Does each class do what its name says?", "classes-causal")}

<h2>Explore every head</h2>
<p>Each head's pattern on {esc(views['grid_prompt'])} (queries down, keys across; colour: square root of the
weight), framed in the colour of the score chosen above the grid. Click a head to open its pattern large, with
the exact weight under the pointer, its scores, their intervals and definitions.</p>
{views['grid']}

<h2>The strongest heads, token by token</h2>
<p>A head view per prompt: pick a layer, hover a token on the left to see where it attends, on the right to see
what attends to it; the squares beside the tokens give each head's exact weight on hover.</p>
{head_views}

<h2>Static figures</h2>
<p>The same scores and patterns as figures for papers (<code>interp report --fmt svg,pdf</code> writes them as
vector files).</p>
<details><summary>Scores per head: {len(scores)} grids (framed cells: heads whose primary label is that
class)</summary>{grids}</details>
<details><summary>Attention maps: the strongest head of each class on a prompt that exercises it (repeated random
tokens for induction and duplicate-token heads, the example text for the others)</summary>
{maps_html or '<p>No labelled heads to show.</p>'}</details>

<h2 id="ablation">Ablation scan</h2>
<p>Zero-ablating each head alone on {esc(summary['study_inputs'])}; metric <code>{esc(summary['metric'])}</code>,
baseline {summary['baseline']:.4f}. Cells show the change in the metric
(<a href="ablation.csv"><code>ablation.csv</code></a>). One run on these prompts, without an interval: a scan that
points at heads to test, not a finding (the findings above come with their random-head or bootstrap comparisons).</p>
{figures.img('ablation', 'ablation scan heatmap')}
<p>Heads whose ablation hurts most:</p>
{_table(top, '{:.4f}')}

{_circuits_html(summary.get("circuits"), figures) or _skipped(summary, "circuits", "Circuits", "circuits")}

<h2 id="pruning">Pruning curve</h2>
<p>Heads pruned (zero-ablated) in order of Michel et al.'s importance, recomputed at each step, against
random orders (mean of 3 seeds, range shaded), {summary.get('pruning_step', 0.1) * 100:.0f}% of the remaining heads at
each step, on {esc(summary['study_inputs'])}, metric <code>{esc(summary['metric'])}</code>;
<a href="pruning.csv"><code>pruning.csv</code></a>.</p>
{figures.img('pruning', 'pruning curve')}
{_table(curves.rename(columns={"area": "area (" + _better(summary.get("higher_is_better")) + ")"}), '{:.3f}')}
{streaming_html(summary.get("streaming"), figures, _table)}<p class="muted">Stage times (s): {esc(', '.join(f'{k} {v}' for k, v in seconds.items()))}.</p>

<h2 id="model">Model internals</h2>
<details><summary>What discovery found: {esc(m['class'])}, its layout and hook points</summary>
<div class="side">{_table(model_rows)}<ul class="found">{found}</ul></div>
<p>Its attention sites (a head is a site and a head number; where each layer has one site, layer.head):</p>
{_table(pd.DataFrame(summary["sites"]))}</details>
</body></html>
"""


def _circuits_html(c, figures) -> str:
    if not c:
        return ""
    esc = html.escape
    table = pd.DataFrame(c["top_heads"])
    table["head"] = [head_name(r) for r in c["top_heads"]]
    return f"""<h2 id="circuits">Circuits: which heads carry {esc(c.get('name', 'the induction task'))}</h2>
<p>{esc(c['task'])}; metric <code>{esc(c['metric'])}</code> ({esc(c.get('measures', ''))}), clean
{c['clean']:.3f}, corrupted {c['corrupted']:.3f}. <b>Attribution patching</b> estimates, from one backward pass,
how much of the way from corrupted to clean each head's clean output alone would take the model (effect 0:
corrupted, 1: clean; <a href="attribution.csv"><code>attribution.csv</code></a>); the eight heads it ranks highest
were then patched exactly (<b>activation patching</b>):</p>
{figures.img('attribution', 'attribution patching heatmap')}
{_table(table[['head', 'effect', 'estimate']], '{:.3f}')}
<p><b>Direct logit attribution</b> of {esc(c.get('answer', ''))}: each component's direct
contribution to the correct token's logit ({c['dla_logit']:.2f}; what the split leaves out:
{c['dla_remainder']:.1e}; <a href="dla.csv"><code>dla.csv</code></a>).</p>
{figures.img('dla', 'direct logit attribution bars')}
{edge_circuit_html(c.get("edge_circuit"), figures, c.get("name", "the induction task"))}"""


def _better(higher_is_better) -> str:
    return "higher is better" if higher_is_better else "lower is better" if higher_is_better is not None else "area"


def _class_ablation_html(c) -> str:
    """Each class's heads ablated together against as many random heads of the same layers."""
    if not c or not c["rows"]:
        return ""
    rows = []
    for r in c["rows"]:
        rand = r["random"]
        rows.append({"class": r["class"], "heads ablated": " ".join(r["heads"]), "second-copy loss": r["ablated"],
                     f"random heads, mean of {c['draws']}": sum(rand) / len(rand) if rand else float("nan"),
                     "random range": f"{min(rand):.3f} to {max(rand):.3f}" if rand else "n/a",
                     "gain removed": f"{r['share'] * 100:.0f}%",
                     "by random heads": (f"{min(r['random_share']) * 100:.0f} to {max(r['random_share']) * 100:.0f}%"
                                         if rand else "n/a")})
    return f"""<h2 id="classes-causal">Does each class do what its name says?</h2>
<p>Each class's strongest heads (primary label, at most 8) zero-ablated together, against {c['draws']} draws of as
many random heads from the same layers, on {html.escape(c['task'])}. Clean: first-copy loss
{c['first_copy_loss']:.3f}, second-copy loss {c['second_copy_loss']:.3f}; the in-context gain is their difference,
and "gain removed" is how much of it the ablation takes away (the range over the random draws beside it).</p>
{_table(pd.DataFrame(rows), '{:.3f}')}"""
