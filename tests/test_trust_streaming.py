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
    import analyses.long.retrieval as retrieval

    seen, original = [], retrieval.retrieval_heads
    monkeypatch.setattr(retrieval, "retrieval_heads", lambda model, **kw: seen.append(kw["context"]) or original(
        model, **kw))
    code, _, err = run(capsys, "stream", "--order", "retrieval", "--context", "48", "--tokens", "64", "--window", "8",
                       "--step", "0.5", "--out", str(tmp_path / "o"))
    assert code == 0, err
    assert seen == [48]


# -- --save --force replaces what interp wrote, and nothing else ------------------------------------------------
def _another_model(minilm, folder):
    """A folder holding an earlier save of interp: MiniLM, with its tokenizer (vocab.txt, tokenizer.json, ...)."""
    from interp.runtime.model_files import save_model

    save_model(minilm, folder)
    (folder / "notes.txt").write_text("the user's own file")
    assert (folder / "tokenizer.json").exists() and (folder / "tokenizer_config.json").exists()


STREAM = ("stream", "--tokens", "64", "--sink", "1", "--window", "8", "--step", "0.5", "--order", "random",
          "--seeds", "1", "--fraction", "0.5", "--force")


@pytest.mark.parametrize("verb", ["stream", "prune"])
def test_save_force_over_another_models_folder_leaves_only_the_new_model(capsys, tmp_path, minilm, verb):
    """`--save DIR --force` over a folder that held another model left that model's tokenizer behind (the saved
    model then loaded with it); now the files the earlier save wrote and this one does not are removed, and the
    user's own file stays."""
    saved = tmp_path / "saved"
    _another_model(minilm, saved)
    capsys.readouterr()
    argv = (*STREAM, "--out", str(tmp_path / "out")) if verb == "stream" else (
        "prune", "--fraction", "0.3", "--n-prompts", "4", "--step", "0.5", "--force")
    code, _, err = run(capsys, *argv, "--save", str(saved))
    assert code == 0, err
    assert sorted(p.name for p in saved.iterdir()) == ["config.json", "generation_config.json", "interp-files.json",
                                                       "model.safetensors", "notes.txt"]
    assert (saved / "notes.txt").read_text() == "the user's own file"
    loaded = interp.load_model(saved)
    assert loaded.tokenizer is None and loaded.cfg.vocab_size == 64  # the toy model's, not MiniLM's


def test_save_force_refuses_model_files_interp_did_not_write(capsys, tmp_path, minilm):
    """A folder whose model files interp did not write (no manifest lists them: saved by transformers itself, or a
    file the user replaced) is refused in one line before any work, and left as it was."""
    plain = tmp_path / "plain"
    minilm.hf.save_pretrained(plain)  # transformers' own save: no manifest
    before = sorted(p.name for p in plain.iterdir())
    code, _, err = run(capsys, *STREAM, "--out", str(tmp_path / "out"), "--save", str(plain))
    _one_line(code, err, "holds config.json, model.safetensors, which interp did not write there")
    assert sorted(p.name for p in plain.iterdir()) == before and not (tmp_path / "out").exists()
    ours = tmp_path / "ours"
    _another_model(minilm, ours)
    (ours / "tokenizer.json").write_text("{}")  # the user's own tokenizer now: its size is not what interp wrote
    capsys.readouterr()
    code, _, err = run(capsys, *STREAM, "--out", str(tmp_path / "out"), "--save", str(ours))
    _one_line(code, err, "holds tokenizer.json, which interp did not write there")
    assert (ours / "tokenizer.json").read_text() == "{}"


def test_save_without_force_refuses_a_non_empty_folder(capsys, tmp_path, minilm, monkeypatch):
    from safetensors import SafetensorError

    from interp.runtime.model_files import save_model

    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(FileExistsError, match=r"exists and is not empty; pass --force \(overwrite=True\)"):
        save_model(minilm, tmp_path)
    code, _, err = run(capsys, "prune", "--fraction", "0.3", "--save", str(tmp_path))
    _one_line(code, err, "exists and is not empty; pass --force")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]

    def fails(*args, **kwargs):  # a safetensors error without an OS error code inside
        raise SafetensorError("Error while serializing: something else")

    monkeypatch.setattr(minilm.hf, "save_pretrained", fails)
    with pytest.raises(OSError, match="cannot save the model to .* \\(nothing was written\\): Error while serial"):
        save_model(minilm, tmp_path / "new")
    assert not (tmp_path / "new").exists()


_FULL_DISK = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'


@pytest.mark.parametrize("verb", ["stream", "prune"])
@pytest.mark.parametrize("error", ["safetensors", "oserror"])
def test_a_full_disk_while_saving_is_one_line_and_leaves_nothing(capsys, tmp_path, monkeypatch, verb, error):
    """A full disk during `stream --save` or `prune --save` printed safetensors' traceback; now one line, exit 2, and
    no folder, no half-written file (the weights are written by transformers for a streamed model and by
    safetensors' save_model for a pruned one: both end in safetensors.torch.save_file)."""
    import errno

    import safetensors.torch
    import transformers.modeling_utils
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        if error == "safetensors":
            raise SafetensorError(_FULL_DISK)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    saved = tmp_path / "saved"
    argv = (*STREAM, "--out", str(tmp_path / "out")) if verb == "stream" else (
        "prune", "--fraction", "0.3", "--n-prompts", "4", "--step", "0.5")
    code, _, err = run(capsys, *argv, "--save", str(saved))
    if verb == "stream":  # the curves were written first, and said so
        assert err.startswith("wrote ") and "streaming_curve.csv" in err.splitlines()[0]
        err = err.split("\n", 1)[1]
    _one_line(code, err, f"interp {verb}: error: No space left on device")
    assert not saved.exists() and [p.name for p in tmp_path.iterdir() if "partial" in p.name] == []


def test_stream_says_how_many_key_value_heads_really_shrink(capsys, tmp_path):
    """On a grouped-query model (4 query heads on 2 key/value heads per layer) the table counts the key/value heads
    whose cache shrinks, and --save says in one line how many of the saved model's do."""
    import io
    import re

    import pandas as pd

    folder = tmp_path / "llama"
    interp.load_model(tiny_hf("llama")).save_pretrained(folder)
    capsys.readouterr()
    code, out, err = run(capsys, "stream", "--model", str(folder), "--tokens", "32", "--sink", "1", "--window", "4",
                         "--order", "random", "--seeds", "1", "--step", "0.5", "--out", str(tmp_path / "out"),
                         "--save", str(tmp_path / "saved"), "--fraction", "0.375")  # 3 of 8 heads: a group is split
    assert code == 0, err
    assert "kv_heads: the key/value heads (of 4) whose cache shrinks" in out.splitlines()[0]
    table = pd.read_csv(io.StringIO("\n".join(out.splitlines()[1:])), sep=r"\s+")
    assert table["kv_heads"].iloc[0] == 0 and table["kv_heads"].iloc[-1] == 4  # no head streaming, then all
    lines = err.strip().splitlines()
    assert lines[-2].startswith("saved a model whose 3 heads")
    assert re.match(r"Streaming these 3 query heads shrinks the cache of [01] of the model's 4 key/value heads: ",
                    lines[-1]) and "Warning" not in err
