"""The KV cache of streaming heads (``interp.streaming``): a transformers ``DynamicCache`` whose layers keep every
entry of the key/value heads that some query head reads in full, and only the first ``sink`` and the last
``window`` entries of the key/value heads all of whose query heads stream.

A layer's ``update`` hands the attention a ``SplitKV`` (the two parts and the ranks of the kept entries), not a
tensor: only our attention, with the layer's streaming spec attached by ``stream_heads``, reads it.

A cache holds only what the heads it was made for keep, so it knows them (its ``block``: sink, window and heads) and
refuses to be read under any other streaming, or after its ``stream_heads`` block has closed: the model would
then attend over keys the cache has already dropped. It checks before it stores anything, so a refused call leaves
it as it was.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["SplitKV", "StreamingLayer", "StreamingCache", "KVHeadsNote", "kv_cache_bytes", "cache_kwarg",
           "output_cache"]

STREAM_ATTR = "_interp_stream"  # an attention module's streaming spec (interp.streaming.attention._LayerStream) while it streams


def _describe(block) -> str:
    """A block ``(sink, window, ((layer, head), ...))`` in words."""
    if block is None:
        return "no streaming head"
    sink, window, pairs = block
    shown = ", ".join(f"{l}.{h}" for l, h in pairs[:8]) + (", ..." if len(pairs) > 8 else "")
    return f"streaming heads {shown or '(none)'} with sink {sink}, window {window}"


def check_reader(made, now, layer) -> None:
    """Refuse to read a cache made for the streaming ``made`` (a block, or None) under ``now`` at ``layer``."""
    if now == made:
        return
    if now is None:
        now_text = "no streaming head (the stream_heads block that made the cache has closed, or this is another model)"
    else:
        now_text = _describe(now)
    raise ValueError(f"This StreamingCache was made for {_describe(made)}, but layer {layer} now runs with {now_text}. "
                     "A streaming cache holds only the keys its own heads keep, so it is read under the same heads, "
                     "sink and window only: use it inside the stream_heads block that made it, or make a new one "
                     "with new_cache() in this block.")


@dataclass
class SplitKV:
    """What a streaming cache layer hands to the attention: the kept key/value heads' full keys ``(b, g_f, k, d)``,
    the streamed ones' sink + window (+ new) entries ``(b, g_s, n, d)``, their ranks ``(n,)`` and the number of
    tokens seen so far, this call's included."""

    full_k: torch.Tensor
    full_v: torch.Tensor
    stream_k: torch.Tensor
    stream_v: torch.Tensor
    ranks: torch.Tensor
    seen: int
    block: tuple | None = None  # the streaming the cache was made for: (sink, window, ((layer, head), ...))

    @property
    def value_dim(self) -> int:
        return self.stream_v.shape[-1]

    def check_reader(self, now, layer) -> None:
        """Refuse a module streaming ``now`` (a block, or None) at ``layer``: the cache was made for ``block``."""
        check_reader(self.block, now, layer)


class StreamingLayer(DynamicLayer):
    """A cache layer keeping every entry of the key/value heads ``kv_full`` and only the first ``sink`` and the last
    ``window`` entries of the heads ``kv_stream``."""

    is_croppable = False

    def __init__(self, kv_full, kv_stream, sink: int, window: int, block: tuple | None = None):
        super().__init__()
        self.kv_full, self.kv_stream, self.sink, self.window = list(kv_full), list(kv_stream), sink, window
        self.block = block
        self.seen = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        b, _, _, d = key_states.shape
        empty = lambda n, e, t: t.new_zeros(b, n, 0, e)  # noqa: E731
        self.keys = empty(len(self.kv_full), d, key_states)
        self.values = empty(len(self.kv_full), value_states.shape[-1], value_states)
        self.stream_keys = empty(len(self.kv_stream), d, key_states)
        self.stream_values = empty(len(self.kv_stream), value_states.shape[-1], value_states)
        self.ranks = torch.zeros(0, dtype=torch.long, device=key_states.device)

    def update(self, key_states, value_states, *args, **kwargs) -> tuple[SplitKV, SplitKV]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self.keys = torch.cat([self.keys, key_states[:, self.kv_full]], dim=-2)
        self.values = torch.cat([self.values, value_states[:, self.kv_full]], dim=-2)
        s_k = torch.cat([self.stream_keys, key_states[:, self.kv_stream]], dim=-2)
        s_v = torch.cat([self.stream_values, value_states[:, self.kv_stream]], dim=-2)
        ranks = torch.cat([self.ranks, torch.arange(self.seen, self.seen + n, device=self.ranks.device)])
        self.seen += n
        # what the next query may still see: ranks < sink, and ranks >= seen - window (ranks are sorted)
        head, tail = min(self.sink, self.seen), min(self.window, self.seen)
        if head + tail >= len(ranks):
            self.stream_keys, self.stream_values, self.ranks = s_k, s_v, ranks
        else:
            cut = lambda t: torch.cat([t[..., :head, :], t[..., -tail:, :]], dim=-2)  # noqa: E731
            self.stream_keys, self.stream_values = cut(s_k), cut(s_v)
            self.ranks = torch.cat([ranks[:head], ranks[-tail:]])
        split = SplitKV(self.keys, self.values, s_k, s_v, ranks, self.seen, self.block)
        return split, split

    def get_seq_length(self) -> int:
        return self.seen

    def _apply(self, fn) -> None:
        if self.is_initialized:
            for name in ("keys", "values", "stream_keys", "stream_values"):
                setattr(self, name, fn(getattr(self, name)))

    def reorder_cache(self, beam_idx) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices) -> None:
        self._apply(lambda t: t[indices, ...])

    def reset(self) -> None:
        self.keys = self.values = self.stream_keys = self.stream_values = None
        self.is_initialized, self.seen = False, 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("A streaming cache layer has dropped the entries a crop would go back to.")


