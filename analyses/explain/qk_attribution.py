"""Why a head attends where it does: the exact attribution of its attention scores to upstream components on the
query side and on the key side (``qk_attribution``), with a causal check built in (``analyses.explain.qk_causal``).

For a head and a (query i, key j) pair, the score ``scale * q_i . k_j`` (before soft-cap and mask; T5's position
bias is its own term) is a bilinear form of the residual streams at i and j once every norm's scale is frozen at
this run's value (``analyses.explain.qk_parts``), so it splits exactly into ``sum over (a, c) of scale * Q_a(i) . K_c(j)``,
``a`` a component of the stream at i (the embedding, each upstream head, each MLP, biases), ``c`` one at j
(cross-attention: the encoder's components, through its final norm). Circuit-tracer freezes attention; its users
ask for this (its issue 53). An induction head attends to the token after an earlier copy because a previous-token
head wrote into that key: the key side of the split says so, per prompt and pair, and the causal check removes
those heads from the key path only and measures the attention lost, against random heads of the same layers.
"""

from __future__ import annotations

import math
import operator

import torch

import pandas as pd

from hooks.names import hook_name
from interp.attention.sites import FRONT, check_heads, head_columns, site_of
from interp.attention.stats import attention_stats
from interp.runtime.progress import progress, stage

from ..heads import registry
from ..data.batches import batch_of, check_position
from ..heads.labels import site_kind
from ..heads.registry import HeadScore
from ..heads.scores import rule_pairs
from .qk_parts import Record, Rows, key_prefix, prefix_of, run_until, side_vectors

__all__ = ["qk_attribution", "target_rule"]

COLUMNS = ["component", "label", "source_stack", "source_site", "source_layer", "source_head", "query", "key",
           "total"]


def target_rule(name_or_rule) -> HeadScore:
    """A target-rule score of the registry by name (``"previous_token"``, ``"induction"``, a user's
    ``analyses.head_score``), or a callable ``rule(ids) -> (b, p)`` key positions (-1: none) taken as one."""
    if callable(name_or_rule):
        return HeadScore("rule", "a given target rule", rule=name_or_rule, threshold=None,
                         sites=("causal", "bidirectional", "cross"))
    record = registry.score(name_or_rule)
    if record.how != "target":
        raise ValueError(f"pairs={name_or_rule!r} is a {record.how} score, not a target rule; give one of "
                         f"{list(registry.names(('target',)))}, 'top1', a list of (batch, query, key) triples, or a "
                         "callable rule(ids) -> (batch, pos) key positions.")
    return record


# -- pairs ---------------------------------------------------------------------------------------------------------
def _masks(model, batch, site) -> tuple[torch.Tensor, torch.Tensor]:
    """Real query rows ``(b, q)`` and real keys ``(b, k)`` of a site, as booleans on the CPU."""
    out = []
    for entry, mask in ((site.queries, site.query_mask), (site.keys, site.key_mask)):
        ids = batch[entry]
        m = batch.get(mask)
        out.append(torch.ones(ids.shape, dtype=torch.bool) if m is None else m.bool().cpu())
    return out[0], out[1]


def _visible(site, i: int, j: int) -> bool:
    if site.kind == "cross":
        return True
    if site.causal and j > i:
        return False
    before, after = site.window if site.window is not None else (None, None)
    return (before is None or j >= i - before) and (after is None or j <= i + after)


