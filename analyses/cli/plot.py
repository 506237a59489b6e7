"""`interp plot`: one head's attention map, a score grid, an ablation scan or pruning curves as a figure."""

from __future__ import annotations

from pathlib import Path

from .common import (load_score_modules, score_module_option, UserError, _check_out_file, _id_line, _load,
                     _model_options, _positive_int, _prompts, _rank_zero_path, _read_csv, _refuse_seq2seq)
from .prune import _pruning_curves


def add_parser(sub) -> None:
    """`interp plot`: its options."""
    p = sub.add_parser("plot", help="a figure as a PNG: one head's attention map, a score grid, a scan or a curve")
    p.add_argument("kind", nargs="?", choices=["attention", "heads", "ablation", "pruning"], default="attention",
                   help="attention (default): one head's map; heads: a score per head; ablation: a scan; "
                        "pruning: curves")
    _model_options(p)
    p.add_argument("--layer", type=int, default=None, help="attention: the head's layer")
    p.add_argument("--head", type=int, default=None, help="attention: the head's index in its layer")
    p.add_argument("--text", default=None, help="attention: text (or token ids) to run; default an example prompt")
    p.add_argument("--window", type=int, nargs=2, metavar=("START", "STOP"), default=None,
                   help="attention: show positions START..STOP-1 of a longer sequence")
    p.add_argument("--score", default="induction", help="heads: the score column to draw (default induction)")
    p.add_argument("--csv", type=Path, default=None, help="heads/ablation/pruning: draw this table (e.g. a report's "
                   "heads.csv) instead of computing it")
    p.add_argument("--n-prompts", type=_positive_int, default=32, help="heads/ablation/pruning without --csv")
    p.add_argument("--step", type=float, default=0.1, help="pruning without --csv: share pruned per step")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--force", action="store_true")
    score_module_option(p)
    p.set_defaults(func=cmd_plot)


def cmd_plot(args) -> int:
    load_score_modules(args)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..views import plots, study_plots

    if args.out.is_dir():
        raise UserError(f"--out {str(args.out)!r} is a folder; give a .png, .svg or .pdf file path")
    if args.out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UserError(f"--out {str(args.out)!r}: figures are written as .png, .svg or .pdf (vector, for papers)")
    _check_out_file(args.out, args.force)
    if args.kind == "attention":
        if args.layer is None or args.head is None:
            raise UserError("`interp plot attention` needs --layer and --head, e.g. --layer 1 --head 3")
        if args.csv is not None:
            raise UserError("--csv goes with `interp plot heads|ablation|pruning`; an attention map runs the model")
        from ..views.report import example_prompt

        model = _load(args)
        _refuse_seq2seq(model, "interp plot attention", "use interp view (every attention site, with a selector).")
        text = args.text if args.text is not None else example_prompt(model, _prompts(args, model), args.seed)
        if isinstance(text, str) and model.tokenizer is None:
            import torch

            text = torch.tensor(_id_line(text, "--text"))
        window = tuple(args.window) if args.window else None
        ax = plots.attention_heatmap(model, args.layer, args.head, text, window=window)
    else:
        metric_name = None
        if args.csv is not None:
            df = _read_csv(args.csv)
        elif args.kind == "heads":
            from ..heads.detect import detect_heads

            model = _load(args)
            df = detect_heads(model, prompts=_prompts(args, model), n_prompts=args.n_prompts, seed=args.seed)
        else:
            from ..causal.ablation import ablation_scan
            from ..data.prompts import study_inputs

            model = _load(args)
            inputs, metric, _ = study_inputs(model, _prompts(args, model), n=args.n_prompts, seed=args.seed)
            metric_name = metric.name
            df = (ablation_scan(model, inputs, metric) if args.kind == "ablation"
                  else _pruning_curves(model, inputs, metric, args.step, args.seed))
        if args.kind == "heads":
            ax = study_plots.head_score_grid(df, args.score)
        elif args.kind == "ablation":
            ax = study_plots.ablation_heatmap(df, metric_name=metric_name)
        else:
            ax = study_plots.pruning_curve_plot(df, metric_name=metric_name)
    plots.save_figure(ax, _rank_zero_path(args.out), dpi=110, overwrite=args.force)
    plt.close(ax.figure)
    print(args.out)
    return 0
