"""Head analyses of encoder-decoder models (a ``HookedModel`` with encoder and decoder sites, ``is_seq2seq``).

- Self-attention heads of each stack get the scores of ``analyses.scores`` (the encoder's as a bidirectional
  model's, with next-token; the decoder's as a causal model's).
- Cross-attention heads (queries from the decoder, keys from the encoder's output) get:

  - **alignment**: the mean weight a target position i puts on source position i, over target positions that
    have one. On a copy task (the decoder reproduces the source, teacher-forced: target i is source i), this is
    the weight on the token being copied.
  - **source_sink**: the mean weight on source position 0.
  - **source_positional**: Voita et al.'s positional score over source positions: the fraction of rows whose
    largest weight falls on one fixed offset from the aligned position (``source_positional_offset``), and
    the mean of that largest weight as the score.

Every score has a 95% bootstrap interval over prompts.

The circuit studies (ablation, patching, attribution, importance, pruning curves) are the same functions on every
model (``analyses.ablation_scan`` ...; heads are ``(site, head)``, ``interp.sites``); the teacher-forced metrics
are ``analyses.metrics.target_loss`` and ``target_accuracy``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import pandas as pd
import torch

from interp.progress import progress

from .engine import Shard
from .labels import CROSS_KINDS, CROSS_THRESHOLDS, DEFAULT_THRESHOLDS, choose_scores, resolve_thresholds
from .scores import pattern_scores

__all__ = ["CROSS_DEFINITIONS", "CROSS_KINDS", "CROSS_SCORES", "copy_accuracy", "copy_patching_task",
           "copy_study_inputs", "copy_task", "is_seq2seq", "pair_batch", "seq2seq_heads", "train_copy_model"]


# CROSS_KINDS and CROSS_THRESHOLDS live with every score's name and threshold (analyses.labels). The score columns of cross-attention heads a grid is coloured by (source_positional reads its fraction), and each
# kind's one-line definition, as above.
CROSS_SCORES = ("alignment", "source_positional_fraction", "source_sink")
CROSS_DEFINITIONS = {
    "alignment": "cross-attention: the weight a target position i puts on source position i (on the copy task, "
                 "the token being copied)",
    "source_sink": "cross-attention: the weight a target position puts on source position 0",
    "source_positional": "cross-attention: the share of target rows whose largest weight sits at one fixed offset "
                         "from the aligned source position (Voita et al. 2019); the offset is source_positional_offset",
}


def is_seq2seq(model) -> bool:
    """Whether a model (or the cache of its run) has an encoder and a decoder stack: data on its sites, not its
    class (every model is an ``interp.HookedModel``)."""
    cfg = getattr(model, "cfg", None)
    sites = cfg.sites if cfg is not None else getattr(model, "sites", ())
    return {"encoder", "decoder"} <= {getattr(s, "stack", None) for s in sites}


def pair_batch(model, inputs) -> dict:
    """``{"input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask"}`` (masks None where there is
    no padding) from a ``(source, target)`` pair (texts or token ids; the target is fed shifted right behind the
    decoder's start token, teacher-forced, ``model.decoder_inputs``) or a batch dict with ``input_ids`` and
    ``decoder_input_ids`` (or ``labels``, shifted)."""
    if isinstance(inputs, Mapping):
        if "input_ids" not in inputs or not {"decoder_input_ids", "labels"} & set(inputs):
            raise ValueError(f"A batch for an encoder-decoder view needs input_ids and decoder_input_ids (or labels); "
                             f"got keys {sorted(inputs)}.")
        src, src_mask = model._ids(inputs["input_ids"], inputs.get("attention_mask"), "input_ids")
        if "decoder_input_ids" in inputs:
            tgt, tgt_mask = model._ids(inputs["decoder_input_ids"], inputs.get("decoder_attention_mask"),
                                       "decoder_input_ids")
            return {"input_ids": src, "attention_mask": src_mask, "decoder_input_ids": tgt,
                    "decoder_attention_mask": tgt_mask}
        labels, labels_mask = model._ids(inputs["labels"], inputs.get("decoder_attention_mask"), "labels")
    elif isinstance(inputs, (tuple, list)) and len(inputs) == 2:
        src, src_mask = model._ids(inputs[0], None, "input_ids")  # text is tokenized, padded on the right
        labels, labels_mask = model._ids(inputs[1], None, "labels")
    else:
        raise ValueError("An encoder-decoder view needs a source and a target: pass (source, target) (texts or token "
                         "ids) or a batch dict with input_ids and decoder_input_ids; got "
                         f"{'nothing' if inputs is None else type(inputs).__name__}.")
    tgt_mask = None if labels_mask is None else torch.cat([torch.ones_like(labels_mask[:, :1]), labels_mask[:, :-1]], 1)
    return {"input_ids": src, "attention_mask": src_mask, "decoder_input_ids": model.decoder_inputs(labels),
            "decoder_attention_mask": tgt_mask}


def copy_task(model, n: int = 64, length: int = 10, seed: int = 0) -> dict:
    """Random source sequences and their teacher-forced copy: ``{"input_ids", "attention_mask",
    "decoder_input_ids", "labels"}`` where the labels are the source (the decoder must reproduce it)."""
    generator = torch.Generator().manual_seed(seed)
    special = {getattr(model.hf.config, a, None) for a in ("pad_token_id", "eos_token_id", "bos_token_id",
                                                             "decoder_start_token_id")}
    pool = torch.tensor([t for t in range(model.cfg.vocab_size) if t not in special])
    if len(pool) < 2:
        raise ValueError(f"copy_task needs at least 2 ordinary tokens; the vocabulary has {len(pool)}.")
    source = pool[torch.randint(len(pool), (n, length), generator=generator)].to(model.device)
    return {"input_ids": source, "attention_mask": torch.ones_like(source),
            "decoder_input_ids": model.decoder_inputs(source), "labels": source}


def copy_patching_task(model, n: int = 16, length: int = 10, seed: int = 0, fraction: float = 0.5):
    """``(clean, corrupted, metric)`` for patching on the copy task: ``copy_task`` pairs (clean); the same pairs with
    the first ``fraction`` of each source replaced by other ordinary tokens (corrupted; the targets stay the clean
    ones); the metric is the teacher-forced loss of the clean targets (``target_loss``). The corruption reaches the
    encoder and the cross-attention, never the decoder's self-attention before its first cross-attention."""
    from .metrics import target_loss

    clean = copy_task(model, n, length, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    special = {getattr(model.hf.config, a, None) for a in ("pad_token_id", "eos_token_id", "bos_token_id",
                                                             "decoder_start_token_id")}
    pool = torch.tensor([t for t in range(model.cfg.vocab_size) if t not in special], device=clean["input_ids"].device)
    k = max(1, round(fraction * length))
    source = clean["input_ids"].clone()
    shift = torch.randint(1, len(pool), (n, k), generator=generator).to(source.device)  # never the clean token
    where = torch.searchsorted(pool, source[:, :k].contiguous())
    source[:, :k] = pool[(where + shift) % len(pool)]
    return clean, {**clean, "input_ids": source}, target_loss(labels=clean["labels"])


COPY_LENGTH = 10  # tokens of a copy-task source where a report or the CLI picks the task


def copy_study_inputs(model, prompts: list | None = None, n: int = 16, seed: int = 0):
    """``(batch, metric, description)`` for the studies of an encoder-decoder model: ``n`` copy-task pairs of random
    tokens, or the given texts (or token-id lists) as both source and target (what a denoising model such as BART was
    trained to do); the metric is the teacher-forced loss of the targets (``target_loss``)."""
    from interp.inputs import pad_ids

    from .metrics import target_loss

    if prompts is None:
        return (copy_task(model, n, COPY_LENGTH, seed), target_loss(),
                f"{n} copy-task pairs of {COPY_LENGTH} random tokens (the target is the source), teacher-forced")
    if all(isinstance(p, str) for p in prompts):
        source = model.to_batch(list(prompts[:n]))
    else:
        ids, mask = pad_ids([torch.as_tensor(p) for p in prompts[:n]], left=False, pad_id=model.pad_token_id)
        source = {"input_ids": ids.to(model.device), "attention_mask": mask.to(model.device)}
    labels = source["input_ids"].masked_fill(source["attention_mask"] == 0, -100)
    batch = {**source, "decoder_input_ids": model.decoder_inputs(labels), "labels": labels,
             "decoder_attention_mask": torch.cat([torch.ones_like(source["attention_mask"][:, :1]),
                                                  source["attention_mask"][:, :-1]], 1)}
    return batch, target_loss(), f"{len(labels)} given prompts, each copied (source = target), teacher-forced"


def copy_accuracy(model, batch: dict) -> float:
    """Fraction of target tokens predicted right (argmax) with teacher forcing."""
    with model.studying(), torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"], decoder_input_ids=batch["decoder_input_ids"]).logits
    return float((logits.argmax(-1) == batch["labels"]).float().mean())


def _bootstrap(per_prompt: np.ndarray, n_bootstrap: int, seed: int) -> tuple[float, float]:
    if n_bootstrap <= 0 or len(per_prompt) < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = per_prompt[rng.integers(0, len(per_prompt), (n_bootstrap, len(per_prompt)))].mean(1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def _cross_scores(pattern: torch.Tensor, source_mask: torch.Tensor | None, target_mask: torch.Tensor | None,
                  n_bootstrap: int, seed: int) -> list[dict]:
    """pattern: (b, h, t, s) of one cross-attention site; one dict per head."""
    b, h, t, s = pattern.shape
    pattern = pattern.float()
    rows = torch.ones(b, t, dtype=torch.bool) if target_mask is None else target_mask.bool().cpu()
    src_len = torch.full((b,), s) if source_mask is None else source_mask.sum(1).cpu()
    i = torch.arange(t)
    aligned = rows & (i[None] < src_len[:, None])  # (b, t): rows with a source position to align to
    diag = pattern.cpu()[:, :, i, i.clamp(max=s - 1)]  # (b, h, t): weight on the aligned source position
    first = pattern.cpu()[..., 0]  # (b, h, t)
    top, where = pattern.cpu().max(-1)  # (b, h, t)
    offset = where - i[None, None]
    out = []
    for head in range(h):
        def per_prompt(values, mask):
            counts = mask.sum(1).clamp(min=1)
            return ((values * mask).sum(1) / counts).numpy().astype(np.float64), mask.sum(1).numpy() > 0

        align, has = per_prompt(diag[:, head], aligned.float())
        sink, has_row = per_prompt(first[:, head], rows.float())
        offs = offset[:, head][rows]
        common = int(offs.mode().values) if offs.numel() else 0
        hits = (offset[:, head] == common) & rows
        fraction = float(hits.sum() / rows.sum().clamp(min=1))
        positional, _ = per_prompt(top[:, head], rows.float())
        row = {"head": head, "alignment": float(align[has].mean()) if has.any() else float("nan"),
               "source_sink": float(sink[has_row].mean()), "source_positional": float(positional[has_row].mean()),
               "source_positional_offset": common, "source_positional_fraction": fraction}
        for name, values, valid in (("alignment", align, has), ("source_sink", sink, has_row),
                                    ("source_positional", positional, has_row)):
            row[f"{name}_lo"], row[f"{name}_hi"] = _bootstrap(values[valid], n_bootstrap, seed)
        out.append(row)
    return out


def _cross_label(row: dict, thresholds: dict, kinds=CROSS_KINDS) -> str:
    found = [k for k in ("alignment", "source_positional", "source_sink") if k in kinds
             and (row["source_positional_fraction"] if k == "source_positional" else row[k]) >= thresholds[k]]
    return "+".join(found) if found else "none"


def _cross_columns(kind: str) -> tuple[str, ...]:
    """The columns of one cross-attention score (dropped where it was not asked for)."""
    extra = ("source_positional_offset", "source_positional_fraction") if kind == "source_positional" else ()
    return (kind, *extra, f"{kind}_lo", f"{kind}_hi")


def seq2seq_heads(model, batch: dict | None = None, n_prompts: int = 64, seq_len: int = 12, seed: int = 0,
                  thresholds: dict | None = None, n_bootstrap: int = 1000, kinds=None,
                  batch_size: int | None = None) -> pd.DataFrame:
    """Score every head of an encoder-decoder model; one row per (site, head).

    batch: ``{"input_ids", "attention_mask", "decoder_input_ids"[, "decoder_attention_mask"]}``; default: the
    copy task (``copy_task(model, n_prompts, seq_len, seed)``: sources of ``seq_len`` random tokens), where target i
    aligns to source i. kinds: the scores to compute (None: all): the attention-pattern kinds of
    ``analyses.scores`` for the self-attention heads (``next_token`` on the encoder's only) and ``alignment``,
    ``source_sink``, ``source_positional`` for the cross-attention heads; a site that none of them applies to has
    no rows. thresholds: per kind, either family. batch_size: pairs per forward pass (None: all at once).
    Columns: ``stack``, ``kind`` (``self``/``cross``), ``site`` (the hook prefix), ``layer`` (the block in its
    stack), ``head``, the self-attention scores (NaN for cross heads), the cross-attention scores (NaN for self
    heads), ``label`` and the bootstrap interval columns.
    """
    if not is_seq2seq(model):
        raise TypeError("seq2seq_heads takes an encoder-decoder model (interp.load_model of T5, BART, ...); use "
                        "detect_heads for decoder-only and encoder models.")
    chosen = choose_scores(kinds, "encoder-decoder")
    for name, value in (("n_prompts", n_prompts), ("seq_len", seq_len), ("n_bootstrap", n_bootstrap),
                        ("batch_size", 1 if batch_size is None else batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer; got {value!r}.")
    limits = resolve_thresholds(thresholds, {**DEFAULT_THRESHOLDS, **CROSS_THRESHOLDS})
    own = {k: v for k, v in (thresholds or {}).items() if k in DEFAULT_THRESHOLDS}  # the self heads' labels
    what = f"{n_prompts} copy-task pairs of {seq_len} random tokens" if batch is None else "the given batch"
    batch = copy_task(model, n_prompts, seq_len, seed) if batch is None else batch
    if not isinstance(batch, Mapping) or "input_ids" not in batch or "decoder_input_ids" not in batch:
        raise ValueError("An encoder-decoder model's heads are scored on a batch {input_ids, attention_mask, "
                         "decoder_input_ids, decoder_attention_mask} (the teacher-forced targets as well as the "
                         "sources; default: copy_task(model)); got "
                         f"{sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__}.")
    src, src_mask = batch["input_ids"], batch.get("attention_mask")
    tgt, tgt_mask = batch["decoder_input_ids"], batch.get("decoder_attention_mask")
    patterns = _patterns(model, {"input_ids": src, "attention_mask": src_mask, "decoder_input_ids": tgt,
                                 "decoder_attention_mask": tgt_mask}, batch_size)
    frames, nonfinite = [], {}
    for site in model.cfg.sites:
        site_kinds = chosen["cross"] if site.kind == "cross" else \
            [k for k in chosen["pattern"] if not (site.causal and k == "next_token")]
        if not site_kinds:  # no score asked for applies to this site's heads
            continue
        pattern = patterns[site.name]
        head = {"stack": site.stack, "kind": site.kind, "site": site.name, "layer": site.block}
        query_mask = src_mask if site.stack == "encoder" else tgt_mask
        real = torch.ones(pattern.shape[0], pattern.shape[2], dtype=torch.bool) if query_mask is None \
            else torch.as_tensor(query_mask).bool().cpu()
        bad = ~torch.isfinite(pattern.transpose(1, 2)[real.to(pattern.device)]).flatten(2).all(-1).all(0)  # (h,)
        if bool(bad.any()):
            nonfinite[site.name] = bad.nonzero().flatten().tolist()
        if site.kind == "cross":
            rows = [{**head, **r} for r in _cross_scores(pattern, src_mask, tgt_mask, n_bootstrap, seed)]
            for r in rows:  # one class per cross head; labels as for self heads ("" when none)
                r["label"] = _cross_label(r, limits, site_kinds)
                r["labels"] = "" if r["label"] == "none" else r["label"]
            unasked = [c for k in CROSS_KINDS if k not in site_kinds for c in _cross_columns(k)]
            frames.append(pd.DataFrame(rows).drop(columns=unasked))
        else:
            ids, mask = (src, src_mask) if site.stack == "encoder" else (tgt, tgt_mask)
            df = pattern_scores(pattern, ids.cpu(), None if mask is None else mask.cpu(), causal=site.causal,
                                kinds=site_kinds, thresholds=own, n_bootstrap=n_bootstrap, seed=seed)
            frames.append(df.drop(columns=["layer"]).assign(**head))
    df = pd.concat(frames, ignore_index=True)
    if nonfinite:  # not data: NaN scores, label "nan", and a warning naming the heads
        bad = pd.Series([h in nonfinite.get(s, ()) for s, h in zip(df["site"], df["head"])], index=df.index)
        keep = ("stack", "kind", "site", "layer", "head", "label", "labels", "positional_offset")
        df.loc[bad, [c for c in df.columns if c not in keep]] = float("nan")
        df.loc[bad, [c for c in ("label", "labels") if c in df]] = "nan"
        where = "; ".join(f"{s}: heads {hs}" for s, hs in nonfinite.items())
        warnings.warn(f"detect_heads: the attention of {int(bad.sum())} head(s) held NaN or inf ({where}); their "
                      "scores are set to NaN and their label to 'nan', not 'none'. Check the model's weights and "
                      "inputs for non-finite values or the dtype's range (fp16 overflows).", RuntimeWarning,
                      stacklevel=3)
    front = ["stack", "kind", "site", "layer", "head"]
    df = df[front + [c for c in df.columns if c not in front]]
    df.attrs.update(attn=model.attn, thresholds=limits, n_prompts=int(src.shape[0]),
                    inputs={k: what for k in chosen["pattern"] + chosen["cross"]})
    return df


def _patterns(model, batch: dict, batch_size: int | None = None) -> dict[str, torch.Tensor]:
    """Every site's pattern ``(b, h, q, k)`` on the batch, ``batch_size`` pairs per forward pass (None: all). Under
    torch.distributed each rank runs its share of the pairs and the patterns are gathered in the original order
    (exact: one contributor per row), so every rank scores what one process scores."""
    names = [n for n in model.hook_names() if n.endswith(("hook_q", "hook_k"))
             or (model.attn == "eager" and n.endswith("hook_pattern"))]
    with Shard(batch) as shard:
        part = shard.rows(batch)
        n = part["input_ids"].shape[0]
        step = n if batch_size is None else batch_size
        parts: dict[str, list[torch.Tensor]] = {site.name: [] for site in model.cfg.sites}
        with model.studying(), torch.no_grad():
            for start in progress(range(0, n, step), total=-(-n // step), desc=f"heads: {n} pairs", unit="batch"):
                rows = {k: None if v is None else v[start:start + step] for k, v in part.items()}
                _, cache = model.run_with_cache(rows["input_ids"], rows["attention_mask"], names=names,
                                                decoder_input_ids=rows["decoder_input_ids"],
                                                decoder_attention_mask=rows["decoder_attention_mask"])
                for site in model.cfg.sites:
                    parts[site.name].append(cache.pattern(site.name))
        return {name: shard.gather(torch.cat(p)) for name, p in parts.items()}


def train_copy_model(steps: int = 400, seed: int = 0, length: int = 10, vocab: int = 24, d_model: int = 64,
                     n_heads: int = 4, batch_size: int = 64, lr: float = 3e-3, attn: str = "flash"):
    """A 1 + 1-layer BART-style encoder-decoder trained here to copy random sequences (learned positions, no
    shortcuts): returns the HookedModel. About 10-30 s on a 2-core CPU with the defaults."""
    from transformers import BartConfig, BartForConditionalGeneration

    import interp

    config = BartConfig(vocab_size=vocab, d_model=d_model, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=n_heads, decoder_attention_heads=n_heads,
                        encoder_ffn_dim=4 * d_model, decoder_ffn_dim=4 * d_model, max_position_embeddings=2 * length + 4,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None, scale_embedding=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = BartForConditionalGeneration(config)
        model = interp.load_model(hf, attn=attn)
        optimizer = torch.optim.AdamW(hf.parameters(), lr=lr, weight_decay=0.0)
        hf.train()
        for step in range(steps):
            batch = copy_task(model, batch_size, length, seed=seed * 100_003 + step + 1)
            loss = hf(input_ids=batch["input_ids"], decoder_input_ids=batch["decoder_input_ids"],
                      labels=batch["labels"], use_cache=False).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        hf.eval()
    return model

