"""Head scores: one definition per score, read either from a pattern or from q, k and the logsumexp.

Every weight score is a set of (prompt, query, key) index triples, its *pairs*: a query row's score is
the sum of its weights on its keys, and a head's score is the mean over the rows that have at least one
pair, pooled over prompts (rows without a target are left out rather than counted as 0). The weights
come from an n x n pattern (eager path, or a pattern given by hand) or, on the flash path, one at a
time as ``exp(scale * q_i . k_j - lse_i)``: O(number of pairs) memory, never n x n.

Scores (definitions in shared/REFERENCE.md):

- ``previous_token`` (Olsson et al. 2022): weight i -> i-1; ``next_token`` i -> i+1 (encoders only).
- ``self``: weight i -> i. ``sink`` (Gu et al. 2024): weight on the first token of the sequence.
- ``duplicate_token``: total weight on earlier occurrences of the query's token.
- ``induction`` (Olsson et al. 2022): total weight on the tokens right after earlier occurrences of
  the query's token; rows whose token did not occur earlier have no target and are not counted.
- ``positional`` (Voita et al. 2019): ``positional_offset`` is the key - query offset that holds the
  row's largest weight most often, ``positional_fraction`` the fraction of rows where it does.

The rows of a causal model's first real position are left out of ``self``, ``sink`` and
``positional``: that row can only attend to itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pandas as pd
import torch

from interp.stats import attention_stats

from .labels import (DEFAULT_THRESHOLDS, KINDS, LABEL_ORDER, SCORE_DEFINITIONS, TAXONOMY_SCORES,  # noqa: F401
                     WEIGHT_SCORES, choose_scores, head_labels, label_heads, resolve_thresholds, strongest_heads)
from .bootstrap import check_n_bootstrap

__all__ = ["WEIGHT_SCORES", "KINDS", "DEFAULT_THRESHOLDS", "LABEL_ORDER", "SCORE_DEFINITIONS", "pattern_scores",
           "label_heads", "head_labels", "strongest_heads"]

_PAIR_CHUNK = 1 << 22  # elements of one gathered (pairs, head, d_head) block on the flash path


@dataclass
class Pairs:
    """Index triples ``(b, q, k)``, each ``(n_pairs,)``, and the rows they cover per prompt: ``(batch,)``."""

    b: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    rows: torch.Tensor


@dataclass
class Targets:
    """What each score reads in one padded batch; built from the tokens alone, shared by all layers.

    valid: (b, p) real tokens. pairs: score -> Pairs. positional_rows: (b, p) rows of the argmax.
    """

    valid: torch.Tensor
    causal: bool
    pairs: dict[str, Pairs]
    positional_rows: torch.Tensor | None


def _pairs(b, q, k, n_batch: int, n_pos: int) -> Pairs:
    row_ids = torch.unique(b * n_pos + q)
    rows = torch.bincount(row_ids // n_pos, minlength=n_batch)
    return Pairs(b, q, k, rows)


def _earlier_occurrences(input_ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every (b, i, j) with j < i, both real and ``input_ids[b, j] == input_ids[b, i]``.

    Sorting groups equal tokens, so memory is O(number of such pairs), not O(p^2).
    """
    n_batch, n_pos = input_ids.shape
    flat = valid.flatten().nonzero().squeeze(1)  # (r,) real positions in (b, p) order
    key = (flat // n_pos) * (int(input_ids.max()) + 1) + input_ids.flatten()[flat]
    order = torch.argsort(key, stable=True)  # groups of equal (b, token), positions ascending inside
    _, counts = torch.unique_consecutive(key[order], return_counts=True)
    start = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)  # (r,) group start per rank
    n_earlier = torch.arange(len(order)) - start
    query_rank = torch.repeat_interleave(torch.arange(len(order)), n_earlier)  # (n_pairs,)
    first_pair = torch.cumsum(n_earlier, 0) - n_earlier
    key_rank = start[query_rank] + torch.arange(len(query_rank)) - first_pair[query_rank]
    query_pos, key_pos = flat[order[query_rank]], flat[order[key_rank]]
    return query_pos // n_pos, query_pos % n_pos, key_pos % n_pos


