"""TransformerLens 4.3's ``transformer_lens.patching`` on interp (``analyses.causal.tl_patching``): each function
against a plain loop of single patched forwards through interp's hooks, on a tiny Llama (GQA: 4 heads on 2
key/value heads, rotary) on the flash path, and a tiny GPT-2 on eager; shapes as TransformerLens documents them."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest
import torch

import interp
from analyses.causal import tl_patching as patching
from interp.utils import get_act_name
from tests.conftest import tiny_hf

ATOL = 1e-5
B, P = 2, 5


@pytest.fixture(scope="module", params=[("llama", "flash"), ("gpt2", "eager")], ids=["llama-flash", "gpt2-eager"])
def setup(request):
    family, attn = request.param
    model = interp.load_model(tiny_hf(family), attn=attn)
    g = torch.Generator().manual_seed(1)
    clean, corrupted = torch.randint(1, 99, (B, P), generator=g), torch.randint(1, 99, (B, P), generator=g)
    _, cache = model.run_with_cache(clean)
    return model, clean, corrupted, cache


def metric(logits):  # every position's logits (a patch at any position moves it directly), summed: the tiny
    return logits[:, :, 3].sum() - logits[:, :, 11].sum()  # models' patches move a mean by less than 1e-4


def _reference(model, corrupted, cache, name: str, shape: list[int], write) -> torch.Tensor:
    """The metric of one plain forward per index, its hook writing the clean slice ``write(act, clean, index)``."""
    out = torch.zeros(shape)
    with torch.no_grad():
        _fill(out, model, corrupted, cache, name, shape, write)
    return out


def _fill(out, model, corrupted, cache, name, shape, write) -> None:
    for index in itertools.product(*map(range, shape)):
        clean = cache[get_act_name(name, index[0])]

        def hook(act, hook, index=index, clean=clean):
            act = act.clone()
            write(act, clean, index)
            return act

        logits = model.run_with_hooks(corrupted, fwd_hooks=[(get_act_name(name, index[0]), hook)]).logits
        out[index] = float(metric(logits))


def _pos(act, clean, i):
    act[:, i[1]] = clean[:, i[1]]


def _pos_head(act, clean, i):
    act[:, i[1], i[2]] = clean[:, i[1], i[2]]


def _head(act, clean, i):
    act[:, :, i[1]] = clean[:, :, i[1]]


def _pattern(act, clean, i):
    act[(slice(None), *i[1:])] = clean[(slice(None), *i[1:])]


# name of the function -> (activation, its shape with L layers, H heads, K key/value heads, P positions, writer)
CASES = {
    "get_act_patch_resid_pre": ("resid_pre", "LP", _pos),
    "get_act_patch_attn_out": ("attn_out", "LP", _pos),
    "get_act_patch_mlp_out": ("mlp_out", "LP", _pos),
    "get_act_patch_attn_head_out_by_pos": ("z", "LPH", _pos_head),
    "get_act_patch_attn_head_q_by_pos": ("q", "LPH", _pos_head),
    "get_act_patch_attn_head_k_by_pos": ("k", "LPK", _pos_head),
    "get_act_patch_attn_head_v_by_pos": ("v", "LPK", _pos_head),
    "get_act_patch_attn_head_pattern_by_pos": ("pattern", "LHP", _pattern),
    "get_act_patch_attn_head_pattern_dest_src_pos": ("pattern", "LHPP", _pattern),
    "get_act_patch_attn_head_out_all_pos": ("z", "LH", _head),
    "get_act_patch_attn_head_q_all_pos": ("q", "LH", _head),
    "get_act_patch_attn_head_k_all_pos": ("k", "LK", _head),
    "get_act_patch_attn_head_v_all_pos": ("v", "LK", _head),
    "get_act_patch_attn_head_pattern_all_pos": ("pattern", "LH", _pattern),
}


def _shape(model, letters: str) -> list[int]:
    cfg = model.cfg
    return [{"L": cfg.n_layers, "H": cfg.n_heads, "K": cfg.n_key_value_heads, "P": P}[c] for c in letters]


@pytest.mark.parametrize("function", list(CASES))
def test_each_function_equals_a_loop_of_single_patched_forwards(setup, function):
    model, _, corrupted, cache = setup
    name, letters, write = CASES[function]
    shape = _shape(model, letters)
    got = getattr(patching, function)(model, corrupted, cache, metric)
    assert list(got.shape) == shape and got.dtype == torch.float32
    want = _reference(model, corrupted, cache, name, shape, write)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    corrupted_value = float(metric(model(corrupted).logits.detach()))
    # some patch moves the metric beyond the tolerance, so the comparison can fail (a tiny random model's k, v and
    assert (want - corrupted_value).abs().max() > 3 * ATOL  # pattern patches move it by 1e-4 or less)


def test_copies_per_forward_do_not_change_the_values(setup):
    model, _, corrupted, cache = setup
    one = patching.get_act_patch_attn_head_out_by_pos(model, corrupted, cache, metric, per_forward=1)
    many = patching.get_act_patch_attn_head_out_by_pos(model, corrupted, cache, metric, per_forward=7)
    torch.testing.assert_close(many, one, atol=ATOL, rtol=0)


EVERY = ["get_act_patch_attn_head_all_pos_every", "get_act_patch_attn_head_by_pos_every", "get_act_patch_block_every"]


@pytest.mark.parametrize("function", [*CASES, *EVERY])
def test_several_indices_per_forward_equal_one_index_per_forward(setup, function):
    """Each function, with several patched copies of the corrupted batch in one forward, gives what one forward per
    index gives (TransformerLens's way) within 1e-6, in fewer forwards."""
    model, _, corrupted, cache = setup
    forwards = []
    handle = model.hf.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        one = getattr(patching, function)(model, corrupted, cache, metric, per_forward=1)
        n_one = len(forwards)
        many = getattr(patching, function)(model, corrupted, cache, metric, per_forward=6)
    finally:
        handle.remove()
    assert many.shape == one.shape and len(forwards) - n_one < n_one
    torch.testing.assert_close(many, one, atol=1e-6, rtol=0)


def test_last_resid_pre_patch_at_every_position_is_the_clean_run(setup):
    model, clean, corrupted, cache = setup
    df = pd.DataFrame({"layer": [0], "pos": [0]})

    def every_pos(act, index, clean_act):
        act[:] = clean_act
        return act

    got = patching.generic_activation_patch(model, corrupted, cache, metric, every_pos, "resid_pre", index_df=df)
    assert got.shape == (1,)
    assert abs(float(got[0]) - float(metric(model(clean).logits.detach()))) < ATOL


def test_the_every_functions_stack_pad_and_transpose_as_transformer_lens(setup):
    model, _, corrupted, cache = setup
    L, H, K = model.cfg.n_layers, model.cfg.n_heads, model.cfg.n_key_value_heads
    every = patching.get_act_patch_attn_head_all_pos_every(model, corrupted, cache, metric)
    assert every.shape == (5, L, H)
    k = patching.get_act_patch_attn_head_k_all_pos(model, corrupted, cache, metric)
    torch.testing.assert_close(every[2, :, :K], k, atol=ATOL, rtol=0)
    assert (every[2, :, K:] == 0).all() and (every[3, :, K:] == 0).all()  # GQA: padded with zeros to n_heads
    torch.testing.assert_close(every[4], patching.get_act_patch_attn_head_pattern_all_pos(model, corrupted, cache,
                                                                                         metric), atol=ATOL, rtol=0)
    by_pos = patching.get_act_patch_attn_head_by_pos_every(model, corrupted, cache, metric)
    assert by_pos.shape == (5, L, P, H)
    pattern = patching.get_act_patch_attn_head_pattern_by_pos(model, corrupted, cache, metric)  # (L, H, P)
    torch.testing.assert_close(by_pos[4], pattern.transpose(1, 2), atol=ATOL, rtol=0)
    blocks = patching.get_act_patch_block_every(model, corrupted, cache, metric)
    assert blocks.shape == (3, L, P)
    torch.testing.assert_close(blocks[2], patching.get_act_patch_mlp_out(model, corrupted, cache, metric),
                               atol=ATOL, rtol=0)


def test_index_df_gives_one_value_per_row_and_returns_it(setup):
    model, _, corrupted, cache = setup
    full = patching.get_act_patch_attn_head_out_by_pos(model, corrupted, cache, metric)
    df = pd.DataFrame({"layer": [1, 0, 1], "pos": [4, 2, 0], "head": [3, 1, 0]})
    got, back = patching.get_act_patch_attn_head_out_by_pos(model, corrupted, cache, metric, index_df=df,
                                                           return_index_df=True)
    assert back is df and got.shape == (3,)
    torch.testing.assert_close(got, torch.stack([full[1, 4, 3], full[0, 2, 1], full[1, 0, 0]]), atol=ATOL, rtol=0)
    values, made = patching.generic_activation_patch(model, corrupted, cache, metric,
                                                     patching.layer_pos_patch_setter, "resid_pre",
                                                     index_axis_names=("layer", "pos"), return_index_df=True)
    assert made.columns.tolist() == ["layer", "pos"] and made.iloc[1].tolist() == [0, 1] and len(made) == values.numel()


def test_no_hook_is_left_and_bad_arguments_get_one_line(setup):
    model, _, corrupted, cache = setup
    before = {name: list(point.fns) for name, point in model.hook_dict.items()}
    patching.get_act_patch_attn_head_pattern_all_pos(model, corrupted, cache, metric)
    assert {name: list(point.fns) for name, point in model.hook_dict.items()} == before
    with pytest.raises(ValueError, match="exactly one"):
        patching.generic_activation_patch(model, corrupted, cache, metric, patching.layer_pos_patch_setter,
                                          "resid_pre")
    with pytest.raises(ValueError, match="index_axis_names takes"):
        patching.generic_activation_patch(model, corrupted, cache, metric, patching.layer_pos_patch_setter,
                                          "resid_pre", index_axis_names=("layer", "token"))
    with pytest.raises(ValueError, match="index of 2 entries"):
        patching.generic_activation_patch(model, corrupted, cache, metric, patching.layer_pos_patch_setter,
                                          "resid_pre", index_axis_names=("layer", "pos", "head"))


def test_an_interrupt_while_the_blocks_are_set_to_replay_leaves_the_model_whole(setup, monkeypatch):
    """Ctrl-C (or run_tl_demos' CPU-time signal) can land while a scan sets the blocks before the patched layer to
    replay the recorded output: afterwards the model runs whole. Before, such a block kept returning the stale
    output, and the next run on other tokens failed in its rotary embedding (the demo's cell 20 after cell 18)."""
    from analyses.causal import engine

    model, _, corrupted, cache = setup
    longer = torch.randint(1, 99, (B, P + 3), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = model(longer).logits

    class Interrupt:  # an interrupt raised while block 0's hook tables are being emptied for the replay
        def __init__(self, *args):
            raise KeyboardInterrupt

    marker = Interrupt.__new__(Interrupt)
    monkeypatch.setattr(engine, "_HOOK_TABLES", (*engine._HOOK_TABLES, "_interp_interrupt"))
    monkeypatch.setattr(model._blocks[0], "_interp_interrupt", marker, raising=False)
    with pytest.raises(KeyboardInterrupt):
        patching.get_act_patch_resid_pre(model, corrupted, cache, metric, per_forward=1)
    assert "forward" not in vars(model._blocks[0]) and model._blocks[0]._interp_interrupt is marker
    with torch.no_grad():
        torch.testing.assert_close(model(longer).logits, before, atol=0, rtol=0)
