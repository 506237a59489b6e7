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
import gc
import io
import json
import re
import resource
import signal
import sys
import time
import traceback
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's interp, not an installed one

LOADING = re.compile(r"HookedTransformer\.from_pretrained(?:_no_processing)?\(|TransformerBridge\.boot_transformers\(")
# Why a cell fails where it is not interp's to fix: notebook -> cell number -> (the error's start, the reason).
# A failure whose error does not start so is reported as not explained.
_CUT = ("CellLimit", "{}: {} forwards of SmolLM2 on the CPU")  # the error column says it was stopped at the limit
# CPU seconds one patched forward of SmolLM2 takes on the induction batch (4 x 41 tokens), averaged over the 30
# layers it starts from (the blocks before are replayed), one thread; measured by benchmarks/bench_tl_patching.py
# 2026-11-28 14:05 UTC, load 6.5, OMP_NUM_THREADS=1 (the IOI batch, 8 x 14: 0.29 there; cell 18's 13,860 took 0.22)
_INDUCTION = 0.40


# what TransformerLens's own notebook says of its slowest cells (15-18, 22, 24): nbval's marker, so its CI never runs them
_NBVAL = "; marked `NBVAL_SKIP` in the notebook (\"too slow for CI without GPU\"): TransformerLens's own CI skips it"


def _needs(forwards: int, rate: float) -> str:
    return f" (at {rate} s of CPU a forward: about {forwards * rate:.0f} s of CPU to finish)"


_GQA = "GPT-2's head numbers on `hook_{}`: SmolLM2 has 3 key/value heads (per key/value head in TransformerLens 4.3 too)"
REASONS: dict[str, dict[int, tuple[str, str]]] = {
    "Main_Demo": {
        15: ("IndexError", "GPT-2's head 8 ablated on `hook_v`: SmolLM2 has 3 key/value heads (TransformerLens "
                           "4.3's `hook_v` is per key/value head too)"),
        52: ("ValueError: All arguments should have the same length", "GPT-2's 12 x 12 heads written out as hover "
                                                                      "labels (SmolLM2 has 30 x 9)"),
        57: ("ModuleNotFoundError", "TransformerLens's table of its own models' training checkpoints "
                                    "(`loading_from_pretrained.get_checkpoint_labels`): other models"),
        58: ("ImportError", "`transformer_lens.evals`, for the induction loss of a second model's checkpoints "
                            "(NeelNanda/SoLU_2L512W_C4_Code, from the internet)"),
        59: ("NameError", "follows from cell 58: loads that second model's checkpoints"),
        60: ("NameError", "follows from cell 59: plots their losses"),
    },
    "Exploratory_Analysis_Demo": {
        28: ("IndexError", _GQA.format("v") + ": it patches all 9 query heads' indices on `hook_v`"),
        35: ("IndexError", _GQA.format("v") + " (direct-path patching into values)"),
        37: ("IndexError", _GQA.format("k") + " (direct-path patching into keys)"),
    },
    "Activation_Patching_in_TL_Demo": {  # its patching on interp's transformer_lens.patching (tl_patching)
        22: (_CUT[0], _CUT[1].format("`get_act_patch_attn_head_all_pos_every` and `..._by_pos_every` on "
                                     "attn-only-2l's induction batch (a second model, loaded as SmolLM2 here)",
                                     "990 + 990 x 41") + _needs(990 * 42, _INDUCTION) + _NBVAL),
        24: (_CUT[0], _CUT[1].format("`get_act_patch_attn_head_all_pos_every` on three corrupted induction batches "
                                     "(attn-only-2l, loaded as SmolLM2 here)", "3 x 990")
             + _needs(3 * 990, _INDUCTION) + _NBVAL),
    },
}
COMPAT = re.compile(r"\b\w+\.enable_compatibility_mode\(")  # TransformerLens 4's other half of loading: a no-op


def cell_source(cell: dict) -> str:
    """A code cell's text with IPython magics and shell lines (not Python) each replaced by ``pass`` at their
    indentation, and the loading calls changed (``_tl_load``; ``enable_compatibility_mode``: ``_tl_noop``)."""
    lines = "".join(cell.get("source", [])).splitlines()
    text = "\n".join(line[:len(line) - len(line.lstrip())] + "pass" if line.lstrip().startswith(("%", "!")) else line
                     for line in lines)
    return COMPAT.sub("_tl_noop(", LOADING.sub("_tl_load(", text))


