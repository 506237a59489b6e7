"""benchmarks/run_tl_demos.py on a small notebook of TransformerLens-style cells: one namespace, the loading line
changed, magics skipped, one line per cell with its failure's reason (issue 53)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.conftest import tiny_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import run_tl_demos  # noqa: E402


def _notebook(path: Path, cells: list[str]) -> Path:
    path.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": ["# title"]}] + [
        {"cell_type": "code", "source": [line + "\n" for line in cell.splitlines()]} for cell in cells]}))
    return path


def test_cells_run_in_one_namespace_with_the_loading_line_changed(tmp_path):
    run_tl_demos.install_transformer_lens()
    path = _notebook(tmp_path / "Demo.ipynb", [
        "%pip install transformer_lens\nimport torch\nfrom transformer_lens import HookedTransformer, utils",
        'model = HookedTransformer.from_pretrained("gpt2-small")\nif True:\n    %matplotlib inline\nmodel.enable_compatibility_mode(\n    fold_ln=True,\n)',
        "n = model.cfg.n_layers\nname = utils.get_act_name('scale4ln1')",
        "tokens = torch.randint(1, 99, (1, 6))\nlogits, cache = model.run_with_cache(tokens)\nassert cache['pattern', 0].shape[-1] == 6",
        "model.no_such_method()",
        "assert n == 2 and name == 'blocks.4.ln1.hook_scale'",
    ])
    lines = []
    results = run_tl_demos.run_notebook(path, tiny_hf("llama"), "cpu", out=lines.append)
    assert [r[1] for r in results] == ["ran", "ran", "ran", "ran", "failed", "ran"]
    assert results[4][2].startswith("AttributeError") and "no_such_method" in results[4][2]
    assert len(lines) == 7 and lines[-1] == "Demo: 5 of 6 cells ran"


def test_a_missing_notebook_is_one_line_and_exit_2(tmp_path, capsys):
    assert run_tl_demos.main([str(tmp_path), "--only", "Main_Demo"]) == 2
    err = capsys.readouterr().err
    assert "Main_Demo.ipynb" in err and len(err.strip().splitlines()) == 1


def test_cells_see_a_shell_and_their_output_goes_to_the_log(tmp_path):
    import io

    run_tl_demos.install_transformer_lens()
    path = _notebook(tmp_path / "Shell.ipynb", [
        "from IPython import get_ipython\nip = get_ipython()\nassert ip is not None and hasattr(ip, 'extension_manager')",
        "print('hello from the cell')\ndisplay('shown')",
        "from transformer_lens.HookedRootModule import HookedRootModule\nfrom transformer_lens.hook_points import HookPoint",
        "raise ValueError('boom')",
    ])
    log, lines = io.StringIO(), []
    results = run_tl_demos.run_notebook(path, tiny_hf("llama"), "cpu", out=lines.append, log=log)
    assert [r[1] for r in results] == ["ran", "ran", "ran", "failed"]
    assert "hello from the cell" in log.getvalue() and "Traceback" in log.getvalue()
    assert not any("hello" in line for line in lines)  # one line per cell, what cells print stays in the log


def test_markdown_counts_the_run_and_explains_only_the_failure_it_was_written_for(tmp_path, monkeypatch):
    monkeypatch.setattr(run_tl_demos, "REASONS", {"Demo": {2: ("IndexError", "GPT-2's head 8"),
                                                           3: ("KeyError", "needs the internet"),
                                                           4: ("NameError", "cascade")}})
    results = {"Demo": [(1, "ran", "", 0.1), (2, "failed", "IndexError: index 8", 0.2),
                        (3, "failed", "ValueError: a|b", 0.0), (4, "ran", "", 0.0)]}
    text = run_tl_demos.markdown(results, ["header line"])
    assert text.startswith("header line") and "**Demo: 2 of 4 cells ran, 2 failed**" in text
    assert "| 2 | `IndexError: index 8` | GPT-2's head 8 |" in text
    assert "| 3 | `ValueError: a\\|b` | **not explained** (expected KeyError) |" in text  # a changed error is not excused
    assert "Explained as failing but ran this time: cells [4]." in text
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{run_tl_demos.BEGIN}\nold table\n{run_tl_demos.END}\nafter\n")
    run_tl_demos.write_markdown(doc, "new table")
    assert doc.read_text() == f"before\n{run_tl_demos.BEGIN}\nnew table\n{run_tl_demos.END}\nafter\n"
