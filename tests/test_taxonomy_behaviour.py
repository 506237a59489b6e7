"""The behavioural copy-suppression signature (analyses.taxonomy.behaviour) finds a head planted in a tiny GPT-2 to
attend to the token the logit lens predicts and write minus its unembedding, and equals the same measures
recomputed with plain torch from the HF weights and hidden states."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import interp
from analyses.taxonomy.behaviour import copy_suppression_behaviour_scores

M, H, E, V = 32, 2, 16, 99  # d_model, heads, head dim, vocab


def _planted():
    """Layer 0 head 0: its QK form is the logit lens's bilinear form (score(q, k) = c * logit of token k at q, up
    to the norms, which are plain LayerNorms), and its OV writes minus the attended token's unembedding. No
    positional embedding, no biases; unembedding untied: u_t = LN(e_t) B A^T."""
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=H, n_embd=M, n_positions=64, vocab_size=V, bos_token_id=0, eos_token_id=0,
                     pad_token_id=0, tie_word_embeddings=False)
    hf = GPT2LMHeadModel(cfg).eval()
    a, b = torch.randn(M, E) / math.sqrt(M), torch.randn(M, E) / math.sqrt(M)
    with torch.no_grad():
        t = hf.transformer
        t.wpe.weight.zero_()
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.zero_()
        ln = torch.nn.functional.layer_norm(t.wte.weight, (M,))
        hf.lm_head.weight.copy_(ln @ b @ a.T * 3.0)
        w = t.h[0].attn.c_attn.weight  # (m, 3m): q | k | v, heads side by side
        w[:, 0:E] = a * 8.0
        w[:, M:M + E] = b * 8.0
        w[:, 2 * M:2 * M + E] = b
        t.h[0].attn.c_proj.weight[0:E] = -2.0 * a.T
    return hf


def _plain(hf, ids, k):
    """Per (layer, head): (behaviour, attends_predicted, predicted_effect), from HF weights with plain torch."""
    t = hf.transformer
    captured = {}
    handle = t.ln_f.register_forward_hook(lambda mod, args, out: captured.update(final=args[0]))
    try:
        out = hf(ids, output_hidden_states=True)
    finally:
        handle.remove()
    final = captured["final"]
    sigma = torch.sqrt(final.var(-1, unbiased=False, keepdim=True) + t.ln_f.eps)
    n, p = ids.shape
    result = {}
    for layer in range(2):
        resid = out.hidden_states[layer]  # the residual entering block `layer`
        top = hf.lm_head(t.ln_f(resid)).topk(k, -1).indices  # (b, p, k)
        block = t.h[layer]
        qkv = block.ln_1(resid) @ block.attn.c_attn.weight + block.attn.c_attn.bias
        q, kk, v = (x.reshape(n, p, H, E).transpose(1, 2) for x in qkv.split(M, -1))  # (b, h, p, e)
        scores = q @ kk.transpose(-1, -2) / math.sqrt(E)
        scores = scores.masked_fill(torch.ones(p, p, dtype=torch.bool).triu(1), float("-inf"))
        pattern = scores.softmax(-1)
        z = pattern @ v  # (b, h, p, e)
        for head in range(H):
            hits, sup, effects = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64), []
            w_o = block.attn.c_proj.weight[head * E:(head + 1) * E]  # (e, m)
            for i in range(n):
                for qpos in range(2, p):
                    key = 1 + int(pattern[i, head, qpos, 1:qpos].argmax())
                    token = int(ids[i, key])
                    predicted = token in top[i, qpos].tolist()
                    c = z[i, head, qpos] @ w_o
                    c = (c - c.mean()) / sigma[i, qpos, 0] * t.ln_f.weight
                    effect = float(c @ hf.lm_head.weight[token])
                    hits[i] += predicted
                    sup[i] += predicted and effect < 0
                    if predicted:
                        effects.append(effect)
            result[(layer, head)] = (float((sup / (p - 2)).mean()), float((hits / (p - 2)).mean()),
                                     float(np.mean(effects)) if effects else float("nan"))
    return result


@torch.no_grad()
def test_planted_copy_suppressor_is_found_and_matches_plain_torch():
    hf = _planted()
    ids = torch.randint(1, V, (12, 20), generator=torch.Generator().manual_seed(1))
    expected = _plain(hf, ids, 10)
    df = copy_suppression_behaviour_scores(interp.load_model(hf), tokens=ids, k=10, n_bootstrap=100)
    assert len(df) == 4
    for row in df.itertuples():
        want = expected[(row.layer, row.head)]
        assert abs(row.copy_suppression_behaviour - want[0]) < 1e-12, (row.layer, row.head)
        assert abs(row.cs_attends_predicted - want[1]) < 1e-12, (row.layer, row.head)
        assert np.isclose(row.cs_predicted_effect, want[2], rtol=1e-4, atol=1e-5), (row.layer, row.head, want)
        assert row.copy_suppression_behaviour_lo <= row.copy_suppression_behaviour <= row.copy_suppression_behaviour_hi
    top = df.sort_values("copy_suppression_behaviour", ascending=False).iloc[0]
    assert (top["layer"], top["head"]) == (0, 0)
    assert top["cs_predicted_effect"] < 0 and top["copy_suppression_behaviour"] > 0.5
    others = df[(df.layer != 0) | (df["head"] != 0)]
    assert (others["copy_suppression_behaviour"] < top["copy_suppression_behaviour"] - 0.2).all()


def test_behaviour_checks_its_input():
    model = interp.load_model(_planted())
    with pytest.raises(ValueError, match="shape"):
        copy_suppression_behaviour_scores(model, tokens=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="ids in"):
        copy_suppression_behaviour_scores(model, tokens=torch.tensor([[1, 2, 300]]))
    with pytest.raises(ValueError, match="k must be"):
        copy_suppression_behaviour_scores(model, tokens=torch.tensor([[1, 2, 3]]), k=0)
    with pytest.raises(ValueError, match="no tokenizer"):
        copy_suppression_behaviour_scores(model)



def test_detect_heads_computes_the_behaviour_on_corpus_windows():
    from test_taxonomy import _tiny_with_tokenizer

    from analyses import detect_heads
    from analyses.taxonomy.behaviour import corpus_windows

    model = _tiny_with_tokenizer()
    df = detect_heads(model, scores=["copy_suppression_behaviour"], n_bootstrap=20)
    direct = copy_suppression_behaviour_scores(model, n_bootstrap=20)
    assert len(df) == 8 and df["copy_suppression_behaviour"].tolist() == direct["copy_suppression_behaviour"].tolist()
    assert set(df["label"]) == {"none"}  # no published threshold: the score labels no head
    windows = corpus_windows(model, 4, 16, seed=3)
    from analyses.data.prompts import _special_frame

    prefix = _special_frame(model)[0]  # SmolLM2's tokenizer adds none: the config's BOS, as corpus prompts have
    assert windows.shape == (4, 16) and windows[:, :len(prefix)].tolist() == [prefix] * 4
    assert len({tuple(w) for w in windows.tolist()}) == 4  # four different places in the text
