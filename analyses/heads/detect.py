"""detect_heads: score and label every attention head of a model, on generated or given prompts.

Which scores exist is the registry's (``analyses.heads.registry``). The target-rule and argmax scores are read in one pass
per batch over the model's attention sites (``interp.attention.site_pass``), nothing n x n kept: on the flash path each weight
is rebuilt from the site's q, k and logsumexp (``analyses.heads.scores``), on the eager path it is read from the pattern;
the forward stops after the last site. The weights and behaviour scores run their registry runner.
"""

from __future__ import annotations

import importlib
import warnings

import pandas as pd
import torch

from interp.runtime import distributed
from interp.runtime.progress import progress, stage
from interp.attention.site_pass import WEIGHTINGS
from interp.attention.sites import FRONT, MASK_OF, is_layered, with_head_columns

from ..data.batches import unpadded_rows
from ..data.provenance import prompts_digest
from ..data.prompts import corpus_prompts, corpus_sentences, prompt_ids, repeated_random_tokens
from .labels import choose_scores, resolve_thresholds
from .scores import Tally, labelled, score_batch, wanted_sites
from ..data.bootstrap import check_n_bootstrap
from ..data.needles import check_protocol

__all__ = ["detect_heads", "corpus_sentences", "repeated_random_tokens"]



