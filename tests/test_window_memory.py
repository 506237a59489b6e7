"""Sliding-window layers on the flash path without the n x n mask: for a prompt without padding or cache, HF's sdpa
builds an n x n mask for every sliding-window layer (4 GiB in fp32 at 32k tokens); our mask function skips it and
``flash_attention`` runs the window by query chunks (``interp.attention.kernels.windowed_attention``). Equal to HF's sdpa and
eager on tiny Gemma 3 (sliding layers around a full one, GQA) and Mistral, with the query/key weights scaled so that
attention is far from uniform; padded batches still take HF's mask; chunked attention is not mistaken for a window.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

import interp
import interp.attention.paths as attention
import interp.attention.masks as masks
from interp.attention.masks import _is_sliding_window

WINDOW = {"gemma3": 9, "mistral": 7}


def _tiny(family: str):
    torch.manual_seed(0)
    if family == "gemma3":
        cfg = Gemma3TextConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=4096,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                               sliding_window=WINDOW[family], pad_token_id=0, bos_token_id=0, eos_token_id=0)
        hf = Gemma3ForCausalLM(cfg)
    else:
        cfg = MistralConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                            sliding_window=WINDOW[family], pad_token_id=0)
        hf = MistralForCausalLM(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ("q_proj" in name or "k_proj" in name) and p.ndim == 2:
                p.mul_(6.0)
    return hf.eval()


def _hf_logits(hf, impl: str, ids, mask=None):
    h = copy.deepcopy(hf)
    h.set_attn_implementation(impl)
    with torch.no_grad():
        return h(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_windowed_layers_skip_the_mask_and_equal_hf(family):
    hf = _tiny(family)
    ids = torch.randint(1, 99, (2, 300), generator=torch.Generator().manual_seed(1))
    model = interp.load_model(copy.deepcopy(hf), attn="flash")
    calls, real = [], attention.windowed_attention
    with mock.patch.object(attention, "windowed_attention", side_effect=lambda *a, **k: calls.append(a[3]) or real(*a, **k)):
        _, cache = model.run_with_cache(ids, names=lambda n: n.endswith("hook_lse"))
    sliding = [l for l, a in enumerate(model.structure.layer_attn) if a.window[0] is not None]
    assert calls == [WINDOW[family] - 1] * len(sliding) and sliding  # every sliding layer, and only those
    got = model(ids).logits
    for impl in ("sdpa", "eager"):
        want = _hf_logits(hf, impl, ids)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), impl
    eager = interp.load_model(copy.deepcopy(hf), attn="eager")
    _, ref = eager.run_with_cache(ids, names=lambda n: n.endswith("hook_attn_scores"))
    for l in sliding:  # (b, h, q) logsumexp of the masked scores, as the mask path gives it
        want = torch.logsumexp(ref[f"blocks.{l}.attn.hook_attn_scores"].float(), -1)
        assert (cache[f"blocks.{l}.attn.hook_lse"] - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_padded_batches_still_take_the_mask(family):
    hf = _tiny(family)
    ids = torch.randint(1, 99, (2, 60), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0  # left padding
    model = interp.load_model(copy.deepcopy(hf), attn="flash")
    with mock.patch.object(attention, "windowed_attention", side_effect=AssertionError("no window path with padding")):
        got = model(ids, mask).logits
    want = _hf_logits(hf, "eager", ids, mask)
    valid = mask.bool()
    assert (got - want)[valid].abs().max() <= 1e-5 * want[valid].abs().max()


def test_only_a_sliding_window_mask_function_is_skipped():
    from transformers.masking_utils import causal_mask_function, chunked_causal_mask_function, sliding_window_causal_mask_function

    assert _is_sliding_window(sliding_window_causal_mask_function(9), 9)
    assert not _is_sliding_window(sliding_window_causal_mask_function(9), 10)
    assert not _is_sliding_window(chunked_causal_mask_function(9, torch.zeros(1, dtype=torch.long)), 9)
    assert not _is_sliding_window(causal_mask_function, 9)
    model = interp.load_model(_tiny("gemma3"), attn="flash")
    window = dict(mask_function=sliding_window_causal_mask_function(9), local_size=9)
    assert masks._fused_mask(1, 40, 40, config=model.hf.config, **window) is None
    built = masks._fused_mask(1, 40, 40, config=model.hf.config, attention_mask=torch.tensor([[0] * 3 + [1] * 37]).bool(),
                              **window)
    assert built is not None and built.shape[-2:] == (40, 40)  # padding: HF's mask, as before
    # a config no wrapper vouches for (its attention modules may not know their window): the mask is built
    bare = copy.deepcopy(model.hf.config)
    assert masks._fused_mask(1, 40, 40, config=bare, **window).shape[-2:] == (40, 40)
    assert masks._fused_mask(1, 40, 40, **window).shape[-2:] == (40, 40)


def test_a_bare_copy_of_the_hf_model_keeps_its_window():
    """A copy of ``model.hf`` carries no hooks (so its modules do not know their window) but keeps our attention
    key: its sliding-window masks are built, and it equals HF."""
    hf = _tiny("mistral")
    model = interp.load_model(copy.deepcopy(hf), attn="flash")
    bare = copy.deepcopy(model.hf)
    ids = torch.randint(1, 99, (1, 120), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), mock.patch.object(attention, "windowed_attention", side_effect=AssertionError("no hooks")):
        got = bare(input_ids=ids).logits
    want = _hf_logits(hf, "eager", ids)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
