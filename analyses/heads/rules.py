"""The target rules of interp's own head scores (``analyses.heads.registry``): for each query position, the key position
a head of that class attends to. Each takes the unpadded tokens of the query side (``ids: (b, q)``) and, for
cross-attention, of the key side (``key_ids: (b, k)``), and returns a ``(b, q)`` LongTensor (-1: no target) or a
``(batch, query, key)`` triple of index tensors for rows with several targets. A user's score is a function of the
same form (``analyses.head_score``). Either form holds integer positions (a float tensor is refused), and a pair
listed twice is one target (``analyses.heads.scores._as_triple`` applies both to every rule)."""

from __future__ import annotations

import torch


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)


def previous_token(ids: torch.Tensor) -> torch.Tensor:
    """Position i attends to i - 1 (Olsson et al. 2022)."""
    return _positions(ids) - 1  # row 0: -1, no target


def next_token(ids: torch.Tensor) -> torch.Tensor:
    """Position i attends to i + 1 (bidirectional heads)."""
    after = _positions(ids) + 1
    return after.masked_fill(after >= ids.shape[1], -1)


def self_target(ids: torch.Tensor) -> torch.Tensor:
    """Position i attends to itself."""
    return _positions(ids).clone()


def sink(ids: torch.Tensor) -> torch.Tensor:
    """Every position attends to the first token (Gu et al. 2024)."""
    return torch.zeros_like(ids, dtype=torch.long)


def earlier_occurrences(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every ``(b, i, j)`` with ``j < i`` and ``ids[b, j] == ids[b, i]``. Sorting groups equal tokens, so memory is
    O(number of such pairs), not O(p^2)."""
    n_batch, n_pos = ids.shape
    flat_ids = ids.flatten().long()
    key = torch.arange(n_batch * n_pos, device=ids.device) // n_pos * (int(flat_ids.max()) + 1) + flat_ids
    order = torch.argsort(key, stable=True)  # groups of equal (b, token), positions ascending inside
    _, counts = torch.unique_consecutive(key[order], return_counts=True)
    start = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)  # (r,) group start per rank
    n_earlier = torch.arange(len(order), device=ids.device) - start
    query_rank = torch.repeat_interleave(torch.arange(len(order), device=ids.device), n_earlier)
    first_pair = torch.cumsum(n_earlier, 0) - n_earlier
    key_rank = start[query_rank] + torch.arange(len(query_rank), device=ids.device) - first_pair[query_rank]
    query_pos, key_pos = order[query_rank], order[key_rank]
    return query_pos // n_pos, query_pos % n_pos, key_pos % n_pos


def duplicate_token(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Position i attends to the earlier occurrences of its own token."""
    return earlier_occurrences(ids)


def induction(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Position i attends to the tokens right after the earlier occurrences of its own token (Olsson et al. 2022)."""
    b, q, k = earlier_occurrences(ids)
    return b, q, k + 1  # k < q, so k + 1 <= q: always a position the query sees


def alignment(ids: torch.Tensor, key_ids: torch.Tensor) -> torch.Tensor:
    """Target position i attends to source position i (on a copy task: the token being copied)."""
    at = _positions(ids).clone()
    return at.masked_fill(at >= key_ids.shape[1], -1)


def source_sink(ids: torch.Tensor, key_ids: torch.Tensor) -> torch.Tensor:
    """Every target position attends to source position 0."""
    return torch.zeros_like(ids, dtype=torch.long)
