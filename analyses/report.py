"""``interp report``: one self-contained HTML page (and CSV/JSON/PNG files) about a model's heads.

The page embeds its figures as PNG data URIs and its style inline, so it reads offline with no network
request; the same figures are also written to ``figures/``.
"""

from __future__ import annotations

import base64
import html
import io
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # noqa: E402  (a report never opens a window)
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from interp.inputs import pad_ids  # noqa: E402
from interp.structure import describe  # noqa: E402

from .ablation import ablation_scan  # noqa: E402
from .attribution import attribution_patching, direct_logit_attribution  # noqa: E402
from .heads import corpus_sentences, detect_heads, repeated_random_tokens  # noqa: E402
from .metrics import embedding_similarity, lm_loss, second_copy_loss  # noqa: E402
from .patching import activation_patching  # noqa: E402
from .plots import (ablation_heatmap, attention_heatmap, dla_bars, head_score_grid, patching_heatmap,  # noqa: E402
                    pruning_curve_plot)
from .pruning import curve_summary, pruning_curve  # noqa: E402
from .scores import SCORE_DEFINITIONS, strongest_heads  # noqa: E402
from .tasks import induction_task  # noqa: E402
from .toy import repeated_sequences  # noqa: E402

__all__ = ["study_inputs", "prompt_batch", "example_prompt", "write_report", "REPORT_FILES"]

REPORT_FILES = ("index.html", "heads.csv", "ablation.csv", "pruning.csv", "summary.json")
_SCORES = ("previous_token", "next_token", "induction", "duplicate_token", "sink", "self", "positional_fraction")


def study_inputs(model, prompts: list | None = None, n: int = 32, seed: int = 0, copy_len: int = 12):
    """Inputs and metric for ablation and pruning studies: ``(inputs, metric, description)``.

    prompts: texts, or token-id sequences (any lengths; a model without a tokenizer takes only these). None:
    the project's sentences for models with a tokenizer, else ``n`` repeated random sequences ``[BOS, x, x]``
    with ``len(x) = copy_len``. The metric: second-copy loss on repeated sequences, causal LM loss on text,
    and for encoders the embedding similarity to the unablated model.
    """
    if prompts is None and model.tokenizer is None:
        generator = torch.Generator().manual_seed(seed)
        bos = model.hf.config.bos_token_id
        ids = repeated_sequences(n, copy_len, model.cfg.vocab_size, generator, bos)
        return ids, second_copy_loss, f"{n} repeated random sequences [BOS, x, x], len(x) = {copy_len}"
    if prompts is None:
        prompts = list(corpus_sentences()[:n])
        what = f"the first {len(prompts)} of the project's sentences"
    else:
        what = f"{len(prompts)} given prompts"
    inputs = prompt_batch(model, prompts)
    if model.cfg.causal:
        return inputs, lm_loss, what
    return inputs, embedding_similarity(model, inputs), what


