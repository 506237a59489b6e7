"""The `interp` command line: every subcommand on the bundled toy model, and one-line errors (exit 2)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pandas as pd
import pytest

from analyses.cli import main

# seaborn 0.13 calls a matplotlib method that matplotlib 3.11 marks for deprecation; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:The set_bad function:PendingDeprecationWarning")


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_console_script_help():
    done = subprocess.run([sys.executable, "-m", "analyses.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0
    for command in ("info", "heads", "ablate", "prune", "stream", "plot", "train-toy", "report"):
        assert command in done.stdout


def test_info_says_what_the_probe_found(capsys):
    code, out, _ = run(capsys, "info", "minilm")
    assert code == 0
    found = out.split("found by the load probe:")[1]
    assert "post-norm; hook_resid_mid is the output of attention.output.LayerNorm" in found
    assert "hook_attn_out: output of attention.output.dense" in found and "bidirectional" in found


def test_info(capsys):
    code, out, _ = run(capsys, "info", "toy-induction", "--format", "json")
    assert code == 0
    info = json.loads(out)
    assert info["n_layers"] == 2 and "blocks.1.attn.hook_z" in info["hook_names"]
    code, out, _ = run(capsys, "info", "--format", "csv")
    table = pd.read_csv(io.StringIO(out)).set_index("property")["value"]
    assert code == 0 and table["n_heads"] == "4"


def test_heads_csv_finds_the_toy_circuit(capsys):
    code, out, _ = run(capsys, "heads", "--format", "csv", "--n-prompts", "20")
    assert code == 0
    df = pd.read_csv(io.StringIO(out))
    assert len(df) == 8
    assert set(df.loc[df.label == "induction", "layer"]) == {1}
    assert set(df.loc[df.label == "previous_token", "layer"]) == {0}


def test_ablate_json(capsys):
    code, out, _ = run(capsys, "ablate", "--format", "json", "--n-prompts", "8", "--heads", "1.3,0.1")
    assert code == 0
    rows = json.loads(out)
    assert sorted((r["layer"], r["head"]) for r in rows) == [(0, 1), (1, 3)]
    assert all(r["delta"] == pytest.approx(r["metric"] - r["baseline"]) for r in rows)


def test_heads_are_sites_on_every_model(capsys):
    """SITE.HEAD names a head on every model; on the toy (one site per layer) blocks.1.attn.3 is 1.3."""
    code, by_site, _ = run(capsys, "ablate", "--format", "csv", "--n-prompts", "4", "--heads", "blocks.1.attn.3,0.1")
    code_layers, by_layer, _ = run(capsys, "ablate", "--format", "csv", "--n-prompts", "4", "--heads", "1.3,0.1")
    assert code == code_layers == 0 and by_site == by_layer and "blocks.1.attn" in by_site


@pytest.mark.parametrize("method", ["mean", "resample"])
def test_ablate_methods(capsys, method):
    code, out, _ = run(capsys, "ablate", "--method", method, "--n-prompts", "8", "--heads", "1.3")
    assert code == 0 and "baseline" in out


def test_prune_and_save(capsys, tmp_path):
    code, out, err = run(capsys, "prune", "--step", "0.25", "--n-prompts", "8", "--save", str(tmp_path / "pruned"),
                         "--fraction", "0.25")
    assert code == 0 and "importance" in out and "random" in out
    import interp

    pruned = interp.load_model(tmp_path / "pruned")
    assert sum(pruned.cfg.heads_per_layer) == 6


def test_stream_curves_and_save(capsys, tmp_path):
    """`interp stream` on the toy model (issue 26): the lowest-retrieval heads (layer 0's) stream first and leave the
    second-copy loss where it was, random orders break it; --save writes a model that loads streaming."""
    out_dir, saved = tmp_path / "curve", tmp_path / "streamed"
    code, out, err = run(capsys, "stream", "--tokens", "64", "--sink", "1", "--window", "8", "--step", "0.25",
                         "--format", "csv", "--out", str(out_dir), "--save", str(saved), "--fraction", "0.5")
    assert code == 0, err
    df = pd.read_csv(io.StringIO(out))
    assert df.equals(pd.read_csv(out_dir / "streaming_curve.csv"))
    assert (out_dir / "streaming_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert set(df.order) == {"retrieval", "random"} and set(df.seed.dropna()) == {0, 1, 2}
    at = df[df.fraction_streaming == 0.5].groupby("order").metric.mean()
    full = df[df.fraction_streaming == 0].metric.iloc[0]
    assert at["retrieval"] < full + 0.05 < at["random"]  # the detector's order keeps the induction circuit
    import interp
    from interp.streaming import streaming_record

    record = streaming_record(interp.load_model(saved))
    assert record == {"sink": 1, "window": 8, "heads": [(0, 0), (0, 1), (0, 2), (0, 3)]}
    assert "stream (sink 1, window 8)" in err


def test_plot(capsys, tmp_path):
    png = tmp_path / "map.png"
    code, out, _ = run(capsys, "plot", "--layer", "1", "--head", "3", "--out", str(png))
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kind, extra", [("heads", ["--score", "previous_token"]), ("ablation", []),
                                         ("pruning", ["--step", "0.5"])])
def test_plot_tables_computed_or_read_from_csv(capsys, tmp_path, kind, extra):
    computed = tmp_path / f"{kind}.png"
    code, out, err = run(capsys, "plot", kind, "--n-prompts", "8", *extra, "--out", str(computed))
    assert code == 0, err
    assert computed.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and computed.stat().st_size > 5000
    table = {"heads": ["heads", "--n-prompts", "8"], "ablation": ["ablate", "--n-prompts", "8"],
             "pruning": ["prune", "--n-prompts", "8", "--step", "0.5"]}[kind]
    code, out, _ = run(capsys, *table, "--format", "csv")
    csv = tmp_path / f"{kind}.csv"
    csv.write_text(out)
    code, _, err = run(capsys, "plot", kind, "--csv", str(csv), *extra[:2] if kind == "heads" else [],
                       "--out", str(tmp_path / f"{kind}_from_csv.png"))
    assert code == 0, err
    code, _, err = run(capsys, "plot", kind, "--csv", str(csv), "--out", str(computed))
    assert code == 2 and "--force" in err  # an existing figure is not replaced silently


def test_train_toy_small(capsys, tmp_path):
    code, out, _ = run(capsys, "train-toy", "--out", str(tmp_path / "toy"), "--steps", "20")
    assert code == 0 and json.loads(out)["steps"] == 20
    assert "interp train-toy --out" in (tmp_path / "toy" / "TRAINING.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["info", "/no/such/folder"], "No model folder"),
    (["heads", "--model", "not-a-model"], "No model folder 'not-a-model'"),
    (["heads", "--prompts", "/no/such/prompts.txt"], "cannot read prompts file"),
    (["plot", "--layer", "5", "--head", "0", "--out", "x.png"], "layer"),
    (["plot", "--layer", "0", "--head", "9", "--out", "x.png"], "head"),
    (["ablate", "--heads", "1-3"], "LAYER.HEAD"),
    (["train-toy", "--out", "toy", "--steps", "0"], "--steps must be at least 1"),
    (["prune", "--save", "somewhere"], "--save needs --fraction"),
    (["prune", "--save", "somewhere", "--fraction", "1.5"], "in (0, 1)"),
    (["prune", "--fraction", "0.3"], "goes with --save"),
    (["stream", "--out", "o", "--order", "retrieval,best"], "--order takes retrieval, importance, random"),
    (["stream", "--out", "o", "--save", "s"], "--save needs --fraction"),
    (["stream", "--out", "o", "--sink", "-1"], "--sink is a number of keys"),
    (["stream", "--out", "o", "--order", "gates", "--steps", "0"], "--steps"),
    (["report", "--model", "minilm", "--streaming", "--out", "o"], "streaming section is for causal decoders"),
    (["stream", "--out", "o", "--tokens", "64"], "would still see every key"),
    (["plot", "--out", "x.png"], "needs --layer and --head"),
    (["plot", "heads", "--csv", "missing.csv", "--out", "x.png"], "cannot read table"),
    (["plot", "grid", "--out", "x.png"], "invalid choice: 'grid'"),  # argparse's own errors: one line too
    (["heads", "--n-prompts", "many"], "invalid int value"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    try:
        code, out, err = run(capsys, *argv)
    except SystemExit as exit:  # argparse exits by itself
        code, (out, err) = exit.code, capsys.readouterr()
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_empty_prompts_file(capsys, tmp_path):
    prompts = tmp_path / "empty.txt"
    prompts.write_text("\n  \n")
    code, _, err = run(capsys, "heads", "--prompts", str(prompts))
    assert code == 2 and "no non-empty line" in err


def test_report_refuses_a_file_and_a_non_empty_folder(capsys, tmp_path):
    target = tmp_path / "file"
    target.write_text("keep me")
    code, _, err = run(capsys, "report", "--out", str(target))
    assert code == 2 and "is a file" in err and target.read_text() == "keep me"
    folder = tmp_path / "full"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    code, _, err = run(capsys, "report", "--out", str(folder))
    assert code == 2 and "--force" in err
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]


def test_errors_from_the_installed_script_have_no_traceback(tmp_path):
    done = subprocess.run(["interp", "info", str(tmp_path / "missing")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_help_imports_no_heavy_module_and_lists_every_bundled_model():
    """`interp --help` took 8 s (issue 27): it now imports neither torch nor transformers, pandas or matplotlib, and
    its --model help names every bundled model."""
    code = ("import sys; from analyses.cli import main\n"
            "try:\n    main(['view', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'pandas', 'matplotlib') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    import interp
    from analyses.cli import BUNDLED_NAMES

    assert set(BUNDLED_NAMES) == set(interp.BUNDLED)
    for name in BUNDLED_NAMES:
        assert name in done.stdout


def test_heads_takes_retrieval_and_its_context(capsys):
    """`interp heads --scores retrieval --context N` (issue 25): the retrieval column, or one line for a context
    the model cannot take."""
    assert main(["heads", "--scores", "retrieval", "--context", "64", "--format", "csv"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("stack,kind,site,layer,head,label,labels,retrieval")  # labels first (issue 35)
    assert main(["heads", "--scores", "retrieval", "--context", "100000"]) == 2
    assert "context must be" in capsys.readouterr().err
