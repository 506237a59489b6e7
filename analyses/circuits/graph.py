"""A model as a graph: nodes (the input, each head's output ``(site, head)``, each MLP's output) and edges into the
downstream inputs (a head's ``q``, ``k`` or ``v`` input, an MLP's input, the logits).

The residual stream a block reads is the sum of its upstream nodes' outputs (plus biases, the same in every run), so
an edge ``u -> v`` is ``u``'s share of what ``v`` reads; ``v`` passes that stream through the model's own norm.
Under grouped-query attention a k or v input belongs to the key/value head its group shares: its ``head`` is the
key/value head. Node names: ``"input"``, ``"{site}:{head}"`` (``"blocks.3.attn:2"``), ``"mlp.{layer}"``;
downstream names add the input: ``"blocks.3.attn:2.k"``, ``"mlp.3"``, ``"logits"``.

Models whose residual stream is such a sum: pre-norm blocks with no norm on a sublayer's output (Llama, GPT-2, Qwen,
Mistral, SmolLM2, the toy model). Others are refused in one line (see ``check_graph``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from interp.attention.sites import is_layered

__all__ = ["Node", "Receiver", "as_edges", "check_graph", "edge_frame", "graph_edges", "node_of", "receiver_of",
           "upstream"]

INPUTS = ("q", "k", "v", "mlp", "logits")


@dataclass(frozen=True, order=True)
class Node:
    """An upstream node: ``kind`` ``"input"``, ``"head"`` (``site``, ``head``) or ``"mlp"`` (``layer``)."""

    kind: str
    layer: int = -1  # the block it sits in (-1: the input)
    site: str = ""
    head: int = -1

    @property
    def name(self) -> str:
        return {"input": "input", "head": f"{self.site}:{self.head}", "mlp": f"mlp.{self.layer}"}[self.kind]


@dataclass(frozen=True, order=True)
class Receiver:
    """A downstream input: ``input`` in q/k/v (``site``, ``head``; k and v: the key/value head), ``"mlp"`` (``layer``)
    or ``"logits"``."""

    input: str
    layer: int = -1
    site: str = ""
    head: int = -1

    @property
    def name(self) -> str:
        if self.input in ("q", "k", "v"):
            return f"{self.site}:{self.head}.{self.input}"
        return f"mlp.{self.layer}" if self.input == "mlp" else "logits"


def check_graph(model) -> None:
    """Refuse, in one line, a model whose residual stream is not the sum of the graph's nodes."""
    s = model.structure
    if not is_layered(model):
        raise ValueError("Edge circuits need a model with one attention site per layer (a decoder such as Llama or "
                         "GPT-2); encoder-decoder models (T5, BART) are not supported yet.")
    if s.kind != "pre-norm":
        raise ValueError(f"Edge circuits need pre-norm blocks, whose residual stream is a sum of the blocks' outputs; "
                         f"this model's blocks are {s.kind} (post-norm: BERT; parallel: GPT-NeoX, Phi), not supported "
                         "yet.")
    if any(n is not None for n in (*s.post_attn_norm, *s.post_mlp_norm)):
        raise ValueError("Edge circuits need blocks that add their sublayers' outputs to the residual stream as they "
                         "are; this model normalises them first (Gemma 2/3, OLMo2), not supported yet.")
    if model.final_norm() is None or any(model.in_norm_of(site) is None for site in model.cfg.sites):
        raise ValueError("Edge circuits recompute each input through the model's own norm; this model has a block "
                         "or an output with no norm, not supported yet.")


def _nodes(model) -> list[Node]:
    nodes = [Node("input")]
    for site in model.cfg.sites:
        nodes += [Node("head", site.block, site.name, h) for h in range(site.n_heads)]
        if model.structure.mlp[site.block] is not None:
            nodes.append(Node("mlp", site.block))
    return nodes


def _receivers(model) -> list[Receiver]:
    out = []
    for site in model.cfg.sites:
        for which in ("q", "k", "v"):
            n = site.n_heads if which == "q" else site.n_kv_heads
            out += [Receiver(which, site.block, site.name, h) for h in range(n)]
        if model.structure.mlp[site.block] is not None:
            out.append(Receiver("mlp", site.block))
    return [*out, Receiver("logits", len(model.cfg.sites))]


def upstream(node: Node, receiver: Receiver) -> bool:
    """Whether ``node``'s output reaches ``receiver``'s input directly (pre-norm: a head feeds its own block's MLP)."""
    if receiver.input == "logits" or node.kind == "input":
        return True
    if receiver.input == "mlp":
        return node.layer < receiver.layer or node.kind == "head" and node.layer == receiver.layer
    return node.layer < receiver.layer


def graph_edges(model) -> list[tuple[Node, Receiver]]:
    """Every edge of the model's graph, in the order of the receivers (site order, q then k then v, MLPs, logits)."""
    check_graph(model)
    nodes = _nodes(model)
    return [(u, r) for r in _receivers(model) for u in nodes if upstream(u, r)]


def edge_frame(edges) -> pd.DataFrame:
    """One row per edge: ``upstream``, ``up_kind``, ``up_layer``, ``up_site``, ``up_head``, ``downstream``,
    ``input`` (q/k/v/mlp/logits), ``down_layer``, ``down_site``, ``down_head`` (-1 where there is none)."""
    rows = [{"upstream": u.name, "up_kind": u.kind, "up_layer": u.layer, "up_site": u.site, "up_head": u.head,
             "downstream": r.name, "input": r.input, "down_layer": r.layer, "down_site": r.site, "down_head": r.head}
            for u, r in edges]
    return pd.DataFrame(rows, columns=["upstream", "up_kind", "up_layer", "up_site", "up_head", "downstream", "input",
                                       "down_layer", "down_site", "down_head"])


def _named(found, name: str, what: str, hint: str):
    for item in found:
        if item.name == name:
            return item
    raise ValueError(f"No {what} {name!r} in this model; {hint}.")


def node_of(model, name: str) -> Node:
    """The upstream node named ``name`` (``"input"``, ``"blocks.0.attn:2"``, ``"mlp.1"``), or a clear error."""
    return _named(_nodes(model), name, "upstream node", f"nodes are 'input', '<site>:<head>' (e.g. "
                  f"'{model.cfg.sites[0].name}:0') and 'mlp.<layer>'")


def receiver_of(model, name: str) -> Receiver:
    """The downstream input named ``name`` (``"blocks.1.attn:0.k"``, ``"mlp.1"``, ``"logits"``), or a clear error."""
    return _named(_receivers(model), name, "downstream input", "inputs are '<site>:<head>.q' (k, v: the key/value "
                  f"head, e.g. '{model.cfg.sites[0].name}:0.k'), 'mlp.<layer>' and 'logits'")


def as_edges(model, edges) -> list[tuple[Node, Receiver]]:
    """Edges given as ``(upstream, downstream)`` names or nodes, or a frame with those columns, checked."""
    check_graph(model)
    if isinstance(edges, pd.DataFrame):
        edges = list(zip(edges["upstream"], edges["downstream"]))
    out = []
    for u, r in edges:
        u = u if isinstance(u, Node) else node_of(model, u)
        r = r if isinstance(r, Receiver) else receiver_of(model, r)
        if not upstream(u, r):
            raise ValueError(f"There is no edge {u.name} -> {r.name}: {u.name} does not feed {r.name}'s input "
                             "(an edge goes from an earlier node to a later input).")
        out.append((u, r))
    return out
