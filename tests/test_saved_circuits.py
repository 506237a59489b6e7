"""Saved circuits (issue 49): a circuit's edges, provenance and faithfulness curve round-trip exactly through JSON; a
truncated or edited file, a file of another schema and a circuit of another model are refused in one line each;
`interp circuit diff A B` lists the edges added, removed and rescored (exit 2 with one line on bad input)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

import interp
from analyses import Circuit, circuit_of, diff_circuits, edge_attribution, load_circuit
from analyses.circuits.saved import EDGE_COLUMNS, SCHEMA
from analyses.cli import main
from analyses.data.provenance import tokenizer_digest, weights_digest
from tests.tiny import tiny_model


def synthetic_circuit(n_layers=30, n_heads=9, n_kv=3, n_edges=300, seed=0, name="SmolLM2-135M-Instruct",
                      weights="a" * 64) -> Circuit:
    """A circuit of a SmolLM2-shaped graph (30 layers of 9 query and 3 key/value heads, an MLP each) with
    ``n_edges`` distinct random edges, highest |score| first, and a five-point faithfulness curve."""
    rng = np.random.default_rng(seed)
    rows, seen = [], set()
    while len(rows) < n_edges:
        which = ("q", "k", "v", "mlp", "logits")[rng.integers(5)]
        down_layer = n_layers if which == "logits" else int(rng.integers(1, n_layers))
        up_layer = int(rng.integers(-1, down_layer))
        kind = "input" if up_layer < 0 else ("mlp" if rng.random() < 0.2 else "head")
        up_head = int(rng.integers(n_heads)) if kind == "head" else -1
        up = {"input": "input", "mlp": f"mlp.{up_layer}", "head": f"blocks.{up_layer}.attn:{up_head}"}[kind]
        if which in ("q", "k", "v"):
            down_head = int(rng.integers(n_heads if which == "q" else n_kv))
            down, down_site = f"blocks.{down_layer}.attn:{down_head}.{which}", f"blocks.{down_layer}.attn"
        else:
            down_head, down_site, down = -1, "", "logits" if which == "logits" else f"mlp.{down_layer}"
        if (up, down) not in seen:
            seen.add((up, down))
            rows.append((up, kind, up_layer, f"blocks.{up_layer}.attn" if kind == "head" else "", up_head, down, which,
                         down_layer, down_site, down_head, float(rng.normal() * 0.1)))
    edges = pd.DataFrame(rows, columns=list(EDGE_COLUMNS))
    edges = edges.loc[edges["score"].abs().sort_values(ascending=False, kind="stable").index].reset_index(drop=True)
    edges["in_circuit"] = np.arange(len(edges)) < n_edges // 2
    edges.attrs.update(method="eap-ig", steps=5, metric="logit_difference", clean=3.25, corrupted=-0.375)
    curve = pd.DataFrame({"size": [25, 50, 100, 200, 300], "edges": [20, 44, 90, 185, 280],
                          "faithfulness": [0.3, 0.55, 0.74, 0.86, 0.93], "lo": [0.2, 0.45, 0.66, 0.8, 0.88],
                          "hi": [0.4, 0.65, 0.82, 0.92, 0.98], "random": [np.nan, 0.1, 0.2, np.inf, 0.4]})
    curve.attrs.update(cpr=0.71, cmd=0.29, total_edges=70_000, forwards_per_point=1)
    provenance = {"model": {"name": name, "weights_sha256": weights, "tokenizer_sha256": "b" * 64},
                  "versions": {"interp": "0.1.0"}, "method": "eap-ig", "steps": 5, "metric": "logit_difference",
                  "task": "ioi", "prompts": {"n": 16, "clean_sha256": "c" * 64, "corrupted_sha256": "d" * 64},
                  "graph": {"sites": [[f"blocks.{l}.attn", l, n_heads, n_kv] for l in range(n_layers)],
                            "mlp": list(range(n_layers))}, "total_edges": 70_000}
    return Circuit(edges, provenance, curve)


def test_round_trip_is_exact(tmp_path):
    """Every cell (strings, integers, floats to the last bit, a bool column, NaN and inf in the curve), the frames'
    attrs and the provenance come back as saved; saving the loaded circuit writes the same bytes."""
    circuit = synthetic_circuit()
    path = circuit.save(tmp_path / "c.json")
    back = load_circuit(path)
    pd.testing.assert_frame_equal(back.edges, circuit.edges, check_exact=True)
    pd.testing.assert_frame_equal(back.curve, circuit.curve, check_exact=True)
    assert back.edges.attrs == circuit.edges.attrs and back.curve.attrs == circuit.curve.attrs
    assert back.provenance == circuit.provenance
    assert np.array_equal(back.edges["score"].to_numpy(), circuit.edges["score"].to_numpy())  # bit for bit
    assert np.isnan(back.curve["random"][0]) and np.isinf(back.curve["random"][3])
    again = back.save(tmp_path / "again.json")
    assert again.read_bytes() == path.read_bytes()
    with pytest.raises(FileExistsError):
        circuit.save(path)  # no overwrite unless asked
    (tmp_path / "mine.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not a circuit interp wrote"):
        circuit.save(tmp_path / "mine.json", overwrite=True)  # a file of someone else's is never replaced
    assert (tmp_path / "mine.json").read_text() == "{}"


def _one_line_error(path, match, **kw):
    with pytest.raises(ValueError, match=match) as err:
        load_circuit(path, **kw)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_truncated_edited_and_foreign_files_are_refused_in_one_line(tmp_path):
    path = synthetic_circuit(n_edges=40).save(tmp_path / "c.json")
    text = path.read_text()
    for cut in (len(text) // 2, len(text) - 3, 10):
        (tmp_path / "cut.json").write_text(text[:cut])
        message = _one_line_error(tmp_path / "cut.json", "truncated")
        assert f"{cut} bytes" in message and "write it again" in message
    body = json.loads(text)
    edits = {"score": lambda b: b["edges"]["values"][b["edges"]["columns"].index("score")].__setitem__(0, 0.5),
             "digest": lambda b: b["provenance"]["model"].__setitem__("weights_sha256", "e" * 64),
             "curve": lambda b: b["curve"]["values"][2].__setitem__(1, 0.99)}
    for what, edit in edits.items():
        changed = json.loads(text)
        edit(changed)
        (tmp_path / f"{what}.json").write_text(json.dumps(changed))
        message = _one_line_error(tmp_path / f"{what}.json", "was changed after it was written")
        assert body["content_sha256"][:16] in message and "restore the original" in message
    (tmp_path / "other.json").write_text(json.dumps({**body, "schema": SCHEMA + 1}))
    _one_line_error(tmp_path / "other.json", f"schema {SCHEMA + 1}.*reads schema {SCHEMA}")
    (tmp_path / "atlas.json").write_text(json.dumps({"schema": 1, "written_by": "interp atlas", "heads": []}))
    _one_line_error(tmp_path / "atlas.json", "is not a circuit")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00garbage")
    _one_line_error(tmp_path / "binary.json", "not a text")


def test_a_circuit_of_another_model_is_refused_by_digest(tmp_path):
    """A circuit found on one tiny Llama loads with that model and is refused with another (other weights) in one
    line naming both digests; the provenance records the model's digests and the prompts'."""
    model = interp.load_model(tiny_model("llama", seed=0))
    other = interp.load_model(tiny_model("llama", seed=1))
    g = torch.Generator().manual_seed(0)
    clean, corrupted = torch.randint(4, 99, (2, 8), generator=g), torch.randint(4, 99, (2, 8), generator=g)
    metric = lambda out, inputs: out.logits[:, -1, 5].mean()  # noqa: E731
    scores = edge_attribution(model, clean, corrupted, metric, method="eap")
    circuit = circuit_of(model, scores, clean, corrupted, edges=30, task="random tokens")
    p = circuit.provenance
    assert p["model"]["weights_sha256"] == weights_digest(model) and p["model"]["tokenizer_sha256"] == \
        tokenizer_digest(model)
    assert p["prompts"]["n"] == 2 and p["prompts"]["clean_sha256"] != p["prompts"]["corrupted_sha256"]
    assert p["method"] == "eap" and p["steps"] == 1 and p["total_edges"] == len(scores)
    assert list(circuit.edges["score"].abs()) == sorted(scores["score"].abs(), reverse=True)[:30]
    path = circuit.save(tmp_path / "c.json")
    pd.testing.assert_frame_equal(load_circuit(path, model=model).edges, circuit.edges, check_exact=True)
    message = _one_line_error(path, "is a circuit of .*weights sha256", model=other)
    assert weights_digest(model)[:16] in message and weights_digest(other)[:16] in message
    assert "find the circuit again" in message


def test_diff_lists_added_removed_and_rescored_edges_and_provenance_notes():
    a = synthetic_circuit(n_edges=50)
    edges = a.edges.drop(index=[3, 7]).copy()
    edges.loc[10, "score"] = edges.loc[10, "score"] * 2
    extra = a.edges.iloc[[0]].assign(upstream="blocks.0.attn:8", downstream="mlp.29", score=0.01)
    b = Circuit(pd.concat([edges, extra], ignore_index=True), {**a.provenance, "method": "eap", "steps": 1}, a.curve)
    table, notes = diff_circuits(a, b)
    assert list(table["change"]) == ["removed", "removed", "added", "changed"]
    removed = table[table["change"] == "removed"]
    assert list(removed["upstream"]) == list(a.edges.loc[[3, 7], "upstream"]) and list(removed["rank_a"]) == [4, 8]
    assert table.iloc[2]["downstream"] == "mlp.29" and np.isnan(table.iloc[2]["score_a"])
    assert table.iloc[3]["score_b"] == 2 * table.iloc[3]["score_a"]
    assert notes == ["method: eap-ig -> eap", "steps: 5 -> 1"]
    same, none = diff_circuits(a, a)
    assert same.empty and none == []


def test_interp_circuit_diff_prints_a_table_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    a = synthetic_circuit(n_edges=20).save(tmp_path / "a.json")
    b_circuit = synthetic_circuit(n_edges=20)
    b_circuit.edges.loc[0, "score"] = 1.5
    b = b_circuit.save(tmp_path / "b.json")
    assert main(["circuit", "diff", str(a), str(a)]) == 0
    assert "the same 20 edges" in capsys.readouterr().out
    assert main(["circuit", "diff", str(a), str(b)]) == 1
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split() == ["change", "upstream", "downstream", "score_a", "score_b", "rank_a", "rank_b"]
    assert len(lines) == 2 and lines[1].split()[0] == "changed" and "+1.5" in lines[1]
    assert "1 rescored" in err
    (tmp_path / "cut.json").write_text(a.read_text()[:500])

    cases = [(["diff", str(a), str(tmp_path / "cut.json")], "truncated"),
             (["diff", str(a), str(tmp_path / "missing.json")], "is not a file"),
             (["diff", str(a)], "diff A.json B.json"), (["compare", str(a), str(b)], "diff A.json B.json"),
             (["--task", "induction"], "--out is needed"),
             (["--task", "induction", "--out", str(tmp_path / "o"), "--atlas", str(a)], "is not an atlas")]
    for argv, expected in cases:
        assert main(["circuit", *argv]) == 2, argv
        text = capsys.readouterr().err.strip()  # one line, no traceback
        assert len(text.splitlines()) == 1 and expected in text and text.startswith("interp circuit: error:"), text
