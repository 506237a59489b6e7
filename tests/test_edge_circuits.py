"""Edge circuits (issue 48): exact edge patching equals a direct recomputation of the one receiver input it changes
(both ways, every kind of input), equals path patching on attention-only models, and every edge / no edge gives the
other run / the run itself; models the graph does not cover are refused in one line."""

from __future__ import annotations

import pytest
import torch

import interp
from analyses import (circuit_areas, edge_attribution, edge_patching, faithfulness, graph_edges, greater_than_task,
                      induction_task,
                      logit_difference, path_patching, refine_circuit, select_circuit)
from test_seq2seq import _tiny as tiny_seq2seq
from tests.tiny import tiny_model

TOL = 1e-5


def _pair(seed=0, shape=(2, 10)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 99, shape, generator=g), torch.randint(4, 99, shape, generator=g)


def _outputs(model, ids):
    names = ["blocks.0.hook_resid_pre"] + [f"blocks.{l}.attn.hook_result" for l in range(model.cfg.n_layers)]
    names += [f"blocks.{l}.hook_mlp_out" for l in range(model.cfg.n_layers)]
    with torch.no_grad():
        _, cache = model.run_with_cache(ids, names=names)
    return cache


def _node(cache, name):
    if name == "input":
        return cache["blocks.0.hook_resid_pre"]
    if name.startswith("mlp."):
        return cache[f"blocks.{name[4:]}.hook_mlp_out"]
    site, head = name.split(":")
    return cache[f"{site}.hook_result"][:, :, int(head)]


def _by_hand(model, base, other, up, down):
    """The base run in which only ``down`` reads base's stream plus (other's - base's) output of ``up``: the stream
    edited at the receiver's block input (or the MLP's, or the output's), the receiver's own q/k/v or MLP output taken
    from that run and put into an otherwise untouched base run."""
    delta = _node(_outputs(model, other), up) - _node(_outputs(model, base), up)
    add = lambda act, hook: act + delta  # noqa: E731
    with torch.no_grad():
        if down == "logits":
            last = model.cfg.n_layers - 1
            return model.run_with_hooks(base, fwd_hooks=[(f"blocks.{last}.hook_resid_post", add)]).logits
        if down.startswith("mlp."):
            layer = int(down[4:])
            _, c = model.run_with_cache(base, names=[f"blocks.{layer}.hook_mlp_out"],
                                        fwd_hooks=[(f"blocks.{layer}.hook_attn_out", add)])
            put = c[f"blocks.{layer}.hook_mlp_out"]
            return model.run_with_hooks(base, fwd_hooks=[(f"blocks.{layer}.hook_mlp_out", lambda a, h: put)]).logits
        return _head_input_by_hand(model, base, down, add)


def _head_input_by_hand(model, base, down, add):
    """The base run in which only head ``down``'s q, k or v (``"blocks.1.attn:0.k"``) is taken from a run whose
    block input was edited by ``add``."""
    site, rest = down.split(":")
    head, which = int(rest.split(".")[0]), rest.split(".")[1]
    layer = int(site.split(".")[1])
    name = f"{site}.hook_{which}"
    with torch.no_grad():
        _, c = model.run_with_cache(base, names=[name], fwd_hooks=[(f"blocks.{layer}.hook_resid_pre", add)])

        def put(act, hook):
            act = act.clone()
            act[:, :, head] = c[name][:, :, head]
            return act

        return model.run_with_hooks(base, fwd_hooks=[(name, put)]).logits


EDGES = [("input", "blocks.1.attn:3.q"), ("blocks.0.attn:1", "blocks.1.attn:1.k"), ("mlp.0", "blocks.1.attn:0.v"),
         ("blocks.1.attn:2", "mlp.1"), ("blocks.0.attn:0", "mlp.0"), ("mlp.1", "logits"), ("blocks.0.attn:3", "logits")]


