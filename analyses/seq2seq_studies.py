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
from .attribution import attribution_patching
from .engine import Shard
from .metrics import Metric, _main_output, as_metric, batch_of
from .patching import activation_patching, paired_batches
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
_paired = paired_batches
seq2seq_activation_patching = activation_patching  # one activation patching for every model


seq2seq_attribution_patching = attribution_patching  # one attribution patching for every model


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
