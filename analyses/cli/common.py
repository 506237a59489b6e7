"""What the verbs of the ``interp`` command share: the one-line error boundary's pieces, the options every study
takes, loading the model and the prompts, printing a table, the progress bar, and where rank 0 writes.

Nothing here imports torch, transformers, pandas or matplotlib at import time (``interp --help`` stays fast): a
helper that needs one imports it when it runs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

# interp.BUNDLED's names, for the help text without importing torch (tests/test_cli.py checks that they agree)
BUNDLED_NAMES = ("smollm2", "gemma3", "toy-induction", "minilm")


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit code 2."""


def _at_least(least: int, note: str = ""):
    """argparse type of a whole number of at least ``least`` (``note`` says what the least one means)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            what = f"a whole number of at least {least}{note}"
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r} ({what})") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {least}{note}; got {value}")
        return value

    return parse


_positive_int = _at_least(1)  # a count: 0 prompts would run a study on nothing
_nonnegative_int = _at_least(0, ", 0 for all")  # a limit where 0 means none (--top 0: every row)


def _threads(text: str) -> str:
    """argparse type of --threads: a whole number of at least 1, or 'auto' (``interp.set_threads`` applies it)."""
    text = text.strip()
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1 or 'auto'; got {text!r}")
    return text


def _check_device(device: str | None) -> None:
    """--device names a device this machine has (``interp.model.loading.resolve_device``, the one check)."""
    from interp.model.loading import available_devices, resolve_device

    try:
        resolve_device(device)
    except ValueError:
        raise UserError(f"--device must be one of this machine's devices ({', '.join(available_devices())}) or "
                        f"auto; got {device!r}") from None


def _one_line(err: BaseException) -> str:
    """An error as one line: an OSError's reason and path, else the first line of its message."""
    if isinstance(err, OSError) and err.strerror:
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror}{where}"
    text = (err.args[0] if err.args and isinstance(err.args[0], str) else str(err)).strip()
    return (text.splitlines() or [type(err).__name__])[0]


def _user_mistake(err: BaseException) -> bool:
    """What the user can fix, reported in one line: a bad command line or input (UserError and the ValueError,
    IndexError, KeyError, TypeError and NotImplementedError our checks raise on what was given, such as a score
    that does not apply to the model), a missing package, and anything the file system refuses (a path in the way,
    a folder that is a file, no permission, a full disk: OSError). Anything else is a bug of ours, and keeps its
    traceback."""
    return isinstance(err, (UserError, ValueError, IndexError, KeyError, TypeError, NotImplementedError,
                            ModuleNotFoundError, OSError))


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the usage block would bury the one line that says what is wrong."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


# -- options ---------------------------------------------------------------------------------------------
def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="toy-induction", help=f"bundled name ({', '.join(BUNDLED_NAMES)}) or model "
                   "folder")
    p.add_argument("--attn", choices=["flash", "eager"], default="flash", help="attention path (default flash)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, mps or auto (default)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--prompts", type=Path, default=None, help="text file, one prompt a line (token ids for a "
                   "model without a tokenizer)")
    p.add_argument("--seed", type=int, default=0)
    _threads_option(p)


def _threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=_threads, default="auto", metavar="N|auto",
                   help="torch CPU threads (default auto: the idle cores, CPUs minus those busy over a 0.2 s sample, "
                        "at least 1; on a 2-core machine with one other busy process two threads ran slower "
                        "than one)")


def _set_threads(value: str) -> int:
    """Set torch's CPU threads from --threads (``interp.set_threads``) and return the count."""
    from interp.runtime.threads import set_threads

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


# -- inputs ----------------------------------------------------------------------------------------------
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


def _text_or_ids(value: str, model):
    import torch

    if model.tokenizer is None:
        return torch.tensor([_id_line(value, "the input")])
    return model.to_batch(value)


def _token(value: str):
    return int(value) if value.strip().lstrip("-").isdigit() else value


def _parse_heads(text: str | None, model) -> list[tuple[int, int]] | None:
    if text is None:
        return None
    heads = []
    for item in text.split(","):  # SITE.HEAD on every model; LAYER.HEAD where each layer has one site
        try:
            where, head = item.strip().rsplit(".", 1)
            heads.append((int(where) if where.isdigit() else where, int(head)))
        except ValueError:
            raise UserError(f"heads are given as SITE.HEAD or LAYER.HEAD separated by commas, e.g. 1.0,blocks.1.attn.3 "
                            f"(an encoder-decoder model's as SITE.HEAD, e.g. decoder.blocks.0.cross_attn.1); got "
                            f"{item!r}") from None
    return heads


def _refuse_seq2seq(model, what: str, instead: str) -> None:
    from ..data.seq2seq import is_seq2seq

    if is_seq2seq(model):
        raise UserError(f"{what} does not handle encoder-decoder models yet; {instead}")


