"""Run TransformerLens's demo notebooks with interp, cell by cell, with only the loading line changed (issue 53).

    python benchmarks/run_tl_demos.py DEMOS_DIR [--model smollm2] [--device cpu] [--only Main_Demo ...]

DEMOS_DIR holds TransformerLens's ``demos/*.ipynb`` (its repository's, brought with ``fetch``; never committed here).
Each notebook's code cells run in one namespace, in order. ``transformer_lens`` and ``transformer_lens.utils`` are
interp's (``HookedTransformer``, ``utils``); every ``HookedTransformer.from_pretrained(...)`` call loads ``--model``
instead; IPython magics (``%...``, ``!...``) are skipped. One line per cell: ``ran`` or ``failed`` with the error's
first line, so the table in ``notebooks/transformerlens.md`` can be written from it."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import time
import traceback
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's interp, not an installed one

LOADING = re.compile(r"HookedTransformer\.from_pretrained(?:_no_processing)?\(|TransformerBridge\.boot_transformers\(")
# Why a cell fails where it is not interp's to fix: notebook -> cell number -> (the error's start, the reason).
# A failure whose error does not start so is reported as not explained.
REASONS: dict[str, dict[int, tuple[str, str]]] = {}
COMPAT = re.compile(r"\b\w+\.enable_compatibility_mode\(")  # TransformerLens 4's other half of loading: a no-op


def cell_source(cell: dict) -> str:
    """A code cell's text with IPython magics and shell lines (not Python) each replaced by ``pass`` at their
    indentation, and the loading calls changed (``_tl_load``; ``enable_compatibility_mode``: ``_tl_noop``)."""
    lines = "".join(cell.get("source", [])).splitlines()
    text = "\n".join(line[:len(line) - len(line.lstrip())] + "pass" if line.lstrip().startswith(("%", "!")) else line
                     for line in lines)
    return COMPAT.sub("_tl_noop(", LOADING.sub("_tl_load(", text))


def install_transformer_lens() -> None:
    """``import transformer_lens`` (and ``from transformer_lens import utils``) gives interp's names."""
    import interp

    module = types.ModuleType("transformer_lens")
    module.HookedTransformer, module.utils, module.ActivationCache = interp.HookedTransformer, interp.utils, interp.ModelCache
    import hooks

    module.FactoredMatrix = interp.LowRank
    bridge = types.ModuleType("transformer_lens.model_bridge")
    bridge.TransformerBridge = module.TransformerBridge = interp.HookedTransformer  # boot_transformers: the loading
    points = types.ModuleType("transformer_lens.hook_points")
    points.HookPoint, points.HookedRootModule = hooks.HookPoint, hooks.HookedRootModule
    root = types.ModuleType("transformer_lens.HookedRootModule")
    root.HookedRootModule = hooks.HookedRootModule
    module.__path__ = []  # a package, so that its submodules import
    sys.modules.update({"transformer_lens": module, "transformer_lens.utils": interp.utils,
                        "transformer_lens.utilities": interp.utils, "transformer_lens.model_bridge": bridge,
                        "transformer_lens.hook_points": points,
                        "transformer_lens.HookedRootModule": root})


def _shell_namespace() -> dict:
    """What a notebook cell finds besides its own names: ``get_ipython()`` returns a shell (cells load extensions
    through it) and ``display`` is defined, as in Jupyter. Without IPython, ``get_ipython()`` stays None."""
    try:
        from IPython.core.interactiveshell import InteractiveShell
        from IPython.display import display
    except ImportError:
        return {}
    InteractiveShell.instance()
    return {"display": display}


def run_notebook(path: Path, model, device: str, out=print, log=None) -> list[tuple[int, str, str, float]]:
    """Run ``path``'s code cells in one namespace (``model``: a name, folder or HF model, as ``from_pretrained``
    takes it); ``(cell number, "ran" | "failed", detail, CPU seconds)`` per cell. What a cell prints goes to
    ``log`` (a writable text file, or nowhere), with a failed cell's traceback."""
    import interp

    loaded = {}

    def from_pretrained(*args, **kwargs):  # the one changed line: every loading call loads --model
        if "model" not in loaded:
            loaded["model"] = interp.HookedTransformer.from_pretrained(model, device=device)
        return loaded["model"]

    namespace = {"__name__": "__main__", "_tl_load": from_pretrained, "_tl_noop": lambda *args, **kwargs: None,
                 **_shell_namespace()}
    cells = [c for c in json.loads(path.read_text())["cells"] if c.get("cell_type") == "code"]
    results = []
    for number, cell in enumerate(cells, 1):
        source = cell_source(cell)
        start, printed = time.process_time(), io.StringIO()
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                exec(compile(source, f"{path.name}:cell{number}", "exec"), namespace)  # noqa: S102 (the demo's own code)
            status, detail = "ran", ""
        except BaseException as error:  # noqa: BLE001 (a cell's failure is the result, SystemExit included)
            if isinstance(error, KeyboardInterrupt):
                raise
            status, detail = "failed", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            printed.write(traceback.format_exc())
        cpu = time.process_time() - start
        results.append((number, status, detail, cpu))
        if log is not None:
            log.write(f"===== {path.stem} cell {number}: {status}\n{printed.getvalue()}\n")
        out(f"{path.stem} cell {number:3d}: {status} ({cpu:.1f} s CPU) {detail}".rstrip())
    ran = sum(r[1] == "ran" for r in results)
    out(f"{path.stem}: {ran} of {len(results)} cells ran")
    return results


