"""Streaming curves: turn heads into streaming heads (sinks + a recent window, ``interp.stream_heads``) a share at a
time, in the order of a score, and record a metric and the KV-cache memory at each step.

DuoAttention (Xiao et al. 2024) keeps full attention for "retrieval" heads and lets the others stream; the order
here can come from any head score: a retrieval score (``analyses.retrieval_heads``: heads with the lowest score
stream first, i.e. by ``1 - retrieval``), Michel et al.'s importance (least important first), or random orders
(one curve per seed). The order is fixed before the curve starts, as DuoAttention's gates are.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from contextlib import ExitStack

import numpy as np
import pandas as pd
import torch

from interp.streaming import KVHeadsNote, check_streamable, stream_heads, streamable_heads, streaming_kv_bytes

from ..causal.ablation import Head
from ..causal.engine import Shard, _arguments
from ..data.batches import batch_of
from ..data.metrics import as_metric

__all__ = ["streaming_curve", "streaming_order", "streaming_inputs"]

ORDERS = ("importance", "random", "gates")


def streaming_order(model, inputs=None, metric=None, order="random", column: str | None = None,
                    seed: int = 0, sink: int = 4, window: int = 256) -> list[Head]:
    """Every head that can stream (``interp.streaming.streamable_heads``: layers with full attention), the first to
    stream first. order: ``"importance"`` (least important first, from the metric's loss), ``"random"`` (a
    permutation drawn with ``seed``), ``"gates"`` (lowest DuoAttention-style gate first: ``analyses.long.streaming_gates``
    on passkey-like inputs, with this ``sink`` and ``window``) or a DataFrame with ``layer``, ``head`` and a score
    column (``column``; default ``"retrieval"``, or ``"gate"``, when present): lowest score first."""
    heads = streamable_heads(model)
    if isinstance(order, pd.DataFrame):
        if column is None:
            numeric = [c for c in order.select_dtypes("number").columns if c not in ("layer", "head")]
            column = next((c for c in ("retrieval", "gate") if c in order), numeric[0] if len(numeric) == 1 else None)
        if column is None or column not in order or not {"layer", "head"} <= set(order.columns):
            raise ValueError("A score table needs columns layer, head and the score to order by (column=...); got "
                             f"columns {list(order.columns)} and column={column!r}.")
        score = {(int(r.layer), int(r.head)): float(getattr(r, column)) for r in order.itertuples()}
        missing = [h for h in heads if h not in score or math.isnan(score[h])]
        if missing:
            raise ValueError(f"The score table has no {column!r} for {len(missing)} heads, e.g. {missing[:3]}; score "
                             "every head (NaN: a retrieval study where the model answered no trial).")
        return sorted(heads, key=lambda h: (score[h], h))
    if isinstance(order, str) and order == "random":
        return [heads[i] for i in np.random.default_rng(seed).permutation(len(heads))]
    if isinstance(order, str) and order == "importance":
        from ..causal.pruning import head_importance

        if metric is None or inputs is None:
            raise ValueError("order='importance' needs the inputs and a metric (its loss ranks the heads).")
        df = head_importance(model, inputs, loss=metric)
        score = {(r.layer, r.head): r.importance for r in df.itertuples()}
        return sorted(heads, key=lambda h: (score[h], h))
    if isinstance(order, str) and order == "gates":
        from .streaming_gates import streaming_gates

        return streaming_order(model, order=streaming_gates(model, sink=sink, window=window, seed=seed))
    raise ValueError(f"Unknown streaming order {order!r}; use one of {', '.join(ORDERS)} or a score DataFrame with "
                     "layer and head columns (e.g. analyses.retrieval_heads' table).")


def _evaluate(model, batch, metric, heads, sink, window) -> float:
    with Shard(batch, metric) as shard, ExitStack() as stack, torch.no_grad():
        batch, local = shard.rows(batch), shard.metric(metric)
        stack.enter_context(stream_heads(model, heads, sink=sink, window=window))
        args, kwargs = _arguments(batch)
        return shard.means([local(model(*args, **kwargs), batch)])[0]


def streaming_curve(model, inputs, metric, order="random", step: float = 0.1, seeds: Sequence[int] = (0, 1, 2),
                    sink: int = 4, window: int = 256, column: str | None = None, kv_tokens: int | None = None,
                    max_fraction: float = 1.0, higher_is_better: bool | None = None) -> pd.DataFrame:
    """Stream ``step`` of the heads that can stream (``streamable_heads``; all heads but those of sliding-window
    layers) more at a time, in ``order`` (see ``streaming_order``), recording ``metric``.

    Returns one row per step: ``fraction_streaming``, ``heads_streaming``, ``kv_heads_streaming`` (key/value heads
    all of whose query heads stream: the ones whose cache shrinks), ``metric``, ``kv_bytes`` (what a
    ``StreamingCache`` holds for one row of ``kv_tokens`` tokens, default the inputs' length), ``kv_fraction``
    (of full attention's), ``order`` (``"random"``, ``"importance"`` or the score column) and ``seed``.
    """
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not 0 < step <= 1:
        raise ValueError(f"step is the share of all heads streamed more at each step, in (0, 1]; got {step!r}.")
    if isinstance(max_fraction, bool) or not isinstance(max_fraction, (int, float)) or not 0 < max_fraction <= 1:
        raise ValueError(f"max_fraction is the share of heads after which the curve stops, in (0, 1]; got "
                         f"{max_fraction!r}.")
    metric = as_metric(metric, higher_is_better)
    batch = batch_of(model, inputs)
    tokens = batch["input_ids"].shape[1] if kv_tokens is None else kv_tokens
    full = streaming_kv_bytes(model, [], tokens, sink, window)  # a clear error for a bad sink, window or model
    heads = check_streamable(model, "streaming_curve")
    per_step = max(1, round(step * len(heads)))
    stop = math.floor(max_fraction * len(heads) + 1e-9)
    name = column or (next((c for c in ("retrieval", "gate") if c in order), None) if isinstance(order, pd.DataFrame)
                      else None)
    rows = []
    with model.studying(), warnings.catch_warnings():
        warnings.simplefilter("ignore", KVHeadsNote)  # the table's kv_heads_streaming says it at every step
        if isinstance(order, str) and order == "random":
            if not len(seeds):
                raise ValueError("order='random' needs at least one seed.")
            runs = [(s, streaming_order(model, batch, metric, "random", seed=s)) for s in seeds]
        else:
            runs = [(None, streaming_order(model, batch, metric, order, column, sink=sink, window=window))]
        for seed, ranked in runs:
            counts = sorted({0, *range(per_step, stop, per_step), stop})
            for n in counts:
                chosen = ranked[:n]
                kv = streaming_kv_bytes(model, chosen, tokens, sink, window)
                with stream_heads(model, chosen, sink=sink, window=window) as s:
                    n_kv = len(s.kv_heads)
                rows.append({"fraction_streaming": n / len(heads), "heads_streaming": n, "kv_heads_streaming": n_kv,
                             "metric": _evaluate(model, batch, metric, chosen, sink, window), "kv_bytes": kv,
                             "kv_fraction": kv / full, "order": name or str(order), "seed": seed})
    df = pd.DataFrame(rows)
    df["seed"] = df["seed"].astype("Int64")
    df.attrs.update(metric=metric.name, sink=sink, window=window, kv_tokens=tokens)
    return df


def streaming_inputs(model, tokens: int, rows: int = 4, seed: int = 0):
    """Long inputs for a streaming curve, ``(ids (rows, tokens), metric, description)``: with a tokenizer, rows of
    the project's sentences (each row a fresh order, no sentence twice in a row until all are used) and the
    next-token loss; without one, ``[BOS, x, x]`` repeated random tokens (``tokens`` or one fewer) and the second
    copy's loss (only heads that see ``len(x)`` tokens back can copy)."""
    from ..data.metrics import lm_loss, second_copy_loss
    from ..data.prompts import haystack
    from ..data.toy import repeated_sequences

    limit = model.cfg.max_positions
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 8 <= tokens <= (limit or tokens):
        raise ValueError(f"tokens must be an integer in [8, {limit}] (the model's positions); got {tokens!r}.")
    g = torch.Generator().manual_seed(seed)
    if model.tokenizer is not None:
        ids = torch.tensor([haystack(model.tokenizer, tokens, g) for _ in range(rows)])
        return ids, lm_loss, f"{rows} rows of {tokens} tokens of the project's sentences, next-token loss"
    bos = model.hf.config.bos_token_id
    half = (tokens - (bos is not None)) // 2
    ids = repeated_sequences(rows, half, model.cfg.vocab_size, g, bos)
    return ids, second_copy_loss, (f"{rows} repeated random sequences [BOS, x, x] of {ids.shape[1]} tokens "
                                   f"(len(x) = {half})")
