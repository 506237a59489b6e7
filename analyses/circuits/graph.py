"""A model as a graph: nodes (the input, each head's output ``(site, head)``, each MLP's output) and edges into the
downstream inputs (a head's ``q``, ``k`` or ``v`` input, an MLP's input, the logits).

The residual stream a block reads is the sum of its upstream nodes' outputs (plus biases, the same in every run), so
an edge ``u -> v`` is ``u``'s share of what ``v`` reads; ``v`` passes that stream through the model's own norm (none
where the model has none: OLMo2's blocks read the stream as it is). Under grouped-query attention a k or v input
belongs to the key/value head its group shares: its ``head`` is the key/value head. Node names: ``"input"``,
``"{site}:{head}"`` (``"blocks.3.attn:2"``), ``"mlp.{layer}"``; downstream names add the input:
``"blocks.3.attn:2.k"``, ``"mlp.3"``, ``"logits"``.

Where a node's output is read (``node_readers``):

- **pre-norm blocks** (Llama, GPT-2, Qwen, Mistral, SmolLM2, the toy model): a head's output is its slice of the
  output projection (``hook_result``), an MLP's its output (``hook_mlp_out``).
- **sandwich norms** (Gemma 2/3, OLMo2: a norm on the attention or MLP output before it is added): a head's output
  is its result times the post-norm's scale in that run (the run's own root mean square of the summed attention
  output, times the norm's weight; a LayerNorm's centring applied to each head alike), so that a block's heads
  sum exactly to what the block adds; an MLP's output is its normed output. The scale is each run's own: a node's
  patched value is its contribution in the source run, not its output rescaled by the receiving run.
- **parallel blocks** (GPT-NeoX, Phi, Cohere): attention and MLP read the same block input, so a block's MLP
  reads its input (through the MLP's own norm) and the heads of that block are not upstream of it.
- **pre-norm encoder-decoders** (T5, mBART; ``analyses.circuits.stacks``): two streams, each the sum of its own
  nodes. Nodes ``"encoder.input"``, ``"decoder.input"``, every head ``(site, head)`` of the encoder's
  self-attention and the decoder's self- and cross-attention, ``"encoder.mlp.{l}"``, ``"decoder.mlp.{l}"``
  (``Node.stack``). Encoder q/k/v and MLPs read the encoder's stream; decoder self-attention q/k/v,
  cross-attention **q**, decoder MLPs read the decoder's (in a decoder block: self-attention, then
  cross-attention, then the MLP); cross-attention **k and v** read the encoder's final stream through the
  encoder's final norm (recomputed when an edge is patched), so every encoder node and no decoder node feeds
  them; the logits read the decoder's final stream through its final norm. T5's relative position bias is left
  as the model computes it. Patching and attribution keep one stack of node differences per stream (the source
  and the target have their own lengths).

Where each receiver reads the stream (``reading``): the one place that says which module's input is the stream it
reads and where what it reads goes on (a head's q/k/v columns of a projection's output, a norm's output, a parallel
block's MLP input), for the patched runs and for the gradients of edge attribution alike.

- **post-norm blocks** (BERT, MiniLM, RoBERTa, DistilBERT: a norm after each residual add; see
  ``analyses.circuits.postnorm``): a node's output is carried through every later norm with that run's own
  centring and scale, and the constants (the output projection's bias, the norms' betas) belong to the input node,
  so that the stream a receiver reads is exactly the sum of its upstream nodes' carried contributions in each run.
  q, k and v read the block's input as it is, an MLP the normed stream after attention (at its first module), the
  metric the last block's output (no final norm).
- **encoder-decoders** (T5, mBART: pre-norm; ``analyses.circuits.stacks``): two streams; cross-attention's k and v
  read the encoder's final stream through its final norm.

Refused in one line (``check_graph``): the post-norm encoder-decoders (BART, Marian), whose norms rescale two
streams.
"""

from __future__ import annotations

import pandas as pd
import torch

from hooks.names import hook_name
from interp.attention.sites import is_layered
from interp.structure.norms import norm_centres, norm_scale, norm_weight, parallel_mlp_norm
from interp.structure.probe import _is_norm

from .nodes import Node, Reading, Receiver
from .postnorm import is_post_norm, last_norm, mlp_input, post_norm_layout
from .stacks import check_stacks, encoder_output, stack_nodes, stack_reading, stack_receivers, stack_upstream