def explain(notebook: str, number: int, detail: str) -> str:
    """A failed cell's reason from ``REASONS``, if the error is the one the reason was written for; else says
    that it is not explained (a new failure, or an old one whose error changed)."""
    expected, reason = REASONS.get(notebook, {}).get(number, ("", ""))
    if reason and detail.startswith(expected):
        return reason
    return "**not explained**" + (f" (expected {expected})" if reason else "")


def markdown(results: dict[str, list[tuple[int, str, str, float]]], header: list[str]) -> str:
    """The per-cell table of a run: per notebook, its counts and each failed cell with its error and reason, plus
    the cells ``REASONS`` names that ran this time."""
    lines = [*header, ""]
    for notebook, cells in results.items():
        failed = [r for r in cells if r[1] == "failed"]
        cpu = sum(r[3] for r in cells)
        lines += [f"**{notebook}: {len(cells) - len(failed)} of {len(cells)} cells ran, {len(failed)} failed** "
                  f"({cpu:.0f} s CPU)", ""]
        if failed:
            lines += ["| cell | error | why |", "|---|---|---|"]
            for number, _, detail, _ in failed:
                error = detail.replace("|", "\\|")[:110]
                lines.append(f"| {number} | `{error}` | {explain(notebook, number, detail)} |")
        stale = sorted(n for n in REASONS.get(notebook, {}) if any(r[0] == n and r[1] == "ran" for r in cells))
        if stale:
            lines.append(f"\nExplained as failing but ran this time: cells {stale}.")
        lines.append("")
    return "\n".join(lines)


BEGIN, END = "<!-- run_tl_demos: begin -->", "<!-- run_tl_demos: end -->"


def write_markdown(path: Path, text: str) -> None:
    """Write ``text`` between the ``BEGIN``/``END`` markers of ``path`` (the rest kept), or as the whole file when
    it has none."""
    old = path.read_text() if path.is_file() else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        text = f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}"
    path.write_text(text)


def _header(argv: list[str], load_before: str) -> list[str]:
    import os
    import platform
    from importlib import metadata

    import torch

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    packages = ["torch", "transformers", "plotly", "circuitsvis", "fancy_einsum", "jaxtyping", "einops", "datasets",
                "numpy", "ipython"]
    return [f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.machine()} "
            f"({os.cpu_count()} CPUs, {platform.platform()}), Python {platform.python_version()}, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, torch threads {torch.get_num_threads()}; "
            f"load average before {load_before}, after {_load()}.", "",
            f"Command: `python benchmarks/run_tl_demos.py {' '.join(argv)}`", "",
            "Packages: " + ", ".join(f"{name} {version(name)}" for name in packages) + "."]


def _load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("demos_dir", type=Path)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", nargs="*", default=["Main_Demo", "Exploratory_Analysis_Demo", "Head_Detector_Demo",
                                                       "Activation_Patching_in_TL_Demo"])
    parser.add_argument("--log", type=Path, help="write what the cells print (and tracebacks) here")
    parser.add_argument("--markdown", type=Path, help="write the per-cell table here (between the file's "
                        f"'{BEGIN}' and '{END}' lines if it has them)")
    args = parser.parse_args(argv)
    paths = [args.demos_dir / f"{name}.ipynb" for name in args.only]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"run_tl_demos: no notebook {missing}; DEMOS_DIR is TransformerLens's demos/ folder.", file=sys.stderr)
        return 2
    load_before = _load()
    install_transformer_lens()
    log = open(args.log, "w") if args.log else None  # noqa: SIM115 (open for the whole run)
    try:
        results = {path.stem: run_notebook(path, args.model, args.device, log=log) for path in paths}
    finally:
        if log is not None:
            log.close()
    if args.markdown:
        write_markdown(args.markdown, markdown(results, _header(argv, load_before)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
