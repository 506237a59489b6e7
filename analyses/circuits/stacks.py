"""The graph of an encoder-decoder model (T5 and other pre-norm encoder-decoders): two residual streams, the
encoder's and the decoder's, each the sum of its own nodes.

- **Nodes**: per stack its input (the token embedding entering the first block, ``"encoder.input"``,
  ``"decoder.input"``), each head ``(site, head)`` (encoder self-attention, decoder self-attention, decoder
  cross-attention) and each MLP (``"encoder.mlp.1"``, ``"decoder.mlp.0"``), in the order the model computes them:
  the encoder's, then the decoder's (within a decoder block: self-attention, cross-attention, MLP).
- **Receivers**: an encoder head's q, k and v and an encoder MLP read the encoder's stream; a decoder
  self-attention head's q, k and v, a cross-attention head's **q** and a decoder MLP read the decoder's stream;
  a cross-attention head's **k and v** read the encoder's final stream through the encoder's final norm (T5's
  ``encoder.final_layer_norm``, recomputed when an edge is patched), so every encoder node feeds them and no
  decoder node does; the logits read the decoder's final stream through its final norm. T5's relative position
  bias is not a stream input: it stays as the model computes it.

Refused in one line (``check_stacks``): post-norm stacks (BART, Marian: a norm after each residual add rescales
every upstream node by the run's own scale), a stack with no final norm, a block whose MLP or MLP norm interp did
not find. What the stacks hold is found by the probe forward (``interp.structure.seq2seq.Seq2SeqStructure``).
"""

from __future__ import annotations

from .nodes import Node, Reading, Receiver

__all__ = ["check_stacks", "encoder_output", "stack_nodes", "stack_reading", "stack_receivers", "stack_upstream"]

STACKS = ("encoder", "decoder")


def check_stacks(model) -> None:
    """Refuse, in one line, an encoder-decoder model whose streams are not sums of the graph's nodes."""
    s = model.stack_structure
    family = type(model.hf).__name__
    if s is None or s.kind != "pre-norm":
        raise ValueError(f"Edge circuits need each stack's residual stream to be a sum of the nodes' outputs; "
                         f"{family}'s blocks are post-norm (BART, Marian: a norm after each residual add rescales "
                         "everything upstream by the run's own scale). Supported encoder-decoders: pre-norm (T5).")
    for stack in STACKS:
        if s.final_norm[stack] is None:
            raise ValueError(f"Edge circuits read the {stack}'s final stream at its final norm; {family}'s {stack} "
                             "has none, not supported.")
        for l, (mlp, norm) in enumerate(zip(s.mlp[stack], s.mlp_norm[stack])):
            if mlp is None or norm is None:
                raise ValueError(f"Edge circuits patch an MLP's input at its norm; interp found no "
                                 f"{'MLP' if mlp is None else 'norm before the MLP'} in {stack} block {l} of "
                                 f"{family}, not supported.")
    for site in model.cfg.sites:
        _, proj = model.projections_of(site)
        if model.o_proj_of(site) is None or isinstance(proj, str):
            why = proj if isinstance(proj, str) else "no output projection reads its z"
            raise ValueError(f"Edge circuits read each head's output and patch its q, k and v at the projections; "
                             f"{site.name}'s cannot be read per head: {why}.")


def _sites(model, stack: str, block: int) -> list:
    return [s for s in model.cfg.sites if s.stack == stack and s.block == block]


def stack_nodes(model) -> list[Node]:
    """Every node, the encoder's then the decoder's, in the order the model computes them."""
    nodes = []
    for stack in STACKS:
        nodes.append(Node("input", stack=stack))
        for l in range(len(model._blocks[stack])):
            for site in _sites(model, stack, l):
                nodes += [Node("head", l, site.name, h, stack) for h in range(site.n_heads)]
            nodes.append(Node("mlp", l, stack=stack))
    return nodes


def stack_receivers(model) -> list[Receiver]:
    """Every downstream input: per site its heads' q (k, v: key/value heads), per block its MLP, the logits."""
    out = []
    for stack in STACKS:
        for l in range(len(model._blocks[stack])):
            for site in _sites(model, stack, l):
                for which in ("q", "k", "v"):
                    n = site.n_heads if which == "q" else site.n_kv_heads
                    out += [Receiver(which, l, site.name, h, stack) for h in range(n)]
            out.append(Receiver("mlp", l, stack=stack))
    return [*out, Receiver("logits", len(model._blocks["decoder"]), stack="decoder")]


def _order(model, kind: str, layer: int, site: str) -> tuple[int, int]:
    """Where a node is computed, or an input read, within its stack: (block, self 0 / cross 1 / MLP 2)."""
    if kind == "input":
        return (-1, 0)
    return (layer, 2) if kind == "mlp" else (layer, int(model.sites[site].kind == "cross"))


def stack_upstream(model, node: Node, receiver: Receiver) -> bool:
    """Whether ``node``'s output reaches ``receiver``'s input directly: cross-attention's k and v read every encoder
    node, the logits every decoder node, any other input the earlier nodes of its own stack."""
    if receiver.input == "logits":
        return node.stack == "decoder"
    if receiver.input in ("k", "v") and model.sites[receiver.site].kind == "cross":
        return node.stack == "encoder"
    return node.stack == receiver.stack and (_order(model, node.kind, node.layer, node.site)
                                             < _order(model, receiver.input, receiver.layer, receiver.site))


def _final_norm(model, stack: str):
    return model.hf.get_submodule(model.stack_structure.final_norm[stack])


def encoder_output(model) -> tuple[str, object, object]:
    """``(key, grab, norm)`` of what cross-attention's keys and values read: the encoder's final stream, grabbed at
    the input of the encoder's final norm, through that norm."""
    norm = _final_norm(model, "encoder")
    return "encoder.output", norm, norm


def stack_reading(model, r: Receiver) -> Reading:
    """Where an encoder-decoder model's MLP (its norm's input) or logits (the decoder's final norm's input) reads."""
    if r.input == "logits":
        norm = _final_norm(model, "decoder")
        return Reading("stream", "final", norm, None, norm)
    module = model._blocks[r.stack][r.layer].get_submodule(model.stack_structure.mlp_norm[r.stack][r.layer])
    return Reading("stream", (r.stack, "mlp", r.layer), module, None, module)
