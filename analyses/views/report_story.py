"""What the report says first: the model's name and size, the findings (each linked to its evidence), and whether
each class of heads does what its name says: its heads ablated together against as many random heads from the
same layers (computed by ``analyses.atlas.class_ablation``).
"""

from __future__ import annotations

import html
import statistics
from pathlib import Path

from hooks.names import attn_site
from interp.attention.sites import one_site_per_layer

from ..atlas.class_ablation import PROPERTY as _PROPERTY, own_task
from ..heads.labels import LABEL_ORDER
from .report_sinks import sinks_finding
from .report_circuit import edge_circuit_finding
from .report_streaming import streaming_finding

__all__ = ["findings", "head_name", "model_name", "model_size", "site_lines"]


def model_name(model) -> str:
    """The name a person knows the model by: the bundled name's description, the folder, or the config's name."""
    bundled = getattr(model, "source_name", None)
    if bundled:
        return bundled
    path = getattr(model.hf.config, "name_or_path", "") or ""
    return Path(path).name if path else type(model.hf).__name__


def model_size(model) -> str:
    """'135M parameters, 30 layers x 9 heads (3 key/value heads), d_model 576' and the class; a model of several
    stacks: its blocks per stack and its attention sites."""
    c = model.cfg
    n = sum(p.numel() for p in model.hf.parameters())
    size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"
    stacks = list(dict.fromkeys(s.stack for s in c.sites))
    if len(stacks) > 1:
        blocks = " and ".join(f"{len({s.block for s in c.sites if s.stack == st})} {st}" for st in stacks)
        counts = sorted({s.n_heads for s in c.sites})
        return (f"{size} parameters, {blocks} blocks, {len(c.sites)} attention sites x "
                f"{'/'.join(map(str, counts))} heads, d_model {c.d_model}; {type(model.hf).__name__}, "
                f"{'-'.join(stacks)}")
    heads = f"{c.n_heads} heads" + (f" ({c.n_kv_heads} key/value heads)" if c.n_kv_heads != c.n_heads else "")
    return (f"{size} parameters, {c.n_layers} layers x {heads}, d_model {c.d_model}; {type(model.hf).__name__}, "
            f"{'causal' if c.causal else 'bidirectional'}")


def site_lines(sites) -> list[str]:
    """The attention sites in plain lines, for a model whose discovery gives no structure summary."""
    return [f"{s.name}: {s.label}, {s.n_heads} heads of {s.d_head} dims, queries from {s.queries}, keys from "
            f"{s.keys}{', causal' if s.causal else ''}" for s in sites]


def head_name(r, form: str = "text"):
    """A head as the page names it, from a table row or a summary dict: ``"L.H"`` where its site is a layer
    (``blocks.L.attn``, or no site given), else ``"SITE.H"``; ``form="dict"``: ``{layer, head}`` or ``{site, head}``."""
    get = r.get if isinstance(r, dict) else lambda k: getattr(r, k, None)
    site, layer, head = get("site"), get("layer"), int(get("head"))
    layered = site is None or layer is not None and site == attn_site(int(layer))
    if form == "dict":
        return {"layer": int(layer), "head": head} if layered else {"site": site, "head": head}
    return f"{int(layer)}.{head}" if layered else f"{site}.{head}"


def _span(values) -> str:
    return f"{min(values) * 100:.0f} to {max(values) * 100:.0f}%" if values else "n/a"


def _separated(value: float, draws) -> bool:
    """Whether a class's effect stands out of its random draws: above every draw and above their mean + 3 standard
    deviations (a handful of draws: 66% against draws up to 63% does not stand out; 86% against -3 to 11% does)."""
    drawn = [v for v in draws if v == v]
    if not drawn:
        return True  # nothing to compare with: the line shows "n/a" for the draws
    spread = statistics.stdev(drawn) if len(drawn) > 1 else 0.0
    return value > max(drawn) and value > statistics.fmean(drawn) + 3 * spread


