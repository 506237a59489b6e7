"""``interp report`` for an encoder-decoder model: its heads per attention site, on the copy task.

The same files as the decoder-only report (``index.html``, ``heads.csv``, ``ablation.csv``, ``pruning.csv``,
``attribution.csv``, ``summary.json``, ``figures/``) and the same rules (one self-contained page, no request):

- heads: ``seq2seq_heads`` (self-attention scores per stack; cross-attention alignment, source-sink and
  source-positional), each with its 95% interval, on the copy task (the decoder reproduces the source);
- the interactive grid of every site's heads and a head view of the site of the best-aligned cross head;
- a zero-ablation scan and attribution patching (first half of the source corrupted) per ``(site, head)`` with
  the teacher-forced loss of the targets, and pruning curves by importance against random orders.

Text prompts (``prompts=``) are copied too (source = target), which is what a denoising model (BART) was trained
to do; without a tokenizer the copy task's random tokens are used.
"""

from __future__ import annotations

import html
import json
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch

from ..attribution import attribution_patching
from ..heads import detect_heads
from ..pruning import curve_summary
from ..seq2seq import CROSS_KINDS, copy_patching_task, copy_task
from ..metrics import target_loss
from .attention import attention_grid, head_view
from .report_parts import _Figures, _formats
from .report_studies import _ablation, _pruning
from .report_page import _CSS, _table
from .seq2seq import CROSS_DEFINITIONS
from .study_plots import head_score_grid, patching_heatmap

__all__ = ["write_seq2seq_report", "seq2seq_study_inputs"]

_SELF_SCORES = ("previous_token", "next_token", "sink", "self", "duplicate_token", "induction")
_COPY_LENGTH = 10


def seq2seq_study_inputs(model, prompts: list | None = None, n: int = 16, seed: int = 0):
    """``(batch, metric, description)`` for the studies: ``n`` copy-task pairs of random tokens, or the given
    texts (or token-id lists) as both source and target; the metric is the teacher-forced loss of the targets."""
    if prompts is None:
        return (copy_task(model, n, _COPY_LENGTH, seed), target_loss(),
                f"{n} copy-task pairs of {_COPY_LENGTH} random tokens (the target is the source), teacher-forced")
    if all(isinstance(p, str) for p in prompts):
        source = model.to_tokens(list(prompts[:n]))
    else:
        from interp.inputs import pad_ids

        ids, mask = pad_ids([torch.as_tensor(p) for p in prompts[:n]], left=False, pad_id=model.pad_token_id)
        source = {"input_ids": ids.to(model.device), "attention_mask": mask.to(model.device)}
    labels = source["input_ids"].masked_fill(source["attention_mask"] == 0, -100)
    batch = {**source, "decoder_input_ids": model.decoder_inputs(labels), "labels": labels,
             "decoder_attention_mask": torch.cat([torch.ones_like(source["attention_mask"][:, :1]),
                                                  source["attention_mask"][:, :-1]], 1)}
    return batch, target_loss(), f"{len(labels)} given prompts, each copied (source = target), teacher-forced"


def write_seq2seq_report(model, out: str | Path, prompts: list | None = None, seed: int = 0, n_prompts: int = 64,
                         progress: Callable[[str], None] | None = None, study_prompts: int | None = None,
                         fmt: str | Sequence[str] = "png") -> dict:
    """``write_report`` for an encoder-decoder ``HookedModel`` (see the module docstring)."""
    formats = _formats(fmt)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = _Figures(out / "figures", formats)
    step = progress or (lambda stage: None)
    stages: list[tuple[str, float]] = []
    t_start = time.perf_counter()
    n_heads = len(model.cfg.heads())
    study_prompts = study_prompts or (16 if n_heads <= 200 else 4)

    def timed(stage: str):
        step(stage)
        stages.append((stage, time.perf_counter()))

    timed("heads")
    heads = detect_heads(model, n_prompts=n_prompts, seed=seed)
    heads.to_csv(out / "heads.csv", index=False)
    sites = list(model.cfg.sites)
    width = max(s.n_heads for s in sites)
    size = (2.4 + 1.05 * width, 1.2 + 0.46 * len(sites))
    scores = [s for s in ("alignment", "source_sink", "source_positional_fraction", *_SELF_SCORES)
              if s in heads and heads[s].notna().any()]
    for score in scores:
        fig, ax = plt.subplots(figsize=size)
        head_score_grid(heads, score, ax=ax)
        figures.add(f"grid_{score}", fig)
    cross = heads[heads["kind"] == "cross"].sort_values("alignment", ascending=False)

    timed("views")
    example = copy_task(model, 1, _COPY_LENGTH, seed + 7)
    grid = attention_grid(model, example, scores=heads, title="every head on a copy-task pair")
    shown = cross.iloc[0]["site"] if len(cross) else sites[-1].name
    view = head_view(model, example, layers=[shown], title=f"{shown} on a copy-task pair")

    timed("ablation")
    batch, metric, inputs_what = seq2seq_study_inputs(model, prompts, n=min(n_prompts, study_prompts), seed=seed)
    scan = _ablation(model, batch, metric, figures, out, size)

    timed("attribution")
    clean, corrupted, patch_metric = copy_patching_task(model, min(n_prompts, study_prompts), _COPY_LENGTH, seed)
    estimate = attribution_patching(model, clean, corrupted, patch_metric)
    estimate.to_csv(out / "attribution.csv", index=False)
    fig, ax = plt.subplots(figsize=size)
    patching_heatmap(estimate, ax=ax, title="attribution patching: estimated effect of each head's clean output")
    figures.add("attribution", fig)

    timed("pruning")
    curves = _pruning(model, batch, metric, figures, out, n_heads)
    ends = [start for _, start in stages[1:]] + [time.perf_counter()]

    summary = {
        "model": model.summary(),
        "sites": [{"site": s.name, "stack": s.stack, "block": s.block, "kind": s.kind, "heads": s.n_heads}
                  for s in sites],
        "label_counts": {k: int(v) for k, v in heads["label"].value_counts().items()},
        "best_aligned": [{"site": r.site, "head": int(r.head), "alignment": round(float(r.alignment), 4)}
                         for r in cross.head(5).itertuples()],
        "head_view_site": shown,
        "study_inputs": inputs_what,
        "metric": metric.name,
        "baseline": float(scan["baseline"].iloc[0]),
        "most_important_by_ablation": [{"site": r.site, "head": int(r.head), "delta": round(float(r.delta), 4)}
                                       for r in scan.sort_values("delta", ascending=False).head(5).itertuples()],
        "attribution": {"clean": estimate.attrs.get("clean"), "corrupted": estimate.attrs.get("corrupted"),
                        "top": [{"site": r.site, "head": int(r.head), "effect": round(float(r.effect), 4)}
                                for r in estimate.reindex(estimate["effect"].abs().sort_values(ascending=False).index)
                                .head(5).itertuples()]},
        "pruning": curve_summary(curves).to_dict(orient="records"),
        "figure_formats": list(formats),
        "seconds": {**{stage: round(end - start, 2) for (stage, start), end in zip(stages, ends)},
                    "total": round(time.perf_counter() - t_start, 2)},
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "python": platform.python_version()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "index.html").write_text(_page(summary, heads, scores, figures, grid.html, view.html))
    return summary


