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
for (``LowRank.full``). ``LowRank`` and ``head_weights`` live in ``interp.lens.circuits`` (the model's ``W_Q`` ... and
``OV``/``QK`` read them too).
"""

from __future__ import annotations

import pandas as pd

from interp.lens.circuits import LowRank, head_weights
from interp.model.config import real_sites
from interp.attention.sites import FRONT, head_columns

__all__ = ["LowRank", "head_weights", "qk_circuit", "ov_circuit", "composition_scores"]

SOURCE = ["source_stack", "source_kind", "source_site", "source_layer", "source_head"]  # head A's columns


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
    sites = real_sites(model)  # not a site pruned empty: its zeroed placeholder head is not a head
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