__all__ = ["Node", "Reading", "Receiver", "as_edges", "check_graph", "edge_frame", "graph_edges", "mlp_norm", "node_of",
           "node_readers", "reading", "receiver_of", "senders", "upstream"]

INPUTS = ("q", "k", "v", "mlp", "logits")


def check_graph(model) -> None:
    """Refuse, in one line, a model whose residual stream is not the sum of the graph's nodes."""
    s = model.structure
    if not is_layered(model):
        return check_stacks(model)
    if s.kind not in ("pre-norm", "parallel", "post-norm"):
        raise ValueError(f"Edge circuits need pre-norm, post-norm or parallel blocks; this model's blocks are "
                         f"{s.kind}.")
    for l, site in enumerate(model.cfg.sites):
        if s.post_attn_norm[l] is not None and getattr(model.o_proj_of(site), "bias", None) is not None:
            raise ValueError(f"Edge circuits split a normed attention output among its heads; {site.name}'s output "
                             "projection adds a bias before the norm, whose share would change with each run's "
                             "scale, not supported.")
        if isinstance(s.projections[l], str):
            raise ValueError(f"Edge circuits patch each head's q, k and v input at its projection; {site.name}'s "
                             f"cannot be read per head: {s.projections[l]}.")
        if s.kind == "parallel" and s.mlp[l] is not None:
            mlp_norm(model, l)
        elif s.mlp[l] is not None and s.resid_mid[l] is None:
            raise ValueError(f"Edge circuits patch an MLP's input on the stream after attention; interp found no "
                             f"module reading that stream in block {l}, not supported.")
    if s.kind == "post-norm":
        post_norm_layout(model)  # or the one line saying which block is not N2(N1(x + attention) + MLP)
    elif model.final_norm() is None:
        raise ValueError("Edge circuits read the logits' input at the final norm; this model has no final norm, not "
                         "supported.")


def mlp_norm(model, layer: int):
    """The norm through which parallel block ``layer``'s MLP reads the block's input
    (``interp.structure.norms.parallel_mlp_norm``), or a clear error. (A pre-norm block's MLP reads the stream after
    attention at ``structure.resid_mid``: its norm, or the MLP itself where there is none.)"""
    norm = parallel_mlp_norm(model.structure, model._blocks[layer], layer)
    if norm is None:
        raise ValueError(f"Edge circuits patch an MLP's input through its norm; block {layer} of this parallel model "
                         "has several norms besides attention's, and which one the MLP reads is not known.")
    return norm


def node_readers(model) -> dict:
    """``{hook name: fn(act) -> node outputs}`` for the hooks whose activation is not yet the nodes' outputs: with a
    norm on a sublayer's output (sandwich norms), each head's result times that run's post-norm scale
    (``(b, p, h, m)``) and the MLP's normed output."""
    s, read = model.structure, {}
    if s is None:  # an encoder-decoder model's pre-norm stacks: the hooks carry the nodes' outputs
        return read
    for l, site in enumerate(model.cfg.sites):
        block = model._blocks[l]
        if s.post_attn_norm[l] is not None:
            read[hook_name("result", site.name)] = _scaled_heads(block.get_submodule(s.post_attn_norm[l]), s.d_model)
        if s.post_mlp_norm[l] is not None and s.mlp[l] is not None:
            read[hook_name("mlp_out", l)] = block.get_submodule(s.post_mlp_norm[l]).forward
    return read


def _scaled_heads(norm, d_model: int):
    """Each head's share of ``norm(sum of the heads' results)``: its result (centred alike, for a LayerNorm) times
    the norm's weight over the run's own scale of the sum."""
    weight, centres = norm_weight(norm, d_model).float(), norm_centres(norm, d_model)

    def read(result):  # (b, p, h, m)
        r = result.float()
        scale = norm_scale(norm, r.sum(2))  # (b, p, 1)
        r = r - r.mean(-1, keepdim=True) if centres else r
        return (r * (weight.to(r.device) / scale)[:, :, None]).to(result.dtype)
    return read


