"""The ``interp`` command line.

    interp info [MODEL]                         model summary and hook names
    interp heads      [--model M]               classify every head (detect_heads)
    interp ablate     [--model M]               effect of ablating each head alone (ablation_scan)
    interp prune      [--model M] [--save DIR]  pruning curves, importance vs random; save a pruned model
    interp plot       --layer L --head H --out PNG [--text T]   one head's attention map
    interp train-toy  --out DIR                 train the toy induction model
    interp report     --out DIR                 everything above as one HTML page

User mistakes print one line to stderr and exit 2, with no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

__all__ = ["main", "build_parser"]


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit code 2."""


# -- shared pieces ---------------------------------------------------------------------------------------
def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="toy-induction", help="bundled name (toy-induction, minilm) or model folder")
    p.add_argument("--attn", choices=["flash", "eager"], default="flash", help="attention path (default flash)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--prompts", type=Path, default=None, help="text file, one prompt a line (token ids for a "
                   "model without a tokenizer)")
    p.add_argument("--seed", type=int, default=0)


def _format_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=["table", "csv", "json"], default="table")


def _load(args):
    import interp

    return interp.load_model(args.model, attn=args.attn, device=args.device, dtype=args.dtype)


def _prompts(args) -> list[str] | None:
    if args.prompts is None:
        return None
    try:
        text = args.prompts.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read prompts file {str(args.prompts)!r}: {err.strerror if isinstance(err, OSError) else err}; "
                        "pass a UTF-8 text file with one prompt a line") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise UserError(f"prompts file {str(args.prompts)!r} has no non-empty line; put one prompt a line")
    return lines


def _emit(df, fmt: str) -> None:
    if fmt == "csv":
        print(df.to_csv(index=False), end="")
    elif fmt == "json":
        print(df.to_json(orient="records", indent=2))
    else:
        print(df.to_string(index=False, float_format=lambda v: f"{v:.4f}"))


class _Progress:
    """Stage names on a tqdm bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, stages: list[str]):
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=len(stages), file=sys.stderr, unit="stage", leave=False)
        self.started = False

    def __call__(self, stage: str) -> None:
        if self.bar is not None:
            if self.started:
                self.bar.update(1)
            self.bar.set_description(stage)
            self.started = True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _rolled(inputs):
    """The batch shifted by one sequence, so that every sequence gets another's activations."""
    import torch

    if isinstance(inputs, dict):
        return {k: None if v is None else torch.roll(v, 1, dims=0) for k, v in inputs.items()}
    return torch.roll(inputs, 1, dims=0)


def _parse_heads(text: str | None, model) -> list[tuple[int, int]] | None:
    if text is None:
        return None
    heads = []
    for item in text.split(","):
        try:
            layer, head = (int(x) for x in item.strip().split("."))
        except ValueError:
            raise UserError(f"heads are given as LAYER.HEAD separated by commas, e.g. 1.0,1.3; got {item!r}") from None
        heads.append((layer, head))
    return heads


# -- subcommands -------------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    if args.model_pos:
        args.model = args.model_pos
    model = _load(args)
    summary = model.summary()
    if args.format == "json":
        print(json.dumps({**summary, "hook_names": model.hook_names()}, indent=2))
        return 0
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")
    print(f"\nhook names ({len(model.hook_names())}):")
    from hooks import HOOK_TABLE

    for spec in HOOK_TABLE:
        if spec.per_layer and spec.name(0) not in model.hook_names():
            continue
        print(f"  {spec.template:<34} {spec.shape:<14} {spec.meaning}")
    return 0


def cmd_heads(args) -> int:
    from .heads import detect_heads

    model = _load(args)
    kinds = args.kinds.split(",") if args.kinds else None
    df = detect_heads(model, kinds=kinds, prompts=_prompts(args), n_prompts=args.n_prompts, seed=args.seed)
    if args.format == "table":
        keep = [c for c in df.columns if not c.endswith(("_lo", "_hi"))]
        df = df[keep]
    _emit(df, args.format)
    return 0


def cmd_ablate(args) -> int:
    from .ablation import ablation_scan
    from .report import study_inputs

    model = _load(args)
    inputs, metric, what = study_inputs(model, _prompts(args), n=args.n_prompts, seed=args.seed)
    # mean: each head's mean output over these inputs; resample: its output on another input of the batch
    reference = None if args.method == "zero" else inputs if args.method == "mean" else _rolled(inputs)
    df = ablation_scan(model, inputs, metric, method=args.method, heads=_parse_heads(args.heads, model),
                       reference=reference)
    if args.format == "table":
        print(f"# {metric.name} on {what}; baseline {df['baseline'].iloc[0]:.4f}")
    _emit(df, args.format)
    return 0


def cmd_prune(args) -> int:
    import pandas as pd

    from .pruning import curve_summary, head_importance, prune_model, pruning_curve
    from .report import study_inputs

    model = _load(args)
    inputs, metric, what = study_inputs(model, _prompts(args), n=args.n_prompts, seed=args.seed)
    curves = pd.concat([pruning_curve(model, inputs, metric, order="importance", step=args.step),
                        pruning_curve(model, inputs, metric, order="random", step=args.step,
                                      seeds=tuple(range(args.seed, args.seed + 3)))])
    if args.format == "table":
        print(f"# {metric.name} on {what}")
        threshold = 0.95 if metric.name == "embedding_similarity" else None
        _emit(curve_summary(curves, threshold), "table")
        print()
    _emit(curves, args.format)
    if args.save is not None:
        if args.fraction is None:
            raise UserError("--save needs --fraction: the share of heads to prune by importance, e.g. 0.3")
        if not 0 < args.fraction < 1:
            raise UserError(f"--fraction is a share of the heads in (0, 1); got {args.fraction}")
        _check_out(args.save, args.force)
        importance = head_importance(model, inputs, loss=metric)
        n = int(round(args.fraction * len(importance)))
        order = importance.sort_values("importance")
        heads = [(int(r.layer), int(r.head)) for r in order.itertuples()][:n]
        pruned = prune_model(model, heads, allow_empty_layers=True)
        pruned.hf.save_pretrained(args.save)
        if model.tokenizer is not None:
            model.tokenizer.save_pretrained(args.save)
        print(f"saved a model without {n} heads to {args.save}", file=sys.stderr)
    return 0