def each_edge_matches_by_hand(model, clean, corrupted, edges, by_hand, plain: dict, matters: float = 1e-3):
    """Each edge patched either way (the clean run with it corrupted, the corrupted run with it clean) changes the
    run's logits ``plain[run]`` by more than ``matters`` and equals ``by_hand(model, base, other, up, down)``."""
    for run, (base, other) in (("clean", (clean, corrupted)), ("corrupted", (corrupted, clean))):
        for up, down in edges:
            got = edge_patching(model, clean, corrupted, [(up, down)], run=run).logits
            want = by_hand(model, base, other, up, down)
            assert (got - plain[run]).abs().max() > matters, (up, down)  # the edge matters
            assert (got - want).abs().max() <= TOL, (run, up, down, float((got - want).abs().max()))


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
def test_one_edge_equals_a_direct_recomputation(family, attn):
    model = interp.load_model(tiny_model(family), attn=attn)
    clean, corrupted = _pair()
    with torch.no_grad():
        plain = {"clean": model(clean).logits, "corrupted": model(corrupted).logits}
    each_edge_matches_by_hand(model, clean, corrupted, EDGES, _by_hand, plain, matters=1e-4)


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_edge_gives_the_other_run_and_none_the_run(family, attn):
    model = interp.load_model(tiny_model(family), attn=attn)
    clean, corrupted = _pair(1)
    every = [(u.name, r.name) for u, r in graph_edges(model)]
    with torch.no_grad():
        logits = {"clean": model(clean).logits, "corrupted": model(corrupted).logits}
    for run, other in (("clean", "corrupted"), ("corrupted", "clean")):
        assert (edge_patching(model, clean, corrupted, every, run=run).logits - logits[other]).abs().max() <= TOL
        assert torch.equal(edge_patching(model, clean, corrupted, [], run=run).logits, logits[run])


def _attention_only(model):
    """The MLPs' output weights zeroed: no MLP carries a sender's effect another way."""
    for l in range(model.cfg.n_layers):
        mlp = model._blocks[l].get_submodule(model.structure.mlp[l])
        last = [m for m in mlp.modules() if hasattr(m, "weight") and m.weight.ndim == 2][-1]
        with torch.no_grad():
            last.weight.zero_()
            if getattr(last, "bias", None) is not None:
                last.bias.zero_()
    return model


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi", "gpt_neox"])  # phi, gpt_neox: parallel blocks
def test_one_edge_clean_equals_path_patching_on_an_attention_only_model(family):
    model = _attention_only(interp.load_model(tiny_model(family, num_hidden_layers=3, n_layer=3)))
    clean, corrupted = _pair(2)
    metric = logit_difference(5, 7)
    site = model.cfg.sites[2]
    group = site.n_heads // site.n_kv_heads
    for via in ("q", "k", "v"):
        for sender, receiver in ((0, 1), (1, 3)):
            df = path_patching(model, clean, corrupted, [(2, receiver)], metric, senders=[(0, sender), (1, sender)],
                               via=via, heads_per_forward=1)
            r = receiver if via == "q" else receiver // group
            for layer in (0, 1):
                got = edge_patching(model, clean, corrupted, [(f"blocks.{layer}.attn:{sender}",
                                                               f"blocks.2.attn:{r}.{via}")], metric, run="corrupted")
                want = df.set_index(["layer", "head"]).loc[(layer, sender), "metric"]
                assert abs(got - want) <= TOL, (via, layer, sender, got, want)
                assert abs(got - df.attrs["corrupted"]) > 1e-4  # the path carries something


def test_bad_edges_and_unsupported_models_get_one_line():
    model = interp.load_model(tiny_model("llama"))
    clean, corrupted = _pair()
    with pytest.raises(ValueError, match="no edge blocks.1.attn:0 -> blocks.0.attn:0.q"):
        edge_patching(model, clean, corrupted, [("blocks.1.attn:0", "blocks.0.attn:0.q")])
    with pytest.raises(ValueError, match="No downstream input 'blocks.1.attn:3.k'"):  # 2 key/value heads
        edge_patching(model, clean, corrupted, [("input", "blocks.1.attn:3.k")])
    with pytest.raises(ValueError, match="No upstream node 'mlp.7'"):
        edge_patching(model, clean, corrupted, [("mlp.7", "logits")])
    with pytest.raises(ValueError, match="post-norm .*BART"):  # T5 (pre-norm): test_edge_circuit_seq2seq.py
        graph_edges(interp.load_model(tiny_seq2seq("bart")))


