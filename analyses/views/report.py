"""``interp report``: one self-contained HTML page (and CSV/JSON/figure files) about a model's heads, the same page
for every model: its sections (heads table and score grids, the grid and head views, ablation, circuits, pruning)
read the model's attention sites, a head is ``(site, head)`` (``layer.head`` where each layer has one site), and a
section a kind of model cannot have is skipped with a one-line note saying why. What differs is data: the inputs
(an encoder-decoder model's studies run on the copy task, ``analyses.data.seq2seq``, or on its prompts copied), and the
scores its heads have (cross-attention alignment, source sink and source positional).

The page embeds its figures as 2x PNG data URIs (shown at 100 px per inch: no text under 10 px), the interactive
attention grid and head views (``attention.py``) and its style inline, so it reads offline with no network
request; the figures are also written to ``figures/`` as PNG, SVG or PDF (``fmt``).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib.pyplot as plt  # noqa: E402  (the backend stays the user's: figures are saved and closed, never shown)
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from interp.runtime.files import staged_folder  # noqa: E402
from interp.runtime.progress import progress_enabled  # noqa: E402
from interp.structure.layered import describe  # noqa: E402

from ..heads.detect import detect_heads  # noqa: E402
from ..heads.labels import strongest_heads  # noqa: E402
from ..data.prompts import repeated_random_tokens, study_inputs  # noqa: E402
from ..causal.pruning import curve_summary  # noqa: E402
from ..data.seq2seq import COPY_LENGTH, copy_study_inputs, copy_task, is_seq2seq  # noqa: E402
from ..heads import registry  # noqa: E402
from ..data.toy import repeated_sequences  # noqa: E402
from .attention import attention_grid, head_view, model_tokens  # noqa: E402
from .plots import attention_heatmap  # noqa: E402
from .report_page import page  # noqa: E402
from .report_parts import _Figures, _formats  # noqa: E402
from ..atlas.class_ablation import class_ablation  # noqa: E402
from .report_sinks import sinks_apply, sinks_section  # noqa: E402
from .report_story import findings, head_name, model_name, model_size, site_lines  # noqa: E402
from .report_streaming import check_streaming, streaming_section  # noqa: E402
from .report_circuit import edge_circuit  # noqa: E402
from .report_studies import _MANY_HEADS, _ablation, _circuits, _pruning, circuit_task, pruning_step  # noqa: E402
from .runs import _Run  # noqa: E402
from .study_plots import head_score_grid  # noqa: E402

__all__ = ["example_prompt", "write_report", "REPORT_FILES"]

REPORT_FILES = ("index.html", "heads.csv", "ablation.csv", "pruning.csv", "summary.json")


def example_prompt(model, prompts: list | None = None, seed: int = 0):
    """The prompt attention maps are drawn on: the first given prompt, a sentence, or a repeated sequence (for an
    encoder-decoder model a (source, target) pair that copies it, or a copy-task pair)."""
    if is_seq2seq(model):
        if prompts:
            first = prompts[0] if isinstance(prompts[0], str) else torch.as_tensor(prompts[0])
            return first, first
        if model.tokenizer is not None:
            sentence = "The quick brown fox jumps over the lazy dog."
            return sentence, sentence
        return copy_task(model, 1, COPY_LENGTH, seed)  # the copy toy trains on this length
    if prompts:
        return prompts[0] if isinstance(prompts[0], str) else torch.as_tensor(prompts[0])
    if model.tokenizer is not None:
        return "The quick brown fox jumps over the lazy dog, and the quick brown fox runs away."
    generator = torch.Generator().manual_seed(seed)
    return repeated_sequences(1, 12, model.cfg.vocab_size, generator, model.hf.config.bos_token_id)[0]




def write_report(model, out: str | Path, prompts: list | None = None, seed: int = 0, n_prompts: int | None = None,
                 progress: Callable[[str], None] | None = None, study_prompts: int | None = None,
                 fmt: str | Sequence[str] = "png", overwrite: bool = False, streaming: bool = False) -> dict:
    """Classify heads, scan ablations, draw pruning curves and write the report into ``out``: the same page for every
    model (an encoder-decoder model's heads per attention site, its studies on the copy task or its prompts copied).

    Writes ``index.html``, ``heads.csv``, ``ablation.csv``, ``pruning.csv``, ``summary.json`` and
    ``figures/*.{fmt}``; returns the summary. ``progress`` is called with the name of each stage (default: a line per
    stage on stderr where progress is shown, ``interp.runtime.progress``).
    n_prompts: prompts per head score (default 64, or 32 for a model with more than 100 heads, whose bootstrap
    intervals stay narrow: on SmolLM2 the widest is 0.10, BENCHMARKS.md).
    study_prompts: prompts for the ablation scan and the pruning curves (default 32, or 4 for a model with
    more than 100 heads; pruning steps of 10% of the remaining heads, or 20% there).
    fmt: the format(s) of the figure files, ``"png"``, ``"svg"`` or ``"pdf"`` (vector, for papers), or several
    (``("png", "pdf")``). The page itself always embeds 2x PNGs.
    overwrite: replace the files of an earlier report in ``out`` (those its ``summary.json`` lists under ``files``);
    other files there, also in ``figures/``, are left alone. Without it an existing report file is an error. Every file is written into a staging folder first and moved into
    ``out`` only when all are written (``interp.runtime.files.staged_folder``): a full disk or an error midway leaves
    ``out`` as it was.
    streaming: add a streaming section (``report_streaming``: heads streamed in order of their induction score
    against random orders, the KV cache beside the metric; ``streaming.csv``). Off by default (it adds a stage);
    causal decoders only, else a ValueError.
    """
    _formats(fmt)
    if streaming:
        check_streaming(model)
    earlier = _earlier_files(out) if overwrite else ()
    with staged_folder(out, overwrite, names=(*REPORT_FILES, "streaming.csv", "figures"), earlier=earlier) as staging, \
            model.studying():  # eval mode and the global RNG untouched for every stage (no dropout in a map)
        return _write_report(model, staging, prompts, seed, n_prompts, progress, study_prompts, fmt, streaming)


def _write_report(model, out: Path, prompts, seed, n_prompts, progress, study_prompts, fmt, streaming=False) -> dict:
    formats = _formats(fmt)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figures = _Figures(out / "figures", formats)
    step = progress or _print_stage
    stages: list[tuple[str, float]] = []  # (stage, start time)
    t_start = time.perf_counter()
    sites = list(model.cfg.sites)
    n_heads = len(model.cfg.heads())
    many = n_heads > _MANY_HEADS
    if study_prompts is None:
        study_prompts = 4 if many else 32
    if n_prompts is None:
        n_prompts = 32 if many else 64

    def timed(stage: str):
        step(stage)
        stages.append((stage, time.perf_counter()))

    timed("heads")
    copied = is_seq2seq(model) and prompts is not None  # a source-target model's prompts are scored copied
    heads = detect_heads(model, prompts=copy_study_inputs(model, prompts, n_prompts)[0] if copied else prompts,
                         n_prompts=n_prompts, seed=seed)
    heads.to_csv(out / "heads.csv", index=False)
    scores = [s for s in registry.columns() if s in heads and heads[s].notna().any()]  # ours and a user's
    width = max(s.n_heads for s in sites)
    grid_size = (1.2 + 0.55 * width, 1.0 + 0.32 * len(sites))
    # score grids carry each value's interval below it: wider, taller cells
    score_size = (2.0 + 1.05 * width, 1.2 + 0.46 * len(sites))
    with_intervals = []
    for score in scores:
        fig, ax = plt.subplots(figsize=score_size)
        head_score_grid(heads, score, ax=ax)
        if any("–" in t.get_text() for t in ax.texts):
            with_intervals.append(score)
        figures.add(f"grid_{score}", fig)
    strongest = strongest_heads(heads)

    timed("attention maps")
    maps, shown = _attention_maps(model, strongest, prompts, seed, figures)
    views = _views(heads, strongest, shown, sites)

    timed("ablation")
    inputs, metric, inputs_what = study_inputs(model, prompts, n=min(n_prompts, study_prompts), seed=seed,
                                               same_length=many)
    scan = _ablation(model, inputs, metric, figures, out, grid_size)

    task, circuits_note = circuit_task(model, seed)
    circuits = None
    if task is not None:
        timed("circuits")
        circuits = _circuits(model, task, figures, out, grid_size)
        circuits["edge_circuit"] = edge_circuit(model, task, figures)

    timed("classes")
    by_class = class_ablation(model, heads, seed=seed)

    sinks = None
    if sinks_apply(model):
        timed("sinks")
        sinks = sinks_section(model, seed)

    timed("pruning")
    threshold = 0.95 if metric.name == "embedding_similarity" else None
    curves = _pruning(model, inputs, metric, figures, out, n_heads, threshold)
    summary_curves = curve_summary(curves, threshold)
    stream = None
    if streaming:
        timed("streaming")
        stream = streaming_section(model, heads, figures, out, seed)
    ends = [start for _, start in stages[1:]] + [time.perf_counter()]
    timings = {stage: round(end - start, 2) for (stage, start), end in zip(stages, ends)}
    aligned = heads[heads["alignment"].notna()].sort_values("alignment", ascending=False) if "alignment" in heads \
        else heads.iloc[:0]

    structure = getattr(model, "structure", None)
    summary = {
        "model": {**model.summary(), "name": model_name(model), "size": model_size(model)},
        "structure": describe(structure) if structure is not None else site_lines(sites),
        "sites": [{"site": s.name, "stack": s.stack, "block": s.block, "kind": s.kind, "heads": s.n_heads}
                  for s in sites],
        "label_counts": {k: int(v) for k, v in heads["label"].value_counts().items()},
        "strongest_heads": strongest.to_dict(orient="records"),
        "attention_maps": [{"class": c, "site" if isinstance(l, str) else "layer": l, "head": h, "prompt": what}
                           for c, l, h, what, _ in maps],
        "views": {"grid": views["grid_prompt"], "head_views": views["head_views"]},
        "head_view_site": views["first_site"],
        **({"best_aligned": [{"site": r.site, "head": int(r.head), "alignment": round(float(r.alignment), 4)}
                             for r in aligned.head(5).itertuples()]} if "alignment" in heads else {}),
        "grids_with_intervals": with_intervals,
        "figure_formats": list(formats),
        "thresholds": heads.attrs.get("thresholds"),
        "stability": heads.attrs.get("stability"),
        "head_inputs": heads.attrs.get("inputs"),
        "study_inputs": inputs_what,
        "metric": metric.name,
        "baseline": float(scan["baseline"].iloc[0]),
        "most_important_by_ablation": _top_ablation(scan, metric.higher_is_better),
        "pruning": summary_curves.to_dict(orient="records"),
        "pruning_step": pruning_step(n_heads),
        "circuits": circuits,
        "class_ablation": by_class,
        **({"sinks": sinks} if sinks else {}),
        "skipped": {k: v for k, v in (("circuits", circuits_note),
                                      ("class_ablation", None if by_class else _NOT_CAUSAL)) if v},
        "higher_is_better": metric.higher_is_better,
        **({"streaming": stream} if stream else {}),
        "seconds": {**timings, "total": round(time.perf_counter() - t_start, 2)},
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "python": platform.python_version()},
    }
    summary["findings"] = findings(summary, heads)
    # what this report wrote, so that the next one with overwrite replaces these and leaves the user's files alone
    summary["files"] = sorted({p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} |
                              {"summary.json", "index.html"})
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "index.html").write_text(page(summary, heads, strongest, scan, summary_curves, maps, scores, figures,
                                         views))
    return summary


_NOT_CAUSAL = ("the class test ablates each class against random heads on repeated random tokens [BOS, x, x] and "
               "reads the in-context gain of a causal LM's next-token loss; this model is not a causal LM")
_REPEATED = "repeated random tokens"
_TEXT = "the example text"


def _prompt_of(kind: str) -> str:
    """Induction and duplicate-token heads need an earlier occurrence: repeated random tokens; others the text."""
    record = registry.of_column(kind)
    return _REPEATED if record is not None and record.prompts == "repeated" else _TEXT


def _attention_maps(model, strongest, prompts, seed, figures) -> tuple[list[tuple], dict]:
    """The strongest head of each class on a prompt that exercises it (``_prompt_of``). Returns the maps,
    ``{prompt: (cache or model, tokens or input)}`` for the views (the interactive grid's first: the repeated random
    tokens). A model whose sites read a source and a target has one example, a (source, target) pair, for every
    class."""
    text = example_prompt(model, prompts, seed)
    if is_seq2seq(model):
        what = "the first prompt, copied" if prompts else f"{_TEXT}, copied" if model.tokenizer is not None \
            else "a copy-task pair"
        return _pair_maps(model, strongest, text, what, figures), {what: (model, text)}
    length = min(40, model.cfg.max_positions or 40)
    repeated = repeated_random_tokens(model, 1, length, torch.Generator().manual_seed(seed))[0]
    shown: dict[str, tuple] = {}

    def run(what: str):
        if what not in shown:
            prompt = repeated if what == _REPEATED else text
            cache = model.run_with_cache(prompt, names=lambda n: n.endswith(("hook_q", "hook_k")))[1]
            shown[what] = cache, model_tokens(model, _ids_of(model, prompt))
        return shown[what]

    run(_REPEATED)
    maps = []
    for kind, group in strongest.groupby("class", sort=False):
        top = group.iloc[0]
        layer, head, what = int(top["layer"]), int(top["head"]), _prompt_of(kind)
        cache, tokens = run(what)
        fig, ax = plt.subplots(figsize=(8.6, 7.6))  # 40 tokens: rows tall enough to label every one
        attention_heatmap(cache, layer, head, tokens=tokens, ax=ax,
                          title=f"{kind}: head {layer}.{head} (score {top['score']:.2f}) on {what}")
        maps.append((kind, layer, head, what, figures.add(f"attention_{kind}_L{layer}H{head}", fig)))
    return maps, shown


def _pair_maps(model, strongest, pair, what: str, figures) -> list[tuple]:
    """The strongest head of each class on a (source, target) pair: each site's queries and keys labelled with the
    tokens of the sequence they come from (cross-attention: target down, source across)."""
    run = _Run.of(model, pair, 0, None)
    index = {p.name: i for i, p in enumerate(run.places)}
    maps = []
    for kind, group in strongest.groupby("class", sort=False):
        top = group.iloc[0]
        site, head = top["site"], int(top["head"])
        place = run.places[index[site]]
        fig, ax = plt.subplots(figsize=(8.6, 7.6))
        attention_heatmap(run.pattern(index[site], [head])[0], tokens=run.tokens[place.queries],
                          key_tokens=run.tokens[place.keys], ax=ax,
                          title=f"{kind}: head {site}.{head} (score {top['score']:.2f}) on {what}")
        maps.append((kind, site, head, what, figures.add(f"attention_{kind}_{site.replace('.', '_')}_H{head}", fig)))
    return maps


def _views(heads, strongest, shown, sites) -> dict:
    """The interactive attention grid (every head on the first prompt shown, framed by its scores) and one head view
    per prompt of the strongest heads of the classes that prompt exercises; heads as ``(site, head)`` where the
    table has sites that are not layers."""
    grid_prompt = next(iter(shown))
    grid = attention_grid(*shown[grid_prompt], scores=heads, title=f"every head on {grid_prompt}")
    prompt_of = lambda kind: _prompt_of(kind) if _prompt_of(kind) in shown else grid_prompt  # noqa: E731
    where = strongest["site"] if "site" in strongest else strongest["layer"]
    head_views, html_parts, first_site = [], [], None
    order = list(dict.fromkeys(prompt_of(kind) for kind in strongest["class"]))  # the most specific class's first
    for what in order + [w for w in shown if w not in order]:
        source, tokens = shown[what]
        # strongest first (classes most specific first, then by score): the view opens on the first head's site
        rows = [(kind, w if isinstance(w, str) else int(w), int(h))
                for kind, w, h in zip(strongest["class"], where, strongest["head"]) if prompt_of(kind) == what]
        pairs = list(dict.fromkeys((w, h) for _, w, h in rows))
        if pairs:
            named = ", ".join(dict.fromkeys(f"{w}.{h} {kind.replace('_', '-')}" for kind, w, h in rows))
            html_parts.append(head_view(source, tokens, heads=pairs, title=f"strongest heads on {what}: {named}").html)
            head_views.append({"prompt": what, "heads": [f"{w}.{h}" for w, h in pairs]})
            first = pairs[0][0]
            first_site = first_site or (first if isinstance(first, str) else sites[first].name)
    return {"grid": grid.html, "grid_prompt": grid_prompt, "head_views": head_views, "head_views_html": html_parts,
            "first_site": first_site}


def _print_stage(stage: str) -> None:
    """The report's stages on stderr, where progress is shown (``interp.runtime.progress``: bars, or lines for a log)."""
    if progress_enabled():
        print(f"interp report: {stage}", file=sys.stderr, flush=True)


def _earlier_files(out) -> tuple[str, ...]:
    """The files an earlier report in ``out`` wrote (its summary's ``files``); none where it has no readable list."""
    try:
        files = json.loads((Path(out) / "summary.json").read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        return ()
    return tuple(f for f in files if isinstance(f, str)) if isinstance(files, list) else ()


def _ids_of(model, text):
    if isinstance(text, str):
        return model.to_batch(text)["input_ids"][0]
    return torch.as_tensor(text)


def _top_ablation(scan: pd.DataFrame, higher_is_better: bool | None) -> list[dict]:
    worst = scan.sort_values("delta", ascending=bool(higher_is_better)).head(5)
    return [{**head_name(r, "dict"), "delta": round(float(r.delta), 4)} for r in worst.itertuples()]