def findings(summary: dict, heads) -> list[str]:
    """The page's first list: one line per finding, in HTML, each with a link to the section that shows it."""
    esc = html.escape
    lines = []
    ablated = {r["class"]: r for r in ((summary.get("class_ablation") or {}).get("rows") or [])}
    strongest = {}
    for r in summary["strongest_heads"]:
        strongest.setdefault(r["class"], r)
    layered = one_site_per_layer(heads)
    for kind in LABEL_ORDER:
        if kind == _PROPERTY:
            continue
        members = heads[heads["label"].astype(str).str.split("+").str[0] == kind]  # primary label
        if not len(members) or kind not in strongest:
            continue
        top = strongest[kind]
        if layered:
            layers = sorted(set(int(l) for l in members["layer"]))
            where = f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}-{layers[-1]}"
        else:
            sites = list(dict.fromkeys(members["site"]))
            where = esc(sites[0]) if len(sites) == 1 else f"{len(sites)} sites ({esc(', '.join(sites[:3]))}" + \
                (", ...)" if len(sites) > 3 else ")")
        interval = f", 95% interval {top['lo']:.2f}-{top['hi']:.2f}" if top["lo"] == top["lo"] else ""
        line = (f"<b>{len(members)} {esc(kind.replace('_', '-'))} head{'s' if len(members) > 1 else ''}</b> in "
                f"{where}; strongest {esc(head_name(top))} ({top['score']:.2f}{interval})")
        r = ablated.get(kind)
        if r is not None and own_task(kind) not in (None, "copy") and r.get("verdict"):
            # a class named for another behaviour: its own test speaks for it, not the copy task's gain
            line += (f"; ablating {'them' if len(r['heads']) > 1 else 'it'} ({len(r['heads'])}) against "
                     f"{len(r.get('random') or [])} draws of as many random heads: {esc(r['verdict'])} "
                     '<a href="#classes-causal">evidence</a>')
        elif r is not None and r["share"] == r["share"]:
            # the prompts named where the number stands: the share depends on them (SmolLM2's 8 induction heads: 74%
            # here, on 8 sequences of 33 tokens; 85% in notebooks/results.md, on 20 of 101)
            line += (f"; ablating {'them' if len(r['heads']) > 1 else 'it'} ({len(r['heads'])}) removes "
                     f"<b>{r['share'] * 100:.0f}%</b> of the in-context gain on "
                     f"{esc(summary['class_ablation']['task'])}; as many random heads (same layers where possible) "
                     f"remove {_span(r['random_share'])}")
            if not _separated(r["share"], r["random_share"]):
                line += ("; <b>not separated from random heads</b> (not above every draw and their mean + 3 sd), "
                         "so this is no evidence that they make the gain")
            line += ' <a href="#classes-causal">evidence</a>'
        else:
            line += ' <a href="#classes">evidence</a>'
        lines.append(line)
    if not lines:
        lines.append('No head clears a class threshold (<a href="#classes">scores</a>).')
    n_sinks = int(heads["labels"].fillna("").astype(str).str.split("+").apply(lambda labels: _PROPERTY in labels).sum())
    if n_sinks:
        primary = int((heads["label"].astype(str).str.split("+").str[0] == _PROPERTY).sum())
        lines.append(f"{n_sinks} of {len(heads)} heads are attention sinks (they park most weight on the first "
                     f"token): a property shown beside the classes, not a class of its own. For {primary} of them it "
                     f"is the primary label (the label counts' \"sink {primary}\"); the other {n_sinks - primary} "
                     "are first of all another class (an induction head can be a sink too)." +
                     sinks_finding(summary.get("sinks")))
    # The single-head ablation scan is not a finding: one run on the study prompts (few and short on a large
    # model), no interval; the "ablation" section shows it as a scan.
    circuits = summary.get("circuits")
    if circuits and circuits["top_heads"]:
        best = max(circuits["top_heads"], key=lambda r: abs(r["effect"]))
        lines.append(f"On {esc(circuits['name'])}, patching head {esc(head_name(best))}'s clean output alone moves "
                     f"the model {best['effect'] * 100:.0f}% of the way from corrupted to clean "
                     '<a href="#circuits">evidence</a>')
        edge = edge_circuit_finding(circuits.get("edge_circuit"), circuits["name"])
        if edge:
            lines.append(edge)
    pruning = {r["order"]: r for r in summary.get("pruning", [])}
    if "importance" in pruning and "random" in pruning:
        better = summary.get("higher_is_better")
        a, b = pruning["importance"]["area"], pruning["random"]["area"]
        if better is not None:
            verdict = "better" if (a > b) == bool(better) else "worse"
            lines.append(f"Pruning heads in order of importance keeps the metric {verdict} than random orders "
                         f"(area {a:.3f} against {b:.3f}; {'higher' if better else 'lower'} is better) "
                         '<a href="#pruning">evidence</a>')
    stream = streaming_finding(summary.get("streaming"))
    if stream:
        lines.append(stream)
    return lines
