"""Head scores read from attention: target rules and row argmaxes, summed per prompt over one per-site pass.

A target-rule score (``analyses.heads.registry``, ``how="target"``) turns into a set of ``(prompt, query, key)`` index
triples, its *pairs*: a query row's score is the sum of its weights on its keys, and a head's score is the mean
over the rows that have at least one pair, pooled over prompts (rows without a target are left out rather than
counted as 0). The weights come from the site's pattern (eager) or are rebuilt one pair at a time from q, k and the
logsumexp (flash: ``interp.attention.site_pass.SiteRead.weights``), so memory is O(number of pairs), never n x n. An
``how="argmax"`` score (positional heads, Voita et al. 2019) histograms the offset of each row's top-1 key from its
query: ``{name}_offset`` is the commonest offset, ``{name}_fraction`` the share of rows whose top-1 key sits there.
``score_batch`` runs one batch's forward and adds every site's pairs to a tally (``detect_heads``, ``sink_heads``).

The rule runs row by row on each prompt's unpadded tokens (positions count from its first real token); pairs
whose query or key is padding are dropped. The row of a causal site's first real position is left out of every
score: it can only attend to itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd
import torch

from interp.model.config import real_sites
from interp.tokens.inputs import pad_ids
from interp.lens.circuits import output_grams
from interp.attention.site_pass import each_site
from interp.attention.sites import FRONT, MASK_OF

from . import registry
from .labels import has_evidence, head_labels, label_evidence, label_heads, site_kind
from .registry import HeadScore
from ..data.bootstrap import check_n_bootstrap, ratio_interval, resample_counts
from ..data.stability import halves, stability

__all__ = ["Pairs", "Tally", "labelled", "order_columns", "pattern_scores", "rule_pairs", "score_batch",
           "wanted_sites"]


@dataclass
class Pairs:
    """Index triples ``(b, q, k)``, each ``(n_pairs,)``, in padded coordinates, and the rows they cover per prompt
    of the batch: ``(batch,)``."""

    b: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    rows: torch.Tensor


def _as_triple(record: HeadScore, out, n_batch: int, n_q: int, n_k: int):
    """A rule's output as ``(b, q, k)`` with every -1 dropped, after checking its form. One rule for both forms:
    positions are integer tensors (a float, bool or complex tensor is refused, never truncated: NaN has no
    position), and a pair listed twice is one target (a set of targets per row: a head's weight on them is at most
    1)."""
    form = (f"the target rule of {record.name!r} must return a (batch, pos) LongTensor of key positions (-1: none) "
            f"or a (batch, query, key) triple of 1-D LongTensors")
    if isinstance(out, torch.Tensor):
        if out.shape != (n_batch, n_q):
            raise ValueError(f"{form}; for ids of shape {(n_batch, n_q)} it returned a tensor of shape "
                             f"{tuple(out.shape)}.")
        _integer(out, form)
        b, q = (out >= 0).nonzero(as_tuple=True)
        triple = b, q, out[b, q].long()
    elif isinstance(out, (tuple, list)) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out):
        triple = tuple(_integer(t, form).reshape(-1).long() for t in out)
        if len({len(t) for t in triple}) != 1:
            raise ValueError(f"{form}; its triple has lengths {[len(t) for t in triple]}.")
        keep = triple[2] >= 0
        triple = tuple(t[keep] for t in triple)
    else:
        raise ValueError(f"{form}; it returned {type(out).__name__}.")
    b, q, k = (t.cpu() for t in triple)
    if len(b) and (b.min() < 0 or b.max() >= n_batch or q.min() < 0 or q.max() >= n_q or k.max() >= n_k):
        raise ValueError(f"The target rule of {record.name!r} returned positions outside the prompt: batch rows "
                         f"0..{n_batch - 1}, queries 0..{n_q - 1} and keys -1..{n_k - 1} are possible.")
    if len(b):  # each (b, q, k) once
        flat = torch.unique((b * n_q + q) * n_k + k)
        b, q, k = flat // (n_q * n_k), flat // n_k % n_q, flat % n_k
    return b, q, k


def _integer(t: torch.Tensor, form: str) -> torch.Tensor:
    """``t`` where it holds integer positions; a float, bool or complex tensor is refused."""
    if t.device.type == "meta":
        raise ValueError(f"{form}; it returned a tensor on the meta device, which holds no values (build it from "
                         "ids, e.g. torch.arange(..., device=ids.device)).")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{form}; it returned a {t.dtype} tensor (positions are integers: cast with .long() where "
                         "they are whole, and mark 'no target' with -1, not NaN).")
    return t


def _call_rule(record: HeadScore, **available):
    """``record.call_rule``; what a rule raises comes back as one line that names the score and the file of its rule
    (the rule's own message first)."""
    try:
        return record.call_rule(**available)
    except Exception as err:  # noqa: BLE001  a user's rule may raise anything
        rule = record.function
        code = getattr(rule, "__code__", None)
        where = f"{code.co_filename}:{code.co_firstlineno}" if code else repr(rule)
        raise ValueError(f"{str(err).strip() or type(err).__name__} ({type(err).__name__} raised by the target rule "
                         f"of score {record.name!r}, {getattr(rule, '__name__', 'rule')} in {where})") from err


def rule_pairs(record: HeadScore, ids, valid, key_ids, key_valid, causal: bool, tokenizer=None) -> Pairs:
    """The pairs of one target-rule score on a padded batch: query side ``ids``/``valid`` ``(b, q)``, key side
    ``key_ids``/``key_valid`` ``(b, k)`` (the same tensors on a self-attention site)."""
    ids, valid, key_ids, key_valid = (t.cpu() for t in (ids, valid, key_ids, key_valid))
    n_batch = ids.shape[0]
    same = key_ids is ids
    if bool(valid.all()) and bool(key_valid.all()):  # no padding: one call for the whole batch
        parts = [(torch.arange(n_batch), torch.arange(ids.shape[1]), torch.arange(key_ids.shape[1]),
                  _as_triple(record, _call_rule(record, ids=ids, key_ids=key_ids, tokenizer=tokenizer), n_batch,
                             ids.shape[1], key_ids.shape[1]))]
    else:
        parts = []
        for row in range(n_batch):
            q_at, k_at = valid[row].nonzero().squeeze(1), key_valid[row].nonzero().squeeze(1)
            mine, theirs = ids[row, q_at][None], key_ids[row, k_at][None]
            out = _call_rule(record, ids=mine, key_ids=mine if same else theirs, tokenizer=tokenizer)
            parts.append((torch.tensor([row]), q_at, k_at, _as_triple(record, out, 1, len(q_at), len(k_at))))
    bs, qs, ks = [], [], []
    for rows_at, q_at, k_at, (b, q, k) in parts:
        keep = q != 0 if causal else torch.ones_like(q, dtype=torch.bool)  # the forced first row of a causal site
        bs.append(rows_at[b[keep]]), qs.append(q_at[q[keep]]), ks.append(k_at[k[keep]])
    b, q, k = torch.cat(bs), torch.cat(qs), torch.cat(ks)
    n_pos = ids.shape[1]
    rows = torch.bincount(torch.unique(b * n_pos + q) // n_pos, minlength=n_batch)
    return Pairs(b, q, k, rows)


def argmax_rows(valid: torch.Tensor, causal: bool) -> torch.Tensor:
    """(b, q): the rows an argmax score counts (real, and not a causal site's forced first row)."""
    valid = valid.cpu()
    first = valid.int().argmax(dim=1)
    return valid & ~(causal & (torch.arange(valid.shape[1])[None] == first[:, None]))


# -- accumulating over batches and sites -------------------------------------------------------------------------
class Tally:
    """Per-prompt sums ``(prompt, site, head)`` and row counts ``(prompt, site)`` of each target-rule score, and
    each argmax score's histograms ``(half, site, head, offsets)`` of top-1 key offsets (even and odd prompts), for the sites of ``model``."""

    def __init__(self, model, records: Iterable[HeadScore], n_prompts: int, max_len: int, weighting: str = "raw"):
        self.model = model
        self.weighting = weighting  # "norm": target-rule scores read norm-weighted attention (interp.attention.site_pass)
        self.sites = model.cfg.sites
        self.records = list(records)
        n_sites, n_heads = len(self.sites), max(s.n_heads for s in self.sites)
        self.width = 2 * max_len - 1
        self.max_len = max_len
        self.sums = {r.name: torch.zeros(n_prompts, n_sites, n_heads, dtype=torch.float64)
                     for r in self.records if r.how == "target"}
        self.rows = {name: torch.zeros(n_prompts, n_sites, dtype=torch.int64) for name in self.sums}
        self.hist = {r.name: torch.zeros(2, n_sites, n_heads, self.width, dtype=torch.int64)  # even, odd prompts
                     for r in self.records if r.how == "argmax"}
        self.nonfinite = torch.zeros(n_sites, n_heads, dtype=torch.int64)

    def applies(self, record: HeadScore, index: int) -> bool:
        return record.applies_to(site_kind(self.sites[index]))

    def add_site(self, read, index: torch.Tensor, pairs: dict[str, Pairs]) -> None:
        """Add one site of one batch whose prompts sit at ``index: (b,)``: ``pairs`` maps each target-rule score
        that applies to the site to its pairs on this batch."""
        i = read.index
        named = [name for name in self.sums if name in pairs]
        if named:  # one gather for the pairs of every score, then split
            parts = [pairs[name] for name in named]
            w = read.weights(*(torch.cat([getattr(p, f) for p in parts]) for f in ("b", "q", "k")),
                             weighting=self.weighting).double().cpu()
            for name, p, ws in zip(named, parts, w.split([len(p.b) for p in parts])):
                per_prompt = torch.zeros(len(index), w.shape[1], dtype=torch.float64).index_add_(0, p.b, ws)
                self.sums[name][index, i, : w.shape[1]] = per_prompt
                self.rows[name][index, i] = p.rows
        argmax = [r for r in self.records if r.how == "argmax" and self.applies(r, i)]
        if argmax:
            key = read.top_keys().cpu()  # (b, h, q)
            b, q = argmax_rows(read.query_valid, read.site.causal).nonzero(as_tuple=True)
            offset = (key[b, :, q] - q[:, None] + self.max_len - 1).clamp(0, self.width - 1)  # (rows, h)
            seen = key[b, :, q] >= 0
            n_heads = key.shape[1]
            half = (index.cpu()[b] % 2)[:, None].expand_as(offset)  # each row's prompt: even or odd
            flat = ((half * n_heads + torch.arange(n_heads)[None]) * self.width + offset)[seen]
            counts = torch.bincount(flat, minlength=2 * n_heads * self.width).view(2, n_heads, self.width)
            for r in argmax:
                self.hist[r.name][:, i, :n_heads] += counts

    def mark_nonfinite(self, index: int, bad: torch.Tensor) -> None:
        self.nonfinite[index, : bad.shape[0]] += bad.cpu().long()

    def tensors(self) -> list[torch.Tensor]:
        """Every accumulated tensor, in a fixed order (for summing over ranks)."""
        return [*self.sums.values(), *self.rows.values(), *self.hist.values(), self.nonfinite]

    def set_tensors(self, tensors: list[torch.Tensor]) -> None:
        it = iter(tensors)
        for group in (self.sums, self.rows, self.hist):
            for name in group:
                group[name] = next(it)
        self.nonfinite = next(it)

    def frame(self, n_bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
        """One row per real head of every site that a score applies to: the scores (NaN where one does not apply),
        each argmax score's ``_offset`` and ``_fraction``, and bootstrap 95% intervals over prompts (percentile
        method, prompts resampled with replacement) for the target-rule scores. ``df.attrs["stability"][score]``: each
        score's ranking of heads on the even against the odd prompts (an argmax score's: its fraction) (``analyses.data.stability``: Spearman,
        top-10 overlap, ``unstable``; ``"halves": "prompts"``), where there are at least 2 prompts."""
        check_n_bootstrap(n_bootstrap)
        index = {s.name: i for i, s in enumerate(self.sites)}
        heads = [(index[s.name], h) for s in real_sites(self.model) for h in range(s.n_heads)
                 if any(self.applies(r, index[s.name]) for r in self.records)]
        site_at, head_at = torch.tensor([i for i, _ in heads], dtype=torch.long), \
            torch.tensor([h for _, h in heads], dtype=torch.long)
        columns: dict[str, object] = {c: [getattr(self.sites[i], "name" if c == "site" else "block" if c == "layer"
                                                  else c) for i, _ in heads] for c in FRONT[:-1]}
        columns["head"] = head_at.numpy()
        intervals, stable = {}, {}
        counts = None  # one set of resamples of the prompts for every score
        for r in self.records:
            ok = torch.tensor([self.applies(r, i) for i, _ in heads], dtype=torch.bool)
            if r.how == "argmax":
                by_half = self.hist[r.name][:, site_at, head_at].double()  # (2, heads, offsets)
                if bool((by_half.sum((1, 2)) > 0).all()):  # each half's share at its own most common offset
                    first, second = (torch.where(ok, h.max(-1).values / h.sum(-1).clamp(min=1), torch.nan)
                                     for h in by_half)
                    stable[r.name] = {**stability(first, second, k=10), "halves": "prompts"}
                hist = by_half.sum(0)
                best = hist.max(-1)
                offsets = best.indices - (self.max_len - 1)
                columns[f"{r.name}_offset"] = offsets.numpy() if bool(ok.all()) else pd.array(
                    [o if k else None for o, k in zip(offsets.tolist(), ok.tolist())], dtype="Int64")
                share = best.values / hist.sum(-1).clamp(min=1)
                columns[f"{r.name}_fraction"] = torch.where(ok & (hist.sum(-1) > 0), share, torch.nan).numpy()
                continue
            sums, rows = self.sums[r.name][:, site_at, head_at], self.rows[r.name][:, site_at].double()
            if not bool((rows[:, ok] > 0).any()) and bool(ok.any()):
                warnings.warn(f"The target rule of {r.name!r} gave no target on any of the {sums.shape[0]} prompts "
                              "(every position -1 or masked), so its values are NaN: check the rule, or give prompts "
                              "on which it has targets.", stacklevel=2)
            if counts is None:
                counts = resample_counts(sums.shape[0], n_bootstrap, seed)
            value, lo, hi = ratio_interval(sums, rows, counts=counts)
            if sums.shape[0] >= 2:  # the ranking on each half of the prompts (0 / 0 rows: NaN, left out)
                first, second = (torch.where(ok, sums[half].sum(0) / rows[half].sum(0), torch.nan)
                                 for half in halves(sums.shape[0]))
                stable[r.name] = {**stability(first, second, k=10), "halves": "prompts"}
            columns[r.name] = torch.where(ok, value, torch.nan).numpy()
            intervals[f"{r.name}_lo"] = torch.where(ok, lo, torch.nan).numpy()
            intervals[f"{r.name}_hi"] = torch.where(ok, hi, torch.nan).numpy()
        df = pd.DataFrame({**columns, **intervals})
        df.attrs["nonfinite"] = [(int(i), int(h)) for i, h in heads if self.nonfinite[i, h] > 0]
        df.attrs["stability"] = stable
        return df


def labelled(df: pd.DataFrame, thresholds: dict | None) -> pd.DataFrame:
    """The table with its ``label`` and ``labels`` columns (and ``evidence`` where two of its scores give one class,
    ``analyses.heads.labels.label_evidence``), in ``order_columns``'s order."""
    attrs = dict(df.attrs)
    df = df.assign(label=label_heads(df, thresholds), labels=head_labels(df, thresholds))
    if has_evidence(df):  # a class two scores give: which of them each head cleared
        df = df.assign(evidence=label_evidence(df, thresholds))
    df = order_columns(df)
    df.attrs.update(attrs)
    return df


def order_columns(df: pd.DataFrame) -> pd.DataFrame:
    """The head columns, the scores in registry order (an argmax score's offset and fraction), label, labels,
    evidence, then the interval columns and anything else."""
    main, intervals = [c for c in FRONT if c in df], []
    for r in registry.scores():  # each score's columns as the registry defines them (registry.table_columns)
        ends = [f"{r.name}_{end}" for end in registry.INTERVAL_ENDS]
        main += [c for c in registry.table_columns(r) if c not in ends and c not in r.extra]
        intervals += [c for c in ends if c in registry.table_columns(r)]
    main += list(registry.LABEL_COLUMNS)
    main, intervals = [c for c in main if c in df], [c for c in intervals if c in df]
    return df[main + intervals + [c for c in df if c not in main + intervals]]


# -- scores of a given pattern ---------------------------------------------------------------------------------
def pattern_scores(pattern: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   causal: bool = True, scores: Iterable[str] | None = None,
                   thresholds: dict[str, float] | None = None, n_bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Scores of a given attention pattern, one row per head (``layer`` is 0), as ``detect_heads`` reports them.

    pattern: (batch, head, query, key); input_ids and attention_mask: (batch, pos), the tokens the pattern was
    computed on (they define the previous token, earlier occurrences and padding). scores: registered
    target-rule and argmax scores of self-attention heads (None: the defaults).

    >>> ids = torch.tensor([[5, 6, 7, 5, 6, 7]])
    >>> shifted = torch.eye(6).roll(-1, dims=1).tril()[None, None]  # row i -> i-1 (row 0 -> itself)
    >>> shifted[0, 0, 0, 0] = 1.0
    >>> df = pattern_scores(shifted, ids)
    >>> float(df.previous_token[0]), float(df.induction[0]), df.label[0]
    (1.0, 0.0, 'previous_token')
    """
    from types import SimpleNamespace  # noqa: PLC0415

    from interp.attention.site_pass import SiteRead  # noqa: PLC0415
    from interp.attention.sites import Site  # noqa: PLC0415

    if pattern.ndim != 4 or pattern.shape[0] != input_ids.shape[0] or pattern.shape[2:] != (input_ids.shape[1],) * 2:
        raise ValueError(f"pattern must be (batch, head, pos, pos) matching input_ids {tuple(input_ids.shape)}; got "
                         f"{tuple(pattern.shape)}.")
    n_heads = pattern.shape[1]
    site = Site("blocks.0.attn", "decoder" if causal else "encoder", 0, "self", n_heads, n_heads, 1, 1, 1.0, causal)
    model = SimpleNamespace(cfg=SimpleNamespace(sites=(site,), causal=causal, empty_sites=()), tokenizer=None)
    kind = site_kind(site)
    if scores is None:
        records = [r for r in registry.scores(("target", "argmax"), kind) if r.default]
    else:
        records = [registry.score(n) for n in ([scores] if isinstance(scores, str) else scores)]
        wrong = [r.name for r in records if r.how not in ("target", "argmax") or not r.applies_to(kind)]
        if wrong:
            raise ValueError(f"The score(s) {wrong} cannot be read from a {kind} pattern; a pattern's scores are "
                             f"{list(registry.names(('target', 'argmax'), kind))}.")
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    tally = Tally(model, records, input_ids.shape[0], input_ids.shape[1])
    pairs = {r.name: rule_pairs(r, input_ids, valid, input_ids, valid, causal) for r in records if r.how == "target"}
    tally.add_site(SiteRead(0, site, valid, valid, pattern=pattern), torch.arange(input_ids.shape[0]), pairs)
    df = tally.frame(n_bootstrap, seed)
    df.attrs.pop("nonfinite")
    return labelled(df, thresholds)


# -- one batch's pass ----------------------------------------------------------------------------------------------
def wanted_sites(model, records) -> list[int]:
    """The indices of the model's sites that one of ``records`` applies to."""
    return [i for i, s in enumerate(model.cfg.sites) if any(r.applies_to(site_kind(s)) for r in records)]


def score_batch(model, rows: list[dict], index: torch.Tensor, records, tally, bar=None) -> None:
    """One forward over one batch of prompts (``rows``: dicts of unpadded 1-D id tensors; ``index``: their places
    in the tally), stopping after the last site a record applies to: each site's target-rule pairs and weights are
    added to ``tally`` (a ``Tally``, or an object with its ``weighting``, ``mark_nonfinite`` and ``add_site``) as
    the site runs, with the value norms of each head's output when ``tally.weighting == "norm"``. bar: a progress
    bar advanced once per site (``detect_heads``'s)."""
    batch = {}
    for entry, mask_name in MASK_OF.items():
        if entry in rows[0]:
            left = model.cfg.causal and entry == "input_ids"  # a causal model's prompts are padded on the left
            batch[entry], batch[mask_name] = pad_ids([row[entry] for row in rows], left=left,
                                                     pad_id=model.pad_token_id)
    targets = [r for r in records if r.how == "target"]
    pairs: dict[tuple, dict] = {}

    def for_site(site) -> dict:
        key = (site.queries, site.keys, site.causal)
        if key not in pairs:
            ids, keys = batch[site.queries], batch[site.keys]
            valid, key_valid = batch[MASK_OF[site.queries]].bool(), batch[MASK_OF[site.keys]].bool()
            pairs[key] = {r.name: rule_pairs(r, ids, valid, keys, key_valid, site.causal, model.tokenizer)
                          for r in targets if r.applies_to(site_kind(site))}
        return pairs[key]

    def visit(read) -> None:
        bad = read.nonfinite_heads()
        if bad is not None:
            tally.mark_nonfinite(read.index, bad)
        tally.add_site(read, index, for_site(read.site))
        if bar is not None:
            bar.update(1)

    wanted = wanted_sites(model, records)
    each_site(model, batch, visit, wanted,
              value_norms=output_grams(model, wanted) if tally.weighting == "norm" else None)