def _linear_one_layer():
    """A one-layer attention-only Llama whose norms are linear: RMSNorm with an epsilon so large that the input's own
    mean square vanishes beside it in float32 (the weight scaled back up)."""
    model = _attention_only(interp.load_model(tiny_model("llama", num_hidden_layers=1), attn="eager"))
    for norm in (model.in_norm_of(model.cfg.sites[0]), model.block_norm(0, mlp_input=True), model.final_norm()):
        norm.variance_epsilon = 1e12
        with torch.no_grad():
            norm.weight.mul_(1e6)
    return model


def test_eap_equals_exact_edge_patching_on_a_linear_one_layer_model_with_frozen_patterns():
    model = _linear_one_layer()
    clean, corrupted = _pair(4)
    metric = logit_difference(5, 7)
    with torch.no_grad():
        _, cache = model.run_with_cache(corrupted, names=["blocks.0.attn.hook_pattern"])
    frozen = cache["blocks.0.attn.hook_pattern"]
    with model.hooks([("blocks.0.attn.hook_pattern", lambda act, hook: frozen)]):
        df = edge_attribution(model, clean, corrupted, metric, method="eap")
        ig = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=3)
        base = edge_patching(model, clean, corrupted, [], metric, run="corrupted")
        exact = [edge_patching(model, clean, corrupted, [(u, d)], metric, run="corrupted") - base
                 for u, d in zip(df["upstream"], df["downstream"])]
    exact = torch.tensor(exact, dtype=torch.float64)
    assert exact.abs().max() > 0.1  # the edges carry something
    assert (torch.tensor(df["score"].to_numpy()) - exact).abs().max() <= TOL
    assert (torch.tensor(ig["score"].to_numpy()) - exact).abs().max() <= TOL  # a linear model: IG = EAP
    # q and k edges do nothing with the patterns frozen; v and logit edges do
    assert df.loc[df["input"].isin(["q", "k"]), "score"].abs().max() == 0.0


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_eap_on_the_flash_path_equals_the_eager_path_and_ig_with_one_step_is_eap(family):
    clean, corrupted = _pair(5)
    metric = logit_difference(5, 7)
    got = {attn: edge_attribution(interp.load_model(tiny_model(family), attn=attn), clean, corrupted, metric,
                                  method="eap") for attn in ("eager", "flash")}
    assert got["eager"]["score"].abs().max() > 0.1
    assert (got["eager"]["score"] - got["flash"]["score"]).abs().max() <= 1e-4
    model = interp.load_model(tiny_model(family), attn="flash")
    one = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=1)
    assert (one["score"] - got["flash"]["score"]).abs().max() <= TOL
    five = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=5)
    assert (five["score"] - one["score"]).abs().max() > 1e-3  # a non-linear model: the path matters
    assert list(five.columns[:10]) == ["upstream", "up_kind", "up_layer", "up_site", "up_head", "downstream", "input",
                                       "down_layer", "down_site", "down_head"]
    assert set(five["input"]) == {"q", "k", "v", "mlp", "logits"}


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "bert"])  # bert: the norms' scales sliced alike
def test_long_inputs_give_the_scores_of_short_ones(family, monkeypatch):
    """What long inputs switch on (each step contracted as it ends instead of the steps' gradients summed first,
    during the backward a block at a time where the model is one stack of pre-norm blocks; positions in several
    chunks) gives the same scores as the whole at once."""
    from analyses.circuits import attribution, taps

    model = interp.load_model(tiny_model(family), attn="flash")
    clean, corrupted = _pair(3, shape=(2, 9))
    metric = logit_difference(5, 7)
    whole = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=3)
    monkeypatch.setattr(attribution, "_SUMMED_ELEMENTS", 0)
    nodes = whole.drop_duplicates("upstream").shape[0]
    monkeypatch.setattr(attribution, "_CHUNK_ELEMENTS", nodes * 2 * model.cfg.d_model * 2)  # 2 positions a chunk
    parts = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=3)
    assert whole["score"].abs().max() > 0.1
    assert (whole["score"] - parts["score"]).abs().max() <= 1e-5 * whole["score"].abs().max()
    monkeypatch.setattr(taps, "TAPS_BYTES", 0)  # contracted at every block the backward reaches
    contracted, contract = [], attribution._contract
    monkeypatch.setattr(attribution, "_contract", lambda m, keys, **kw: (contracted.append(list(keys)),
                                                                        contract(m, keys, **kw)))
    early = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=3)
    assert (whole["score"] - early["score"]).abs().max() <= 1e-5 * whole["score"].abs().max()
    blocks = model.cfg.n_layers
    assert len(contracted) == 3 * (1 if family == "bert" else blocks)  # post-norm: after each backward


