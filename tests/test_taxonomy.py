"""Head taxonomy (issue 24): weight-based successor and copy-suppression scores find heads planted in a tiny
Llama and equal the same scores recomputed from the HF weights with plain torch; the task-based scores and
detect_heads(scores=...) dispatch; the validation script's quick mode runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import interp
from analyses.taxonomy.weights import copy_suppression_scores, successor_scores

ITEMS = list(range(10, 18))  # an ordinal list of 8 token ids: succ(10) = 11, ...
OTHER = list(range(20, 28))  # a second list, for the hand-made case where the argmax's candidates matter
D = 32


def _planted():
    """Layer 1's heads, each reading through a random input-norm weight and writing through a random final-norm
    weight: head 0 maps each item's block-0 embedding to its successor, head 1 maps every token to minus itself,
    head 2 maps each item's MLP0 output (Gould et al.'s embedding) to its successor, head 3 does the same plus a
    pull towards OTHER[0] (the successor still wins among ITEMS, OTHER[0] wins among every ordinal token)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=99, hidden_size=D, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=D, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0, tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        layers = hf.model.layers
        layers[0].mlp.down_proj.weight.mul_(5.0)  # MLP0 matters
        layers[1].input_layernorm.weight.copy_(torch.rand(D) + 0.5)
        hf.model.norm.weight.copy_(torch.rand(D) + 0.5)
        inputs = _plain_head_inputs(hf, 1)  # (vocab, D): what layer 1's heads read for each token
        mlp0 = _plain_head_inputs(hf, 1, kind="mlp0")
        hf.lm_head.weight.copy_(inputs)  # W_U rows = those inputs: a head's own-token logit is easy to reason about
        gain = 1.0 / hf.model.norm.weight
        v, o = layers[1].self_attn.v_proj.weight, layers[1].self_attn.o_proj.weight
        for head in range(4):
            v[head * D:(head + 1) * D] = torch.eye(D)
        o[:, 0:D] = (torch.linalg.lstsq(inputs[ITEMS[:-1]], inputs[ITEMS[1:]]).solution * gain).T  # x @ W
        o[:, D:2 * D] = -torch.diag(gain)
        o[:, 2 * D:3 * D] = (torch.linalg.lstsq(mlp0[ITEMS[:-1]], inputs[ITEMS[1:]]).solution * gain).T
        pulled = inputs[ITEMS[1:]] + 1.5 * inputs[OTHER[0]]
        o[:, 3 * D:4 * D] = (torch.linalg.lstsq(mlp0[ITEMS[:-1]], pulled).solution * gain).T
    return hf


def _plain_eff(hf, ids, kind="block0"):
    """block0: W_E t + MLP0(norm(W_E t)), block 0 with its attention removed (Llama: no o_proj bias); mlp0: the
    MLP0 term alone. Plain torch."""
    x = hf.model.embed_tokens.weight[ids]
    block = hf.model.layers[0]
    mlp = block.mlp(block.post_attention_layernorm(x))
    return x + mlp if kind == "block0" else mlp


def _plain_head_inputs(hf, layer, ids=None, kind="block0"):
    ids = torch.arange(hf.config.vocab_size) if ids is None else torch.as_tensor(ids)
    return hf.model.layers[layer].input_layernorm(_plain_eff(hf, ids, kind))


def _plain_logits(hf, layer, head, ids, kind="block0"):
    """(n, vocab) logits of one head on an effective embedding, from HF weights: frozen final-norm scale dropped
    (it is one positive number per row)."""
    attn = hf.model.layers[layer].self_attn
    w_v = attn.v_proj.weight[head * D:(head + 1) * D]  # (d, m)
    w_o = attn.o_proj.weight[:, head * D:(head + 1) * D]  # (m, d)
    out = _plain_head_inputs(hf, layer, ids, kind) @ w_v.T @ w_o.T
    return (out * hf.model.norm.weight) @ hf.lm_head.weight.T


def _plain_successor(hf, layer, head, kind, pairs, candidates):
    """The share of (token, successor) pairs whose successor has the largest logit among ``candidates``."""
    sources, succ = torch.tensor([a for a, _ in pairs]), [b for _, b in pairs]
    logits = _plain_logits(hf, layer, head, sources, kind)[:, candidates]
    best = logits.max(-1).values
    return float((logits[torch.arange(len(pairs)), [candidates.index(b) for b in succ]] >= best).double().mean())


