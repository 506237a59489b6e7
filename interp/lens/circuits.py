"""Each attention site's weights split per head, and ``LowRank``: a matrix kept as two factors, with what
TransformerLens's ``FactoredMatrix`` offers (``@``, ``.T``, ``.AB``, ``.BA``, ``.eigenvalues``, ``.norm()``,
``.svd()``, indexing). Row-vector conventions, as TransformerLens: a head reads the residual stream ``x`` (a row)
and writes ``x @ W_V @ W_O``; its score between ``x_q`` and ``x_k`` is ``x_q @ W_Q @ W_K.T @ x_k.T``."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from transformers.pytorch_utils import Conv1D

from ..runtime.distributed import onloaded
from ..structure.norms import norm_weight
from ..attention.sites import Site, is_layered

__all__ = ["LowRank", "head_biases", "head_weights"]


@dataclass(frozen=True)
class LowRank:
    """A matrix kept as ``left @ right``: left ``(..., m, r)``, right ``(..., r, n)`` (TransformerLens's
    ``FactoredMatrix``: ``A`` is ``left``, ``B`` is ``right``). Leading dimensions broadcast as in torch."""

    left: torch.Tensor
    right: torch.Tensor

    def __post_init__(self):
        if self.left.shape[-1] != self.right.shape[-2]:
            raise ValueError(f"LowRank factors must agree on the inner dimension: left {tuple(self.left.shape)}, "
                             f"right {tuple(self.right.shape)}.")

    # -- the factors and the product -------------------------------------------------------------------------
    A = property(lambda self: self.left)
    B = property(lambda self: self.right)

    def full(self) -> torch.Tensor:
        return self.left @ self.right

    @property
    def AB(self) -> torch.Tensor:  # noqa: N802
        """The full matrix ``(..., m, n)``."""
        return self.full()

    @property
    def BA(self) -> torch.Tensor:  # noqa: N802
        """``right @ left`` ``(..., r, r)``: the same non-zero eigenvalues as AB, for a square AB."""
        return self.right @ self.left

    @property
    def T(self) -> LowRank:  # noqa: N802
        return LowRank(self.right.transpose(-1, -2), self.left.transpose(-1, -2))

    @property
    def shape(self) -> torch.Size:
        lead = torch.broadcast_shapes(self.left.shape[:-2], self.right.shape[:-2])
        return torch.Size((*lead, self.left.shape[-2], self.right.shape[-1]))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    ldim = property(lambda self: self.left.shape[-2])
    mdim = property(lambda self: self.left.shape[-1])
    rdim = property(lambda self: self.right.shape[-1])

    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.left, self.right

    def __repr__(self) -> str:
        return f"LowRank(shape {tuple(self.shape)}, inner dim {self.mdim})"

    # -- products ------------------------------------------------------------------------------------------
    def __matmul__(self, other) -> LowRank | torch.Tensor:
        """With a LowRank: a LowRank (the inner product is r x r); with a matrix: a LowRank; with a vector ``(n,)``:
        the vector ``(..., m)``."""
        if isinstance(other, LowRank):
            return LowRank(self.left @ (self.right @ other.left), other.right)
        if other.ndim == 1:
            return (self.left @ (self.right @ other[:, None]))[..., 0]
        return LowRank(self.left, self.right @ other)

    def __rmatmul__(self, other: torch.Tensor) -> LowRank | torch.Tensor:
        if other.ndim == 1:
            return ((other[None] @ self.left) @ self.right)[..., 0, :]
        return LowRank(other @ self.left, self.right)

    def __mul__(self, scalar) -> LowRank:
        return LowRank(self.left * scalar, self.right)

    __rmul__ = __mul__

    def unsqueeze(self, dim: int) -> LowRank:
        return LowRank(self.left.unsqueeze(dim), self.right.unsqueeze(dim))

    def __getitem__(self, index) -> LowRank:
        """Index the leading dimensions (``OV[layer, head]``); a row or column index past them keeps its axis, as
        TransformerLens does (``M[..., :5, :]`` selects rows of the left factor)."""
        index = index if isinstance(index, tuple) else (index,)
        lead = self.ndim - 2
        if any(i is Ellipsis or i is None for i in index) or len(index) > self.ndim:
            raise IndexError(f"LowRank takes up to {self.ndim} plain indices (no ... or None); got {index!r}.")
        left, right = self.left.expand(*self.shape[:-2], *self.left.shape[-2:]), \
            self.right.expand(*self.shape[:-2], *self.right.shape[-2:])
        for n, i in enumerate(index):  # an int past the end is an error, never an empty slice
            if isinstance(i, int) and not -self.shape[n] <= i < self.shape[n]:
                raise IndexError(f"index {i} is out of range for axis {n} of size {self.shape[n]} (LowRank "
                                 f"{tuple(self.shape)}).")
        keep = [slice(i, i + 1 or None) if isinstance(i, int) and n >= lead else i for n, i in enumerate(index)]
        left, right = left[tuple(keep[:lead])], right[tuple(keep[:lead])]
        if len(index) > lead:
            left = left[(..., keep[lead], slice(None))]
        if len(index) > lead + 1:
            right = right[(..., keep[lead + 1])]
        return LowRank(left, right)

    # -- spectra -------------------------------------------------------------------------------------------
    def norm(self) -> torch.Tensor:
        """Frobenius norm ``(...)``, from r x r Gram matrices: ||L R||^2 = tr((L^T L)(R R^T))."""
        gram_left = self.left.transpose(-1, -2) @ self.left
        gram_right = self.right @ self.right.transpose(-1, -2)
        return (gram_left * gram_right.transpose(-1, -2)).sum((-1, -2)).clamp(min=0).sqrt()

    @cached_property
    def _svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        left, right = _upcast(self.left), _upcast(self.right)
        u_l, s_l, vh_l = torch.linalg.svd(left, full_matrices=False)
        u_r, s_r, vh_r = torch.linalg.svd(right, full_matrices=False)
        middle = s_l[..., :, None] * (vh_l @ u_r) * s_r[..., None, :]  # (..., r, r)
        u_m, s_m, vh_m = torch.linalg.svd(middle, full_matrices=False)
        return u_l @ u_m, s_m, vh_r.transpose(-1, -2) @ vh_m.transpose(-1, -2)

    def svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(U, S, V)`` with ``U @ diag(S) @ V.T`` the matrix (TransformerLens's convention: V, not Vh), from the
        factors' SVDs: ``U (..., m, r)``, ``S (..., r)``, ``V (..., n, r)``."""
        return self._svd

    U = property(lambda self: self._svd[0])
    S = property(lambda self: self._svd[1])
    V = property(lambda self: self._svd[2])

    @property
    def eigenvalues(self) -> torch.Tensor:
        """The eigenvalues of a square matrix's non-zero part, ``(..., r)`` complex: those of ``BA``."""
        return torch.linalg.eig(_upcast(self.BA)).eigenvalues

    def get_corner(self, k: int = 3) -> torch.Tensor:
        """The top-left ``k x k`` block of the full matrix (of the first leading index)."""
        left, right = self.left.reshape(-1, *self.left.shape[-2:])[0], self.right.reshape(-1, *self.right.shape[-2:])[0]
        return left[:k] @ right[:, :k]