def test_toy_induction_circuit_k_edges_from_the_previous_token_head_and_faithfulness_beats_random():
    model = interp.load_model("toy-induction", attn="eager")
    clean, corrupted, metric = induction_task(model, n=16, length=12)
    with torch.no_grad():
        _, cache = model.run_with_cache(clean, names=["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"])
    offset = clean.shape[1] - 24
    previous = cache["blocks.0.attn.hook_pattern"].diagonal(-1, 2, 3).mean((0, 2))  # (h,): weight on i - 1
    induction = cache["blocks.1.attn.hook_pattern"].diagonal(-11, 2, 3)[:, :, offset + 1:].mean((0, 2))
    prev_head = int(previous.argmax())
    assert previous[prev_head] > 0.9
    inductions = [h for h in range(4) if induction[h] > 0.9]
    assert len(inductions) >= 2
    model.set_attn("flash")
    df = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=5)
    for h in inductions:
        into_k = df[df["downstream"] == f"blocks.1.attn:{h}.k"]
        assert into_k.loc[into_k["abs_score"].idxmax(), "upstream"] == f"blocks.0.attn:{prev_head}", h
    top = faithfulness(model, clean, corrupted, metric, df, sizes=(20, 40), n_random=5)
    assert top["faithfulness"].iloc[0] < 0.5 < 0.8 <= top["lo"].iloc[1]  # the top 20 by |score| miss edges (below)
    curve = faithfulness(model, clean, corrupted, metric, df, sizes=(20,), n_random=5, refine=True)
    at20 = curve.iloc[0]
    assert at20["edges"] <= 20 and at20["faithfulness"] >= 0.8
    assert curve["random_max"].max() < at20["lo"] and at20["random"] < 0.1
    assert at20["complement"] < 0.25  # what the circuit leaves out carries little
    assert 0 < curve.attrs["cmd"] < curve.attrs["cmd_random"] and curve.attrs["cpr"] > curve.attrs["cpr_random"]
    # what the refinement adds: the previous-token head's value edges into the induction heads, which score low
    # alone (the induction heads attend elsewhere at the corrupted run) and are needed with the key edges
    chosen = refine_circuit(model, clean, corrupted, metric, df, edges=20)
    ranks = df["abs_score"].rank(ascending=False)
    added = chosen[ranks.loc[chosen.index] > 20]
    assert {f"blocks.0.attn:{prev_head}"} <= set(added["upstream"]) and set(added["input"]) <= {"v", "k"}


