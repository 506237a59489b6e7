"""Sinks and dormant heads on a planted model (weights set by hand), massive activations and the causal checks.

The planted model is a one-layer Llama whose first token (id 1) lives alone in residual dimension 0. Both heads
put most of their weight on it (a query direction that only the first token's key answers, in the one RoPE pair that
hardly rotates); head 0 reads no value from dimension 0, so the first token's value there is exactly zero (a
dormant head), head 1 reads it (a sink that moves something)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import interp
from analyses import detect_heads, sink_heads, sink_value_ablation

FIRST = 1  # the planted first token


def planted(sink_query: float = 3.0, seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rope_theta=1e12,
                      rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=FIRST, eos_token_id=0)
    hf = LlamaForCausalLM(cfg).eval()
    attn, g = hf.model.layers[0].self_attn, torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    with torch.no_grad():
        emb = torch.zeros(20, 16)
        emb[2:, 1:15] = rand(18, 14)
        emb[2:, 15] = 1.0  # every ordinary token carries a constant direction: the sink query reads it
        emb[FIRST, 0] = 4.0  # the first token: dimension 0 alone
        hf.model.embed_tokens.weight.copy_(emb)
        hf.lm_head.weight.copy_(rand(20, 16))
        for w in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight):
            w.zero_()
            w[:, 1:15] = 0.5 * rand(w.shape[0], 14)
        for head in (0, 1):
            d = head * 8 + 3  # RoPE pair (3, 7): inverse frequency 1e12^-0.75, no rotation to speak of
            for w in (attn.q_proj.weight, attn.k_proj.weight):
                w[[d, d + 4]] = 0.0
            attn.q_proj.weight[d, 15] = sink_query
            attn.k_proj.weight[d, 0] = 3.0
        attn.v_proj.weight[8:16, 0] = rand(8)  # head 1 reads the first token's value; head 0 does not
        attn.o_proj.weight.copy_(rand(16, 16))
        for w in (hf.model.layers[0].mlp.down_proj.weight,):
            w.zero_()
    return hf


def prompts(n: int = 6, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randint(2, 20, (6 + 3 * i,), generator=g)
        out.append([FIRST, *x.tolist(), *x.tolist()])  # repeats: duplicate-token and induction rows exist
    return out


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_a_head_whose_sink_value_is_zero_is_dormant(attn):
    model = interp.load_model(planted(), attn=attn)
    df = sink_heads(model, prompts=prompts(), batch_size=4, n_bootstrap=50).set_index("head")
    assert df.loc[0, "sink_weight"] > 0.5 and df.loc[1, "sink_weight"] > 0.5  # both are sinks
    assert df.loc[0, "sink_output"] == 0.0 and df.loc[0, "sink_value_ratio"] == 0.0  # the sink moves nothing
    assert df.loc[1, "sink_output"] > 0.3 and df.loc[1, "sink_value_ratio"] > 0.5
    assert df.loc[0, "dormant"] == pytest.approx(df.loc[0, "sink_weight"], abs=1e-6)
    assert bool(df.loc[0, "is_dormant"]) and not bool(df.loc[1, "is_dormant"])
    assert df.loc[0, "dormant_lo"] <= df.loc[0, "dormant"] <= df.loc[0, "dormant_hi"]
    heads = detect_heads(model, scores=["dormant", "sink"], n_bootstrap=50).set_index("head")
    assert "dormant" in heads.loc[0, "labels"] and "dormant" not in heads.loc[1, "labels"]


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_a_dormant_heads_norm_weighted_scores_come_from_its_other_keys_only(attn):
    """A weaker sink query changes only the sink's logit: the raw scores of head 0 move, its norm-weighted scores
    (the sink moves nothing, so it takes no share) stay."""
    kwargs = dict(prompts=prompts(), batch_size=4, n_bootstrap=20,
                  scores=["previous_token", "self", "duplicate_token", "induction", "sink"])
    strong, weak = (interp.load_model(planted(sink_query=q), attn=attn) for q in (3.0, 1.5))
    columns = ["previous_token", "self", "duplicate_token", "induction"]
    norm = [detect_heads(m, weighting="norm", **kwargs).set_index("head") for m in (strong, weak)]
    raw = [detect_heads(m, **kwargs).set_index("head") for m in (strong, weak)]
    assert norm[0].loc[0, "sink"] == 0.0 and norm[1].loc[0, "sink"] == 0.0
    moved = torch.tensor((raw[0].loc[0, columns] - raw[1].loc[0, columns]).abs().to_numpy(dtype=float))
    kept = torch.tensor((norm[0].loc[0, columns] - norm[1].loc[0, columns]).abs().to_numpy(dtype=float))
    assert moved.max() > 1e-2 and kept.max() < 1e-5
    # head 1's sink moves something: its norm-weighted scores change with the sink's logit
    live = (norm[0].loc[1, columns] - norm[1].loc[1, columns]).abs().max()
    assert live > 1e-2


def test_zeroing_a_dormant_heads_sink_value_changes_nothing_and_a_live_sinks_does():
    model = interp.load_model(planted(), attn="flash")
    df = sink_value_ablation(model, prompts=prompts(), n_random=2, batch_size=4, n_bootstrap=50).set_index("condition")
    assert abs(df.loc["dormant", "delta_loss"]) < 1e-6  # its sink's value is zero: removing it removes nothing
    assert abs(df.loc["random", "delta_loss"]) > 1e-3 and df.loc["random", "what"] == "2 draws"
    assert model.attn == "flash"  # the path is restored



# -- massive activations, planted ------------------------------------------------------------------------------------
MASSIVE_DIM, WRITER_BLOCK = 7, 1  # block 1's MLP writes 5,000 into residual dim 7 at the first token, nowhere else


def planted_massive(seed: int = 0):
    """A three-block Llama whose first token (id 1) lives alone in residual dim 0, every other token in dims 1-6 and
    8-14 (random) and 15 (a constant). Attention writes nothing before block 2 (o_proj zero). Block 1's MLP reads dim
    0 and writes 5,000 into dim 7: a massive activation at position 0 only. Both heads of block 2 key on dim 7 (a
    query on the constant dim 15, in the RoPE pair that hardly rotates), so their sink exists only through it."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=20, hidden_size=16, intermediate_size=8, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, rope_theta=1e12,
                      rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=FIRST, eos_token_id=0)
    hf = LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb = torch.zeros(20, 16)
        emb[2:, 1:15] = torch.randn(18, 14, generator=g)
        emb[:, MASSIVE_DIM] = 0.0
        emb[2:, 15] = 1.0
        emb[FIRST, 0] = 4.0
        hf.model.embed_tokens.weight.copy_(emb)
        hf.lm_head.weight.copy_(torch.randn(20, 16, generator=g))
        for block in hf.model.layers:
            block.self_attn.o_proj.weight.zero_()
            for w in (block.mlp.gate_proj.weight, block.mlp.up_proj.weight, block.mlp.down_proj.weight):
                w.zero_()
        mlp = hf.model.layers[WRITER_BLOCK].mlp
        mlp.gate_proj.weight[0, 0] = mlp.up_proj.weight[0, 0] = 2.0  # the first token's normed dim 0 is 4: 8 each
        mlp.down_proj.weight[MASSIVE_DIM, 0] = 5000.0 / (8.0 * torch.sigmoid(torch.tensor(8.0)) * 8.0)
        attn = hf.model.layers[2].self_attn
        attn.q_proj.weight.zero_()
        attn.k_proj.weight.zero_()
        for head in (0, 1):
            attn.q_proj.weight[head * 8 + 3, 15] = 3.0
            attn.k_proj.weight[head * 8 + 3, MASSIVE_DIM] = 3.0
    return hf


