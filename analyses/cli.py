"""The ``interp`` command line.

    interp info [MODEL]                         model summary and hook names
    interp heads      [--model M]               classify every head (detect_heads)
    interp ablate     [--model M]               effect of ablating each head alone (ablation_scan)
    interp prune      [--model M] [--save DIR]  pruning curves, importance vs random; save a pruned model
    interp plot       --layer L --head H --out PNG [--text T]   one head's attention map
    interp plot       heads|ablation|pruning [--csv FILE] --out PNG   a score grid, scan or curve
    interp view       [head|grid] --out HTML [--text T]   an interactive view, one offline page
    interp patch      [--model M]               activation, attribution or path patching of every head
    interp attribute  [--model M]               direct logit attribution (or --lens: the logit lens)
    interp train-toy  --out DIR                 train the toy induction model
    interp report     --out DIR                 everything above as one HTML page

User mistakes print one line to stderr and exit 2, with no traceback.

Under ``torchrun --nproc_per_node N -m analyses.cli ...`` (or ``accelerate launch``) every command runs unchanged:
the studies split their prompts across the ranks, and only rank 0 prints and writes files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main", "build_parser", "BUNDLED_NAMES"]

# interp.BUNDLED's names, for the help text without importing torch (tests/test_cli.py checks that they agree)
BUNDLED_NAMES = ("smollm2", "gemma3", "toy-induction", "minilm")


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit code 2."""


def _positive_int(text: str) -> int:
    """argparse type of a count: a whole number of at least 1 (0 prompts would run a study on nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r} (a whole number of at least 1)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1; got {value}")
    return value


_DEVICES = "auto, cpu, cuda, cuda:N or mps"


def _check_device(device: str | None) -> None:
    """--device names a device torch knows and this machine has."""
    if device in (None, "auto"):
        return
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise UserError(f"--device must be {_DEVICES}; got {device!r}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: torch sees no CUDA device on this machine; use --device cpu (or auto)")
    if kind not in ("cpu", "cuda", "mps"):
        raise UserError(f"--device must be {_DEVICES}; got {device!r}")


def _one_line(err: BaseException) -> str:
    """An error as one line: an OSError's reason and path, else the first line of its message."""
    if isinstance(err, OSError) and err.strerror:
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror}{where}"
    text = (err.args[0] if err.args and isinstance(err.args[0], str) else str(err)).strip()
    return (text.splitlines() or [type(err).__name__])[0]


def _user_mistake(err: BaseException) -> bool:
    """What the user can fix, reported in one line: a bad command line or input (UserError and the ValueError,
    IndexError, KeyError, TypeError and NotImplementedError our checks raise on what was given), a missing
    package, and anything the file system refuses (a path in the way, a folder that is a file, no permission, a
    full disk: OSError). Anything else is a bug of ours, and keeps its traceback."""
    return isinstance(err, (UserError, ValueError, IndexError, KeyError, NotImplementedError, ModuleNotFoundError,
                            OSError))


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the usage block would bury the one line that says what is wrong."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


# -- shared pieces ---------------------------------------------------------------------------------------
def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="toy-induction", help=f"bundled name ({', '.join(BUNDLED_NAMES)}) or model "
                   "folder")
    p.add_argument("--attn", choices=["flash", "eager"], default="flash", help="attention path (default flash)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--prompts", type=Path, default=None, help="text file, one prompt a line (token ids for a "
                   "model without a tokenizer)")
    p.add_argument("--seed", type=int, default=0)
    _threads_option(p)


def _threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", default="auto", metavar="N|auto",
                   help="torch CPU threads (default auto: the idle cores, CPUs minus the 1-minute load average, at "
                        "least 1; on a 2-core machine with one other busy process two threads ran slower than one)")