def _page(summary, heads, scores, figures, grid_html: str, view_html: str) -> str:
    esc = html.escape
    m = summary["model"]
    sites = pd.DataFrame(summary["sites"])
    best = pd.DataFrame(summary["best_aligned"])
    top = pd.DataFrame(summary["most_important_by_ablation"])
    attribution = pd.DataFrame(summary["attribution"]["top"])
    definitions = "".join(f"<li><b>{k}</b>: {esc(CROSS_DEFINITIONS[k])}</li>" for k in CROSS_KINDS)
    grids = "".join(f"<figure>{figures.img(f'grid_{s}', f'{s} per head')}<figcaption><b>{esc(s)}</b>"
                    "</figcaption></figure>" for s in scores)
    files = ["heads.csv", "ablation.csv", "attribution.csv", "pruning.csv", "summary.json"]
    seconds = summary["seconds"]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,"><title>interp report: {esc(m['class'])}</title>
<style>{_CSS}</style></head><body>
<h1>Attention heads of {esc(m['class'])} (encoder-decoder)</h1>
<p class="muted">interp report, {esc(time.strftime('%Y-%m-%d %H:%M'))}; attention path {esc(m['attn'])};
torch {esc(summary['versions']['torch'])}, transformers {esc(summary['versions']['transformers'])};
{seconds['total']:.1f} s on {summary['threads']} CPU thread(s). Files:
{', '.join(f'<a href="{f}"><code>{f}</code></a>' for f in files)}; figures in <code>figures/</code>.</p>

<h2>Attention sites</h2>
<p>Each attention module is a site: the encoder's self-attention, the decoder's (causal) self-attention and its
cross-attention, whose queries come from the decoder and keys and values from the encoder's output.</p>
{_table(sites)}

<h2>Cross-attention heads</h2>
<p>Scores on the copy task (the decoder reproduces the source, teacher-forced), each with its 95% bootstrap
interval in <a href="heads.csv"><code>heads.csv</code></a>:</p><ul>{definitions}</ul>
<p>Best-aligned cross-attention heads:</p>
{_table(best, '{:.3f}') if len(best) else '<p>No cross-attention heads.</p>'}
<p>Label counts: {esc(', '.join(f'{k} {v}' for k, v in summary['label_counts'].items()))}.</p>

<h2>Explore every head</h2>
<p>One row per site; click a head to open its pattern with its scores.</p>
{grid_html}
<h2>{esc(summary['head_view_site'])}, token by token</h2>
{view_html}

<h2>Static figures</h2>
<details><summary>Scores per head: {len(scores)} grids (blank: a score that does not apply to that kind of
attention)</summary>{grids}</details>

<h2>Ablation scan</h2>
<p>Zero-ablating each head alone on {esc(summary['study_inputs'])}; metric <code>{esc(summary['metric'])}</code>,
baseline {summary['baseline']:.4f} (<a href="ablation.csv"><code>ablation.csv</code></a>).</p>
{figures.img('ablation', 'ablation scan heatmap')}
{_table(top, '{:.4f}')}

<h2>Attribution patching</h2>
<p>The first half of each source replaced by other tokens (corrupted) against the copy task (clean); metric: the
loss of the clean targets; effect 0: corrupted, 1: clean, estimated from one backward pass
(<a href="attribution.csv"><code>attribution.csv</code></a>).</p>
{figures.img('attribution', 'attribution patching heatmap')}
{_table(attribution, '{:.3f}')}

<h2>Pruning curve</h2>
<p>Heads zero-ablated in order of importance (recomputed at each step) against random orders
(<a href="pruning.csv"><code>pruning.csv</code></a>).</p>
{figures.img('pruning', 'pruning curve')}
<p class="muted">Stage times (s): {esc(', '.join(f'{k} {v}' for k, v in seconds.items()))}.</p>
</body></html>
"""