def massive_prompts(n: int = 6, seed: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[FIRST, *torch.randint(2, 20, (8 + 2 * i,), generator=g).tolist()] for i in range(n)]


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_massive_activations_finds_the_planted_dim_its_position_block_and_writer(attn):
    from analyses import massive_activations

    model = interp.load_model(planted_massive(), attn=attn)
    df = massive_activations(model, prompts=massive_prompts(), batch_size=4)
    assert set(df.dim) == {MASSIVE_DIM}  # dim 0 (the first token's 4.0) is large but not massive
    assert df.layer.tolist() == [1, 2]  # after the writing block and every block after it
    assert (df.first_layer == WRITER_BLOCK).all() and (df.writer == "mlp").all()
    assert (df.positions == "0").all() and (df.first_token_share == 1.0).all()
    assert (df.n_tokens == len(massive_prompts())).all()  # once per prompt, at its first token
    assert df.value.tolist() == pytest.approx([5000.0, 5000.0], rel=1e-3)
    assert df.attrs["dim_median"][1, MASSIVE_DIM] == 0.0  # every other token holds 0 there


def test_massive_activations_names_an_attention_writer_and_the_embedding():
    """The same dim written by block 1's attention instead (head 0's value reads dim 0, which only the first token
    has, and every other row keeps away from the first token: its key there is strongly negative), and a massive
    embedding entry: the writer follows."""
    from analyses import massive_activations

    hf = planted_massive()
    with torch.no_grad():
        hf.model.layers[WRITER_BLOCK].mlp.down_proj.weight.zero_()
        attn = hf.model.layers[WRITER_BLOCK].self_attn
        for w in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight):
            w.zero_()
        attn.q_proj.weight[3, 15], attn.k_proj.weight[3, 0] = 3.0, -3.0
        attn.v_proj.weight[0, 0] = 1.0
        attn.o_proj.weight[MASSIVE_DIM, 0] = 5000.0 / 4.0  # the first token's own row: all its weight on itself
    df = massive_activations(interp.load_model(hf), prompts=massive_prompts(), batch_size=4)
    first = df[df.layer == WRITER_BLOCK]
    assert first.dim.tolist() == [MASSIVE_DIM] and first.writer.tolist() == ["attn"]
    assert first.positions.tolist() == ["0"]
    with torch.no_grad():
        hf.model.embed_tokens.weight[FIRST, 0] = 4000.0
    df = massive_activations(interp.load_model(hf), prompts=massive_prompts(), batch_size=4)
    assert df.loc[df.dim == 0, "writer"].unique().tolist() == ["embedding"]
    assert (df.loc[df.dim == 0, "first_layer"] == 0).all()


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_removing_the_massive_dim_moves_the_sink_heads_weight_off_the_sink_and_random_dims_do_not(attn):
    from analyses import massive_dims_ablation

    model = interp.load_model(planted_massive(), attn=attn)
    df = massive_dims_ablation(model, prompts=massive_prompts(), n_random=4, batch_size=4,
                               n_bootstrap=50).set_index("condition")
    assert df.attrs["heads"] == ["2.0", "2.1"] and df.attrs["edited_from"] == WRITER_BLOCK
    assert df.attrs["sink_weight"] > 0.9  # the planted sink
    assert df.loc["massive", "what"] == str(MASSIVE_DIM)
    # without the massive dim the first token's key is 0: uniform rows, weight 1 / (row + 1) on it
    assert df.loc["massive", "sink_drop"] > 0.6 and df.loc["massive", "sink_drop_lo"] > 0.5
    assert abs(df.loc["random", "sink_drop"]) < 0.01 and df.loc["random", "what"] == "4 draws"
    assert all(MASSIVE_DIM not in map(int, df.loc[f"random {i}", "what"].split()) for i in range(4))
    assert model.attn == attn