@torch.no_grad()
def test_planted_successor_and_copy_suppression_heads_match_plain_torch():
    hf = _planted()
    model = interp.load_model(hf)
    succ = successor_scores(model, lists={"planted": ITEMS}, embedding="block0", candidates="list", n_bootstrap=50)
    tokens = list(range(1, 99))
    copy = copy_suppression_scores(model, tokens=tokens, k=3, n_bootstrap=50)
    for df, column in ((succ, "successor"), (copy, "copy_suppression")):
        assert len(df) == 8 and df[column].between(0, 1).all()
        assert (df[f"{column}_lo"] <= df[column] + 1e-12).all() and (df[column] <= df[f"{column}_hi"] + 1e-12).all()
    top_succ = succ.sort_values("successor", ascending=False).iloc[0]
    top_copy = copy.sort_values("copy_suppression", ascending=False).iloc[0]
    assert (top_succ["layer"], top_succ["head"], top_succ["successor"]) == (1, 0, 1.0)
    assert (top_copy["layer"], top_copy["head"], top_copy["copy_suppression"]) == (1, 1, 1.0)
    # every head's score, recomputed from the HF weights with plain torch
    pairs = list(zip(ITEMS, ITEMS[1:]))
    for row in succ.itertuples():
        expected = _plain_successor(hf, row.layer, row.head, "block0", pairs, ITEMS)
        assert abs(row.successor - expected) < 1e-12, (row.layer, row.head)
    ids = torch.tensor(tokens)
    for row in copy.itertuples():
        logits = _plain_logits(hf, row.layer, row.head, ids)
        own = logits[torch.arange(len(ids)), ids]
        expected = float(((logits < own[:, None]).sum(-1) < 3).double().mean())
        assert abs(row.copy_suppression - expected) < 1e-12, (row.layer, row.head)
    assert succ.successor.drop(index=top_succ.name).max() < 1.0
    few = torch.arange(1, 11)  # fewer tokens than d_head: the other multiplication order
    small = copy_suppression_scores(model, tokens=few, k=3, n_bootstrap=20)
    for row in small.itertuples():
        logits = _plain_logits(hf, row.layer, row.head, few)
        own = logits[torch.arange(len(few)), few]
        assert abs(row.copy_suppression - float(((logits < own[:, None]).sum(-1) < 3).double().mean())) < 1e-12


@torch.no_grad()
def test_published_successor_finds_the_head_planted_on_mlp0_and_matches_plain_torch():
    """Gould et al.'s score (MLP0's output alone; argmax among the list's successor tokens) finds head (1, 2), planted
    on that embedding; every head equals the plain-torch recomputation; today's variant (block 0 with its residual)
    finds head (1, 0) instead."""
    hf = _planted()
    model = interp.load_model(hf)
    published = successor_scores(model, lists={"planted": ITEMS}, n_bootstrap=50)
    assert published.attrs["embedding"] == "mlp0" and published.attrs["candidates"] == "targets"
    top = published.sort_values("successor", ascending=False).iloc[0]
    assert (top["layer"], top["head"], top["successor"]) == (1, 2, 1.0)
    pairs = list(zip(ITEMS, ITEMS[1:]))
    for row in published.itertuples():
        expected = _plain_successor(hf, row.layer, row.head, "mlp0", pairs, ITEMS[1:])
        assert abs(row.successor - expected) < 1e-12, (row.layer, row.head)
    old = successor_scores(model, lists={"planted": ITEMS}, embedding="block0", candidates="list", n_bootstrap=50)
    assert old.set_index(["layer", "head"]).loc[(1, 0), "successor"] == 1.0
    assert old.set_index(["layer", "head"]).loc[(1, 2), "successor"] < 1.0


@torch.no_grad()
def test_where_the_argmax_is_taken_decides_a_hand_made_head():
    """Head (1, 3) maps each item to its successor plus a pull towards OTHER[0]: among its own list's tokens the
    successor wins every time, among every ordinal token (and the whole vocabulary) OTHER[0] wins instead."""
    hf = _planted()
    model = interp.load_model(hf)
    lists = {"items": ITEMS, "other": OTHER}
    got = {c: successor_scores(model, lists=lists, candidates=c, n_bootstrap=20).set_index(["layer", "head"])
           for c in ("targets", "list", "ordinal", "vocab")}
    pairs = list(zip(ITEMS, ITEMS[1:]))
    every = sorted(ITEMS + OTHER)
    per_item = {"targets": ITEMS[1:], "list": ITEMS, "ordinal": every, "vocab": list(range(99))}
    for c, candidates in per_item.items():
        # head (1, 3) on the ITEMS half of the items; OTHER's items are scored too (7 of the 14)
        mine = _plain_successor(hf, 1, 3, "mlp0", pairs, candidates)
        assert abs(got[c].loc[(1, 3), "successor"] - (mine * 7 + _other_share(hf, c)) / 14) < 1e-12, c
    assert _plain_successor(hf, 1, 3, "mlp0", pairs, ITEMS[1:]) == 1.0
    assert _plain_successor(hf, 1, 3, "mlp0", pairs, every) == 0.0
    assert got["targets"].loc[(1, 3), "successor"] - got["ordinal"].loc[(1, 3), "successor"] >= 0.5
    assert got["ordinal"]["successor"].tolist() != got["targets"]["successor"].tolist()


