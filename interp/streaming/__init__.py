"""Streaming heads (DuoAttention, Xiao et al. 2024; StreamingLLM's sinks, Xiao et al. 2023): chosen heads attend
only to the first ``sink`` keys and the last ``window`` keys up to and including each query.

``with stream_heads(model, [(3, 1), (7, 0)], sink=4, window=256) as s:`` masks those heads inside our attention:

- eager: the excluded scores are set to the dtype's minimum after the additive mask (what HF's own masks use),
  so patterns and hooks see the streaming pattern, exactly;
- flash: the other heads run the fused kernel as before; streaming heads run ``streaming_attention``, which per
  tile of queries gathers only the sink keys and the keys of the tile's windows (the middle tiles are skipped, so
  its cost grows with ``sink + window``, not with the sequence).

This room may import every room of ``interp`` below it (``runtime`` to ``model``).

Positions count real tokens: with left padding a row's first real token is its position 0, as if it ran alone.

**Real memory** (``interp.streaming.cache``). ``s.new_cache()`` is a transformers ``DynamicCache`` whose layers
keep, for every key/value head all of whose query heads stream (grouped-query attention: a key/value head serves
several query heads), only the sink and the last ``window`` entries; the other key/value heads keep everything.
Its ``update`` returns a ``SplitKV`` (not a tensor), which only our attention understands: use it with
``model.hf.generate`` or forward calls inside the same ``with`` block, without attention hooks and without padding.
It knows the sink, window and heads it was made for and refuses (ValueError) to be read under others or after the
block has closed: it no longer holds the keys those would read.

**For good** (``interp.streaming.model``): ``stream_model(model, heads, sink, window)`` returns a new model whose heads
stream in every forward and in ``generate``, recorded in its config so that it saves and loads.

The modules: ``heads`` (``stream_heads``, which heads can stream, the bytes a cache holds), ``attention`` (the kernel
and one layer's streaming), ``cache`` (the KV cache of streaming heads), ``model`` (``stream_model``).
"""

from .attention import streaming_attention
from .cache import KVHeadsNote, SplitKV, StreamingCache, StreamingLayer, cache_kwarg, kv_cache_bytes, output_cache
from .heads import Streaming, check_streamable, stream_heads, streamable_heads, streaming_kv_bytes
from .model import stream_model, streaming_record

__all__ = ["stream_heads", "Streaming", "StreamingCache", "StreamingLayer", "SplitKV", "streaming_attention",
           "kv_cache_bytes", "streaming_kv_bytes", "streamable_heads", "check_streamable", "KVHeadsNote",
           "cache_kwarg", "output_cache", "stream_model", "streaming_record"]
