"""Decoder-only and encoder-only models: one attention site per layer (``blocks.{l}.attn``).

What ``HookedModel`` keeps for them (``LAYERED``): the structure one probe forward finds (``interp.structure.layered``), the
per-layer hook points of the hook table (``hook_embed``, ``blocks.{l}.hook_resid_pre``, ``blocks.{l}.attn.hook_q``,
...), the torch hooks that serve the module-level ones, and how a batch feeds the model (``input_ids``,
``attention_mask`` and, for a padded causal batch, ``position_ids``).
"""

from __future__ import annotations

import torch
from einops import rearrange
from transformers.pytorch_utils import Conv1D

from hooks import HOOK_TABLE, AttentionMeta, HookPoint

from .config import _config_of
from ..runtime.distributed import onloaded
from ..tokens.inputs import padded_positions
from ..structure.head_slicing import check_head_counts
from ..structure.layered import discover
from ..structure.norms import norm_modules
from .norm_hooks import NormHooks
from .wrapper import Kind, Layout, _Handles, _replace_first

__all__ = ["LAYERED", "spec_name"]

_MODULE_KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "result")


def spec_name(layer: int, kind: str) -> str:
    """Concrete name of a per-layer module-level point, e.g. (3, "resid_pre") -> blocks.3.hook_resid_pre."""
    return f"blocks.{layer}.attn.hook_{kind}" if kind == "result" else f"blocks.{layer}.hook_{kind}"


def _build(hf, structure) -> Layout:
    s = structure if structure is not None else discover(hf)
    cfg = _config_of(hf, s)
    blocks = hf.get_submodule(s.layers)
    check_head_counts(blocks, s)
    modules = {site.name: block.get_submodule(path) for site, block, path in zip(cfg.sites, blocks, s.attn)}
    weights = {site.name: (block, s.projections[l], None if s.attn_in_norm[l] is None else
                           block.get_submodule(s.attn_in_norm[l]))
               for l, (site, block) in enumerate(zip(cfg.sites, blocks))}
    points = [HookPoint("hook_embed")]
    attach = {"hook_embed": lambda point: hf.get_input_embeddings().register_forward_hook(lambda m, i, out: point(out))}
    norms = norm_modules(s, blocks, hf)  # ln1, ln2, ln_final where the model has them
    for layer in range(cfg.n_layers):
        has = {"resid_mid": s.resid_mid[layer] is not None, "mlp_out": s.mlp[layer] is not None,
               "result": s.o_proj[layer] is not None}  # parallel blocks have no resid_mid; result needs an o_proj
        for spec in HOOK_TABLE:
            if not spec.per_layer or not has.get(spec.short, True) or spec.norm is not None:
                continue
            read_only = None
            if spec.short == "resid_mid" and s.resid_mid[layer][1] == "input":
                read_only = ("in this pre-norm block it is the input of "
                             f"{s.resid_mid[layer][0]}, not a module's output; edit hook_attn_out instead")
            elif spec.short == "lse":
                read_only = "it is derived from the scores; edit hook_attn_scores or hook_pattern instead"
            points.append(HookPoint(spec.name(layer), layer, read_only))
            if spec.short in _MODULE_KINDS:
                attach[spec.name(layer)] = _attacher(blocks[layer], s, layer, spec.short, cfg)
        for where in (f"blocks.{layer}.ln1", f"blocks.{layer}.ln2"):
            _norm_points(norms, where, layer, blocks[layer], points, attach)
    _norm_points(norms, "ln_final", None, None, points, attach)
    return Layout(cfg, s, blocks, modules, weights, points, attach, norms=norms)


def _norm_points(norms: dict, where: str, layer: int | None, block, points: list, attach: dict) -> None:
    """``{where}.hook_scale`` and ``{where}.hook_normalized``, served by one ``NormHooks``, if the model has that norm."""
    if where not in norms:
        return
    scale, normalized = HookPoint(f"{where}.hook_scale", layer), HookPoint(f"{where}.hook_normalized", layer)
    served = NormHooks(norms[where][0], scale, normalized, block)
    points += [scale, normalized]
    attach[scale.name] = attach[normalized.name] = served.attach


