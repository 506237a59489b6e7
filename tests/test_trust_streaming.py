"""Issue 35 on the `interp stream` and `interp prune` commands: a model without full attention, --context, --save
with --force over another model's folder, a full disk, and the note on key/value heads that really shrink."""

from __future__ import annotations

import pytest
from conftest import tiny_hf

import interp
from analyses.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:The set_bad function:PendingDeprecationWarning")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(code, err, message):
    assert code == 2, err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("verb", ["stream", "report"])
def test_a_model_without_a_full_attention_layer_is_one_line(capsys, tmp_path, verb):
    """`interp stream` and `interp report --streaming` on Mistral with a sliding window on every layer raised
    ZeroDivisionError; now one line, exit 2, before any study runs."""
    folder = tmp_path / "mistral"
    interp.load_model(tiny_hf("mistral", sliding_window=4)).save_pretrained(folder)
    capsys.readouterr()  # transformers' progress bar of the save
    argv = (["stream", "--tokens", "32", "--window", "4"] if verb == "stream" else ["report", "--streaming"])
    code, _, err = run(capsys, *argv, "--model", str(folder), "--out", str(tmp_path / "out"))
    _one_line(code, err, "no head of this mistral model can stream: every layer already has a sliding window")
    assert not (tmp_path / "out").exists()


def test_context_without_a_retrieval_order_is_refused(capsys, tmp_path):
    """`interp stream --context` was ignored unless the retrieval order ran: now refused in one line."""
    code, _, err = run(capsys, "stream", "--order", "random,gates", "--context", "64", "--out", str(tmp_path / "o"))
    _one_line(code, err, "--context sets the length of the retrieval order's needle prompts, and --order random,gates "
                         "has no retrieval order")


def test_context_sets_the_retrieval_orders_prompts(capsys, tmp_path, monkeypatch):
    import analyses.retrieval as retrieval

    seen, original = [], retrieval.retrieval_heads
    monkeypatch.setattr(retrieval, "retrieval_heads", lambda model, **kw: seen.append(kw["context"]) or original(
        model, **kw))
    code, _, err = run(capsys, "stream", "--order", "retrieval", "--context", "48", "--tokens", "64", "--window", "8",
                       "--step", "0.5", "--out", str(tmp_path / "o"))
    assert code == 0, err
    assert seen == [48]
