"""Norm-weighted attention (Kobayashi et al. 2020): ``||w_ij v_j W_O|| / sum_k ||w_ik v_k W_O||``, read by every
target-rule score with ``weighting="norm"``. The flash path (per-key norms and one more statistic of the tiled pass)
equals the eager path (the pattern) on GPT-2, Llama (GQA) and T5 sites with padding, and both equal a plain
recomputation from HF's eager patterns, values and output weights."""

from __future__ import annotations

import copy
import io

import pandas as pd
import pytest
import torch

import interp
from interp.tokens.inputs import padded_positions
from analyses import detect_heads, pattern_scores
from conftest import reference_and_ours, tiny_hf
from test_heads import _ragged_prompts
from test_seq2seq import _batch, _tiny

FLASH_TOL = 1e-5
SCORES = ["previous_token", "sink", "self", "duplicate_token", "induction"]


def _pad_left(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    n = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):], mask[i, n - len(p):] = torch.tensor(p), 1
    return ids, mask


def _numeric(df, columns):
    return torch.tensor(df[columns].to_numpy(dtype=float))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_norm_weighted_scores_flash_equal_eager_with_padding(family):
    hf = tiny_hf(family, initializer_range=0.4)  # llama: 4 heads on 2 key/value heads (GQA)
    flash = interp.load_model(copy.deepcopy(hf), attn="flash")
    eager = interp.load_model(copy.deepcopy(hf), attn="eager")
    kwargs = dict(prompts=_ragged_prompts(99), batch_size=3, n_bootstrap=20, weighting="norm", scores=SCORES)
    a, b = detect_heads(flash, **kwargs), detect_heads(eager, **kwargs)
    assert a.attrs["weighting"] == "norm"
    torch.testing.assert_close(_numeric(a, SCORES), _numeric(b, SCORES), atol=FLASH_TOL, rtol=0)
    raw = detect_heads(flash, **{**kwargs, "weighting": "raw"})
    assert (_numeric(raw, SCORES) - _numeric(a, SCORES)).abs().max() > 1e-3  # the weighting changes the scores


def test_norm_weighted_scores_flash_equal_eager_on_t5_sites_with_padding():
    """Encoder self-attention, decoder self-attention and cross-attention sites, source and target padded."""
    src, src_mask, tgt, tgt_mask = _batch()
    batch = {"input_ids": src, "attention_mask": src_mask, "decoder_input_ids": tgt, "decoder_attention_mask": tgt_mask}
    hf = _tiny("t5")
    flash = interp.load_model(copy.deepcopy(hf), attn="flash")
    eager = interp.load_model(copy.deepcopy(hf), attn="eager")
    a = detect_heads(flash, prompts=batch, n_bootstrap=20, weighting="norm")
    b = detect_heads(eager, prompts=batch, n_bootstrap=20, weighting="norm")
    columns = [c for c in ("previous_token", "sink", "self", "alignment", "source_sink") if c in a]
    assert {"alignment", "source_sink", "sink"} <= set(columns) and set(a.kind) >= {"self", "cross"}
    values_a, values_b = _numeric(a, columns), _numeric(b, columns)
    assert torch.equal(values_a.isnan(), values_b.isnan())
    torch.testing.assert_close(values_a.nan_to_num(), values_b.nan_to_num(), atol=FLASH_TOL, rtol=0)
    raw = detect_heads(flash, prompts=batch, n_bootstrap=20)
    assert (_numeric(raw, columns) - values_a).nan_to_num().abs().max() > 1e-3


def _hf_values_and_w_o(family: str, ref, ids, mask):
    """Per layer: HF's eager pattern (b, h, q, k), its values per query head (b, k, h, e) and W_O (h, e, m), read
    from HF's own modules (no interp)."""
    values, layers = [], ref.model.layers if family == "llama" else ref.transformer.h
    cfg = ref.config
    n_heads = cfg.num_attention_heads if family == "llama" else cfg.n_head
    handles = []
    for layer in layers:
        proj = layer.self_attn.v_proj if family == "llama" else layer.attn.c_attn
        handles.append(proj.register_forward_hook(lambda m, i, o: values.append(o.detach())))
    try:
        with torch.no_grad():
            out = ref(input_ids=ids, attention_mask=mask, output_attentions=True, use_cache=False,
                      position_ids=padded_positions(mask))  # what interp passes with left padding
    finally:
        for h in handles:
            h.remove()
    per_layer = []
    for layer, v, pattern in zip(layers, values, out.attentions):
        if family == "llama":
            n_kv = cfg.num_key_value_heads
            v = v.unflatten(-1, (n_kv, -1)).repeat_interleave(n_heads // n_kv, dim=2)  # (b, k, h, e)
            w_o = layer.self_attn.o_proj.weight.detach().T  # (h e, m)
        else:
            m = cfg.n_embd
            v = v[..., 2 * m:].unflatten(-1, (n_heads, -1))
            w_o = layer.attn.c_proj.weight.detach()  # Conv1D: already (h e, m)
        per_layer.append((pattern, v, w_o.reshape(n_heads, v.shape[-1], -1)))
    return per_layer


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_norm_weighted_scores_equal_a_plain_recomputation_from_hf(family):
    ref, ours = reference_and_ours(tiny_hf(family, initializer_range=0.4), "flash", ref_impl="eager")
    prompts = _ragged_prompts(99)
    ids, mask = _pad_left(prompts)
    got = detect_heads(ours, prompts=prompts, batch_size=2, n_bootstrap=20, weighting="norm", scores=SCORES)
    for layer, (pattern, v, w_o) in enumerate(_hf_values_and_w_o(family, ref, ids, mask)):
        moved = torch.einsum("bkhe,hem->bhkm", v.double(), w_o.double()).norm(dim=-1)  # (b, h, k) ||v_j W_O||
        share = pattern.double() * moved[:, :, None, :]  # ||w_ij v_j W_O||
        share = share / share.sum(-1, keepdim=True).clamp(min=1e-300)
        want = pattern_scores(share.float(), ids, mask, scores=SCORES, n_bootstrap=20)
        mine = got[got.layer == layer]
        torch.testing.assert_close(_numeric(mine, SCORES), _numeric(want, SCORES), atol=FLASH_TOL, rtol=0)


def test_weighting_is_checked():
    model = interp.load_model(tiny_hf("llama"), attn="flash")
    with pytest.raises(ValueError, match="weighting is one of"):
        detect_heads(model, n_prompts=2, seq_len=8, weighting="abs")
    with pytest.raises(ValueError, match="read by target-rule scores"):
        detect_heads(model, n_prompts=2, seq_len=8, scores=["positional"], weighting="norm")


def test_cli_heads_reads_norm_weighted_scores(capsys):
    from analyses.cli import main

    code = main(["heads", "--format", "csv", "--n-prompts", "8", "--scores", "induction,sink", "--weighting", "norm",
                 "--top", "0"])
    out, _ = capsys.readouterr()
    assert code == 0
    df = pd.read_csv(io.StringIO(out)).sort_values(["layer", "head"])
    want = detect_heads(interp.load_model("toy-induction"), n_prompts=8, scores=["induction", "sink"],
                        weighting="norm")
    torch.testing.assert_close(_numeric(df, ["induction", "sink"]), _numeric(want, ["induction", "sink"]),
                               atol=1e-6, rtol=0)
    with pytest.raises(SystemExit) as exit_:
        main(["heads", "--weighting", "abs"])
    assert exit_.value.code == 2 and "invalid choice: 'abs'" in capsys.readouterr().err
