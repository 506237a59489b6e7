"""Issue 22, the silent wrong results: each test here failed before its fix."""

from __future__ import annotations

import pytest
import torch

import interp
from analyses import ablate_heads, ablation_scan, activation_patching
from tests.tiny import tiny_model

HEADS = [(1, 0), (1, 1), (3, 0)]  # the first group starts at layer 1: blocks before it are replayed


@pytest.fixture(scope="module")
def llama4():
    return interp.load_model(tiny_model("llama", num_hidden_layers=4))


def _ids(seed=1):
    return torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(seed))


def _metric(out, batch):
    return float(out.logits[:, -1].float().logsumexp(-1).mean())


def _steering(model):
    return torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(2)) * 3


def _direct_ablation(model, ids):
    values = []
    for layer, head in HEADS:
        with ablate_heads(model, [(layer, head)]), torch.no_grad():
            values.append(_metric(model(ids), None))
    return values


# -- 2: a scan's prefix replay must not apply a hook of the user's twice ------------------------------------------
def test_scan_equals_direct_ablation_under_a_steering_hook_on_resid_post(llama4):
    steer, ids = _steering(llama4), _ids()
    with llama4.hooks([("blocks.0.hook_resid_post", lambda x, hook: x + steer)]):
        scan = ablation_scan(llama4, ids, _metric, heads=HEADS)
        direct = _direct_ablation(llama4, ids)
    assert scan["metric"].tolist() == pytest.approx(direct, abs=1e-5)  # before the fix: off by 0.29


def test_scan_equals_direct_ablation_under_a_plain_torch_hook_on_a_block(llama4):
    steer, ids = _steering(llama4), _ids()
    handle = llama4.hf.model.layers[0].register_forward_hook(
        lambda m, i, o: (o[0] + steer, *o[1:]) if isinstance(o, tuple) else o + steer)
    try:
        scan = ablation_scan(llama4, ids, _metric, heads=HEADS)
        direct = _direct_ablation(llama4, ids)
    finally:
        handle.remove()
    assert scan["metric"].tolist() == pytest.approx(direct, abs=1e-5)
    assert not llama4.hf.model.layers[0]._forward_hooks  # the user's hook table is theirs again, and empty now


def test_activation_patching_equals_direct_patching_under_a_steering_hook(llama4):
    steer, clean, corrupted = _steering(llama4), _ids(1), _ids(2)
    with llama4.hooks([("blocks.0.hook_resid_post", lambda x, hook: x + steer)]):
        patched = activation_patching(llama4, clean, corrupted, _metric, heads=HEADS)
        _, cache = llama4.run_with_cache(clean, names=[f"blocks.{l}.attn.hook_z" for l in (1, 3)])
        direct = []
        for layer, head in HEADS:
            def patch(z, hook, head=head, layer=layer):
                z = z.clone()
                z[:, :, head] = cache["z", layer][:, :, head]
                return z
            with llama4.hooks([(f"blocks.{layer}.attn.hook_z", patch)]), torch.no_grad():
                direct.append(_metric(llama4(corrupted), None))
    assert patched["metric"].tolist() == pytest.approx(direct, abs=1e-5)


# -- 3: our attention must be the one that runs ------------------------------------------------------------------
def test_a_study_refuses_an_attention_switched_behind_the_wrapper():
    model = interp.load_model(tiny_model("llama", num_hidden_layers=2))
    ids = _ids()
    model.hf.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match=r"set_attn\('flash'\)"):
        ablation_scan(model, ids, _metric)  # before the fix: every delta 0.0
    with pytest.raises(RuntimeError, match="switched behind the wrapper"):
        model.run_with_cache(ids)  # before the fix: a cache without q, k or z
    model.set_attn("flash")
    _, cache = model.run_with_cache(ids)
    assert "blocks.0.attn.hook_z" in cache and (ablation_scan(model, ids, _metric)["delta"] != 0).any()


