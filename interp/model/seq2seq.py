"""Encoder-decoder models (T5, BART, mBART, Marian, ...): our attention in both stacks and in cross-attention.

Three kinds of attention run in an encoder-decoder model, each with its own hook prefix:

- ``encoder.blocks.{l}.attn``: bidirectional self-attention over the source;
- ``decoder.blocks.{l}.attn``: causal self-attention over the target;
- ``decoder.blocks.{l}.cross_attn``: queries from the decoder, keys and values from the encoder's output
  (q length = target length, k length = source length).

Each prefix carries the attention hooks of the hook table (``hook_q``, ``hook_k``, ``hook_v``, ``hook_z``,
``hook_lse``; ``hook_attn_scores`` and ``hook_pattern`` on the eager path; ``hook_result``, each head's share of
the output projection without its bias, opt-in) and each block the residual hooks ``hook_resid_pre``/``hook_resid_post``,
``hook_attn_out`` (decoder blocks also ``hook_cross_attn_out``) and ``hook_mlp_out`` (the MLP's output before the
residual add, and before BART's norm after it; the MLP found as ``interp.structure.seq2seq`` says).
T5's relative position bias is added to the scores before the mask, as HF does; on the flash path it is
folded into the additive mask, so the kernel's logsumexp is that of the biased scores.

Where is what: found by one probe forward (``interp.structure.seq2seq``), as for decoder-only models: every attention
call is recorded with its module, and the source and target lengths differ in the probe, so a call whose key
length is the source's and query length the target's is cross-attention.

This module is what ``HookedModel`` keeps for such a model (``SEQ2SEQ``): the sites, the hook points per stack,
block and site, and how a batch feeds it: ``input_ids``/``attention_mask`` for the encoder and
``decoder_input_ids``/``decoder_attention_mask`` (teacher forcing; ``decoder_inputs(model, labels)`` shifts targets
right). There is no class of its own: ``HookedModel(t5)`` is a ``HookedModel``, and its cache an ``ActivationCache``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hooks import AttentionMeta, HookPoint

from ..tokens.inputs import position_limit
from ..structure.head_slicing import CONFIG_KEY
from ..structure.probe import _is_norm
from ..structure.seq2seq import _discover
from ..attention.sites import Site
from .config import TLConfigFields, tl_facts
from .layered import _norm_points, _result_hook
from .wrapper import Kind, Layout, _replace_first

__all__ = ["SEQ2SEQ", "Seq2SeqConfig", "decoder_inputs"]

_ATTN_KINDS = ("q", "k", "v", "attn_scores", "pattern", "z", "lse")


@dataclass(frozen=True)
class Seq2SeqConfig(TLConfigFields):
    """Shape of an encoder-decoder model: its attention sites in call order (encoder, then decoder).
    TransformerLens's config names (``TLConfigFields``) where they mean one thing for both stacks: ``n_layers``,
    ``n_heads``, ``d_head`` and ``n_key_value_heads`` when every stack and site agree (else one line naming the
    per-stack fields), ``d_mlp``, ``act_fn``, ``normalization_type`` (never ``"Pre"``: ``model.W_*`` are per site
    here), ``positional_embedding_type``, ``d_vocab``, ``n_ctx``, ``device``, ``dtype``, ``tokenizer_name`` ..."""

    n_encoder_layers: int
    n_decoder_layers: int
    d_model: int
    vocab_size: int
    family: str
    sites: tuple[Site, ...]
    causal: bool = False  # the encoder (and so the model's inputs) are bidirectional: pad on the right
    max_positions: int | None = None  # source and target each (None: relative positions, e.g. T5)

    def heads(self) -> list[tuple[str, int]]:
        """Every ``(site name, head)`` (the placeholder of a site that was pruned empty is not a head)."""
        return [(s.name, h) for s in self.sites if s.name not in self.empty_sites for h in range(s.n_heads)]

    @property
    def stacks(self) -> tuple[str, ...]:
        return ("encoder", "decoder")

    pruned: bool = False  # heads sliced out by analyses.prune_model (interp.structure.head_slicing.slice_sites)
    empty_sites: tuple[str, ...] = ()  # sites pruned of every head: one zeroed placeholder head each
    # TransformerLens's facts read from the HF config (``tl_facts``); None where the model has no such thing
    mlp_width: int | None = None
    mlp_act: str | None = None
    norm_kind: str | None = None  # "LN" or "RMS", from the decoder's first norm
    positions: str | None = None
    owner: object = field(default=None, repr=False, compare=False)  # the live model (HookedModel sets it)

    _folds_norms = False  # no stacked W_* on an encoder-decoder model, so nothing is read folded

    def _same(self, name: str, values: dict[str, int], fields: str) -> int:
        """The one value every stack or site has, or one line saying where to read the differing ones."""
        if len(set(values.values())) == 1:
            return next(iter(values.values()))
        raise AttributeError(f"cfg.{name} differs across this {self.family} model's stacks or sites ({values}); "
                             f"read {fields}.")

    @property
    def n_layers(self) -> int:
        return self._same("n_layers", {"encoder": self.n_encoder_layers, "decoder": self.n_decoder_layers},
                          "cfg.n_encoder_layers and cfg.n_decoder_layers")

    @property
    def n_heads(self) -> int:
        return self._same("n_heads", {s.name: s.n_heads for s in self.sites}, "each site's n_heads in cfg.sites")

    @property
    def n_kv_heads(self) -> int:
        return self._same("n_key_value_heads", {s.name: s.n_kv_heads for s in self.sites},
                          "each site's n_kv_heads in cfg.sites")

    @property
    def d_head(self) -> int:
        return self._same("d_head", {s.name: s.d_head for s in self.sites}, "each site's d_head in cfg.sites")


def _in_norm_name(site: Site) -> str:
    """Where the norm a site's queries read the stream through is named (``Layout.norms``): ``ln_cross`` for
    cross-attention, ``ln1`` for self-attention."""
    return f"{site.stack}.blocks.{site.block}.{'ln_cross' if site.kind == 'cross' else 'ln1'}"


def _out_name(site: Site) -> str:
    prefix = f"{site.stack}.blocks.{site.block}"
    return f"{prefix}.hook_cross_attn_out" if site.kind == "cross" else f"{prefix}.hook_attn_out"


def _build(hf, structure=None) -> Layout:
    sites, enc_path, dec_path, modules, weights, stacks = _discover(hf)
    c = hf.config
    record = getattr(c, CONFIG_KEY, None) or {}
    cfg = Seq2SeqConfig(
        n_encoder_layers=sum(s.stack == "encoder" for s in sites),
        n_decoder_layers=sum(s.stack == "decoder" and s.kind == "self" for s in sites),
        d_model=int(getattr(c, "d_model", None) or c.hidden_size), family=c.model_type,
        vocab_size=int(getattr(c, "vocab_size", None) or hf.get_input_embeddings().num_embeddings),
        sites=tuple(sites), max_positions=position_limit(c), pruned=bool(record),
        empty_sites=tuple(name for name, kept in record.items() if not kept), **tl_facts(hf, norm=_first_norm(hf)))
    blocks = {"encoder": hf.get_encoder().get_submodule(enc_path), "decoder": hf.get_decoder().get_submodule(dec_path)}
    points, attach = [], {}
    norms = _norms(hf, stacks, sites, weights, blocks)
    for stack in ("encoder", "decoder"):
        for block in range(len(blocks[stack])):
            module = blocks[stack][block]
            points.append(HookPoint(f"{stack}.blocks.{block}.hook_resid_pre", block))
            attach[points[-1].name] = _pre_hook(module)
            for site in (s for s in sites if s.stack == stack and s.block == block):
                _norm_points(norms, _in_norm_name(site), block, None, points, attach)
                for kind in _ATTN_KINDS:
                    read_only = ("it is derived from the scores; edit hook_attn_scores or hook_pattern instead"
                                 if kind == "lse" else None)
                    points.append(HookPoint(f"{site.name}.hook_{kind}", block, read_only))
                points.append(HookPoint(_out_name(site), block))
                attention = modules[site.name]
                attach[points[-1].name] = _out_hook(attention.get_submodule(site.o_proj) if site.o_proj else attention)
                if site.o_proj:  # each head's share of the output projection, as in a layered model
                    points.append(HookPoint(f"{site.name}.hook_result", block))
                    attach[points[-1].name] = _result_attacher(attention.get_submodule(site.o_proj), site)
            _norm_points(norms, f"{stack}.blocks.{block}.ln2", block, None, points, attach)
            if stacks.mlp[stack][block] is not None:
                points.append(HookPoint(f"{stack}.blocks.{block}.hook_mlp_out", block))
                attach[points[-1].name] = _out_hook(module.get_submodule(stacks.mlp[stack][block]))
            points.append(HookPoint(f"{stack}.blocks.{block}.hook_resid_post", block))
            attach[points[-1].name] = _out_hook(module)
        _norm_points(norms, f"{stack}.ln_final", None, None, points, attach)
    weights = {name: (modules[name], proj, norm) for name, (proj, norm) in weights.items()}
    return Layout(cfg, None, blocks, modules, weights, points, attach, stacks, norms)


def _norms(hf, stacks, sites: list[Site], weights: dict, blocks: dict) -> dict:
    """Where a norm reads a stack's residual stream (``Layout.norms``), TransformerLens's names under the stack's
    prefix: ``{stack}.blocks.{l}.ln1`` before self-attention, ``decoder.blocks.{l}.ln_cross`` before
    cross-attention's queries (TransformerLens's HookedEncoderDecoder: ``ln2``), ``ln2`` before the MLP (its
    ``ln3`` in a decoder block), ``{stack}.ln_final`` on the last block's output (the encoder's: what
    cross-attention's keys and values read). Each reads the block's input plus what the sublayers before it added,
    in the model's order. Post-norm blocks (BART, Marian) normalise after each sublayer: only ``ln_final``."""
    found = {}
    for stack, found_blocks in blocks.items():
        count = len(found_blocks)
        for block in range(count):
            prefix = f"{stack}.blocks.{block}"
            reads = [f"{prefix}.hook_resid_pre"]
            here = [s for s in sites if s.stack == stack and s.block == block]
            for site in sorted(here, key=lambda s: s.kind != "self"):  # self-attention first, as the block runs
                norm = weights[site.name][1]
                if stacks.kind == "pre-norm" and norm is not None:
                    found[_in_norm_name(site)] = (norm, tuple(reads))
                reads.append(_out_name(site))
            path = stacks.mlp_norm[stack][block]
            if stacks.kind == "pre-norm" and path is not None:
                found[f"{prefix}.ln2"] = (found_blocks[block].get_submodule(path), tuple(reads))
        if stacks.final_norm[stack] is not None:
            found[f"{stack}.ln_final"] = (hf.get_submodule(stacks.final_norm[stack]),
                                          (f"{stack}.blocks.{count - 1}.hook_resid_post",))
    return found


