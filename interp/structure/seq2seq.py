"""Where an encoder-decoder model keeps its attention sites, found by one probe forward (``interp.structure.probe``) as for
decoder-only models: the source and target lengths differ in the probe, so a call whose key length is the source's
and query length the target's is cross-attention. ``interp.model.seq2seq`` wraps what this finds."""

from __future__ import annotations

import torch

from ..attention.paths import softmax_upcasts
from ..runtime.distributed import input_device
from .probe import _find_blocks, _is_linear, _is_norm, _ModuleLog, probe
from .projections import Projections
from ..attention.sites import Site

_SOURCE_LEN, _TARGET_LEN = 7, 5  # probe lengths: different, so that cross-attention shows in its shapes


def _discover(hf) -> tuple[list[Site], str, str, dict, dict]:
    """Probe forward on our eager path: the attention sites, the two block lists, the modules, and per site its
    weights' layout (``_weights``)."""
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
    return sites, enc_path, dec_path, by_name, layout


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