def detect_heads(model, scores=None, prompts=None, n_prompts: int = 100, seq_len: int | None = None, seed: int = 0,
                 batch_size: int = 32, thresholds: dict[str, float] | None = None,
                 n_bootstrap: int = 1000, context: int | None = None, protocol: str | None = None,
                 weighting: str = "raw") -> pd.DataFrame:
    """Score every head of ``model`` and label it; one row per head: ``(site, head)``, shown as ``(layer, head)`` on a
    model with one site per layer.

    scores: the registered head scores to compute (``analyses.heads.registry``; None: every default score that applies to
        one of the model's sites). The attention-pattern classes: ``previous_token``, ``next_token`` (bidirectional
        heads only), ``self``, ``sink``, ``duplicate_token``, ``induction``, ``positional``; an encoder-decoder
        model's cross-attention heads take ``alignment``, ``source_sink`` and ``source_positional``; a score of your
        own (``analyses.head_score``) runs like these, on every model and path. The literature's classes are
        computed only on request (decoder-only and encoder models): ``successor``, ``copy_suppression`` (from
        weights, seconds), ``copy_suppression_behaviour`` (no label), ``name_mover``, ``s_inhibition`` (IOI task)
        and ``function_vector`` (ICL tasks; minutes on a 135M model), and ``retrieval`` (causal models; Wu et al.
        2024, read while the model copies a needle out of haystacks of up to ``context`` tokens); ``prompts`` does
        not apply to them. A site that none of the scores applies to has no rows. A name that is no score, or a
        score the model cannot take, is refused.
    prompts: None, or the inputs of every attention-pattern score: texts, token-id sequences (lists or 1-D
        tensors), a 2-D tensor of ids, or ``model.to_batch`` output (an encoder-decoder model: a batch dict with
        ``input_ids`` and ``decoder_input_ids``, or a ``(source, target)`` pair). Each must fit the model's positions.
        With None, a score computed on ``"repeated"`` prompts (duplicate_token, induction) runs on ``n_prompts``
        repeated random token sequences (``repeated_random_tokens``) and the others on ``n_prompts`` prompts of the
        bundled corpus of plain English sentences; a model without a tokenizer uses the random sequences for every
        score; an encoder-decoder model, ``n_prompts`` copy-task pairs (``copy_task``).
    n_prompts: the number of generated prompts.
    context: the length in tokens of the prompts generated for every score that has one: the attention-pattern
        scores' prompts (the repeated random tokens, specials included; the corpus prompts are at most this long;
        an encoder-decoder model's copy-task sources) unless ``seq_len`` is given, and retrieval's longest haystack
        (default: the model's positions, at most 8192). Refused where no score asked for reads it.
    seq_len: the attention-pattern scores' prompt length alone (``context`` sets it too); default 64, or the
        model's positions when fewer (12 on an encoder-decoder model).
    seed: seeds the generated prompts and the bootstrap.
    batch_size: prompts per forward pass (padded: left for causal models, right for encoders).
    thresholds: per score, the value a head needs for that label (``positional`` reads ``positional_fraction``);
        defaults ``analyses.DEFAULT_THRESHOLDS`` (0.4; sink 0.3; positional 0.9).
    n_bootstrap: resamples of the prompts for the 95% intervals ``<score>_lo`` and ``<score>_hi``.
    protocol: retrieval's protocol (``analyses.data.needles.PROTOCOLS``): ``"interp"`` (default) or ``"wu2024"`` (Wu et
        al.'s natural-sentence needle, up to 50 steps stopping at a newline, ROUGE-1 recall); recorded in
        ``df.attrs["protocol"]``. Refused where no score asked for reads it.
    weighting: ``"raw"`` (the attention weights) or ``"norm"``: every target-rule score (ours and a user's) read on
        norm-weighted attention, ``||w_ij v_j W_O|| / sum_k ||w_ik v_k W_O||`` (Kobayashi et al. 2020), the share of
        the head's output norm that comes from its targets (``interp.attention.site_pass``; O(n) memory on the flash path).
        Argmax scores (positional) and the weights and behaviour scores are read as they are; recorded in
        ``df.attrs["weighting"]``. Refused where no target-rule score is asked for.

    Every attention-pattern score is read in one pass per batch over the model's attention sites
    (``interp.attention.site_pass``): from the pattern on the eager path, from q, k and the logsumexp on the flash path (no
    n x n matrix, any length); the forward stops after the last site. Progress (``interp.runtime.progress``): each prompt
    set's pass, and each retrieval trial.

    Under torch.distributed (``torchrun``, ``accelerate launch``) the batches are split across ranks and each
    prompt's sums and row counts are added up over ranks (float64, one contributor each), so the bootstrap runs on
    the same per-prompt statistics in the same order, and every rank returns what one process returns.

    Returns columns ``stack``, ``kind``, ``site``, ``layer``, ``head`` (as every head table, ``interp.attention.sites``), one
    per score (an argmax score as ``<score>_offset`` and ``<score>_fraction``), ``label`` (the most specific class
    whose score clears its threshold, ``analyses.LABEL_ORDER``; else ``"none"``), ``labels`` (every class cleared,
    most specific first, joined by ``+``), then the interval columns. ``df.attrs`` records the inputs of each
    score, the thresholds and the attention path, ``prompt_sha256`` (per attention-pattern score, the digest of
    its prompts' token ids, ``prompts_digest``), and ``df.attrs["stability"][score]`` how stable each score's
    ranking of heads is on two disjoint halves of its prompts or trials (``analyses.data.stability``; every target-rule
    score, and the runners' scores that report it). ``evidence`` (where two scores give one class, e.g.
    ``induction`` on random tokens and ``induction_text`` on the corpus): which of them each head cleared.
    """
    check_n_bootstrap(n_bootstrap)
    for name, value in (("n_prompts", n_prompts), ("batch_size", batch_size),
                        ("context", 1 if context is None else context)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}.")
    limits = resolve_thresholds(thresholds)
    records = choose_scores(scores, model)
    attention = [r for r in records if r.how in ("target", "argmax")]
    _check_weighting(weighting, records)
    runners: dict[str, list[str]] = {}  # "module:function" -> the scores it computes
    for r in records:
        if r.how in ("weights", "behaviour"):
            runners.setdefault(r.runner, []).append(r.name)
    retrieval = any(r.prompts == "needle" for r in records)  # reads context and protocol
    run_kw = {} if protocol is None else {"protocol": _check_protocol(protocol, retrieval, records)}
    extra = [r.name for r in records if r.how in ("weights", "behaviour") and r.prompts != "needle"]
    what = "context" if seq_len is None and context is not None else "seq_len"  # what the user called the length
    seq_len = _prompt_length(seq_len, context, [r.name for r in attention], prompts, extra, retrieval)
    df, inputs, stable, digests = None, {}, {}, {}  # each score's halves (df.attrs["stability"]); prompts' sha256
    if attention:
        sets = prompt_sets(model, attention, prompts, n_prompts, seq_len, seed, what)
        frames, nonfinite = [], set()
        with model.studying():
            for set_records, rows, what in sets:
                tally = _tally(model, rows, set_records, batch_size, weighting)
                with stage(f"heads: {n_bootstrap} bootstrap resamples of {len(rows)} prompts"):
                    frame = tally.frame(n_bootstrap, seed)
                nonfinite |= set(frame.attrs.pop("nonfinite"))
                stable.update(frame.attrs.pop("stability", {}))
                frames.append(frame.set_index(FRONT))
                inputs.update(dict.fromkeys((r.name for r in set_records), what))
                digests.update(dict.fromkeys((r.name for r in set_records), prompts_digest(rows)))
        df = pd.concat(frames, axis=1).reset_index() if len(frames) > 1 else frames[0].reset_index()
        df = _mark_nonfinite(model, df, nonfinite)
    for runner, names in runners.items():
        module, function = runner.split(":")
        reads = run_kw if any(r.prompts == "needle" for r in records if r.name in names) else {}  # protocol
        with stage(f"heads: {', '.join(names)}"):
            more = getattr(importlib.import_module(module), function)(
                model, names, seed=seed, n_bootstrap=n_bootstrap, thresholds=thresholds, context=context, **reads)
        more = with_head_columns(model, more.drop(columns=["label", "labels"], errors="ignore"))
        attrs, kept = dict(more.attrs), ({} if df is None else dict(df.attrs))  # a merge keeps no attrs
        stable.update(attrs.pop("stability", {}))
        df = more if df is None else df.merge(more, on=FRONT, how="left", suffixes=("", "_dup"))
        df.attrs.update({**kept, **{k: v for k, v in attrs.items() if k not in ("inputs", "trials")}})
        what = attrs.get("inputs") if isinstance(attrs.get("inputs"), str) else module
        inputs.update(dict.fromkeys(names, what))
        if "trials" in attrs:
            df.attrs["retrieval_trials"] = attrs["trials"]
    df = labelled(df, limits)
    df.attrs.update(inputs=inputs, thresholds=limits, attn=model.attn, stability=stable, weighting=weighting)
    if digests:
        df.attrs["prompt_sha256"] = digests
    return df


