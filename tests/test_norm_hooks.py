"""Norms' hook_scale and hook_normalized as hook points (issue 53): TransformerLens's ``blocks.{l}.ln1.hook_scale``,
``ln2``, ``ln_final``, and its ``hook_normalized``. Each fires with the value the cache gives; an edit changes the
forward as recomputing the norm by hand from the HF module does; a failing hook leaves nothing behind."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import main_output, no_torch_hooks, tiny_hf

import interp
from interp import utils
from interp.structure.norms import parallel_mlp_norm
from interp.structure.probe import _is_norm
from test_seq2seq import _tiny as _tiny_seq2seq
from tests.tiny import FAMILIES, tiny_model

ATOL = 1e-5
WHERE = ["blocks.1.ln1", "blocks.0.ln2", "ln_final"]


def _pair(family: str, attn: str):
    """(a reference HF model, our model on an identical copy)."""
    hf = tiny_hf(family) if family in ("llama", "gpt2") else tiny_model(family)
    ref = copy.deepcopy(hf)
    return ref, interp.load_model(hf, attn=attn)


def _ids(seed=0):
    return torch.randint(1, 99, (2, 7), generator=torch.Generator().manual_seed(seed))


def _module_path(model, where: str) -> str:
    """The HF path of the norm ``where`` names, so the same norm is found in the reference copy."""
    norm = {"ln_final": model.final_norm(), "blocks.1.ln1": model.block_norm(1),
            "blocks.0.ln2": model.block_norm(0, mlp_input=True)}[where]
    return next(name for name, m in model.hf.named_modules() if m is norm)


def _by_hand(ref, path: str, scale_factor=1.0, normalized_fn=None):
    """A torch hook on the reference's norm that recomputes it from the module's own parameters: centred x (LayerNorm)
    / (scale * scale_factor), then ``normalized_fn``, then * weight (+ bias)."""
    norm = ref.get_submodule(path)
    layer_norm = isinstance(norm, torch.nn.LayerNorm)
    eps = norm.eps if layer_norm else norm.variance_epsilon

    def hook(module, args, out):
        x = args[0].float()
        x = x - x.mean(-1, keepdim=True) if layer_norm else x
        normalized = x / ((x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * scale_factor)
        normalized = normalized if normalized_fn is None else normalized_fn(normalized)
        return normalized * norm.weight + (norm.bias if layer_norm else 0)

    return norm.register_forward_hook(hook)


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])  # gpt_neox: ln2 of a parallel block
def test_norm_points_exist_and_fire_the_values_the_cache_gives(family, attn):
    _, model = _pair(family, attn)
    names = [f"{w}.hook_{k}" for w in ("blocks.0.ln1", "blocks.1.ln1", "blocks.0.ln2", "blocks.1.ln2", "ln_final")
             for k in ("scale", "normalized")]
    assert set(names) <= set(model.hook_names) and set(names) <= set(model.hook_dict)
    assert set(names) <= set(model.mod_dict)
    ids = _ids()
    seen = {}
    _, captured = model.run_with_cache(ids, names_filter=names)  # captured by the hook points
    logits, default = model.run_with_cache(ids)  # not captured by default (opt-in): built on access
    with model.hooks([(names, lambda t, hook: seen.update({hook.name: t.clone()}))]):
        hooked = model(ids)
    assert torch.equal(hooked.logits, logits.logits)  # observing changes nothing
    b, p = ids.shape
    for name in names:
        assert seen[name].shape == ((b, p, 1) if name.endswith("scale") else (b, p, model.cfg.d_model)), name
        assert torch.equal(seen[name], captured[name]), name
        torch.testing.assert_close(default[name], seen[name], atol=1e-6, rtol=1e-6)
    assert "ln_final.hook_scale" not in default._store  # not captured unless named
    assert torch.equal(captured["scale", 1, "ln1"], captured[utils.get_act_name("scale", 1, "ln1")])


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox"])
def test_a_scale_edit_changes_the_logits_as_recomputing_the_norm_by_hand(family, attn, where):
    ref, model = _pair(family, attn)
    ids = _ids(1)
    with torch.no_grad():
        clean = model(ids).logits
        edited = model.run_with_hooks(ids, fwd_hooks=[(f"{where}.hook_scale", lambda s, hook: s * 2)]).logits
        handle = _by_hand(ref, _module_path(model, where), scale_factor=2.0)
        expected = ref(ids).logits
        handle.remove()
    assert (edited - clean).abs().max() > 1e-2  # the edit reached the logits
    torch.testing.assert_close(edited, expected, atol=ATOL, rtol=ATOL)
    assert no_torch_hooks(model.hf.get_submodule(_module_path(model, where)))  # detached after the run


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_normalized_edit_and_a_scale_edit_together_compose_as_by_hand(family, attn):
    ref, model = _pair(family, attn)
    ids = _ids(2)

    def zero_first(t):
        t = t.clone()
        t[..., 0] = 0
        return t

    hooks = [("blocks.1.ln1.hook_scale", lambda s, hook: s * 0.5),
             ("blocks.1.ln1.hook_normalized", lambda n, hook: zero_first(n))]
    with torch.no_grad():
        edited = model.run_with_hooks(ids, fwd_hooks=hooks).logits
        handle = _by_hand(ref, _module_path(model, "blocks.1.ln1"), 0.5, zero_first)
        expected = ref(ids).logits
        handle.remove()
    torch.testing.assert_close(edited, expected, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_transformerlens_freezing_trick_through_model_blocks(family):
    """TransformerLens's recipe: a hook on ``model.blocks[l].ln1.hook_scale`` (and ``ln_final``'s) that returns
    the clean run's cached scale; on the clean input that changes nothing, on another input the frozen scale is
    the one the norm divides by."""
    _, model = _pair(family, "flash")
    clean_ids, other_ids = _ids(3), _ids(4)
    clean, cache = model.run_with_cache(clean_ids)
    points = [model.blocks[l].ln1.hook_scale for l in range(model.cfg.n_layers)]
    points += [model.blocks[l].ln2.hook_scale for l in range(model.cfg.n_layers)] + [model.ln_final.hook_scale]
    assert all(isinstance(p, interp.HookPoint) for p in points) and points[0].name == "blocks.0.ln1.hook_scale"

    def freeze(scale, hook):
        return cache[hook.name]

    for point in points:
        point.add_hook(freeze)
    try:
        with torch.no_grad():
            torch.testing.assert_close(model(clean_ids).logits, clean.logits, atol=1e-6, rtol=1e-6)
            _, frozen = model.run_with_cache(other_ids, names_filter=lambda n: n.endswith("hook_scale"))
    finally:
        model.reset_hooks()
    for point in points:
        assert torch.equal(frozen[point.name], cache[point.name])
    _, free = model.run_with_cache(other_ids)
    assert not torch.allclose(free["ln_final.hook_scale"], cache["ln_final.hook_scale"])
    assert no_torch_hooks(model.hf)


def test_a_hook_that_raises_leaves_the_models_hooks_as_they_were():
    _, model = _pair("llama", "eager")
    ids = _ids()
    kept = model.add_hook("blocks.0.ln1.hook_scale", lambda s, hook: None, is_permanent=True)
    before = {name: list(p.fns) for name, p in model.hook_dict.items()}
    norm = model.block_norm(0)
    n_torch = len(norm._forward_hooks)

    def boom(t, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.run_with_hooks(ids, fwd_hooks=[("blocks.0.ln1.hook_normalized", boom)])
    with pytest.raises(RuntimeError, match="boom"):
        model.run_with_cache(ids, fwd_hooks=[("ln_final.hook_scale", boom)])
    assert {name: list(p.fns) for name, p in model.hook_dict.items()} == before
    assert len(norm._forward_hooks) == n_torch == 1  # the permanent hook's torch hook, once
    assert no_torch_hooks(model.final_norm())
    model.reset_hooks(including_permanent=True)
    assert no_torch_hooks(model.hf) and kept


def test_a_bad_edit_and_a_norm_the_model_lacks_get_one_line():
    _, model = _pair("llama", "eager")
    with pytest.raises(ValueError, match=r"must return None or a tensor of shape \(2, 7, 1\)"):
        model.run_with_hooks(_ids(), fwd_hooks=[("ln_final.hook_scale", lambda s, hook: s[..., 0])])
    assert no_torch_hooks(model.hf)
    bert = interp.load_model(tiny_hf("bert"))
    assert not [n for n in bert.hook_names if ".ln" in n or n.startswith("ln_")]
    with pytest.raises(ValueError, match="post-norm blocks .BERT.") as error:
        bert.run_with_hooks(torch.tensor([[1, 2, 3]]), fwd_hooks=[("blocks.0.ln1.hook_scale", lambda s, hook: s)])
    assert "\n" not in str(error.value)
    bart = interp.load_model(_tiny_seq2seq("bart"))  # post-norm encoder-decoder blocks: none, said in one line
    assert not [n for n in bart.hook_names if ".ln" in n]
    with pytest.raises(ValueError, match=r"post-norm blocks \(BERT, BART\)") as error:
        bart.add_hook("encoder.blocks.0.ln1.hook_scale", lambda s, hook: None)
    assert "\n" not in str(error.value)
    with pytest.raises(KeyError, match="post-norm blocks"):
        bart.run_with_cache(torch.tensor([[3, 4, 5]]), decoder_input_ids=torch.tensor([[3, 4]]))[1][
            "decoder.blocks.0.ln1.hook_scale"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_norm_rebuilt_from_its_hooks_is_the_modules_and_an_edit_reaches_the_output(family):
    """On every family of tests/tiny.py: a hook that returns a copy of the scale makes the norm's output be rebuilt
    from the hooks (normalized * w + b, Gemma's 1 + w included), which equals the module's own output; doubling
    the last norm's scale (ln_final where there is one: Gemma 3's q/k norms and normed attention output make a
    block's attention blind to ln1's scale) changes the output. The names exist exactly where the norm does (no
    ln1/ln2 in post-norm blocks or where no norm reads the stream; ln2 in a parallel block only where its MLP has a
    norm of its own)."""
    model = interp.load_model(copy.deepcopy(tiny_model(family)), attn="flash")
    names = [n for n in model.hook_names if n.endswith((".hook_scale", ".hook_normalized"))]
    kind = model.cfg.block
    for layer, in_norm in enumerate(model.structure.attn_in_norm):  # None: OLMo2 (sublayer outputs normed
        assert (f"blocks.{layer}.ln1.hook_scale" in names) == (kind != "post-norm" and in_norm is not None)  # only),
    for layer, mid in enumerate(model.structure.resid_mid):  # a norm before the MLP (not OLMo2's); parallel: where
        block = model._blocks[layer]                            # the MLP has a norm of its own (GPT-NeoX, not Phi)
        before = kind == "pre-norm" and mid is not None and mid[1] == "input" and _is_norm(block.get_submodule(mid[0]))
        own = kind == "parallel" and parallel_mlp_norm(model.structure, block, layer) not in (
            None, model.in_norm_of(model.cfg.sites[layer]))
        assert (f"blocks.{layer}.ln2.hook_scale" in names) == (before or own), (family, layer)
    assert any(".ln2." in n for n in names) or family not in ("llama", "gpt2", "gpt_neox")
    assert ("ln_final.hook_scale" in names) == (model.structure.final_norm is not None)
    scales = [n for n in names if n.endswith("hook_scale")]
    if not scales:
        return
    ids = torch.randint(4, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        clean = main_output(model(ids))
        rebuilt = main_output(model.run_with_hooks(ids, fwd_hooks=[(scales, lambda s, hook: s.clone())]))
        doubled = main_output(model.run_with_hooks(ids, fwd_hooks=[(scales[-1], lambda s, hook: s * 2)]))
    size = float(clean.abs().max())
    assert float((rebuilt - clean).abs().max()) <= 1e-5 * max(1.0, size), family
    assert float((doubled - clean).abs().max()) > 1e-4 * size, family
    assert no_torch_hooks(model.hf)


# An encoder-decoder model's norms, per stack: T5 (RMSNorm, relative positions) and mBART (LayerNorm), both pre-norm
SEQ2SEQ_WHERE = ["encoder.blocks.1.ln1", "encoder.blocks.0.ln2", "encoder.ln_final", "decoder.blocks.0.ln1",
                 "decoder.blocks.1.ln_cross", "decoder.blocks.0.ln2", "decoder.ln_final"]


def _seq2seq_pair(family: str, attn: str):
    hf = _tiny_seq2seq(family)
    with torch.no_grad():  # BART-like init (std 0.02) leaves the sublayers' outputs too small for a norm edit to show
        for module in hf.modules():
            if isinstance(module, torch.nn.Linear) and family != "t5":
                module.weight.mul_(8)
    ref = copy.deepcopy(hf)
    return ref, interp.load_model(hf, attn=attn)


def _seq2seq_batch(seed=0):
    """A padded source and target, so that the norms' streams hold padded rows too."""
    generator = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(3, 99, (2, 8), generator=generator), torch.randint(3, 99, (2, 5), generator=generator)
    src_mask, tgt_mask = torch.ones_like(src), torch.ones_like(tgt)
    src_mask[1, 5:] = 0
    tgt_mask[1, 3:] = 0
    return dict(input_ids=src, attention_mask=src_mask, decoder_input_ids=tgt, decoder_attention_mask=tgt_mask)


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", ["t5", "mbart"])
def test_encoder_decoder_norm_points_fire_the_values_the_cache_gives(family, attn):
    """Each stack's norms, TransformerLens's names under the stack's prefix (cross-attention's norm is
    ``ln_cross``): they exist for every block, fire with the values a default cache builds on access from the
    streams the norm reads, and observing them changes nothing."""
    _, model = _seq2seq_pair(family, attn)
    wheres = [f"{stack}.blocks.{l}.{norm}" for stack, norms in (("encoder", ("ln1", "ln2")),
                                                                  ("decoder", ("ln1", "ln_cross", "ln2")))
              for l in range(2) for norm in norms] + ["encoder.ln_final", "decoder.ln_final"]
    names = [f"{w}.hook_{k}" for w in wheres for k in ("scale", "normalized")]
    assert sorted(n for n in model.hook_names if ".ln" in n) == sorted(names)
    batch = _seq2seq_batch()
    seen = {}
    _, captured = model.run_with_cache(batch, names_filter=names)
    out, default = model.run_with_cache(batch)
    with model.hooks([(names, lambda t, hook: seen.update({hook.name: t.clone()}))]):
        hooked = model(batch)
    assert torch.equal(hooked.logits, out.logits)
    for name in names:
        stack_len = batch["input_ids" if name.startswith("encoder") else "decoder_input_ids"].shape[1]
        assert seen[name].shape == ((2, stack_len, 1) if name.endswith("scale") else (2, stack_len, 32)), name
        assert torch.equal(seen[name], captured[name]), name
        torch.testing.assert_close(default[name], seen[name], atol=1e-6, rtol=1e-6)
        assert name in default and name not in default._store  # built on access, not kept
    assert "decoder.blocks.0.ln_cross.hook_scale" in model.hook_dict and "decoder.blocks.0.ln3.hook_scale" not in default
    with pytest.raises(NotImplementedError, match="one final norm per stack.*encoder.ln_final, decoder.ln_final"):
        model.ln_final


