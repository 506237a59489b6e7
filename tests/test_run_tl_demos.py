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


def test_transformer_lens_patching_imports_and_runs_as_the_demo_calls_it(tmp_path):
    run_tl_demos.install_transformer_lens()
    path = _notebook(tmp_path / "Patching.ipynb", [
        "import torch\nimport transformer_lens.patching as patching\nfrom transformer_lens import HookedTransformer",
        'model = HookedTransformer.from_pretrained("gpt2")\nclean = torch.randint(1, 99, (2, 5))\n'
        "corrupted = torch.randint(1, 99, (2, 5))\n_, clean_cache = model.run_with_cache(clean)\n"
        "metric = lambda logits: logits[:, -1, 3].mean()",
        "r = patching.get_act_patch_resid_pre(model, corrupted, clean_cache, metric)\nassert r.shape == (2, 5)",
        "e = patching.get_act_patch_attn_head_all_pos_every(model, corrupted, clean_cache, metric)\n"
        "assert e.shape == (5, model.cfg.n_layers, model.cfg.n_heads)",
    ])
    results = run_tl_demos.run_notebook(path, tiny_hf("llama"), "cpu", out=lambda line: None)
    assert [r[1] for r in results] == ["ran"] * 4, results


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
    cells = [(1, "ran", "", 0.1), (2, "failed", "IndexError: index 8", 0.2), (3, "failed", "ValueError: a|b", 0.0),
             (4, "ran", "", 0.0)]
    text = run_tl_demos.markdown("Demo", cells, ["- header line"])
    assert text.startswith("**Demo: 2 of 4 cells ran, 2 failed**") and "- header line" in text
    assert "| 2 | `IndexError: index 8` | GPT-2's head 8 |" in text
    assert "| 3 | `ValueError: a\\|b` | **not explained** (expected KeyError) |" in text  # a changed error is not excused
    assert "Explained as failing but ran this time: cells [4]." in text
    doc = tmp_path / "doc.md"
    begin, end = run_tl_demos.markers("Demo")
    doc.write_text(f"before\n{begin}\nold table\n{end}\nafter\n")
    run_tl_demos.write_markdown(doc, {"Demo": "new table", "Other": "other table"})
    other = "\n".join(run_tl_demos.markers("Other"))
    assert doc.read_text() == f"before\n{begin}\nnew table\n{end}\nafter\n\n" + other.replace("\n", "\nother table\n") + "\n"


def test_render_writes_the_table_again_from_the_saved_results(tmp_path, monkeypatch, capsys):
    saved = {"Demo": {"cells": [[1, "ran", "", 0.5], [2, "failed", "IndexError: index 8", 0.1]], "header": ["- h"]}}
    (tmp_path / "r.json").write_text(__import__("json").dumps(saved))
    monkeypatch.setattr(run_tl_demos, "REASONS", {"Demo": {2: ("IndexError", "GPT-2's head 8")}})
    md = tmp_path / "t.md"
    assert run_tl_demos.main([str(tmp_path), "--render", "--results", str(tmp_path / "r.json"), "--markdown", str(md)]) == 0
    assert "**Demo: 1 of 2 cells ran, 1 failed**" in md.read_text() and "| 2 | `IndexError: index 8` | GPT-2's head 8 |" in md.read_text()
    assert run_tl_demos.main([str(tmp_path), "--render", "--markdown", str(md)]) == 2
    assert "--render needs --results" in capsys.readouterr().err


def test_a_cell_past_the_cpu_limit_is_stopped_and_the_next_one_runs(tmp_path):
    path = _notebook(tmp_path / "Slow.ipynb", ["x = 0\nwhile True:\n    x += 1", "y = x"])
    results = run_tl_demos.run_notebook(path, tiny_hf("llama"), "cpu", out=lambda line: None, cell_limit=0.5)
    # the kernel's profiling timer samples CPU time per tick, process_time reads it exactly: a tick or two apart
    assert results[0][1] == "failed" and results[0][2].startswith("CellLimit") and 0.4 <= results[0][3] < 5
    assert results[1][1] == "ran"  # the namespace survived: x was defined by the stopped cell


def test_skipped_cells_are_not_run_and_are_listed_with_their_reason(tmp_path, monkeypatch):
    path = _notebook(tmp_path / "Skip.ipynb", ["x = 1", "raise SystemExit('must not run')", "y = x + 1"])
    lines = []
    results = run_tl_demos.run_notebook(path, tiny_hf("llama"), "cpu", out=lines.append, skip={2})
    assert [r[1] for r in results] == ["ran", "skipped", "ran"]
    assert "skipped" in lines[1] and lines[-1] == "Skip: 2 of 3 cells ran"
    monkeypatch.setattr(run_tl_demos, "REASONS", {"Skip": {2: ("CellLimit", "a second model's heads")}})
    text = run_tl_demos.markdown("Skip", results, [])
    assert text.startswith("**Skip: 2 of 3 cells ran, 0 failed, 1 not run (--skip)**")
    assert "| 2 | not run (`--skip`) | a second model's heads |" in text