# -- 4: a mask of 2s is a mask of 1s, as HF reads it ---------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_any_nonzero_mask_value_attends_as_in_hf(attn):
    model = interp.load_model(tiny_model("llama", num_hidden_layers=2), attn=attn)
    ids = _ids()[:, :5]
    ones = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        want = model(ids, ones).logits
        for mask in (ones * 2, ones.bool(), ones.float() * 0.5):
            got = model(ids, mask).logits  # before the fix: 4.39 off with 2s (position ids cumsum(mask) - 1)
            assert torch.equal(got[ones.bool()], want[ones.bool()]), mask
        from analyses import detect_heads  # a study's batch goes the same way
        a = detect_heads(model, prompts={"input_ids": ids, "attention_mask": ones}, n_bootstrap=10)
        b = detect_heads(model, prompts={"input_ids": ids, "attention_mask": ones * 2}, n_bootstrap=10)
    assert a.drop(columns=["label", "labels"]).equals(b.drop(columns=["label", "labels"]))


# -- 1: cross-attention with a source batch of 1 and a target batch of 3, both paths -----------------------------
@pytest.mark.parametrize("family", ["bart", "t5"])
@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_cross_attention_batch_sizes_broadcast_as_hf_or_fail_clearly(family, attn):
    import copy

    from interp.structure.probe import set_attention_key
    from tests.tiny import model_class

    hf = tiny_model(family, cls=model_class(family, seq2seq=True))
    ref = copy.deepcopy(hf)
    set_attention_key(ref, "eager")
    model = interp.load_model(hf, attn=attn)
    g = torch.Generator().manual_seed(0)
    src1, tgt3 = torch.randint(4, 90, (1, 9), generator=g), torch.randint(4, 90, (3, 7), generator=g)
    with torch.no_grad():
        want = ref(input_ids=src1, decoder_input_ids=tgt3, use_cache=False).logits
        got = model(src1, decoder_input_ids=tgt3).logits  # flash before the fix: NaN, different on each call
        again = model(src1, decoder_input_ids=tgt3).logits
    assert torch.equal(got, again)
    assert (got - want).abs().max() <= (0 if attn == "eager" else 1e-5 * want.abs().max())
    src3, tgt2 = torch.randint(4, 90, (3, 9), generator=g), torch.randint(4, 90, (2, 7), generator=g)
    with pytest.raises(ValueError, match="batch sizes that do not broadcast: query 2, key 3"), torch.no_grad():
        model(src3, decoder_input_ids=tgt2)  # flash before the fix: a (2, 7, V) tensor and no error


# -- 5: no silent empty table ---------------------------------------------------------------------------------------
def test_patching_refuses_heads_the_model_or_the_patched_activation_does_not_have():
    from analyses import path_patching

    model = interp.load_model(tiny_model("llama", num_hidden_layers=2))  # 4 query heads on 2 key/value heads
    clean, corrupted = _ids(1), _ids(2)
    for what in ("k", "v"):
        with pytest.raises(ValueError, match="Layer 5 is out of range"):
            activation_patching(model, clean, corrupted, _metric, what=what, heads=[(5, 0)])
        with pytest.raises(ValueError, match="Key/value head 3 is out of range.*each serving 2 query heads"):
            activation_patching(model, clean, corrupted, _metric, what=what, heads=[(0, 3)])
    assert len(activation_patching(model, clean, corrupted, _metric, what="k", heads=[(0, 1)])) == 1
    with pytest.raises(ValueError, match="No head sits before the receivers' last layer 0"):
        path_patching(model, clean, corrupted, [(0, 0)], _metric)


def test_cli_path_patching_with_receivers_in_layer_0_exits_2(capsys):
    from analyses.cli import main

    assert main(["patch", "--method", "path", "--receivers", "0.0"]) == 2
    err = capsys.readouterr().err
    assert "No head sits before" in err and len(err.strip().splitlines()) == 1