def install_transformer_lens() -> None:
    """``import transformer_lens`` (and ``from transformer_lens import utils``, ``import transformer_lens.patching``)
    gives interp's names."""
    import interp
    from analyses.causal import tl_patching

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
    module.patching = tl_patching  # transformer_lens.patching: its names and signatures, on the causal engine
    module.__path__ = []  # a package, so that its submodules import
    sys.modules.update({"transformer_lens": module, "transformer_lens.utils": interp.utils,
                        "transformer_lens.utilities": interp.utils, "transformer_lens.model_bridge": bridge,
                        "transformer_lens.hook_points": points,
                        "transformer_lens.HookedRootModule": root, "transformer_lens.patching": tl_patching})


def _shell_namespace() -> dict:
    """What a notebook cell finds besides its own names: ``get_ipython()`` returns a shell (cells load extensions
    through it) with the extension a Jupyter kernel starts with (``storemagic``), and ``display`` is defined, as in
    Jupyter. Without IPython, ``get_ipython()`` stays None."""
    try:
        from IPython.core.interactiveshell import InteractiveShell
        from IPython.display import display
    except ImportError:
        return {}
    shell = InteractiveShell.instance()
    if "storemagic" not in shell.extension_manager.loaded:  # what IPython's apps (Jupyter's kernel) load at start
        shell.extension_manager.load_extension("storemagic")
    return {"display": display}


class CellLimit(Exception):
    """A cell ran past ``--cell-limit`` seconds of CPU time: stopped there (no error of its own seen until then)."""


def _over_limit(signum, frame):
    raise CellLimit("stopped at the cell's CPU-time limit (no error until then)")


def run_notebook(path: Path, model, device: str, out=print, log=None, cell_limit: float | None = None,
                 skip=()) -> list[tuple[int, str, str, float]]:
    """Run ``path``'s code cells in one namespace (``model``: a name, folder or HF model, as ``from_pretrained``
    takes it); ``(cell number, "ran" | "failed" | "skipped", detail, CPU seconds)`` per cell. What a cell prints
    goes to ``log`` (a writable text file, or nowhere), with a failed cell's traceback. A cell that runs past
    ``cell_limit`` seconds of this process's CPU time is stopped and counted as failed (``CellLimit``); the cells
    numbered in ``skip`` are not run (a cell that reads what one of them defines then fails)."""
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
        if number in skip:
            results.append((number, "skipped", "not run (--skip)", 0.0))
            out(f"{path.stem} cell {number:3d}: skipped (--skip)")
            continue
        source = cell_source(cell)
        start, printed = time.process_time(), io.StringIO()
        if cell_limit:
            signal.signal(signal.SIGPROF, _over_limit)
            signal.setitimer(signal.ITIMER_PROF, cell_limit)  # counts this process's CPU time, not the wall
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                exec(compile(source, f"{path.name}:cell{number}", "exec"), namespace)  # noqa: S102 (the demo's own code)
            status, detail = "ran", ""
        except BaseException as error:  # noqa: BLE001 (a cell's failure is the result, SystemExit included)
            if isinstance(error, KeyboardInterrupt):
                raise
            status, detail = "failed", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            printed.write(traceback.format_exc())
        finally:
            if cell_limit:
                signal.setitimer(signal.ITIMER_PROF, 0)
        cpu = time.process_time() - start
        results.append((number, status, detail, cpu))
        if log is not None:
            log.write(f"===== {path.stem} cell {number}: {status}\n{printed.getvalue()}\n")
            log.flush()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (Linux counts KiB)
        out(f"{path.stem} cell {number:3d}: {status} ({cpu:.1f} s CPU, peak {peak:.1f} GiB) {detail}".rstrip())
    namespace.clear()  # the cells' functions hold the namespace in a cycle: free what they built now
    loaded.clear()
    gc.collect()
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


def markdown(notebook: str, cells: list[tuple[int, str, str, float]], header: list[str]) -> str:
    """One notebook's per-cell table: the run's header, its counts, each failed cell with its error and reason,
    and the cells ``REASONS`` names that ran this time."""
    failed = [r for r in cells if r[1] == "failed"]
    skipped = [r for r in cells if r[1] == "skipped"]
    ran = len(cells) - len(failed) - len(skipped)
    lines = [f"**{notebook}: {ran} of {len(cells)} cells ran, {len(failed)} failed"
             + (f", {len(skipped)} not run (--skip)" if skipped else "")
             + f"** ({sum(r[3] for r in cells):.0f} s CPU).", "", *header, ""]
    if failed or skipped:
        lines += ["| cell | error | why |", "|---|---|---|"]
        for number, status, detail, _ in sorted(failed + skipped):
            if status == "skipped":
                reason = REASONS.get(notebook, {}).get(number, ("", ""))[1]
                lines.append(f"| {number} | not run (`--skip`) | {reason or '**not explained**'} |")
                continue
            error = detail.replace("|", "\\|").replace("`", "'")[:110]
            lines.append(f"| {number} | `{error}` | {explain(notebook, number, detail)} |")
    stale = sorted(n for n in REASONS.get(notebook, {}) if any(r[0] == n and r[1] == "ran" for r in cells))
    if stale:
        lines += ["", f"Explained as failing but ran this time: cells {stale}."]
    return "\n".join(lines)


