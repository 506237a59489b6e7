"""The circuit view: a saved circuit (``analyses.circuits.saved.Circuit``) as one offline HTML page, and the layout
its static figure (``circuit_figure.py``) draws too.

Nodes stand in columns by layer: the input on the left, each layer's heads (head 0 at the top) with its MLP below,
the logits on the right. An edge runs from its upstream node to its downstream input: a head's q (solid line, upper
port), k (dashed, middle) or v input (dotted, lower port), under grouped-query attention the k and v ports at the
middle of the key/value head's group; blue for a positive score, red for a negative one, wider for a larger
``|score|``. In the page a slider keeps the top n edges, with the faithfulness at n from the saved curve beside it
(measured there, or on the straight line between the sizes either side); hover an edge for its score, a head for
its atlas labels (``atlas=``); click a head for its attention pattern on the task's prompt (``model=`` and
``prompt=``: one prompt, its last ``max_tokens`` tokens, 8-bit weights). The page embeds its data as JSON, draws
with inline vanilla JavaScript (``assets/circuit.js``) and writes every string with ``textContent``; elements carry
``data-role`` attributes for tests.

    view = circuit_view(circuit, model, prompt=clean["input_ids"][0], atlas=load_atlas("smollm2.json"))
    view.save("circuit.html")
"""

from __future__ import annotations

import base64

import numpy as np

from .common import _View

__all__ = ["CircuitView", "circuit_layout", "circuit_view"]

INPUTS = ("q", "k", "v", "mlp", "logits")
PORT = {"q": -0.22, "k": 0.0, "v": 0.22, "mlp": 0.0, "logits": 0.0}  # where each input arrives, in rows
MAX_EDGES = 1000  # edges a page embeds at most (the slider's range)


class CircuitView(_View):
    """A circuit's graph, its slider, hover and head patterns; see ``circuit_view``."""

    kind = "circuit"
    assets = ("circuit.css", "circuit.js")

    def __repr__(self) -> str:
        d = self.data
        return (f"CircuitView({len(d['edges'])} edges, {sum(n[1] == 'head' for n in d['nodes'])} heads, "
                f"{len(d['patterns']['heads'])} patterns; .save(path) writes one offline page)")


def _sites(circuit) -> tuple[list, set]:
    """``[name, layer, heads, key/value heads]`` per site and the MLP layers: the circuit's record of the graph, or
    what its edges show (heads up to the largest index seen, no grouping)."""
    graph = circuit.provenance.get("graph")
    if graph:
        return [list(s) for s in graph["sites"]], set(graph["mlp"])
    e = circuit.edges
    found: dict[str, list] = {}
    for site, layer, head in [*zip(e["up_site"], e["up_layer"], e["up_head"]),
                              *zip(e["down_site"], e["down_layer"], e["down_head"])]:
        if site:
            entry = found.setdefault(site, [site, int(layer), 0, 0])
            entry[2] = entry[3] = max(entry[2], int(head) + 1)
    mlp = {int(l) for k, l in zip(e["up_kind"], e["up_layer"]) if k == "mlp"}
    mlp |= {int(l) for i, l in zip(e["input"], e["down_layer"]) if i == "mlp"}
    return sorted(found.values(), key=lambda s: s[1]), mlp


