"""The attention of streaming heads (``interp.streaming``): ``streaming_attention``, the kernel that per tile of
queries reads only the sink keys and the tile's window keys, and ``_LayerStream``, what one attention module does
while some of its heads stream (the eager path's mask, the flash path's split between the fused kernel and this one,
and attention over a ``StreamingCache``'s split keys). Our attention (``interp.attention.paths``) calls it through the spec
that ``stream_heads`` attaches to the module under ``STREAM_ATTR``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.kernels import fused_attention
from .cache import SplitKV

__all__ = ["streaming_attention"]

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
