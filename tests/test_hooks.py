"""Hook table tests: every name fires once per layer with its documented shape, identity hooks change
nothing, edits equal the same edit by hand, and nothing stays registered after an exception."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import main_output, no_torch_hooks, padded_batch, tiny_hf

import interp
from hooks import HOOK_TABLE, spec_for

FAMILIES = ["gpt2", "llama", "bert"]


def _model(family, attn):
    return interp.load_model(tiny_hf(family), attn=attn)


def _dims(model, ids):
    b, p = ids.shape
    c = model.cfg
    return {"b": b, "p": p, "q": p, "k": p, "h": c.n_heads, "g": c.n_kv_heads, "d": c.d_head, "e": c.d_head_v, "m": c.d_model, "1": 1}


def _expected_shape(spec, dims):
    return tuple(dims[axis.strip()] for axis in spec.shape.strip("()").split(","))


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_name_fires_once_with_documented_shape(family, attn):
    model = _model(family, attn)
    ids, mask = padded_batch(model.cfg.causal)
    names = [n for n in model.hook_names() if not (attn == "flash" and spec_for(n).eager_only)]
    fired: dict[str, list[tuple[int, ...]]] = {}
    with model.hooks([(names, lambda t, hook: fired.setdefault(hook.name, []).append(tuple(t.shape)))]):
        with torch.no_grad():
            model(ids, mask)
    dims = _dims(model, ids)
    assert sorted(fired) == sorted(names)
    for name, shapes in fired.items():
        assert shapes == [_expected_shape(spec_for(name), dims)], name
    # the table covers every layer: per-layer names appear once per layer
    for spec in HOOK_TABLE:
        if spec.per_layer and spec.name(0) in names:
            assert all(spec.name(l) in fired for l in range(model.cfg.n_layers))


@pytest.mark.parametrize("family", FAMILIES)
def test_hook_layer_attribute(family):
    model = _model(family, "eager")
    seen = []
    model.run_with_hooks(torch.arange(1, 6), fwd_hooks=[(lambda n: n.endswith("hook_z"), lambda t, h: seen.append((h.name, h.layer)))])
    assert seen == [(f"blocks.{l}.attn.hook_z", l) for l in range(model.cfg.n_layers)]


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", FAMILIES)
def test_identity_hooks_leave_outputs_bit_identical(family, attn):
    model = _model(family, attn)
    ids, mask = padded_batch(model.cfg.causal)
    with torch.no_grad():
        clean = main_output(model(ids, mask))
        names = [n for n in model.hook_names() if not (attn == "flash" and spec_for(n).eager_only)]
        hooked = main_output(model.run_with_hooks(ids, mask, fwd_hooks=[(names, lambda t, hook: t)]))
    assert torch.equal(clean, hooked)


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", FAMILIES)
def test_z_edit_equals_the_same_edit_to_the_output_projection_input(family, attn):
    model = _model(family, attn)
    ids, mask = padded_batch(model.cfg.causal)
    c = model.cfg

    def scale_head(z, hook):
        z = z.clone()
        z[:, :, 1] *= -2.0
        return z

    with torch.no_grad():
        edited = main_output(model.run_with_hooks(ids, mask, fwd_hooks=[("blocks.1.attn.hook_z", scale_head)]))
        o_proj = model._blocks[1].get_submodule(model.structure.o_proj[1])

        def by_hand(module, args):
            z = args[0].reshape(*args[0].shape[:-1], c.n_heads, c.d_head).clone()
            z[:, :, 1] *= -2.0
            return (z.reshape(args[0].shape),)

        handle = o_proj.register_forward_pre_hook(by_hand)
        try:
            expected = main_output(model(ids, mask))
        finally:
            handle.remove()
    assert torch.equal(edited, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_pattern_edit_changes_output_as_computing_it_by_hand(family):
    model = _model(family, "eager")
    ids, mask = padded_batch(model.cfg.causal)
    layer, head = 0, 2
    captured = {}

    def flatten_head(pattern, hook):
        pattern = pattern.clone()
        allowed = pattern[:, head] > 0
        pattern[:, head] = allowed / allowed.sum(-1, keepdim=True)  # uniform over the keys it may see
        captured["pattern"] = pattern
        return pattern

    def keep(t, hook):
        captured[hook.name.rsplit("_", 1)[1]] = t

    with torch.no_grad():
        out = main_output(model.run_with_hooks(ids, mask, fwd_hooks=[
            (f"blocks.{layer}.attn.hook_pattern", flatten_head),
            ([f"blocks.{layer}.attn.hook_v", f"blocks.{layer}.attn.hook_z"], keep),
        ]))
        group = model.cfg.n_heads // model.cfg.n_kv_heads
        v = captured["v"][:, :, head // group]  # (b, k, d)
        z_by_hand = torch.einsum("bqk,bkd->bqd", captured["pattern"][:, head], v)
        assert torch.allclose(captured["z"][:, :, head], z_by_hand, atol=1e-6)
        # the edit reached the output: it differs from the clean run, and equals putting z in by hand
        clean = main_output(model(ids, mask))
        z_full = captured["z"].clone()
        by_hand = main_output(model.run_with_hooks(ids, mask, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", lambda t, h: z_full)]))
    assert not torch.allclose(out, clean, atol=1e-4)
    assert torch.equal(out, by_hand)


@pytest.mark.parametrize("family", FAMILIES)
def test_cache_pattern_from_flash_equals_eager_pattern(family):
    hf = tiny_hf(family)
    model = interp.load_model(hf, attn="flash")
    ids, mask = padded_batch(model.cfg.causal)
    with torch.no_grad():
        _, flash_cache = model.run_with_cache(ids, mask)
        model.set_attn("eager")
        _, eager_cache = model.run_with_cache(ids, mask)
    valid = mask.bool()[:, None, :, None]  # compare real query rows
    for layer in range(model.cfg.n_layers):
        rebuilt = flash_cache.pattern(layer)
        eager = eager_cache["pattern", layer]
        assert (rebuilt - eager).masked_select(valid.expand_as(eager)).abs().max() <= 1e-6
        assert torch.equal(flash_cache.pattern(layer, heads=[3, 1]), rebuilt[:, [3, 1]])


def test_flash_lse_equals_eager_lse_and_rebuilds_weights():
    model = _model("llama", "flash")
    ids, mask = padded_batch(True)
    with torch.no_grad():
        _, flash = model.run_with_cache(ids, mask)
        model.set_attn("eager")
        _, eager = model.run_with_cache(ids, mask)
    valid = mask.bool()[:, None, :]
    for layer in range(model.cfg.n_layers):
        a, b = flash["lse", layer], eager["lse", layer]
        assert (a - b).masked_select(valid.expand_as(a)).abs().max() <= 1e-5
    # one weight from q, k and the lse: exp(scale * q_i . k_j - lse_i)
    q, k, lse = flash["q", 1], flash["k", 1], flash["lse", 1]
    i, j, h = 9, 8, 3
    w = torch.exp(model.attn_scales[1] * q[0, i, h] @ k[0, j, h // 2] - lse[0, h, i])
    assert abs(w - eager["pattern", 1][0, h, i, j]) <= 1e-6


def test_cache_shorthand_stack_and_head_results():
    model = _model("gpt2", "eager")
    ids = torch.arange(1, 9)[None]
    out, cache = model.run_with_cache(ids, names=lambda n: True)
    assert torch.equal(cache["pattern", 1], cache["blocks.1.attn.hook_pattern"])
    assert torch.equal(cache["resid_pre", 0], cache["blocks.0.hook_resid_pre"])
    assert cache.stack("z").shape == (2, 1, 8, 4, 8)
    results, labels = cache.stack_head_results(return_labels=True)  # TransformerLens: labels when asked
    assert results.shape == (8, 1, 8, 32) and labels[:2] == ["L0H0", "L0H1"] and labels[-1] == "L1H3"
    # per-head results sum to the attention output minus the projection's bias
    bias = model._blocks[0].attn.c_proj.bias
    assert torch.allclose(results[:4].sum(0) + bias, cache["attn_out", 0], atol=1e-5)
    # moving keeps names and values
    moved = cache.to("cpu", dtype=torch.float64)
    assert moved["z", 0].dtype == torch.float64 and list(moved) == list(cache)


def test_result_edit_reaches_the_output():
    model = _model("llama", "flash")
    ids = torch.arange(1, 9)[None]

    def drop_head(result, hook):
        result = result.clone()
        result[:, :, 2] = 0
        return result

    def drop_z(z, hook):
        z = z.clone()
        z[:, :, 2] = 0
        return z

    with torch.no_grad():
        a = model.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_result", drop_head)]).logits
        b = model.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_z", drop_z)]).logits
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("name", ["blocks.1.hook_resid_pre", "blocks.0.hook_resid_post"])
def test_patching_the_residual_stream_from_another_input(name):
    """Everything after a full residual patch depends only on the patched stream."""
    model = _model("gpt2", "flash")
    a, b = torch.arange(1, 9)[None], torch.arange(20, 28)[None]
    with torch.no_grad():
        _, cache_b = model.run_with_cache(b, names=[name])
        patched = model.run_with_hooks(a, fwd_hooks=[(name, lambda t, h: cache_b[name])]).logits
        assert torch.equal(patched, model(b).logits)
        assert not torch.allclose(patched, model(a).logits)


def test_resid_mid_is_observe_only_on_pre_ln_models():
    model = _model("gpt2", "eager")
    with pytest.raises(ValueError, match="observe-only"):
        model.run_with_hooks(torch.arange(1, 5), fwd_hooks=[("blocks.0.hook_resid_mid", lambda t, h: t * 2)])
    assert model._registry.active() == [] and no_torch_hooks(model.hf)


def test_pattern_hooks_on_flash_run_that_layer_eager_and_leave_nothing_behind():
    """On flash a hook on hook_pattern/hook_attn_scores runs its layer's eager step for that call (issue 53; the
    numbers: tests/test_transformerlens.py); a flash run's cache rebuilds a pattern on access."""
    model = _model("gpt2", "flash")
    fired = []
    model.run_with_hooks(torch.arange(1, 5), fwd_hooks=[("blocks.0.attn.hook_pattern", lambda t, h: fired.append(t.shape))])
    assert fired == [(1, 4, 4, 4)] and model.attn == "flash"
    _, cache = model.run_with_cache(torch.arange(1, 5), names=["blocks.0.attn.hook_attn_scores"])
    assert list(cache) == ["blocks.0.attn.hook_attn_scores"]
    _, cache = model.run_with_cache(torch.arange(1, 5))
    assert cache["pattern", 0].shape == (1, 4, 4, 4)
    with model.hooks([("blocks.1.attn.hook_pattern", lambda t, h: None)]):
        model.set_attn("flash")  # no longer refused with such a hook on
    assert model._registry.active() == [] and no_torch_hooks(model.hf)


