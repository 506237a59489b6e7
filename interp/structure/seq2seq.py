"""Where an encoder-decoder model keeps its attention sites, found by one probe forward (``interp.structure.probe``) as for
decoder-only models: the source and target lengths differ in the probe, so a call whose key length is the source's
and query length the target's is cross-attention. ``interp.model.seq2seq`` wraps what this finds.

Per stack (``Seq2SeqStructure``): whether its blocks are pre-norm (T5: a norm before each sublayer, the residual
stream a sum of what the sublayers add) or post-norm (BART, Marian: a norm after each residual add), each block's
MLP (the module whose output is what the MLP branch adds, found by value as in ``interp.structure.layered``), the
norm the MLP reads the stream through (pre-norm), and the stack's final norm (the norm applied to its last block's
output: T5's ``final_layer_norm``, through which cross-attention's keys and values and the logits read)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.paths import softmax_upcasts
from ..runtime.distributed import input_device
from .probe import _close, _find_blocks, _is_linear, _is_norm, _ModuleLog, probe
from .projections import Projections
from ..attention.sites import Site

_SOURCE_LEN, _TARGET_LEN = 7, 5  # probe lengths: different, so that cross-attention shows in its shapes


@dataclass(frozen=True)
class Seq2SeqStructure:
    """What an encoder-decoder model's stacks add to its sites, per stack (``"encoder"``, ``"decoder"``): ``kind``
    ``"pre-norm"`` or ``"post-norm"`` (one for the model), ``mlp`` (per block, its path under the block, or None),
    ``mlp_norm`` (per block, the norm under the block whose output the MLP reads, pre-norm only, or None) and
    ``final_norm`` (the path from the HF model's root of the norm on the stack's last block's output, or None)."""

    kind: str
    mlp: dict
    mlp_norm: dict
    final_norm: dict


def _discover(hf) -> tuple[list[Site], str, str, dict, dict, Seq2SeqStructure]:
    """Probe forward on our eager path: the attention sites, the two block lists, the modules, per site its
    weights' layout (``_weights``), and the stacks' MLPs and norms (``Seq2SeqStructure``)."""
    vocab = int(getattr(hf.config, "vocab_size", None) or hf.get_input_embeddings().num_embeddings)
    generator = torch.Generator().manual_seed(1234)
    device = input_device(hf)
    src = torch.randint(min(4, vocab - 1), vocab, (1, _SOURCE_LEN), generator=generator).to(device)
    tgt = torch.randint(min(4, vocab - 1), vocab, (1, _TARGET_LEN), generator=generator).to(device)
    recording, log = probe(hf, lambda: hf(input_ids=src, decoder_input_ids=tgt, use_cache=False))
    encoder, decoder = hf.get_encoder(), hf.get_decoder()
    in_encoder = {id(m) for m in encoder.modules()}
    calls = {}
    for call in recording.calls:  # first call per module
        calls.setdefault(id(call["module"]), call)
    enc, dec_self, dec_cross = [], [], []
    for call in calls.values():
        n_q, n_k = call["query"].shape[2], call["key"].shape[2]
        if id(call["module"]) in in_encoder:
            enc.append(call)
        elif n_q == _TARGET_LEN and n_k == _SOURCE_LEN:
            dec_cross.append(call)
        elif n_q == n_k == _TARGET_LEN:
            dec_self.append(call)
        else:
            raise NotImplementedError(f"{type(hf).__name__}: an attention call with {n_q} queries and {n_k} keys "
                                      "fits none of encoder, decoder or cross-attention.")
    if not enc or not dec_self or len(dec_cross) != len(dec_self):
        raise NotImplementedError(
            f"{type(hf).__name__}: expected encoder self-attention and, in every decoder block, self- and "
            f"cross-attention through transformers' attention interface; found {len(enc)} encoder, "
            f"{len(dec_self)} decoder self and {len(dec_cross)} cross-attention calls.")
    enc_path, _ = _find_blocks(encoder, [c["module"] for c in enc])
    dec_path, dec_blocks = _find_decoder_blocks(decoder, [c["module"] for c in dec_self], [c["module"] for c in dec_cross])
    sites = []
    for stack, kind, group in (("encoder", "self", enc), ("decoder", "self", dec_self), ("decoder", "cross", dec_cross)):
        for block, call in enumerate(group):
            q, k, v = call["query"], call["key"], call["value"]
            sites.append(Site(
                name=f"{stack}.blocks.{block}.{'cross_attn' if kind == 'cross' else 'attn'}", stack=stack, block=block,
                kind=kind, n_heads=q.shape[1], n_kv_heads=k.shape[1], d_head=q.shape[-1], d_head_v=v.shape[-1],
                scale=float(call["scaling"]) if call["scaling"] is not None else q.shape[-1] ** -0.5,
                causal=stack == "decoder" and kind == "self", o_proj=_o_proj(call, log), softmax_fp32=softmax_upcasts(call),
                queries="input_ids" if stack == "encoder" else "decoder_input_ids",
                keys="decoder_input_ids" if stack == "decoder" and kind == "self" else "input_ids"))
    order = {("encoder", "self"): 0, ("decoder", "self"): 1, ("decoder", "cross"): 2}
    sites.sort(key=lambda s: (order[(s.stack, s.kind)] > 0, s.block, order[(s.stack, s.kind)]))
    groups = {("encoder", "self"): enc, ("decoder", "self"): dec_self, ("decoder", "cross"): dec_cross}
    blocks = {"encoder": encoder.get_submodule(enc_path), "decoder": dec_blocks}
    by_name, layout = {}, {}
    for site in sites:
        call = groups[(site.stack, site.kind)][site.block]
        by_name[site.name] = call["module"]
        layout[site.name] = _weights(call, log, blocks[site.stack][site.block])
    return sites, enc_path, dec_path, by_name, layout, _stacks(hf, blocks, sites, by_name, log)


def _stacks(hf, blocks: dict, sites: list[Site], modules: dict, log: _ModuleLog) -> Seq2SeqStructure:
    """Each block's MLP and its norm, the stacks' final norms and the block kind, read off the probe."""
    kinds, mlp, mlp_norm, final = set(), {}, {}, {}
    for stack, found in blocks.items():
        parts = [_mlp_of(block, [modules[s.name] for s in sites if s.stack == stack and s.block == l], log)
                 for l, block in enumerate(found)]
        kinds |= {kind for kind, _, _ in parts}
        mlp[stack], mlp_norm[stack] = tuple(p[1] for p in parts), tuple(p[2] for p in parts)
        last = log.outputs.get(found[-1])
        final[stack] = next((name for name, m in hf.named_modules() if _is_norm(m) and last is not None
                             and log.inputs.get(m) is last), None)
    if len(kinds) != 1:
        raise NotImplementedError(f"{type(hf).__name__} mixes block kinds {sorted(kinds)}; not supported.")
    return Seq2SeqStructure(kinds.pop(), mlp, mlp_norm, final)


def _mlp_of(block, attentions: list, log: _ModuleLog) -> tuple[str, str | None, str | None]:
    """``(kind, MLP path, MLP norm path)`` of one block: the MLP is the module, run after the block's last attention,
    whose output is what the MLP branch adds (pre-norm: the block's output minus the stream the MLP's norm reads;
    post-norm: the final norm's input minus the stream after attention)."""
    names = {m: n for n, m in block.named_modules()}
    inside = {m for a in attentions for m in a.modules()}
    y = log.outputs.get(block)
    end = max(log.ended[a] for a in attentions)
    later = sorted((m for m in block.modules() if m is not block and m not in inside and log.order.get(m, -1) > end),
                   key=lambda m: log.order[m])
    post = next((m for m in block.modules() if m is not block and _is_norm(m) and log.outputs.get(m) is y), None)
    norms = [m for m in later if _is_norm(m) and m is not post]
    if y is None or not norms:
        return ("post-norm" if post is not None else "pre-norm"), None, None
    if post is not None:  # post-norm: the MLP adds to the norm after attention, then the final norm
        stream, target, norm = log.outputs[norms[0]], log.inputs.get(post), None
    else:
        norm = norms[0]
        stream, target = log.inputs.get(norm), y
    if stream is None or target is None or stream.shape != target.shape:
        return ("post-norm" if post is not None else "pre-norm"), None, None
    added = target.float() - stream.float()
    tol = 1e-5 * max(float(target.abs().max()), 1e-6)
    matches = [m for m in later if not _is_norm(m) and _close(log.outputs.get(m), added, tol)]
    with_params = [m for m in matches if any(True for _ in m.parameters())]
    mlp = min(with_params, key=lambda m: (names[m].count("."), log.order[m])) if with_params else None
    return ("post-norm" if post is not None else "pre-norm", None if mlp is None else names[mlp],
            None if mlp is None or norm is None else names[norm])


def _weights(call: dict, log: _ModuleLog, block) -> tuple[Projections | str, torch.nn.Module | None]:
    """Where a site's heads sit in its weights: ``Projections`` (paths relative to the attention module; the q, k
    and v linears are those whose outputs are the query, key and value the attention function got) or the reason
    they cannot be read, and the norm in its block whose output the site's queries are computed from (None: none)."""
    attn = call["module"]
    names = {m: n for n, m in attn.named_modules()}
    found = {}
    for role in ("query", "key", "value"):
        t = call[role]  # (b, n, p, d)
        want = t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)
        found[role] = next((m for m in attn.modules() if _is_linear(m) and (out := log.outputs.get(m)) is not None
                            and out.shape == want.shape and torch.equal(out, want)), None)
    missing = [role for role, m in found.items() if m is None]
    projections = (f"no linear map's output is the {' or '.join(missing)} the attention function got" if missing
                   else Projections("separate", names[found["query"]], names[found["key"]], names[found["value"]]))
    attn_input = log.inputs.get(attn)
    norm = next((m for m in block.modules() if _is_norm(m) and attn_input is not None and log.outputs.get(m) is attn_input),
                None)
    return projections, norm


def _o_proj(call: dict, log: _ModuleLog) -> str | None:
    """The linear map inside the attention module whose input is z flattened over heads."""
    z = call["out"]
    flat = z.reshape(*z.shape[:2], -1)
    for name, module in call["module"].named_modules():
        if name and _is_linear(module):
            seen = log.inputs.get(module)
            if seen is not None and seen.shape == flat.shape and torch.equal(seen, flat):
                return name
    return None


def _find_decoder_blocks(decoder, self_modules, cross_modules):
    for name, module in decoder.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) != len(self_modules):
            continue
        if all(any(m is s for m in block.modules()) and any(m is c for m in block.modules())
               for block, s, c in zip(module, self_modules, cross_modules)):
            return name, module
    raise NotImplementedError(f"{type(decoder).__name__}: could not find a list of decoder blocks, each holding one "
                              "self-attention and one cross-attention module.")
