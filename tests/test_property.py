"""Property test: our attention functions against HF's, over random shapes, head counts and GQA groupings,
padding patterns, causal and bidirectional masks, and both paths (250 examples per run).

Masks are built by the mask functions registered for each key, as a model's forward would build them.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (ALL_MASK_ATTENTION_FUNCTIONS, bidirectional_mask_function,
                                        causal_mask_function, eager_mask, sdpa_mask)
from transformers.models.llama.modeling_llama import eager_attention_forward as hf_eager

from interp.attention import EAGER_KEY, FLASH_KEY, eager_attention, flash_attention


class _Module(torch.nn.Module):
    def __init__(self, groups: int, causal: bool):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = causal
        self.eval()


@st.composite
def cases(draw):
    b = draw(st.integers(1, 3))
    p = draw(st.integers(1, 16))
    g = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    d = draw(st.sampled_from([4, 8, 16]))
    causal = draw(st.booleans())
    padded = draw(st.booleans())
    lengths = [draw(st.integers(1, p)) if padded else p for _ in range(b)]
    path = draw(st.sampled_from(["eager", "flash"]))
    scale = draw(st.sampled_from([None, 0.125, 1.0]))
    seed = draw(st.integers(0, 2**16))
    return b, p, g, group, d, causal, lengths, path, scale, seed


def _padding(lengths, p, causal):
    mask = torch.zeros(len(lengths), p, dtype=torch.bool)
    for i, n in enumerate(lengths):
        if causal:
            mask[i, p - n:] = True  # left padding for causal models
        else:
            mask[i, :n] = True  # right padding for encoders
    return mask


@settings(max_examples=250, deadline=None)
@given(cases())
def test_attention_matches_hf(case):
    b, p, g, group, d, causal, lengths, path, scale, seed = case
    torch.manual_seed(seed)
    h = g * group
    q, k, v = torch.randn(b, h, p, d), torch.randn(b, g, p, d), torch.randn(b, g, p, d)
    pad = _padding(lengths, p, causal)
    no_padding = bool(pad.all())
    module = _Module(group, causal)
    mask_fn = causal_mask_function if causal else bidirectional_mask_function
    common = dict(batch_size=b, q_length=p, kv_length=p, mask_function=mask_fn,
                  attention_mask=None if no_padding else pad, allow_is_bidirectional_skip=not causal)
    scaling = scale if scale is not None else d**-0.5
    if path == "eager":
        ours_mask = ALL_MASK_ATTENTION_FUNCTIONS[EAGER_KEY](**common, dtype=torch.float32)
        ref_mask = eager_mask(**common, dtype=torch.float32)
        ours, pattern = eager_attention(module, q, k, v, ours_mask, scaling=scaling)
        ref, ref_pattern = hf_eager(module, q, k, v, ref_mask, scaling=scaling)
        tol = 1e-6
    else:
        ours_mask = ALL_MASK_ATTENTION_FUNCTIONS[FLASH_KEY](**common, dtype=torch.float32)
        ref_mask = sdpa_mask(**common)
        ours, pattern = flash_attention(module, q, k, v, ours_mask, scaling=scaling)
        ref, ref_pattern = sdpa_attention_forward(module, q, k, v, ref_mask, scaling=scaling)
        tol = 1e-5
        assert pattern is None and ref_pattern is None
    assert ours.shape == ref.shape == (b, p, h, d)
    # compare query rows that see at least one key (fully masked padding rows are undefined)
    rows = pad if causal else torch.ones_like(pad)
    err = (ours - ref)[rows].abs().max().item() if rows.any() else 0.0
    assert err <= tol, f"{path}: {err:.3g} on b={b} p={p} g={g} group={group} d={d} causal={causal} lengths={lengths}"
    if path == "eager":
        assert torch.equal(pattern[rows[:, None, :].expand(b, h, p)], ref_pattern[rows[:, None, :].expand(b, h, p)])