def _attacher(block, s, layer: int, kind: str, cfg):
    """``fn(point) -> handle``: the torch hook that serves ``blocks.{layer}``'s module-level point ``kind``."""

    def attach(point: HookPoint):
        if kind == "resid_pre":
            def pre(module, args, kwargs):
                if args:
                    return (point(args[0]), *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": point(kwargs["hidden_states"])}
            return block.register_forward_pre_hook(pre, with_kwargs=True)
        if kind == "result":
            hook = _result_hook(point, cfg.heads_per_layer[layer], cfg.d_head_v)
            return block.get_submodule(s.o_proj[layer]).register_forward_hook(hook)
        if kind in ("resid_post", "attn_out"):
            module = block.get_submodule(s.o_proj[layer] or s.attn[layer]) if kind == "attn_out" else block
            return module.register_forward_hook(lambda m, i, out: _replace_first(out, point))
        # resid_mid and mlp_out: some blocks run their MLP on (b * p, m) (OPT); hooks always see (b, p, m)
        shape: list[int] = []

        def remember(module, args, kwargs):
            shape[:] = (args[0] if args else kwargs["hidden_states"]).shape[:-1]

        handles = [block.register_forward_pre_hook(remember, with_kwargs=True)]

        def shaped(t):
            if t.ndim == 2 and len(shape) == 2:
                return point(t.reshape(*shape, t.shape[-1])).reshape(t.shape)
            return point(t)

        if kind == "resid_mid" and s.resid_mid[layer][1] == "input":
            def observe(module, args, kwargs):
                shaped(args[0] if args else kwargs["hidden_states"])  # the block adds its residual from its own variable
            handles.append(block.get_submodule(s.resid_mid[layer][0]).register_forward_pre_hook(observe, with_kwargs=True))
        else:
            module = block.get_submodule(s.mlp[layer] if kind == "mlp_out" else s.resid_mid[layer][0])
            handles.append(module.register_forward_hook(lambda m, i, out: _replace_first(out, shaped)))
        return _Handles(handles)

    return attach


def _result_hook(point: HookPoint, h: int, e: int):
    """Replace the output projection by a per-head sum, so that an edit to hook_result reaches the model."""

    def hook(o_proj, args, out):
        z = rearrange(args[0], "b p (h e) -> b p h e", h=h, e=e)
        with onloaded(o_proj):  # accelerate has put an offloaded weight back by the time this hook runs
            if isinstance(o_proj, Conv1D):
                w = rearrange(o_proj.weight, "(h e) m -> h e m", h=h)
            else:
                w = rearrange(o_proj.weight, "m (h e) -> h e m", h=h)
            result = torch.einsum("bphe,hem->bphm", z, w)
            bias = o_proj.bias  # the loaded tensor (accelerate puts a new meta Parameter in its place on exit)
        edited = point(result)
        if edited is result:  # observed only: keep the projection's own output, bit for bit
            return out
        summed = edited.sum(dim=2)
        return summed if bias is None else summed + bias

    return hook


def _feed(model, inputs, attention_mask, kwargs: dict) -> tuple[dict, dict]:
    """With padding, a causal model gets ``position_ids = cumsum(mask) - 1`` (as HF's ``generate`` does), so that
    each left-padded row is computed exactly as if it ran alone; ``position_ids`` in ``kwargs`` overrides it."""
    ids, mask = model._inputs(inputs, attention_mask)
    kwargs = dict(kwargs)
    if model.cfg.causal:
        kwargs.setdefault("use_cache", False)  # analysis needs no KV cache, and hooks must not edit one
        if mask is not None and model._takes_position_ids and "position_ids" not in kwargs and not bool(mask.all()):
            kwargs["position_ids"] = padded_positions(mask)
    return {"input_ids": ids, "attention_mask": mask, **kwargs}, {"attention_mask": mask}


def _meta(model, masks: dict, biases: dict) -> AttentionMeta:
    """Per layer the scale, the window of keys, the soft-cap and the sink logits (their values now), and the
    padding of the run."""
    attention_mask = masks.get("attention_mask")
    layers = model.structure.layer_attn
    with onloaded(*(model._blocks[l] for l, a in enumerate(layers) if a.sinks is not None)):
        sinks = {l: model._blocks[l].get_parameter(a.sinks).detach().float().clone()
                 for l, a in enumerate(layers) if a.sinks is not None}
    mask = None if attention_mask is None or bool(attention_mask.all()) else attention_mask
    return AttentionMeta(
        list(model.cfg.sites), mask, sinks=sinks, masks={"attention_mask": mask},
    )


def _shape(cfg) -> str:
    heads = f"{cfg.n_heads} heads ({cfg.n_kv_heads} kv)"
    if cfg.pruned:
        heads = f"pruned heads {list(cfg.heads_per_layer)} ({list(cfg.kv_heads_per_layer)} kv)"
    return f"{cfg.n_layers} layers x {heads}"


LAYERED = Kind(build=_build, feed=_feed, meta=_meta, shape=_shape,
               probe_batch=lambda model: {"inputs": torch.zeros(1, 2, dtype=torch.long),
                                          "attention_mask": torch.ones(1, 2, dtype=torch.long)})
