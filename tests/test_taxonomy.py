"""Head taxonomy (issue 24): weight-based successor and copy-suppression scores find heads planted in a tiny
Llama and equal the same scores recomputed from the HF weights with plain torch; the task-based scores and
detect_heads(scores=...) dispatch; the validation script's quick mode runs."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import interp
from analyses.taxonomy import copy_suppression_scores, successor_scores

ITEMS = list(range(10, 18))  # an ordinal list of 8 token ids: succ(10) = 11, ...
D = 32


def _planted():
    """Layer 1 head 0 maps each item to its successor, head 1 maps every token to minus itself (both read
    through a random input-norm weight and write through a random final-norm weight)."""
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
        hf.lm_head.weight.copy_(inputs)  # W_U rows = those inputs: a head's own-token logit is easy to reason about
        gain = 1.0 / hf.model.norm.weight
        v, o = layers[1].self_attn.v_proj.weight, layers[1].self_attn.o_proj.weight
        for head in (0, 1):
            v[head * D:(head + 1) * D] = torch.eye(D)
        w_succ = torch.linalg.lstsq(inputs[ITEMS[:-1]], inputs[ITEMS[1:]]).solution * gain  # (D, D), x @ W
        o[:, 0:D] = w_succ.T
        o[:, D:2 * D] = -torch.diag(gain)
    return hf


def _plain_eff(hf, ids):
    """W_E t + MLP0(norm(W_E t)): block 0 with its attention removed (Llama: no o_proj bias), plain torch."""
    x = hf.model.embed_tokens.weight[ids]
    block = hf.model.layers[0]
    return x + block.mlp(block.post_attention_layernorm(x))


def _plain_head_inputs(hf, layer, ids=None):
    ids = torch.arange(hf.config.vocab_size) if ids is None else torch.as_tensor(ids)
    return hf.model.layers[layer].input_layernorm(_plain_eff(hf, ids))


def _plain_logits(hf, layer, head, ids):
    """(n, vocab) logits of one head on eff(t), from HF weights: frozen final-norm scale dropped (it is one
    positive number per row)."""
    attn = hf.model.layers[layer].self_attn
    w_v = attn.v_proj.weight[head * D:(head + 1) * D]  # (d, m)
    w_o = attn.o_proj.weight[:, head * D:(head + 1) * D]  # (m, d)
    out = _plain_head_inputs(hf, layer, ids) @ w_v.T @ w_o.T
    return (out * hf.model.norm.weight) @ hf.lm_head.weight.T


@torch.no_grad()
def test_planted_successor_and_copy_suppression_heads_match_plain_torch():
    hf = _planted()
    model = interp.load_model(hf)
    succ = successor_scores(model, lists={"planted": ITEMS}, n_bootstrap=50)
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
    for row in succ.itertuples():
        logits = _plain_logits(hf, row.layer, row.head, ITEMS[:-1])[:, ITEMS]  # (7, 8)
        expected = float((logits.argmax(-1) == torch.arange(1, 8)).double().mean())
        assert abs(row.successor - expected) < 1e-12, (row.layer, row.head)
    ids = torch.tensor(tokens)
    for row in copy.itertuples():
        logits = _plain_logits(hf, row.layer, row.head, ids)
        own = logits[torch.arange(len(ids)), ids]
        expected = float(((logits < own[:, None]).sum(-1) < 3).double().mean())
        assert abs(row.copy_suppression - expected) < 1e-12, (row.layer, row.head)
    assert succ.successor.drop(index=top_succ.name).max() < 1.0


def test_weight_scores_check_their_input():
    model = interp.load_model(_planted())
    import pytest

    with pytest.raises(ValueError, match="at least 2 distinct"):
        successor_scores(model, lists={"bad": [5, 5]})
    with pytest.raises(ValueError, match="tokenizer"):
        successor_scores(model)  # no tokenizer: the bundled lists cannot be tokenized
    with pytest.raises(ValueError, match="k must be"):
        copy_suppression_scores(model, tokens=[1, 2], k=0)
