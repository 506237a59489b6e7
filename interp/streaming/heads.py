"""``stream_heads``: chosen heads attend only to the first ``sink`` and the last ``window`` keys up to and including
each query, inside a ``with`` block (the package's docstring, ``interp.streaming``, says how on each path); which
heads can stream; and the bytes a streaming cache holds (``streaming_kv_bytes``).
"""

from __future__ import annotations

import numbers
import warnings
from contextlib import contextmanager

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ..attention.sites import check_heads
from .attention import _LayerStream
from .cache import STREAM_ATTR, KVHeadsNote, StreamingCache, StreamingLayer, kv_note

__all__ = ["stream_heads", "Streaming", "streaming_kv_bytes", "streamable_heads", "check_streamable"]


# -- memory ----------------------------------------------------------------------------------------------------
def streaming_kv_bytes(model, heads, tokens: int, sink: int = 4, window: int = 256, batch: int = 1) -> int:
    """The bytes a ``StreamingCache`` holds after ``tokens`` tokens of ``batch`` rows (``kv_cache_bytes`` of it;
    ``heads=[]``: a plain DynamicCache): every key/value head all of whose query heads stream keeps
    ``min(tokens, sink + window)`` entries; of the others, a sliding-window layer's keep its window (the ``w``
    keys before the query, as HF's ``DynamicSlidingWindowLayer`` holds ``sliding_window - 1``), the rest ``tokens``."""
    pairs, cfg = _check(model, heads, sink, window), model.cfg
    size = torch.finfo(model.dtype).bits // 8 if model.dtype.is_floating_point else 4
    total = 0
    for l, left in enumerate(layer_windows(model)):
        n_q, n_kv = cfg.heads_per_layer[l], cfg.kv_heads_per_layer[l]
        kv_stream = len(_LayerStream(tuple(h for ll, h in pairs if ll == l), n_q, n_kv, sink, window).kv_stream)
        held = tokens if left is None else min(tokens, left)
        entries = (n_kv - kv_stream) * held + kv_stream * min(tokens, sink + window)
        total += entries * (cfg.d_head + cfg.d_head_v) * size * batch
    return total


# -- the context manager ---------------------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check(model, heads, sink, window) -> list[tuple[int, int]]:
    from ..model.hooked import HookedModel

    if not isinstance(model, HookedModel) or not model.cfg.causal:
        raise ValueError("stream_heads needs a causal decoder-only model (an interp HookedModel of a causal LM): "
                         "streaming keeps each query's sinks and its recent past, which an encoder or a "
                         "cross-attention does not have; got " + (repr(model) if isinstance(model, HookedModel)
                                                                  else type(model).__name__) + ".")
    for name, value, least in (("sink", sink, 0), ("window", window, 1)):
        if not _is_int(value) or value < least:
            raise ValueError(f"{name} must be an integer >= {least} (keys); got {value!r}.")
    pairs = check_heads(model, heads, allow_empty=True)  # (layer, head) or ("blocks.3.attn", head)
    for l, _ in pairs:
        layer = model.structure.layer_attn[l]
        if layer.window[0] is not None or layer.sinks is not None:
            what = f"a sliding window of {layer.window[0] + 1} keys" if layer.window[0] is not None else "sink logits"
            full = [i for i, a in enumerate(model.structure.layer_attn) if a.window[0] is None and a.sinks is None]
            raise NotImplementedError(f"Layer {l} already has {what}; streaming its heads is not implemented. "
                                      f"Stream heads of the layers with full attention: {full}.")
    return pairs


def streamable_heads(model) -> list[tuple[int, int]]:
    """Every (layer, head) that ``stream_heads`` takes: the heads of layers with full attention (on Gemma 3 its
    global layers; a sliding-window layer already keeps a window)."""
    return [(l, h) for l, a in enumerate(model.structure.layer_attn) if a.window[0] is None and a.sinks is None
            for h in range(model.cfg.heads_per_layer[l])]


def check_streamable(model, what: str, fix: str = "Use a model with full-attention layers (e.g. Llama, Qwen2, or "
                     "Gemma 3, whose global layers stream).") -> list[tuple[int, int]]:
    """``streamable_heads(model)``, or a ValueError saying why ``what`` has no head to stream on this model."""
    heads = streamable_heads(model)
    if not heads:
        has = sorted({f"a sliding window of {a.window[0] + 1} keys" if a.window[0] is not None else "sink logits"
                      for a in model.structure.layer_attn})
        raise ValueError(f"{what}: no head of this {model.hf.config.model_type} model can stream: every layer already "
                         f"has {' or '.join(has)}, and streaming is for layers with full attention. {fix}")
    return heads