def _set_threads(value: str) -> int:
    """Set torch's CPU threads from --threads (``interp.set_threads``) and return the count."""
    from interp.threads import set_threads

    try:
        return set_threads(value)
    except ValueError:
        raise UserError(f"--threads takes a positive integer or 'auto'; got {value!r}") from None


def _circuit_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clean", default=None, help="clean input text (or token ids); default: the induction task")
    p.add_argument("--corrupted", default=None, help="corrupted input, the same length in tokens as --clean")
    p.add_argument("--answer", default=None, help="with --clean: the correct next token (text or id)")
    p.add_argument("--wrong", default=None, help="with --clean: the wrong next token; metric logit[answer] - logit[wrong]")
    p.add_argument("--n-prompts", type=_positive_int, default=16, help="sequences of the induction task")
    p.add_argument("--top", type=_positive_int, default=20, help="table: the heads with the largest effects")


def _format_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=["table", "csv", "json"], default="table")


def _load(args):
    """The model of --model. A folder the user gave that does not load (an invalid config.json, no weights, a
    truncated weight file, an unknown model type) is their mistake, whatever transformers raises: one line."""
    import interp

    _check_device(args.device)
    folder = args.model not in interp.BUNDLED
    try:
        return interp.load_model(args.model, attn=args.attn, device=args.device, dtype=args.dtype)
    except (UserError, ModuleNotFoundError):
        raise
    except Exception as err:  # noqa: BLE001  (the folder is the user's; anything it makes fail is reported)
        if not folder:
            raise
        raise UserError(f"cannot load the model folder {str(args.model)!r}: {_one_line(err)}") from None