@pytest.mark.parametrize("where", SEQ2SEQ_WHERE)
@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", ["t5", "mbart"])
def test_encoder_decoder_scale_edit_changes_the_logits_as_recomputing_the_norm_by_hand(family, attn, where):
    ref, model = _seq2seq_pair(family, attn)
    batch = _seq2seq_batch(1)
    norm = model._norms[where][0]
    path = next(name for name, m in model.hf.named_modules() if m is norm)
    with torch.no_grad():
        clean = model(batch).logits
        edited = model.run_with_hooks(batch, fwd_hooks=[(f"{where}.hook_scale", lambda s, hook: s * 2)]).logits
        handle = _by_hand(ref, path, scale_factor=2.0)
        expected = ref(**batch).logits
        handle.remove()
    assert (edited - clean).abs().max() > 1e-2 * clean.abs().max()  # the edit reached the logits
    torch.testing.assert_close(edited, expected, atol=ATOL, rtol=ATOL)
    assert no_torch_hooks(model.hf)


@pytest.mark.parametrize("family", ["t5", "mbart"])
def test_apply_ln_reads_each_stack_through_its_own_norms(family):
    """``accumulated_resid(stack=..., apply_ln=True)`` and ``apply_ln_to_stack``: the stream entering a block, read
    through that block's ln1 (``mlp_input``: ln2), is the norm's ``hook_normalized``; the final stream through the
    stack's ``ln_final`` too. BART (post-norm) refuses in one line."""
    _, model = _seq2seq_pair(family, "flash")
    batch = _seq2seq_batch(2)
    _, cache = model.run_with_cache(batch)
    for stack in ("encoder", "decoder"):
        normed = cache.accumulated_resid(stack=stack, apply_ln=True, layer=1)
        torch.testing.assert_close(normed[-1], cache[f"{stack}.blocks.1.ln1.hook_normalized"], atol=1e-5, rtol=1e-5)
        final = cache.accumulated_resid(stack=stack, apply_ln=True)
        torch.testing.assert_close(final[-1], cache[f"{stack}.ln_final.hook_normalized"], atol=1e-5, rtol=1e-5)
        mid = cache[f"{stack}.blocks.0.hook_resid_pre"] + cache[f"{stack}.blocks.0.hook_attn_out"]
        if stack == "decoder":
            mid = mid + cache["decoder.blocks.0.hook_cross_attn_out"]
        torch.testing.assert_close(cache.apply_ln_to_stack(mid[None], 0, mlp_input=True, stack=stack)[0],
                                   cache[f"{stack}.blocks.0.ln2.hook_normalized"], atol=1e-5, rtol=1e-5)
    bart = interp.load_model(_tiny_seq2seq("bart"))
    _, cache = bart.run_with_cache(batch)
    with pytest.raises(NotImplementedError, match="post-norm") as error:
        cache.accumulated_resid(stack="decoder", layer=1, apply_ln=True)
    assert "\n" not in str(error.value)