def circuit_layout(circuit) -> dict:
    """Where the circuit's nodes and edge ends go, in layout units (a column per layer, a row per head): ``nodes``
    ``{name: (kind, x, y)}`` (every node of the graph), ``rows`` (the height), ``columns`` ``[(x, label)]``, and
    ``ends``: per edge of ``circuit.edges``, ``(upstream name, receiving node name, x2, y2)``, the receiving node
    being the head (q) or the first head of the key/value group (k, v)."""
    sites, mlp = _sites(circuit)
    if any(s[0].startswith(("encoder.", "decoder.")) for s in sites):
        raise ValueError("The circuit view draws one residual stream, a column per layer; this circuit is of an "
                         "encoder-decoder model (two stacks, cross-attention reading the encoder), which it does not "
                         "draw yet: read circuit.edges or circuit.top(n) instead.")
    rows = max((s[2] for s in sites), default=1) + 1
    last = max([s[1] for s in sites] + list(mlp) + [int(circuit.edges["down_layer"].max()) - 1
                                                     if len(circuit.edges) else 0])
    nodes = {"input": ("input", 0.0, (rows - 1) / 2), "logits": ("logits", float(last + 2), (rows - 1) / 2)}
    group = {}
    for name, layer, n_heads, n_kv in sites:
        for h in range(n_heads):
            nodes[f"{name}:{h}"] = ("head", float(layer + 1), float(h))
        group[name] = max(1, n_heads // max(1, n_kv))
    for layer in sorted(mlp):
        nodes[f"mlp.{layer}"] = ("mlp", float(layer + 1), float(rows - 1))
    ends = []
    for up, which, site, head, layer in zip(circuit.edges["upstream"], circuit.edges["input"],
                                            circuit.edges["down_site"], circuit.edges["down_head"],
                                            circuit.edges["down_layer"]):
        if which in ("q", "k", "v"):
            g = 1 if which == "q" else group.get(site, 1)
            target = f"{site}:{int(head) * g}"
            y = int(head) * g + (g - 1) / 2 + PORT[which]
        else:
            target = "logits" if which == "logits" else f"mlp.{int(layer)}"
            y = nodes[target][2]
        if up not in nodes or target not in nodes:
            raise ValueError(f"the circuit's edge {up} -> {target} names a node its graph does not have; expected "
                             "edges of the model the circuit records (provenance['graph']).")
        ends.append((up, target, nodes[target][1], y))
    columns = [(0.0, "input")] + [(float(l + 1), f"layer {l}") for l in range(last + 1)] + [(float(last + 2), "logits")]
    return {"nodes": nodes, "rows": rows, "columns": columns, "ends": ends}


def _labels(atlas, circuit) -> dict[str, str]:
    """``{"site:head": labels}`` from an atlas of the circuit's model (refused, in one line, for another model)."""
    if atlas is None:
        return {}
    if not isinstance(atlas, dict) or not isinstance(atlas.get("heads"), list):
        raise TypeError(f"atlas is a head atlas (load_atlas(path)'s dict, with heads); got {type(atlas).__name__}.")
    mine = circuit.provenance.get("model", {}).get("weights_sha256")
    theirs = atlas.get("model", {}).get("weights_sha256")
    if mine and theirs and mine != theirs:
        raise ValueError(f"the atlas is of {atlas['model'].get('name')!r} (weights sha256 {theirs[:16]}...), the "
                         f"circuit of {circuit.provenance['model'].get('name')!r} ({mine[:16]}...): pass the atlas "
                         "of the circuit's model.")
    return {f"{h['site']}:{int(h['head'])}": str(h.get("labels") or h.get("label") or "")
            for h in atlas["heads"] if str(h.get("labels") or h.get("label") or "") not in ("", "none", "nan")}


def _patterns(model, prompt, heads: list[str], sites: list, max_tokens: int) -> dict:
    """The last ``max_tokens`` tokens of ``prompt`` and each head's pattern over them, 8-bit, base64."""
    from .runs import _Run

    index = {s[0]: i for i, s in enumerate(sites)}
    by_site: dict[str, list[int]] = {}
    for name in heads:
        site, h = name.rsplit(":", 1)
        by_site.setdefault(site, []).append(int(h))
    run = _Run.of(model, prompt, 0, sorted(index[s] for s in by_site))
    tokens = next(iter(run.tokens.values()))
    keep = min(max_tokens, len(tokens))
    out = {}
    for site, hs in by_site.items():
        p = run.pattern(index[site], hs)[:, -keep:, -keep:]  # (h, q, k)
        if not bool(np.isfinite(p.numpy()).all()):
            raise ValueError(f"the attention of {site} holds NaN or inf on this prompt: the model computed non-finite "
                             "values there; check its weights and inputs.")
        q = np.round(p.numpy() * 255).clip(0, 255).astype(np.uint8)
        out.update({f"{site}:{h}": base64.b64encode(q[i].tobytes()).decode("ascii") for i, h in enumerate(hs)})
    return {"tokens": list(tokens[-keep:]), "skipped": len(tokens) - keep, "heads": out}


def circuit_view(circuit, model=None, prompt=None, *, atlas=None, max_edges: int = MAX_EDGES, top: int | None = None,
                 max_tokens: int = 24, title: str | None = None) -> CircuitView:
    """The page of ``circuit`` (a ``Circuit``, or a path to its JSON): its ``max_edges`` highest-``|score|`` edges,
    the slider opening on ``top`` (default: the largest size of the saved curve, else 50).

    model, prompt: with both, each head the embedded edges touch gets its pattern on ``prompt`` (one text or token ids
      ``(p,)``; its last ``max_tokens`` tokens) for the click; the model must be the circuit's (its digests).
    atlas: a head atlas of the same model (``load_atlas``'s dict): each head's labels shown on hover.
    """
    from ..circuits.saved import Circuit, check_model, load_circuit

    if not isinstance(circuit, Circuit):
        circuit = load_circuit(circuit, model)
    elif model is not None:
        check_model(circuit, model)
    for name, value in (("max_edges", max_edges), ("max_tokens", max_tokens)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}.")
    if (model is None) != (prompt is None):
        raise ValueError("Give model and prompt together (the head patterns run the circuit's model on the prompt), "
                         "or neither.")
    shown = circuit.top(int(max_edges))
    part = type(circuit)(shown, circuit.provenance, circuit.curve)
    layout = circuit_layout(part)
    names = list(layout["nodes"])
    at = {n: i for i, n in enumerate(names)}
    touched = list(dict.fromkeys([u for u, _, _, _ in layout["ends"]] + [t for _, t, _, _ in layout["ends"]]))
    heads = [n for n in touched if layout["nodes"][n][0] == "head"]
    labels = _labels(atlas, circuit)
    curve = circuit.curve
    sizes = [] if curve is None else curve[["size", "faithfulness", "lo", "hi"]].to_numpy(float).tolist()
    if top is None:
        top = int(max(s[0] for s in sizes)) if sizes else 50
    p = circuit.provenance
    model_name = p.get("model", {}).get("name", "a model")
    data = {
        "title": title or f"circuit of {model_name}: {p.get('task') or 'task'}, {p.get('method', '?')}, "
                          f"metric {p.get('metric', '?')}",
        "model": model_name, "method": p.get("method"), "steps": p.get("steps"), "metric": p.get("metric"),
        "total_edges": p.get("total_edges"), "rows": layout["rows"], "columns": layout["columns"],
        "nodes": [[n, kind, x, y, labels.get(n, "")] for n, (kind, x, y) in layout["nodes"].items()],
        "edges": [[at[u], at[t], INPUTS.index(w), round(float(s), 8), round(y, 4)]
                  for (u, t, _, y), w, s in zip(layout["ends"], shown["input"], shown["score"])],
        "top": max(1, min(int(top), len(shown))),
        "curve": [[round(x, 6) if np.isfinite(x) else None for x in row] for row in sizes],
        "patterns": _patterns(model, prompt, heads, _sites(part)[0], int(max_tokens)) if model is not None
        else {"tokens": [], "skipped": 0, "heads": {}},
    }
    return CircuitView(data)