def _prompts(args, model) -> list[str] | list[list[int]] | None:
    """The --prompts file, one prompt a line: texts for a model with a tokenizer, else space-separated token
    ids (any lengths). The one reader of prompt files for every command."""
    if args.prompts is None:
        return None
    try:
        text = args.prompts.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read prompts file {str(args.prompts)!r}: {err.strerror if isinstance(err, OSError) else err}; "
                        "pass a UTF-8 text file with one prompt a line") from None
    lines = [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise UserError(f"prompts file {str(args.prompts)!r} has no non-empty line; put one prompt a line")
    if model.tokenizer is not None:
        return [line for _, line in lines]
    return [_id_line(line, f"{args.prompts} line {i}") for i, line in lines]


def _id_line(line: str, where: str) -> list[int]:
    try:
        return [int(t) for t in line.split()]
    except ValueError:
        raise UserError(f"{where}: this model has no tokenizer, so a prompt is space-separated token ids, e.g. "
                        f"'0 5 17 5'; got {line[:40]!r}") from None


def _number(v: float) -> str:
    """A table's float: an integer value as an integer (a rank), else 4 decimals."""
    return f"{v:.0f}" if float(v).is_integer() and abs(v) < 1e15 else f"{v:.4f}"


def _emit(df, fmt: str) -> None:
    if fmt == "csv":
        print(df.to_csv(index=False), end="")
    elif fmt == "json":
        print(df.to_json(orient="records", indent=2))
    else:
        print(df.to_string(index=False, float_format=_number))


class _Progress:
    """Stage names on a tqdm bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, stages: list[str]):
        from interp import distributed

        self.bar = None
        if sys.stderr.isatty() and distributed.rank_zero():
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

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
    for item in text.split(","):  # LAYER.HEAD, or SITE.HEAD for an encoder-decoder model's attention sites
        try:
            where, head = item.strip().rsplit(".", 1)
            heads.append((int(where) if where.isdigit() else where, int(head)))
        except ValueError:
            raise UserError(f"heads are given as LAYER.HEAD separated by commas, e.g. 1.0,1.3 (an encoder-decoder "
                            f"model's as SITE.HEAD, e.g. decoder.blocks.0.cross_attn.1); got {item!r}") from None
    return heads


def _refuse_seq2seq(model, what: str, instead: str) -> None:
    from .seq2seq import is_seq2seq

    if is_seq2seq(model):
        raise UserError(f"{what} does not handle encoder-decoder models yet; {instead}")


# -- subcommands -------------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    if args.model_pos:
        args.model = args.model_pos
    model = _load(args)
    summary = model.summary()
    if args.format == "json":
        print(json.dumps({**summary, "hook_names": model.hook_names()}, indent=2))
        return 0
    if args.format == "csv":
        import pandas as pd

        _emit(pd.DataFrame({"property": list(summary), "value": [str(v) for v in summary.values()]}), "csv")
        return 0
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")
    from interp.structure import describe

    print("\nfound by the load probe:")
    for line in describe(model.structure):
        print(f"  {line}")
    print(f"\nhook names ({len(model.hook_names())}):")
    from hooks import HOOK_TABLE

    for spec in HOOK_TABLE:
        if spec.per_layer and spec.name(0) not in model.hook_names():
            continue
        print(f"  {spec.template:<34} {spec.shape:<14} {spec.meaning}")
    return 0


def cmd_heads(args) -> int:
    from .heads import detect_heads

    with _Progress(["load", "heads"]) as progress:
        progress("load")
        model = _load(args)
        kinds = args.kinds.split(",") if args.kinds else None
        progress("heads")
        df = detect_heads(model, kinds=kinds, prompts=_prompts(args, model), n_prompts=args.n_prompts, seed=args.seed,
                          context=args.context)
    if args.format == "table":
        keep = [c for c in df.columns if not c.endswith(("_lo", "_hi"))]
        df = df[keep]
    _emit(df, args.format)
    return 0


def cmd_ablate(args) -> int:
    from .ablation import ablation_scan
    from .views.report import study_inputs

    with _Progress(["load", "ablation scan"]) as progress:
        progress("load")
        model = _load(args)
        inputs, metric, what = study_inputs(model, _prompts(args, model), n=args.n_prompts, seed=args.seed)
        # mean: each head's mean output over these inputs; resample: its output on another input of the batch
        reference = None if args.method == "zero" else inputs if args.method == "mean" else _rolled(inputs)
        progress("ablation scan")
        df = ablation_scan(model, inputs, metric, method=args.method, heads=_parse_heads(args.heads, model),
                           reference=reference)
    if args.format == "table":
        print(f"# {metric.name} on {what}; baseline {df['baseline'].iloc[0]:.4f}")
    _emit(df, args.format)
    return 0


def cmd_prune(args) -> int:
    from interp import distributed

    from .pruning import curve_summary, head_importance, prune_model
    from .views.report import study_inputs

    if args.save is not None:  # check before any work
        if args.fraction is None:
            raise UserError("--save needs --fraction: the share of heads to prune by importance, e.g. 0.3")
        if not 0 < args.fraction < 1:
            raise UserError(f"--fraction is a share of the heads in (0, 1); got {args.fraction}")
        _check_out(args.save, args.force)
    elif args.fraction is not None:
        raise UserError("--fraction goes with --save DIR (where the pruned model is written)")
    with _Progress(["load", "pruning curves"]) as progress:
        progress("load")
        model = _load(args)
        if args.save is not None:
            _refuse_seq2seq(model, "--save (a structurally pruned copy)", "drop --save to get the pruning curves.")
        inputs, metric, what = study_inputs(model, _prompts(args, model), n=args.n_prompts, seed=args.seed)
        progress("pruning curves")
        curves = _pruning_curves(model, inputs, metric, args.step, args.seed)
    if args.format == "table":
        print(f"# {metric.name} on {what}")
        threshold = 0.95 if metric.name == "embedding_similarity" else None
        _emit(curve_summary(curves, threshold), "table")
        print()
    _emit(curves, args.format)
    if args.save is not None:
        importance = head_importance(model, inputs, loss=metric)
        n = int(round(args.fraction * len(importance)))
        left = dict(enumerate(model.cfg.heads_per_layer))
        heads = []  # the n least important, keeping at least one head in every layer
        for r in importance.sort_values(["importance", "layer", "head"]).itertuples():
            if len(heads) < n and left[r.layer] > 1:
                heads.append((int(r.layer), int(r.head)))
                left[r.layer] -= 1
        pruned = prune_model(model, heads)
        from interp.files import staged_folder

        with staged_folder(_rank_zero_path(args.save), overwrite=args.force) as staging:  # whole, or not at all
            pruned.save_pretrained(staging)
        if distributed.rank_zero():
            print(f"saved a model without {len(heads)} heads ({', '.join(f'{l}.{h}' for l, h in heads)}) to "
                  f"{args.save}", file=sys.stderr)
    return 0


def _read_csv(path: Path):
    import pandas as pd

    try:
        return pd.read_csv(path)
    except (OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise UserError(f"cannot read table {str(path)!r}: {getattr(err, 'strerror', None) or err}; pass a CSV "
                        "written by `interp heads/ablate/prune --format csv` or by `interp report`") from None


def _pruning_curves(model, inputs, metric, step: float, seed: int):
    import pandas as pd

    from .pruning import pruning_curve

    return pd.concat([pruning_curve(model, inputs, metric, order="importance", step=step),
                      pruning_curve(model, inputs, metric, order="random", step=step,
                                    seeds=tuple(range(seed, seed + 3)))])


def cmd_plot(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .views import plots

    if args.out.is_dir():
        raise UserError(f"--out {str(args.out)!r} is a folder; give a .png, .svg or .pdf file path")
    if args.out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UserError(f"--out {str(args.out)!r}: figures are written as .png, .svg or .pdf (vector, for papers)")
    if args.out.exists() and not args.force:
        raise UserError(f"{str(args.out)!r} exists; pass --force to overwrite it")
    if not args.out.parent.is_dir():
        raise UserError(f"the folder of --out, {str(args.out.parent)!r}, does not exist; create it first "
                        f"(mkdir -p {args.out.parent})")
    if args.kind == "attention":
        if args.layer is None or args.head is None:
            raise UserError("`interp plot attention` needs --layer and --head, e.g. --layer 1 --head 3")
        if args.csv is not None:
            raise UserError("--csv goes with `interp plot heads|ablation|pruning`; an attention map runs the model")
        from .views.report import example_prompt

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
            from .heads import detect_heads

            model = _load(args)
            df = detect_heads(model, prompts=_prompts(args, model), n_prompts=args.n_prompts, seed=args.seed)
        else:
            from .ablation import ablation_scan
            from .views.report import study_inputs

            model = _load(args)
            inputs, metric, _ = study_inputs(model, _prompts(args, model), n=args.n_prompts, seed=args.seed)
            metric_name = metric.name
            df = (ablation_scan(model, inputs, metric) if args.kind == "ablation"
                  else _pruning_curves(model, inputs, metric, args.step, args.seed))
        if args.kind == "heads":
            ax = plots.head_score_grid(df, args.score)
        elif args.kind == "ablation":
            ax = plots.ablation_heatmap(df, metric_name=metric_name)
        else:
            ax = plots.pruning_curve_plot(df, metric_name=metric_name)
    plots.save_figure(ax, _rank_zero_path(args.out), dpi=110, overwrite=args.force)
    plt.close(ax.figure)
    print(args.out)
    return 0


def cmd_view(args) -> int:
    from .views import attention_grid, head_view
    from .views.report import example_prompt

    if args.out.suffix.lower() not in (".html", ".htm"):
        raise UserError(f"--out {str(args.out)!r}: a view is one .html page")
    if args.out.exists() and not args.force:
        raise UserError(f"{str(args.out)!r} exists; pass --force to overwrite it")
    if not args.out.parent.is_dir():
        raise UserError(f"the folder of --out, {str(args.out.parent)!r}, does not exist; create it first "
                        f"(mkdir -p {args.out.parent})")
    if args.kind == "grid" and (args.layers or args.heads):
        raise UserError("--layers and --heads go with `interp view head`; the grid shows every head")
    from .seq2seq import is_seq2seq

    model = _load(args)
    text = args.text if args.text is not None else example_prompt(model, _prompts(args, model), args.seed)
    if isinstance(text, str) and model.tokenizer is None:
        import torch

        text = torch.tensor(_id_line(text, "--text"))
    if is_seq2seq(model) and args.text is not None:
        text = (text, text)  # the decoder copies the source (what a denoising model such as BART does)
    window = tuple(args.window) if args.window else None
    if args.kind == "grid":
        scores = _read_csv(args.csv) if args.csv is not None else None
        view = attention_grid(model, text, score=args.score, scores=scores, window=window)
    else:
        layers = None if args.layers is None else [int(x) if x.isdigit() else x  # an index, or a seq2seq site
                                                   for x in args.layers.replace(",", " ").split()]
        view = head_view(model, text, layers=layers, heads=_parse_heads(args.heads, model), window=window)
    view.save(_rank_zero_path(args.out), overwrite=args.force)
    print(args.out)
    return 0


def _circuit_inputs(args, model):
    """(clean, corrupted, metric, description): the induction task by default, or --clean/--corrupted texts with
    --answer/--wrong tokens (a logit difference at the last position)."""
    from .attribution import token_ids
    from .metrics import logit_difference
    from .tasks import induction_task

    from .seq2seq import copy_patching_task, is_seq2seq

    if is_seq2seq(model):
        if args.clean is not None or args.corrupted is not None:
            raise UserError("--clean/--corrupted are for decoder-only models; an encoder-decoder model is patched on "
                            "the copy task (omit them), or from Python with analyses.activation_patching on batches.")
        clean, corrupted, metric = copy_patching_task(model, n=args.n_prompts, seed=args.seed)
        return clean, corrupted, metric, (f"the copy task ({args.n_prompts} pairs; corrupted: the first half of "
                                          "each source replaced)")
    if args.clean is None and args.corrupted is None:
        clean, corrupted, metric = induction_task(model, n=args.n_prompts, length=12, seed=args.seed)
        return clean, corrupted, metric, f"the induction task ({args.n_prompts} sequences [BOS, x, x] against [BOS, y, x])"
    if args.clean is None or args.corrupted is None or args.answer is None or args.wrong is None:
        raise UserError("give --clean, --corrupted, --answer and --wrong together (or none of them for the "
                        "induction task)")
    clean, corrupted = _text_or_ids(args.clean, model), _text_or_ids(args.corrupted, model)
    answer, wrong = (int(token_ids(model, _token(v), 1, name)[0]) for v, name in ((args.answer, "--answer"),
                                                                                    (args.wrong, "--wrong")))
    return clean, corrupted, logit_difference(answer, wrong), f"{args.clean!r} against {args.corrupted!r}"


def _text_or_ids(value: str, model):
    import torch

    if model.tokenizer is None:
        return torch.tensor([_id_line(value, "the input")])
    return model.to_tokens(value)


def _token(value: str):
    return int(value) if value.strip().lstrip("-").isdigit() else value


def cmd_patch(args) -> int:
    from .attribution import attribution_patching
    from .patching import activation_patching, path_patching

    with _Progress(["load", args.method]) as progress:
        progress("load")
        model = _load(args)
        if args.method == "path":
            _refuse_seq2seq(model, "--method path", "use --method activation or attribution (per site and head).")
        clean, corrupted, metric, what = _circuit_inputs(args, model)
        progress(args.method)
        if args.method == "activation":
            df = activation_patching(model, clean, corrupted, metric, by=args.by, what=args.what)
        elif args.method == "attribution":
            df = attribution_patching(model, clean, corrupted, metric, by=args.by)
        else:
            if not args.receivers:
                raise UserError("--method path needs --receivers LAYER.HEAD,... (the heads the path ends in)")
            df = path_patching(model, clean, corrupted, _parse_heads(args.receivers, model), metric, via=args.via)
    if args.format == "table":
        a = df.attrs
        print(f"# {args.method} patching of {a.get('what', 'z')} on {what}; {a['metric']}: clean {a['clean']:.4f}, "
              f"corrupted {a['corrupted']:.4f}; effect 0 = corrupted, 1 = clean")
        df = df.reindex(df["effect"].abs().sort_values(ascending=False).index).head(args.top)
    _emit(df, args.format)
    return 0


def cmd_attribute(args) -> int:
    from .attribution import direct_logit_attribution, logit_lens, token_ids

    with _Progress(["load", "attribution"]) as progress:
        progress("load")
        model = _load(args)
        _refuse_seq2seq(model, "interp attribute (logit attribution reads one residual stream)",
                        "use interp patch --method attribution (per site and head).")
        if args.text is None:
            from .tasks import induction_task

            clean, _, _ = induction_task(model, n=args.n_prompts, length=12, seed=args.seed)
            inputs, answer, wrong = clean[:, :-1], clean[:, -1], None
            what = "the induction task's second copy, last token"
        else:
            if args.answer is None:
                raise UserError("--text needs --answer (the next token to attribute), and optionally --wrong")
            inputs = _text_or_ids(args.text, model)
            answer = token_ids(model, _token(args.answer), 1, "--answer")
            wrong = None if args.wrong is None else token_ids(model, _token(args.wrong), 1, "--wrong")
            what = repr(args.text)
        progress("attribution")
        if args.lens:
            df = logit_lens(model, inputs, answer=answer)
        else:
            df = direct_logit_attribution(model, inputs, answer, wrong)
    if args.format == "table" and not args.lens:
        print(f"# direct logit attribution on {what}: logit{' difference' if wrong is not None else ''} "
              f"{df.attrs['logit']:.4f}, remainder {df.attrs['remainder']:.2e}")
        df = df.reindex(df["attribution"].abs().sort_values(ascending=False).index).head(args.top)
    _emit(df, args.format)
    return 0


def cmd_train_toy(args) -> int:
    import inspect

    import torch

    from .toy import train_toy_model

    _check_out(args.out, args.force)
    from interp import distributed

    if distributed.world_size() > 1:
        raise UserError("train-toy trains in one process; run it without torchrun")
    steps = args.steps if args.steps is not None else inspect.signature(train_toy_model).parameters["steps"].default
    if steps < 1:
        raise UserError(f"--steps must be at least 1; got {steps}")
    bar, done = None, [0]
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=steps, file=sys.stderr, unit="step", leave=False)

    def progress(record: dict) -> None:
        if bar is not None:
            bar.update(record["step"] - done[0])
            done[0] = record["step"]
            bar.set_postfix(loss=f"{record['loss']:.3f}", second_copy=f"{record['loss_second_copy']:.3f}")

    command = f"interp train-toy --out {args.out} --seed {args.seed} --steps {steps} --threads {torch.get_num_threads()}"
    try:
        from interp.files import staged_folder

        with staged_folder(args.out, overwrite=args.force) as staging:  # the folder appears whole, or not at all
            metrics = train_toy_model(staging, seed=args.seed, steps=steps, progress=progress, command=command)
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(metrics, indent=2))
    return 0


def cmd_report(args) -> int:
    from .views.report import write_report

    _check_out(args.out, args.force)
    t0 = time.perf_counter()
    progress = _Progress(["load", "heads", "attention maps", "ablation", "circuits", "classes", "pruning"])
    try:
        progress("load")
        model = _load(args)
        summary = write_report(model, _rank_zero_path(args.out), prompts=_prompts(args, model), seed=args.seed,
                               n_prompts=args.n_prompts, progress=progress,
                               fmt=[f.strip() for f in args.fmt.split(",") if f.strip()], overwrite=args.force)
    finally:
        progress.close()
    if "attention_maps" in summary:
        labelled = ", ".join(f"{m['class']} {m['layer']}.{m['head']}" for m in summary["attention_maps"]) or "none"
        found = f"strongest heads: {labelled}"
    else:  # an encoder-decoder model's report
        found = "best-aligned cross-attention heads: " + (", ".join(
            f"{b['site']}.{b['head']} {b['alignment']:.2f}" for b in summary["best_aligned"][:3]) or "none")
    print(f"wrote {args.out / 'index.html'} in {time.perf_counter() - t0:.1f} s ({found})")
    return 0


def _check_out(out: Path, force: bool) -> None:
    """An output folder may be new or empty; an existing non-empty one needs --force; a file is refused."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} is a file; give a folder path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out {str(out)!r} exists and is not empty; pass --force to write into it "
                        "(files of the same names are replaced)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="interp", description="Attention-head interpretability for HF models.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Run `interp COMMAND --help` for a command's options.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("info", help="model summary and its hook names")
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="bundled name or model folder")
    _model_options(p)
    _format_option(p)
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("heads", help="classify every head (previous-token, induction, ...)")
    _model_options(p)
    _format_option(p)
    p.add_argument("--kinds", "--scores", dest="kinds", default=None,
                   help="comma-separated score kinds (default: all attention-pattern kinds that apply); on request also "
                        "successor, copy_suppression, name_mover, s_inhibition, function_vector, retrieval")
    p.add_argument("--context", type=_positive_int, default=None, metavar="TOKENS",
                   help="with --scores retrieval: the longest needle-in-a-haystack prompt (default: the model's "
                        "positions, at most 8192)")
    p.add_argument("--n-prompts", type=_positive_int, default=100)
    p.set_defaults(func=cmd_heads)

    p = sub.add_parser("ablate", help="the effect of ablating each head alone")
    _model_options(p)
    _format_option(p)
    p.add_argument("--method", choices=["zero", "mean", "resample"], default="zero")
    p.add_argument("--heads", default=None, help="LAYER.HEAD list, e.g. 1.0,1.3 (default: all heads)")
    p.add_argument("--n-prompts", type=_positive_int, default=32)
    p.set_defaults(func=cmd_ablate)

    p = sub.add_parser("prune", help="pruning curves (importance vs random); optionally save a pruned model")
    _model_options(p)
    _format_option(p)
    p.add_argument("--step", type=float, default=0.1, help="share of the remaining heads pruned per step")
    p.add_argument("--n-prompts", type=_positive_int, default=32)
    p.add_argument("--save", type=Path, default=None, help="folder to save a structurally pruned model to")
    p.add_argument("--fraction", type=float, default=None, help="with --save: share of heads to prune")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_prune)

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
    p.set_defaults(func=cmd_plot)

    p = sub.add_parser("view", help="an interactive view as one offline HTML page: a head view or the grid of heads")
    p.add_argument("kind", nargs="?", choices=["head", "grid"], default="head",
                   help="head (default): lines between query and key tokens; grid: every head as a thumbnail")
    _model_options(p)
    p.add_argument("--text", default=None, help="text (or token ids) to run; default an example prompt")
    p.add_argument("--layers", default=None, help="head: layers to offer, e.g. 17,18 (default all)")
    p.add_argument("--heads", default=None, help="head: LAYER.HEAD list, e.g. 17.4,18.6 (instead of --layers)")
    p.add_argument("--window", type=int, nargs=2, metavar=("START", "STOP"), default=None,
                   help="show positions START..STOP-1 of a longer text")
    p.add_argument("--score", default=None, help="grid: the score that frames the thumbnails first")
    p.add_argument("--csv", type=Path, default=None, help="grid: scores from this table (a report's heads.csv) "
                   "instead of running detect_heads")
    p.add_argument("--out", type=Path, required=True, help="the .html page to write")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_view)

    p = sub.add_parser("patch", help="activation, attribution or path patching of every head")
    _model_options(p)
    _format_option(p)
    _circuit_options(p)
    p.add_argument("--method", choices=["activation", "attribution", "path"], default="activation")
    p.add_argument("--what", choices=["z", "q", "k", "v", "pattern"], default="z",
                   help="activation patching: which activation of a head is patched (pattern: eager path only)")
    p.add_argument("--by", choices=["head", "head_pos"], default="head")
    p.add_argument("--receivers", default=None, help="path patching: LAYER.HEAD list the paths end in")
    p.add_argument("--via", choices=["q", "k", "v"], default="q", help="path patching: the receivers' input")
    p.set_defaults(func=cmd_patch)

    p = sub.add_parser("attribute", help="direct logit attribution of every head and MLP (or the logit lens)")
    _model_options(p)
    _format_option(p)
    p.add_argument("--text", default=None, help="the input (default: the induction task's second copy)")
    p.add_argument("--answer", default=None, help="the next token to attribute (a token or its id)")
    p.add_argument("--wrong", default=None, help="attribute logit[answer] - logit[wrong]")
    p.add_argument("--lens", action="store_true", help="print the logit lens instead")
    p.add_argument("--n-prompts", type=_positive_int, default=16)
    p.add_argument("--top", type=_positive_int, default=20, help="table: the largest components")
    p.set_defaults(func=cmd_attribute)

    p = sub.add_parser("train-toy", help="train the toy induction model (the bundled default)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="training steps (default: train_toy_model's, 3000)")
    _threads_option(p)
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_train_toy)

    p = sub.add_parser("report", help="an HTML report: head classes, attention maps, ablation, pruning")
    _model_options(p)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--n-prompts", type=_positive_int, default=None, help="prompts per head score (default 64, or 32 "
                   "for a model with more than 100 heads)")
    p.add_argument("--fmt", default="png", help="format(s) of the files in figures/: png, svg, pdf, or a comma list "
                   "(svg,pdf: vector, for papers); the page always embeds 2x PNGs")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out folder")
    p.set_defaults(func=cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        hint = ""
        if getattr(args, "model", None) is not None and not extra[0].startswith("-"):
            hint = f"; the model is an option: `interp {args.command} --model {extra[0]}`"
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from transformers.utils import logging as hf_logging  # here, not above: `interp --help` imports no torch

    hf_logging.disable_progress_bar()  # the weight-loading bar is noise in a command's output
    from interp import distributed

    with distributed.launched(getattr(args, "device", None)):  # under torchrun: join its process group
        return _run(args, distributed.rank_zero())


def _run(args, main_rank: bool) -> int:
    try:
        with contextlib.ExitStack() as stack:
            if not main_rank:  # every rank computes; rank 0 alone prints
                stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
            if getattr(args, "threads", None) is not None:
                _set_threads(args.threads)
            return args.func(args)
    except BrokenPipeError:  # e.g. `interp heads | head`
        return 0
    except Exception as err:  # noqa: BLE001
        if not _user_mistake(err):
            raise
        if main_rank:
            print(f"interp {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    finally:
        for folder in _SCRATCH:
            shutil.rmtree(folder, ignore_errors=True)
        _SCRATCH.clear()


_SCRATCH: list[str] = []  # temporary folders of the ranks other than 0


def _rank_zero_path(path: Path) -> Path:
    """Where this process writes ``path``: the path itself on rank 0 (and without torchrun); on the other ranks a
    temporary path, removed when the command ends, so that every rank runs the same studies and only rank 0's
    files are written."""
    from interp import distributed

    if distributed.rank_zero():
        return path
    _SCRATCH.append(tempfile.mkdtemp(prefix="interp-rank"))
    return Path(_SCRATCH[-1]) / path.name


if __name__ == "__main__":
    sys.exit(main())