def markers(notebook: str) -> tuple[str, str]:
    return f"<!-- run_tl_demos: {notebook} -->", f"<!-- run_tl_demos: end {notebook} -->"


def write_markdown(path: Path, sections: dict[str, str]) -> None:
    """Write each notebook's table between its ``markers`` in ``path`` (the rest of the file kept; a notebook
    without markers there is appended), so that notebooks run at different times keep their own run's header."""
    text = path.read_text() if path.is_file() else ""
    for notebook, table in sections.items():
        begin, end = markers(notebook)
        block = f"{begin}\n{table}\n{end}"
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            text = head + block + rest.split(end, 1)[1]
        else:
            text = f"{text.rstrip()}\n\n{block}\n" if text.strip() else block + "\n"
    path.write_text(text)


def _commit() -> str:
    """The checkout's commit, and whether interp, hooks or this script differ from it (read when the run starts)."""
    import subprocess

    git = ["git", "-C", str(Path(__file__).resolve().parents[1])]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "interp", "hooks", "benchmarks"]).returncode
    return (commit or "unknown") + (" with changes" if dirty else "")


def _header(argv: list[str], started: str, load_before: str, commit: str) -> list[str]:
    """Where and how the run was made: date, machine, threads, load, the checkout's commit, the command, and the
    versions of what the notebooks import."""
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
                "numpy", "ipython", "neel-plotly"]
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    return [f"- run {started} to {time.strftime('%H:%M UTC', time.gmtime())} on {platform.machine()}, "
            f"{os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}; "
            f"OMP_NUM_THREADS={threads}, torch threads {torch.get_num_threads()}; load average {load_before} before, "
            f"{_load()} after; interp at commit {commit}",
            f"- command: `OMP_NUM_THREADS={threads} python benchmarks/run_tl_demos.py {' '.join(argv)}`",
            "- packages: " + ", ".join(f"{name} {version(name)}" for name in packages)]


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
    parser.add_argument("--cell-limit", type=float, help="stop a cell after this many seconds of CPU time "
                        "(counted as failed: CellLimit)")
    parser.add_argument("--skip", type=int, nargs="*", default=[], help="cell numbers not to run (each notebook "
                        "of the run), e.g. a long loop over a second model's heads; listed as not run")
    parser.add_argument("--log", type=Path, help="write what the cells print (and tracebacks) here")
    parser.add_argument("--markdown", type=Path, help="write each notebook's per-cell table here, between its "
                        "'<!-- run_tl_demos: NAME -->' and '<!-- run_tl_demos: end NAME -->' lines (appended if none)")
    parser.add_argument("--results", type=Path, help="keep each notebook's cells and run header here (JSON, "
                        "merged with what the file holds), so --render can write the table again")
    parser.add_argument("--render", action="store_true", help="run nothing: write --markdown from --results "
                        "with the reasons as they are now")
    args = parser.parse_args(argv)
    if args.render:
        if not (args.results and args.results.is_file() and args.markdown):
            print("run_tl_demos: --render needs --results FILE (from an earlier run) and --markdown FILE.",
                  file=sys.stderr)
            return 2
        saved = json.loads(args.results.read_text())
        write_markdown(args.markdown, {name: markdown(name, [tuple(c) for c in run["cells"]], run["header"])
                                       for name, run in saved.items()})
        return 0
    paths = [args.demos_dir / f"{name}.ipynb" for name in args.only]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"run_tl_demos: no notebook {missing}; DEMOS_DIR is TransformerLens's demos/ folder.", file=sys.stderr)
        return 2
    load_before, started, commit = _load(), time.strftime("%Y-%m-%d %H:%M", time.gmtime()), _commit()
    install_transformer_lens()
    log = open(args.log, "w") if args.log else None  # noqa: SIM115 (open for the whole run)
    try:
        results = {path.stem: run_notebook(path, args.model, args.device, log=log, cell_limit=args.cell_limit,
                                           skip=set(args.skip))
                   for path in paths}
    finally:
        if log is not None:
            log.close()
    header = _header(argv, started, load_before, commit)
    if args.results:
        saved = json.loads(args.results.read_text()) if args.results.is_file() else {}
        saved.update({name: {"cells": cells, "header": header} for name, cells in results.items()})
        args.results.write_text(json.dumps(saved, indent=1))
    if args.markdown:
        write_markdown(args.markdown, {name: markdown(name, cells, header) for name, cells in results.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