def _nodes(model) -> list[Node]:
    if not is_layered(model):
        return stack_nodes(model)
    nodes = [Node("input")]
    for site in model.cfg.sites:
        nodes += [Node("head", site.block, site.name, h) for h in range(site.n_heads)]
        if model.structure.mlp[site.block] is not None:
            nodes.append(Node("mlp", site.block))
    return nodes


def _receivers(model) -> list[Receiver]:
    if not is_layered(model):
        return stack_receivers(model)
    out = []
    for site in model.cfg.sites:
        for which in ("q", "k", "v"):
            n = site.n_heads if which == "q" else site.n_kv_heads
            out += [Receiver(which, site.block, site.name, h) for h in range(n)]
        if model.structure.mlp[site.block] is not None:
            out.append(Receiver("mlp", site.block))
    return [*out, Receiver("logits", len(model.cfg.sites))]


def upstream(node: Node, receiver: Receiver, parallel: bool = False) -> bool:
    """Whether ``node``'s output reaches ``receiver``'s input directly (a head feeds its own block's MLP, unless the
    block is ``parallel``: its MLP reads the block's input)."""
    if receiver.input == "logits" or node.kind == "input":
        return True
    if receiver.input == "mlp":
        return node.layer < receiver.layer or node.kind == "head" and node.layer == receiver.layer and not parallel
    return node.layer < receiver.layer


def graph_edges(model) -> list[tuple[Node, Receiver]]:
    """Every edge of the model's graph, in the order of the receivers (site order, q then k then v, MLPs, logits)."""
    check_graph(model)
    nodes, feeds = _nodes(model), _feeds(model)
    return [(u, r) for r in _receivers(model) for u in nodes if feeds(u, r)]


def _feeds(model):
    """``fn(node, receiver) -> bool``: ``upstream`` for this model (``stack_upstream`` for an encoder-decoder)."""
    if not is_layered(model):
        return lambda u, r: stack_upstream(model, u, r)
    parallel = model.structure.kind == "parallel"
    return lambda u, r: upstream(u, r, parallel)


def senders(model, edges=None) -> list[Node]:
    """The upstream nodes of ``edges`` (default: every node), each once, in the order the model computes them (so
    that the nodes an input reads are one span of them: an encoder-decoder model's encoder nodes, then its
    decoder's)."""
    used = None if edges is None else {u for u, _ in edges}
    return [u for u in _nodes(model) if used is None or u in used]


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
    stack = "" if is_layered(model) else "<stack>."
    return _named(_nodes(model), name, "upstream node", f"nodes are '{stack}input', '<site>:<head>' (e.g. "
                  f"'{model.cfg.sites[0].name}:0') and '{stack}mlp.<layer>'")


def receiver_of(model, name: str) -> Receiver:
    """The downstream input named ``name`` (``"blocks.1.attn:0.k"``, ``"mlp.1"``, ``"logits"``), or a clear error."""
    stack = "" if is_layered(model) else "<stack>."
    return _named(_receivers(model), name, "downstream input", "inputs are '<site>:<head>.q' (k, v: the key/value "
                  f"head, e.g. '{model.cfg.sites[0].name}:0.k'), '{stack}mlp.<layer>' and 'logits'")


def as_edges(model, edges) -> list[tuple[Node, Receiver]]:
    """Edges given as ``(upstream, downstream)`` names or nodes, or a frame with those columns, checked."""
    check_graph(model)
    if isinstance(edges, pd.DataFrame):
        edges = list(zip(edges["upstream"], edges["downstream"]))
    out, feeds = [], _feeds(model)
    for u, r in edges:
        u = u if isinstance(u, Node) else node_of(model, u)
        r = r if isinstance(r, Receiver) else receiver_of(model, r)
        if not feeds(u, r):
            raise ValueError(f"There is no edge {u.name} -> {r.name}: {u.name} does not feed {r.name}'s input "
                             "(an edge goes from an earlier node to a later input of its stream; in a parallel block "
                             "the heads do not feed that block's MLP; cross-attention's k and v read the encoder's "
                             "nodes).")
        out.append((u, r))
    return out


