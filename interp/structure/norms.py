"""A norm module read as numbers: its epsilon, whether it centres (LayerNorm) or only rescales (RMSNorm), its
effective weight and bias, and the scale it divides a residual stream by. Found by calling the module, not listed
per family (Gemma's ``1 + w``, T5's ``T5LayerNorm`` that is an RMSNorm, OLMo's hard-coded epsilon). The probes
call ``norm.forward``, not the module, so that no hook on it (a user's, interp's own norm hooks) fires on them."""

from __future__ import annotations

import torch

from .probe import _is_norm

__all__ = ["mlp_norm_reads", "norm_bias", "norm_centres", "norm_divide", "norm_eps", "norm_modules", "norm_scale",
           "norm_weight", "parallel_mlp_norm"]


def norm_eps(norm, d_model: int) -> float:
    """The norm's epsilon: its attribute, or (OLMo's LayerNorm hard-codes it) solved from the module's output on a
    small input, where the epsilon weighs as much as the input's own scale."""
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(norm, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    dtype, device = _probe_place(norm)
    sign = torch.ones(1, d_model, dtype=dtype, device=device)
    sign[0, 1::2] = -1.0  # mean 0, mean square 1: LayerNorm and RMSNorm see the same scale
    small = 1e-3
    with torch.no_grad():
        ratio = float((norm.forward(sign * small).double() - norm.forward(sign * 0).double()).abs().sum()
                      / (norm.forward(sign).double() - norm.forward(sign * 0).double()).abs().sum()) / small
    # ratio = sqrt(1 + eps) / sqrt(small^2 + eps)
    return max(0.0, (1.0 - ratio**2 * small**2) / (ratio**2 - 1.0))


def _probe_place(norm) -> tuple[torch.dtype, torch.device | str]:
    """The dtype and device to call ``norm`` on: its parameters', or, where a device map offloaded them (``meta``),
    the device accelerate runs the module on."""
    param = next(norm.parameters(), None)
    if param is None:
        return torch.float32, "cpu"
    if param.device.type == "meta":
        return param.dtype, getattr(getattr(norm, "_hf_hook", None), "execution_device", None) or "cpu"
    return param.dtype, param.device


def norm_centres(norm, d_model: int) -> bool:
    """Whether the norm subtracts the mean (a LayerNorm) rather than only dividing by the root mean square (T5's
    ``T5LayerNorm`` is an RMSNorm by another name): a LayerNorm's output ignores a constant added to the input."""
    if isinstance(norm, torch.nn.LayerNorm):
        return True
    dtype, device = _probe_place(norm)
    x = torch.ones(1, d_model, dtype=dtype, device=device)
    x[0, 1::2] = -1.0
    with torch.no_grad():
        return bool(torch.allclose(norm.forward(x + 3.0).float(), norm.forward(x).float(), atol=1e-3))


def norm_weight(norm, d_model: int) -> torch.Tensor:
    """The effective weight ``(m,)`` in float64 that multiplies the normalised stream (Gemma's ``1 + w`` included):
    the module's output on a zero-mean, unit-scale input, less its bias."""
    dtype, device = _probe_place(norm)
    eps = norm_eps(norm, d_model)
    with torch.no_grad():
        if norm_centres(norm, d_model):
            weight = getattr(norm, "weight", None)
            return (torch.ones(d_model, dtype=torch.float64, device=device) if weight is None
                    else weight.detach().double())
        ones = torch.ones(1, d_model, dtype=dtype, device=device)
        return norm.forward(ones).double()[0] * (1.0 + eps) ** 0.5


def norm_bias(norm, d_model: int) -> torch.Tensor | None:
    """The norm's additive bias ``(m,)`` in float64 (a LayerNorm's beta), or None."""
    bias = getattr(norm, "bias", None)
    return None if not isinstance(bias, torch.Tensor) or not norm_centres(norm, d_model) else bias.detach().double()


def norm_scale(norm, x: torch.Tensor, eps: float | None = None, centres: bool | None = None) -> torch.Tensor:
    """What ``norm`` divides ``x: (..., m)`` by, ``(..., 1)`` (TransformerLens's ``hook_scale``): the standard
    deviation of a LayerNorm, the root mean square of an RMSNorm, each with the norm's epsilon, in float32.
    ``eps``/``centres``: ``norm_eps``/``norm_centres`` when already read (they call the module)."""
    eps = norm_eps(norm, x.shape[-1]) if eps is None else eps
    centres = norm_centres(norm, x.shape[-1]) if centres is None else centres
    x = x.float()
    if centres:
        return torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
    return torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def norm_divide(x: torch.Tensor, scale: torch.Tensor, centres: bool) -> torch.Tensor:
    """``x`` centred (a LayerNorm's) and divided by ``scale``, in ``x``'s dtype, computed in float32:
    TransformerLens's ``hook_normalized``, the norm's output before its weight and bias."""
    return (_centred(x, centres) / scale.float()).to(x.dtype)


def _centred(x: torch.Tensor, centres: bool) -> torch.Tensor:
    x = x.float()
    return x - x.mean(-1, keepdim=True) if centres else x


def parallel_mlp_norm(structure, block, layer: int) -> torch.nn.Module | None:
    """The norm through which parallel block ``layer``'s MLP reads the block's input: the block's one norm outside
    attention that is not attention's own (GPT-NeoX), attention's where that is the block's only one (Phi, GPT-J:
    shared), None where several could be."""
    inside = set(block.get_submodule(structure.attn[layer]).modules())
    path = structure.attn_in_norm[layer]
    attn_norm = None if path is None else block.get_submodule(path)
    own = [m for m in block.modules() if _is_norm(m) and m not in inside and m is not attn_norm]
    if len(own) == 1 or (not own and attn_norm is not None):
        return own[0] if own else attn_norm
    return None


def mlp_norm_reads(kind: str) -> str:
    """The hook kind of the stream a block's MLP norm reads: the block's input (``"resid_pre"``) in a parallel
    block, ``"resid_mid"`` (after attention) in a pre-norm one."""
    return "resid_pre" if kind == "parallel" else "resid_mid"


def norm_modules(structure, blocks, hf) -> dict[str, tuple[torch.nn.Module, tuple[str, ...]]]:
    """TransformerLens's norm names -> (the HF norm module, the hook names of the cached streams whose sum it
    reads), where the model has one: ``blocks.{l}.ln1`` the norm block ``l``'s attention reads the stream through
    (pre-norm and parallel blocks), ``blocks.{l}.ln2`` the norm the MLP reads the stream through (pre-norm blocks:
    ``hook_resid_mid``; parallel blocks: the block's input, where the MLP has a norm of its own, GPT-NeoX's; Phi's
    one norm serves both and is ``ln1`` only: an edit of ``ln2`` would reach attention too), ``ln_final`` the norm
    before the output layer. Post-norm blocks (BERT) normalise after each sublayer: no ln1/ln2."""
    found = {}
    if structure.final_norm is not None:
        found["ln_final"] = (hf.get_submodule(structure.final_norm), (f"blocks.{len(blocks) - 1}.hook_resid_post",))
    if structure.kind == "post-norm":
        return found
    for layer, block in enumerate(blocks):
        attn_norm = structure.attn_in_norm[layer]
        if attn_norm is not None:
            found[f"blocks.{layer}.ln1"] = (block.get_submodule(attn_norm), (f"blocks.{layer}.hook_resid_pre",))
        mid, module = structure.resid_mid[layer], None
        if structure.kind == "pre-norm" and mid is not None and mid[1] == "input":
            module = block.get_submodule(mid[0])
            module = module if _is_norm(module) else None
        elif structure.kind == "parallel" and structure.mlp[layer] is not None:
            module = parallel_mlp_norm(structure, block, layer)
            module = None if module is found.get(f"blocks.{layer}.ln1", (None,))[0] else module
        if module is not None:
            found[f"blocks.{layer}.ln2"] = (module, (f"blocks.{layer}.hook_{mlp_norm_reads(structure.kind)}",))
    return found
