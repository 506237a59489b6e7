"""Encoder-decoder models: T5 (relative position bias), BART, mBART and Marian on both attention paths, their
three kinds of attention, hooks, patterns, generation, head scores and a copy-task toy."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (BartConfig, BartForConditionalGeneration, MarianConfig, MarianMTModel, MBartConfig,
                          MBartForConditionalGeneration, T5Config, T5ForConditionalGeneration)

import interp
from interp.structure.probe import set_attention_key
from analyses import ablate_heads, detect_heads
from analyses.data.seq2seq import copy_accuracy, copy_task, train_copy_model
from hooks import spec_for

_BART_LIKE = dict(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                  dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                  eos_token_id=2, decoder_start_token_id=2)


def _tiny(family: str):
    torch.manual_seed(0)
    if family == "t5":
        config = T5Config(vocab_size=100, d_model=32, d_kv=8, num_heads=4, num_layers=2, num_decoder_layers=2, d_ff=64,
                          relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
                          pad_token_id=0, eos_token_id=1)
        hf = T5ForConditionalGeneration(config)
    elif family == "bart":
        hf = BartForConditionalGeneration(BartConfig(**_BART_LIKE))
    elif family == "mbart":
        hf = MBartForConditionalGeneration(MBartConfig(**_BART_LIKE))
    else:
        hf = MarianMTModel(MarianConfig(**{**_BART_LIKE, "decoder_vocab_size": 100}))
    with torch.no_grad():  # weights large enough that the bias and the patterns matter
        for name, p in hf.named_parameters():
            if "relative_attention_bias" in name:
                p.mul_(8)
            elif any(k in name for k in ("q.weight", "k.weight", "q_proj", "k_proj")):
                p.mul_(4)
    return hf.eval()


FAMILIES = ["t5", "bart", "mbart", "marian"]


def _batch():
    generator = torch.Generator().manual_seed(1)
    src = torch.randint(3, 100, (3, 9), generator=generator)
    src_mask = torch.ones(3, 9, dtype=torch.long)
    src_mask[1, 6:] = 0
    src_mask[2, 3:] = 0
    tgt = torch.randint(3, 100, (3, 6), generator=generator)
    tgt_mask = torch.ones(3, 6, dtype=torch.long)
    tgt_mask[1, 4:] = 0
    return src, src_mask, tgt, tgt_mask


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    hf = _tiny(request.param)
    ref = copy.deepcopy(hf)
    set_attention_key(ref, "eager")  # every stack: transformers 5.17 copies T5's config per stack
    return request.param, hf, ref


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_parity_with_hf_eager_with_padding_on_both_sides(pair, attn):
    family, hf, ref = pair
    src, src_mask, tgt, tgt_mask = _batch()
    with torch.no_grad():
        want = ref(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask,
                   use_cache=False).logits
        model = interp.load_model(copy.deepcopy(hf), attn=attn)
        got = model(src, src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask).logits
    assert isinstance(model, interp.HookedModel)
    real = tgt_mask.bool()
    if attn == "eager":
        assert torch.equal(got[real], want[real])
    else:
        assert (got[real] - want[real]).abs().max() <= 1e-5 * want[real].abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "pad"])
def test_eager_outputs_and_patterns_are_bit_identical_to_hf_eager(pair, padding, dtype):
    """Every position of the logits and the encoder output, and every site's pattern (HF's output_attentions),
    torch.equal to HF eager, with query/key weights x4 and T5's position bias x8 so that the bias, the scale and
    the mask all move the patterns. T5, BART, mBART and Marian take their softmax in the scores' dtype, where our
    path took it in float32: the same bits in float32, up to 2.4e-6 apart in float64 (the softmax's precision)."""
    family, hf, ref = pair
    hf, ref = copy.deepcopy(hf).to(dtype), copy.deepcopy(ref).to(dtype)
    src, src_mask, tgt, tgt_mask = _batch()
    if not padding:
        src_mask = tgt_mask = None
    model = interp.load_model(hf, attn="eager")
    with torch.no_grad():
        want = ref(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask,
                   use_cache=False, output_attentions=True)
        got, cache = model.run_with_cache(src, src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask,
                                          names=lambda name: name.endswith("hook_pattern"))
        _, qk = model.run_with_cache(src, src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask,
                                     names=lambda name: name.endswith(("hook_q", "hook_k")))
    assert got.logits.dtype == dtype
    assert torch.equal(got.logits, want.logits)
    assert torch.equal(got.encoder_last_hidden_state, want.encoder_last_hidden_state)
    theirs = {**{f"encoder.blocks.{i}.attn": a for i, a in enumerate(want.encoder_attentions)},
              **{f"decoder.blocks.{i}.attn": a for i, a in enumerate(want.decoder_attentions)},
              **{f"decoder.blocks.{i}.cross_attn": a for i, a in enumerate(want.cross_attentions)}}
    assert set(theirs) == set(model.sites)
    for site, pattern in theirs.items():
        assert torch.equal(cache[f"{site}.hook_pattern"], pattern), site
        assert torch.equal(qk.pattern(site), pattern), site  # rebuilt from q and k


def test_a_decoder_whose_modules_say_not_causal_is_still_causal_on_flash():
    """NLLB-MoE's decoder self-attention modules say is_causal=False (HF refuses sdpa for it); without padding
    the mask function skips the causal mask, so the flash path must know the layer is causal from discovery."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    config = AutoConfig.for_model("nllb-moe", d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=128,
                                  max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    hf = AutoModelForSeq2SeqLM.from_config(config).eval()
    assert not hf.get_decoder().layers[0].self_attn.is_causal
    src, tgt = torch.randint(5, 100, (2, 7)), torch.randint(5, 100, (2, 5))
    with torch.no_grad():
        want = hf(input_ids=src, decoder_input_ids=tgt, use_cache=False).logits  # HF eager
        got = interp.load_model(copy.deepcopy(hf), attn="flash")(src, decoder_input_ids=tgt).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_t5_position_bias_matters_and_is_used():
    """Zeroing T5's relative position bias changes the output: a path that dropped it would not be exact."""
    hf = _tiny("t5")
    src, src_mask, tgt, tgt_mask = _batch()
    model = interp.load_model(copy.deepcopy(hf), attn="flash")
    with torch.no_grad():
        base = model(src, src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask).logits
        for name, p in model.hf.named_parameters():
            if "relative_attention_bias" in name:
                p.zero_()
        without = model(src, src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask).logits
    assert (base - without).abs().max() > 0.1


def test_sites_and_hook_names():
    model = interp.load_model(_tiny("t5"), attn="eager")
    names = [s.name for s in model.cfg.sites]
    assert names == ["encoder.blocks.0.attn", "encoder.blocks.1.attn", "decoder.blocks.0.attn",
                     "decoder.blocks.0.cross_attn", "decoder.blocks.1.attn", "decoder.blocks.1.cross_attn"]
    hooks = set(model.hook_names())
    for stack in ("encoder", "decoder"):
        for l in range(2):
            assert {f"{stack}.blocks.{l}.hook_resid_pre", f"{stack}.blocks.{l}.hook_resid_post",
                    f"{stack}.blocks.{l}.attn.hook_z", f"{stack}.blocks.{l}.hook_attn_out"} <= hooks
    assert "decoder.blocks.1.cross_attn.hook_q" in hooks and "decoder.blocks.1.hook_cross_attn_out" in hooks
    assert "encoder.blocks.0.cross_attn.hook_q" not in hooks
    assert spec_for("decoder.blocks.1.cross_attn.hook_k").shape == "(b, p, g, d)"


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_hook_shapes_follow_the_table(family):
    """Every captured tensor has its table shape; cross-attention's q has the target's length, k and v the source's."""
    model = interp.load_model(_tiny(family), attn="eager")
    src, src_mask, tgt, tgt_mask = _batch()
    _, cache = model.run_with_cache(src, src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    sizes = {"b": 3, "m": model.cfg.d_model, "h": 4, "g": 4, "d": 8, "e": 8}
    for name, tensor in cache.items():
        stack = name.split(".")[0]
        cross = ".cross_attn." in name
        p = 9 if stack == "encoder" else 6
        dims = dict(sizes, p=p, q=p, k=9 if cross or stack == "encoder" else 6)
        if cross and name.endswith(("hook_k", "hook_v")):
            dims["p"] = 9
        want = tuple(dims[a.strip()] for a in spec_for(name).shape.strip("()").split(","))
        assert tuple(tensor.shape) == want, name


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_cache_pattern_for_all_three_kinds(family):
    hf = _tiny(family)
    src, src_mask, tgt, tgt_mask = _batch()
    model = interp.load_model(hf, attn="eager")
    kwargs = dict(decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    _, eager = model.run_with_cache(src, src_mask, **kwargs)
    _, qk = model.run_with_cache(src, src_mask, names=lambda n: n.endswith(("hook_q", "hook_k")), **kwargs)
    model.set_attn("flash")
    _, flash = model.run_with_cache(src, src_mask, **kwargs)
    for i, site in enumerate(model.cfg.sites):
        want = eager[f"{site.name}.hook_pattern"]
        assert torch.equal(qk.pattern(site.name), want), site.name  # rebuilt from the eager run's q and k: exact
        if site.kind == "cross":
            assert want.shape[-2:] == (6, 9)
        # the flash run's q and k differ from the eager run's by rounding upstream; its rebuilt pattern may differ
        # by what that moves the scores (softmax moves a weight by at most twice the largest score change), and
        # the scores agree to 1e-5 of their size
        scores = {name: torch.einsum("bqhd,bkhd->bhqk", c[f"{site.name}.hook_q"], c[f"{site.name}.hook_k"]) * site.scale
                  for name, c in (("eager", eager), ("flash", flash))}
        moved = (scores["flash"] - scores["eager"]).abs().max()
        assert moved <= 1e-5 * scores["eager"].abs().max(), site.name
        assert (flash.pattern(site.name) - want).abs().max() <= 2 * moved + 1e-6, site.name
        assert (flash.pattern(i, heads=[1, 3]) - want[:, [1, 3]]).abs().max() <= 2 * moved + 1e-6, site.name
    with pytest.raises(KeyError, match="decoder.blocks.1.cross_attn"):
        flash.pattern("decoder.blocks.7.cross_attn")


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_generation_equals_hf_with_hooks_firing_per_step(pair, attn):
    family, hf, ref = pair
    src, src_mask, _, _ = _batch()
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=1)
    with torch.no_grad():
        want = ref.generate(input_ids=src, attention_mask=src_mask, **settings)
    model = interp.load_model(copy.deepcopy(hf), attn=attn)
    fired = []
    with torch.no_grad(), model.hooks([("decoder.blocks.1.cross_attn.hook_z", lambda z, hook: fired.append(z.shape))]):
        got = model.hf.generate(input_ids=src, attention_mask=src_mask, **settings)
    assert torch.equal(got, want)
    assert len(fired) == 6 and fired[-1] == (3, 1, 4, 8)
    assert not model._registry.active()


def test_missing_decoder_inputs_is_a_clear_error():
    model = interp.load_model(_tiny("bart"))
    src, src_mask, _, _ = _batch()
    with pytest.raises(ValueError, match="decoder_input_ids"):
        model(src, src_mask)
    with pytest.raises(ValueError, match="decoder_input_ids"):
        model.run_with_cache(src, src_mask)


def test_hooks_edit_cross_attention_and_nothing_is_left_after_an_exception():
    model = interp.load_model(_tiny("t5"), attn="flash")
    src, src_mask, tgt, tgt_mask = _batch()
    weights = {k: v.clone() for k, v in model.hf.state_dict().items()}
    kwargs = dict(decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)
    with torch.no_grad():
        base = model(src, src_mask, **kwargs).logits
        edited = model.run_with_hooks(src, src_mask, fwd_hooks=[("decoder.blocks.1.cross_attn.hook_z",
                                                                  lambda z, hook: z * 0)], **kwargs).logits
    assert (base - edited).abs().max() > 1e-3

    def boom(z, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.run_with_hooks(src, src_mask, fwd_hooks=[("encoder.blocks.0.attn.hook_z", boom)], **kwargs)
    with pytest.raises(RuntimeError, match="boom"), model.studying():
        model.hf.train()
        raise RuntimeError("boom")
    assert not model._registry.active() and not model._torch_handles
    assert not model.hf.training
    assert all(torch.equal(v, weights[k]) for k, v in model.hf.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(src, src_mask, **kwargs).logits, base)


def test_a_folder_loads_as_an_encoder_decoder_model(tmp_path):
    hf = _tiny("bart")
    hf.save_pretrained(tmp_path)
    model = interp.load_model(tmp_path, attn="eager")
    src, src_mask, tgt, tgt_mask = _batch()
    with torch.no_grad():
        want = hf(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, use_cache=False).logits
        got = model(src, src_mask, decoder_input_ids=tgt).logits
    assert isinstance(model, interp.HookedModel) and torch.allclose(got, want, atol=1e-6)


def test_head_scores_of_every_kind_on_both_paths():
    model = interp.load_model(_tiny("t5"), attn="flash")
    flash = detect_heads(model, n_prompts=8, seq_len=8, n_bootstrap=50)
    model.set_attn("eager")
    eager = detect_heads(model, n_prompts=8, seq_len=8, n_bootstrap=50)
    assert len(flash) == 6 * 4 and set(flash["kind"]) == {"self", "cross"}
    assert flash[flash.kind == "cross"]["alignment"].notna().all()
    assert flash[(flash.kind == "self") & (flash.stack == "encoder")]["next_token"].notna().all()
    assert flash[(flash.kind == "self") & (flash.stack == "decoder")]["next_token"].isna().all()
    cols = ["alignment", "source_sink", "previous_token", "self", "sink"]
    assert (flash[cols].fillna(0) - eager[cols].fillna(0)).abs().max().max() < 1e-5


@pytest.fixture(scope="module")
def copy_model():
    return train_copy_model(steps=400, n_heads=4, seed=0)


def test_copy_toy_cross_attention_head_is_found_and_needed(copy_model):
    """The toy copies (teacher-forced accuracy ~1); its copying cross-attention heads are the ones with a high
    alignment score, and ablating them breaks copying while ablating the rest does not."""
    model = copy_model
    batch = copy_task(model, 128, 10, seed=999)
    assert copy_accuracy(model, batch) > 0.98
    df = detect_heads(model, n_prompts=64, seq_len=10)
    cross = df[df.kind == "cross"]
    aligned = cross[cross["alignment"] >= 0.4]
    assert len(aligned) >= 1 and (aligned["label"].str.contains("alignment")).all()
    site = cross["site"].iloc[0]
    with ablate_heads(model, [(site, int(h)) for h in aligned["head"]]):
        broken = copy_accuracy(model, batch)
    assert broken < 0.2  # chance is 1/21
    rest = [(site, int(h)) for h in cross["head"] if h not in set(aligned["head"])]
    if rest:
        with ablate_heads(model, rest):
            assert copy_accuracy(model, batch) > 0.9
    assert not model._registry.active()
