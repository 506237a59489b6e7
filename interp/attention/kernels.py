"""Attention kernels for the flash path: each returns the output and the per-row fp32 logsumexp, and none builds
an n x n matrix per head.

- the fused kernels (PyTorch's CPU flash kernel; on CUDA flash-attn, PyTorch's flash or memory-efficient
  kernel), which return the logsumexp without a gradient: ``_LogSumExp`` gives it one;
- ``tiled_attention``, PyTorch over query tiles, for what the fused kernels cannot do (logit soft-capping):
  one ``(b, h, tile, k)`` block at a time.

Shapes: query ``(b, h, q, d)``, key ``(b, g, k, d)``, value ``(b, g, k, e)`` with ``h`` a multiple of ``g``
(grouped-query attention) and ``e`` the value head size (``e != d`` in multi-head latent attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["repeat_kv", "fused_attention", "tiled_attention", "windowed_attention", "cuda_backend"]

_TILE_ELEMENTS = 1 << 23  # elements of one (b, h, tile, k) score block in tiled_attention (32 MiB in fp32)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(b, g, k, d) -> (b, g * n_rep, k, d), each key/value head serving n_rep query heads."""
    if n_rep == 1:
        return x
    b, g, k, d = x.shape
    return x[:, :, None].expand(b, g, n_rep, k, d).reshape(b, g * n_rep, k, d)


