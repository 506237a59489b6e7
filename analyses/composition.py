"""Weight-based circuits: each head's QK and OV matrices as low-rank factors, and Elhage et al. 2021's
composition scores between heads ("A Mathematical Framework for Transformer Circuits").

Conventions (row vectors, as TransformerLens): a head reads the residual stream ``x`` (a row) and writes
``x @ W_OV`` with ``W_OV = W_V @ W_O`` (d_model x d_model, rank <= d_head); its score between a query at
``x_q`` and a key at ``x_k`` is ``x_q @ W_QK @ x_k.T`` with ``W_QK = W_Q @ W_K.T``. With ``fold_norms`` (default)
the weight of the norm each head reads its input through (its RMSNorm or LayerNorm weight) multiplies the rows
of W_Q, W_K and W_V, as TransformerLens folds it; the norm's division by the scale is left out, as are biases
and RoPE (so QK scores are position-blind: a previous-token head's preference for offset -1 is in RoPE, not
here). For an earlier head A and a later head B (Elhage et al.):

    Q-composition = ||W_OV^A @ W_QK^B|| / (||W_OV^A|| ||W_QK^B||)      (A's output read by B's queries)
    K-composition = ||W_OV^A @ W_QK^B.T|| / (||W_OV^A|| ||W_QK^B||)    (read by B's keys)
    V-composition = ||W_OV^A @ W_OV^B|| / (||W_OV^A|| ||W_OV^B||)      (read by B's values)

in Frobenius norms, computed from the factors: no d_model x d_model matrix per head is ever built unless asked
for (``LowRank.full``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch
from transformers.pytorch_utils import Conv1D

from interp.distributed import onloaded
from interp.sites import FRONT, Site, head_columns, is_layered

__all__ = ["LowRank", "head_weights", "qk_circuit", "ov_circuit", "composition_scores"]

SOURCE = ["source_stack", "source_kind", "source_site", "source_layer", "source_head"]  # head A's columns


@dataclass(frozen=True)
class LowRank:
    """A matrix kept as ``left @ right``: left (..., m, r), right (..., r, n)."""

    left: torch.Tensor
    right: torch.Tensor

    def full(self) -> torch.Tensor:
        return self.left @ self.right

    @property
    def T(self) -> LowRank:  # noqa: N802
        return LowRank(self.right.transpose(-1, -2), self.left.transpose(-1, -2))

    def __matmul__(self, other: LowRank) -> LowRank:
        return LowRank(self.left @ (self.right @ other.left), other.right)

    def norm(self) -> torch.Tensor:
        """Frobenius norm, from r x r Gram matrices: ||L R||^2 = tr((L^T L)(R R^T))."""
        gram_left = self.left.transpose(-1, -2) @ self.left
        gram_right = self.right @ self.right.transpose(-1, -2)
        return (gram_left * gram_right.transpose(-1, -2)).sum((-1, -2)).clamp(min=0).sqrt()


def _rows(module: torch.nn.Module, index: torch.Tensor) -> torch.Tensor:
    """Output features ``index`` of a projection as (d_model, len(index)) columns: x @ W."""
    weight = module.weight.detach().double()
    return weight[:, index] if isinstance(module, Conv1D) else weight[index].T


def _norm_weight(norm) -> torch.Tensor | None:
    if norm is None:
        return None
    weight = getattr(norm, "weight", None)
    if "RMS" not in type(norm).__name__ and (isinstance(norm, torch.nn.LayerNorm) or "LayerNorm" in type(norm).__name__):
        return weight.detach().double() if weight is not None else None
    from .attribution import _eps

    with torch.no_grad():  # the effective weight of any RMSNorm convention (Gemma's 1 + w included)
        ones = torch.ones(1, weight.shape[-1], dtype=weight.dtype, device=weight.device)
        return norm(ones).double()[0] * (1.0 + _eps(norm, weight.shape[-1])) ** 0.5


def head_weights(model, layer, fold_norms: bool = True) -> dict[str, torch.Tensor]:
    """One site's W_Q (h, m, d), W_K and W_V (g, m, d|e) and W_O (h, e, m) in float64, as row-vector maps, on the
    model's input device (a model split by a device map has its layers elsewhere; offloaded weights are loaded for
    the read). ``layer``: a site's name (``"decoder.blocks.0.cross_attn"``), or on a model with one site per
    layer the layer's number."""
    site = _check_site(model, layer)
    module, _ = model.projections_of(site)
    with onloaded(module):
        weights = _head_weights(model, site, fold_norms)
    return {name: w.to(model.device) for name, w in weights.items()}


def _check_site(model, layer) -> Site:
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