class StreamingCache(DynamicCache):
    """A DynamicCache whose layers with fully streaming key/value heads are ``StreamingLayer`` s, made for the
    streaming ``block`` ``(sink, window, ((layer, head), ...))``. Given the model's attention ``modules`` (one per
    layer), every ``update`` first checks that they stream exactly that block, and raises a ValueError otherwise."""

    def __init__(self, layers: list[DynamicLayer], block: tuple | None = None, modules=None):
        super().__init__()
        self.layers, self.layer_class_to_replicate = layers, None
        self.block = block
        streaming = {l for l, _ in block[2]} if block is not None else set()
        self._expected = [block if l in streaming else None for l in range(len(layers))]
        self._modules = None if modules is None else [weakref.ref(m) for m in modules]

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self._modules is not None:  # every layer, before any is updated: a refused call leaves the cache whole
            for l, ref in enumerate(self._modules):
                module = ref()
                spec = None if module is None else module.__dict__.get(STREAM_ATTR)
                if module is not None:
                    check_reader(self._expected[l], getattr(spec, "block", None), l)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class KVHeadsNote(UserWarning):
    """Some streaming query heads share their key/value head with heads that do not stream: that key/value head's
    cache keeps every key (``stream_heads`` and ``stream_model`` say how many key/value heads really shrink)."""


def kv_note(pairs, heads_per_layer, kv_heads_per_layer) -> str | None:
    """One line where streaming the query heads ``pairs`` ((layer, head)) leaves key/value heads that some of them
    read holding every key (grouped-query attention: a key/value head keeps only sink + window entries when all its
    query heads stream); None where every key/value head they read shrinks."""
    shrink = keep = 0
    groups = set()
    for l in sorted({l for l, _ in pairs}):
        group = heads_per_layer[l] // kv_heads_per_layer[l]
        chosen = {h for ll, h in pairs if ll == l}
        groups.add(group)
        for g in sorted({h // group for h in chosen}):
            if all(q in chosen for q in range(g * group, (g + 1) * group)):
                shrink += 1
            else:
                keep += 1
    if not keep:
        return None
    per = f" (here {groups.pop()})" if len(groups) == 1 else ""
    return (f"Streaming these {len(pairs)} query heads shrinks the cache of {shrink} of the model's "
            f"{sum(kv_heads_per_layer)} key/value heads: a key/value head keeps only sink + window entries when all "
            f"its query heads{per} stream, and {keep} that they read also serve heads that do not stream, so they "
            "keep every key (Streaming.kv_heads lists those that shrink).")


def kv_cache_bytes(cache) -> int:
    """Bytes of the keys and values a transformers cache holds (a StreamingCache's streamed entries included)."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "stream_keys", "stream_values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def cache_kwarg(hf) -> str:
    """The name a HF model's forward and ``generate`` take its KV cache by: ``cache`` (transformers 5.24) or
    ``past_key_values`` (5.17), read from its forward's signature: ``hf(ids, **{cache_kwarg(hf): cache})``."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def output_cache(out):
    """The KV cache a model's output carries, under either name (``out.cache`` in 5.24, ``out.past_key_values``
    in 5.17); None when it has none."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)