def test_select_circuit_drops_edges_with_no_path_to_the_metric_and_areas_are_mibs():
    model = interp.load_model(tiny_model("llama"))
    frame = edge_attribution(model, *_pair(6), logit_difference(5, 7), method="eap")
    frame["score"] = 0.0
    frame.loc[(frame["upstream"] == "input") & (frame["downstream"] == "blocks.1.attn:0.q"), "score"] = 3.0
    frame.loc[(frame["upstream"] == "blocks.0.attn:2") & (frame["downstream"] == "blocks.1.attn:0.k"), "score"] = -2.0
    frame.loc[(frame["upstream"] == "blocks.0.attn:3") & (frame["downstream"] == "blocks.1.attn:1.k"), "score"] = -2.5
    frame.loc[(frame["upstream"] == "blocks.1.attn:0") & (frame["downstream"] == "logits"), "score"] = 1.0
    chosen = select_circuit(model, frame, edges=4)
    # head 1.0 reaches the logits, so the edges into its q and into its key/value head's k (kv head 0, shared with
    # head 1.1) stay; kv head 1 serves heads 1.2 and 1.3, which reach nothing: that edge goes
    assert set(zip(chosen["upstream"], chosen["downstream"])) == {
        ("input", "blocks.1.attn:0.q"), ("blocks.0.attn:2", "blocks.1.attn:0.k"), ("blocks.1.attn:0", "logits")}
    frame.loc[(frame["upstream"] == "blocks.1.attn:0") & (frame["downstream"] == "logits"), "score"] = 0.0
    assert len(select_circuit(model, frame, edges=4)) == 0  # nothing reaches the logits
    with pytest.raises(ValueError, match="one of edges"):
        select_circuit(model, frame)
    clean, corrupted = _pair(6)
    with pytest.raises(ValueError, match="candidates must be an integer at least edges"):
        refine_circuit(model, clean, corrupted, logit_difference(5, 7), frame, edges=4, candidates=2)
    with pytest.raises(ValueError, match="edges must be a positive integer"):
        refine_circuit(model, clean, corrupted, logit_difference(5, 7), frame, edges=0)
    cpr, cmd = circuit_areas([0.5], [0.5])
    assert cpr == pytest.approx(0.5) and cmd == pytest.approx(0.5)
    cpr, cmd = circuit_areas([0.1, 0.5], [1.0, 1.0])
    assert cpr == pytest.approx(0.95) and cmd == pytest.approx(0.05)