def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


# -- one site's weights, per head --------------------------------------------------------------------------------
def _rows(module: torch.nn.Module, index: torch.Tensor) -> torch.Tensor:
    """Output features ``index`` of a projection as (d_model, len(index)) columns: x @ W."""
    weight = module.weight.detach().double()
    return weight[:, index] if isinstance(module, Conv1D) else weight[index].T


def _bias(module: torch.nn.Module, index: torch.Tensor) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return None if bias is None else bias.detach().double()[index]


def check_site(model, layer) -> Site:
    """The site a layer number (a model with one site per layer) or a site name stands for; clear errors."""
    if isinstance(layer, str):
        if layer not in model.sites:
            raise ValueError(f"{layer!r} is not an attention site of this model; give one of "
                             f"{', '.join(model.sites)}.")
        return model.sites[layer]
    if not is_layered(model):
        raise ValueError(f"An encoder-decoder model's weights are read per site: give a site name such as "
                         f"{model.cfg.sites[-1].name!r}; got {layer!r}.")
    n = model.cfg.n_layers
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n:
        raise ValueError(f"layer must be an integer in [0, {n}) (this model has {n} layers); got {layer!r}.")
    return model.cfg.sites[layer]


def _indices(site: Site, proj) -> tuple[list, list]:
    """``([q, k, v] modules, [q, k, v] output indices)`` of a site's projections."""
    h, g, d, e = site.n_heads, site.n_kv_heads, site.d_head, site.d_head_v
    arange = torch.arange
    if proj.layout == "separate":
        return [proj.q, proj.k, proj.v], [arange(h * d), arange(g * d), arange(g * e)]
    if proj.layout == "concat":
        return [proj.q] * 3, [arange(h * d), arange(g * d) + h * d, arange(g * e) + h * d + g * d]
    base = (arange(h)[:, None] * 3 * d + arange(d)).flatten()  # interleaved per head: [q_h | k_h | v_h]
    return [proj.q] * 3, [base, base + d, base + 2 * d]


