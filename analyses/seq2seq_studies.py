"""The circuit studies of encoder-decoder models (``interp.seq2seq.Seq2SeqHookedModel``), per attention site.

Heads are named ``(site, head)``, e.g. ``("decoder.blocks.0.cross_attn", 2)``, and batches are
``{input_ids, attention_mask, decoder_input_ids, decoder_attention_mask[, labels]}`` (teacher forcing, as
``analyses.seq2seq.copy_task`` returns). ``ablation_scan``, ``activation_patching``, ``attribution_patching``,
``head_importance`` and ``pruning_curve`` call these for an encoder-decoder model; their rows carry ``stack``,
``kind``, ``site``, ``layer`` (the block in its stack) and ``head``, then the decoder-only study's own columns.
They share the engine (``analyses.engine``) and each leaves the model as it found it (``model.studying()``).

- ``ablate_seq2seq_heads`` / ``seq2seq_ablation_scan``: zero, mean or resample ablation through ``hook_z``.
- ``seq2seq_activation_patching`` / ``seq2seq_attribution_patching``: a corrupted source changes encoder and
  cross-attention heads, a corrupted target decoder heads; patch any of them.
- ``seq2seq_head_importance``: Michel et al.'s gates, normalised within each site.
- ``target_loss`` / ``target_accuracy``: teacher-forced metrics of the labels.
"""

from __future__ import annotations


import pandas as pd
import torch
import torch.nn.functional as F

from interp.sites import check_heads

from .ablation import ablate_heads, ablation_scan
from .attribution import _first_order
from .engine import Shard, _arguments, copies_per_forward, scan
from .metrics import Metric, _main_output, as_metric, batch_of
from .patching import WHAT, _patch_hooks, scalar_metric
from .pruning import _gate_gradients, _loss_fn
from .seq2seq import _FRONT

__all__ = ["ablate_seq2seq_heads", "check_site_heads", "seq2seq_ablation_scan", "seq2seq_activation_patching",
           "seq2seq_attribution_patching", "seq2seq_batch", "seq2seq_head_importance", "target_accuracy",
           "target_loss"]


# -- batches, heads and metrics of the studies -----------------------------------------------------------------
seq2seq_batch = batch_of  # one batch reader for every model (analyses.metrics)
check_site_heads = check_heads  # one reader of head lists for every model (interp.sites)


def _columns(model, site: str, head: int) -> dict:
    s = model.sites[site]
    return {"stack": s.stack, "kind": s.kind, "site": site, "layer": s.block, "head": head}


def _query_mask(model, site: str, batch: dict) -> torch.Tensor | None:
    """The mask of a site's z positions: the source's in the encoder, the target's in the decoder (cross-attention
    z lives on target positions)."""
    return batch.get("attention_mask" if model.sites[site].stack == "encoder" else "decoder_attention_mask")


class _TargetMetric(Metric):
    """Teacher-forced: per example, the mean over real target positions (``decoder_attention_mask`` and labels
    other than -100) of the labels' cross-entropy (``loss``) or of argmax hits (``accuracy``)."""

    def __init__(self, kind: str, labels):
        self.kind, self.labels = kind, None if labels is None else torch.as_tensor(labels)
        self.name, self.higher_is_better = f"target_{kind}", kind == "accuracy"

    def per_example(self, output, inputs) -> torch.Tensor:
        logits = _main_output(output)  # (b, t, vocab)
        labels = self.labels if self.labels is not None else inputs.get("labels")
        if labels is None:
            raise ValueError(f"{self.name} scores the labels (b, t): put 'labels' in the batch (copy_task does) or "
                             f"build the metric with them, {self.name}(labels).")
        labels = labels.to(logits.device)
        if labels.shape != logits.shape[:2]:
            raise ValueError(f"{self.name}'s labels are {tuple(labels.shape)}; the decoder ran on "
                             f"{tuple(logits.shape[:2])} (batch, target pos).")
        valid = labels != -100
        if inputs.get("decoder_attention_mask") is not None:
            valid = valid & inputs["decoder_attention_mask"].to(logits.device).bool()
        if self.kind == "loss":
            values = F.cross_entropy(logits.transpose(1, 2).float(), labels.clamp(min=0), reduction="none")
        else:
            values = (logits.argmax(-1) == labels).float()
        valid = valid.float()
        return (values * valid).sum(1) / valid.sum(1).clamp(min=1)  # (b,)

    def loss(self, output, inputs) -> torch.Tensor:
        if self.kind == "accuracy":
            raise TypeError("target_accuracy counts argmax hits, which have no gradient; rank heads with "
                            "loss=target_loss() instead.")
        return self.per_example(output, inputs)

    def rows(self, index: torch.Tensor) -> Metric:
        return self if self.labels is None else _TargetMetric(self.kind, self.labels[index.to(self.labels.device)])


def target_loss(labels=None) -> Metric:
    """Metric: teacher-forced cross-entropy of the targets, averaged over each example's real target positions
    (lower is better). labels: ``(b, t)`` (-100 skipped); default the batch's ``labels``. Fixed labels keep scoring
    the clean targets on a corrupted batch (patching)."""
    return _TargetMetric("loss", labels)