def build_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, causal: bool,
                  kinds: Iterable[str]) -> Targets:
    """The pairs of each score in ``kinds`` for a batch ``input_ids: (b, p)`` with padding mask ``(b, p)``."""
    input_ids = input_ids.cpu()
    n_batch, n_pos = input_ids.shape
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.cpu().bool()
    pos = torch.arange(n_pos)
    first = valid.int().argmax(dim=1)  # (b,) first real position
    rows = valid & ~(causal & (pos[None] == first[:, None]))  # rows that are not forced
    kinds = set(kinds)
    pairs: dict[str, Pairs] = {}

    def shifted(shift: int) -> Pairs:
        ok = torch.zeros_like(valid)
        if shift < 0:
            ok[:, -shift:] = valid[:, -shift:] & valid[:, :shift]
        else:
            ok[:, :-shift] = valid[:, :-shift] & valid[:, shift:]
        b, q = ok.nonzero(as_tuple=True)
        return _pairs(b, q, q + shift, n_batch, n_pos)

    if "previous_token" in kinds:
        pairs["previous_token"] = shifted(-1)
    if "next_token" in kinds:
        pairs["next_token"] = shifted(1)
    b, q = rows.nonzero(as_tuple=True)
    if "self" in kinds:
        pairs["self"] = _pairs(b, q, q, n_batch, n_pos)
    if "sink" in kinds:
        pairs["sink"] = _pairs(b, q, first[b], n_batch, n_pos)
    if kinds & {"duplicate_token", "induction"}:
        b, q, k = _earlier_occurrences(input_ids, valid)
        if "duplicate_token" in kinds:
            pairs["duplicate_token"] = _pairs(b, q, k, n_batch, n_pos)
        if "induction" in kinds:
            nxt = k + 1
            keep = (nxt < n_pos) & valid[b, nxt.clamp(max=n_pos - 1)]  # causal: nxt <= q since k < q
            pairs["induction"] = _pairs(b[keep], q[keep], nxt[keep], n_batch, n_pos)
    return Targets(valid, causal, pairs, rows if "positional" in kinds else None)


# -- reading weights -------------------------------------------------------------------------------------
def weights_from_pattern(pattern: torch.Tensor, pairs: Pairs) -> torch.Tensor:
    """pattern: (b, h, q, k) -> the weight of every pair in every head: (n_pairs, h)."""
    return pattern[pairs.b, :, pairs.q, pairs.k]


