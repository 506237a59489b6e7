"""The studies ``interp report`` runs beside the head scores, sized for the time they take: the ablation scan, the
pruning curves and a circuit task (the induction task on a causal LM, the copy task on an encoder-decoder model),
each writing its table and figure. They are the one study of every model: heads are ``(site, head)``."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from interp.attention.sites import is_layered, row_head

from ..causal.ablation import ablation_scan
from ..causal.attribution import attribution_patching
from ..explain.logit_attribution import direct_logit_attribution
from ..causal.engine import copies_per_forward
from ..data.batches import batch_of
from ..causal.patching import activation_patching
from ..causal.pruning import pruning_curve
from ..data.seq2seq import COPY_LENGTH, copy_patching_task, is_seq2seq
from ..data.tasks import induction_task
from .study_plots import ablation_heatmap, dla_bars, patching_heatmap, pruning_curve_plot

__all__ = ["circuit_task", "pruning_step"]

# Beyond this many heads, ablation and pruning studies run on a few short prompts: on a 30-layer model one scan
# is 270 forwards (README: CLI gives the measured times).
_MANY_HEADS = 100


def _copies(model, inputs) -> int | None:
    """Copies of a small batch per forward of a scan: on CPU about 256 tokens, where the engine's memory budget would
    give fewer (SmolLM2's 4 prompts: 3 copies took 12% less CPU time than 1, 9 copies more; BENCHMARKS.md)."""
    if model.device.type != "cpu":
        return None
    batch = batch_of(model, inputs)
    return max(copies_per_forward(model, batch, None), 256 // batch["input_ids"].numel())


def _ablation(model, inputs, metric, figures, out: Path, size) -> pd.DataFrame:
    """The zero-ablation scan of every head: ``ablation.csv`` and its heatmap (both reports), several copies of a
    small batch per forward (``_copies``)."""
    scan = ablation_scan(model, inputs, metric, heads_per_forward=_copies(model, inputs))
    scan.to_csv(out / "ablation.csv", index=False)
    fig, ax = plt.subplots(figsize=size)
    ablation_heatmap(scan, ax=ax)
    figures.add("ablation", fig)
    return scan


def pruning_step(n_heads: int) -> float:
    """The share of the remaining heads each pruning step removes: 10%, or 20% beyond 100 heads (SmolLM2's 270: 11
    steps instead of 21 down to one head per layer), and at least one head."""
    return max(0.2 if n_heads > _MANY_HEADS else 0.1, 1.0 / n_heads)


def _pruning(model, inputs, metric, figures, out: Path, n_heads: int, threshold: float | None = None) -> pd.DataFrame:
    """Pruning curves by importance and by 3 random orders (their pruned sets several per forward, as the ablation
    scan's heads): ``pruning.csv`` and the plot (both reports)."""
    step_size = pruning_step(n_heads)
    curves = pd.concat([pruning_curve(model, inputs, metric, order="importance", step=step_size),
                        pruning_curve(model, inputs, metric, order="random", step=step_size, seeds=(0, 1, 2),
                                      sets_per_forward=_copies(model, inputs))])
    curves.to_csv(out / "pruning.csv", index=False)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pruning_curve_plot(curves, ax=ax, metric_name=metric.name, threshold=threshold)
    figures.add("pruning", fig)
    return curves


def circuit_task(model, seed: int) -> tuple[dict | None, str | None]:
    """``(task, None)``, or ``(None, why)`` where the model has no circuit task: the task's clean and corrupted inputs,
    its metric, and the inputs and answer whose logit direct logit attribution splits. A model whose sites read a
    source and a target: the copy task with the first half of each source corrupted (``copy_patching_task``); a causal
    LM with a tokenizer and a final norm: the induction task, [BOS, x, x] against [BOS, y, x]."""
    if is_seq2seq(model):
        clean, corrupted, metric = copy_patching_task(model, 8, COPY_LENGTH, seed)
        return {"name": "the copy task", "clean": clean, "corrupted": corrupted, "metric": metric,
                "dla": (clean, clean["labels"][:, -1]), "answer": "the last target token",
                "task": f"8 copy-task pairs of {COPY_LENGTH} random tokens (clean) against the same pairs with the "
                        "first half of each source replaced by other tokens (corrupted)",
                "measures": "the teacher-forced loss of the clean targets"}, None
    structure = getattr(model, "structure", None)
    if model.tokenizer is None or not model.cfg.causal or structure is None or structure.final_norm is None:
        lacks = ("a tokenizer" if model.tokenizer is None else "causal attention" if not model.cfg.causal
                 else "a final norm")
        return None, (f"the induction-task circuit (patching and direct logit attribution of [BOS, x, x] against "
                      f"[BOS, y, x]) needs a causal LM with a tokenizer and a final norm; this model has no {lacks}")
    clean, corrupted, metric = induction_task(model, n=8, length=12, seed=seed)
    return {"name": "the induction task", "clean": clean, "corrupted": corrupted, "metric": metric,
            "dla": (clean[:, :-1], clean[:, -1]), "answer": "the last token of the clean second copy",
            "task": "8 sequences [BOS, x, x] (clean) against [BOS, y, x] (corrupted), |x| = 12",
            "measures": "the loss of the clean second copy"}, None


def _circuits(model, task: dict, figures, out: Path, size) -> dict:
    """The circuit task: attribution patching of every head (one backward), exact activation patching of the eight
    heads it ranks highest, and the direct logit attribution of the task's answer."""
    clean, corrupted, metric = task["clean"], task["corrupted"], task["metric"]
    estimate = attribution_patching(model, clean, corrupted, metric)
    top = estimate.reindex(estimate["effect"].abs().sort_values(ascending=False).index).head(8)
    exact = activation_patching(model, clean, corrupted, metric, heads=[row_head(model, r) for r in top.itertuples()])
    dla = direct_logit_attribution(model, *task["dla"])
    estimate.to_csv(out / "attribution.csv", index=False)
    dla.to_csv(out / "dla.csv", index=False)
    fig, ax = plt.subplots(figsize=size)
    patching_heatmap(estimate, ax=ax, title="attribution patching: estimated effect of each head's clean output")
    figures.add("attribution", fig)
    fig, ax = plt.subplots(figsize=(6.5, 6.0))
    dla_bars(dla, top=16, ax=ax)
    figures.add("dla", fig)
    both = exact.merge(estimate[["site", "head", "effect"]], on=["site", "head"], suffixes=("", "_estimate"))
    layered = is_layered(model)
    return {"task": task["task"], "name": task["name"], "measures": task["measures"], "answer": task["answer"],
            "metric": metric.name, "clean": exact.attrs["clean"], "corrupted": exact.attrs["corrupted"],
            "top_heads": [{**({} if layered else {"site": r.site}), "layer": int(r.layer), "head": int(r.head),
                           "effect": round(float(r.effect), 4), "estimate": round(float(r.effect_estimate), 4)}
                          for r in both.itertuples()],
            "dla_logit": dla.attrs["logit"], "dla_remainder": dla.attrs["remainder"]}
