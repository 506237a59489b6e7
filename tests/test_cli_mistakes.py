"""Issue 22 items 6-8: no lost or half-written file, and a user's mistake is one line and exit 2 (each test here
failed before its fix)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import interp
from analyses.cli import main
from interp.model import bundled
from interp.runtime.files import atomic_write, staged_folder
from tests.tiny import tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:The set_bad function:PendingDeprecationWarning")


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err  # one line, no traceback
    return err


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny saved Llama (no tokenizer)."""
    out = tmp_path_factory.mktemp("tiny") / "llama"
    interp.load_model(tiny_model("llama", num_hidden_layers=2)).save_pretrained(out)
    return out


# -- 8: the command line --------------------------------------------------------------------------------------------
def _exit_code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as exit:  # argparse's own errors
        return exit.code


@pytest.mark.parametrize("argv, expected", [
    (["heads", "--device", "tpu"], "--device must be"),
    (["heads", "--device", "gpu"], "--device must be"),
    (["patch", "--n-prompts", "0"], "at least 1"),
    (["attribute", "--n-prompts", "0"], "at least 1"),
])
def test_bad_options_are_one_line_and_exit_2(argv, expected, capsys):
    assert _exit_code(argv) == 2
    assert expected in _err(capsys)


def test_model_folders_that_do_not_load_are_one_line(folder, tmp_path, capsys):
    import shutil

    broken = tmp_path / "bad-config"
    shutil.copytree(folder, broken)
    (broken / "config.json").write_text("{ not json")
    assert main(["heads", "--model", str(broken)]) == 2
    assert "cannot load the model folder" in _err(capsys)

    no_weights = tmp_path / "no-weights"
    shutil.copytree(folder, no_weights)
    for f in no_weights.glob("*.safetensors"):
        f.unlink()
    assert main(["heads", "--model", str(no_weights)]) == 2
    assert "cannot load the model folder" in _err(capsys)

    truncated = tmp_path / "truncated"
    shutil.copytree(folder, truncated)
    weights = next(truncated.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["heads", "--model", str(truncated)]) == 2
    assert "cannot load the model folder" in _err(capsys)

    unknown = tmp_path / "unknown-type"
    shutil.copytree(folder, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no_such_model_type"}))
    assert main(["heads", "--model", str(unknown)]) == 2
    assert "cannot load the model folder" in _err(capsys)


@pytest.mark.parametrize("argv", [
    ["report", "--out", "{file}/report"],
    ["view", "--out", "{file}/view.html"],
    ["plot", "--layer", "1", "--head", "3", "--out", "{file}/map.png"],
    ["prune", "--step", "0.5", "--save", "{file}/pruned", "--fraction", "0.25"],
    ["train-toy", "--steps", "1", "--out", "{file}/toy"],
])
def test_an_out_path_under_a_file_is_one_line(argv, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    argv = [a.replace("{file}", str(blocker)) for a in argv]
    assert main(argv) == 2
    _err(capsys)
    assert blocker.read_text() == "mine"


def test_view_out_that_is_a_folder_is_one_line_even_with_force(tmp_path, capsys):
    (tmp_path / "v.html").mkdir()
    assert main(["view", "--out", str(tmp_path / "v.html"), "--force"]) == 2
    assert "folder" in _err(capsys)


def test_a_full_disk_keeps_the_old_view_and_reports_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "view.html"
    out.write_text("the good old page")

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("interp.runtime.files._write_all", full)
    assert main(["view", "--out", str(out), "--force"]) == 2
    assert "No space left on device" in _err(capsys)
    assert out.read_text() == "the good old page"  # before the fix: truncated
    assert sorted(p.name for p in tmp_path.iterdir()) == ["view.html"]  # no partial file


# -- 7: writes are whole or not at all, and never over a file unasked --------------------------------------------------
def test_write_report_refuses_to_overwrite_unless_asked_and_a_failure_leaves_nothing(tmp_path, monkeypatch):
    from analyses import write_report

    model = interp.load_model("toy-induction")
    out = tmp_path / "report"
    out.mkdir()
    (out / "index.html").write_text("an earlier report")
    (out / "notes.txt").write_text("the user's own file")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_report(model, out, n_prompts=4, study_prompts=2)
    assert (out / "index.html").read_text() == "an earlier report"

    import analyses.views.report as report

    def broken(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(report, "_pruning", broken)  # a full disk late in the report
    with pytest.raises(OSError):
        write_report(model, out, n_prompts=4, study_prompts=2, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report"]  # no staging folder left
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "notes.txt"]  # before: 6 partial files
    assert (out / "index.html").read_text() == "an earlier report"
    monkeypatch.undo()
    write_report(model, out, n_prompts=4, study_prompts=2, overwrite=True)
    assert "toy-induction" in (out / "index.html").read_text() and (out / "notes.txt").exists()


def test_atomic_write_and_staged_folder(tmp_path):
    path = atomic_write(tmp_path / "a.txt", "one")
    with pytest.raises(FileExistsError):
        atomic_write(path, "two")
    assert atomic_write(path, "two", overwrite=True).read_text() == "two"
    with pytest.raises(RuntimeError), staged_folder(tmp_path / "out") as staging:
        (staging / "x").write_text("partial")
        raise RuntimeError("midway")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


# -- 6: the bundled GGUF files ----------------------------------------------------------------------------------------
def _fake_package(tmp_path, content: bytes):
    digest = hashlib.sha256(content).hexdigest()

    def assemble(output_path=None, overwrite=False):  # the package's behaviour, on a small file
        target = Path(output_path)
        if target.exists() and not overwrite:
            if hashlib.sha256(target.read_bytes()).hexdigest() != digest:
                raise FileExistsError(f"{target} already exists with an unexpected sha256")
            return target
        target.write_bytes(content)
        return target

    return types.SimpleNamespace(assemble=assemble, MODEL_NAME="fake.gguf")


def test_a_truncated_gguf_from_a_killed_assembly_is_rebuilt(tmp_path, capsys):
    package = _fake_package(tmp_path, b"GGUF" * 1000)
    target = tmp_path / "gguf" / "fake.gguf"
    target.parent.mkdir()
    target.write_bytes(b"GGUF" * 10)  # what a killed assembly left (before the fix: FileExistsError for ever)
    assert bundled._assembled(package, target).read_bytes() == b"GGUF" * 1000
    assert "assembling it again" in capsys.readouterr().err
    assert sorted(p.name for p in target.parent.iterdir()) == ["fake.gguf"]


def test_stale_staging_left_by_a_killed_process_is_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process that has ended
    stale = tmp_path / f"smollm2-0.1.2-transformers-x.partial-{pid}"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"0" * 100)
    alive = tmp_path / f"smollm2-0.1.2-transformers-x.partial-{os.getpid()}"
    alive.mkdir()
    bundled._remove_stale(tmp_path, "smollm2-0.1.2-transformers-x.partial-")
    assert not stale.exists() and alive.exists()
