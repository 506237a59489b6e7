"""Where a layer's heads sit in its q/k/v weights (``Projections``), read off the probe forward: what structural
pruning (``interp.structure.head_slicing``) slices, or the reason it refuses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .probe import _is_linear, _ModuleLog

__all__ = ["Projections"]


@dataclass(frozen=True)
class Projections:
    """How one layer's heads sit in its weights, for pruning. Paths are relative to the block.

    layout: ``"separate"`` (q, k, v each a linear), ``"concat"`` (one linear, ``[q | k | v]`` on its outputs),
    ``"interleaved"`` (one linear, ``[q_h | k_h | v_h]`` per head, GPT-NeoX).
    per_head: other parameters of the attention module with one slice per head along their first axis:
    ``(path, "q" | "kv", width)`` (sinks, per-head norms over h * d).
    """

    layout: str
    q: str
    k: str
    v: str
    per_head: tuple[tuple[str, str, int], ...] = ()


def _projections(block, attn, o_proj, call: dict, log: _ModuleLog, names: dict) -> Projections | str:
    """Where the heads sit in the q/k/v weights, or the reason they cannot be sliced."""
    if o_proj is None:
        return "no linear map reads z (the heads' outputs) directly, so there is nothing to slice per head"
    q, k, v = call["query"], call["key"], call["value"]
    h, g, d, e = q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
    b, p = v.shape[0], v.shape[2]
    v_flat = v.transpose(1, 2).reshape(b, p, g * e)
    linears = [m for m in attn.modules() if _is_linear(m) and m is not o_proj]
    outs = {m: log.outputs.get(m) for m in linears}
    path = {m: names[m] for m in linears}

    def matches(out, columns):
        return out is not None and out.shape[:2] == (b, p) and torch.equal(out[..., columns], v_flat)

    per_head = _per_head_params(attn, linears + [o_proj], h, g, d, names)
    if isinstance(per_head, str):
        return per_head
    if len(linears) == 1:
        (fused,) = linears
        out = outs[fused]
        width = out.shape[-1] if out is not None else 0
        if width == h * d + g * d + g * e and matches(out, slice(h * d + g * d, width)):
            return Projections("concat", path[fused], path[fused], path[fused], per_head)
        if g == h and d == e and width == 3 * h * d and out is not None and torch.equal(
                out.reshape(b, p, h, 3 * d)[..., 2 * d:].reshape(b, p, h * d), v_flat):
            return Projections("interleaved", path[fused], path[fused], path[fused], per_head)
    if len(linears) == 3:
        v_proj = [m for m in linears if outs[m] is not None and outs[m].shape[-1] == g * e and matches(outs[m], slice(None))]
        rest = [m for m in linears if m not in v_proj]
        if len(v_proj) == 1:
            by_width = {outs[m].shape[-1] for m in rest if outs[m] is not None}
            if h == g and by_width == {h * d}:
                q_proj, k_proj = rest  # same heads kept on both sides: which is which does not matter
            else:
                q_proj = next((m for m in rest if outs[m] is not None and outs[m].shape[-1] == h * d), None)
                k_proj = next((m for m in rest if m is not q_proj and outs[m] is not None and outs[m].shape[-1] == g * d), None)
            if q_proj is not None and k_proj is not None:
                return Projections("separate", path[q_proj], path[k_proj], path[v_proj[0]], per_head)
    shown = ", ".join(f"{path[m]} ({m.weight.shape[0]} outputs)" for m in linears) or "none"
    return f"its q/k/v projections are not a layout interp can slice per head: {shown}"


def _per_head_params(attn, linears, h, g, d, names) -> tuple[tuple[str, str, int], ...] | str:
    """Parameters of the attention module outside its projections: per-head ones (sliced), per-head-size ones
    (norms over d, shared by every head: kept), anything else (pruning refused)."""
    skip = {id(p) for m in linears for p in m.parameters()}
    out = []
    for name, param in attn.named_parameters():
        if id(param) in skip:
            continue
        first = param.shape[0] if param.ndim else 0
        if param.ndim and param.shape[-1] == d and param.numel() == d:
            continue  # a norm over each head's d features, shared by all heads
        side = "q" if first in (h, h * d) else "kv" if first in (g, g * d) else None
        if side is None:
            return f"the attention module has a parameter {name} of shape {tuple(param.shape)} that is not per head"
        width = 1 if first in (h, g) and param.ndim == 1 else (d if first in (h * d, g * d) else 1)
        out.append((f"{names[attn]}.{name}", side, width))
    return tuple(out)