# -- hygiene ---------------------------------------------------------------------------------------------

class Boom(RuntimeError):
    pass


def _raise(t, hook):
    raise Boom(hook.name)


@pytest.mark.parametrize("where", ["blocks.1.attn.hook_z", "blocks.0.hook_resid_pre", "blocks.1.hook_mlp_out",
                                   "blocks.0.attn.hook_result"])
@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_exception_inside_a_hook_leaves_nothing_registered(where, attn):
    model = _model("gpt2", attn)
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        clean = model(ids).logits
        with pytest.raises(Boom):
            model.run_with_hooks(ids, fwd_hooks=[(where, _raise)])
        with pytest.raises(Boom):
            with model.hooks([(where, _raise)]):
                model.run_with_cache(ids)
        with pytest.raises(Boom):
            with model.hooks([("blocks.0.attn.hook_q", lambda t, h: None)]):
                raise Boom("inside the block")
        assert model._registry.active() == []
        assert no_torch_hooks(model.hf)
        assert torch.equal(model(ids).logits, clean)


def test_bad_hook_return_is_a_clear_error_and_cleans_up():
    model = _model("llama", "flash")
    with pytest.raises(ValueError, match=r"must return None or a tensor of shape \(1, 4, 4, 8\)"):
        model.run_with_hooks(torch.arange(1, 5), fwd_hooks=[("blocks.0.attn.hook_q", lambda t, h: t[:, :2])])
    assert model._registry.active() == [] and no_torch_hooks(model.hf)


