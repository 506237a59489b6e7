"""The report's edge circuit of the induction task (issue 49), sized to stay cheap: EAP-IG with 3 steps on the circuit
task's prompts, the faithfulness of the top 10, 20 and 40 edges by exact patching against 3 random circuits of each
size, the circuit's figure (``circuit_figure``) and curve (``faithfulness_plot``), and the finding in one sentence.
A model whose graph the circuits do not cover (``analyses.circuits.graph.check_graph``), or whose graph has more than
``MAX_GRAPH`` edges (SmolLM2 has 70,651: 46 CPU s for this part), gets a one-line note."""

from __future__ import annotations

import html

from ..circuits.attribution import edge_attribution
from ..circuits.evaluation import faithfulness
from ..circuits.graph import graph_edges
from ..circuits.saved import circuit_of
from .circuit_figure import circuit_figure
from .circuit_plots import faithfulness_plot

__all__ = ["edge_circuit", "edge_circuit_finding", "edge_circuit_html"]

SIZES = (10, 20, 40)  # edges: the toy's 110 and SmolLM2's ~70,000 alike; each size is 1 + 1 + RANDOM patched runs
STEPS, RANDOM = 3, 3
MAX_GRAPH = 100_000  # edges; beyond, edge attribution and the curve's patched runs outgrow the report's time (COST)
COST = ("SmolLM2's 70,651 edges take this part 46 s of CPU time, 1 thread, measured 2026-11-28; the rest of the "
        "report about 2 min; its cost grows with the edges")


def edge_circuit(model, task: dict, figures) -> dict:
    """The induction task's edge circuit as the report's summary holds it, its two figures added to ``figures``;
    ``{"skipped": why}`` for a model the graph does not cover."""
    try:
        n_edges = len(graph_edges(model))
    except ValueError as err:
        return {"skipped": str(err)}
    if n_edges > MAX_GRAPH:
        return {"skipped": f"this model's graph has {n_edges:,} edges; the report runs its edge circuit on graphs of at "
                           f"most {MAX_GRAPH:,} ({COST}). Run `interp circuit --task induction --out DIR` for it."}
    clean, corrupted, metric = task["clean"], task["corrupted"], task["metric"]
    scores = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=STEPS)
    sizes = tuple(s for s in SIZES if s <= len(scores)) or (len(scores),)
    curve = faithfulness(model, clean, corrupted, metric, scores, sizes=sizes, n_random=RANDOM, n_bootstrap=200)
    circuit = circuit_of(model, scores, clean, corrupted, curve=curve, edges=max(sizes), task=task["name"])
    figures.add("edge_circuit", circuit_figure(circuit).figure)
    ax = faithfulness_plot(curve, title=f"{task['name']}: EAP-IG ({STEPS} steps), {metric.name}")
    figures.add("edge_faithfulness", ax.figure)
    last = curve.iloc[-1]
    top = circuit.edges.iloc[0]
    return {"total": len(scores), "steps": STEPS, "random": RANDOM, "cpr": curve.attrs["cpr"],
            "cpr_random": curve.attrs["cpr_random"],
            "curve": curve[["size", "edges", "faithfulness", "lo", "hi", "complement", "random", "random_max"]]
            .round(4).to_dict(orient="records"),
            "size": int(last["size"]), "edges": int(last["edges"]), "faithfulness": float(last["faithfulness"]),
            "lo": float(last["lo"]), "hi": float(last["hi"]), "random_mean": float(last["random"]),
            "random_max": float(last["random_max"]),
            "strongest": {"upstream": top["upstream"], "downstream": top["downstream"], "score": float(top["score"])}}


def edge_circuit_finding(c: dict | None, name: str) -> str | None:
    """The finding in one sentence (HTML, escaped), or None without a circuit."""
    if not c or "skipped" in c:
        return None
    beats = c["lo"] > c["random_max"]
    return (f"On {html.escape(name)}, the {c['size']} edges EAP-IG ranks highest ({c['edges']} after pruning, of "
            f"{c['total']}) take the model {c['faithfulness'] * 100:.0f}% [{c['lo'] * 100:.0f}, {c['hi'] * 100:.0f}] "
            f"of the way from corrupted to clean; random circuits of that size {c['random_mean'] * 100:.0f}% (at most "
            f"{c['random_max'] * 100:.0f}%){'' if beats else ', not separated from them'} "
            '<a href="#edge-circuit">evidence</a>')


def edge_circuit_html(c: dict | None, figures, name: str) -> str:
    """The report's edge-circuit part of its circuits section."""
    if not c:
        return ""
    esc = html.escape
    if "skipped" in c:
        return f'<h3 id="edge-circuit">Edge circuit</h3><p class="muted">Not run: {esc(c["skipped"])}</p>'
    s = c["strongest"]
    return f"""<h3 id="edge-circuit">Edge circuit: which heads, connected how</h3>
<p>Every edge of the model's graph ({c['total']}: from the input, each head and each MLP into each later head's q, k
or v input, each MLP and the logits) scored by <b>EAP-IG</b> ({c['steps']} steps) on {esc(name)}; the top
{', '.join(str(r['size']) for r in c['curve'])} edges kept as circuits and evaluated by exact edge patching (every other
edge corrupted): faithfulness 0 is the corrupted run, 1 the clean one, against {c['random']} random circuits of each
size (CPR {c['cpr']:.2f}, random {c['cpr_random']:.2f}). The strongest edge: {esc(s['upstream'])} &rarr;
{esc(s['downstream'])} (score {s['score']:+.3g}). Blue edges raise the metric, red ones lower it; q solid, k dashed,
v dotted. <code>interp circuit --task induction --out DIR</code> writes the interactive view and the circuit's
JSON.</p>
{figures.img('edge_circuit', 'the induction circuit: top edges by layer')}
{figures.img('edge_faithfulness', 'faithfulness of the top edges against random circuits')}"""