def target_accuracy(labels=None) -> Metric:
    """Metric: the fraction of target tokens predicted right (argmax, teacher-forced), per example over its real
    target positions (higher is better); labels as in ``target_loss``. Has no gradient (no ``head_importance``)."""
    return _TargetMetric("accuracy", labels)


# -- ablation ---------------------------------------------------------------------------------------------------
ablate_seq2seq_heads, seq2seq_ablation_scan = ablate_heads, ablation_scan  # one ablation for every model


# -- patching and attribution -----------------------------------------------------------------------------------
def _paired(model, clean, corrupted) -> tuple[dict, dict]:
    """Clean and corrupted batches with the same shapes (source and target) and the same padding."""
    clean, corrupted = seq2seq_batch(model, clean), seq2seq_batch(model, corrupted)
    for ids, mask in (("input_ids", "attention_mask"), ("decoder_input_ids", "decoder_attention_mask")):
        a, b = clean[ids], corrupted[ids]
        if a.shape != b.shape:
            raise ValueError(f"clean and corrupted {ids} must have the same shape, so that each position of one "
                             f"patches the same position of the other; got {tuple(a.shape)} and {tuple(b.shape)}.")
        ma, mb = clean[mask], corrupted[mask]
        ma = None if ma is None or bool(ma.all()) else ma
        mb = None if mb is None or bool(mb.all()) else mb
        if (ma is None) != (mb is None) or ma is not None and not torch.equal(ma, mb):
            raise ValueError(f"clean and corrupted inputs must have the same padding ({mask}).")
    return clean, corrupted


def _positions(model, site: str, what: str, batch: dict) -> int:
    """How many positions a site's ``what`` has: keys (k, v) come from the source in the encoder and in
    cross-attention; queries (q, z, pattern rows) from the site's own stack."""
    s = model.sites[site]
    source = s.stack == "encoder" or (what in ("k", "v") and s.kind == "cross")
    return batch["input_ids" if source else "decoder_input_ids"].shape[1]


def seq2seq_activation_patching(model, clean, corrupted, metric, by: str = "head", what: str = "z", heads=None,
                                memory_budget: float | None = None,
                                heads_per_forward: int | None = None) -> pd.DataFrame:
    """``activation_patching`` of an encoder-decoder model: each (site, head)'s clean activation put into the
    corrupted run alone.

    clean, corrupted: batches of the same shapes and padding (source and target); the metric is taken on the
    corrupted batch, so give it fixed targets (``target_loss(clean["labels"])``) when the batches' labels differ.
    what: ``"z"``, ``"q"``, ``"k"``, ``"v"`` (rows are key/value heads) or ``"pattern"`` (eager path). by:
    ``"head"`` or ``"head_pos"`` (``pos``: a query position, a key position for k and v; source positions in
    the encoder and for cross-attention keys, target positions otherwise). Returns ``stack``, ``kind``,
    ``site``, ``layer``, ``head`` (, ``pos``), ``metric``, ``effect`` (0 corrupted, 1 clean).
    """
    if what not in WHAT:
        raise ValueError(f"what must be one of {', '.join(WHAT)}; got {what!r}.")
    if by not in ("head", "head_pos"):
        raise ValueError(f"by must be 'head' or 'head_pos'; got {by!r}.")
    if what == "pattern" and model.attn != "eager":
        raise ValueError("Patching patterns needs the eager path (the flash path never builds them): call "
                         "model.set_attn('eager') first, or patch 'q' and 'k'.")
    metric = scalar_metric(metric)
    clean, corrupted = _paired(model, clean, corrupted)
    if what in ("k", "v"):  # one key/value head serves several query heads
        units = [(s.name, g) for s in model.cfg.sites for g in range(s.n_kv_heads)] if heads is None else \
            check_site_heads(model, heads, kv=True)
    else:
        units = model.cfg.heads() if heads is None else check_site_heads(model, heads)
    items = units if by == "head" else [(site, h, p) for site, h in units
                                        for p in range(_positions(model, site, what, clean))]
    names = [f"{site}.hook_{what}" for site in dict.fromkeys(site for site, _ in units)]
    with Shard(corrupted, metric) as shard:  # this rank's prompts under torch.distributed, else all of them
        clean, corrupted, local = shard.rows(clean), shard.rows(corrupted), shard.metric(metric)
        with model.studying(), torch.no_grad():
            args, kwargs = _arguments(clean)
            output, cache = model.run_with_cache(*args, names=names, **kwargs)
            clean_value = local(output, clean)
        sources = {name.rsplit(".", 1)[0]: cache[name] for name in names}
        per_forward = heads_per_forward or copies_per_forward(model, corrupted, memory_budget)
        corrupted_value, values = scan(
            model, corrupted, items, lambda item: 0,
            lambda group, copies: _patch_hooks(what, group, sources, copies, name=lambda s, w: f"{s}.hook_{w}"),
            local, per_forward)
        clean_value, corrupted_value, *values = shard.means([clean_value, corrupted_value, *values])
    span = clean_value - corrupted_value
    rows = [{**_columns(model, item[0], item[1]), **({"pos": item[2]} if by == "head_pos" else {}), "metric": v,
             "effect": (v - corrupted_value) / span if span else float("nan")} for item, v in zip(items, values)]
    columns = [*_FRONT, *(["pos"] if by == "head_pos" else []), "metric", "effect"]
    df = pd.DataFrame(rows, columns=columns)
    df.attrs.update(metric=metric.name, clean=clean_value, corrupted=corrupted_value, what=what, by=by)
    return df


