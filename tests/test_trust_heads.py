"""Issue 35, detect_heads and `interp heads` (each test here failed before its fix): every argument is honoured or
refused on every kind of model, context= means the generated prompts' length, an unknown score lists every score
with the closest one, the table is sorted and cut, and long runs say what they are doing."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout

import pandas as pd
import pytest
import interp
from analyses import detect_heads
from analyses.cli import main
from analyses.heads import registry
from interp.runtime import progress as progress_module
from tests.tiny import model_class, tiny_model
from test_progress import restore  # noqa: F401  (the fixture that puts the progress setting back)

pytestmark = pytest.mark.filterwarnings("ignore:The set_bad function:PendingDeprecationWarning")


@pytest.fixture(scope="module")
def bart():
    return interp.load_model(tiny_model("bart", cls=model_class("bart", seq2seq=True)))


@pytest.fixture(scope="module")
def llama():
    return interp.load_model(tiny_model("llama"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Saved tiny models: a T5, a BART, and a 6-layer Llama with 24 heads (none has a tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    tiny_model("t5", cls=model_class("t5", seq2seq=True)).save_pretrained(root / "t5")
    tiny_model("bart", cls=model_class("bart", seq2seq=True)).save_pretrained(root / "bart")
    tiny_model("llama", num_hidden_layers=6).save_pretrained(root / "llama")
    return root


def run(*argv, threads: str = "1") -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main([*map(str, argv), "--threads", threads])
        except SystemExit as exit:  # argparse's own errors
            code = exit.code
    return code, out.getvalue(), err.getvalue()


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- 1: every argument honoured or refused on an encoder-decoder ------------------------------------------------------
def test_encoder_decoder_computes_the_scores_asked_for(bart):
    df = detect_heads(bart, scores=["induction", "alignment"], n_prompts=6, n_bootstrap=10)
    assert {"induction", "alignment"} <= set(df.columns)
    assert not {"previous_token", "sink", "source_sink", "source_positional"} & set(df.columns)
    assert df.loc[df["kind"] == "cross", "alignment"].notna().all()
    assert df.loc[df["kind"] == "self", "induction"].notna().all()
    cross = detect_heads(bart, scores=["alignment"], n_prompts=6, n_bootstrap=10)
    assert set(cross["kind"]) == {"cross"}  # no score asked for applies to the self-attention sites
    assert cross["alignment"].tolist() == df.loc[df["kind"] == "cross", "alignment"].tolist()
    low = detect_heads(bart, scores=["alignment"], n_prompts=6, n_bootstrap=10, thresholds={"alignment": 0.01})
    assert (low["label"] == "alignment").all()  # the cross heads' threshold is honoured, not refused


def test_encoder_decoder_refuses_what_it_cannot_compute_as_decoders_do(bart, llama):
    with pytest.raises(ValueError) as on_bart:
        detect_heads(bart, scores=["bogus"])
    with pytest.raises(ValueError) as on_llama:
        detect_heads(llama, scores=["bogus"])
    assert str(on_bart.value) == str(on_llama.value) and "Unknown score 'bogus'" in str(on_bart.value)
    with pytest.raises(TypeError, match="an encoder-decoder model has two stacks"):
        detect_heads(bart, scores=["retrieval"])
    with pytest.raises(TypeError, match="applies to cross attention sites"):
        detect_heads(llama, scores=["source_sink"])
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        detect_heads(bart, batch_size=0)


def test_encoder_decoder_runs_batch_size_pairs_per_forward(bart):
    rows = []
    handle = bart.hf.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                               with_kwargs=True)
    try:
        split = detect_heads(bart, n_prompts=8, batch_size=3, n_bootstrap=10)
    finally:
        handle.remove()
    assert sorted(rows) == [2, 3, 3]
    whole = detect_heads(bart, n_prompts=8, batch_size=8, n_bootstrap=10)
    numbers = [c for c in whole.columns if whole[c].dtype.kind == "f"]
    assert ((split[numbers] - whole[numbers]).abs().max().max()) < 1e-6


# -- 2: context= is the generated prompts' length, or refused -------------------------------------------------------
def test_context_sets_the_length_of_the_generated_prompts(llama, bart):
    df = detect_heads(llama, context=20, n_prompts=4, n_bootstrap=10)
    assert df.attrs["inputs"]["induction"] == "4 repeated random token sequences of 20 tokens"
    assert df.attrs["inputs"]["sink"].endswith("of 20 tokens")
    pairs = detect_heads(bart, context=7, n_prompts=4, n_bootstrap=10)
    assert pairs.attrs["inputs"]["alignment"] == "4 copy-task pairs of 7 random tokens"
    with pytest.raises(ValueError, match="prompts= were given, so drop context"):
        detect_heads(llama, context=20, prompts=[[1, 2, 3, 4]])
    with pytest.raises(ValueError, match=r"\['successor'\] build their own task prompts: drop context"):
        detect_heads(llama, scores=["successor"], context=20)
    with pytest.raises(ValueError, match="both set the generated prompts' length; give one"):
        detect_heads(llama, context=20, seq_len=30)
    with pytest.raises(ValueError, match="context 4 leaves 3 random tokens"):
        detect_heads(llama, context=4)


# -- 4: the unknown-score message ---------------------------------------------------------------------------------
def test_unknown_score_lists_every_score_and_the_closest(llama):
    with pytest.raises(ValueError) as err:
        detect_heads(llama, scores=["retreival"])
    message = str(err.value)
    assert "Did you mean 'retrieval'?" in message
    assert all(name in message for name in registry.names())


# -- 1, 3: the command line ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model, score, says", [("t5", "retrieval", "encoder-decoder model has two stacks"),
                                                ("bart", "successor", "encoder-decoder model has two stacks"),
                                                ("llama", "alignment", "applies to cross attention sites")])
def test_scores_a_model_cannot_take_are_one_line_and_exit_2(folders, model, score, says):
    code, out, err = run("heads", "--model", folders / model, "--scores", score)
    assert code == 2 and out == "" and says in _one_line(err)


def test_the_help_names_every_score(monkeypatch):
    """The help is written without importing the scores (``interp --help`` stays fast): this keeps it true."""
    monkeypatch.setenv("COLUMNS", "200")  # argparse breaks a long name across lines in a narrow terminal
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        main(["heads", "--help"])
    text = " ".join(out.getvalue().split())
    missing = [n for n in registry.names() if n not in text]
    assert missing == [], text


# -- 5: sorted, cut, labels first ------------------------------------------------------------------------------------
def test_table_is_sorted_cut_to_top_and_labels_come_first(folders):
    code, out, _ = run("heads", "--model", folders / "llama", "--n-prompts", "4", "--scores", "sink,induction")
    lines = out.strip().splitlines()
    assert code == 0 and lines[-1] == "# 4 more heads not shown (sorted by sink); --top 0 shows all"
    assert lines[0].split()[:7] == ["stack", "kind", "site", "layer", "head", "label", "labels"] and len(lines) == 22
    at = lines[0].split().index("sink") - len(lines[0].split())  # from the end: labels may be empty
    sinks = [float(line.split()[at]) for line in lines[1:-1]]
    assert sinks == sorted(sinks, reverse=True)
    code, out, _ = run("heads", "--model", folders / "llama", "--n-prompts", "4", "--scores", "sink", "--top", "0")
    assert code == 0 and len(out.strip().splitlines()) == 25 and "more heads" not in out

    code, out, _ = run("heads", "--model", folders / "llama", "--n-prompts", "4", "--format", "csv")
    every = pd.read_csv(io.StringIO(out))  # csv keeps every head, in site order, without --top
    assert len(every) == 24 and list(zip(every["layer"], every["head"])) == [(l, h) for l in range(6) for h in range(4)]
    code, out, _ = run("heads", "--model", folders / "llama", "--n-prompts", "4", "--format", "csv", "--scores",
                       "induction", "--top", "3")
    top = pd.read_csv(io.StringIO(out))
    assert len(top) == 3 and top["induction"].tolist() == sorted(every["induction"], reverse=True)[:3]


# -- 6: --threads -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", [["heads"], ["train-toy", "--out", "/tmp/never-written"]])
@pytest.mark.parametrize("threads", ["0", "-1", "two"])
def test_threads_below_one_are_refused_in_one_line(verb, threads):
    """Already refused at HEAD (when the command ran); now argparse refuses it, before anything loads."""
    code, out, err = run(*verb, threads=threads)
    assert code == 2 and out == "" and "--threads" in _one_line(err)


# -- 7: progress ------------------------------------------------------------------------------------------------------
def test_each_stage_writes_a_line_when_stderr_is_not_a_terminal(restore, monkeypatch):
    monkeypatch.delenv("INTERP_PROGRESS", raising=False)
    code, out, err = run("heads", "--model", "toy-induction", "--scores", "induction,retrieval", "--context", "48",
                         "--n-prompts", "4")
    lines = err.strip().splitlines()
    assert code == 0 and "heads: 4 prompts in 1 batch (induction): 0/2 site" in lines  # counted per site of a batch
    assert any(line.startswith("heads: 4 prompts in 1 batch (induction): 2/2 site, done in") for line in lines)
    assert "retrieval: needle trials: 0/6 trial" in lines
    assert any(line.startswith("retrieval: needle trials: 6/6 trial, done in") for line in lines)
    assert progress_module._state["on"] is None  # the command's choice does not outlive it


def test_python_api_stages_in_lines_mode(restore, llama, capsys):
    interp.set_progress("lines")
    detect_heads(llama, scores=["copy_suppression"], n_bootstrap=10)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "heads: copy_suppression: 0/1 step"
    assert err[1] == "copy suppression: 0/2 layer"  # the score's own progress, a layer at a time
    assert err[-1].startswith("heads: copy_suppression: 1/1 step, done in")
    interp.set_progress(False)
    detect_heads(llama, scores=["copy_suppression"], n_bootstrap=10)
    assert capsys.readouterr().err == ""
