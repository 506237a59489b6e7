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

from interp.attention.paths import EAGER_KEY, FLASH_KEY, eager_attention, flash_attention


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


@st.composite
def feature_cases(draw):
    b, p = draw(st.integers(1, 2)), draw(st.integers(1, 24))
    g, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    d = draw(st.sampled_from([4, 8, 16]))
    e = draw(st.sampled_from([d, 4, 12]))  # value head size: differs from d in multi-head latent attention
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 8)))
    softcap = draw(st.one_of(st.none(), st.sampled_from([1.0, 5.0])))
    sinks = draw(st.booleans())
    padded = draw(st.booleans())
    lengths = [draw(st.integers(1, p)) if padded else p for _ in range(b)]
    return b, p, g, group, d, e, causal, window, softcap, sinks, lengths, draw(st.integers(0, 2**16))


@settings(max_examples=200, deadline=None)
@given(feature_cases())
def test_softcap_sinks_windows_and_value_sizes_match_a_float64_reference(case):
    """Both paths against the textbook computation in float64: scores = cap(scale q k^T), masked (causal or not,
    a band of ``window`` keys, padding), softmax over the keys and the sink, weights @ v."""
    b, p, g, group, d, e, causal, window, softcap, sinks, lengths, seed = case
    torch.manual_seed(seed)
    h = g * group
    q, k = torch.randn(b, h, p, d) * 3, torch.randn(b, g, p, d) * 3  # large scores, so that the cap bites
    v = torch.randn(b, g, p, e)
    s_aux = torch.randn(h) * 2 if sinks else None
    pad = _padding(lengths, p, causal)
    mask_fn = causal_mask_function if causal else bidirectional_mask_function
    if window is not None:
        from transformers.masking_utils import and_masks, sliding_window_bidirectional_overlay, sliding_window_overlay

        overlay = sliding_window_overlay(window) if causal else sliding_window_bidirectional_overlay(window)
        mask_fn = and_masks(mask_fn, overlay)
    common = dict(batch_size=b, q_length=p, kv_length=p, mask_function=mask_fn, local_size=window,
                  attention_mask=None if bool(pad.all()) else pad, allow_is_bidirectional_skip=not causal)
    scale = d**-0.5

    # the reference, in float64
    allowed = sdpa_mask(**{**common, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})
    allowed = torch.ones(b, 1, p, p, dtype=torch.bool) if allowed is None else allowed.expand(b, 1, p, p)
    k64, v64 = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = q.double() @ k64.transpose(2, 3) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks:
        scores = torch.cat([scores, s_aux.double().view(1, h, 1, 1).expand(b, h, p, 1)], dim=-1)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)[..., :p]
    expected = (weights @ v64).transpose(1, 2)  # (b, q, h, e)

    rows = allowed[:, 0].any(-1)  # query rows that see at least one key (others are undefined padding rows)
    for path, fn, tol in (("eager", eager_attention, 1e-5), ("flash", flash_attention, 1e-5)):
        module = _Module(group, causal)
        key = EAGER_KEY if path == "eager" else FLASH_KEY
        mask = ALL_MASK_ATTENTION_FUNCTIONS[key](**common, dtype=torch.float32)
        out, _ = fn(module, q, k, v, mask, scaling=scale, softcap=softcap, s_aux=s_aux)
        assert out.shape == (b, p, h, e)
        if rows.any():
            err = (out.double() - expected)[rows].abs().max().item()
            assert err <= tol * max(1.0, expected[rows].abs().max().item()), (
                f"{path}: {err:.3g} on b={b} p={p} g={g} group={group} d={d} e={e} causal={causal} "
                f"window={window} softcap={softcap} sinks={sinks} lengths={lengths}")