# -- 13: a pruned model starts without the user's torch hooks -----------------------------------------------------
def test_prune_model_leaves_the_users_torch_hooks_behind():
    from analyses import prune_model

    model = interp.load_model(tiny_model("llama", num_hidden_layers=2))
    calls = []
    handle = model.hf.model.layers[1].register_forward_hook(lambda m, i, o: calls.append(1))
    pre = model.hf.lm_head.register_forward_pre_hook(lambda m, i: calls.append(2))
    try:
        pruned = prune_model(model, [(0, 1)])
        calls.clear()
        with torch.no_grad():
            pruned(_ids())
        assert calls == []  # before the fix: the copied hooks fired on the pruned model
        assert not pruned.hf.model.layers[1]._forward_hooks and not pruned.hf.lm_head._forward_pre_hooks
        with torch.no_grad():
            model(_ids())
        assert calls == [1, 2]  # the user's own model keeps them
    finally:
        handle.remove()
        pre.remove()


# -- more for 2 and 3 (from a second implementation of issue 22, kept as tests) ----------------------------------
def test_path_patching_under_a_steering_hook_equals_no_replay(llama4, monkeypatch):
    from contextlib import nullcontext

    from analyses.causal import engine
    from analyses import path_patching

    steer, clean, corrupted = _steering(llama4), _ids(1), _ids(2)
    with llama4.hooks([("blocks.0.hook_resid_post", lambda x, hook: x + steer)]):
        replayed = path_patching(llama4, clean, corrupted, [(3, 0)], _metric, heads_per_forward=1)
        monkeypatch.setattr(engine.Prefix, "replaying", lambda self, first, copies: nullcontext())  # never replay
        recomputed = path_patching(llama4, clean, corrupted, [(3, 0)], _metric, heads_per_forward=1)
    assert (replayed["metric"] - recomputed["metric"]).abs().max() <= 1e-5


def test_attention_switched_on_one_stack_of_an_encoder_decoder_is_refused():
    from tests.tiny import model_class

    model = interp.load_model(tiny_model("t5", cls=model_class("t5", seq2seq=True)), attn="eager")
    ids = _ids()[:1, :5]
    for switched in (model.hf, model.hf.get_encoder()):
        switched.set_attn_implementation("sdpa")
        with pytest.raises(RuntimeError, match="model.set_attn"):
            model(ids, decoder_input_ids=ids)
        model.set_attn("eager")
        model(ids, decoder_input_ids=ids)


# -- issue 35, 8: load_model(instance, ...) never changes the caller's model --------------------------------------
def _state(hf):
    return ({k: v.clone() for k, v in hf.state_dict().items()}, [m.training for m in hf.modules()],
            [p.requires_grad for p in hf.parameters()], hf.config._attn_implementation)


def _same_state(hf, state):
    tensors, modes, grads, key = state
    now = hf.state_dict()
    return (all(torch.equal(now[k], v) and now[k].dtype == v.dtype and now[k].device == v.device
                for k, v in tensors.items()) and [m.training for m in hf.modules()] == modes
            and [p.requires_grad for p in hf.parameters()] == grads and hf.config._attn_implementation == key
            and not any(hasattr(m, "_hf_hook") for m in hf.modules()))


@pytest.mark.parametrize("kwargs", [dict(dtype=torch.bfloat16), dict(dtype="float16", attn="eager"),
                                    dict(device_map={"": "cpu"}), dict(device="cpu", dtype="float32")])
def test_load_model_leaves_the_instance_as_it_was(kwargs):
    """load_model(instance, dtype=torch.bfloat16) converted the caller's model in place, and a device map
    dispatched it in place; now the wrapper gets a converted copy (or the instance itself where nothing changes) and
    the instance keeps its weights, dtype, device, train mode and, once the wrapper is gone, HF's attention."""
    import gc

    hf = tiny_model("llama").train()
    ids = _ids()
    before = _state(hf)
    model = interp.load_model(hf, **kwargs)
    wanted = interp.model.loading.resolve_dtype(kwargs.get("dtype")) or torch.float32
    assert model.dtype == wanted and model.hf.training
    copied = model.hf is not hf
    assert copied == (wanted != torch.float32 or "device_map" in kwargs)  # a copy only where something changes
    if copied:
        assert _same_state(hf, before)
    del model
    gc.collect()
    assert _same_state(hf, before)  # HF's own attention again: the wrapper is gone
    with torch.no_grad():
        assert torch.equal(hf.eval()(ids).logits, tiny_model("llama")(ids).logits)