def prompt_batch(model, prompts: list) -> dict:
    """Texts or token-id sequences as one padded batch ``{"input_ids", "attention_mask"}``."""
    if prompts and all(isinstance(p, str) for p in prompts):
        return model.to_tokens(prompts)
    if not prompts or any(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a non-empty list of texts or of token-id sequences, not a mix.")
    ids, mask = pad_ids(prompts, left=model.cfg.causal, pad_id=model.pad_token_id)
    return {"input_ids": ids.to(model.device), "attention_mask": mask.to(model.device)}


def example_prompt(model, prompts: list | None = None, seed: int = 0):
    """The prompt attention maps are drawn on: the first given prompt, a sentence, or a repeated sequence."""
    if prompts:
        return prompts[0] if isinstance(prompts[0], str) else torch.as_tensor(prompts[0])
    if model.tokenizer is not None:
        return "The quick brown fox jumps over the lazy dog, and the quick brown fox runs away."
    generator = torch.Generator().manual_seed(seed)
    return repeated_sequences(1, 12, model.cfg.vocab_size, generator, model.hf.config.bos_token_id)[0]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


class _Figures:
    """Writes each figure to ``figures/NAME.png`` and keeps it for embedding in the page."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.items: dict[str, bytes] = {}

    def add(self, name: str, fig) -> str:
        data = _png(fig)
        (self.folder / f"{name}.png").write_bytes(data)
        self.items[name] = data
        return name

    def img(self, name: str, alt: str) -> str:
        data = base64.b64encode(self.items[name]).decode()
        return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}">'


# Beyond this many heads, ablation and pruning studies run on a few short prompts: on a 30-layer model one scan
# is 270 forwards (README: CLI gives the measured times).
_MANY_HEADS = 100


def write_report(model, out: str | Path, prompts: list | None = None, seed: int = 0, n_prompts: int = 64,
                 progress: Callable[[str], None] | None = None, study_prompts: int | None = None) -> dict:
    """Classify heads, scan ablations, draw pruning curves and write the report into ``out``.

    Writes ``index.html``, ``heads.csv``, ``ablation.csv``, ``pruning.csv``, ``summary.json`` and
    ``figures/*.png``; returns the summary. ``progress`` is called with the name of each stage.
    study_prompts: prompts for the ablation scan and the pruning curves (default 32, or 4 for a model with
    more than 100 heads).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = _Figures(out / "figures")
    step = progress or (lambda stage: None)
    stages: list[tuple[str, float]] = []  # (stage, start time)
    t_start = time.perf_counter()
    n_heads = len(model.cfg.heads())
    if study_prompts is None:
        study_prompts = 32 if n_heads <= _MANY_HEADS else 4

    def timed(stage: str):
        step(stage)
        stages.append((stage, time.perf_counter()))

    timed("heads")
    heads = detect_heads(model, prompts=prompts, n_prompts=n_prompts, seed=seed)
    heads.to_csv(out / "heads.csv", index=False)
    scores = [s for s in _SCORES if s in heads]
    grid_size = (1.2 + 0.55 * max(model.cfg.heads_per_layer), 1.0 + 0.32 * model.cfg.n_layers)
    for score in scores:
        fig, ax = plt.subplots(figsize=grid_size)
        head_score_grid(heads, score, ax=ax)
        figures.add(f"grid_{score}", fig)
    strongest = strongest_heads(heads)

    timed("attention maps")
    maps = _attention_maps(model, strongest, prompts, seed, figures)

    timed("ablation")
    inputs, metric, inputs_what = study_inputs(model, prompts, n=min(n_prompts, study_prompts), seed=seed)
    scan = ablation_scan(model, inputs, metric)
    scan.to_csv(out / "ablation.csv", index=False)
    fig, ax = plt.subplots(figsize=grid_size)
    ablation_heatmap(scan, ax=ax)
    figures.add("ablation", fig)

    circuits = None
    if model.tokenizer is not None and model.cfg.causal and model.structure.final_norm is not None:
        timed("circuits")
        circuits = _circuits(model, figures, out, seed)

    timed("pruning")
    step_size = max(0.1, 1.0 / n_heads)
    curves = pd.concat([pruning_curve(model, inputs, metric, order="importance", step=step_size),
                        pruning_curve(model, inputs, metric, order="random", step=step_size, seeds=(0, 1, 2))])
    curves.to_csv(out / "pruning.csv", index=False)
    threshold = 0.95 if metric.name == "embedding_similarity" else None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pruning_curve_plot(curves, ax=ax, metric_name=metric.name, threshold=threshold)
    figures.add("pruning", fig)
    summary_curves = curve_summary(curves, threshold)
    ends = [start for _, start in stages[1:]] + [time.perf_counter()]
    timings = {stage: round(end - start, 2) for (stage, start), end in zip(stages, ends)}

    summary = {
        "model": model.summary(),
        "structure": describe(model.structure),
        "label_counts": {k: int(v) for k, v in heads["label"].value_counts().items()},
        "strongest_heads": strongest.to_dict(orient="records"),
        "attention_maps": [{"class": c, "layer": l, "head": h, "prompt": what} for c, l, h, what, _ in maps],
        "thresholds": heads.attrs.get("thresholds"),
        "head_inputs": heads.attrs.get("inputs"),
        "study_inputs": inputs_what,
        "metric": metric.name,
        "baseline": float(scan["baseline"].iloc[0]),
        "most_important_by_ablation": _top_ablation(scan, metric.higher_is_better),
        "pruning": summary_curves.to_dict(orient="records"),
        "circuits": circuits,
        "seconds": {**timings, "total": round(time.perf_counter() - t_start, 2)},
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "python": platform.python_version()},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "index.html").write_text(_page(summary, heads, strongest, scan, summary_curves, maps, scores, figures))
    return summary


def _circuits(model, figures, out: Path, seed: int) -> dict:
    """The induction task: attribution patching of every head (one backward), exact activation patching of the
    eight heads it ranks highest, and the direct logit attribution of the second copy's last token."""
    clean, corrupted, metric = induction_task(model, n=8, length=12, seed=seed)
    estimate = attribution_patching(model, clean, corrupted, metric)
    top = estimate.reindex(estimate["effect"].abs().sort_values(ascending=False).index).head(8)
    exact = activation_patching(model, clean, corrupted, metric, heads=list(zip(top["layer"], top["head"])))
    dla = direct_logit_attribution(model, clean[:, :-1], clean[:, -1])
    estimate.to_csv(out / "attribution.csv", index=False)
    dla.to_csv(out / "dla.csv", index=False)
    fig, ax = plt.subplots(figsize=(1.2 + 0.55 * max(model.cfg.heads_per_layer), 1.0 + 0.32 * model.cfg.n_layers))
    patching_heatmap(estimate, ax=ax, title="attribution patching: estimated effect of each head's clean output")
    figures.add("attribution", fig)
    fig, ax = plt.subplots(figsize=(6.5, 6.0))
    dla_bars(dla, top=16, ax=ax)
    figures.add("dla", fig)
    both = exact.merge(estimate[["layer", "head", "effect"]], on=["layer", "head"], suffixes=("", "_estimate"))
    return {"task": "8 sequences [BOS, x, x] (clean) against [BOS, y, x] (corrupted), |x| = 12",
            "metric": metric.name, "clean": exact.attrs["clean"], "corrupted": exact.attrs["corrupted"],
            "top_heads": [{"layer": int(r.layer), "head": int(r.head), "effect": round(float(r.effect), 4),
                           "estimate": round(float(r.effect_estimate), 4)} for r in both.itertuples()],
            "dla_logit": dla.attrs["logit"], "dla_remainder": dla.attrs["remainder"]}


def _attention_maps(model, strongest, prompts, seed, figures) -> list[tuple]:
    """The strongest head of each class on a prompt that exercises it: repeated random tokens for induction and
    duplicate-token heads (their behaviour needs an earlier occurrence), the example text for the others."""
    text = example_prompt(model, prompts, seed)
    length = min(40, model.cfg.max_positions or 40)
    repeated = repeated_random_tokens(model, 1, length, torch.Generator().manual_seed(seed))[0]
    caches: dict[str, object] = {}
    maps = []
    for kind, group in strongest.groupby("class", sort=False):
        top = group.iloc[0]
        layer, head = int(top["layer"]), int(top["head"])
        prompt, what = (repeated, "repeated random tokens") if kind in ("induction", "duplicate_token") else \
            (text, "the example text")
        if what not in caches:
            caches[what] = model.run_with_cache(prompt, names=lambda n: n.endswith(("hook_q", "hook_k")))[1]
        fig, ax = plt.subplots(figsize=(6.5, 5.5))
        attention_heatmap(caches[what], layer, head, tokens=model.to_str_tokens(_ids_of(model, prompt)), ax=ax,
                          title=f"{kind}: head {layer}.{head} (score {top['score']:.2f}) on {what}")
        maps.append((kind, layer, head, what, figures.add(f"attention_{kind}_L{layer}H{head}", fig)))
    return maps


def _ids_of(model, text):
    if isinstance(text, str):
        return model.to_tokens(text)["input_ids"][0]
    return torch.as_tensor(text)


def _top_ablation(scan: pd.DataFrame, higher_is_better: bool | None) -> list[dict]:
    worst = scan.sort_values("delta", ascending=bool(higher_is_better)).head(5)
    return [{"layer": int(r.layer), "head": int(r.head), "delta": round(float(r.delta), 4)} for r in worst.itertuples()]


_CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 2rem auto; max-width: 1100px;
       color: #222; line-height: 1.45; padding: 0 1rem; }
h1 { margin-bottom: 0.2rem; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; margin-top: 2.2rem; }
table { border-collapse: collapse; font-size: 0.88rem; margin: 0.6rem 0; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.55rem; text-align: right; }
th { background: #f4f4f4; } td.text, th.text { text-align: left; }
img { max-width: 100%; margin: 0.4rem 0.6rem 0.4rem 0; vertical-align: top; }
.grid img { max-width: 48%; } .muted { color: #666; font-size: 0.9rem; }
.side { display: flex; gap: 2rem; align-items: flex-start; } .found { margin: 0.6rem 0; font-size: 0.9rem; }
"""


def _table(df: pd.DataFrame, floatfmt: str = "{:.3f}") -> str:
    def cell(v):
        if isinstance(v, float):
            return f"<td>{floatfmt.format(v)}</td>"
        return f'<td class="text">{html.escape(str(v))}</td>'

    head = "".join(f'<th class="text">{html.escape(str(c))}</th>' for c in df.columns)
    rows = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in df.itertuples(index=False))
    return f"<table><tr>{head}</tr>{rows}</table>"


def _inputs_text(inputs: dict | None) -> str:
    """{kind: inputs} as "inputs (kind, kind); ..." """
    groups: dict[str, list[str]] = {}
    for kind, what in (inputs or {}).items():
        groups.setdefault(what, []).append(kind)
    return "; ".join(f"{what} ({', '.join(kinds)})" for what, kinds in groups.items())


def _page(summary, heads, strongest, scan, curves, maps, scores, figures) -> str:
    m = summary["model"]
    esc = html.escape
    shown = ("class", "family", "n_layers", "n_heads", "n_kv_heads", "d_head", "d_model", "block", "attn", "dtype",
             "n_params", "tokenizer")
    model_rows = pd.DataFrame([(k, str(m[k])) for k in shown if k in m], columns=["property", "value"])
    found = "".join(f"<li>{esc(line)}</li>" for line in summary["structure"])
    table = strongest.assign(
        head=[f"{l}.{h}" for l, h in zip(strongest["layer"], strongest["head"])],
        interval=[f"{lo:.3f} to {hi:.3f}" if lo == lo else "" for lo, hi in zip(strongest["lo"], strongest["hi"])],
    )[["class", "head", "score", "interval", "labels"]]
    counts = ", ".join(f"{k} {v}" for k, v in summary["label_counts"].items())
    definitions = "".join(f"<li><b>{esc(k)}</b>: {esc(v)} (threshold {summary['thresholds'].get(k, 0):g})</li>"
                          for k, v in SCORE_DEFINITIONS.items() if (k if k != "positional" else "positional_fraction")
                          in heads)
    maps_html = "".join(figures.img(name, f"attention map of {kind} head {l}.{h} on {what}")
                        for kind, l, h, what, name in maps)
    grids = "".join(figures.img(f"grid_{s}", f"{s} score per head") for s in scores)
    top = pd.DataFrame(summary["most_important_by_ablation"])
    seconds = summary["seconds"]
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>interp report: {esc(m['class'])}</title>
<style>{_CSS}</style></head><body>
<h1>Attention heads of {esc(m['class'])}</h1>
<p class="muted">interp report, {esc(time.strftime('%Y-%m-%d %H:%M'))}; attention path {esc(m['attn'])};
torch {esc(summary['versions']['torch'])}, transformers {esc(summary['versions']['transformers'])};
{seconds['total']:.1f} s on {summary['threads']} CPU thread(s).</p>

<h2>Model</h2>
<div class="side">{_table(model_rows)}<ul class="found">{found}</ul></div>

<h2>Strongest heads of each class</h2>
<p>Each class's highest-scoring heads with 95% bootstrap intervals over prompts; <b>labels</b> lists every class
a head clears, most specific first (a head's primary label is the first). Label counts: {esc(counts)}. All
{len(heads)} heads with every score and interval: <a href="heads.csv"><code>heads.csv</code></a>.</p>
{_table(table) if len(table) else '<p>No head passes a threshold.</p>'}
<ul class="muted">{definitions}</ul>
<p class="muted">Inputs: {esc(_inputs_text(summary['head_inputs']))}.</p>

<h2>Scores per head</h2>
<p>Framed cells are heads whose primary label is that class.</p>
<div class="grid">{grids}</div>

<h2>Attention maps</h2>
<p>The strongest head of each class on a prompt that exercises it: repeated random tokens for induction and
duplicate-token heads, the example text for the others.</p>
<div class="grid">{maps_html or '<p>No labelled heads to show.</p>'}</div>

<h2>Ablation scan</h2>
<p>Zero-ablating each head alone on {esc(summary['study_inputs'])}; metric <code>{esc(summary['metric'])}</code>,
baseline {summary['baseline']:.4f}. Cells show the change in the metric
(<a href="ablation.csv"><code>ablation.csv</code></a>).</p>
{figures.img('ablation', 'ablation scan heatmap')}
<p>Heads whose ablation hurts most:</p>
{_table(top, '{:.4f}')}

{_circuits_html(summary.get("circuits"), figures)}

<h2>Pruning curve</h2>
<p>Heads pruned (zero-ablated) in order of Michel et al.'s importance, recomputed at each step, against
random orders (mean of 3 seeds, range shaded); <a href="pruning.csv"><code>pruning.csv</code></a>.</p>
{figures.img('pruning', 'pruning curve')}
{_table(curves, '{:.3f}')}
<p class="muted">Stage times (s): {esc(', '.join(f'{k} {v}' for k, v in seconds.items()))}.</p>
</body></html>
"""


def _circuits_html(c, figures) -> str:
    if not c:
        return ""
    esc = html.escape
    table = pd.DataFrame(c["top_heads"]).assign(head=lambda d: [f"{l}.{h}" for l, h in zip(d["layer"], d["head"])])
    return f"""<h2>Circuits: which heads carry the induction task</h2>
<p>{esc(c['task'])}; metric <code>{esc(c['metric'])}</code> (the loss of the clean second copy), clean
{c['clean']:.3f}, corrupted {c['corrupted']:.3f}. <b>Attribution patching</b> estimates, from one backward pass,
how much of the way from corrupted to clean each head's clean output alone would take the model (effect 0:
corrupted, 1: clean; <a href="attribution.csv"><code>attribution.csv</code></a>); the eight heads it ranks highest
were then patched exactly (<b>activation patching</b>):</p>
{figures.img('attribution', 'attribution patching heatmap')}
{_table(table[['head', 'effect', 'estimate']], '{:.3f}')}
<p><b>Direct logit attribution</b> of the last token of the clean second copy: each component's direct
contribution to the correct token's logit ({c['dla_logit']:.2f}; what the split leaves out:
{c['dla_remainder']:.1e}; <a href="dla.csv"><code>dla.csv</code></a>).</p>
{figures.img('dla', 'direct logit attribution bars')}"""
