"""A norm's ``hook_scale`` and ``hook_normalized`` as hook points that change the forward (TransformerLens's
``blocks.{l}.ln1.hook_scale``, ``ln2``, ``ln_final``; which norm each name is: ``interp.structure.norms.norm_modules``).

One torch forward hook on the HF norm module serves both points, attached while either has a listener. It reads the
norm's input ``x``, fires ``hook_scale`` with the scale (``norm_scale``, in ``x``'s dtype, ``(b, p, 1)``), then
``hook_normalized`` with ``x`` centred (LayerNorm) and divided by the scale that hook returned (``(b, p, m)``). When
neither hook returns a new tensor the module's own output is kept, bit for bit; when one does, the output is
rebuilt from it as TransformerLens's norms compute it: ``normalized * w + b`` (RMSNorm: no ``b``; the effective
weight, Gemma's ``1 + w`` included), in the output's dtype.
"""

from __future__ import annotations

import torch

from hooks import HookPoint

from ..structure.norms import norm_bias, norm_centres, norm_divide, norm_eps, norm_scale, norm_weight
from .wrapper import _Handles

__all__ = ["NormHooks"]


class NormHooks:
    """The two hook points of one norm module. ``attach(point)`` is what the model calls when a point gets its
    first listener (``Layout.attach``); the torch hook stays while either point's handle is held. ``block``: the
    module whose input gives ``(b, p)`` where the norm runs on ``(b * p, m)`` (OPT's MLP norm)."""

    def __init__(self, norm: torch.nn.Module, scale: HookPoint, normalized: HookPoint,
                 block: torch.nn.Module | None = None):
        self.norm, self.scale, self.normalized, self.block = norm, scale, normalized, block
        self.users, self.handle, self.shape, self.fixed = 0, None, (), None

    def attach(self, point: HookPoint) -> _Release:
        if self.handle is None:
            handles = [self.norm.register_forward_hook(self._hook, with_kwargs=True)]
            if self.block is not None:
                handles.append(self.block.register_forward_pre_hook(self._remember, with_kwargs=True))
            self.handle = _Handles(handles)
        self.users += 1
        return _Release(self)

    def _release(self) -> None:
        self.users -= 1
        if self.users == 0 and self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _remember(self, module, args, kwargs) -> None:
        x = args[0] if args else kwargs.get("hidden_states")
        self.shape = tuple(x.shape[:-1]) if isinstance(x, torch.Tensor) else ()

    def _hook(self, module, args, kwargs, out):
        x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
        if not isinstance(x, torch.Tensor) or not isinstance(out, torch.Tensor):
            return None  # a call whose input or output is not one tensor: left as it is
        m = x.shape[-1]
        if self.fixed is None:  # what kind of norm it is does not change: read once (norm.forward: no hook fires)
            self.fixed = (norm_eps(self.norm, m), norm_centres(self.norm, m))
        eps, centres = self.fixed
        if x.ndim == 2 and len(self.shape) == 2 and self.shape[0] * self.shape[1] == x.shape[0]:
            x = x.reshape(*self.shape, m)  # hooks always see (b, p, ...)
        scale = norm_scale(self.norm, x, eps, centres).to(x.dtype)
        edited_scale = self.scale(scale)
        normalized = norm_divide(x, edited_scale, centres)
        edited = self.normalized(normalized)
        if edited_scale is scale and edited is normalized:
            return None  # observed only: the module's own output
        y = edited.float() * norm_weight(self.norm, m).float().to(x.device)
        bias = norm_bias(self.norm, m)
        y = y if bias is None else y + bias.float().to(x.device)
        return y.to(out.dtype).reshape(out.shape)


class _Release:
    """The handle ``attach`` returns: removing it lets go of the torch hook once no point listens (twice: once)."""

    def __init__(self, hooks: NormHooks):
        self.hooks = hooks

    def remove(self) -> None:
        if self.hooks is not None:
            self.hooks._release()
            self.hooks = None