def _projections(model, site: Site):
    module, proj = model.projections_of(site)  # paths relative to module
    o_proj = model.o_proj_of(site)
    if isinstance(proj, str) or o_proj is None:
        raise NotImplementedError(f"{site.name}'s weights cannot be split per head: "
                                  f"{proj if isinstance(proj, str) else 'no output projection reads z'}.")
    paths, index = _indices(site, proj)
    return [module.get_submodule(p) for p in paths], index, o_proj


def head_weights(model, layer, fold_norms: bool = True) -> dict[str, torch.Tensor]:
    """One site's W_Q (h, m, d), W_K and W_V (g, m, d|e) and W_O (h, e, m) in float64, as row-vector maps, on the
    model's input device (a model split by a device map has its layers elsewhere; offloaded weights are loaded for
    the read). ``layer``: a site's name (``"decoder.blocks.0.cross_attn"``), or on a model with one site per
    layer the layer's number. ``fold_norms``: the weight of the norm the site reads its input through (RMSNorm or
    LayerNorm) multiplies the rows of W_Q, and of W_K and W_V in self-attention; its bias and division are left out."""
    site = check_site(model, layer)
    module, _ = model.projections_of(site)
    with onloaded(module):
        (q, k, v), (iq, ik, iv), o_proj = _projections(model, site)
        w_q, w_k, w_v = _rows(q, iq), _rows(k, ik), _rows(v, iv)
        norm = model.in_norm_of(site)
        gamma = norm_weight(norm, w_q.shape[0]) if fold_norms and norm is not None else None
        if gamma is not None:  # a cross site's keys and values read the encoder's output, not this norm's
            w_q = gamma[:, None] * w_q
            if site.kind == "self":
                w_k, w_v = gamma[:, None] * w_k, gamma[:, None] * w_v
        w_o = o_proj.weight.detach().double()
        w_o = w_o if isinstance(o_proj, Conv1D) else w_o.T  # (h e, m)
    h, g = site.n_heads, site.n_kv_heads
    weights = {"W_Q": w_q.T.reshape(h, site.d_head, -1).transpose(1, 2),
               "W_K": w_k.T.reshape(g, site.d_head, -1).transpose(1, 2),
               "W_V": w_v.T.reshape(g, site.d_head_v, -1).transpose(1, 2), "W_O": w_o.reshape(h, site.d_head_v, -1)}
    return {name: w.to(model.device) for name, w in weights.items()}


def head_biases(model, layer) -> dict[str, torch.Tensor]:
    """One site's b_Q (h, d), b_K and b_V (g, d|e) and b_O (m,) in float64 (zeros where a projection has none)."""
    site = check_site(model, layer)
    module, _ = model.projections_of(site)
    with onloaded(module):
        (q, k, v), (iq, ik, iv), o_proj = _projections(model, site)
        parts = [_bias(q, iq), _bias(k, ik), _bias(v, iv), getattr(o_proj, "bias", None)]
        m = o_proj.weight.shape[-1] if isinstance(o_proj, Conv1D) else o_proj.weight.shape[0]
        sizes = [len(iq), len(ik), len(iv), m]
        b_q, b_k, b_v, b_o = [torch.zeros(n, dtype=torch.float64, device=o_proj.weight.device) if b is None
                              else b.detach().double() for b, n in zip(parts, sizes)]
    h, g = site.n_heads, site.n_kv_heads
    biases = {"b_Q": b_q.reshape(h, site.d_head), "b_K": b_k.reshape(g, site.d_head),
              "b_V": b_v.reshape(g, site.d_head_v), "b_O": b_o}
    return {name: b.to(model.device) for name, b in biases.items()}


def output_grams(model, indices) -> dict[int, torch.Tensor]:
    """Per site index (into ``model.cfg.sites``), ``W_O W_O^T: (h, e, e)`` in float64 (the output projection's
    weight, no norm folded): what ``interp.attention.site_pass.each_site(value_norms=...)`` reads norm-weighted
    attention with."""
    grams = {}
    for i in indices:
        w_o = head_weights(model, model.cfg.sites[i].name, fold_norms=False)["W_O"]  # (h, e, m)
        grams[i] = torch.einsum("hem,hfm->hef", w_o, w_o)
    return grams