# -- the report's sink finding ---------------------------------------------------------------------------------------
def test_the_reports_sink_finding_counts_the_dormant_head_checks_it_and_names_the_massive_writer():
    from analyses.views.report_sinks import sinks_apply, sinks_finding, sinks_section

    model = interp.load_model(planted())
    assert sinks_apply(model)
    entry = sinks_section(model)
    assert (entry["n_sink"], entry["n_dormant"]) == (2, 1) and entry["dormant"][0]["head"] == "0.0"
    mean, lo, hi = entry["value_check"]["dormant"]
    assert abs(mean) < 1e-6 and lo <= mean <= hi  # head 0's sink moves nothing
    assert all(abs(d) > 1e-3 for d in entry["value_check"]["draws"])  # head 1's does
    assert entry["massive"] == []
    line = sinks_finding(entry)
    # the report's own prompts: random tokens on a model without a tokenizer
    assert "<b>1 of 2</b> sink heads on 8 repeated random token sequences of 64 tokens are dormant" in line
    assert "0.0 (weight" in line and "zeroing the first token's value in them changes the loss by +0.000" in line
    assert "on 4 repeated random token sequences of 64 tokens, in as many other sink heads by" in line
    assert "No massive activation" in line
    entry = sinks_section(interp.load_model(planted_massive()))
    assert entry["massive"] == [{"dim": MASSIVE_DIM, "block": WRITER_BLOCK, "writer": "mlp", "max_abs": 5000.0,
                                 "first_token": True}]
    assert "dim 7 (up to 5,000, from block 1's MLP, at the first token only)" in sinks_finding(entry)
    evil = {**entry, "prompts": "<script>x</script>"}
    assert "<script>" not in sinks_finding(evil) and "&lt;script&gt;" in sinks_finding(evil)
    assert sinks_finding(None) == "" and sinks_finding({**entry, "n_sink": 0}) == ""