class Streaming:
    """What ``stream_heads`` yields: ``heads``, ``sink``, ``window``, ``kv_heads`` (the key/value heads whose query
    heads all stream: the ones a ``new_cache()`` shrinks) and ``new_cache()``."""

    def __init__(self, model, heads, sink, window, layers: dict[int, _LayerStream]):
        self.model, self.heads, self.sink, self.window, self._layers = model, heads, sink, window, layers
        self.kv_heads = [(l, g) for l, s in sorted(layers.items()) for g in s.kv_stream]

    def new_cache(self) -> StreamingCache:
        """An empty cache for ``model.hf(..., cache=c, use_cache=True)`` or ``generate`` (transformers 5.17 names it
        ``past_key_values=``: ``interp.cache_kwarg(model.hf)``), inside this block only."""
        kv = [(s.kv_full, s.kv_stream) if s is not None and s.kv_stream else None
              for s in map(self._layers.get, range(self.model.cfg.n_layers))]
        return streaming_cache(layer_windows(self.model), kv, self.sink, self.window,
                               (self.sink, self.window, tuple(self.heads)), self.model._attn_modules)


def layer_windows(model) -> list[int | None]:
    """Each layer's sliding window (keys before the query; None for full attention), as ``streaming_cache`` takes."""
    return [model.structure.layer_attn[l].window[0] for l in range(model.cfg.n_layers)]


def streaming_cache(windows: list, kv: list, sink: int, window: int, block: tuple | None = None,
                    modules=None) -> StreamingCache:
    """An empty cache whose layer ``l`` keeps sink + window entries of its streaming key/value heads (``kv[l]``:
    ``(kv_full, kv_stream)``, or None where no key/value head streams); a layer with nothing streaming keeps every
    key, or its sliding window ``windows[l]`` where it has one, as HF's own cache does (Gemma 3's local layers).
    ``block``: the streaming it is for, ``(sink, window, ((layer, head), ...))``; ``modules``: the attention modules
    whose streaming each update checks against it (``StreamingCache``)."""
    layers = []
    for left, split in zip(windows, kv):
        if split is not None:
            layers.append(StreamingLayer(*split, sink, window, block))
        else:
            layers.append(DynamicLayer() if left is None else DynamicSlidingWindowLayer(sliding_window=left + 1))
    return StreamingCache(layers, block, modules)


@contextmanager
def stream_heads(model, heads, sink: int = 4, window: int = 256):
    """Inside the block, ``heads`` ((layer, head) pairs; an empty list streams nothing) attend only to the first
    ``sink`` and the last ``window`` keys up to and including each query (positions count real tokens). Yields a
    ``Streaming``; everything is as before on exit, also after an exception. Where some of the heads share their
    key/value head with heads that do not stream (grouped-query attention), a ``KVHeadsNote`` warning says how many
    key/value heads really shrink in a ``new_cache()``."""
    pairs = _check(model, heads, sink, window)
    note = kv_note(pairs, model.cfg.heads_per_layer, model.cfg.kv_heads_per_layer)
    if note:
        warnings.warn(note, KVHeadsNote, stacklevel=3)  # the caller's `with` line (this generator, contextlib, it)
    model._check_attached()
    modules = model._attn_modules
    busy = [l for l, m in enumerate(modules) if STREAM_ATTR in m.__dict__]
    if busy:
        raise RuntimeError(f"Layers {busy} already stream heads (a stream_heads block is open, or the model was made "
                           "by interp.stream_model); nesting is not supported: give all the heads to one block, or "
                           "open it on the model before stream_model.")
    layers: dict[int, _LayerStream] = {}
    block = (sink, window, tuple(pairs))
    for l in sorted({l for l, _ in pairs}):
        layers[l] = _LayerStream(tuple(h for ll, h in pairs if ll == l), model.cfg.heads_per_layer[l],
                                 model.cfg.kv_heads_per_layer[l], sink, window, block)
    try:
        for l, spec in layers.items():
            modules[l].__dict__[STREAM_ATTR] = spec
        yield Streaming(model, pairs, sink, window, layers)
    finally:
        for l in layers:
            modules[l].__dict__.pop(STREAM_ATTR, None)