def _word_model(digits: str):
    """A tiny random Llama with a word-level tokenizer that splits numbers into ``digits`` ("\\d\\d": two-digit
    tokens, as GPT-2 writes years; "\\d": one digit each, as SmolLM2 does)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "The", "the", "lasted", "from", "year", "to", "war", "deal", "trip", "strike", "project",
             "famine", "drought", "dynasty", "siege", "voyage", *[f"{i:02d}" for i in range(100)],
             *[str(i) for i in range(10)]]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Split(Regex(digits), "isolated")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    return interp.load_model(LlamaForCausalLM(cfg).eval(), tokenizer=fast)


def test_greater_than_task_is_built_from_the_tokenizer_and_refused_where_it_splits_digits():
    model = _word_model(r"\d\d")
    clean, corrupted, metric = greater_than_task(model, n=6, seed=1)
    ids = clean["input_ids"]
    tok = model.tokenizer
    assert [tok.decode([i]) for i in ids[0, -6:-4]] == ["17", f"{int(metric.years[0]):02d}"]
    assert all(tok.decode([i]) == "01" for i in corrupted["input_ids"][:, -5])
    with torch.no_grad():
        probs = model(clean["input_ids"]).logits[:, -1].softmax(-1)[:, metric.year_ids]
    later = torch.arange(100)[None] > metric.years[:, None]
    want = (probs * later).sum(-1) - (probs * ~later).sum(-1)
    assert torch.allclose(metric.per_example(model(clean["input_ids"]), clean), want, atol=1e-6)
    df = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=2)
    assert df["score"].abs().max() > 0
    with pytest.raises(ValueError, match=r"one token .*writes 'the year 1700' as \['7', '0', '0'\]"):
        greater_than_task(_word_model(r"\d"))


@pytest.mark.parametrize("study", ["attribution", "patching", "faithfulness"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi", "olmo2"])  # pre-norm, sandwich, parallel, no in-norm
def test_the_model_is_left_as_it_was_also_when_the_metric_raises(study, family):
    model = interp.load_model(tiny_model(family))
    model.hf.train()
    model.hf.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)
    left_as_it_was(model, *_pair(7), study, ("input", "logits"))


def left_as_it_was(model, clean, corrupted, study: str, edge) -> None:
    """``study`` (attribution, patching of ``edge``, faithfulness) with a metric that raises on its third call leaves
    the model's weights, hooks, training mode, gradient flags and the RNG as they were."""
    from test_ablation import _weights, assert_clean

    weights, grads = _weights(model), {n: p.requires_grad for n, p in model.hf.named_parameters()}
    training = model.hf.training
    good = logit_difference(5, 7)
    scores = edge_attribution(model, clean, corrupted, good, method="eap")
    calls = {"n": 0}

    def broken(output, inputs):
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("the metric broke")
        return good(output, inputs)

    torch.manual_seed(11)
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="the metric broke"):
        if study == "attribution":  # the second call: in the first gradient step
            calls["n"] = 1
            edge_attribution(model, clean, corrupted, broken, method="eap-ig", steps=2)
        elif study == "patching":
            calls["n"] = 2
            edge_patching(model, clean, corrupted, [edge], broken)
        else:
            faithfulness(model, clean, corrupted, broken, scores, sizes=(3,), n_random=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert model.hf.training == training
    assert {n: p.requires_grad for n, p in model.hf.named_parameters()} == grads
    assert_clean(model, weights)


def test_the_circuit_command_refines_and_writes_a_line_per_stage_off_a_terminal(tmp_path, capsys, monkeypatch):
    """--refine prunes the top 2n edges by exact patching (the toy's 20-edge contract from the command line); with
    stderr a file, each stage and each loop of the command writes lines, as the other verbs do."""
    import pandas as pd

    from analyses.cli import main
    from interp.runtime import progress as progress_module

    monkeypatch.delenv("INTERP_PROGRESS", raising=False)
    out = tmp_path / "refined"
    assert main(["circuit", "--model", "toy-induction", "--task", "induction", "--edges", "20", "--refine",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "pruned to 20 by exact patching" in printed.out
    curve = pd.read_csv(out / "faithfulness.csv")
    last = curve.iloc[-1]
    assert last["edges"] <= 20 and last["faithfulness"] >= 0.8 and last["random_max"] < last["lo"]
    edges = pd.read_csv(out / "edges.csv")
    assert edges["in_circuit"].sum() == last["edges"]  # the curve's refined circuit, not another refinement's
    lines = printed.err.splitlines()
    assert any(line.startswith("circuit: eap-ig (stage 2 of 4") for line in lines), lines
    blocks = 2 * (1 + 2 * 5)  # toy-induction's 2 blocks: the clean run, then each step's run and backward
    assert any(line.startswith(f"eap-ig: blocks run, then differentiated: {blocks}/{blocks} block, done in")
               for line in lines), lines
    assert progress_module._state["on"] is None  # the command's choice does not outlive it


def test_the_circuit_command_writes_its_folder_and_refuses_mistakes_in_one_line(tmp_path, capsys):
    import pandas as pd

    from analyses.cli import main

    out = tmp_path / "circuit"
    assert main(["circuit", "--model", "toy-induction", "--task", "induction", "--edges", "40", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "faithfulness" in printed and "CPR" in printed and "CMD" in printed
    edges = pd.read_csv(out / "edges.csv")
    assert {"upstream", "downstream", "input", "score", "in_circuit"} <= set(edges.columns)
    assert 0 < edges["in_circuit"].sum() <= 40
    curve = pd.read_csv(out / "faithfulness.csv")
    assert curve["edges"].max() <= 40 and (out / "faithfulness.png").stat().st_size > 1000

    def one_line(argv, expected):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
        assert code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, err

    one_line(["circuit", "--model", "toy-induction", "--task", "induction", "--out", str(out)], "pass --force")
    one_line(["circuit", "--model", "toy-induction", "--task", "ioi", "--out", str(tmp_path / "a")], "no tokenizer")
    one_line(["circuit", "--model", "toy-induction", "--edges", "0", "--out", str(tmp_path / "b")], "at least 1")
    one_line(["circuit", "--model", "toy-induction", "--method", "acdc", "--out", str(tmp_path / "c")], "invalid choice")
    mla = tmp_path / "mla"  # multi-head latent attention: q, k, v cannot be read per head (post-norm BERT is covered)
    interp.load_model(tiny_model("deepseek_v3")).save_pretrained(mla)
    one_line(["circuit", "--model", str(mla), "--task", "induction", "--out", str(tmp_path / "d")], "q, k and v input")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_batched_edge_sets_and_single_edge_effects_equal_one_run_each(family):
    from analyses.circuits.patching import EdgeIndex, edge_effects, patched_runs, source_outputs

    model = interp.load_model(tiny_model(family, num_hidden_layers=3, n_layer=3))
    clean, corrupted = _pair(8)
    metric = logit_difference(5, 7)
    index = EdgeIndex(model)
    g = torch.Generator().manual_seed(0)
    chosen = torch.rand(4, len(index), generator=g) < torch.tensor([[0.0], [0.05], [0.5], [0.97]])
    with torch.no_grad():
        _, source = source_outputs(model, {"input_ids": corrupted, "attention_mask": None})
        together = patched_runs(model, {"input_ids": clean, "attention_mask": None}, source, chosen, index).logits
    for i in range(4):  # copy i of the batched forward = a run of its edge set alone
        edges = [(index.edges[e][0].name, index.edges[e][1].name) for e in chosen[i].nonzero()[:, 0].tolist()]
        alone = edge_patching(model, clean, corrupted, edges, run="clean").logits
        assert (together[i * 2:(i + 1) * 2] - alone).abs().max() <= TOL, i
    picks = [3, 40, 77, len(index) - 1, len(index) - 30]  # receivers in layers 0, 1, 2 and the logits
    edges = [(index.edges[e][0].name, index.edges[e][1].name) for e in picks]
    base = edge_patching(model, clean, corrupted, [], metric, run="corrupted")
    want = [edge_patching(model, clean, corrupted, [e], metric, run="corrupted") - base for e in edges]
    assert max(abs(w) for w in want) > 1e-3
    for budget, forwards in ((1, 5), (2**30, 1)):  # one edge per forward (blocks before it replayed), or all in one
        df = edge_effects(model, clean, corrupted, edges, metric, memory_budget=budget)
        assert list(zip(df["upstream"], df["downstream"])) == edges and df.attrs["forwards"] == forwards
        assert max(abs(a - b) for a, b in zip(df["effect"], want)) <= TOL
        assert (df.attrs["block_fraction"] < 1) == (forwards > 1)


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3_text", "phi", "bert"])  # phi: parallel blocks
def test_recomputing_each_block_in_the_backward_gives_the_same_scores_and_leaves_the_model_as_it_was(family, attn,
                                                                                                     monkeypatch):
    """Blocks recomputed in the backward (what long inputs switch on) run twice, give the scores of one run and
    leave no block changed."""
    from analyses.circuits import attribution

    model = interp.load_model(tiny_model(family), attn=attn)
    clean, corrupted = _pair(4, shape=(2, 9))
    metric = logit_difference(5, 7)
    calls = []
    handle = model._blocks[1].register_forward_pre_hook(lambda m, a: None)  # the user's hook, kept
    first = next(model._blocks[1].children())  # a recomputation may stop after the last tensor the backward needs
    counter = first.register_forward_pre_hook(lambda m, a: calls.append(1))
    runs = {}
    for recompute in (False, True):
        calls.clear()
        runs[recompute] = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=2,
                                           recompute=recompute)
        runs[recompute].attrs["calls"] = len(calls)
    assert runs[True].attrs["calls"] > runs[False].attrs["calls"]  # the block ran again in each backward
    assert runs[False]["score"].abs().max() > 0.1
    assert (runs[False]["score"] - runs[True]["score"]).abs().max() <= 1e-6 * runs[False]["score"].abs().max()
    assert all("forward" not in block.__dict__ for block in model._blocks)
    assert len(model._blocks[1]._forward_pre_hooks) == 1
    monkeypatch.setattr(attribution, "_RECOMPUTE_TOKENS", 18)  # 2 x 9 tokens: the default recomputes
    calls.clear()
    auto = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=2)
    assert len(calls) == runs[True].attrs["calls"]
    assert (auto["score"] - runs[True]["score"]).abs().max() == 0
    counter.remove(), handle.remove()
    with pytest.raises(ValueError, match="recompute must be True, False or None"):
        edge_attribution(model, clean, corrupted, metric, method="eap", recompute="yes")