def _explicit(model, batch, site, pairs) -> list[tuple[int, int, int]]:
    q_ok, k_ok = _masks(model, batch, site)
    n_b, n_q, n_k = q_ok.shape[0], q_ok.shape[1], k_ok.shape[1]
    out = []
    for pair in pairs:
        try:
            values = [operator.index(v) for v in pair]
        except TypeError:
            values = None
        if values is None or len(values) not in (2, 3) or (len(values) == 2 and n_b != 1):
            form = "(batch, query, key) triples" + (" or (query, key) pairs" if n_b == 1 else "")
            raise ValueError(f"pairs are {form} of integer positions; got {pair!r}. (query, key) pairs name the "
                             "batch's only sequence: with several, give the batch row first.")
        b, i, j = values if len(values) == 3 else (0, *values)
        i, j = i + n_q if i < 0 else i, j + n_k if j < 0 else j
        if not (0 <= b < n_b and 0 <= i < n_q and 0 <= j < n_k):
            raise ValueError(f"pair {pair!r} is out of range: batch rows 0..{n_b - 1}, queries 0..{n_q - 1}, keys "
                             f"0..{n_k - 1} (negative positions count from the end).")
        if not (q_ok[b, i] and k_ok[b, j]):
            raise ValueError(f"pair {pair!r} is on a padded position of batch row {b}; give real positions (the "
                             "mask's ones; left-padded rows start later).")
        if not _visible(site, i, j):
            raise ValueError(f"pair {pair!r}: {site.name} cannot attend from query {i} to key {j} (causal mask or "
                             f"window {site.window}); its score is masked, so there is nothing to explain.")
        out.append((b, i, j))
    return out


def _from_rule(model, batch, site, record: HeadScore) -> list[tuple[int, int, int]]:
    """The pairs of a target rule at one site: the rule runs on each prompt's real tokens (``scores.rule_pairs``),
    and a pair the site cannot see (outside its window) is left out."""
    if not record.applies_to(site_kind(site)):
        raise ValueError(f"The target rule {record.name!r} applies to {', '.join(record.sites)} sites; {site.name} is "
                         f"a {site_kind(site)} site. Give explicit (batch, query, key) pairs or 'top1'.")
    q_ok, k_ok = _masks(model, batch, site)
    found = rule_pairs(record, batch[site.queries].cpu(), q_ok, batch[site.keys].cpu(), k_ok, site.causal,
                       model.tokenizer)
    return [(b, i, j) for b, i, j in zip(found.b.tolist(), found.q.tolist(), found.k.tolist()) if _visible(site, i, j)]


