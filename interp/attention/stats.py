"""Per-row attention statistics from q and k, one tile of the n x n weights at a time.

``attention_stats`` walks query tiles and, inside each, key tiles; the block it holds is at most ``budget``
elements ``(b, h, query tile, key tile)``, so memory is O(n) for any sequence length. The weights are rebuilt
exactly as the flash path's kernel defines them, ``w = exp(cap(scale * q . k) + bias + mask - lse)``, with the
row's logsumexp either given (the kernel's ``hook_lse``, which already counts an attention sink) or computed
in a first pass over the same tiles (online logsumexp, the sink logit added at the end).

Per query row and head it returns: the top-1 key (index and weight), the weight on the first ``n_sink`` real
keys, the weight per distance bucket (``|q - k|`` = 0, 1, 2-3, 4-7, ..., the last bucket holding everything
farther), the weight on given key sets (a needle span: ``(b, k)`` booleans), the weight-averaged value of given
per-key quantities (``key_values``: ``(b, h, k)``, such as each key's norm ``||v_j W_O||`` per head, whose row sum is
the denominator of norm-weighted attention), the weight of given
``(batch, query, key)`` pairs (per-row target sets such as earlier occurrences), the entropy and the row's total
weight (1, or less with sinks; 0 for a fully masked row).

Shapes: query ``(b, h, q, d)``, key ``(b, g, k, d)`` as the kernels take them (``h`` a multiple of ``g``);
queries are the last ``q`` of the ``k`` positions (a decode step is one query row against the whole cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["FIELDS", "HeadStats", "attention_stats", "capped", "offset_buckets", "bucket_labels", "pair_weights"]

FIELDS = ("top_index", "top_weight", "sink", "offsets", "entropy", "total")
_BUDGET = 1 << 22  # elements of one (b, h, query tile, key tile) block: 16 MiB in fp32
_TOP_BUDGET = 1 << 20  # the same when only the top-1 key is asked for (4 MiB)
_PAIR_BUDGET = 1 << 22  # elements of one gathered (pairs, head, d_head) block in pair_weights


@dataclass
class HeadStats:
    """Statistics of every query row: each field ``(b, h, q)`` unless said otherwise.

    top_index: key position of the row's largest weight (-1 for a fully masked row). top_weight: that weight.
    sink: weight on the first ``n_sink`` real keys. offsets: ``(b, h, q, n_buckets)`` weight per distance bucket.
    entropy: ``-sum w log w`` in nats. total: the row's weight on keys (1 without sinks; 0 when fully masked).
    key_sets: name -> weight on that set of keys. key_values: name -> ``sum_k w_qk x_hk`` of that per-key quantity.
    pairs: name -> ``(n_pairs, h)`` weight of each pair.
    A field not asked for (``attention_stats(fields=...)``) is None.
    """

    top_index: torch.Tensor
    top_weight: torch.Tensor | None
    sink: torch.Tensor | None
    offsets: torch.Tensor | None
    entropy: torch.Tensor | None
    total: torch.Tensor | None
    key_sets: dict[str, torch.Tensor] = field(default_factory=dict)
    pairs: dict[str, torch.Tensor] = field(default_factory=dict)
    key_values: dict[str, torch.Tensor] = field(default_factory=dict)


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """A layer's logit soft-cap, ``tanh(s / cap) * cap`` (Gemma 2), or the scores as they are."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def pair_weights(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scale: float, b: torch.Tensor,
                 qi: torch.Tensor, kj: torch.Tensor, softcap: float | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """The weight ``exp(cap(scale * q_i . k_j) + bias_ij - lse_i)`` of each ``(batch, query, key)`` pair in every
    head, float32 ``(n_pairs, h)``, a block of pairs at a time: O(pairs) memory, never n x n. The one formula of a
    weight rebuilt from the flash path's q, k and logsumexp.

    q: (b, q, h, d) and k: (b, k, g, d) as the hooks give them (head h reads key/value head h // (h / g));
    lse: (b, h, q); bias: the position bias, broadcastable to (b, h, q, k). Masks are the caller's: a pair the
    layer cannot see gets a meaningless weight here."""
    n_heads, n_kv, d_head = q.shape[2], k.shape[2], q.shape[3]
    step = max(1, _PAIR_BUDGET // (n_heads * d_head))
    out = []
    for s in range(0, len(b), step):
        bb, ii, jj = b[s:s + step], qi[s:s + step], kj[s:s + step]
        qs = q[bb, ii].float().unflatten(1, (n_kv, n_heads // n_kv))  # (n, g, r, d)
        dots = capped(torch.einsum("ngrd,ngd->ngr", qs, k[bb, jj].float()).flatten(1) * scale, softcap)  # (n, h)
        if bias is not None:
            dots = dots + bias[bb if bias.shape[0] > 1 else torch.zeros_like(bb), :, ii, jj].float()
        out.append(torch.exp(dots - lse[bb, :, ii].float()))
    return torch.cat(out) if out else torch.zeros(0, n_heads, device=q.device)


def offset_buckets(distance: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """Bucket of each distance ``|q - k|``: 0 -> 0, 1 -> 1, 2-3 -> 2, 4-7 -> 3, ..., capped at ``n_buckets - 1``."""
    d = distance.abs()
    bucket = torch.floor(torch.log2(d.clamp(min=1).double())).long() + 1
    return torch.where(d == 0, 0, bucket).clamp(max=n_buckets - 1)


def bucket_labels(n_buckets: int) -> list[str]:
    """Readable names of the buckets: ``["0", "1", "2-3", "4-7", ..., ">=2^(n-2)"]``."""
    labels = ["0"] + [f"{2 ** (i - 1)}-{2 ** i - 1}" if i > 1 else "1" for i in range(1, n_buckets - 1)]
    return labels + [f">={2 ** (n_buckets - 2)}"]


def attention_stats(query: torch.Tensor, key: torch.Tensor, scale: float, lse: torch.Tensor | None = None, *,
                    causal: bool = True, window: tuple[int | None, int | None] = (None, None),
                    key_valid: torch.Tensor | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None, bias: torch.Tensor | None = None, n_sink: int = 1,
                    n_buckets: int = 16, key_sets: dict[str, torch.Tensor] | None = None,
                    pairs: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
                    fields: tuple[str, ...] = FIELDS, budget: int | None = None,
                    query_offset: int | None = None,
                    key_values: dict[str, torch.Tensor] | None = None) -> HeadStats:
    """Statistics of ``softmax(cap(scale * q k^T) + bias + mask)`` (a sink column joining the softmax) per row.

    query: (b, h, q, d); key: (b, g, k, d). lse: (b, h, q) the rows' logsumexp as the flash path's ``hook_lse``
    gives it (sink included), or None to compute it here. causal and window: which keys a query may see, window
    being (keys before, keys after), None for unbounded. key_valid: (b, k) real (unpadded) keys, or None.
    softcap: ``tanh(s / cap) * cap`` on the scaled scores. sinks: (h,) sink logits (GPT-OSS ``s_aux``).
    bias: additive position bias broadcastable to (b, h, q, k) (T5), sliced per tile. n_sink: how many of the
    first real keys count as the sink. key_sets: name -> (b, k) booleans. pairs: name -> (batch, query, key)
    index tensors, query indices counted among the ``q`` rows. fields: which of ``FIELDS`` to compute (the others
    are None); ``("top_index",)`` alone needs no logsumexp, so it is one pass over the scores. budget: elements of one
    block (default ``_BUDGET``, 2^22; for ``("top_index",)`` alone at most 2^20, with power-of-two query tiles).
    query_offset: the key position of query row 0 (default ``k - q``: the queries are the last of the keys); 0 for
    a cross-attention site, whose queries and keys are different sequences. key_values: name -> (b, h, k) a
    quantity per key and head; the result's ``key_values[name]`` is each row's ``sum_k w_qk x_hk`` (b, h, q).
    """
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ValueError(f"Unknown field(s) {unknown}; attention_stats computes {list(FIELDS)}.")
    want = set(fields)
    budget = _BUDGET if budget is None else budget
    b, h, n_q, d = query.shape
    g, n_k = key.shape[1], key.shape[2]
    if h % g or key.shape[0] != b or key.shape[3] != d:
        raise ValueError(f"attention_stats expects query (b, h, q, d) and key (b, g, k, d) with h a multiple of g; "
                         f"got {tuple(query.shape)} and {tuple(key.shape)}.")
    if n_q > n_k and query_offset is None:
        raise ValueError(f"queries are the last q of the k key positions; got q={n_q} > k={n_k}.")
    device = query.device
    offset = n_k - n_q if query_offset is None else query_offset
    valid = torch.ones(b, n_k, dtype=torch.bool, device=device) if key_valid is None else key_valid.to(device).bool()
    first = valid.int().argmax(dim=1)  # (b,) first real key
    sets = {name: s.to(device).bool() for name, s in (key_sets or {}).items()}
    r = h // g
    # anything that needs the weights, hence the lse
    weighted = bool(want - {"top_index"} or key_sets or pairs or key_values)
    side = int(math.isqrt(budget // (b * h)))
    if not weighted:  # the top-1 adds nothing up across key tiles, so their size cannot change it: smaller blocks,
        budget = min(budget, _TOP_BUDGET)  # which stay in cache, with power-of-two query tiles, run faster
        side = 1 << max(0, int(math.isqrt(budget // (b * h))).bit_length() - 1)
    t_q = max(1, min(n_q, side))
    t_k = max(1, min(n_k, budget // (b * h * t_q)))
    if not weighted and t_q < t_k < n_k:  # key tiles a multiple of query tiles: a prefill's diagonal blocks share
        t_k -= t_k % t_q  # one band (the weighted pass keeps its tiles, hence its sums, as they were)
    q_f = query.float().reshape(b, g, r, n_q, d)
    k_t = key.float().transpose(2, 3).reshape(b * g, d, n_k)  # (b g, d, k), one O(n) copy
    before, after = window
    if causal:
        after = 0 if after is None else min(after, 0)
    padded = not bool(valid.all())
    on_cpu = device.type == "cpu"
    # Blocks live in buffers allocated once per call and are edited in place: fresh blocks of changing sizes would
    # fragment the C allocator's heap, and its peak would grow with n (argmax_from_qk measured +0.85 GiB at 8k).
    buffer = torch.empty(b * h * t_q * t_k, device=device)

    # A block's band (the keys outside the causal triangle or the window) depends only on where the block sits
    # relative to the diagonal; with query and key tiles aligned, every diagonal block shares one.
    bands: dict[tuple[int, int, int], torch.Tensor | None] = {}

    def band(s, e, ks, ke):
        """(t, tk) additive mask, 0 inside the band and -inf outside, or None when the whole block is inside."""
        cut_before = before is not None and ks - (e - 1 + offset) < -before  # only blocks that cross the window's
        cut_after = after is not None and ke - 1 - (s + offset) > after  # edges need masking
        if not (cut_before or cut_after):
            return None
        place = (ks - s - offset, e - s, ke - ks)
        if place not in bands:
            if len(bands) >= 8:
                bands.clear()
            dist = torch.arange(ks, ke, device=device)[None] - (torch.arange(s, e, device=device) + offset)[:, None]
            inside = (dist >= -before) if cut_before else None
            if cut_after:
                inside = dist <= after if inside is None else inside & (dist <= after)
            bands[place] = torch.zeros(inside.shape, device=device).masked_fill_(~inside, float("-inf"))
        return bands[place]

    def fill(scores, q_tile, ks, ke, s, e, mask, exact):
        torch.bmm(q_tile, k_t[:, :, ks:ke], out=scores)
        scores = scores.view(b, h, e - s, ke - ks)  # head h = g * r + j reads key head g
        if scale != 1.0:
            scores.mul_(scale)
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        if bias is not None:
            scores.add_(bias[..., s:e, ks:ke])
        if mask is not None and exact:
            scores.masked_fill_(torch.isinf(mask), float("-inf"))
        elif mask is not None:  # on CPU adding 0 / -inf is 3x faster than masked_fill_, the same on finite scores
            scores.add_(mask)
        if padded:
            scores.masked_fill_(~valid[:, None, None, ks:ke], float("-inf"))
        return scores

    def blocks(s, e):
        """Key tiles a query tile may see: (ks, ke, scores, row max), scores (b, h, t, tk) -inf where masked."""
        lo = 0 if before is None else max(0, s + offset - before)
        hi = n_k if after is None else min(n_k, e + offset + after)
        q_tile = q_f[:, :, :, s:e].reshape(b * g, r * (e - s), d)
        for ks in range(lo, hi, t_k):
            ke = min(hi, ks + t_k)
            out = buffer[: b * h * (e - s) * (ke - ks)].view(b * g, r * (e - s), ke - ks)
            mask = band(s, e, ks, ke)
            scores = fill(out, q_tile, ks, ke, s, e, mask, exact=not on_cpu)
            value = scores.amax(dim=-1)  # (b, h, t); NaN where a row holds NaN
            if on_cpu and mask is not None and bool(value.isnan().any()):  # inf + -inf is NaN, not -inf
                scores = fill(out, q_tile, ks, ke, s, e, mask, exact=True)
                value = scores.amax(dim=-1)
            yield ks, ke, scores, value

    def zeros(*shape):
        return torch.zeros(b, h, n_q, *shape, device=device)

    top_index = torch.full((b, h, n_q), -1, dtype=torch.long, device=device)
    top_weight, sink, entropy, total = zeros(), zeros(), zeros(), zeros()
    offsets = zeros(n_buckets) if "offsets" in want else None
    set_out = {name: zeros() for name in sets}
    set_keys = {name: key_set.float() for name, key_set in sets.items()}  # (b, k)
    value_in = {name: x.to(device).float() for name, x in (key_values or {}).items()}  # (b, h, k)
    value_out = {name: zeros() for name in value_in}
    pair_idx = {name: tuple(t.to(device).long() for t in p) for name, p in (pairs or {}).items()}
    pair_out = {name: torch.zeros(len(p[0]), h, device=device) for name, p in pair_idx.items()}
    sink_logits = None if sinks is None else sinks.float().to(device).reshape(1, h, 1)
    keys = torch.arange(n_k, device=device)
    in_sink = ((keys[None] >= first[:, None]) & (keys[None] < first[:, None] + n_sink)).float()  # (b, k)
    w_buffer = torch.empty_like(buffer) if weighted else None

    def row_sum(w, x):  # (b, h, t, tk) . (b, tk) -> (b, h, t), without a block-sized temporary
        return torch.einsum("bhtk,bk->bht", w, x)

    for s in range(0, n_q, t_q):
        e = min(n_q, s + t_q)
        if lse is not None:
            row_lse = lse[:, :, s:e].float().to(device)
        elif weighted:  # first pass: online logsumexp over the key tiles
            row_lse = torch.full((b, h, e - s), float("-inf"), device=device)
            for _, _, scores, _ in blocks(s, e):
                row_lse = torch.logaddexp(row_lse, torch.logsumexp(scores, dim=-1))
            if sink_logits is not None:
                row_lse = torch.logaddexp(row_lse, sink_logits.expand_as(row_lse))
            row_lse = torch.where(torch.isinf(row_lse), torch.zeros_like(row_lse), row_lse)  # fully masked: 0
        best = torch.full((b, h, e - s), float("-inf"), device=device)
        best_at = torch.full((b, h, e - s), -1, dtype=torch.long, device=device)
        for ks, ke, scores, value in blocks(s, e):
            best = _improve(scores, value, best, best_at, ks)
            if not weighted:
                continue
            log_w = scores.sub_(row_lse[..., None])  # in place: log weights, -inf where masked
            w = torch.exp(log_w, out=w_buffer[: scores.numel()].view_as(scores))
            if "total" in want:
                total[:, :, s:e] += w.sum(-1)
            if "entropy" in want:  # -sum w log w; a masked key's 0 * -inf would be NaN, so clamp log w first
                entropy[:, :, s:e] -= torch.einsum("bhtk,bhtk->bht", w, log_w.clamp_(min=-1e30))
            if offsets is not None:
                dist = torch.arange(ks, ke, device=device)[None] - (torch.arange(s, e, device=device) + offset)[:, None]
                bucket = offset_buckets(dist, n_buckets)  # (t, tk)
                offsets[:, :, s:e].scatter_add_(3, bucket.expand_as(w), w)
            if "sink" in want:
                sink[:, :, s:e] += row_sum(w, in_sink[:, ks:ke])
            for name, key_set in set_keys.items():
                set_out[name][:, :, s:e] += row_sum(w, key_set[:, ks:ke])
            for name, x in value_in.items():
                value_out[name][:, :, s:e] += torch.einsum("bhtk,bhk->bht", w, x[:, :, ks:ke])
            for name, (pb, pq, pk) in pair_idx.items():
                hit = (pq >= s) & (pq < e) & (pk >= ks) & (pk < ke)
                if hit.any():
                    pair_out[name][hit] = w[pb[hit], :, pq[hit] - s, pk[hit] - ks]
        masked = torch.isinf(best)
        top_index[:, :, s:e] = torch.where(masked, -1, best_at)
        if weighted:
            top_weight[:, :, s:e] = torch.where(masked, 0.0, torch.exp(best - row_lse))

    def kept(name, value):
        return value if name in want else None

    return HeadStats(top_index, kept("top_weight", top_weight), kept("sink", sink), offsets,
                     kept("entropy", entropy), kept("total", total), set_out, pair_out, value_out)


def _improve(scores: torch.Tensor, value: torch.Tensor, best: torch.Tensor, best_at: torch.Tensor,
             start: int) -> torch.Tensor:
    """Fold one key tile into each row's running top-1: ``scores (b, h, t, tk)``, ``value (b, h, t)`` its row maxima.
    Updates ``best_at`` in place and returns the new ``best``; ties keep the earlier key, as argmax does.

    On CPU the indices come from the rows that improve only: ``amax`` is about 6x faster than ``max`` with indices,
    and after a row's first tiles few of its later tiles beat it."""
    better = value > best
    if scores.device.type != "cpu":
        best_at.copy_(torch.where(better, scores.max(dim=-1).indices + start, best_at))
        return torch.where(better, value, best)
    rows = better.view(-1).nonzero().squeeze(1)  # (n,) flat (b, h, t) rows that improve
    if len(rows) == better.numel():
        best_at.copy_(scores.max(dim=-1).indices + start)
    elif len(rows):
        at = scores.reshape(-1, scores.shape[-1]).index_select(0, rows).max(dim=-1).indices
        best_at.view(-1).index_copy_(0, rows, at + start)
    return torch.where(better, value, best)