# -- where each receiver reads the stream (patching and attribution) ----------------------------------------------
def _columns(model, site, which: str, head: int):
    """Where ``head``'s ``which`` (q, k or v) input is written: ``(path, cols, compute)``, the module (path under the
    site's block) whose output holds it, its columns there, and ``compute(y)``, those columns from the normed
    stream ``y``. That module is the projection, or a norm over every head's q (or k) together (OLMo2's
    ``q_norm``), after which one head's columns depend on its own projection alone."""
    block, proj = model.projections_of(site)
    if isinstance(proj, str):
        raise ValueError(f"Edge patching needs {site.name}'s q, k and v projections as linear maps; {proj}.")
    d = site.d_head_v if which == "v" else site.d_head
    start = 0
    if proj.layout == "interleaved":  # [q_h | k_h | v_h] per head (GPT-NeoX)
        start = head * 3 * d + {"q": 0, "k": d, "v": 2 * d}[which]
        cols = slice(start, start + d)
    else:
        if proj.layout == "concat":
            start = {"q": 0, "k": site.n_heads * site.d_head, "v": (site.n_heads + site.n_kv_heads) * site.d_head}[which]
        cols = slice(start + head * d, start + (head + 1) * d)
    linear = block.get_submodule(getattr(proj, which))
    side = "q" if which == "q" else "kv"
    across = [path.rsplit(".", 1)[0] for path, on, width in proj.per_head if on == side and width == d and which != "v"
              and _is_norm(block.get_submodule(path.rsplit(".", 1)[0]))]
    if not across:
        return getattr(proj, which), cols, lambda y: _head_columns(linear, y, cols), _column_weight(linear, cols)
    norm = block.get_submodule(across[0])
    return across[0], cols, lambda y: norm.forward(linear(y))[..., cols], None


def _column_weight(module, cols: slice) -> torch.Tensor | None:
    """The map from the normed stream to ``module``'s output columns ``cols`` as ``(e, m)`` (a linear layer, or
    GPT-2's transposed Conv1D), None where the module is neither."""
    if isinstance(module, torch.nn.Linear):
        return module.weight[cols]
    if type(module).__name__ == "Conv1D":
        return module.weight[:, cols].T
    return None


def reading(model, r: Receiver) -> Reading:
    """Where receiver ``r`` reads the stream (``Reading``)."""
    if r.stack and r.input in ("mlp", "logits"):  # an encoder-decoder model's MLP or logits
        return stack_reading(model, r)
    post = is_post_norm(model)
    if r.input == "logits" and post:  # the last block's output, read where its norm writes it
        norm = last_norm(model)
        return Reading("output", "final", norm, None, norm)
    if r.input == "mlp" and post:  # the normed stream after attention, at the module the MLP reads it through
        module = mlp_input(model, r.layer)
        return Reading("stream", ("mlp", r.layer), module, None, module)
    if r.input == "logits":
        norm = model.final_norm()
        return Reading("stream", "final", norm, None, norm)
    if r.input == "mlp" and model.structure.kind == "parallel":
        norm = mlp_norm(model, r.layer)
        mlp = model._blocks[r.layer].get_submodule(model.structure.mlp[r.layer])
        return Reading("mlp_input", ("mlp", r.layer), norm, norm, mlp)
    if r.input == "mlp":  # the norm on the stream after attention, or the MLP itself (no norm)
        module = model._blocks[r.layer].get_submodule(model.structure.resid_mid[r.layer][0])
        return Reading("stream", ("mlp", r.layer), module, None, module)
    site = model.sites[r.site]
    block, proj = model.projections_of(site)
    path, cols, compute, weight = _columns(model, site, r.input, r.head)
    norm, key = model.in_norm_of(site), site.name
    grab = norm or block.get_submodule(proj.q)  # no norm: q's projection reads the stream
    if site.kind == "cross" and r.input != "q":  # keys and values: the encoder's final stream through its norm
        key, grab, norm = encoder_output(model)
    return Reading("columns", key, grab, norm, block.get_submodule(path), cols, compute, weight)


def _head_columns(module, y: torch.Tensor, cols: slice) -> torch.Tensor:
    """``module(y)[..., cols]`` computed for those columns only (a linear layer, or GPT-2's transposed Conv1D)."""
    if isinstance(module, torch.nn.Linear):
        bias = None if module.bias is None else module.bias[cols]
        return torch.nn.functional.linear(y, module.weight[cols], bias)
    if type(module).__name__ == "Conv1D":
        return y @ module.weight[:, cols] + module.bias[cols]
    return module.forward(y)[..., cols]
