"""Weight-based head classes of the literature: successor heads and copy-suppression (negative) heads.

Both read a head's OV circuit on a token's *effective embedding* and map the result to logits:

    eff(t)     = the residual stream after block 0 on the one-token input [t] with block 0's attention removed
                 (its heads zero-ablated): W_E t (+ position 0's embedding where the model adds one) + MLP0 of it,
                 with whatever norms the model applies around MLP0 (Gould et al. 2023's "embedding through the
                 first MLP", with the residual; McDougall et al. 2023's effective embedding without attention).
    out_h(t)   = norm_l(eff(t)) @ W_V^h @ W_O^h   (norm_l: the norm layer l's attention reads its input through,
                 applied as the model applies it; biases left out)
    logits_h(t) = out_h(t) through the post-attention norm (where the model has one) and the final norm, their
                 scales frozen (a positive number per row, which changes no ranking), then W_U (no bias).

Every head of every layer is scored on the same eff(t), layer 0 included.

- ``successor`` (Gould et al. 2023, "Successor Heads: Recurring, Interpretable Attention Heads In The Wild"):
  over ordinal lists (``data/ordinal_lists.json``: digits, numbers, number words, ordinals, days, months,
  letters...; each list with and without a leading space, items kept where they are one token), the fraction of
  items ``t`` with a successor for which ``logits_h(t)``, restricted to that list's tokens, is largest at
  ``succ(t)``. Published threshold 0.4.
- ``copy_suppression`` (McDougall et al. 2023, "Copy Suppression: Comprehensively Understanding an Attention
  Head"): over a sample of ordinary tokens, the fraction for which ``logits_h(t)`` puts ``t`` itself among the
  ``k`` (default 10) most *negative* logits of the whole vocabulary (their negative copy score). GPT-2 small's
  L10H7 is the reference head.

Intervals: 95% percentile bootstrap over items (tokens).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pandas as pd
import torch

from hooks.names import hook_name
from interp.config import real_sites
from interp.distributed import onloaded

from .ablation import ablate_heads
from .attribution import _unembedding, frozen_norm
from .composition import ov_circuit
from .bootstrap import check_n_bootstrap, mean_interval
from .taxonomy_base import check_k, refuse_non_lm, refuse_stacks

__all__ = ["successor_scores", "copy_suppression_scores", "effective_embedding", "ordinal_lists", "ORDINAL_LISTS"]

ORDINAL_LISTS = Path(__file__).resolve().parent / "data" / "ordinal_lists.json"


@cache
def _bundled_lists() -> dict[str, tuple[str, ...]]:
    return {k: tuple(v) for k, v in json.loads(ORDINAL_LISTS.read_text(encoding="utf-8"))["lists"].items()}


def ordinal_lists(model) -> dict[str, list[tuple[int, int]]]:
    """The bundled ordinal lists in the model's tokenizer: name -> ``(token, successor token)`` id pairs, each list
    once as written and once with a leading space (``"days"``, ``"days_space"``). An item is kept where it is one
    token (not the tokenizer's unknown token); a pair where both items are kept and adjacent in the list; a list
    where it keeps at least 2 pairs."""
    if model.tokenizer is None:
        raise ValueError("ordinal_lists needs the model's tokenizer; give lists={name: [token ids in order]} "
                         "instead.")
    tok = model.tokenizer
    unknown = [tok.unk_token_id] if tok.unk_token_id is not None else []
    out = {}
    for name, items in _bundled_lists().items():
        for suffix, prefix in (("", ""), ("_space", " ")):
            ids = [tok(prefix + item, add_special_tokens=False)["input_ids"] for item in items]
            ids = [[] if a == unknown else a for a in ids]  # an item the tokenizer cannot read is not kept
            singles = [a[0] for a in ids if len(a) == 1]
            pairs = [(a[0], b[0]) for a, b in zip(ids, ids[1:]) if len(a) == 1 and len(b) == 1]
            if len(pairs) >= 2 and len(set(singles)) == len(singles):
                out[name + suffix] = pairs
    return out


def _as_pairs(lists) -> dict[str, list[tuple[int, int]]]:
    """User lists ``{name: [id, id, ...]}`` (in order), or ``{name: [(id, successor id), ...]}``, as pairs."""
    out = {}
    for name, ids in dict(lists).items():
        if all(isinstance(i, (tuple, list)) and len(i) == 2 for i in ids):  # already (token, successor) pairs
            out[name] = [(int(a), int(b)) for a, b in ids]
            continue
        ids = [int(i) for i in ids]
        if len(ids) < 2 or len(set(ids)) != len(ids):
            raise ValueError(f"list {name!r} must hold at least 2 distinct token ids in order; got {ids}.")
        out[name] = list(zip(ids, ids[1:]))
    return out


def effective_embedding(model, ids) -> torch.Tensor:
    """eff(t) for token ids ``ids: (n,)``: ``(n, d_model)`` float32 (see the module docstring)."""
    refuse_stacks(model, "effective_embedding")
    ids = torch.as_tensor(ids).long().flatten()
    layer0 = [(0, h) for h in range(model.cfg.heads_per_layer[0])] if 0 in _scored_layers(model) else []
    kept = {}

    def keep(resid, hook):
        kept["x"] = resid[:, 0].detach().float()

    with model.studying(), torch.no_grad(), model.hooks([(hook_name("resid_post", 0), keep)]):
        if layer0:
            with ablate_heads(model, layer0):
                model(ids[:, None].to(model.device))
        else:
            model(ids[:, None].to(model.device))
    return kept["x"].cpu()


def _readout(model, layer: int) -> tuple[torch.nn.Module | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(norm_in, W_V (h, m, e), B (h, e, m), W_U (vocab, m))``: a head's logits on a residual ``x`` are
    ``norm_in(x) @ W_V @ B @ W_U.T`` up to a positive factor per row (B folds the post-attention and final norms'
    weights, and a LayerNorm's centring, into W_O)."""
    s = model.structure
    block = model._blocks[layer]
    norm_in = block.get_submodule(s.attn_in_norm[layer]) if s.attn_in_norm and s.attn_in_norm[layer] else None
    ov = ov_circuit(model, layer, fold_norms=False)
    w_v, w_o = ov.left.float().cpu(), ov.right.float().cpu()  # (h, m, e), (h, e, m)
    probe = torch.ones(1, w_o.shape[-1])
    probe[0, 1::2] = -1.0  # mean 0, mean square 1: the frozen scale is 1 (up to eps)
    norms = [block.get_submodule(s.post_attn_norm[layer])] if s.post_attn_norm and s.post_attn_norm[layer] else []
    norms.append(model.hf.get_submodule(s.final_norm))
    unembed = _unembedding(model)
    for norm in norms:
        with onloaded(norm):
            param = next(norm.parameters(), None)
            apply, _ = frozen_norm(norm, probe.to(param.device if param is not None else "cpu"))
            w_o = apply(w_o.to(probe.device if param is None else param.device)).float().cpu()
    with onloaded(unembed):
        w_u = unembed.weight.detach().float().cpu()
    return norm_in, w_v, w_o, w_u


def _head_inputs(model, norm_in, eff: torch.Tensor) -> torch.Tensor:
    if norm_in is None:
        return eff
    with torch.no_grad(), onloaded(norm_in):
        param = next(norm_in.parameters(), None)
        device, dtype = (param.device, param.dtype) if param is not None else (eff.device, eff.dtype)
        return norm_in(eff.to(device, dtype)).float().cpu()


def _scored_layers(model) -> list[int]:
    return [s.block for s in real_sites(model)]


def _frame(model, name: str, hits: dict[int, torch.Tensor], n_bootstrap: int, seed: int) -> pd.DataFrame:
    rows = []
    for layer, layer_hits in hits.items():  # (items, h)
        mean, lo, hi = mean_interval(layer_hits, n_bootstrap, seed)
        for head in range(layer_hits.shape[1]):
            rows.append({"layer": layer, "head": head, name: float(mean[head]), f"{name}_lo": float(lo[head]),
                         f"{name}_hi": float(hi[head])})
    return pd.DataFrame(rows, columns=["layer", "head", name, f"{name}_lo", f"{name}_hi"])


def successor_scores(model, lists=None, n_bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Every head's successor score (Gould et al. 2023; module docstring): one row per (layer, head) with
    ``successor``, ``successor_lo``, ``successor_hi``.

    lists: None (the bundled ordinal lists in the model's tokenizer, ``ordinal_lists``), ``{name: [token ids in
    order]}`` or ``{name: [(token, successor), ...]}``. ``df.attrs["items"]`` holds the number of scored items, ``df.attrs["lists"]`` the list names.
    """
    refuse_non_lm(model, "The successor score")
    check_n_bootstrap(n_bootstrap)
    pairs = ordinal_lists(model) if lists is None else _as_pairs(lists)
    if not pairs:
        raise ValueError("No ordinal list has 2 single-token successor pairs in this tokenizer; give lists=.")
    vocab = model.cfg.vocab_size
    bad = [t for p in pairs.values() for pair in p for t in pair if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab}).")
    sources = torch.tensor([a for p in pairs.values() for a, _ in p])
    # per item: the list's token ids, and which of them is the successor
    members = [sorted({t for pair in p for t in pair}) for p in pairs.values()]
    items = [(m, m.index(b)) for m, p in zip(members, pairs.values()) for _, b in p]
    eff = effective_embedding(model, sources)
    hits = {}
    with model.studying():
        for layer in _scored_layers(model):
            norm_in, w_v, w_o, w_u = _readout(model, layer)
            out = (_head_inputs(model, norm_in, eff) @ w_v) @ w_o  # (h, n, m)
            layer_hits = torch.zeros(len(items), out.shape[0], dtype=torch.bool)
            for i, (member, succ) in enumerate(items):
                logits = out[:, i] @ w_u[member].T  # (h, list)
                layer_hits[i] = logits.argmax(-1) == succ
            hits[layer] = layer_hits
    df = _frame(model, "successor", hits, n_bootstrap, seed)
    df.attrs.update(items=len(items), lists=list(pairs))
    return df


def copy_suppression_scores(model, tokens=None, n_tokens: int = 200, k: int = 10, n_bootstrap: int = 1000,
                            seed: int = 0) -> pd.DataFrame:
    """Every head's negative copy score (McDougall et al. 2023; module docstring): one row per (layer, head) with
    ``copy_suppression``, ``copy_suppression_lo``, ``copy_suppression_hi``.

    tokens: the token ids to score (default: ``n_tokens`` ordinary tokens drawn with ``seed``). k: a token counts
    when it is among the ``k`` most negative logits of the whole vocabulary.
    """
    from .prompts import _ordinary_ids

    refuse_non_lm(model, "The copy-suppression score")
    check_n_bootstrap(n_bootstrap)
    check_k(model, k)
    if tokens is None:
        pool = _ordinary_ids(model)
        g = torch.Generator().manual_seed(seed)
        tokens = pool[torch.randperm(len(pool), generator=g)[:n_tokens]]
    tokens = torch.as_tensor(tokens).long().flatten()
    if tokens.numel() == 0 or int(tokens.min()) < 0 or int(tokens.max()) >= model.cfg.vocab_size:
        raise ValueError(f"tokens must be ids in [0, {model.cfg.vocab_size}); got {tokens.tolist()[:5]}...")
    eff = effective_embedding(model, tokens)
    rows = torch.arange(len(tokens))
    hits = {}
    with model.studying():
        for layer in _scored_layers(model):
            norm_in, w_v, w_o, w_u = _readout(model, layer)
            values = _head_inputs(model, norm_in, eff) @ w_v  # (h, n, e)
            layer_hits = torch.zeros(len(tokens), w_v.shape[0], dtype=torch.bool)
            for head in range(w_v.shape[0]):
                # (n, vocab), multiplied in the cheaper order
                logits = (values[head] @ w_o[head] @ w_u.T if len(tokens) < w_o.shape[1]
                          else values[head] @ (w_o[head] @ w_u.T))
                own = logits[rows, tokens]
                layer_hits[:, head] = (logits < own[:, None]).sum(-1) < k
            hits[layer] = layer_hits
    df = _frame(model, "copy_suppression", hits, n_bootstrap, seed)
    df.attrs.update(tokens=len(tokens), k=k)
    return df


# -- detect_heads's dispatch -------------------------------------------------------------------------------------
def taxonomy_frame(model, names: list[str], seed: int = 0, n_bootstrap: int = 1000,
                   thresholds: dict[str, float] | None = None, **_) -> pd.DataFrame:
    """The taxonomy scores ``names`` of every head, merged on (layer, head); ``io_attention`` comes with
    ``name_mover`` (its label needs it), and ``s_inhibition`` brings ``name_mover`` along (its receivers). The
    registry's runner of these scores (``detect_heads`` passes ``context`` too, which they do not read)."""
    refuse_non_lm(model, f"The score(s) {names}")
    check_n_bootstrap(n_bootstrap)
    frames = []
    if "successor" in names:
        frames.append(successor_scores(model, n_bootstrap=n_bootstrap, seed=seed))
    if "copy_suppression" in names:
        frames.append(copy_suppression_scores(model, n_bootstrap=n_bootstrap, seed=seed))
    if "copy_suppression_behaviour" in names:
        from .taxonomy_behaviour import copy_suppression_behaviour_scores

        frames.append(copy_suppression_behaviour_scores(model, n_bootstrap=n_bootstrap, seed=seed))
    if "name_mover" in names or "s_inhibition" in names:
        from .taxonomy_ioi import _ioi, name_mover_scores, s_inhibition_scores

        task = _ioi(model, 32, seed)[:3]
        movers = name_mover_scores(model, seed=seed, n_bootstrap=n_bootstrap, task=task)
        frames.append(movers)
        if "s_inhibition" in names:
            frames.append(s_inhibition_scores(model, seed=seed, n_bootstrap=n_bootstrap, task=task,
                                              name_movers=movers, thresholds=thresholds))
    if "function_vector" in names:
        from .function_vectors import function_vector_scores

        fv = function_vector_scores(model, seed=seed, n_bootstrap=n_bootstrap)
        frames.append(fv)
    df = frames[0]
    for other in frames[1:]:
        df = df.merge(other, on=["layer", "head"], how="outer")
    attrs = {}
    for frame in frames:
        attrs.update({k: v for k, v in frame.attrs.items() if k != "mean_z"})
    df.attrs.update(taxonomy=attrs)
    return df
