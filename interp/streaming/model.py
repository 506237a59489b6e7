"""Streaming heads for good: ``stream_model(model, heads, sink, window)`` returns a new ``HookedModel`` whose
``heads`` stream (``interp.streaming``: each sees only the first ``sink`` keys and the last ``window`` keys up to
and including each query) in every forward and in ``generate``, and that saves and loads like ``prune_model``'s.

The heads are recorded in the HF config, in the original head numbering (as ``interp_pruned_heads`` records the kept
heads), so that a saved folder rebuilds the same model::

    config.interp_streaming_heads = {"sink": 4, "window": 256, "heads": {layer: [heads]}}

Every ``HookedModel`` reads the record when it is built (``load_model(folder)``, a copy, a pickle, ``prune_model`` of
a streamed model), so the config is the one source of truth: the specs on the attention modules are not copied
(a bare ``copy.deepcopy(model.hf)`` does not stream until ``interp.load_model`` wraps it). Pruning composes: heads are numbered as in the unpruned
model, a pruned streaming head simply goes, and the others keep streaming.

``generate`` (``model.hf.generate``) starts with a ``StreamingCache`` (``interp.streaming.cache``: streamed
key/value heads keep only sink + window entries), unless the call has padding, attention hooks are active, the model
is in training mode, or a cache is passed: then it uses transformers' ``DynamicCache``, under which the masked model
computes the same tokens with the full memory.
"""

from __future__ import annotations

import copy
import types
import warnings
from collections.abc import Mapping, Sequence

from transformers.cache_utils import DynamicCache

from hooks.points import TORCH_HOOK_TABLES

from ..runtime import distributed
from ..model import hooked as _model
from ..attention.paths import attached_layer_hooks
from ..structure.head_slicing import CONFIG_KEY as PRUNED_KEY
from ..structure.head_slicing import kept_heads, plan_layer
from .attention import _LayerStream
from .cache import STREAM_ATTR, KVHeadsNote, kv_note
from .heads import _check, _is_int, layer_windows, streaming_cache

__all__ = ["CONFIG_KEY", "stream_model", "streaming_record"]

CONFIG_KEY = "interp_streaming_heads"
_PLAN = "_interp_stream_plan"  # on the HF model: (each layer's sliding window, per layer
                               # (kv_full, kv_stream) or None, sink, window, the block a cache checks)
_PREPARE = "_prepare_cache_for_generation"  # transformers' GenerationMixin method that builds generate's cache


# -- the record ----------------------------------------------------------------------------------------------
def _layouts(model) -> tuple[dict[int, tuple[int, ...]], int | None]:
    """(each layer's query heads in original numbering, in the module's order now (a placeholder head: ()); the
    unpruned model's heads per layer, None where each layer has its own count as now)."""
    config = model.hf.config
    if not getattr(config, PRUNED_KEY, None):
        return {l: tuple(range(n)) for l, n in enumerate(model.cfg.heads_per_layer)}, None
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    out = {}
    for layer, kept in kept_heads(config).items():
        plan = plan_layer(n_heads, n_kv, kept)
        out[layer] = () if plan.placeholder else plan.q
    return out, n_heads


def streaming_record(model) -> dict | None:
    """The model's permanent streaming heads ``{"sink", "window", "heads": [(layer, head), ...]}`` in its own head
    numbering, or None for a model that ``stream_model`` did not make. A record that does not describe this model
    (a layer or head it does not have, a number that is not a whole one) is a ValueError naming the field, the
    value and the valid range; a head that pruning removed simply no longer streams."""
    record = getattr(model.hf.config, CONFIG_KEY, None)
    if not record:
        return None
    where = f"config.{CONFIG_KEY}"
    if not isinstance(record, Mapping) or set(record) != {"sink", "window", "heads"} or not isinstance(
            record["heads"], Mapping):
        raise ValueError(f"{where} must be {{'sink': int, 'window': int, 'heads': {{layer: [heads]}}}} "
                         f"(written by interp.stream_model); got {record!r}.")
    for name, least in (("sink", 0), ("window", 1)):
        if not _is_int(record[name]) or record[name] < least:
            raise ValueError(f"{where}['{name}'] must be a whole number >= {least} (keys); got {record[name]!r}. "
                             "Fix the model's config.json (interp.stream_model writes it).")
    layouts, n_original = _layouts(model)
    pairs = []
    for layer, heads in record["heads"].items():  # JSON turns the int keys into strings
        number = int(layer) if isinstance(layer, str) and layer.isdigit() else layer
        if not _is_int(number) or number not in layouts:
            raise ValueError(f"{where}['heads'] names layer {layer!r}; this model's layers are 0..{len(layouts) - 1}. "
                             "Fix the model's config.json (interp.stream_model writes it).")
        layer = int(number)
        n = len(layouts[layer]) if n_original is None else n_original
        if isinstance(heads, (str, bytes)) or not isinstance(heads, Sequence):
            raise ValueError(f"{where}['heads'][{layer}] must be a list of head numbers; got {heads!r}.")
        for h in heads:
            if not _is_int(h) or not 0 <= h < n:
                raise ValueError(f"{where}['heads'][{layer}] names head {h!r}; heads are whole numbers 0..{n - 1}"
                                 f"{' (numbered as in the unpruned model)' if n_original is not None else ''}. Fix "
                                 "the model's config.json (interp.stream_model writes it).")
        pairs += [(layer, layouts[layer].index(int(h))) for h in heads if int(h) in layouts[layer]]
    return {"sink": record["sink"], "window": record["window"], "heads": sorted(pairs)}