def _top1(model, batch, heads, queries) -> dict:
    """Each real query row's top-1 key per head, from q and k with ``interp.attention.stats`` (O(n) memory): one forward."""
    sites = {site_of(model, h).name: site_of(model, h) for h in heads}
    held, bias = {}, {}

    def hold(t, hook):
        held[hook.name] = t.detach()
        site = hook.name.rsplit(".", 1)[0]
        b = model._layer_hooks[site].bias
        bias[site] = None if b is None else b.detach()

    run_until(model, batch, [([hook_name(x, s) for s in sites for x in ("q", "k")], hold)], sites.values())
    out = {}
    for head in heads:
        site = site_of(model, head)
        q, k = held[hook_name("q", site.name)][:, :, head[1]:head[1] + 1], held[hook_name("k", site.name)]
        group = site.n_heads // site.n_kv_heads
        k = k[:, :, head[1] // group: head[1] // group + 1]
        q_ok, k_ok = _masks(model, batch, site)
        b = bias[site.name]
        stats = attention_stats(q.transpose(1, 2), k.transpose(1, 2), site.scale, causal=site.causal and
                                site.kind == "self", window=site.window or (None, None),
                                key_valid=k_ok.to(q.device), softcap=site.softcap,
                                bias=None if b is None else b[:, head[1]:head[1] + 1], fields=("top_index",))
        top = stats.top_index[:, 0].cpu()  # (b, q)
        rows = q_ok & (top >= 0)
        if queries is not None:
            chosen = torch.zeros_like(rows)
            chosen[:, _query_rows(queries, rows.shape[1])] = True
            rows &= chosen
        out[head] = [(b_, i, int(top[b_, i])) for b_, i in rows.nonzero().tolist()]
    return out


def _query_rows(queries, n_q: int) -> list[int]:
    """``queries=`` as query positions: integers in ``[-n_q, n_q)`` (negative count from the end), never wrapped."""
    if isinstance(queries, torch.Tensor):
        queries = queries.tolist()
    if not isinstance(queries, (list, tuple, range)) or not len(queries):
        raise ValueError(f"queries is a non-empty list of query positions; got {queries!r}.")
    return [check_position(i, n_q, f"each of queries ({n_q} query positions)") for i in queries]


def _pairs(model, batch, heads, pairs, queries) -> dict:
    if isinstance(pairs, str) and pairs == "top1":
        return _top1(model, batch, heads, queries)
    if queries is not None:
        raise ValueError("queries= restricts pairs='top1' to some query rows; with other pairs leave it out.")
    if isinstance(pairs, str) or callable(pairs):
        record = target_rule(pairs)
        return {h: _from_rule(model, batch, site_of(model, h), record) for h in heads}
    if isinstance(pairs, torch.Tensor):
        pairs = pairs.tolist()
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise ValueError("pairs is 'top1', a target rule ('previous_token', 'induction' or a callable rule(ids)), or "
                         f"a non-empty list of (batch, query, key) triples; got {pairs!r}.")
    return {h: _explicit(model, batch, site_of(model, h), pairs) for h in heads}


# -- the study -----------------------------------------------------------------------------------------------------
def qk_attribution(model, inputs, heads, pairs="top1", *, queries=None, causal: bool = True, top: int = 3,
                   draws: int = 20, seed: int = 0) -> pd.DataFrame:
    """Each upstream component's share of a head's attention scores, on the query and on the key side, exactly.

    heads: ``(layer, head)`` or ``(site, head)`` pairs (``interp.attention.sites.check_heads``). pairs: which scores to explain:

    - a list of ``(batch, query, key)`` triples (``(query, key)`` for a batch of one), positions of the padded batch;
    - ``"top1"``: every real query row's top-1 key (from q and k in O(n) memory), ``queries=[...]`` to keep some rows
      (positions in ``[-p, p)``, negative from the end; any other is refused, never wrapped);
    - a target rule: a callable ``rule(ids (b, p)) -> (b, p)`` key positions, -1 where a row has none, or the name of
      a built-in one, ``"previous_token"`` or ``"induction"`` (pairs it gives that are masked or padded are dropped).

    The score of a pair is ``scale * q_i . k_j`` as the kernel computes it, before the soft-cap and the mask, plus
    T5's position bias as its own term. Norm scales (input norms, q/k norms, post-attention norms, an encoder's
    final norm) are frozen at this run's values: the split is exact for this forward and linear in each component,
    the frozen scales being the forward's own. Its terms sum to the score within float error on every supported
    family and on both attention paths (``df.attrs["pairs"]`` lists score, sum and error per pair): about 1e-6 of
    the score in float32; in bfloat16 the run rounds q and k themselves, so about 1e-2 (the terms are float64).

    Returns one row per (head, component): the head's columns (``stack``, ``kind``, ``site``, ``layer``, ``head``),
    ``component`` (``embed``, ``pos_embed``, ``head``, ``mlp``, ``out_bias``, ``qk_bias``), ``label`` (``L3H1``,
    ``mlp2``, ``enc.L1H0``...), the component's ``source_*`` columns, ``query`` (its query-side term: ``scale *
    Q_a . k``, NaN if it is not on that side), ``key`` (``scale * q . K_c``) and ``total`` (both sides summed, the
    per-upstream-head marginal), each averaged over the pairs. ``df.attrs``: ``pairs`` (records per pair: score,
    explained, error, position bias, attention weight), ``matrices`` (per head the mean (query component x key
    component) matrix: rows, cols, values), ``causal`` (with ``causal=True``: ``analyses.explain.qk_causal``'s records,
    the drop of attention on the pairs when the ``top`` upstream heads of each side are removed from that side's
    path, and when ``top`` random heads of the same layers are, ``draws`` times).

    Memory: the residual components at the positions the pairs use (``components x positions x d_model``), plus
    one forward; never an n x n matrix (T5 alone builds its own position bias).
    """
    heads = check_heads(model, heads)
    batch = batch_of(model, inputs)
    for name, limit in (("top", 1), ("draws", 0)):
        value = {"top": top, "draws": draws}[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < limit:
            raise ValueError(f"{name} must be an integer >= {limit}; got {value!r}.")
    by_head = _pairs(model, batch, heads, pairs, queries)
    empty = [h for h, p in by_head.items() if not p]
    if empty:
        raise ValueError(f"no pair to explain for heads {empty}: the rule found no target with a real, visible key "
                         "(a sequence with no repeated token has no induction target); give other inputs or pairs.")
    rows_of: dict[str, set] = {}
    for head, found in by_head.items():
        site = site_of(model, head)
        rows_of.setdefault(prefix_of(site), set()).update((b, i) for b, i, _ in found)
        rows_of.setdefault(key_prefix(model, site), set()).update((b, j) for b, _, j in found)
    rows = {prefix: Rows.of(kept) for prefix, kept in rows_of.items()}
    targets = list({site_of(model, h).name: site_of(model, h) for h in heads}.values())
    rec = Record(model, rows, targets)
    try:
        with stage(f"qk attribution: the residual parts of {len(heads)} head(s)"):
            run_until(model, batch, rec.hooks, targets)
    finally:
        rec.close()
    cache: dict = {}
    frames, pair_records, matrices = [], [], {}
    for head in progress(heads, total=len(heads), desc="qk attribution: split", unit="head"):
        frame, records, matrix = _explain(model, rec, head, by_head[head], cache)
        frames.append(frame)
        pair_records += records
        matrices[f"{frame['site'].iloc[0]}:{head[1]}"] = matrix
    df = pd.concat(frames, ignore_index=True)
    df.attrs.update(pairs=pair_records, matrices=matrices, path=model.attn,
                    max_error=max(r["error"] for r in pair_records), causal=[])
    if causal:
        from .qk_causal import causal_check

        for head in progress(heads, total=len(heads), desc=f"qk attribution: causal check ({draws} draws)",
                             unit="head"):
            df.attrs["causal"] += causal_check(model, batch, head, by_head[head], df, rec, top=top, draws=draws,
                                               seed=seed)
    return df


def _explain(model, rec: Record, head, pairs, cache) -> tuple[pd.DataFrame, list, dict]:
    site = site_of(model, head)
    h = head[1]
    g = h // (site.n_heads // site.n_kv_heads)
    lq, qv, q_real, q_rows = side_vectors(model, rec, site, "q", h, cache)
    lk, kv, k_real, k_rows = side_vectors(model, rec, site, "k", g, cache)
    qi = torch.tensor([q_rows.where[(b, i)] for b, i, _ in pairs])
    kj = torch.tensor([k_rows.where[(b, j)] for b, _, j in pairs])
    contributions = site.scale * torch.einsum("anx,cnx->nac", qv[:, qi], kv[:, kj])  # (pairs, query c, key c)
    real = site.scale * (q_real[qi] * k_real[kj]).sum(-1)  # (pairs,)
    bias_table = rec.bias.get(site.name)
    lse = rec.at.get(hook_name("lse", site.name))
    columns = head_columns(model, head)
    records = []
    for n, (b, i, j) in enumerate(pairs):
        bias = 0.0 if bias_table is None else float(bias_table[min(b, bias_table.shape[0] - 1), h, i, j])
        score = float(real[n])
        capped = score if site.softcap is None else math.tanh(score / site.softcap) * site.softcap
        explained = float(contributions[n].sum())
        weight = float("nan") if lse is None else math.exp(capped + bias - float(lse[qi[n], h]))
        records.append({**columns, "batch": b, "query": i, "key": j, "score": score + bias,
                        "explained": explained + bias, "error": abs(explained - score), "position_bias": bias,
                        "weight": weight})
    mean = contributions.mean(0)  # (query components, key components)
    query_side, key_side = mean.sum(1), mean.sum(0)
    rows = {}
    for labels, values, side in ((lq, query_side, "query"), (lk, key_side, "key")):
        for label, value in zip(labels, values.tolist()):
            row = rows.setdefault(label["label"], {**columns, **label, "query": float("nan"),
                                                   "key": float("nan")})
            row[side] = value
    frame = pd.DataFrame(list(rows.values()))
    frame["total"] = frame["query"].fillna(0.0) + frame["key"].fillna(0.0)
    frame = frame[FRONT + COLUMNS]
    for column in ("source_layer", "source_head"):
        frame[column] = frame[column].astype("Int64")
    matrix = {"rows": [l["label"] for l in lq], "cols": [l["label"] for l in lk], "values": mean.tolist(),
              "pairs": len(pairs)}
    return frame, records, matrix
