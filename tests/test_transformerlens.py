"""TransformerLens's everyday surface (issue 37), each function against an independent computation on a tiny Llama
(RMSNorm, rotary, GQA), a tiny GPT-2 (learned positions, LayerNorm with bias) and MiniLM's encoder."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import interp
from interp import HookedTransformer, LowRank, utils
from tests.conftest import tiny_hf

ATOL = 1e-5


@pytest.fixture(scope="module")
def llama():
    return interp.load_model(tiny_hf("llama"), attn="eager")


@pytest.fixture(scope="module")
def gpt2():
    return interp.load_model(tiny_hf("gpt2"), attn="flash")


@pytest.fixture(scope="module")
def smollm2():
    return interp.load_model("smollm2", attn="flash", device="cpu")


def _ids(b=2, p=9, seed=0):
    return torch.randint(1, 99, (b, p), generator=torch.Generator().manual_seed(seed))


# -- tokens -----------------------------------------------------------------------------------------------------
def test_to_tokens_is_a_padded_long_tensor_with_bos_as_asked(smollm2):
    tok = smollm2.tokenizer
    ids = smollm2.to_tokens(["The cat sat", "Hi"])
    assert ids.dtype == torch.long and ids.ndim == 2
    assert ids[0].tolist() == tok("The cat sat")["input_ids"]  # the tokenizer's convention (SmolLM2: no BOS)
    hi = tok("Hi")["input_ids"]
    assert ids[1, :len(hi)].tolist() == hi and (ids[1, len(hi):] == smollm2.pad_token_id).all()  # right padding
    assert smollm2.to_tokens("Hi", prepend_bos=True)[0].tolist() == [tok.bos_token_id, *hi]
    assert smollm2.to_tokens("Hi", prepend_bos=False)[0].tolist() == hi
    left = smollm2.to_tokens(["The cat sat", "Hi"], padding_side="left")
    assert left[1, -len(hi):].tolist() == hi
    batch = smollm2.to_batch(["The cat sat", "Hi"])  # the mapping to_tokens returned before: left padding for a causal LM
    assert batch["input_ids"][1, -len(hi):].tolist() == hi and batch["attention_mask"][1].sum() == len(hi)


def test_strings_single_tokens_and_positions(smollm2):
    assert smollm2.to_str_tokens("The cat") == ["The", " cat"]  # not 'Ġcat'
    assert smollm2.to_str_tokens(smollm2.to_tokens("The cat")) == ["The", " cat"]  # (1, p) gives one list
    assert smollm2.to_str_tokens(["a b", "c"])[1] == ["c"]
    cat = smollm2.to_single_token(" cat")
    assert cat == smollm2.tokenizer(" cat", add_special_tokens=False)["input_ids"][0]
    with pytest.raises(ValueError, match="3 tokens"):
        smollm2.to_single_token(" catapulting")
    text = "The cat saw the cat"
    assert smollm2.to_string(smollm2.to_tokens(text)[0]) == text
    assert smollm2.to_string(smollm2.to_tokens([text, "x"]))[0].startswith(text)
    assert smollm2.get_token_position(" cat", text) == 1 and smollm2.get_token_position(" cat", text, "last") == 4
    directions = smollm2.tokens_to_residual_directions(torch.tensor([[cat, cat]]))
    assert directions.shape == (1, 2, 576) and torch.equal(directions[0, 0], smollm2.W_U[:, cat])
    assert torch.equal(smollm2.tokens_to_residual_directions(" cat"), smollm2.W_U[:, cat])


def test_an_encoders_right_padded_tensor_masks_its_pad_tokens(minilm):
    texts = ["The cat sat on the mat.", "Hi"]
    ids = minilm.to_tokens(texts)
    assert ids[1, -1] == minilm.tokenizer.pad_token_id
    ours = minilm(ids).last_hidden_state
    with torch.no_grad():
        ref = minilm.hf(input_ids=ids, attention_mask=(ids != 0).long()).last_hidden_state  # HF with the true mask
    real = ids != 0
    torch.testing.assert_close(ours[real], ref[real], atol=1e-5, rtol=1e-5)


def test_hook_names_is_a_list_and_still_callable(llama):
    names = llama.hook_names
    assert len(names) == len(llama.hook_names()) and names == llama.hook_names() and "hook_embed" in names
    assert set(llama.hook_dict) == set(names) and llama.hook_dict["blocks.1.attn.hook_z"].name == "blocks.1.attn.hook_z"
    assert llama.mod_dict["blocks.1.attn"] is llama._site_modules["blocks.1.attn"]
    assert utils.get_act_name("attn", 1) == "blocks.1.attn.hook_pattern" == utils.get_act_name("pattern1")
    assert utils.get_act_name("resid_pre", 0) == "blocks.0.hook_resid_pre" and utils.get_act_name("embed") == "hook_embed"
    with pytest.raises(ValueError, match="no hook of kind 'pre'"):
        utils.get_act_name("pre", 2)


# -- forward and generation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_return_types_against_hf(name, request):
    model = request.getfixturevalue(name)
    ids = _ids()
    with torch.no_grad():
        logits = model.hf(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 99), ids[:, 1:].reshape(-1))
        assert torch.allclose(model(ids, return_type="logits"), logits, atol=ATOL)
        assert torch.allclose(model(ids, return_type="loss"), loss, atol=ATOL)
        per = model(ids, return_type="loss", loss_per_token=True)
        assert per.shape == (2, 8) and torch.allclose(per.mean(), loss, atol=ATOL)
        both = model(ids, return_type="both")
        assert torch.allclose(both[1], loss, atol=ATOL) and model(ids, return_type=None) is None
        assert hasattr(model(ids), "logits")  # the default is still the HF output
        out, cache = model.run_with_cache(ids, return_type="loss")
        assert torch.allclose(out, loss, atol=ATOL) and "blocks.0.hook_resid_pre" in cache


def test_from_pretrained_answers_with_logits_and_studies_still_get_the_output():
    model = HookedTransformer.from_pretrained(tiny_hf("llama"))
    ids = _ids()
    with torch.no_grad():
        assert torch.allclose(model(ids), model.hf(input_ids=ids).logits, atol=ATOL)
        with model.studying():
            assert hasattr(model(ids), "logits")
    assert model.return_type == "logits" and copy.deepcopy(model).return_type == "logits"


def test_generate_is_greedy_hfs_and_runs_the_hooks(llama):
    ids = _ids(1, 4)
    ours = llama.generate(ids, max_new_tokens=5, do_sample=False, stop_at_eos=False)
    with torch.no_grad():
        ref = llama.hf.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5, pad_token_id=0)
    assert torch.equal(ours, ref)
    seen = []
    with llama.hooks([("blocks.0.attn.hook_z", lambda z, hook: seen.append(z.shape[1]) or z * 0)]):
        edited = llama.generate(ids, max_new_tokens=3, do_sample=False, stop_at_eos=False)
    assert seen == [4, 5, 6] and not torch.equal(edited, ours[:, :7])


def test_generate_returns_a_string_for_a_string(smollm2):
    out = smollm2.generate("The capital of France is", max_new_tokens=3, do_sample=False)
    ids = smollm2.to_tokens("The capital of France is")
    with torch.no_grad():
        ref = smollm2.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)
    assert isinstance(out, str) and out == smollm2.tokenizer.decode(ref[0])


# -- weights ----------------------------------------------------------------------------------------------------
def test_llama_weights_are_the_projections_per_head(llama):
    llama.fold_ln = False
    try:
        attn = llama.hf.model.layers[1].self_attn
        d = 8
        assert torch.equal(llama.W_Q[1, 3], attn.q_proj.weight[3 * d:4 * d].T)
        assert torch.equal(llama._W_K[1, 1], attn.k_proj.weight[d:2 * d].T)
        assert torch.equal(llama.W_K[1, 3], llama._W_K[1, 1]) and llama.W_K.shape == (2, 4, 32, 8)  # GQA repeated
        assert torch.equal(llama.W_O[1, 2], attn.o_proj.weight[:, 2 * d:3 * d].T)
        assert torch.equal(llama.W_U, llama.hf.lm_head.weight.T) and torch.equal(llama.W_E, llama.hf.model.embed_tokens.weight)
        assert not llama.b_Q.any() and llama.b_O.shape == (2, 32)
        with pytest.raises(NotImplementedError, match="no learned position table"):
            llama.W_pos
    finally:
        llama.fold_ln = True


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_folded_weights_read_the_normalised_stream_as_the_norm_does(name, request):
    """fold_ln: norm(x) @ W + b == (x centred if LayerNorm) / scale(x) @ W_folded + b_folded."""
    model = request.getfixturevalue(name)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    norm = model.in_norm_of(model.cfg.sites[0])
    model.fold_ln = False
    raw = {k: getattr(model, k)[0] for k in ("W_Q", "W_V", "b_Q", "b_V")}
    model.fold_ln = True
    folded = {k: getattr(model, k)[0] for k in ("W_Q", "W_V", "b_Q", "b_V")}
    xhat = x - x.mean(-1, keepdim=True) if name == "gpt2" else x
    xhat = xhat / utils_scale(norm, x)
    with torch.no_grad():
        for w, b in (("W_Q", "b_Q"), ("W_V", "b_V")):
            want = torch.einsum("pm,hmd->phd", norm(x), raw[w]) + raw[b]
            got = torch.einsum("pm,hmd->phd", xhat, folded[w]) + folded[b]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def utils_scale(norm, x):
    from interp.structure.norms import norm_scale
    return norm_scale(norm, x)


def test_gpt2_learned_positions_and_biases(gpt2):
    gpt2.fold_ln = False
    try:
        attn = gpt2.hf.transformer.h[0].attn
        assert torch.equal(gpt2.W_pos, gpt2.hf.transformer.wpe.weight)
        assert torch.equal(gpt2.b_Q[0, 1], attn.c_attn.bias[8:16]) and torch.equal(gpt2.b_V[0, 0], attn.c_attn.bias[64:72])
        assert torch.equal(gpt2.W_K[0, 0], attn.c_attn.weight[:, 32:40]) and torch.equal(gpt2.b_O[0], attn.c_proj.bias)
    finally:
        gpt2.fold_ln = True


def test_ov_qk_are_factored_matrices_with_factoredmatrix_api(gpt2):
    ov, qk = gpt2.OV, gpt2.QK
    assert ov.shape == (2, 4, 32, 32) and isinstance(ov, LowRank)
    full = gpt2.W_V[1, 2] @ gpt2.W_O[1, 2]
    head = ov[1, 2]
    torch.testing.assert_close(head.AB, full)
    torch.testing.assert_close(qk[0, 1].AB, gpt2.W_Q[0, 1] @ gpt2.W_K[0, 1].T)
    torch.testing.assert_close(head.T.AB, full.T)
    torch.testing.assert_close(head.norm(), full.norm(), atol=1e-5, rtol=1e-5)
    u, s, v = head.svd()
    torch.testing.assert_close(u @ torch.diag(s) @ v.T, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, torch.linalg.svdvals(full)[:8], atol=1e-5, rtol=1e-5)
    eig = torch.linalg.eigvals(full)
    ours = head.eigenvalues
    assert ours.shape == (8,)
    for value in ours:  # every eigenvalue of BA is one of AB's
        assert (eig - value).abs().min() < 1e-4
    torch.testing.assert_close((head @ head).AB, full @ full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close((gpt2.W_E[:3] @ head).AB, gpt2.W_E[:3] @ full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head[:5].AB, full[:5])
    from analyses.explain.composition import LowRank as from_analyses
    assert from_analyses is LowRank


def test_an_encoder_has_weights_and_refuses_an_unembedding(minilm):
    layer = minilm.hf.encoder.layer[1].attention.self
    assert torch.equal(minilm.W_Q[1, 0], layer.query.weight[:32].T)  # post-norm: no norm to fold before attention
    assert minilm.W_pos.shape == (512, 384)
    with pytest.raises(NotImplementedError, match="no output layer"):
        minilm.W_U
    with pytest.raises(NotImplementedError, match="no output layer"):
        minilm(minilm.to_tokens("a b"), return_type="loss")


# -- the cache --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_residual_decompositions_sum_to_the_stream_and_read_the_logits(name, request):
    model = request.getfixturevalue(name)
    ids = _ids()
    logits, cache = model.run_with_cache(ids, return_type="logits")
    acc, labels = cache.accumulated_resid(incl_mid=True, return_labels=True)
    assert labels[:3] == ["0_pre", "0_mid", "1_pre"] and labels[-1] == "final_post"
    assert torch.equal(acc[2], cache["resid_pre", 1]) and torch.equal(acc[-1], cache["resid_post", -1])
    lens = cache.accumulated_resid(apply_ln=True, pos_slice=-1)  # (3, b, m)
    torch.testing.assert_close(lens[-1] @ model.W_U + model.b_U, logits[:, -1], atol=1e-4, rtol=1e-4)
    parts, labels = cache.decompose_resid(return_labels=True)
    assert labels[-1] == "1_mlp_out" and ("pos_embed" in labels) == (name == "gpt2")
    torch.testing.assert_close(parts.sum(0), cache["resid_post", 1], atol=1e-5, rtol=1e-5)
    answer = ids[:, -1]
    attrs = cache.logit_attrs(parts[:, :, -1], answer, pos_slice=-1)  # (components, b)
    torch.testing.assert_close(attrs.sum(0) + model.b_U[answer], logits[torch.arange(2), -1, answer],
                               atol=1e-4, rtol=1e-4)
    diff = cache.logit_attrs(parts[:, :, -1], answer, ids[:, 0], pos_slice=-1)
    torch.testing.assert_close(diff, attrs - cache.logit_attrs(parts[:, :, -1], ids[:, 0], pos_slice=-1))
    full, labels = cache.get_full_resid_decomposition(expand_neurons=False, return_labels=True)
    assert labels[:2] == ["L0H0", "L0H1"] and labels[-1] == "bias"
    torch.testing.assert_close(full.sum(0), cache["resid_post", 1], atol=1e-5, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="no hook on MLP neurons"):
        cache.get_full_resid_decomposition()


def test_head_results_from_z_equal_the_result_hook(gpt2):
    ids = _ids()
    _, cache = gpt2.run_with_cache(ids, names=lambda n: "pattern" not in n and "scores" not in n)
    _, default = gpt2.run_with_cache(ids)
    with_hook = cache.stack_head_results(pos_slice=(2, 5))
    from_z = default.stack_head_results(pos_slice=(2, 5))
    assert with_hook.shape == (8, 2, 3, 32)
    torch.testing.assert_close(from_z, with_hook, atol=1e-6, rtol=1e-6)
    stack, labels = default.stack_head_results(1, return_labels=True, incl_remainder=True)
    assert labels[-1] == "remainder" and torch.allclose(stack.sum(0), default["resid_post", 0], atol=1e-6)
    assert default.stack_activation("z").shape == (2, 2, 9, 4, 8)


def test_remove_batch_dim_and_the_mlp_input_norm(llama):
    _, eager = llama.run_with_cache(_ids(1))
    assert torch.equal(eager["attn", -1, "attn"], eager["blocks.1.attn.hook_pattern"])  # TransformerLens's key forms
    assert torch.equal(eager["k1"], eager["blocks.1.attn.hook_k"])
    _, cache = llama.run_with_cache(_ids(1), remove_batch_dim=True)
    assert cache["resid_pre", 0].shape == (9, 32) and not cache.has_batch_dim
    ln2 = llama.blocks[1].ln2
    mid = cache["resid_mid", 1]
    scaled = cache.apply_ln_to_stack(mid[None], layer=1, mlp_input=True)[0]
    torch.testing.assert_close(scaled * llama.blocks[1].ln2.weight, ln2(mid).detach(), atol=1e-5, rtol=1e-5)
    moved = cache.to("cpu")
    assert moved.model is llama and torch.equal(moved["resid_pre", 0], cache["resid_pre", 0])
    with pytest.raises(ValueError, match="one sequence"):
        llama.run_with_cache(_ids(2))[1].to("cpu").remove_batch_dim()


def test_an_encoder_cache_accumulates_and_refuses_a_split(minilm):
    _, cache = minilm.run_with_cache(minilm.to_tokens("The cat sat on the mat."))
    acc = cache.accumulated_resid()
    assert acc.shape[0] == minilm.cfg.n_layers + 1 and torch.equal(acc[-1], cache["resid_post", -1])
    with pytest.raises(NotImplementedError, match="post-norm"):
        cache.decompose_resid()
    with pytest.raises(NotImplementedError, match="Post-norm"):
        cache.accumulated_resid(layer=2, apply_ln=True)


def test_an_encoder_decoder_cache_reads_each_stack_and_refuses_the_rest():
    from tests.test_seq2seq import _tiny

    t5 = interp.load_model(_tiny("t5"), attn="eager")
    ids, dec = _ids(2, 6) % 50, _ids(2, 4, seed=1) % 50
    _, cache = t5.run_with_cache(ids, decoder_input_ids=dec)
    encoder, labels = cache.accumulated_resid(stack="encoder", return_labels=True)
    assert labels[-1] == "final_post" and torch.equal(encoder[-1], cache["encoder.blocks.1.hook_resid_post"])
    assert torch.equal(cache.accumulated_resid(stack="decoder")[0], cache["decoder.blocks.0.hook_resid_pre"])
    with pytest.raises(ValueError, match="stack='encoder' or stack='decoder'"):
        cache.accumulated_resid()
    with pytest.raises(NotImplementedError, match="encoder-decoder model has two"):
        cache.decompose_resid()
    with pytest.raises(NotImplementedError, match="head_weights"):
        t5.W_Q
    with pytest.raises(NotImplementedError, match="model.hf.generate"):
        t5.generate(ids)
    assert t5(ids, decoder_input_ids=dec, return_type="logits").shape == (2, 4, t5.cfg.vocab_size)


def test_add_hook_reset_hooks_and_hook_layer(llama):
    ids = _ids()
    seen = []
    llama.add_hook("blocks.1.attn.hook_z", lambda z, hook: seen.append(hook.layer()))
    llama.add_hook(lambda n: n.endswith("hook_resid_post"), lambda x, hook: seen.append(("post", hook.layer)),
                   is_permanent=True)
    llama(ids)
    assert seen == [("post", 0), 1, ("post", 1)]
    llama.reset_hooks()  # the permanent hook stays
    seen.clear()
    llama(ids)
    assert seen == [("post", 0), ("post", 1)]
    llama.reset_hooks(including_permanent=True)
    seen.clear()
    llama(ids)
    assert seen == [] and not llama._registry.active()
    with pytest.raises(ValueError, match="forward hooks"):
        llama.add_hook("blocks.0.attn.hook_z", lambda z, hook: None, dir="bwd")


# -- patterns on demand on the flash path (issue 53) ------------------------------------------------------------
class _NxN(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every tensor an op makes (not a view of its inputs) with two adjacent axes of size ``n``."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.found = n, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {x.untyped_storage().data_ptr() for x in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(x, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given and any(
                    a == b == self.n for a, b in zip(t.shape, t.shape[1:])):
                self.found.append((str(func), tuple(t.shape)))
        return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("padded", [False, True])
def test_flash_cache_builds_pattern_and_scores_on_access_equal_to_eager(family, padded):
    hf = tiny_hf(family)
    flash, eager = interp.load_model(copy.deepcopy(hf), attn="flash"), interp.load_model(hf, attn="eager")
    ids = _ids(p=11)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0
    _, fc = flash.run_with_cache(ids, mask)
    _, ec = eager.run_with_cache(ids, mask)
    assert not any(n.endswith(("hook_pattern", "hook_attn_scores")) for n in fc)  # nothing n x n was kept
    for l in range(flash.cfg.n_layers):
        for kind in ("pattern", "attn", "attn_scores"):
            assert fc[kind, l].shape == ec[kind, l].shape == (2, flash.cfg.n_heads, 11, 11)
            assert (fc[kind, l] - ec[kind, l]).abs().max() <= ATOL, (kind, l)
        assert torch.equal(fc["pattern", l], fc.pattern(l)) and torch.equal(fc["attn_scores", l], fc.attn_scores(l))
        assert torch.equal(fc[f"blocks.{l}.attn.hook_pattern"], fc.pattern(l))
    assert torch.equal(fc["pattern", -1], fc.pattern(flash.cfg.n_layers - 1))
    assert "blocks.0.attn.hook_pattern" in fc and "blocks.0.attn.hook_pattern" not in list(fc)
    one = flash.run_with_cache(ids[:1])[1].remove_batch_dim()
    assert one["pattern", 1].shape == (flash.cfg.n_heads, 11, 11)


def test_flash_pattern_on_access_costs_one_layers_matrix():
    model = interp.load_model(tiny_hf("llama"), attn="flash")
    ids = _ids(p=23)
    _, cache = model.run_with_cache(ids)
    with _NxN(23) as rec:
        cache["pattern", 1]
    assert rec.found and max(torch.Size(s).numel() for _, s in rec.found) == 2 * model.cfg.n_heads * 23 * 23


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("kind", ["pattern", "attn_scores"])
def test_a_pattern_hook_on_flash_runs_that_layer_eager_and_edits_as_eager(family, kind):
    hf = tiny_hf(family)
    flash, eager = interp.load_model(copy.deepcopy(hf), attn="flash"), interp.load_model(hf, attn="eager")
    ids = _ids(p=13)
    seen = {}

    def edit(t, hook):
        seen[hook.name] = t.detach().clone()
        t = t.clone()
        t[:, 1, 5:] = 0 if kind == "pattern" else torch.finfo(t.dtype).min  # head 1 of the layer
        return t

    name = f"blocks.1.attn.hook_{kind}"
    with torch.no_grad():
        plain = flash(ids).logits
        hooked = flash.run_with_hooks(ids, fwd_hooks=[(name, edit)]).logits
        seen_flash = seen.pop(name)
        reference = eager.run_with_hooks(ids, fwd_hooks=[(name, edit)]).logits
    assert (hooked - reference).abs().max() <= ATOL
    assert (hooked - plain).abs().max() > 1e-3  # the edit reached the model
    assert (seen_flash - seen[name]).abs().max() <= ATOL  # the hook saw what eager's sees
    assert flash.attn == "flash" and flash._registry.active() == []
    # the other layer stayed on flash: one softmax over n x n in such a run, one per layer on eager
    softmaxes = lambda rec: sum("softmax" in op for op, _ in rec.found)  # noqa: E731
    with _NxN(13) as rec, torch.no_grad():
        flash.run_with_hooks(ids, fwd_hooks=[(name, lambda t, hook: None)])
    with _NxN(13) as all_eager, torch.no_grad():
        eager(ids)
    assert softmaxes(rec) == 1 and softmaxes(all_eager) == eager.cfg.n_layers == 2


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_flash_forward_without_pattern_hooks_builds_no_n_by_n_matrix(family):
    model = interp.load_model(tiny_hf(family), attn="flash")
    ids = _ids(p=29)
    with _NxN(29) as rec, torch.no_grad():
        model(ids)
        model.run_with_cache(ids)
        model.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_z", lambda t, hook: t * 1.0)])
    assert rec.found == []
    model.set_attn("eager")  # the check can fail: eager builds every layer's pattern
    with _NxN(29) as rec, torch.no_grad():
        model(ids)
    assert rec.found


def test_cache_shorthand_takes_a_layer_from_topk():
    model = interp.load_model(tiny_hf("gpt2"), attn="flash")
    _, cache = model.run_with_cache(_ids(p=7))
    layer = torch.tensor([0.2, 0.9]).topk(1).indices[0]  # a 0-dim LongTensor, as TransformerLens's demos index
    assert torch.equal(cache["attn", layer], cache.pattern(1)) and torch.equal(cache["z", layer], cache["z", 1])
    with pytest.raises(KeyError, match="shorthand"):
        cache["z", torch.tensor(1.0)]


# -- model.cfg with TransformerLens's field names (issue 53) ----------------------------------------------------
@pytest.mark.parametrize("name, d_mlp, act_fn, norm, positions", [
    ("llama", 37, "silu", "RMS", "rotary"),  # TransformerLens: act_fn=hidden_act, "RMSPre" when folded, "rotary"
    ("gpt2", 128, "gelu_new", "LN", "standard"),  # 4 * d_model when n_inner is None, "LNPre" when folded
])
def test_cfg_has_transformerlens_fields(name, d_mlp, act_fn, norm, positions, request):
    model = request.getfixturevalue(name)
    cfg = model.cfg
    assert (cfg.d_mlp, cfg.act_fn, cfg.positional_embedding_type) == (d_mlp, act_fn, positions)
    assert cfg.d_mlp == model.hf.config.to_dict().get("intermediate_size", 4 * cfg.d_model)
    assert cfg.normalization_type == norm + "Pre"  # from_pretrained's fold_ln=True, as TransformerLens's default
    copied = copy.deepcopy(model)
    copied.fold_ln = False
    assert copied.cfg.normalization_type == norm and model.cfg.normalization_type == norm + "Pre"
    assert cfg.device == model.device and cfg.dtype == model.dtype
    assert cfg.n_key_value_heads == model.hf.config.num_key_value_heads if name == "llama" else cfg.n_heads
    assert (cfg.d_vocab, cfg.n_ctx, cfg.d_head) == (99, 64, 8)
    assert cfg.attn_only is False and cfg.default_prepend_bos is False  # tiny models have no tokenizer
    import pickle

    assert pickle.loads(pickle.dumps(cfg)) == cfg  # the model it reads settings from is not pickled with it
    with pytest.raises(AttributeError, match="setting of a loaded model"):
        pickle.loads(pickle.dumps(cfg)).device


def test_cfg_default_prepend_bos_is_what_to_tokens_does(smollm2):
    cfg = smollm2.cfg
    bos = smollm2.tokenizer.bos_token_id
    assert cfg.default_prepend_bos == (smollm2.to_tokens("Hi")[0, 0].item() == bos)
    assert cfg.tokenizer_name == smollm2.tokenizer.name_or_path and cfg.n_layers == 30 and cfg.d_mlp == 1536


def test_cfg_refuses_a_field_a_model_has_not(minilm):
    cfg = minilm.cfg
    assert cfg.positional_embedding_type == "standard" and cfg.normalization_type in ("LN", "LNPre")  # BERT: post-norm
    import dataclasses

    bare = dataclasses.replace(cfg, mlp_width=None, norm_kind=None)
    with pytest.raises(AttributeError, match="d_mlp means nothing"):
        bare.d_mlp
    with pytest.raises(AttributeError, match="normalization_type means nothing"):
        bare.normalization_type


# -- modules by TransformerLens's names and its switches (issue 53) ----------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_embed_unembed_ln_final_blocks_by_transformerlens_names(name, request):
    model = request.getfixturevalue(name)
    ids = _ids()
    assert torch.equal(model.embed.W_E, model.W_E) and torch.equal(model.unembed.W_U, model.W_U)
    assert torch.equal(model.embed(ids), model.hf.get_input_embeddings()(ids))
    assert torch.equal(model.blocks[1].attn.W_Q, model.W_Q[1])
    logits, cache = model.run_with_cache(ids, return_type="logits")
    final = cache["resid_post", model.cfg.n_layers - 1]
    for fold in (True, False):  # folded: ln_final only rescales and W_U holds the weight, as TransformerLens's LNPre
        model.fold_ln = fold
        torch.testing.assert_close(model.unembed(model.ln_final(final)), logits, atol=ATOL, rtol=ATOL)
    model.fold_ln = True
    assert model.ln_final.weight is model.final_norm().weight
    named = dict(model.tl_named_parameters())
    assert torch.equal(named["blocks.1.attn.W_O"], model.W_O[1]) and torch.equal(named["unembed.W_U"], model.W_U)
    assert ("pos_embed.W_pos" in named) == (name == "gpt2")
    assert len([k for k in named if k.startswith("blocks.")]) == 8 * model.cfg.n_layers


def test_set_use_attn_result_puts_hook_result_in_the_default_cache(gpt2):
    ids = _ids()
    _, cache = gpt2.run_with_cache(ids)
    assert "blocks.0.attn.hook_result" not in cache.keys()
    copied = copy.deepcopy(gpt2)
    copied.set_use_attn_result(True)
    _, cache = copied.run_with_cache(ids)
    result = cache["blocks.0.attn.hook_result"]
    b_o = copied.b_O[0]
    torch.testing.assert_close(result.sum(2) + b_o, cache["attn_out", 0], atol=ATOL, rtol=ATOL)
    assert copy.deepcopy(copied).use_attn_result is True and "use_attn_result" not in vars(gpt2)
    copied.set_use_hook_mlp_in(True)  # a no-op: hook_resid_mid is the MLP's input
    with pytest.raises(NotImplementedError, match="hook_q_input"):
        copied.set_use_split_qkv_input(True)
    copied.set_use_split_qkv_input(False)


# -- norm scale hooks in the cache, get_act_name's norm names (issue 53) ----------------------------------------
def test_get_act_name_knows_transformerlens_norm_names():
    # TransformerLens 4.3's docstring examples
    assert utils.get_act_name("normalized", 27, "ln2") == "blocks.27.ln2.hook_normalized"
    assert utils.get_act_name("scale4ln1") == "blocks.4.ln1.hook_scale"
    assert utils.get_act_name("scale") == "ln_final.hook_scale"
    with pytest.raises(ValueError, match="ln1' or 'ln2"):
        utils.get_act_name("scale", 3)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_cache_norm_scale_and_normalized_rebuild_the_norms_output(name, request):
    model = request.getfixturevalue(name)
    ids = _ids()
    _, cache = model.run_with_cache(ids)
    last = model.cfg.n_layers - 1
    for key, norm, x in [("ln_final", model.final_norm(), cache["resid_post", last]),
                         ("blocks.1.ln1", model.block_norm(1), cache["resid_pre", 1]),
                         ("blocks.0.ln2", model.block_norm(0, mlp_input=True), cache["resid_mid", 0])]:
        scale, normalized = cache[f"{key}.hook_scale"], cache[f"{key}.hook_normalized"]
        assert scale.shape == (*x.shape[:-1], 1) and f"{key}.hook_scale" in cache
        w = norm.weight  # HF's norm output is normalized * w (+ b): neither llama nor gpt2 shifts its weight
        b = norm.bias if getattr(norm, "bias", None) is not None else 0
        with torch.no_grad():
            torch.testing.assert_close(normalized * w + b, norm(x), atol=ATOL, rtol=ATOL)
    assert torch.equal(cache[utils.get_act_name("scale")], cache["ln_final.hook_scale"])
    assert torch.equal(cache["scale", 1, "ln1"], cache["blocks.1.ln1.hook_scale"])
    assert "blocks.0.ln3.hook_scale" not in cache


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_stop_at_layer_returns_the_stream_entering_that_block(name, request):
    model = request.getfixturevalue(name)
    ids = _ids()
    logits, cache = model.run_with_cache(ids, return_type="logits")
    fired = []
    with model.hooks([(lambda n: n.endswith("hook_z"), lambda z, hook: fired.append(hook.name))]):
        out = model(ids, stop_at_layer=1)
    assert torch.equal(out, cache["resid_pre", 1]) and fired == ["blocks.0.attn.hook_z"]  # block 1 never ran
    assert torch.equal(model(ids, stop_at_layer=-1), cache["resid_pre", 1])  # as TransformerLens: from the end
    assert torch.equal(model(ids, stop_at_layer=0), cache["resid_pre", 0])
    assert torch.equal(model(ids, stop_at_layer=2), cache["resid_post", 1])  # n_layers: all blocks, no final norm
    with pytest.raises(ValueError, match="stop_at_layer takes a layer in"):
        model(ids, stop_at_layer=3)
    torch.testing.assert_close(model(ids, return_type="logits"), logits)  # the model runs whole again
    early, part = model.run_with_cache(ids, stop_at_layer=1)  # the cache holds what ran
    assert torch.equal(early, cache["resid_pre", 1]) and torch.equal(part["resid_pre", 1], early)
    assert "blocks.0.attn.hook_z" in part and "blocks.1.attn.hook_z" not in part


# -- BOS as TransformerLens handles it where a user cannot tell (issue 53) --------------------------------------
def test_a_bos_written_in_the_text_stays_and_generate_drops_the_one_it_added(smollm2):
    tok = smollm2.tokenizer
    bos, hi = tok.bos_token_id, tok("Hi")["input_ids"]
    assert smollm2.cfg.default_prepend_bos is False  # SmolLM2's tokenizer adds none
    text = tok.bos_token + "Hi"
    # TransformerLens: prepend_bos=False tokenizes the text as it is, so its BOS stays (interp dropped it before)
    assert smollm2.to_tokens(text, prepend_bos=False)[0].tolist() == [bos, *hi]
    assert smollm2.to_tokens(text, prepend_bos=True)[0].tolist() == [bos, bos, *hi]  # prepended, as TL does
    out = smollm2.generate("Hi", max_new_tokens=2, do_sample=False, prepend_bos=True)
    assert out.startswith("Hi") and not out.startswith(tok.bos_token)  # TL's generate drops the BOS it added
    kept = smollm2.generate(text, max_new_tokens=2, do_sample=False, prepend_bos=False)
    assert kept.startswith(text)  # one the user wrote stays


def test_from_pretrained_warns_when_no_bos_is_prepended():
    with pytest.warns(UserWarning, match="prepend_bos=True"):
        model = HookedTransformer.from_pretrained("smollm2", device="cpu")
    assert model.cfg.default_prepend_bos is False


def test_utils_get_device_is_where_torch_can_run():
    device = utils.get_device()
    assert device.type == ("cuda" if torch.cuda.is_available() else device.type) and torch.zeros(1, device=device).device.type == device.type


# -- what TransformerLens 4's demos call (issue 53, run_tl_demos) ------------------------------------------------
def test_get_act_name_in_and_out_are_transformerlens_4s_block_hooks():
    # TransformerLens 4.3: get_act_name("in", l) is "blocks.{l}.hook_in", its BlockBridge's alias of hook_resid_pre
    assert utils.get_act_name("in", 3) == "blocks.3.hook_resid_pre" == utils.get_act_name("in3")
    assert utils.get_act_name("out", 0) == "blocks.0.hook_resid_post"


def test_test_prompt_ranks_the_answer_as_the_logits_do(smollm2, capsys):
    ranks = utils.test_prompt("The capital of France is", ["Paris", "London"], smollm2, top_k=3)
    out = capsys.readouterr().out
    logits = smollm2(smollm2.to_tokens("The capital of France is"), return_type="logits")[0, -1]
    assert [w for w, _ in ranks[0]] == [" Paris", " London"]
    for word, rank in ranks[0]:
        tid = smollm2.to_single_token(word)
        assert rank == int((logits > logits[tid]).sum())  # rank 0: the top token
    assert "Ranks of the answer tokens" in out and out.count("Top ") == 3
    multi = utils.test_prompt("The cat", "sat on", smollm2, print_details=False)  # one answer, two tokens
    assert [w for step in multi for w, _ in step] == [" sat", " on"]
    with pytest.raises(TypeError, match="string or a list of strings"):
        utils.test_prompt("a", 3, smollm2)


class _SquareThenAdd(torch.nn.Module):
    def __init__(self, offset):
        super().__init__()
        self.offset = torch.nn.Parameter(torch.tensor(offset))
        self.hook_square = interp.HookPoint()

    def forward(self, x):
        return self.offset + self.hook_square(x * x)


class _TwoLayers(interp.HookedRootModule):
    """Main_Demo's own hooked module, as TransformerLens's HookedRootModule is used there."""

    def __init__(self):
        super().__init__()
        self.layer1, self.layer2 = _SquareThenAdd(3.0), _SquareThenAdd(-4.0)
        self.hook_in, self.hook_mid, self.hook_out = interp.HookPoint(), interp.HookPoint(), interp.HookPoint()
        self.setup()

    def forward(self, x):
        return self.hook_out(self.layer2(self.hook_mid(self.layer1(self.hook_in(x)))))


def test_hooked_root_module_names_its_points_and_runs_with_hooks_and_cache():
    model = _TwoLayers()
    assert set(model.hook_dict) == {"hook_in", "hook_mid", "hook_out", "layer1.hook_square", "layer2.hook_square"}
    out, cache = model.run_with_cache(torch.tensor(5.0))
    assert out.item() == (5.0 ** 2 + 3) ** 2 - 4  # 780
    assert {k: cache[k].item() for k in cache} == {"hook_in": 5.0, "layer1.hook_square": 25.0, "hook_mid": 28.0,
                                                   "layer2.hook_square": 784.0, "hook_out": 780.0}
    zeroed = model.run_with_hooks(torch.tensor(5.0), fwd_hooks=[("layer2.hook_square", lambda t, hook: torch.zeros_like(t))])
    assert zeroed.item() == -4.0 and not model.hook_dict["layer2.hook_square"].fns  # removed after the call
    model.add_hook("hook_mid", lambda t, hook: t * 0, is_permanent=True)
    model.add_hook("hook_in", lambda t, hook: t + 1)
    model.reset_hooks()  # the permanent one stays
    assert model(torch.tensor(5.0)).item() == -4.0 + 0.0 and model.hook_dict["hook_mid"].fns
    model.reset_hooks(including_permanent=True)
    assert model(torch.tensor(5.0)).item() == 780.0
    with pytest.raises(RuntimeError, match="setup"):
        type("NoSetup", (interp.HookedRootModule,), {"forward": lambda self, x: x})().run_with_hooks(torch.ones(1))


def _said(fn) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if "hook_rot_q" in str(w.message)]


def test_rotary_hook_q_k_warn_a_transformerlens_user_once_per_model():
    ids = _ids()
    model = HookedTransformer.from_pretrained(tiny_hf("llama"))  # rotary, GQA
    assert _said(lambda: model.run_with_cache(ids)) == []  # the default capture is not the user's choice
    assert _said(lambda: model.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_v", lambda t, hook: None)])) == []
    first = _said(lambda: model.run_with_hooks(ids, fwd_hooks=[(utils.get_act_name("q", 1), lambda t, hook: None)]))
    assert len(first) == 1 and "blocks.1.attn.hook_q" in first[0] and "before rotary" in first[0]
    _, cache = model.run_with_cache(ids)
    assert _said(lambda: cache["k", 0]) == [] and _said(lambda: model.add_hook("blocks.0.attn.hook_k", lambda t, hook: None)) == []
    model.reset_hooks()
    other = HookedTransformer.from_pretrained(tiny_hf("llama"))
    _, cache = other.run_with_cache(ids)
    assert len(_said(lambda: cache["k", 0])) == 1  # a new model says it again, also on a read from the cache
    assert len(_said(lambda: HookedTransformer.from_pretrained(tiny_hf("llama")).run_with_cache(
        ids, names_filter=lambda n: n.endswith("hook_q")))) == 1  # a filter the user wrote that picks hook_q


def test_no_rotary_warning_where_hook_q_k_are_transformerlens_s():
    ids = _ids()
    gpt2 = HookedTransformer.from_pretrained(tiny_hf("gpt2"))  # learned positions: hook_q is TransformerLens's
    assert _said(lambda: gpt2.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_q", lambda t, hook: None)])) == []
    plain = interp.load_model(tiny_hf("llama"))  # not loaded as a TransformerLens user: interp's docs say it
    assert _said(lambda: plain.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_q", lambda t, hook: None)])) == []


# -- TransformerLens's config names on an encoder-decoder model (issue 53) ------------------------------------------
def _t5(decoder_layers=2):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=32, d_kv=8, num_heads=4, num_layers=2,
                                               num_decoder_layers=decoder_layers, d_ff=64, decoder_start_token_id=0,
                                               relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1)).eval()


def test_seq2seq_config_has_transformerlens_fields_where_they_mean_one_thing():
    from transformers import BartConfig, BartForConditionalGeneration

    model = HookedTransformer.from_pretrained(_t5(), device="cpu")
    cfg = model.cfg
    # TransformerLens 4.3's T5 config: d_model, d_head=d_kv, n_heads=num_heads, d_mlp=d_ff, d_vocab, n_layers=num_layers,
    # act_fn=feed_forward_proj, positional_embedding_type "relative_positional_bias"
    assert (cfg.d_model, cfg.d_head, cfg.n_heads, cfg.d_mlp, cfg.d_vocab, cfg.n_layers) == (32, 8, 4, 64, 100, 2)
    assert cfg.act_fn == "relu" and cfg.positional_embedding_type == "relative_positional_bias"
    assert cfg.normalization_type == "RMS"  # T5's norm does not centre; never "RMSPre": no stacked W_* to fold into
    assert cfg.n_key_value_heads == 4 and cfg.n_ctx is None  # relative positions: no position limit
    assert cfg.device == model.device and cfg.dtype == torch.float32 and cfg.attn_only is False
    bart = interp.load_model(BartForConditionalGeneration(BartConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)).eval())
    assert bart.cfg.normalization_type == "LN" and bart.cfg.positional_embedding_type == "standard"
    assert bart.cfg.n_ctx == 64 and bart.cfg.act_fn == "gelu"
    uneven = interp.load_model(_t5(decoder_layers=3)).cfg
    with pytest.raises(AttributeError, match="n_encoder_layers and cfg.n_decoder_layers"):
        uneven.n_layers
    assert (uneven.n_encoder_layers, uneven.n_decoder_layers) == (2, 3)
    with pytest.raises(ValueError, match="one stack of blocks"):
        model(torch.ones(1, 4, dtype=torch.long), stop_at_layer=1, decoder_input_ids=torch.zeros(1, 2, dtype=torch.long))


def test_hook_point_add_hook_adds_through_its_model_as_transformerlens():
    model = interp.load_model(tiny_hf("llama"))
    ids = _ids()
    clean = model(ids, return_type="logits")
    point = model.blocks[1].attn.hook_z
    point.add_hook(lambda z, hook: torch.zeros_like(z))  # Exploratory_Analysis_Demo's ablation, on the point
    ablated = model(ids, return_type="logits")
    assert not torch.allclose(ablated, clean) and point.fns
    with model.hooks([("blocks.1.attn.hook_z", lambda z, hook: None)]):
        assert len(point.fns) == 2
    point.add_hook(lambda z, hook: None, is_permanent=True)
    point.remove_hooks()  # the permanent one stays, as TransformerLens's
    assert len(point.fns) == 1 and torch.equal(model(ids, return_type="logits"), clean)
    point.remove_hooks(including_permanent=True)
    assert point.fns == []
    with pytest.raises(TypeError, match="belongs to none"):
        interp.HookPoint("loose").add_hook(lambda t, hook: None)
    root = _TwoLayers()
    root.layer2.hook_square.add_hook(lambda t, hook: torch.zeros_like(t))
    assert root(torch.tensor(5.0)).item() == -4.0
    root.layer2.hook_square.remove_hooks()
    assert root(torch.tensor(5.0)).item() == 780.0
