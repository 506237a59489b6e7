"""What a compression of heads cuts from a circuit (issue 49): the edges cut are exactly those the definitions in
``analyses/circuits/compression.py`` name, compressing nothing keeps the circuit's faithfulness, compressing every
head keeps what exact patching of the circuit less those edges gives, and mistakes get one line."""

from __future__ import annotations

import pytest
import torch

import interp
from analyses import (compression_cuts, compression_table, edge_frame, edge_patching, graph_edges, logit_difference,
                      prune_model)
from tests.tiny import tiny_model

TOL = 1e-5


def _pair(seed=0, shape=(3, 12)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 99, shape, generator=g), torch.randint(4, 99, shape, generator=g)


@pytest.fixture(scope="module")
def llama():  # 2 layers, 4 query heads on 2 key/value heads (groups of 2)
    return interp.load_model(tiny_model("llama"), attn="eager")


def _circuit(model, every=3):
    frame = edge_frame(graph_edges(model))
    return frame.iloc[::every].reset_index(drop=True)


def _expected(frame, heads, method, long=True):
    """The definitions, written out on names: (cut, partial) as sets of (upstream, downstream)."""
    names = {f"blocks.{l}.attn:{h}" for l, h in heads}
    kv = {}
    for l, h in heads:
        kv.setdefault(f"blocks.{l}.attn:{h // 2}", set()).add(h)
    cut, partial = set(), set()
    for u, d in zip(frame["upstream"], frame["downstream"]):
        receiver, _, which = d.rpartition(".")
        if method == "prune" and (u in names or which == "q" and receiver in names):
            cut.add((u, d))
        elif which in ("k", "v") and receiver in kv and long:
            (cut if len(kv[receiver]) == 2 else partial).add((u, d))
    return cut, partial


@pytest.mark.parametrize("method", ["prune", "stream"])
def test_the_edges_cut_are_exactly_those_the_definition_names(llama, method):
    frame = edge_frame(graph_edges(llama))  # every edge of the model
    heads = [(0, 1), (1, 0), (1, 1)]  # layer 1's key/value head 0 whole, layer 0's key/value head 0 in part
    df = compression_cuts(llama, frame, heads, method, tokens=12, sink=2, window=4)
    cut, partial = _expected(frame, heads, method)
    got = set(zip(df.loc[df["cut"], "upstream"], df.loc[df["cut"], "downstream"]))
    assert got == cut and len(cut) > 0
    assert set(zip(df.loc[df["partial"], "upstream"], df.loc[df["partial"], "downstream"])) == partial
    assert len(partial) > 0 and not (df["cut"] & df["partial"]).any()
    if method == "stream":  # a streaming head keeps its output and its query
        assert not df.loc[df["cut"], "input"].isin(["q", "mlp", "logits"]).any()
        short = compression_cuts(llama, frame, heads, method, tokens=6, sink=2, window=4)  # 6 <= 2 + 4
        assert not short["cut"].any() and not short["partial"].any()
    else:
        assert {"output removed", "query removed", "key/value head removed"} <= set(df["why"])


