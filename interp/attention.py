"""Our attention step, registered with transformers' attention interface under two keys.

HF keeps its weights, projections and RoPE and calls us with ``query: (b, h, q, d)`` and
``key, value: (b, g, k, d)``; we return ``(out: (b, q, h, d), pattern or None)``.

- ``eager`` (key ``interp_exact``) mirrors HF's ``eager_attention_forward`` step by step (repeat_kv, scale,
  additive mask, fp32 softmax, transpose), so that with no hooks it equals HF eager exactly, and it fires
  every attention hook inside the computation: an edit to q, scores, pattern or z changes what follows.
- ``flash`` (key ``interp_fused``) runs a fused kernel that also returns each row's logsumexp and never
  builds the n x n matrix; it fires q, k, v, z and lse.

Key names contain neither "flash" nor "sdpa": HF matches those substrings and would take over dispatch.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from hooks import HookPoint

__all__ = ["EAGER_KEY", "FLASH_KEY", "ATTN_KEYS", "LayerHooks", "attach_layer_hooks", "attached_layer_hooks", "detach_layer_hooks",
           "eager_attention", "flash_attention", "fused_attention", "REFUSED_KWARGS"]

EAGER_KEY = "interp_exact"
FLASH_KEY = "interp_fused"
ATTN_KEYS = {"eager": EAGER_KEY, "flash": FLASH_KEY}

# Keyword arguments some models pass that change the attention math; we do not implement them.
REFUSED_KWARGS = {
    "softcap": "logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias (T5/ALiBi-style)",
    "sliding_window": "sliding-window attention",
}


class LayerHooks:
    """The attention hook points of one layer; ``any`` is kept up to date by the model.

    ``owner`` is a weak reference to the HookedModel these points belong to. A copy of the HF model
    (``copy.deepcopy``, pickling) carries no hooks: they belong to the wrapper, not to the weights.
    """

    __slots__ = ("q", "k", "v", "attn_scores", "pattern", "z", "lse", "any", "owner")

    def __init__(self, points: dict[str, HookPoint], owner=None):
        for kind in ("q", "k", "v", "attn_scores", "pattern", "z", "lse"):
            setattr(self, kind, points[kind])
        self.any = False
        self.owner = weakref.ref(owner) if owner is not None else (lambda: None)

    def refresh(self) -> None:
        self.any = any(bool(getattr(self, kind)) for kind in ("q", "k", "v", "attn_scores", "pattern", "z", "lse"))

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (type(None), ())


# The hook points live on the attention module itself, as a plain attribute (not a submodule, parameter or
# buffer: state_dict, repr and save_pretrained never see it). A global weak table keyed by module made
# torch.compile guard on the table's changing contents.
_HOOKS_ATTR = "_interp_hooks"


def attach_layer_hooks(module: torch.nn.Module, hooks: LayerHooks) -> None:
    module.__dict__[_HOOKS_ATTR] = hooks


def attached_layer_hooks(module: torch.nn.Module) -> LayerHooks | None:
    return module.__dict__.get(_HOOKS_ATTR)


def detach_layer_hooks(module: torch.nn.Module) -> None:
    module.__dict__.pop(_HOOKS_ATTR, None)


def _active_hooks(module: torch.nn.Module) -> LayerHooks | None:
    hooks = getattr(module, _HOOKS_ATTR, None)
    return hooks if hooks is not None and hooks.any else None


def _refuse(kwargs: dict) -> None:
    for key, what in REFUSED_KWARGS.items():
        if kwargs.get(key) is not None:
            raise NotImplementedError(
                f"This model asked for {what} ({key}={kwargs[key]!r}), which interp's attention does not implement; "
                "computing without it would silently give a different pattern. Use a model without it."
            )


def _fire_qkv(hooks: LayerHooks, query, key, value):
    """Hooks see (b, p, h, d) as TransformerLens does; the kernel gets (b, h, p, d) back."""
    if hooks.q:
        query = hooks.q(query.transpose(1, 2)).transpose(1, 2)
    if hooks.k:
        key = hooks.k(key.transpose(1, 2)).transpose(1, 2)
    if hooks.v:
        value = hooks.v(value.transpose(1, 2)).transpose(1, 2)
    return query, key, value


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(b, g, k, d) -> (b, g * n_rep, k, d), each key/value head serving n_rep query heads."""
    if n_rep == 1:
        return x
    b, g, k, d = x.shape
    return x[:, :, None].expand(b, g, n_rep, k, d).reshape(b, g * n_rep, k, d)