def _read_csv(path: Path):
    import pandas as pd

    try:
        return pd.read_csv(path)
    except (OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise UserError(f"cannot read table {str(path)!r}: {getattr(err, 'strerror', None) or err}; pass a CSV "
                        "written by `interp heads/ablate/prune --format csv` or by `interp report`") from None


# -- outputs ---------------------------------------------------------------------------------------------
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
    """Stage names on a tqdm bar on stderr when it is a terminal; silent otherwise, or with ``lines`` (a command's
    name) one line per stage where progress is written as lines (``interp.runtime.progress.progress_lines_off_a_terminal``):
    each stage as it starts, with the time the one before took. The first stage (loading the model) gets no line of
    its own: a mistake found after it is still the only line on stderr."""

    def __init__(self, stages: list[str], lines: str | None = None):
        from interp.runtime import distributed

        self.bar, self.lines = None, None
        if sys.stderr.isatty() and distributed.rank_zero():
            from tqdm import tqdm

            self.bar = tqdm(total=len(stages), file=sys.stderr, unit="stage", leave=False)
        elif distributed.rank_zero():
            self.lines = lines
        self.stages, self.last = list(stages), None
        self.started = False

    def __call__(self, stage: str) -> None:
        if self.bar is not None:
            if self.started:
                self.bar.update(1)
            self.bar.set_description(stage)
            self.started = True
        from interp.runtime.progress import progress_mode

        now = time.perf_counter()
        if self.lines and self.last is not None and progress_mode() == "lines":
            number = self.stages.index(stage) + 1 if stage in self.stages else "?"
            print(f"{self.lines}: {stage} (stage {number} of {len(self.stages)}; {self.last[0]} took "
                  f"{now - self.last[1]:.1f} s)", file=sys.stderr, flush=True)
        self.last = (stage, now)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_out(out: Path, force: bool) -> None:
    """An output folder may be new or empty; an existing non-empty one needs --force; a file is refused."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} is a file; give a folder path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UserError(f"--out {str(out)!r} exists and is not empty; pass --force to write into it "
                        "(files of the same names are replaced)")


def _check_out_file(out: Path, force: bool) -> None:
    """An output file may be new (in a folder that exists); an existing one needs --force."""
    if out.exists() and not force:
        raise UserError(f"{str(out)!r} exists; pass --force to overwrite it")
    if not out.parent.is_dir():
        raise UserError(f"the folder of --out, {str(out.parent)!r}, does not exist; create it first "
                        f"(mkdir -p {out.parent})")


_SCRATCH: list[str] = []  # temporary folders of the ranks other than 0


def _rank_zero_path(path: Path) -> Path:
    """Where this process writes ``path``: the path itself on rank 0 (and without torchrun); on the other ranks a
    temporary path, removed when the command ends, so that every rank runs the same studies and only rank 0's
    files are written."""
    from interp.runtime import distributed

    if distributed.rank_zero():
        return path
    _SCRATCH.append(tempfile.mkdtemp(prefix="interp-rank"))
    return Path(_SCRATCH[-1]) / path.name


# -- head scores of the user's own --------------------------------------------------------------------------------
def score_help() -> str:
    """The registered scores, for an option's help (the registry imports no torch)."""
    from ..heads import registry

    ours = [r for r in registry.scores() if r.builtin]
    default = ", ".join(r.name for r in ours if r.default)
    asked = ", ".join(r.name for r in ours if not r.default)
    return (f"by default those that apply of {default}; on request {asked} (decoder-only and encoder models); a "
            "score of your own from --score-module")


def score_module_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--score-module", action="append", default=[], metavar="MODULE",
                   help="a Python module (an importable name, or a path to a .py file) that registers head scores "
                        "of your own with analyses.head_score; they run beside ours (repeatable)")


def load_score_modules(args) -> None:
    """Import each ``--score-module``: a file path, or a module name importable from the working directory."""
    import importlib
    import importlib.util

    from ..heads import registry

    for name in getattr(args, "score_module", None) or ():
        path = Path(name)
        saved, modules = registry.snapshot(), set(sys.modules)  # a module that fails registers nothing
        before, imported = {id(r) for r in registry.scores()}, name in sys.modules  # imported: runs no more code
        try:
            if path.is_dir():
                raise UserError(f"--score-module {name}: is a folder; give the .py file inside it that registers "
                                "scores with analyses.head_score, or an importable module name.")
            if path.suffix == ".py" or path.exists():
                if not path.is_file():
                    raise UserError(f"--score-module {name}: no such file; give a .py file that registers scores "
                                    "with analyses.head_score, or an importable module name.")
                spec = importlib.util.spec_from_file_location(f"interp_scores_{path.stem}", path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module
                spec.loader.exec_module(module)
            else:
                sys.path.insert(0, str(Path.cwd()))
                try:
                    importlib.import_module(name)
                finally:
                    sys.path.remove(str(Path.cwd()))
        except Exception as err:  # noqa: BLE001  the user's module: say which one failed and how
            registry.restore(saved)
            for half_run in {f"interp_scores_{path.stem}", name} - modules:  # its own entry, not what it imported
                sys.modules.pop(half_run, None)
            if isinstance(err, UserError):
                raise
            raise UserError(f"--score-module {name}: importing it failed: {type(err).__name__}: {err}") from err
        if not imported and not {id(r) for r in registry.scores()} - before:
            raise UserError(f"--score-module {name}: it registers no score; call analyses.head_score(name, "
                            "description, rule) in it (at import time).")