def test_nothing_compressed_keeps_the_circuits_faithfulness_and_the_whole_graph_keeps_one(llama):
    clean, corrupted = _pair()
    metric = logit_difference(5, 7)
    circuit = _circuit(llama)
    df = compression_table(llama, clean, corrupted, metric, circuit, {"none": []}, sink=2, window=4, n_bootstrap=50)
    assert list(df["method"]) == ["stream", "prune"] and (df["edges_cut"] == 0).all()
    assert (df["edges"] == len(circuit)).all()
    assert ((df["kept"] - df["faithfulness"]).abs() <= 1e-9).all() and ((df["kept_partial"] - df["kept"]).abs() <= 1e-9).all()
    assert ((df["metric"] - df.attrs["clean"]).abs() <= TOL).all() and ((df["metric_kept"] - 1).abs() <= 1e-4).all()
    whole = compression_table(llama, clean, corrupted, metric, edge_frame(graph_edges(llama)), {"none": []},
                              methods=["prune"], n_bootstrap=50)
    assert abs(whole["faithfulness"].iloc[0] - 1) <= 1e-4 and abs(whole["kept"].iloc[0] - 1) <= 1e-4
    # every head streaming with every key in its window (12 tokens <= 4 sinks + 8 recent): nothing cut, nothing lost
    heads = [(l, h) for l in range(2) for h in range(4)]
    wide = compression_table(llama, clean, corrupted, metric, circuit, {"all": heads}, methods=["stream"], sink=4,
                             window=8, n_bootstrap=50).iloc[0]
    assert wide["edges_cut"] == 0 and abs(wide["kept"] - df["faithfulness"].iloc[0]) <= 1e-9
    assert abs(wide["metric"] - df.attrs["clean"]) <= TOL


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_every_head_compressed_keeps_what_patching_the_circuit_less_its_cut_edges_gives(attn):
    llama = interp.load_model(tiny_model("llama"), attn=attn)
    clean, corrupted = _pair(1)
    metric = logit_difference(5, 7)
    circuit = _circuit(llama, every=2)
    heads = [(l, h) for l in range(2) for h in range(4)]
    df = compression_table(llama, clean, corrupted, metric, circuit, {"all": heads}, sink=2, window=4, n_bootstrap=50)
    full = edge_patching(llama, clean, corrupted, [], metric)
    empty = edge_patching(llama, clean, corrupted, edge_frame(graph_edges(llama)), metric)
    every = set(zip(*[edge_frame(graph_edges(llama))[c] for c in ("upstream", "downstream")]))
    for method in ("prune", "stream"):
        row = df[df["method"] == method].iloc[0]
        cut, partial = _expected(circuit, heads, method)
        assert not partial and row["edges_cut"] == len(cut) > 0 and row["edges_partial"] == 0
        if method == "prune":  # every edge from a head or into a q, k or v: only input/MLP -> MLP/logits remain
            left = {(u, d) for u, d in zip(circuit["upstream"], circuit["downstream"]) if (u, d) not in cut}
            assert all(":" not in u and ":" not in d for u, d in left)
        else:  # every edge into a k or v
            assert cut == {(u, d) for u, d in zip(circuit["upstream"], circuit["downstream"]) if d[-2:] in (".k", ".v")}
        kept = set(zip(circuit["upstream"], circuit["downstream"])) - cut
        value = edge_patching(llama, clean, corrupted, sorted(every - kept), metric)
        assert abs(row["kept"] - (value - empty) / (full - empty)) <= 1e-4
        assert row["kept"] == pytest.approx(row["kept_partial"], abs=1e-9)
    pruned = prune_model(llama, heads, allow_empty_layers=True)  # the structural pruning: the same metric
    with torch.no_grad():
        want = float(metric(pruned(clean), {"input_ids": clean}))
    assert df.loc[df["method"] == "prune", "metric"].iloc[0] == pytest.approx(want, abs=1e-4)
    assert df.loc[df["method"] == "stream", "metric"].iloc[0] != pytest.approx(df.attrs["clean"], abs=1e-4)


def test_bad_input_gets_one_line(llama):
    circuit = _circuit(llama)
    clean, corrupted = _pair()
    for call, match in [
        (lambda: compression_cuts(llama, circuit, [(0, 1)], "quantise"), "method must be one of stream, prune"),
        (lambda: compression_cuts(llama, circuit, [(0, 1)], "stream"), "needs tokens"),
        (lambda: compression_cuts(llama, circuit, [(0, 9)], "prune"), "head"),
        (lambda: compression_cuts(llama, circuit, [(0, 1)], "stream", tokens=12, window=0), "window must be"),
        (lambda: compression_cuts(llama, [("blocks.1.attn:0", "blocks.0.attn:0.q")], [], "prune"), "no edge"),
        (lambda: compression_table(llama, clean, corrupted, logit_difference(5, 7), circuit, {}), "non-empty dict"),
    ]:
        with pytest.raises(ValueError, match=match) as err:
            call()
        assert "\n" not in str(err.value)
