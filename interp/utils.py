"""TransformerLens's ``utils`` names that interp has: ``from interp import utils; utils.get_act_name("pattern", 3)``,
``utils.lm_cross_entropy_loss``, ``utils.get_corner``."""

from __future__ import annotations

import torch

from hooks import get_act_name
from .lens.tokens import lm_loss

__all__ = ["get_act_name", "get_corner", "get_device", "lm_cross_entropy_loss", "to_numpy"]


def lm_cross_entropy_loss(logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                          per_token: bool = False) -> torch.Tensor:
    """Next-token cross-entropy of ``logits (b, p, vocab)`` on ``tokens (b, p)``, as TransformerLens's."""
    return lm_loss(logits, tokens, attention_mask, per_token)


def get_corner(tensor, n: int = 3):
    """The top-left ``n x ... x n`` corner of a tensor or a LowRank."""
    if hasattr(tensor, "get_corner"):
        return tensor.get_corner(n)
    return tensor[tuple(slice(n) for _ in range(tensor.ndim))]


def to_numpy(tensor):
    """A tensor (or a nested list of numbers) as a numpy array, detached and on the CPU."""
    import numpy as np

    return tensor.detach().cpu().numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)


def get_device() -> torch.device:
    """TransformerLens's ``utils.get_device``: CUDA if there is one, else Apple's MPS, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    return torch.device("mps" if mps is not None and mps.is_available() else "cpu")