def _other_share(hf, candidates):
    """Head (1, 3)'s hits on OTHER's 7 items, by plain torch (the count, not the share)."""
    pairs = list(zip(OTHER, OTHER[1:]))
    own = {"targets": OTHER[1:], "list": OTHER, "ordinal": sorted(ITEMS + OTHER), "vocab": list(range(99))}
    return 7 * _plain_successor(hf, 1, 3, "mlp0", pairs, own[candidates])


@torch.no_grad()
def test_copy_suppression_whole_vocabulary_and_stability_attrs():
    """tokens="all" scores every non-special token against the whole vocabulary and finds the planted suppressor
    (1, 1) at 1.0; a column block narrower than the vocabulary gives the same counts; both scores report the
    stability of their ranking from two disjoint halves of their items."""
    import analyses.taxonomy.weights as taxonomy
    from analyses.data.stability import halves, stability

    model = interp.load_model(_planted())
    every = copy_suppression_scores(model, tokens="all", n_bootstrap=20)
    assert every.attrs["tokens"] == 98  # 99 ids less the one special id (0: BOS = EOS = PAD)
    top = every.sort_values("copy_suppression", ascending=False).iloc[0]
    assert (top["layer"], top["head"], top["copy_suppression"]) == (1, 1, 1.0)
    cells = taxonomy._CELLS
    try:
        taxonomy._CELLS = 7 * 32  # columns in blocks of 7: the counts add up across blocks
        blocked = copy_suppression_scores(model, tokens="all", n_bootstrap=20)
    finally:
        taxonomy._CELLS = cells
    assert blocked["copy_suppression"].tolist() == every["copy_suppression"].tolist()
    # the default sample: as many tokens as the budget of multiply-adds allows, from 100 to 1000
    assert taxonomy._auto_tokens(model) == 1000
    budget = taxonomy._BUDGET
    try:
        taxonomy._BUDGET = 8 * taxonomy._cost(300, 32, 32, 99)  # 8 heads: exactly 300 tokens fit
        assert taxonomy._auto_tokens(model) == 300
        taxonomy._BUDGET = 1.0
        assert taxonomy._auto_tokens(model) == 100
    finally:
        taxonomy._BUDGET = budget
    s = every.attrs["stability"]["copy_suppression"]
    assert set(s) == {"spearman", "top_k_overlap", "k", "unstable", "halves"} and s["k"] == 8 and s["halves"] == "items"
    # the same numbers as analyses.data.stability on the halves of the per-token hits, recomputed here
    hf = model.hf
    ids = torch.arange(1, 99)
    hits = []
    for layer in (0, 1):
        for head in range(4):
            logits = _plain_logits(hf, layer, head, ids)
            own = logits[torch.arange(98), ids]
            hits.append(((logits < own[:, None]).sum(-1) < 10).double())
    hits = torch.stack(hits, 1)  # (tokens, heads)
    first, second = halves(98)
    expected = stability(hits[first].mean(0), hits[second].mean(0))
    assert s["top_k_overlap"] == expected["top_k_overlap"] and s["unstable"] == expected["unstable"]
    assert s["spearman"] == pytest.approx(expected["spearman"], nan_ok=True)
    succ = successor_scores(model, lists={"planted": ITEMS}, n_bootstrap=20)
    assert set(succ.attrs["stability"]) == {"successor"}


def test_weight_scores_check_their_input():
    model = interp.load_model(_planted())

    with pytest.raises(ValueError, match="at least 2 distinct"):
        successor_scores(model, lists={"bad": [5, 5]})
    with pytest.raises(ValueError, match="tokenizer"):
        successor_scores(model)  # no tokenizer: Gould et al.'s dataset cannot be tokenized
    with pytest.raises(ValueError, match="ordinal_lists needs the model's tokenizer; give lists="):
        successor_scores(model, lists="bundled")
    with pytest.raises(ValueError, match="k must be"):
        copy_suppression_scores(model, tokens=[1, 2], k=0)
    with pytest.raises(ValueError, match="embedding must be one of"):
        successor_scores(model, lists={"a": [5, 6, 7]}, embedding="resid")
    with pytest.raises(ValueError, match="candidates must be one of"):
        successor_scores(model, lists={"a": [5, 6, 7]}, candidates="everything")
    with pytest.raises(ValueError, match="dataset must be one of"):
        successor_scores(model, lists="gould")
    with pytest.raises(ValueError, match="tokens must be token ids, 'all'"):
        copy_suppression_scores(model, tokens="every")
    with pytest.raises(ValueError, match="n_tokens must be an integer of at least 2"):
        copy_suppression_scores(model, n_tokens=1)


