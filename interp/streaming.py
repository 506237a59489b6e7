"""Streaming heads (DuoAttention, Xiao et al. 2024; StreamingLLM's sinks, Xiao et al. 2023): chosen heads attend
only to the first ``sink`` keys and the last ``window`` keys up to and including each query.

``with stream_heads(model, [(3, 1), (7, 0)], sink=4, window=256) as s:`` masks those heads inside our attention:

- eager: the excluded scores are set to the dtype's minimum after the additive mask (what HF's own masks use),
  so patterns and hooks see the streaming pattern, exactly;
- flash: the other heads run the fused kernel as before; streaming heads run ``streaming_attention``, which per
  tile of queries gathers only the sink keys and the keys of the tile's windows (the middle tiles are skipped, so
  its cost grows with ``sink + window``, not with the sequence).

Positions count real tokens: with left padding a row's first real token is its position 0, as if it ran alone.

**Real memory** (``interp.streaming_cache``). ``s.new_cache()`` is a transformers ``DynamicCache`` whose layers
keep, for every key/value head all of whose query heads stream (grouped-query attention: a key/value head serves
several query heads), only the sink and the last ``window`` entries; the other key/value heads keep everything.
Its ``update`` returns a ``SplitKV`` (not a tensor), which only our attention understands: use it with
``model.hf.generate`` or forward calls inside the same ``with`` block, without attention hooks and without padding.
It knows the sink, window and heads it was made for and refuses (ValueError) to be read under others or after the
block has closed: it no longer holds the keys those would read.
"""

from __future__ import annotations

import numbers
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .kernels import fused_attention
from .sites import check_heads
from .streaming_cache import STREAM_ATTR, KVHeadsNote, SplitKV, StreamingCache, StreamingLayer, kv_cache_bytes, kv_note

__all__ = ["stream_heads", "Streaming", "StreamingCache", "SplitKV", "streaming_attention", "kv_cache_bytes",
           "streaming_kv_bytes", "streamable_heads", "KVHeadsNote"]

_TILE_KEYS = 1 << 22  # elements of one (b, h, tile, keys) score block in streaming_attention


# -- the kernel --------------------------------------------------------------------------------------------
def _first_at_least(k_rank: torch.Tensor, rank: torch.Tensor, right: bool = False) -> torch.Tensor:
    """k_rank: (b, k) non-decreasing; rank: (b, n). The first key index whose rank is >= rank (> with right)."""
    return torch.searchsorted(k_rank, rank.contiguous(), right=right)