def eager_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF's eager attention, with our hooks inside. query: (b, h, q, d); key, value: (b, g, k, d)."""
    _refuse(kwargs)
    hooks = _active_hooks(module)
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    if hooks is not None:
        query, key, value = _fire_qkv(hooks, query, key, value)

    n_rep = query.shape[1] // key.shape[1]
    key_states = repeat_kv(key, n_rep)
    value_states = repeat_kv(value, n_rep)
    scores = torch.matmul(query, key_states.transpose(2, 3)) * scaling  # (b, h, q, k)
    if attention_mask is not None:
        scores = scores + attention_mask
    if hooks is not None:
        if hooks.attn_scores:
            scores = hooks.attn_scores(scores)
        if hooks.lse:
            hooks.lse(torch.logsumexp(scores.float(), dim=-1))
    pattern = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)  # (b, h, q, k)
    if hooks is not None and hooks.pattern:
        pattern = hooks.pattern(pattern)
    attn = F.dropout(pattern, p=dropout, training=module.training)
    out = torch.matmul(attn, value_states).transpose(1, 2).contiguous()  # (b, q, h, d)
    if hooks is not None and hooks.z:
        out = hooks.z(out)
    return out, pattern


def flash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None, **kwargs):
    """Fused attention that never builds the n x n matrix. Same arguments as ``eager_attention``."""
    _refuse(kwargs)
    hooks = _active_hooks(module)
    if hooks is not None:
        if hooks.attn_scores or hooks.pattern:
            raise ValueError(
                "hook_pattern and hook_attn_scores exist only on the eager path. Call model.set_attn('eager'), "
                "or capture q and k on the flash path and rebuild patterns with cache.pattern(layer, heads)."
            )
        query, key, value = _fire_qkv(hooks, query, key, value)
    if scaling is None:
        scaling = query.size(-1) ** -0.5

    # As HF's sdpa integration: causal via the kernel flag when no mask was built.
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal and query.shape[2] > 1 and attention_mask is None)
    if causal and key.shape[2] > query.shape[2]:  # prefill into a larger static cache, as HF does
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]

    need_lse = hooks is not None and bool(hooks.lse)
    out, lse = fused_attention(query, key, value, attention_mask, scaling, dropout, causal, need_lse)
    if need_lse:
        hooks.lse(lse)
    out = out.transpose(1, 2).contiguous()  # (b, q, h, d)
    if hooks is not None and hooks.z:
        out = hooks.z(out)
    return out, None


def fused_attention(query, key, value, mask, scale: float, dropout: float = 0.0, causal: bool = False,
                    need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(scale * q k^T + mask) v and the per-row fp32 logsumexp, from a fused kernel.

    query: (b, h, q, d); key, value: (b, g, k, d) with h a multiple of g; mask: additive, broadcastable
    to (b, h, q, k), or None. Returns out: (b, h, q, d) and lse: (b, h, q) (None when not available).
    """
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
    if query.device.type == "cuda":
        out, lse = _fused_cuda(query, key, value, mask, scale, causal)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, attn_mask=mask, scale=scale
        )
        lse = lse.float()
    if need_lse and torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        lse = _LogSumExp.apply(query, key, lse, mask, scale, causal)
    return out, lse


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


def _fused_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None,
                dtype=torch.float32, **kwargs):
    """HF's sdpa mask (None when the kernel's causal flag or no mask suffices), made additive.

    The CPU flash kernel rejects boolean masks; -inf on disallowed keys gives fully padded rows output 0
    and logsumexp 0, as HF sdpa does.
    """
    mask = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)
    if mask is None:
        return None
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, float("-inf")).to(dtype)


def _register() -> None:
    AttentionInterface.register(EAGER_KEY, eager_attention)
    AttentionInterface.register(FLASH_KEY, flash_attention)
    AttentionMaskInterface.register(EAGER_KEY, eager_mask)
    AttentionMaskInterface.register(FLASH_KEY, _fused_mask)


_register()