def cmd_plot(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import attention_heatmap
    from .report import example_prompt

    model = _load(args)
    prompts = _prompts(args)
    text = args.text if args.text is not None else example_prompt(model, prompts, args.seed)
    if isinstance(text, str) and model.tokenizer is None:
        from .report import _id_lines

        text = _id_lines([text], model)[0]
    if args.out.is_dir():
        raise UserError(f"--out {str(args.out)!r} is a folder; give a .png file path")
    if args.out.exists() and not args.force:
        raise UserError(f"{str(args.out)!r} exists; pass --force to overwrite it")
    window = tuple(args.window) if args.window else None
    ax = attention_heatmap(model, args.layer, args.head, text, window=window)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    ax.figure.savefig(args.out, dpi=110, bbox_inches="tight")
    plt.close(ax.figure)
    print(args.out)
    return 0


def cmd_train_toy(args) -> int:
    from .toy import train_toy_model

    _check_out(args.out, args.force)
    progress = None
    if sys.stderr.isatty():
        progress = lambda r: print(f"step {r['step']}: loss {r['loss']:.3f}, second copy {r['loss_second_copy']:.3f}",  # noqa: E731
                                   file=sys.stderr)
    command = f"interp train-toy --out {args.out} --seed {args.seed} --steps {args.steps}"
    metrics = train_toy_model(args.out, seed=args.seed, steps=args.steps, progress=progress, command=command)
    print(json.dumps(metrics, indent=2))
    return 0


def cmd_report(args) -> int:
    from .report import write_report

    _check_out(args.out, args.force)
    t0 = time.perf_counter()
    progress = _Progress(["load", "heads", "attention maps", "ablation", "pruning"])
    try:
        progress("load")
        model = _load(args)
        summary = write_report(model, args.out, prompts=_prompts(args), seed=args.seed, n_prompts=args.n_prompts,
                               progress=progress)
    finally:
        progress.close()
    labelled = ", ".join(f"{h['label']} {h['layer']}.{h['head']}" for h in summary["strongest_heads"]) or "none"
    print(f"wrote {args.out / 'index.html'} in {time.perf_counter() - t0:.1f} s (strongest heads: {labelled})")
    return 0


def _check_out(out: Path, force: bool) -> None:
    """An output folder may be new or empty; an existing non-empty one needs --force; a file is refused."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} is a file; give a folder path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out {str(out)!r} exists and is not empty; pass --force to write into it "
                        "(files of the same names are replaced)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="interp", description="Attention-head interpretability for HF models.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Run `interp COMMAND --help` for a command's options.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("info", help="model summary and its hook names")
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="bundled name or model folder")
    _model_options(p)
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("heads", help="classify every head (previous-token, induction, ...)")
    _model_options(p)
    _format_option(p)
    p.add_argument("--kinds", default=None, help="comma-separated score kinds (default: all that apply)")
    p.add_argument("--n-prompts", type=int, default=100)
    p.set_defaults(func=cmd_heads)

    p = sub.add_parser("ablate", help="the effect of ablating each head alone")
    _model_options(p)
    _format_option(p)
    p.add_argument("--method", choices=["zero", "mean", "resample"], default="zero")
    p.add_argument("--heads", default=None, help="LAYER.HEAD list, e.g. 1.0,1.3 (default: all heads)")
    p.add_argument("--n-prompts", type=int, default=32)
    p.set_defaults(func=cmd_ablate)

    p = sub.add_parser("prune", help="pruning curves (importance vs random); optionally save a pruned model")
    _model_options(p)
    _format_option(p)
    p.add_argument("--step", type=float, default=0.1, help="share of the remaining heads pruned per step")
    p.add_argument("--n-prompts", type=int, default=32)
    p.add_argument("--save", type=Path, default=None, help="folder to save a structurally pruned model to")
    p.add_argument("--fraction", type=float, default=None, help="with --save: share of heads to prune")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_prune)

    p = sub.add_parser("plot", help="one head's attention map as a PNG")
    _model_options(p)
    p.add_argument("--layer", type=int, required=True)
    p.add_argument("--head", type=int, required=True)
    p.add_argument("--text", default=None, help="text (or token ids) to run; default an example prompt")
    p.add_argument("--window", type=int, nargs=2, metavar=("START", "STOP"), default=None)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("train-toy", help="train the toy induction model (the bundled default)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_train_toy)

    p = sub.add_parser("report", help="an HTML report: head classes, attention maps, ablation, pruning")
    _model_options(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--n-prompts", type=int, default=64)
    p.add_argument("--force", action="store_true", help="write into a non-empty --out folder")
    p.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bar is noise in a command's output
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (UserError, FileNotFoundError, NotADirectoryError, ModuleNotFoundError, NotImplementedError,
            ValueError, IndexError, KeyError) as err:
        message = err.args[0] if err.args else str(err)
        print(f"interp {args.command}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `interp heads | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