def _check_weighting(weighting, records) -> None:
    """``"raw"`` or ``"norm"``, and ``"norm"`` only where a target-rule score reads it."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting is one of {WEIGHTINGS} (the attention weights, or norm-weighted attention); "
                         f"got {weighting!r}.")
    if weighting == "norm" and not any(r.how == "target" for r in records):
        raise ValueError(f"weighting='norm' is read by target-rule scores, and none was asked for "
                         f"({[r.name for r in records]}); add one (e.g. \"sink\" or \"induction\") or drop weighting.")


def _check_protocol(protocol, retrieval: bool, records) -> str:
    """A protocol that a requested score reads (only retrieval's runner reads one), and a name it knows."""
    if not retrieval:
        raise ValueError(f"protocol={protocol!r} chooses how retrieval heads are measured, and no score asked for "
                         f"reads it ({[r.name for r in records]}); add \"retrieval\" to scores or drop protocol.")
    return check_protocol(protocol)


def _prompt_length(seq_len, context, kinds: list[str], prompts, extra: list[str], retrieval: bool) -> int | None:
    """The length of the attention-pattern scores' generated prompts: ``seq_len``, else ``context``. A ``context``
    that no score asked for reads is refused with what it means."""
    if context is not None and not retrieval:
        if not kinds:
            raise ValueError(f"context sets the length of the prompts detect_heads generates (attention-pattern "
                             f"scores, retrieval); {extra} build their own task prompts: drop context.")
        if prompts is not None:
            raise ValueError("context sets the length of the prompts detect_heads generates; prompts= were given, "
                             "so drop context (or prompts).")
        if seq_len is not None and seq_len != context:
            raise ValueError(f"seq_len ({seq_len!r}) and context ({context!r}) both set the generated prompts' "
                             "length; give one.")
    return seq_len if seq_len is not None else context


# -- the prompts ---------------------------------------------------------------------------------------------------
def prompt_sets(model, records, prompts, n_prompts: int, seq_len: int | None, seed: int,
                what: str = "seq_len") -> list[tuple]:
    """``[(records, rows, description)]``: which scores run on which prompts. A row is one prompt as a dict of 1-D
    id tensors (``input_ids``, and on an encoder-decoder model ``decoder_input_ids``), unpadded. what: the name the
    caller gave the length (``seq_len`` or ``context``), for an error."""
    if not is_layered(model):
        from ..data.seq2seq import copy_task, pair_batch  # noqa: PLC0415

        if prompts is None:
            what = f"{n_prompts} copy-task pairs of {seq_len or 12} random tokens"
            batch = copy_task(model, n_prompts, seq_len or 12, seed)
        else:
            what, batch = "the given batch", pair_batch(model, prompts)
        return [(records, unpadded_rows(batch), what)]
    if prompts is not None:
        ids = prompt_ids(model, prompts)
        return [(records, [{"input_ids": i} for i in ids], f"{len(ids)} given prompts")]
    cfg = model.cfg
    seq_len = min(64, cfg.max_positions) if seq_len is None else seq_len
    if not isinstance(seq_len, int) or seq_len > cfg.max_positions:
        raise ValueError(f"{what} must be an integer of at most {cfg.max_positions} (the model's positions); got "
                         f"{seq_len!r}.")
    generator = torch.Generator().manual_seed(seed)
    repeated = [r for r in records if r.prompts == "repeated" or model.tokenizer is None]
    text = [r for r in records if r not in repeated]
    sets = []
    if repeated:
        ids = repeated_random_tokens(model, n_prompts, seq_len, generator, what)
        sets.append((repeated, [{"input_ids": i} for i in ids],
                     f"{n_prompts} repeated random token sequences of {seq_len} tokens"))
    if text:
        ids = corpus_prompts(model, n_prompts, seq_len, generator)
        sets.append((text, [{"input_ids": i} for i in ids], f"{n_prompts} corpus prompts of up to {seq_len} tokens"))
    return sets


# -- running -------------------------------------------------------------------------------------------------------
def _tally(model, rows: list[dict], records, batch_size: int, weighting: str = "raw") -> Tally:
    """The prompts' tally over one per-site pass per batch."""
    lengths = torch.tensor([sum(len(v) for v in row.values()) for row in rows])
    order = torch.argsort(lengths, stable=True)  # similar lengths share a batch: less padding
    max_len = max(len(v) for row in rows for v in row.values())
    tally = Tally(model, records, len(rows), max_len, weighting)
    starts = list(range(0, len(rows), batch_size))
    if distributed.initialised():
        checksum = sum(int(v.long().sum()) for row in rows for v in row.values())
        distributed.check_same([len(rows), int(lengths.sum()), checksum], "prompts")
    mine = distributed.shard(len(starts), strided=True)  # this rank's batches (the same batches as one process's)
    names = ", ".join(r.name for r in records)
    with distributed.failing_together(), torch.no_grad():
        batches = starts if mine is None else [starts[i] for i in mine]
        # counted per attention site of each batch: one batch of a large model is one long forward (tens of seconds)
        n_sites = len(wanted_sites(model, records))
        bar = progress(total=len(batches) * n_sites, desc=f"heads: {len(rows)} prompts in {len(batches)} "
                       f"batch{'es' if len(batches) > 1 else ''} ({names})", unit="site")
        for start in batches:
            index = order[start:start + batch_size]
            score_batch(model, [rows[i] for i in index], index, records, tally, bar)
        bar.close()
        if mine is not None:  # every other rank's prompts are zeros here: the sums are exact
            tally.set_tensors(distributed.all_sum(*tally.tensors()))
    return tally


def _mark_nonfinite(model, df: pd.DataFrame, nonfinite: set) -> pd.DataFrame:
    """Heads whose attention held NaN or inf: their scores are not data. Scores NaN, labels ``"nan"``, and a
    warning naming them."""
    if not nonfinite:
        return df
    names = {(model.cfg.sites[i].name, h) for i, h in nonfinite}
    bad = pd.Series([(s, int(h)) in names for s, h in zip(df["site"], df["head"])], index=df.index)
    keep = (*FRONT, "positional_offset", "source_positional_offset")
    df.loc[bad, [c for c in df.columns if c not in keep]] = float("nan")
    df.attrs["nonfinite"] = True
    by_site: dict[str, list[int]] = {}
    layered = is_layered(model)
    for i, head in sorted(nonfinite):
        site = model.cfg.sites[i]
        by_site.setdefault(f"layer {site.block}" if layered else site.name, []).append(head)
    where = "; ".join(f"{s}: heads {hs}" for s, hs in by_site.items())
    warnings.warn(f"detect_heads: the attention of {int(bad.sum())} head(s) held NaN or inf ({where}); their scores "
                  "are set to NaN and their label to 'nan', not 'none'. Check the model's weights and inputs for "
                  "non-finite values (e.g. all(p.isfinite().all() for p in model.hf.parameters())) or the dtype's "
                  "range (fp16 overflows).", RuntimeWarning, stacklevel=3)
    return df