def test_detect_heads_scores_dispatch_and_kinds_alias():

    from analyses import detect_heads

    model = interp.load_model(_planted())
    both = detect_heads(model, scores=["induction", "copy_suppression"], n_prompts=4, n_bootstrap=20)
    assert {"induction", "induction_lo", "copy_suppression", "copy_suppression_lo", "copy_suppression_hi"} <= set(both)
    assert len(both) == 8
    planted = both[(both.layer == 1) & (both["head"] == 1)].iloc[0]
    assert "copy_suppression" in planted["labels"].split("+")  # token sample: 1000 ordinary ids of 99 -> all of them
    assert both.attrs["stability"]["copy_suppression"]["k"] == 8  # the runner's stability survives the merge
    new = detect_heads(model, scores=["induction"], n_prompts=4, n_bootstrap=20)
    assert "copy_suppression" not in new
    only = detect_heads(model, scores="copy_suppression", n_bootstrap=20)
    assert list(only.columns[:6]) == ["stack", "kind", "site", "layer", "head", "copy_suppression"] and "induction" not in only
    assert only["copy_suppression"].tolist() == both["copy_suppression"].tolist()
    with pytest.raises(ValueError, match="successor"):
        detect_heads(model, scores=["sucessor"])


def test_encoder_decoder_is_refused_for_residual_stream_scores():
    from test_seq2seq import _tiny

    from analyses import detect_heads

    model = interp.load_model(_tiny("t5"))
    for score in ("successor", "name_mover", "function_vector"):
        with pytest.raises(TypeError, match="encoder-decoder"):
            detect_heads(model, scores=[score])


def _tiny_with_tokenizer():
    """A tiny random Llama with SmolLM2's tokenizer (49,152 tokens), so the text tasks run in a second."""
    from transformers import AutoTokenizer

    from interp.model.bundled import bundled_folder  # found (and converted) as a user's load_model finds it

    folder = bundled_folder("smollm2")
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
    return interp.load_model(LlamaForCausalLM(cfg).eval(), tokenizer=tok)


@torch.no_grad()
def test_task_scores_agree_with_the_project_studies_and_a_hand_patch():
    from analyses import direct_logit_attribution, path_patching
    from analyses.taxonomy.function_vectors import _mean_z, function_vector_scores, icl_prompts, icl_tasks
    from analyses.taxonomy.ioi import _ioi, name_mover_scores, s_inhibition_scores

    model = _tiny_with_tokenizer()
    clean, corrupted, metric, io, s = _ioi(model, 8, 0)
    nm = name_mover_scores(model, task=(clean, corrupted, metric), n_bootstrap=50)
    dla = direct_logit_attribution(model, clean, io, s)
    heads = dla[dla.component == "head"]
    assert np.allclose(nm["name_mover"] * nm.attrs["logit_difference"], heads["attribution"].to_numpy(), atol=1e-5)
    assert nm["io_attention"].abs().le(1).all()
    si = s_inhibition_scores(model, receivers=[(1, 0)], task=(clean, corrupted, metric), n_bootstrap=50)
    pp = path_patching(model, clean, corrupted, [(1, 0)], metric, via="q")
    assert np.allclose(si[si.layer == 0]["s_inhibition"].to_numpy(), pp["effect"].to_numpy(), atol=1e-6)
    assert (si[si.layer == 1]["s_inhibition"] == 0).all()
    pairs = icl_tasks()["antonyms"]
    fv = function_vector_scores(model, tasks=["antonyms"], n_prompts=4, n_shots=2, n_bootstrap=50)
    # head (1, 2) by hand: its z at the final token set to its few-shot mean on the shuffled prompts
    clean_b, answers = icl_prompts(model, pairs, 4, 2, 0)
    shuffled, _ = icl_prompts(model, pairs, 4, 2, 0, shuffled=True)
    mean = _mean_z(model, clean_b)[1][2]

    def patch(z, hook):
        z = z.clone()
        z[:, -1, 2] = mean
        return z

    def p_answer(hooks=()):
        with model.hooks(hooks):
            logits = model(shuffled["input_ids"], shuffled["attention_mask"]).logits[:, -1].float()
        return logits.softmax(-1)[torch.arange(4), answers]

    expected = float((p_answer([("blocks.1.attn.hook_z", patch)]) - p_answer()).mean())
    got = float(fv[(fv.layer == 1) & (fv["head"] == 2)]["function_vector"].iloc[0])
    assert abs(got - expected) < 1e-7 and abs(expected) > 0



