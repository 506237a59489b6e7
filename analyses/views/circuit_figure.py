"""A circuit as a static figure for papers (matplotlib; save it as PNG, SVG or PDF with ``save_figure``): the layout
of the circuit view (``circuit_view.circuit_layout``: a column per layer, a row per head, the MLP below), the top
edges coloured by sign and sized by ``|score|``, q solid, k dashed, v dotted, the faithfulness at that size from the
saved curve in the title."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.path import Path as CurvePath
from matplotlib.patches import PathPatch

from .circuit_view import MAX_EDGES, PORT, circuit_layout, circuit_view
from .common import MIN_FONT

__all__ = ["circuit_figure", "write_circuit"]

STYLE = {"q": "-", "k": (0, (5, 3)), "v": (0, (1.2, 2)), "mlp": "-", "logits": "-"}
COLOURS = {True: "#2166ac", False: "#b2182b"}  # a positive score raises the metric, a negative one lowers it


def circuit_figure(circuit, top: int | None = None, ax=None, title: str | None = None):
    """The circuit's ``top`` highest-``|score|`` edges (default: the largest size on its saved curve, else 50) on its
    graph; returns the Axes. circuit: a ``Circuit`` or the path of its JSON."""
    from ..circuits.saved import Circuit, load_circuit

    if not isinstance(circuit, Circuit):
        circuit = load_circuit(circuit)
    curve = circuit.curve
    if top is None:
        top = int(curve["size"].max()) if curve is not None and len(curve) else 50
    if isinstance(top, bool) or not isinstance(top, (int, np.integer)) or top < 1:
        raise ValueError(f"top must be a positive integer (the edges drawn); got {top!r}.")
    shown = circuit.top(int(top))
    layout = circuit_layout(type(circuit)(shown, circuit.provenance, curve))
    nodes, rows = layout["nodes"], layout["rows"]
    n_cols = len(layout["columns"])
    if ax is None:
        _, ax = plt.subplots(figsize=(min(16.0, 1.5 + 0.42 * n_cols), min(8.0, 1.6 + 0.36 * rows)),
                             layout="constrained")
    touched = {u for u, *_ in layout["ends"]} | {t for _, t, *_ in layout["ends"]}
    largest = float(shown["score"].abs().max()) if len(shown) else 1.0
    for (up, target, x2, y2), which, score in zip(layout["ends"], shown["input"], shown["score"]):
        _, x1, y1 = nodes[up]
        mid = (x1 + x2) / 2
        curve_path = CurvePath([(x1, y1), (mid, y1), (mid, y2), (x2, y2)],
                               [CurvePath.MOVETO, CurvePath.CURVE4, CurvePath.CURVE4, CurvePath.CURVE4])
        ax.add_patch(PathPatch(curve_path, fill=False, edgecolor=COLOURS[score >= 0], alpha=0.8,
                               linewidth=0.4 + 3.0 * abs(score) / (largest or 1.0), linestyle=STYLE[which]))
    for name, (kind, x, y) in nodes.items():
        on = name in touched
        ax.scatter([x], [y], s=42 if on else 14, marker="o" if kind == "head" else "s", zorder=3,
                   facecolor="#ffe9a8" if on else "#f2f2f2", edgecolor="#222" if on else "#c8c8c8", linewidth=0.8)
    ax.set_xticks([x for x, _ in layout["columns"]],
                  [label.replace("layer ", "") for _, label in layout["columns"]], fontsize=MIN_FONT)
    ax.set_yticks(range(rows), [f"h{h}" for h in range(rows - 1)] + ["MLP"], fontsize=MIN_FONT)
    ax.set_xlim(-0.6, layout["columns"][-1][0] + 0.6)
    ax.set_ylim(rows - 0.4 + max(PORT.values()), -0.6)
    ax.set_xlabel("layer", fontsize=MIN_FONT + 1)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    f = circuit.faithfulness_at(len(shown))
    p = circuit.provenance
    ax.set_title(title or f"{p.get('model', {}).get('name', 'circuit')}: {p.get('task') or 'task'}, top {len(shown)} "
                 f"edges ({p.get('method', '?')})" + ("" if f is None else f", faithfulness {f:.2f}"),
                 fontsize=MIN_FONT + 2)
    handles = [Line2D([], [], color=COLOURS[True], label="raises the metric"),
               Line2D([], [], color=COLOURS[False], label="lowers it"),
               *(Line2D([], [], color="0.3", linestyle=STYLE[w], label=f"into {w}") for w in ("q", "k", "v"))]
    ax.legend(handles=handles, fontsize=MIN_FONT, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    return ax


def write_circuit(model, scores, clean, corrupted, curve, out, task: str | None = None, source: str | None = None,
                  atlas=None, max_edges: int = MAX_EDGES) -> list:
    """Write ``out/circuit.json`` (the ``max_edges`` highest-``|score|`` edges of ``edge_attribution``'s ``scores``
    with their provenance and the faithfulness ``curve``), ``out/circuit.html`` (its view, the heads' patterns on
    the first clean prompt) and ``out/circuit.png`` (its figure); returns the paths. Files there are replaced."""
    from pathlib import Path

    from ..circuits.saved import circuit_of
    from ..data.batches import batch_of
    from .plots import save_figure

    out = Path(out)
    circuit = circuit_of(model, scores, clean, corrupted, curve=curve, edges=max_edges, task=task, source=source)
    first = {k: v[:1] for k, v in batch_of(model, clean).items() if v is not None}  # one prompt: its padding dropped
    paths = [circuit.save(out / "circuit.json", overwrite=True),
             circuit_view(circuit, model, first, atlas=atlas).save(out / "circuit.html", overwrite=True)]
    ax = circuit_figure(circuit)
    paths.append(save_figure(ax.figure, out / "circuit.png", overwrite=True))
    plt.close(ax.figure)
    return paths