def streaming_attention(query, key, value, q_rank, k_rank, k_real, sink: int, window: int, scale: float,
                        softcap: float | None = None, kv_index=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of streaming heads: query ``i`` sees real key ``j`` iff ``rank_j <= rank_i`` and (``rank_j < sink``
    or ``rank_i - rank_j < window``). query: (b, h, q, d); key: (b, h, k, d); value: (b, h, k, e); q_rank: (b, q)
    (-1 for a padded query, whose output is 0 and logsumexp 0, as the fused kernels give); k_rank, k_real: (b, k),
    ranks non-decreasing along k (a padding key repeats its predecessor's rank). Per tile of queries only the sink
    keys and the tile's window keys are read.
    Returns out: (b, h, q, e) and lse: (b, h, q) in fp32.
    """
    b, h, n_q, _ = query.shape
    n_k = key.shape[2]
    k_rank = k_rank.contiguous()
    dense = n_k <= sink + 2 * window  # few keys (a streaming cache's): read them all, no tiles
    n_sink = 0 if dense else int(_first_at_least(k_rank, torch.full((b, 1), sink, device=k_rank.device)).max())
    tile = n_q if dense else max(1, min(n_q, window, _TILE_KEYS // max(1, b * h * (sink + 2 * window))))
    outs, lses = [], []
    for s in range(0, n_q, tile):
        e = min(n_q, s + tile)
        qr = q_rank[:, s:e]  # (b, t)
        if dense:
            idx = slice(None)
        else:
            lo = int(_first_at_least(k_rank, qr[:, :1] - window + 1).min())
            hi = int(_first_at_least(k_rank, qr[:, -1:], right=True).max())  # after the last key the tile may see
            lo, hi = min(lo, n_k), min(max(hi, lo), n_k)
            if n_sink >= lo:
                idx = slice(0, hi)
            else:
                idx = torch.cat([torch.arange(0, min(n_sink, n_k), device=key.device),
                                 torch.arange(lo, hi, device=key.device)])
        k, v, kr, real = key[:, :, idx], value[:, :, idx], k_rank[:, idx], k_real[:, idx]  # (b, g, n, d), (b, n)
        if kv_index is not None:  # the selected keys only, never the whole sequence, per query head
            k, v = k[:, kv_index], v[:, kv_index]
        scores = torch.matmul(query[:, :, s:e], k.transpose(2, 3)).mul_(scale)  # (b, h, t, n)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.float()
        gap = qr[:, :, None] - kr[:, None, :]  # (b, t, n)
        allowed = (gap >= 0) & ((kr[:, None, :] < sink) | (gap < window)) & real[:, None, :] & (qr[:, :, None] >= 0)
        scores.masked_fill_(~allowed[:, None], float("-inf"))  # in place: one (b, h, t, n) block per tile
        lse = torch.logsumexp(scores, dim=-1)  # (b, h, t)
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        outs.append(torch.matmul(scores.sub_(lse[..., None]).exp_().to(v.dtype), v))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _ranks(mask, batch: int, n_q: int, n_k: int, device):
    """(q_rank (b, q), k_rank (b, k), k_real (b, k)) from our additive mask (b or 1, 1, q, k), or None (no padding).
    A key is real when the last query row may see it (left padding: the last query is a real token); the queries
    are the last ``n_q`` keys."""
    if mask is None:
        k_real = torch.ones(batch, n_k, dtype=torch.bool, device=device)
    else:
        k_real = (mask[:, 0, -1, :] == 0).expand(batch, n_k)
        if not bool(k_real[:, -1].all()):
            raise ValueError("Streaming heads count positions from the mask's last query row, which must be a real "
                             "token that sees every earlier one: pad on the left (as interp does for causal models) "
                             "and use a dynamic cache (HF's StaticCache is not supported).")
    count = torch.cumsum(k_real.long(), dim=1)
    k_rank = count - 1
    own = slice(n_k - n_q, n_k)
    q_rank = torch.where(k_real[:, own], k_rank[:, own], torch.full_like(k_rank[:, own], -1))
    return q_rank, k_rank, k_real


# -- what one layer does ------------------------------------------------------------------------------------
@dataclass(eq=False)
class _LayerStream:
    """The streaming heads of one attention module: query heads ``heads`` of ``n_heads`` on ``n_kv_heads``."""

    heads: tuple[int, ...]
    n_heads: int
    n_kv_heads: int
    sink: int
    window: int
    block: tuple | None = None  # the whole streaming: (sink, window, ((layer, head), ...)), a cache's check

    def __post_init__(self):
        group = self.n_heads // self.n_kv_heads
        self.is_streaming = torch.zeros(self.n_heads, dtype=torch.bool)
        self.is_streaming[list(self.heads)] = True
        self.kv_stream = tuple(g for g in range(self.n_kv_heads)
                               if all(q in self.heads for q in range(g * group, (g + 1) * group)))
        self.kv_full = tuple(g for g in range(self.n_kv_heads) if g not in self.kv_stream)
        # query heads on kept / streamed key/value heads, and whether any of the former streams
        self.q_full = [q for g in self.kv_full for q in range(g * group, (g + 1) * group)]
        self.q_stream = [q for g in self.kv_stream for q in range(g * group, (g + 1) * group)]
        self.full_streams = self.is_streaming[self.q_full]
        self.stream_kv_index = [i // group for i in range(len(self.q_stream))]  # into the streamed heads' cache
        self._index: dict = {}

    def _idx(self, which: str, device) -> torch.Tensor:
        key = (which, str(device))
        if key not in self._index:
            self._index[key] = torch.tensor(getattr(self, which), dtype=torch.long, device=device)
        return self._index[key]

    def __deepcopy__(self, memo):  # a copy of the HF model does not stream
        return None

    def __reduce__(self):
        return (type(None), ())

    def mask_scores(self, scores: torch.Tensor, mask) -> torch.Tensor:
        """Eager path: scores (b, h, q, k) after the additive mask, with the streaming heads' excluded keys at the
        dtype's minimum (as HF's masks), on real query rows only."""
        b, _, n_q, n_k = scores.shape
        q_rank, k_rank, k_real = _ranks(mask, b, n_q, n_k, scores.device)
        gap = q_rank[:, :, None] - k_rank[:, None, :]  # (b, q, k)
        kept = (k_rank[:, None, :] < self.sink) | (gap < self.window)
        drop = ~kept & k_real[:, None, :] & (q_rank[:, :, None] >= 0)
        heads = self.is_streaming.to(scores.device)[None, :, None, None]
        return scores.masked_fill(drop[:, None] & heads, torch.finfo(scores.dtype).min)

    def attend(self, query, key, value, mask, scale, causal, need_lse, softcap, heads=None, dropout=0.0):
        """Flash path: the fused kernel for the key/value groups that have a head that does not stream (so that
        those heads are bit for bit what the plain model computes), the streaming kernel for the streaming heads
        (a group whose heads all stream never reads its middle keys). heads: (h,) bool, default this layer's."""
        if dropout > 0.0:
            raise NotImplementedError("Streaming heads on the flash path run without attention dropout: call "
                                      "model.hf.eval() (studies do), or use the eager path.")
        heads = self.is_streaming if heads is None else heads
        b, h, n_q, _ = query.shape
        n_kv = key.shape[1]
        n_rep = h // n_kv
        groups = [g for g in range(n_kv) if not bool(heads[g * n_rep:(g + 1) * n_rep].all())]
        if len(groups) == n_kv:
            out, lse = fused_attention(query, key, value, mask, scale, 0.0, causal, True, softcap)
            out, lse = out.clone(), lse.clone()
        else:
            out = query.new_empty(b, h, n_q, value.shape[-1])
            lse = torch.empty(b, h, n_q, dtype=torch.float32, device=query.device)
            if groups:
                g_idx = torch.tensor(groups, device=query.device)
                q_idx = torch.tensor([q for g in groups for q in range(g * n_rep, (g + 1) * n_rep)],
                                     device=query.device)
                o, l = fused_attention(query[:, q_idx], key[:, g_idx], value[:, g_idx], mask, scale, 0.0, causal,
                                       True, softcap)
                out[:, q_idx], lse[:, q_idx] = o, l
        chosen = heads.nonzero().flatten().tolist()
        if chosen:
            idx = torch.tensor(chosen, device=query.device)
            q_rank, k_rank, k_real = _ranks(mask, b, n_q, key.shape[2], query.device)
            s_out, s_lse = streaming_attention(query[:, idx], key, value, q_rank, k_rank, k_real, self.sink,
                                               self.window, scale, softcap, kv_index=idx // n_rep)
            out[:, idx], lse[:, idx] = s_out.to(out.dtype), s_lse
        return out, lse

    def attend_cached(self, query, key: SplitKV, mask, scale, softcap):
        """Either path, with a ``StreamingCache``: query heads on kept key/value heads attend over the full cache
        (streaming ones masked); query heads on streamed key/value heads over the sink + window entries."""
        if mask is not None and not bool((mask[:, 0, -1] == 0).all()):
            raise ValueError("A StreamingCache needs rows without padding (every attention_mask entry 1); run the "
                             "rows one at a time, or use a plain cache (the masked model computes the same).")
        b, h, n_q, _ = query.shape
        group = h // self.n_kv_heads
        out = query.new_empty(b, h, n_q, key.value_dim)
        if self.kv_full:
            idx = self._idx("q_full", query.device)
            o, _ = self.attend(query[:, idx], key.full_k, key.full_v, mask, scale, mask is None and n_q > 1, False,
                               softcap, heads=self.full_streams)
            out[:, idx] = o
        idx = self._idx("q_stream", query.device)
        if n_q == 1:  # a decode step: each key/value head's query heads at once, no copies of the keys
            out[:, idx] = self._decode_step(query[:, idx], key, scale, softcap, group).to(out.dtype)
            return out
        q_rank = torch.arange(key.seen - n_q, key.seen, device=query.device).expand(b, n_q)
        k_rank = key.ranks.to(query.device).expand(b, -1)
        o, _ = streaming_attention(query[:, idx], key.stream_k, key.stream_v, q_rank, k_rank,
                                   torch.ones_like(k_rank, dtype=torch.bool), self.sink, self.window, scale, softcap,
                                   kv_index=self._idx("stream_kv_index", query.device))
        out[:, idx] = o.to(out.dtype)
        return out


    def _decode_step(self, query, key: SplitKV, scale, softcap, group: int) -> torch.Tensor:
        """query: (b, g_s * group, 1, d) -> (b, g_s * group, 1, e) over the kept entries the query may see."""
        b, h, _, d = query.shape
        q = query.reshape(b, h // group, group, d)  # (b, g, r, d)
        scores = torch.matmul(q, key.stream_k.transpose(2, 3)) * scale  # (b, g, r, n)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        ranks = key.ranks.to(query.device)
        seen = (ranks < self.sink) | (ranks > key.seen - 1 - self.window)  # (n,)
        scores = scores.float().masked_fill(~seen, float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(key.stream_v.dtype)
        return torch.matmul(weights, key.stream_v).reshape(b, h, 1, -1)


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
    from .model import HookedModel

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
