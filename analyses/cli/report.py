"""`interp report`: everything above as one HTML page."""

from __future__ import annotations

import time
from pathlib import Path

from .common import (_Progress, _check_out, _load, _model_options, _positive_int, _prompts, _rank_zero_path,
                     load_score_modules, score_module_option)


def add_parser(sub) -> None:
    """`interp report`: its options."""
    p = sub.add_parser("report", help="an HTML report: head classes, attention maps, ablation, pruning")
    _model_options(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--n-prompts", type=_positive_int, default=None, help="prompts per head score (default 64, or 32 "
                   "for a model with more than 100 heads)")
    p.add_argument("--fmt", default="png", help="format(s) of the files in figures/: png, svg, pdf, or a comma list "
                   "(svg,pdf: vector, for papers); the page always embeds 2x PNGs")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out folder: the files of an earlier "
                   "report there are replaced, other files (also in figures/) stay")
    p.add_argument("--streaming", action="store_true", help="add a streaming-heads section (sinks + a recent window, "
                   "in order of the induction score against random orders; causal decoders only)")
    score_module_option(p)
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from interp.runtime.progress import progress_lines_off_a_terminal

    from ..views.report import write_report
    from ..views.report_parts import _formats
    from ..views.report_streaming import check_streaming

    _check_out(args.out, args.force)
    load_score_modules(args)
    fmt = _formats([f.strip() for f in args.fmt.split(",") if f.strip()])
    t0 = time.perf_counter()
    stages = ["load", "heads", "attention maps", "ablation", "circuits", "classes", "sinks", "pruning"]
    # a bar on a terminal; where stderr is a file, a line as each stage starts, and the studies' own lines (a report
    # on SmolLM2 ran 4.5 minutes with nothing printed after the model's conversion line)
    with _Progress(stages + (["streaming"] if args.streaming else []), lines="interp report") as progress, \
            progress_lines_off_a_terminal():
        progress("load")
        model = _load(args)
        prompts = _prompts(args, model)
        if args.streaming:
            check_streaming(model)  # a mistake found here is the only line on stderr: no stage line before it
        summary = write_report(model, _rank_zero_path(args.out), prompts=prompts, seed=args.seed,
                               n_prompts=args.n_prompts, progress=progress, fmt=fmt, overwrite=args.force,
                               streaming=args.streaming)
    if summary.get("best_aligned"):  # a model with cross-attention heads: those that align target to source
        found = "best-aligned cross-attention heads: " + ", ".join(
            f"{b['site']}.{b['head']} {b['alignment']:.2f}" for b in summary["best_aligned"][:3])
    else:
        labelled = ", ".join(f"{m['class']} {m.get('site', m.get('layer'))}.{m['head']}"
                             for m in summary["attention_maps"]) or "none"
        found = f"strongest heads: {labelled}"
    threads = summary.get("threads")  # the time means little without the threads it ran on
    ran = f" on {threads} thread{'s' if threads != 1 else ''}" if threads else ""
    print(f"wrote {args.out / 'index.html'} in {time.perf_counter() - t0:.1f} s{ran} ({found})")
    return 0
