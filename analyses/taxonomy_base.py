"""What the literature's head classes share (``analyses.taxonomy``, ``taxonomy_ioi``, ``function_vectors``, and
``detect_heads``'s dispatch): the refusal for models with several stacks and the bootstrap over items. It sits below
those modules, so none of them imports another back."""

from __future__ import annotations

import torch

from interp.sites import is_layered

__all__ = ["refuse_stacks", "bootstrap"]


def refuse_stacks(model, what: str) -> None:
    """A clear refusal for models with several stacks (encoder-decoder): these scores need one residual stream."""
    if not is_layered(model):
        raise TypeError(f"{what} reads one residual stream and its unembedding; an encoder-decoder model has two "
                        "stacks. Compute it on a decoder-only model, or use the attention-pattern scores "
                        "(detect_heads's defaults), which work per (site, head).")


def bootstrap(hits: torch.Tensor, n_bootstrap: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean over items of ``hits: (items, heads)`` and its 95% percentile bootstrap interval (items resampled)."""
    hits = hits.double()
    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(hits.shape[0], (n_bootstrap, hits.shape[0]), generator=g)
    counts = torch.zeros(n_bootstrap, hits.shape[0], dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(n_bootstrap, hits.shape[0], dtype=torch.float64))
    boot = counts @ hits / hits.shape[0]  # (n_bootstrap, heads)
    lo_hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=0)
    return hits.mean(0), lo_hi[0], lo_hi[1]