def test_unknown_hook_name_suggests_close_names():
    model = _model("gpt2", "flash")
    with pytest.raises(ValueError, match=re.escape("Did you mean 'blocks.0.attn.hook_pattern'")):
        model.run_with_hooks(torch.arange(1, 5), fwd_hooks=[("blocks.0.attn.hook_patern", lambda t, h: None)])
    with pytest.raises(ValueError, match=r"Unknown hook name 'blocks\.7\.attn\.hook_z'.*Layers run 0\.\.1"):
        model.run_with_cache(torch.arange(1, 5), names=["blocks.7.attn.hook_z"])
    assert model._registry.active() == []


def test_a_second_wrapper_of_the_same_hf_model_takes_over_and_the_first_refuses_to_run():
    hf = tiny_hf("gpt2")
    first = interp.load_model(hf, attn="flash")
    second = interp.load_model(hf, attn="eager")
    ids = torch.arange(1, 6)
    fired = []
    second.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_z", lambda t, h: fired.append(h.name))])
    assert fired == ["blocks.0.attn.hook_z"]
    with pytest.raises(RuntimeError, match="wrapped again"):
        first(ids)
    with pytest.raises(RuntimeError, match="wrapped again"):
        first.run_with_cache(ids)


def test_the_readme_hook_table_is_the_code_table():
    """The hook reference (notebooks/hooks.md, linked from the README) shows hooks/names.py's table row for row."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "notebooks" / "hooks.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `") and "hook_" in line.split("|")[1]]
    expected = [f"| `{s.template}`{' (opt-in)' if s.opt_in else ''} | {s.shape} | {s.meaning} |" for s in HOOK_TABLE]
    assert rows == expected


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_hook_name_builds_every_name_a_model_has(family):
    """``hooks.hook_name`` (issue 36: studies build names from the table, never by hand) gives exactly the names the
    model's hook points carry: per layer, per attention site (cross-attention included) and per block of a stack."""
    from hooks import attn_site, hook_name

    if family == "t5":
        from test_seq2seq import _tiny

        model = interp.load_model(_tiny("t5"))
    else:
        model = _model(family, "eager")
    names = set(model.hook_names())
    built = set()
    for site in model.cfg.sites:
        kinds = [s.short for s in HOOK_TABLE if s.template.startswith("blocks.{l}.attn.")]
        built |= {hook_name(kind, site) for kind in kinds} | {hook_name(kind, site.name) for kind in kinds}
        stack = None if family == "llama" else site.stack
        out = "cross_attn_out" if site.kind == "cross" else "attn_out"
        built |= {hook_name(kind, site.block, stack) for kind in ("resid_pre", "resid_post", out)}
        if family == "llama":
            assert site.name == attn_site(site.block) and hook_name("z", site.block) == hook_name("z", site)
    optional = {hook_name("result", site) for site in model.cfg.sites}  # opt-in: present only where o_proj is found
    assert built - optional <= names and len(built & names) > 6 * len(model.cfg.sites)
    with pytest.raises(ValueError, match="take a layer number"):
        hook_name("resid_pre", "blocks.0.attn")
    with pytest.raises(ValueError, match="stack='decoder'"):
        hook_name("cross_attn_out", 0)