def fused_attention(query, key, value, mask, scale: float, dropout: float = 0.0, causal: bool = False,
                    need_lse: bool = True, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(cap(scale * q k^T) + mask) v and the per-row fp32 logsumexp of the capped, masked scores.

    mask: additive, broadcastable to (b, h, q, k), or None. causal: apply the causal mask (only with mask None).
    softcap: ``cap(s) = tanh(s / softcap) * softcap`` (Gemma 2), computed by ``tiled_attention``, as is a mask
    that needs a gradient (T5's learned position bias folded into it): the fused CPU kernel has none for its mask.
    Returns out: (b, h, q, e) and lse: (b, h, q), or None when not asked for. The logsumexp is differentiable
    with respect to query and key whenever they require grad.
    """
    if softcap is not None or (mask is not None and mask.requires_grad and torch.is_grad_enabled()):
        return tiled_attention(query, key, value, mask, scale, causal, softcap, dropout)
    if dropout > 0.0:
        if need_lse:
            raise NotImplementedError(
                "hook_lse is not available with attention dropout (training mode): the kernels that apply "
                "dropout do not return the logsumexp. Call model.hf.eval() or use the eager path."
            )
        n_rep = query.shape[1] // key.shape[1]
        out = F.scaled_dot_product_attention(query, repeat_kv(key, n_rep), repeat_kv(value, n_rep),
                                             attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scale)
        return out, None
    # The CPU flash op reads the head dimension as if its stride were 1 (F.scaled_dot_product_attention would copy
    # first; we call the op itself): Inkling's keys and values come as (b, g, k, d) with stride 14 along d.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    if mask is not None and mask.stride(-1) != 1:
        mask = mask.contiguous()
    d, e = query.shape[-1], value.shape[-1]
    if e < d:  # the fused kernels want one head size: zero columns of v add zero columns to the output
        v = F.pad(v, (0, d - e))
    elif e > d:  # zero columns of q and k leave every score as it was
        q, k = F.pad(q, (0, e - d)), F.pad(k, (0, e - d))
    if query.device.type == "cuda":
        out, lse = _fused_cuda(q, k, v, mask, scale, causal)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
        lse = lse.float()
    if e < d:
        out = out[..., :e]
    if need_lse and torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        lse = _LogSumExp.apply(query, key, lse, mask, scale, causal)
    return out, lse


def windowed_attention(query, key, value, window: int, scale: float, need_lse: bool = True,
                       softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal sliding-window attention (query ``i`` sees keys ``i - window .. i``; HF's ``sliding_window`` is
    ``window + 1``) for a prompt without padding or cache (``q == k``), by query chunks: each chunk runs the fused
    kernel on its own keys with a small mask, so memory is O(n (chunk + window)), not the n x n mask HF's sdpa
    builds, and the time falls with the window. Same returns as ``fused_attention``."""
    n = query.shape[2]
    chunk = max(256, window + 1)
    # one band for every chunk: query r of a chunk starting at s sees key k = s - window + c iff r <= c <= r + window
    r = torch.arange(chunk, device=query.device)[:, None]
    c = torch.arange(chunk + window, device=query.device)[None]
    band = torch.zeros(chunk, chunk + window, dtype=query.dtype, device=query.device)
    band.masked_fill_((c < r) | (c > r + window), float("-inf"))
    outs, lses = [], []
    for start in range(0, n, chunk):
        stop, first = min(n, start + chunk), max(0, start - window)
        mask = band[: stop - start, first - start + window: stop - start + window]
        out, lse = fused_attention(query[:, :, start:stop], key[:, :, first:stop], value[:, :, first:stop], mask,
                                   scale, 0.0, False, need_lse, softcap)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, 2), (torch.cat(lses, 2) if need_lse else None)


def tiled_attention(query, key, value, mask, scale: float, causal: bool = False, softcap: float | None = None,
                    dropout: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over query tiles in PyTorch: the scores of one tile of queries against the keys it may see,
    ``(b, h, tile, k)``, at a time. The same operations as HF's eager attention (scale, soft-cap, additive mask,
    softmax in fp32) except that the softmax is written ``exp(s - lse)`` so that the logsumexp comes with it.

    Causal rows skip the keys after their tile; fully masked (padding) rows give output 0 and logsumexp 0, as
    the fused kernels do.
    """
    b, h, n_q, _ = query.shape
    n_k = key.shape[2]
    n_rep = h // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    offset = n_k - n_q  # queries are the last n_q positions (a prefill into a cache sees earlier keys)
    tile = max(1, min(n_q, _TILE_ELEMENTS // max(1, b * h * n_k)))
    outs, lses = [], []
    for s in range(0, n_q, tile):
        e = min(n_q, s + tile)
        stop = min(n_k, e + offset) if causal and mask is None else n_k  # keys after the tile's last row
        scores = torch.matmul(query[:, :, s:e], key[:, :, :stop].transpose(2, 3)) * scale  # (b, h, t, stop)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.float()
        if mask is not None:
            scores = scores + mask[..., s:e, :stop].float()
        elif causal:
            rows = torch.arange(s, e, device=scores.device)[:, None] + offset
            scores = scores.masked_fill(torch.arange(stop, device=scores.device)[None] > rows, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # (b, h, t)
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # fully masked rows: weights 0
        weights = torch.exp(scores - lse[..., None])
        if dropout > 0.0:
            weights = F.dropout(weights, p=dropout)
        outs.append(torch.matmul(weights.to(value.dtype), value[:, :, :stop]))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


class _LogSumExp(torch.autograd.Function):
    """The kernels' logsumexp, which they return without a gradient, given its gradient.

    With P the pattern, d lse_i = scale * sum_j P_ij (dq_i . k_j + q_i . dk_j), so for an upstream gradient g:
    dq = scale * g * (P k), an attention whose values are the keys, and dk = scale * P^T (g q), the gradient an
    attention passes to its values. Both run through the fused kernel: no n x n matrix in backward either.
    """

    @staticmethod
    def forward(ctx, query, key, lse, mask, scale, causal):
        ctx.save_for_backward(query, key, mask)
        ctx.scale, ctx.causal = scale, causal
        return lse.clone()

    @staticmethod
    def backward(ctx, grad):  # grad: (b, h, q)
        query, key, mask = ctx.saved_tensors
        query, key = query.detach(), key.detach()
        g = ctx.scale * grad.to(query.dtype)[..., None]  # (b, h, q, 1)
        dq = dk = None
        if ctx.needs_input_grad[0]:
            p_k, _ = fused_attention(query, key, key, mask, ctx.scale, causal=ctx.causal, need_lse=False)
            dq = g * p_k
        if ctx.needs_input_grad[1]:
            with torch.enable_grad():
                values = torch.zeros_like(key, requires_grad=True)
                n_rep = query.shape[1] // key.shape[1]
                out, _ = fused_attention(query, repeat_kv(key, n_rep), repeat_kv(values, n_rep), mask, ctx.scale,
                                         causal=ctx.causal, need_lse=False)
                (dk,) = torch.autograd.grad(out, values, g * query)
        return dq, dk, None, None, None, None


def _fused_cuda(query, key, value, mask, scale, causal):
    """flash-attn when installed, else PyTorch's flash or memory-efficient kernel; both return the LSE."""
    n_rep = query.shape[1] // key.shape[1]
    half = query.dtype in (torch.float16, torch.bfloat16)
    if mask is None and half and query.shape[-1] <= 256:
        flash_attn_func = _flash_attn_func()
        if flash_attn_func is not None:  # native GQA; layout (b, p, h, d)
            out, lse, _ = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                          softmax_scale=scale, causal=causal, return_attn_probs=True)
            return out.transpose(1, 2), lse.float()
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), 0.0, causal, False, scale=scale
        )
        return out, lse.float()
    bias = None
    if mask is not None:
        b, h, q, _ = query.shape
        # A fully masked (padding) query row would give NaN in the memory-efficient kernel, and NaN * 0
        # would then leak into real rows through the padded keys: let such rows attend everywhere
        # instead (as HF's _unmask_unattended did). Their output is never a real token's.
        bias = mask.masked_fill(torch.isinf(mask).all(-1, keepdim=True), 0.0)
        bias = bias.to(query.dtype).expand(b, h, q, key.shape[2])
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, repeat_kv(key, n_rep), repeat_kv(value, n_rep), bias, True, 0.0, causal, scale=scale
    )
    return out, lse[:, :, : query.shape[2]].float()


_FLASH_ATTN = []


def _flash_attn_func():
    if not _FLASH_ATTN:
        try:
            from flash_attn import flash_attn_func
        except ImportError:
            flash_attn_func = None
        _FLASH_ATTN.append(flash_attn_func)
    return _FLASH_ATTN[0]


def cuda_backend() -> str:
    """Which fused kernel the flash path uses on CUDA for unmasked half-precision input."""
    return "flash_attn" if _flash_attn_func() is not None else "torch-flash"