def _head_weights(model, site: Site, fold_norms: bool) -> dict[str, torch.Tensor]:
    module, proj = model.projections_of(site)  # paths relative to module
    o_proj = model.o_proj_of(site)
    if isinstance(proj, str) or o_proj is None:
        raise NotImplementedError(f"{site.name}'s weights cannot be split per head: "
                                  f"{proj if isinstance(proj, str) else 'no output projection reads z'}.")
    h, g, d, e = site.n_heads, site.n_kv_heads, site.d_head, site.d_head_v
    arange = torch.arange
    if proj.layout == "separate":
        q, k, v = (module.get_submodule(p) for p in (proj.q, proj.k, proj.v))
        w_q, w_k, w_v = _rows(q, arange(h * d)), _rows(k, arange(g * d)), _rows(v, arange(g * e))
    elif proj.layout == "concat":
        qkv = module.get_submodule(proj.q)
        w_q, w_k = _rows(qkv, arange(h * d)), _rows(qkv, arange(g * d) + h * d)
        w_v = _rows(qkv, arange(g * e) + h * d + g * d)
    else:  # interleaved per head: [q_h | k_h | v_h]
        qkv = module.get_submodule(proj.q)
        base = (arange(h)[:, None] * 3 * d + arange(d)).flatten()
        w_q, w_k, w_v = _rows(qkv, base), _rows(qkv, base + d), _rows(qkv, base + 2 * d)
    gamma = _norm_weight(model.in_norm_of(site)) if fold_norms else None
    if gamma is not None:  # a cross site's keys and values read the encoder's output, not this norm's
        w_q = gamma[:, None] * w_q
        if site.kind == "self":
            w_k, w_v = gamma[:, None] * w_k, gamma[:, None] * w_v
    w_o = o_proj.weight.detach().double()
    w_o = w_o if isinstance(o_proj, Conv1D) else w_o.T  # (h e, m)
    return {"W_Q": w_q.T.reshape(h, d, -1).transpose(1, 2), "W_K": w_k.T.reshape(g, d, -1).transpose(1, 2),
            "W_V": w_v.T.reshape(g, e, -1).transpose(1, 2), "W_O": w_o.reshape(h, e, -1)}


def qk_circuit(model, layer, fold_norms: bool = True) -> LowRank:
    """Every head's W_QK = W_Q @ W_K.T of a site (a layer's number on a model with one site per layer): LowRank
    with left (h, m, d), right (h, d, m)."""
    w = head_weights(model, layer, fold_norms)
    group = w["W_Q"].shape[0] // w["W_K"].shape[0]
    return LowRank(w["W_Q"], w["W_K"].repeat_interleave(group, 0).transpose(1, 2))


def ov_circuit(model, layer, fold_norms: bool = True) -> LowRank:
    """Every head's W_OV = W_V @ W_O of a site (a layer's number on a model with one site per layer): LowRank
    with left (h, m, e), right (h, e, m)."""
    w = head_weights(model, layer, fold_norms)
    group = w["W_Q"].shape[0] // w["W_V"].shape[0]
    return LowRank(w["W_V"].repeat_interleave(group, 0), w["W_O"])


def composition_scores(model, kind: str = "k", fold_norms: bool = True) -> pd.DataFrame:
    """Q-, K- or V-composition (``kind``) of every earlier head A with every later head B that reads what A
    writes.

    A writes the residual stream of its stack; B's queries read its own stack's stream and its keys and values
    the stream named by its site (``Site.keys``). So on a model with one stack, A is any head of an earlier
    layer; in an encoder-decoder model the pairs are within the encoder, within the decoder (a block's
    self-attention before its cross-attention included, for Q-composition into cross sites), and encoder heads
    into cross-attention keys and values (K- and V-composition: the cross site reads the encoder's final output;
    the encoder's final norm is not folded in). Decoder heads do not K- or V-compose with cross sites (those read
    no decoder head), and nothing composes into the encoder from the decoder.

    Rows: ``source_stack``, ``source_kind``, ``source_site``, ``source_layer``, ``source_head`` (A), then B's
    columns (``stack``, ``kind``, ``site``, ``layer``, ``head``), ``score`` in [0, 1]. Random matrices of these
    shapes score about ``sqrt(rank / d_model)``-sized values, so compare a score with the others, not with 0
    (``df.attrs["baseline"]`` holds the median over all pairs).
    """
    if kind not in ("q", "k", "v"):
        raise ValueError(f"kind must be 'q', 'k' or 'v'; got {kind!r}.")
    empty = set(getattr(model.cfg, "empty_layers", ()))  # pruned empty: a zeroed placeholder head, not a head
    sites = [s for s in model.cfg.sites if not (is_layered(model) and s.block in empty)
             and s.name not in getattr(model.cfg, "empty_sites", ())]
    ov = {s.name: ov_circuit(model, s.name, fold_norms) for s in sites}
    read = {s.name: (qk_circuit(model, s.name, fold_norms) if kind == "q" else qk_circuit(model, s.name, fold_norms).T
                     if kind == "k" else ov[s.name]) for s in sites}
    rows = []
    for j, b in enumerate(sites):
        reader = read[b.name]  # (H_b, m, r) @ (H_b, r, m)
        reader_norm = reader.norm()  # (H_b,)
        stream = b.queries if kind == "q" else b.keys  # the stream B's side reads
        for a in [a for a in sites[:j] if a.queries == stream]:
            writer = ov[a.name]
            writer_norm = writer.norm()  # (H_a,)
            pair = LowRank(writer.left[:, None], writer.right[:, None]) @ LowRank(reader.left[None], reader.right[None])
            scores = pair.norm() / (writer_norm[:, None] * reader_norm[None])  # (H_a, H_b)
            for ha in range(scores.shape[0]):
                source = {"source_stack": a.stack, "source_kind": a.kind, "source_site": a.name,
                          "source_layer": a.block, "source_head": ha}
                for hb in range(scores.shape[1]):
                    rows.append({**source, **head_columns(model, (b.name, hb)), "score": float(scores[ha, hb])})
    df = pd.DataFrame(rows, columns=[*SOURCE, *FRONT, "score"])
    df.attrs.update(kind=kind, fold_norms=fold_norms, baseline=float(df["score"].median()) if len(df) else float("nan"))
    return df