def weights_from_qk(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scaling: float, pairs: Pairs,
                    softcap: float | None = None, window: tuple[int | None, int | None] = (None, None)) -> torch.Tensor:
    """``exp(cap(scaling * q_i . k_j) - lse_i)`` for every pair, in fp32: (n_pairs, h).

    q: (b, p, h, d) after RoPE; k: (b, p, g, d) with head h reading key/value head h // (h / g);
    lse: (b, h, q) logsumexp of the scaled, capped, masked scores (a sink included). softcap: the layer's logit
    soft-cap; window: (keys before, keys after) the query the layer may see: pairs outside it weigh 0.
    """
    n_heads, n_kv, d_head = q.shape[2], k.shape[2], q.shape[3]
    b, qi, kj = pairs.b.to(q.device), pairs.q.to(q.device), pairs.k.to(q.device)
    step = max(1, _PAIR_CHUNK // (n_heads * d_head))
    out = []
    for s in range(0, len(b), step):
        bb, ii, jj = b[s:s + step], qi[s:s + step], kj[s:s + step]
        qs = q[bb, ii].float().unflatten(1, (n_kv, n_heads // n_kv))  # (n, g, r, d)
        dots = torch.einsum("ngrd,ngd->ngr", qs, k[bb, jj].float()).flatten(1) * scaling  # (n, h)
        if softcap is not None:
            dots = torch.tanh(dots / softcap) * softcap
        w = torch.exp(dots - lse[bb, :, ii].float())
        out.append(w * _in_window(ii, jj, window)[:, None])
    return torch.cat(out) if out else torch.zeros(0, n_heads, device=q.device)


def _in_window(qi: torch.Tensor, kj: torch.Tensor, window: tuple[int | None, int | None]) -> torch.Tensor:
    """1.0 where key kj lies inside query qi's window of keys, else 0.0."""
    before, after = window
    inside = torch.ones_like(qi, dtype=torch.bool)
    if before is not None:
        inside &= kj >= qi - before
    if after is not None:
        inside &= kj <= qi + after
    return inside.float()


def argmax_from_pattern(pattern: torch.Tensor, targets: Targets, window=(None, None)) -> torch.Tensor:
    """Key index of each row's largest allowed weight: (b, h, q)."""
    allowed = _allowed(targets, 0, pattern.shape[2], pattern.device, window)
    return pattern.masked_fill(~allowed, -1.0).argmax(dim=-1)


def argmax_from_qk(q: torch.Tensor, k: torch.Tensor, targets: Targets, window=(None, None)) -> torch.Tensor:
    """The same from q (b, p, h, d) and k (b, p, g, d): ``interp.stats``'s top-1 key, one tile of the scores at a
    time (O(p) memory). The scale, the soft-cap and the logsumexp do not move a row's argmax, so raw dot products
    suffice."""
    stats = attention_stats(q.transpose(1, 2), k.transpose(1, 2), 1.0, causal=targets.causal, window=window,
                            key_valid=targets.valid, fields=("top_index",))
    return stats.top_index.clamp(min=0)  # a row with no key to see (padding) is never a positional row


def _band(start: int, end: int, n_keys: int, causal: bool, window, device) -> torch.Tensor:
    """(end - start, n_keys): keys that rows start..end-1 may see (causal, and within the layer's window)."""
    offset = torch.arange(n_keys, device=device)[None] - torch.arange(start, end, device=device)[:, None]
    before, after = window
    after = 0 if causal and after is None else after
    inside = torch.ones_like(offset, dtype=torch.bool)
    if before is not None:
        inside &= offset >= -before
    if after is not None:
        inside &= offset <= after
    return inside


def _allowed(targets: Targets, start: int, end: int, device, window=(None, None)) -> torch.Tensor:
    """(b, 1, end - start, p): which keys the query rows start..end-1 may attend to."""
    valid = targets.valid.to(device)
    n_pos = valid.shape[1]
    allowed = valid[:, None, None, :].expand(-1, 1, end - start, n_pos)
    return allowed & _band(start, end, n_pos, targets.causal, window, device)


# -- accumulating over batches and layers ----------------------------------------------------------------
class Tally:
    """Per-prompt sums ``(prompt, layer, head)`` and row counts ``(prompt,)`` of each weight score, and the
    positional histogram ``(layer, head, 2 * max_len - 1)`` of row-argmax offsets.

    heads_per_layer: each layer's head count (a pruned model has fewer heads in some layers).
    """

    def __init__(self, kinds: Iterable[str], n_prompts: int, heads_per_layer: tuple[int, ...], max_len: int):
        self.kinds = [k for k in KINDS if k in set(kinds)]
        self.max_len = max_len
        self.heads_per_layer = tuple(heads_per_layer)
        n_layers, n_heads = len(self.heads_per_layer), max(self.heads_per_layer)
        self.sums = {s: torch.zeros(n_prompts, n_layers, n_heads, dtype=torch.float64)
                     for s in self.kinds if s in WEIGHT_SCORES}
        self.rows = {s: torch.zeros(n_prompts, dtype=torch.int64) for s in self.sums}
        self.hist = torch.zeros(n_layers, n_heads, 2 * max_len - 1, dtype=torch.int64) if "positional" in self.kinds else None

    def add_rows(self, index: torch.Tensor, targets: Targets) -> None:
        """Count the rows of one batch whose prompts sit at ``index: (b,)``; once per batch."""
        for s in self.sums:
            self.rows[s][index] = targets.pairs[s].rows

    def add_layer(self, layer: int, index: torch.Tensor, targets: Targets,
                  weights: Callable[[Pairs], torch.Tensor], argmax: Callable[[], torch.Tensor]) -> None:
        """Add one layer of one batch: ``weights(pairs) -> (n_pairs, h)``, ``argmax() -> (b, h, q)``."""
        if self.sums:  # one gather for the pairs of every score, then split
            scores = list(self.sums)
            parts = [targets.pairs[s] for s in scores]
            joined = Pairs(*(torch.cat([getattr(p, f) for p in parts]) for f in ("b", "q", "k")), rows=None)
            w = weights(joined).double().cpu()  # (n_pairs, h)
            for s, p, ws in zip(scores, parts, w.split([len(p.b) for p in parts])):
                per_prompt = torch.zeros(len(index), w.shape[1], dtype=torch.float64).index_add_(0, p.b, ws)
                self.sums[s][index, layer, : w.shape[1]] = per_prompt
        if self.hist is not None:
            key = argmax().cpu()  # (b, h, q)
            b, q = targets.positional_rows.nonzero(as_tuple=True)
            offset = key[b, :, q] - q[:, None] + self.max_len - 1  # (rows, h)
            n_heads, width = key.shape[1], self.hist.shape[2]
            flat = (torch.arange(n_heads)[None] * width + offset).flatten()
            self.hist[layer, :n_heads] += torch.bincount(flat, minlength=n_heads * width).view(n_heads, width)

    def frame(self, n_bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
        """One row per (layer, head): each score, positional offset and fraction, and bootstrap 95% intervals
        over prompts (percentile method, prompts resampled with replacement) for the weight scores."""
        check_n_bootstrap(n_bootstrap)
        n_heads = max(self.heads_per_layer)
        exists = torch.tensor([[h < n for h in range(n_heads)] for n in self.heads_per_layer]).flatten()
        layer = torch.tensor([l for l, n in enumerate(self.heads_per_layer) for _ in range(n)])
        head = torch.tensor([h for n in self.heads_per_layer for h in range(n)])
        columns: dict[str, object] = {"layer": layer.numpy(), "head": head.numpy()}
        intervals = {}
        weights = None
        for s, sums in self.sums.items():
            n_prompts = sums.shape[0]
            if weights is None:
                g = torch.Generator().manual_seed(seed)
                draws = torch.randint(n_prompts, (n_bootstrap, n_prompts), generator=g)
                weights = torch.zeros(n_bootstrap, n_prompts, dtype=torch.float64).scatter_add_(
                    1, draws, torch.ones(n_bootstrap, n_prompts, dtype=torch.float64))
            flat, rows = sums.flatten(1)[:, exists], self.rows[s].double()
            columns[s] = _ratio(flat.sum(0), rows.sum()).numpy()
            boot = _ratio(weights @ flat, (weights @ rows)[:, None])  # (n_bootstrap, l * h)
            lo_hi = torch.nanquantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=0)
            intervals[f"{s}_lo"], intervals[f"{s}_hi"] = lo_hi[0].numpy(), lo_hi[1].numpy()
        if self.hist is not None:
            hist = self.hist.flatten(0, 1)[exists]
            total = hist.sum(-1).double()
            best = hist.max(-1)
            columns["positional_offset"] = (best.indices - (self.max_len - 1)).numpy()
            columns["positional_fraction"] = _ratio(best.values.double(), total).numpy()
        return pd.DataFrame({**columns, **intervals})


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, NaN where den is 0 (no row had a target)."""
    return torch.where(den > 0, num / den.clamp(min=1), torch.nan)


# -- scores of a given pattern ---------------------------------------------------------------------------
def pattern_scores(pattern: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   causal: bool = True, kinds: Iterable[str] | None = None,
                   thresholds: dict[str, float] | None = None, n_bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Scores of a given attention pattern, one row per head (``layer`` is 0), as ``detect_heads`` reports them.

    pattern: (batch, head, query, key); input_ids and attention_mask: (batch, pos), the tokens the
    pattern was computed on (they define the previous token, earlier occurrences and padding).

    >>> ids = torch.tensor([[5, 6, 7, 5, 6, 7]])
    >>> shifted = torch.eye(6).roll(-1, dims=1).tril()[None, None]  # row i -> i-1 (row 0 -> itself)
    >>> shifted[0, 0, 0, 0] = 1.0
    >>> df = pattern_scores(shifted, ids)
    >>> float(df.previous_token[0]), float(df.induction[0]), df.label[0]
    (1.0, 0.0, 'previous_token')
    """
    kinds = check_kinds(kinds, causal)
    if pattern.ndim != 4 or pattern.shape[0] != input_ids.shape[0] or pattern.shape[2:] != (input_ids.shape[1],) * 2:
        raise ValueError(
            f"pattern must be (batch, head, pos, pos) matching input_ids {tuple(input_ids.shape)}; got {tuple(pattern.shape)}."
        )
    targets = build_targets(input_ids, attention_mask, causal, kinds)
    tally = Tally(kinds, input_ids.shape[0], (pattern.shape[1],), input_ids.shape[1])
    index = torch.arange(input_ids.shape[0])
    tally.add_rows(index, targets)
    tally.add_layer(0, index, targets, lambda pairs: weights_from_pattern(pattern, pairs),
                    lambda: argmax_from_pattern(pattern, targets))
    df = tally.frame(n_bootstrap, seed)
    return order_columns(df.assign(label=label_heads(df, thresholds), labels=head_labels(df, thresholds)))


def check_kinds(kinds: Iterable[str] | None, causal: bool) -> list[str]:
    """The requested attention-pattern score kinds in canonical order; None means all that apply to the model.
    Unknown names are refused with the closest valid ones (``labels.choose_scores``)."""
    chosen = choose_scores(kinds, "causal" if causal else "bidirectional")
    other = chosen["taxonomy"] + chosen["retrieval"]
    if other:
        raise ValueError(f"The score(s) {other} are read from the model, not from a given pattern: ask "
                         f"detect_heads(model, scores=...) for them; a pattern's scores are {list(KINDS)}.")
    return chosen["pattern"]


def order_columns(df: pd.DataFrame) -> pd.DataFrame:
    """layer, head, the scores, positional_offset/fraction, label, then the interval columns."""
    scores = WEIGHT_SCORES + TAXONOMY_SCORES
    main = ["layer", "head", *[s for s in scores if s in df], "positional_offset", "positional_fraction", "retrieval",
            "label", "labels"]
    intervals = [f"{s}_{end}" for s in (*scores, "retrieval") for end in ("lo", "hi")]
    main, intervals = [c for c in main if c in df], [c for c in intervals if c in df]
    return df[main + intervals + [c for c in df if c not in main + intervals]]
