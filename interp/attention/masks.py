"""Our mask functions, registered with our attention functions under interp's attention keys.

The eager key builds HF's eager mask; the flash key builds HF's sdpa mask made additive (the CPU flash kernel takes
no boolean mask), or none where the kernel's causal flag or ``flash_attention``'s own window suffices. While a
``Recording`` is active (the load probe) every mask is built and its mask function remembered.
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from .paths import EAGER_KEY, FLASH_KEY, Recording, eager_attention, flash_attention

__all__ = ["window_aware"]


def _recorded(mask_fn):
    """Wrap a mask function: while a Recording is active, never skip building the mask, and remember which of
    HF's mask functions (causal, sliding window, bidirectional, ...) made each mask."""

    def build(*args, **kwargs):
        recording = Recording.active
        if recording is not None:
            kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
        mask = mask_fn(*args, **kwargs)
        if recording is not None and mask is not None:
            recording.masks[id(mask)] = kwargs.get("mask_function")
        return mask

    return build


def _fused_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None,
                dtype=torch.float32, **kwargs):
    """HF's sdpa mask (None when the kernel's causal flag or no mask suffices), made additive. A causal sliding
    window over a prompt without padding or cache is not built (n x n): ``flash_attention`` applies the window.

    The CPU flash kernel rejects boolean masks; -inf on disallowed keys gives fully padded rows output 0
    and logsumexp 0, as HF sdpa does.
    """
    size, config = kwargs.get("local_size"), kwargs.get("config")
    if (size is not None and Recording.active is None and _WINDOWED.get(id(config)) is config is not None
            and q_length == kv_length > size and not q_offset
            and not kv_offset and (attention_mask is None or bool(attention_mask.all()))
            and _is_sliding_window(kwargs.get("mask_function"), size)):
        return None  # a causal sliding window, no padding, no cache: flash_attention applies it in O(n) memory
    mask = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)
    if mask is None:
        return None
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, float("-inf")).to(dtype)


_WINDOWED = weakref.WeakValueDictionary()  # configs of models whose attention modules all know their window


def window_aware(hf) -> None:
    """Let our mask function skip sliding-window masks for ``hf``: every attention module has our hooks, which carry
    the window (a module without them, e.g. in a bare copy, gets HF's mask as before)."""
    for config in {id(c): c for c in (hf.config, hf.config.get_text_config())}.values():
        _WINDOWED[id(config)] = config


def _is_sliding_window(mask_function, size: int) -> bool:
    """Whether HF's mask function lets query q see exactly keys q - size + 1 .. q (not chunked or block attention)."""
    index, kv = torch.zeros((), dtype=torch.long), torch.arange(8 * size)
    try:
        allowed = torch.broadcast_to(torch.as_tensor(mask_function(index, index, torch.tensor(4 * size), kv)), kv.shape)
    except Exception:  # noqa: BLE001  a mask function that needs real positions or vmap: build the mask
        return False
    return bool(torch.equal(allowed.bool(), (kv <= 4 * size) & (kv > 3 * size)))


def _register() -> None:
    AttentionInterface.register(EAGER_KEY, eager_attention)
    AttentionInterface.register(FLASH_KEY, flash_attention)
    AttentionMaskInterface.register(EAGER_KEY, _recorded(eager_mask))
    AttentionMaskInterface.register(FLASH_KEY, _recorded(_fused_mask))


_register()