def _record(model, pairs, sink, window) -> dict:
    layouts, _ = _layouts(model)
    heads: dict[int, list[int]] = {}
    for l, h in pairs:
        heads.setdefault(l, []).append(int(layouts[l][h]))
    return {"sink": sink, "window": window, "heads": heads}


# -- attaching (every HookedModel, when it is built) ---------------------------------------------------------
def _attach(model) -> None:
    """Make the streaming heads the config records stream in ``model`` (nothing for a model without a record)."""
    record = streaming_record(model) if model.cfg.causal else None
    if record is None:
        return
    pairs = _check(model, record["heads"], record["sink"], record["window"])
    sink, window, cfg = record["sink"], record["window"], model.cfg
    block, plan = (sink, window, tuple(pairs)), []
    for l, module in enumerate(model._attn_modules):
        heads = tuple(h for ll, h in pairs if ll == l)
        if not heads:
            module.__dict__.pop(STREAM_ATTR, None)
            plan.append(None)
            continue
        spec = _LayerStream(heads, cfg.heads_per_layer[l], cfg.kv_heads_per_layer[l], sink, window, block)
        module.__dict__[STREAM_ATTR] = spec
        plan.append((spec.kv_full, spec.kv_stream) if spec.kv_stream else None)
    model.hf.__dict__[_PLAN] = (layer_windows(model), plan, sink, window, block)  # streaming_cache's arguments
    model.hf.__dict__[_PREPARE] = types.MethodType(_prepare_cache_for_generation, model.hf)


def _streaming_cache_fits(hf, model_kwargs) -> bool:
    """Whether generate may use a StreamingCache: a plan with something to shrink, eval mode, no padding, no
    attention hook active, and the streaming specs still attached."""
    plan = hf.__dict__.get(_PLAN)
    if plan is None or not any(plan[1]) or hf.training:
        return False
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        return False
    streams = 0
    for module in hf.modules():
        hooks = attached_layer_hooks(module)
        if hooks is not None and hooks.any:
            return False
        streams += module.__dict__.get(STREAM_ATTR) is not None
    return streams > 0


def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    """transformers' own, then its new DynamicCache replaced by a StreamingCache where one fits (module doc)."""
    given = {name: model_kwargs.get(name) for name in ("cache", "past_key_values")}  # 5.24 / earlier names
    result = type(self)._prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs)
    for name, before in given.items():
        made = model_kwargs.get(name)
        if before is None and type(made) is DynamicCache and _streaming_cache_fits(self, model_kwargs):
            model_kwargs[name] = streaming_cache(*self.__dict__[_PLAN])
    return result


_model._ON_BUILD.append(_attach)


# -- the conversion --------------------------------------------------------------------------------------------
def stream_model(model, heads, sink: int = 4, window: int = 256):
    """A new ``HookedModel`` whose ``heads`` ((layer, head) pairs; an empty list streams nothing) attend only to the
    first ``sink`` and the last ``window`` keys up to and including each query, in every forward and in
    ``generate``: what ``stream_heads(model, heads, sink, window)`` computes, made permanent. The original is
    untouched. Save with ``streamed.save_pretrained(folder)``; ``interp.load_model(folder)`` rebuilds it (the config
    records the heads in ``interp_streaming_heads``). Prune it (``analyses.prune_model``) and the remaining streaming
    heads keep streaming; stream a pruned model and its heads are numbered as it numbers them. Like
    ``stream_heads``, a ``KVHeadsNote`` warning says how many key/value heads really shrink where some heads share
    theirs with heads that do not stream."""
    pairs = _check(model, heads, sink, window)
    if getattr(model.hf.config, CONFIG_KEY, None):
        raise ValueError(f"This model already streams heads ({streaming_record(model)['heads'][:4]}...): stream_model "
                         "converts a model once. Convert the original model with all the heads at once.")
    busy = [l for l, m in enumerate(model._attn_modules) if m.__dict__.get(STREAM_ATTR) is not None]
    if busy:
        raise RuntimeError(f"Layers {busy} stream heads in an open stream_heads block; call stream_model outside it "
                           "(the copy would not keep them anyway).")
    if model._registry.active():
        raise ValueError(f"Remove the hooks on {model._registry.active()[:3]} before stream_model: it copies the "
                         "model, and torch hooks would be copied with it.")
    if distributed.dispatched(model.hf):
        raise NotImplementedError("stream_model copies the model in memory; this one is placed by a device map "
                                  "(accelerate), which a copy does not carry over. Load it without device_map, or "
                                  "use the stream_heads context manager, which works on it as it is.")
    hf = copy.deepcopy(model.hf)
    for module in hf.modules():  # the user's torch hooks belong to their model: the copy starts clean
        for name in TORCH_HOOK_TABLES:
            table = getattr(module, name, None)
            if table:
                setattr(module, name, type(table)())
    setattr(hf.config, CONFIG_KEY, _record(model, pairs, sink, window))
    streamed = _model.HookedModel(hf, tokenizer=model.tokenizer, attn=model.attn)  # attaches from the record
    note = kv_note(pairs, model.cfg.heads_per_layer, model.cfg.kv_heads_per_layer)
    if note:
        warnings.warn(note, KVHeadsNote, stacklevel=2)
    if hasattr(model, "source_name"):
        streamed.source_name = model.source_name
    return streamed