@torch.no_grad()
def test_cached_cie_equals_the_full_forward_per_head():
    """method="cached" (keys and values of the prompts kept, a layer's heads per forward of the final token) gives
    the whole-prompt-per-head numbers: probabilities equal to float rounding, every head, left padding included."""
    from analyses.taxonomy.function_vectors import function_vector_scores

    model = _tiny_with_tokenizer()
    kw = dict(tasks=["antonyms", "country_capital"], n_prompts=5, n_shots=3, n_bootstrap=50)
    full = function_vector_scores(model, method="full", **kw)
    cached = function_vector_scores(model, **kw)
    assert cached.attrs["method"] == "cached" and full.attrs["method"] == "full"
    scale = full["function_vector"].abs().max()
    assert scale > 0  # a random model: P(answer) about 2e-5, effects about 1e-8; agreement is relative
    assert (full["function_vector"] - cached["function_vector"]).abs().max() <= 1e-4 * scale
    for task, p in full.attrs["shuffled_probability"].items():
        assert abs(p - cached.attrs["shuffled_probability"][task]) <= 1e-5 * p
    assert full["function_vector"].corr(cached["function_vector"], method="spearman") > 0.999
    with pytest.raises(ValueError, match="method must be"):
        function_vector_scores(model, method="fast", **kw)

def test_validation_script_quick_mode_runs(tmp_path, capsys):
    """benchmarks/validate_taxonomy.py --quick on a tiny random model (about 6 s): every class gets its row."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "validate_taxonomy.py"
    spec = importlib.util.spec_from_file_location("validate_taxonomy", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "results.json"
    threads = torch.get_num_threads()
    try:
        script.main(["--quick", "--draws", "2", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)  # the script pins one thread
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    classes = ["successor", "copy_suppression", "name_mover", "s_inhibition", "function_vector"]
    assert list(results) == classes
    for name in classes:
        assert any(line.startswith(name) for line in printed.splitlines())
        r = results[name]
        assert len(r["top"]) == 4 and 0 <= r["stability"] <= 1
        assert r["class_lo"] <= r["class_delta"] <= r["class_hi"]
        assert r["random_delta_min"] <= r["random_delta_mean"] <= r["random_delta_max"]
    assert set(results["function_vector"]["steering"]) == {"antonyms"}


@pytest.mark.slow  # a CLI subprocess: about 11 s on the loaded 2-core machine
def test_cli_heads_takes_scores(tmp_path):
    import io
    import os
    import subprocess
    import sys

    import pandas as pd

    folder = tmp_path / "planted"
    _planted().save_pretrained(folder)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "analyses.cli", "heads", "--model", str(folder), "--scores", "copy_suppression",
                          "--format", "csv"], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    df = pd.read_csv(io.StringIO(run.stdout))
    row = df[(df.layer == 1) & (df["head"] == 1)].iloc[0]
    assert row["copy_suppression"] == 1.0 and row["label"] == "copy_suppression"


@torch.no_grad()
def test_path_patching_with_a_receiver_before_every_sender_of_a_group():
    """Receivers in layers 0 and 2, one sender per forward: a layer-1 sender's forward starts after the layer-0
    receiver (Gemma 3's S-inhibition run hit this as a KeyError); its effect is the one through layer 2 alone."""
    from analyses import logit_difference, path_patching

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = interp.load_model(LlamaForCausalLM(cfg).eval())
    g = torch.Generator().manual_seed(1)
    clean, corrupted = torch.randint(1, 99, (4, 10), generator=g), torch.randint(1, 99, (4, 10), generator=g)
    metric = logit_difference(5, 7)
    senders = [(1, h) for h in range(4)]
    both = path_patching(model, clean, corrupted, [(0, 1), (2, 0)], metric, senders=senders, heads_per_forward=1)
    late = path_patching(model, clean, corrupted, [(2, 0)], metric, senders=senders, heads_per_forward=1)
    assert np.allclose(both["metric"].to_numpy(), late["metric"].to_numpy(), rtol=0, atol=1e-6)
    assert late["effect"].abs().max() > 0  # the senders do act through layer 2