def seq2seq_attribution_patching(model, clean, corrupted, metric, by: str = "head", heads=None) -> pd.DataFrame:
    """``attribution_patching`` of an encoder-decoder model: first-order estimates of what="z" activation
    patching for every (site, head) from one clean forward and one corrupted forward and backward: the sum over
    the batch (and positions, for ``by="head"``) of ``(z_clean - z_corrupted) . d metric / d z`` at the corrupted
    run. Returns ``stack``, ``kind``, ``site``, ``layer``, ``head`` (, ``pos``), ``metric`` (corrupted +
    estimate), ``effect`` (estimate / (clean - corrupted)), ``estimate``.
    """
    if by not in ("head", "head_pos"):
        raise ValueError(f"by must be 'head' or 'head_pos'; got {by!r}.")
    metric = scalar_metric(metric)
    clean, corrupted = _paired(model, clean, corrupted)
    heads = model.cfg.heads() if heads is None else check_site_heads(model, heads)
    sites = list(dict.fromkeys(site for site, _ in heads))
    with Shard(corrupted, metric) as shard:  # this rank's prompts under torch.distributed, else all of them
        clean, corrupted, local = shard.rows(clean), shard.rows(corrupted), shard.metric(metric)
        *values, estimates = _first_order(model, clean, corrupted, local, [f"{s}.hook_z" for s in sites],
                                          None if shard.index is None else shard.n)
        clean_value, corrupted_value = shard.means(values)
        # site -> (p, h): the estimate of each head at each position, summed over the batch
        per_site = {s: shard.gather(estimates[f"{s}.hook_z"].cpu()).sum(0) for s in sites}
    span = clean_value - corrupted_value
    rows = []
    for site, head in heads:
        per_pos = per_site[site][:, head]  # (p,)
        parts = [(None, float(per_pos.sum()))] if by == "head" else list(enumerate(per_pos.tolist()))
        for pos, estimate in parts:
            rows.append({**_columns(model, site, head), **({} if pos is None else {"pos": pos}),
                         "metric": corrupted_value + estimate, "effect": estimate / span if span else float("nan"),
                         "estimate": estimate})
    df = pd.DataFrame(rows, columns=[*_FRONT, *(["pos"] if by == "head_pos" else []), "metric", "effect", "estimate"])
    df.attrs.update(metric=metric.name, clean=clean_value, corrupted=corrupted_value, by=by, what="z")
    return df


# -- importance -------------------------------------------------------------------------------------------------
def seq2seq_head_importance(model, inputs, loss=None, ablated=()) -> pd.DataFrame:
    """``head_importance`` (Michel et al. 2019) of an encoder-decoder model: a gate per example and (site, head) on
    z, importance E_x |dL(x)/dxi_h| L2-normalised within each site (Michel et al. normalise per layer of each
    attention kind: encoder, decoder and encoder-decoder). loss: e.g. ``target_loss()``. ablated: (site, head)
    pairs gated at 0, without rows. Returns ``stack``, ``kind``, ``site``, ``layer``, ``head``, ``importance``,
    ``importance_raw``."""
    _loss_fn(loss)  # a clear error without one
    source = as_metric(loss)
    batch = seq2seq_batch(model, inputs)
    ablated = set(check_site_heads(model, ablated, allow_empty=True))
    sites = model.cfg.sites
    with Shard(batch, source) as shard:  # this rank's prompts under torch.distributed, else all of them
        batch, loss_fn = shard.rows(batch), shard.metric(source).loss
        units = [(f"{s.name}.hook_z", [(s.name, h) not in ablated for h in range(s.n_heads)]) for s in sites]
        grads = _gate_gradients(model, batch, loss_fn, units)
        b = batch["input_ids"].shape[0]
        per_example = torch.cat([torch.zeros(b, s.n_heads) if g is None else g.detach().abs().float().cpu()
                                 for g, s in zip(grads, sites)], dim=1)  # (b, heads of all sites): |dL(x)/dxi_h|
        per_example = shard.gather(per_example)
    rows = []
    for s, g in zip(sites, per_example.split([s.n_heads for s in sites], dim=1)):
        raw = g.mean(0)  # (h,)
        live = [h for h in range(s.n_heads) if (s.name, h) not in ablated]
        norm = float(raw[live].norm()) if live else 0.0
        rows += [{**_columns(model, s.name, h), "importance": float(raw[h]) / norm if norm > 0 else 0.0,
                  "importance_raw": float(raw[h])} for h in live]
    return pd.DataFrame(rows, columns=[*_FRONT, "importance", "importance_raw"])
