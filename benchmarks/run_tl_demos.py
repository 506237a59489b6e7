"""Run TransformerLens's demo notebooks with interp, cell by cell, with only the loading line changed (issue 53).

    python benchmarks/run_tl_demos.py DEMOS_DIR [--model smollm2] [--device cpu] [--only Main_Demo ...]

DEMOS_DIR holds TransformerLens's ``demos/*.ipynb`` (its repository's, brought with ``fetch``; never committed here).
Each notebook's code cells run in one namespace, in order. ``transformer_lens`` and ``transformer_lens.utils`` are
interp's (``HookedTransformer``, ``utils``); every ``HookedTransformer.from_pretrained(...)`` call loads ``--model``
instead; IPython magics (``%...``, ``!...``) are skipped. One line per cell: ``ran`` or ``failed`` with the error's
first line, so the table in ``notebooks/transformerlens.md`` can be written from it."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import types
from pathlib import Path

LOADING = re.compile(r"HookedTransformer\.from_pretrained(?:_no_processing)?\(|TransformerBridge\.boot_transformers\(")
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
    points.HookPoint = hooks.HookPoint
    module.__path__ = []  # a package, so that its submodules import
    sys.modules.update({"transformer_lens": module, "transformer_lens.utils": interp.utils,
                        "transformer_lens.utilities": interp.utils, "transformer_lens.model_bridge": bridge,
                        "transformer_lens.hook_points": points})


def run_notebook(path: Path, model, device: str, out=print) -> list[tuple[int, str, str]]:
    """Run ``path``'s code cells in one namespace (``model``: a name, folder or HF model, as ``from_pretrained``
    takes it); ``(cell number, "ran" | "failed", detail)`` per cell."""
    import interp

    loaded = {}

    def from_pretrained(*args, **kwargs):  # the one changed line: every loading call loads --model
        if "model" not in loaded:
            loaded["model"] = interp.HookedTransformer.from_pretrained(model, device=device)
        return loaded["model"]

    namespace = {"__name__": "__main__", "_tl_load": from_pretrained, "_tl_noop": lambda *args, **kwargs: None}
    cells = [c for c in json.loads(path.read_text())["cells"] if c.get("cell_type") == "code"]
    results = []
    for number, cell in enumerate(cells, 1):
        source = cell_source(cell)
        start = time.process_time()
        try:
            exec(compile(source, f"{path.name}:cell{number}", "exec"), namespace)  # noqa: S102 (the demo's own code)
            status, detail = "ran", ""
        except BaseException as error:  # noqa: BLE001 (a cell's failure is the result, SystemExit included)
            if isinstance(error, KeyboardInterrupt):
                raise
            status, detail = "failed", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        results.append((number, status, detail))
        out(f"{path.stem} cell {number:3d}: {status} ({time.process_time() - start:.1f} s CPU) {detail}".rstrip())
    ran = sum(s == "ran" for _, s, _ in results)
    out(f"{path.stem}: {ran} of {len(results)} cells ran")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("demos_dir", type=Path)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", nargs="*", default=["Main_Demo", "Exploratory_Analysis_Demo", "Head_Detector_Demo",
                                                       "Activation_Patching_in_TL_Demo"])
    args = parser.parse_args(argv)
    paths = [args.demos_dir / f"{name}.ipynb" for name in args.only]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"run_tl_demos: no notebook {missing}; DEMOS_DIR is TransformerLens's demos/ folder.", file=sys.stderr)
        return 2
    install_transformer_lens()
    for path in paths:
        run_notebook(path, args.model, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
