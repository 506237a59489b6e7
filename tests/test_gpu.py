"""GPU parity and kernel checks: `python -m pytest -m gpu` on a machine with CUDA.

Skipped without CUDA (reason: these tests compare CUDA kernels; CPU parity lives in test_parity.py).
Tolerances from REFERENCE.md (HF's eager-vs-sdpa test): fp32 1e-6 eager / 1e-5 flash, fp16 5e-3, bf16 1e-2.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY_FAMILIES, hf_kwargs, main_output, padded_batch, tiny_hf
from transformers import AutoModel

import interp
from interp.attention.kernels import cuda_backend, fused_attention
from interp.structure.probe import set_attention_key

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.float32: {"eager": 1e-6, "flash": 1e-5}, torch.float16: 5e-3, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tol(dtype, attn):
    tol = TOL[dtype]
    return tol[attn] if isinstance(tol, dict) else tol


def _pair(hf, attn, dtype):
    hf = hf.to("cuda", dtype)
    ref = copy.deepcopy(hf)
    set_attention_key(ref, "eager" if attn == "eager" else "sdpa")
    return ref, interp.load_model(copy.deepcopy(hf), attn=attn)


def _err(ref, ours, ids, mask):
    kwargs = hf_kwargs(ours, mask)
    with torch.no_grad():
        a = main_output(ref(input_ids=ids, attention_mask=mask, **kwargs)).float()
        b = main_output(ours(ids, mask)).float()
    valid = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    return (a - b)[valid].abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_models_match_hf_on_cuda(family, attn, padding, dtype):
    ref, ours = _pair(tiny_hf(family), attn, dtype)
    ids, mask = padded_batch(ours.cfg.causal)
    ids, mask = ids.cuda(), (mask.cuda() if padding else None)
    assert _err(ref, ours, ids, mask) <= _tol(dtype, attn)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_minilm_matches_hf_on_cuda(minilm_folder, attn, dtype):
    hf = AutoModel.from_pretrained(minilm_folder, local_files_only=True).eval()
    ref, ours = _pair(hf, attn, dtype)
    tokens = interp.load_model(minilm_folder, device="cpu").to_batch(
        ["The cat sat on the mat.", "Attention heads can be read and edited on a GPU.", "Hi"])
    ids, mask = tokens["input_ids"].cuda(), tokens["attention_mask"].cuda()
    assert _err(ref, ours, ids, mask) <= _tol(dtype, attn)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_path_runs_a_fused_kernel_and_returns_the_lse(dtype, causal):
    q, k, v = (torch.randn(2, 8, 1024, 64, device="cuda", dtype=dtype) for _ in range(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out, lse = fused_attention(q, k[:, :2], v[:, :2], None, 0.125, 0.0, causal)
        torch.cuda.synchronize()
    kernels = " ".join(e.name.lower() for e in prof.events())
    assert "flash" in kernels or "fmha" in kernels or "efficient" in kernels, kernels[:500]
    assert "softmax" not in kernels  # no materialized softmax over an n x n matrix
    ref_scores = (q.float() @ k[:, :2].float().repeat_interleave(4, 1).transpose(-1, -2)) * 0.125
    if causal:
        ref_scores = ref_scores.masked_fill(torch.ones(1024, 1024, device="cuda").triu(1).bool(), float("-inf"))
    assert lse.shape == (2, 8, 1024) and lse.dtype == torch.float32
    assert (lse - ref_scores.logsumexp(-1)).abs().max() <= 2e-2
    assert cuda_backend() in ("flash_attn", "torch-flash")


def test_padded_flash_uses_the_efficient_kernel_with_lse():
    model = interp.load_model(tiny_hf("llama").to("cuda", torch.bfloat16), attn="flash")
    ids, mask = padded_batch(True)
    with torch.no_grad():
        _, flash = model.run_with_cache(ids.cuda(), mask.cuda())
        model.set_attn("eager")
        _, eager = model.run_with_cache(ids.cuda(), mask.cuda())
    valid = mask.cuda().bool()[:, None, :]
    for layer in range(model.cfg.n_layers):
        a, b = flash["lse", layer], eager["lse", layer]
        assert (a - b).masked_select(valid.expand_as(a)).abs().max() <= 5e-2