def _result_attacher(o_proj, site: Site):
    return lambda point: o_proj.register_forward_hook(_result_hook(point, site.n_heads, site.d_head_v))


def _first_norm(hf):
    """The decoder's first norm with a weight: what kind of norm the model uses (T5's RMS, BART's LayerNorm)."""
    return next((m for m in hf.get_decoder().modules() if _is_norm(m) and getattr(m, "weight", None) is not None),
                None)


def _pre_hook(module):
    def attach(point: HookPoint):
        def pre(m, args, kwargs):
            if args:
                return (point(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": point(kwargs["hidden_states"])}
        return module.register_forward_pre_hook(pre, with_kwargs=True)
    return attach


def _out_hook(module):
    return lambda point: module.register_forward_hook(lambda m, i, out: _replace_first(out, point))


def decoder_inputs(model, labels: torch.Tensor) -> torch.Tensor:
    """Target ids shifted right with the decoder start token, as the model was trained (teacher forcing).

    The model's own ``prepare_decoder_input_ids_from_labels`` when its config names the start token and it has one
    (mBART's moves the language code to the front); else the config's start token, the generation config's, or the
    bos token, as ``generate`` finds it (a bare ``T5Model`` has no LM head and no such method)."""
    if "decoder" not in model.cfg.stacks or "encoder" not in model.cfg.stacks:
        raise ValueError(f"decoder_inputs shifts targets for an encoder-decoder model; this {type(model.hf).__name__} "
                         "has one stack, so it takes the whole sequence as input_ids.")
    labels = torch.as_tensor(labels, device=model.device)
    configured = getattr(model.hf.config, "decoder_start_token_id", None)
    if configured is not None and hasattr(model.hf, "prepare_decoder_input_ids_from_labels"):
        return model.hf.prepare_decoder_input_ids_from_labels(labels=labels)
    # a bare encoder-decoder (T5Model, BartModel: no LM head) has no such method: the same shift, done here
    start = next((v for v in (configured,
                              getattr(getattr(model.hf, "generation_config", None), "decoder_start_token_id", None),
                              getattr(model.hf.config, "bos_token_id", None)) if isinstance(v, int)), None)
    if start is None:
        raise ValueError(f"{type(model.hf).__name__}'s config and generation config name no decoder start token "
                         "(decoder_start_token_id), so targets cannot be shifted right; set "
                         "model.hf.config.decoder_start_token_id (T5 uses its pad token, 0) or pass "
                         "decoder_input_ids yourself.")
    shifted = labels.new_full(labels.shape, start)
    shifted[..., 1:] = labels[..., :-1]
    return shifted.masked_fill(shifted == -100, model.pad_token_id)


def _feed(model, inputs, attention_mask, kwargs: dict) -> tuple[dict, dict]:
    """``decoder_input_ids`` (and ``decoder_attention_mask``) from ``kwargs`` or from a batch mapping."""
    kwargs = dict(kwargs)
    decoder_input_ids = kwargs.pop("decoder_input_ids", None)
    decoder_attention_mask = kwargs.pop("decoder_attention_mask", None)
    if decoder_input_ids is None:
        if isinstance(inputs, dict) and "decoder_input_ids" in inputs:
            decoder_input_ids = inputs["decoder_input_ids"]
            decoder_attention_mask = inputs.get("decoder_attention_mask", decoder_attention_mask)
        else:
            raise ValueError(
                "An encoder-decoder model needs decoder_input_ids (b, t) as well as the encoder's input_ids: "
                "pass decoder_input_ids=... (e.g. model.decoder_inputs(labels), the targets shifted right), "
                "or use model.hf.generate(...) to produce them.")
    if isinstance(inputs, dict):
        inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
    ids, mask = model._ids(inputs, attention_mask, "input_ids")
    dec, dec_mask = model._ids(decoder_input_ids, decoder_attention_mask, "decoder_input_ids")
    kwargs.setdefault("use_cache", False)
    return ({"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec, "decoder_attention_mask": dec_mask,
             **kwargs}, {"attention_mask": mask, "decoder_attention_mask": dec_mask})


def _meta(model, masks: dict, biases: dict) -> AttentionMeta:
    """Per site its scale, heads, causality, padding of its keys and position bias: ``cache.pattern(site)``."""
    sites = list(model.cfg.sites)
    return AttentionMeta(
        sites, masks=masks, biases={i: biases[s.name] for i, s in enumerate(sites) if biases.get(s.name) is not None}, views=True)


def _shape(cfg) -> str:
    return f"{cfg.n_encoder_layers} encoder + {cfg.n_decoder_layers} decoder layers x {cfg.sites[0].n_heads} heads"


def _probe_batch(model) -> dict:
    one = torch.ones(1, 2, dtype=torch.long, device=model.device)
    return {"inputs": one, "decoder_input_ids": one}


SEQ2SEQ = Kind(build=_build, feed=_feed, probe_batch=_probe_batch, meta=_meta, shape=_shape, seq2seq=True,
               position_bias=True, pad_attrs=("pad_token_id",))
