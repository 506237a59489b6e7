"""Views of encoder-decoder models (a ``HookedModel`` of T5, BART, ...): what ``head_view`` and ``attention_grid`` read there.

Such a model has three kinds of attention, each a *site* (``model.cfg.sites``): what a decoder-only view calls a
layer is a site here. Encoder self-attention shows source tokens on both sides, decoder self-attention target
tokens, cross-attention target tokens (queries) against source tokens (keys); each side's padding is dropped.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .common import MAX_BYTES, SCALE, _b64, _quantise, visible_token

# Cross-attention scores of seq2seq_heads (analyses/seq2seq.py), coloured first in an encoder-decoder grid, and
# their one-line definitions, as that module's docstring gives them.
CROSS_SCORES = ("alignment", "source_positional_fraction", "source_sink")
CROSS_DEFINITIONS = {
    "alignment": "cross-attention: the weight a target position i puts on source position i (on the copy task, "
                 "the token being copied)",
    "source_sink": "cross-attention: the weight a target position puts on source position 0",
    "source_positional": "cross-attention: the share of target rows whose largest weight sits at one fixed offset "
                         "from the aligned source position (Voita et al. 2019); the offset is source_positional_offset",
}
_SIDES = {("encoder", "self"): ("source", "source"), ("decoder", "self"): ("target", "target"),
          ("decoder", "cross"): ("target", "source")}  # (stack, kind) -> where its queries and keys come from


@dataclass
class _Seq2SeqRun:
    """One source-target pair's cache from an encoder-decoder model: a site's pattern comes from
    ``cache.pattern(site)``; ``keep`` drops each side's padding, ``tokens`` labels each side."""

    cache: object
    batch: int
    keep: dict  # {"source": (p,) bool or None, "target": (t,) bool or None}
    tokens: dict  # {"source": labels, "target": labels}, padding dropped
    sites: list  # every Site of the model, in model.cfg.sites order
    available: list[int]  # sites whose patterns the cache can give
    name: str
    model: object = None
    unit = "site"

    @property
    def heads_per_layer(self) -> list[int]:
        return [s.n_heads for s in self.sites]

    @classmethod
    def from_model(cls, model, inputs, batch: int, layers: list[int] | None) -> _Seq2SeqRun:
        src, src_mask, tgt, tgt_mask = _seq2seq_inputs(model, inputs)
        if not 0 <= batch < src.shape[0]:
            raise IndexError(f"batch {batch} is out of range: the input holds {src.shape[0]} pair(s).")
        if tgt.shape[0] != src.shape[0]:
            raise ValueError(f"{src.shape[0]} source and {tgt.shape[0]} target sequences: give one target per source.")
        source = src[batch] if src_mask is None else src[batch][src_mask[batch].bool()]  # padding dropped: run alone
        target = tgt[batch] if tgt_mask is None else tgt[batch][tgt_mask[batch].bool()]
        sites = list(model.cfg.sites)
        layers = range(len(sites)) if layers is None else layers
        bad = [l for l in layers if not 0 <= l < len(sites)]
        if bad:
            raise IndexError(f"site {bad[0]} is out of range: this model has sites 0..{len(sites) - 1}.")
        names = [f"{sites[l].name}.hook_{kind}" for l in layers for kind in ("q", "k")]
        with model.studying(), torch.no_grad():
            _, cache = model.run_with_cache(source[None], None, names=names, decoder_input_ids=target[None])
        tokens = {side: [visible_token(t) for t in _str_tokens(model, ids)]
                  for side, ids in (("source", source), ("target", target))}
        return cls(cache, 0, {"source": None, "target": None}, tokens, sites, list(layers),
                   f"{type(model.hf).__name__} ({model.attn} path)", model)

    @classmethod
    def from_cache(cls, cache, tokens, batch: int) -> _Seq2SeqRun:
        sites = list(cache.sites)
        available = [i for i, s in enumerate(sites) if f"{s.name}.hook_pattern" in cache or
                     f"{s.name}.hook_q" in cache and f"{s.name}.hook_k" in cache]
        if not available:
            raise KeyError("This cache holds neither q and k nor patterns of any site; run_with_cache captures q "
                           "and k by default.")
        n_batch, lengths = None, {}
        for i in available:  # each side's padded length, from the sites captured
            site = sites[i]
            q_side, k_side = _SIDES[(site.stack, site.kind)]
            if f"{site.name}.hook_pattern" in cache:
                n_batch, _, lengths[q_side], lengths[k_side] = cache[f"{site.name}.hook_pattern"].shape
            else:
                n_batch, lengths[q_side] = cache[f"{site.name}.hook_q"].shape[:2]
                lengths[k_side] = cache[f"{site.name}.hook_k"].shape[1]
        if not 0 <= batch < n_batch:
            raise IndexError(f"batch {batch} is out of range: the cache holds {n_batch} pair(s).")
        masks = {"source": cache.source_mask, "target": cache.target_mask}
        for side, mask in masks.items():  # a side no captured site reads: its length from its mask
            if side not in lengths:
                lengths[side] = 0 if mask is None else mask.shape[1]
        if isinstance(tokens, str):
            raise TypeError("A cache cannot tokenize text: pass (source tokens, target tokens), e.g. "
                            "model.tokenizer.convert_ids_to_tokens of each, or give the model and the texts.")
        if isinstance(tokens, Mapping):
            tokens = (tokens.get("input_ids"), tokens.get("decoder_input_ids"))
        if tokens is not None and not (isinstance(tokens, (tuple, list)) and len(tokens) == 2):
            raise TypeError("An encoder-decoder cache is labelled with (source tokens, target tokens), or the batch "
                            f"dict it was run on; got {type(tokens).__name__}.")
        keep, labels = {}, {}
        for side, given in zip(("source", "target"), (None, None) if tokens is None else tokens):
            mask = masks[side]
            keep[side] = None if mask is None else mask[batch].bool().cpu()
            labels[side] = _labels_of(given, batch, lengths[side], keep[side], side)
        return cls(cache, batch, keep, labels, sites, available, "cached run")

    def pattern(self, layer: int, heads: list[int]) -> torch.Tensor:
        """(h, q, k) float32 on the CPU, padding dropped on both sides."""
        site = self.sites[layer]
        q_side, k_side = _SIDES[(site.stack, site.kind)]
        p = self.cache.pattern(layer, heads)[self.batch].float().cpu()
        if self.keep[q_side] is not None:
            p = p[:, self.keep[q_side]]
        return p if self.keep[k_side] is None else p[:, :, self.keep[k_side]]


def _seq2seq_inputs(model, inputs):
    """(source ids, mask or None, decoder input ids, mask or None), each ``(b, p)``, from what head_view takes."""
    if isinstance(inputs, Mapping):
        if "input_ids" not in inputs or not {"decoder_input_ids", "labels"} & set(inputs):
            raise ValueError(f"A batch for an encoder-decoder view needs input_ids and decoder_input_ids (or labels); "
                             f"got keys {sorted(inputs)}.")
        src, src_mask = model._ids(inputs["input_ids"], inputs.get("attention_mask"), "input_ids")
        if "decoder_input_ids" in inputs:
            tgt, tgt_mask = model._ids(inputs["decoder_input_ids"], inputs.get("decoder_attention_mask"),
                                       "decoder_input_ids")
            return src, src_mask, tgt, tgt_mask
        labels, labels_mask = model._ids(inputs["labels"], inputs.get("decoder_attention_mask"), "labels")
    elif isinstance(inputs, (tuple, list)) and len(inputs) == 2:
        src, src_mask = model._ids(inputs[0], None, "input_ids")  # text is tokenized, padded on the right
        labels, labels_mask = model._ids(inputs[1], None, "labels")
    else:
        raise ValueError("An encoder-decoder view needs a source and a target: pass (source, target) (texts or token "
                         "ids) or a batch dict with input_ids and decoder_input_ids; got "
                         f"{'nothing' if inputs is None else type(inputs).__name__}.")
    tgt = model.decoder_inputs(labels)  # teacher forcing: the targets shifted right behind the start token
    tgt_mask = None if labels_mask is None else torch.cat([torch.ones_like(labels_mask[:, :1]), labels_mask[:, :-1]], 1)
    return src, src_mask, tgt, tgt_mask


def _str_tokens(model, ids: torch.Tensor) -> list[str]:
    if model.tokenizer is None:
        return [str(int(i)) for i in ids]
    return model.tokenizer.convert_ids_to_tokens(ids.tolist())


def _labels_of(tokens, batch: int, n_pos: int, keep: torch.Tensor | None, side: str) -> list[str]:
    """Token labels of one side of one pair, padding dropped (positions where none are given)."""
    n_real = n_pos if keep is None else int(keep.sum())
    if tokens is None:
        return [str(i) for i in range(n_real)]
    if isinstance(tokens, torch.Tensor) and tokens.ndim == 2 or \
            isinstance(tokens, Sequence) and tokens and isinstance(tokens[0], (list, tuple, torch.Tensor)):
        tokens = tokens[batch]
    labels = [visible_token(t.item() if isinstance(t, torch.Tensor) else t) for t in tokens]
    if keep is not None and len(labels) == len(keep):
        labels = [t for t, k in zip(labels, keep.tolist()) if k]
    if len(labels) != n_real:
        raise ValueError(f"{len(labels)} {side} token labels for a {side} of {n_real} real positions.")
    return labels


def _site_indices(source, layers, heads):
    """For an encoder-decoder model or cache, ``layers`` and ``(site, head)`` pairs with site names turned into
    indices into its sites; anything else unchanged."""
    from ..seq2seq import is_seq2seq

    if not is_seq2seq(source):
        return layers, heads
    sites = [s.name for s in (source.cfg.sites if hasattr(source, "cfg") else source.sites)]

    def index(site):
        if isinstance(site, str):
            if site not in sites:
                close = difflib.get_close_matches(site, sites, n=3, cutoff=0.5) or sites[:3]
                raise KeyError(f"{site!r} is not an attention site of this model; closest: {close} "
                               f"(model.cfg.sites has {len(sites)}).")
            return sites.index(site)
        return site

    if isinstance(layers, (str, int)):
        layers = [index(layers)]
    elif layers is not None:
        layers = [index(l) for l in layers]
    if heads is not None and len(heads) and isinstance(heads[0], (tuple, list)):
        heads = [(index(l), h) for l, h in heads]
    return layers, heads


def _embed_sites(run: _Seq2SeqRun, chosen: dict[int, list[int]], window, what: str) -> dict:
    """An encoder-decoder model's data: both sides' tokens, each site's stack, kind and sides, the chosen heads'
    weights site after site, each ``(q, k)`` (the lower triangle alone where a square site has nothing above)."""
    if window is not None:
        raise ValueError("window= picks positions of one sequence; an encoder-decoder view shows its source and target "
                         "whole: give shorter inputs, or fewer sites and heads with layers= and heads=.")
    sides = {site.name: _SIDES[(site.stack, site.kind)] for site in run.sites}
    n = {side: len(tokens) for side, tokens in run.tokens.items()}
    size = 2 * sum(len(heads) * n[sides[run.sites[l].name][0]] * n[sides[run.sites[l].name][1]]
                   for l, heads in chosen.items()) * 4 / 3
    if size > MAX_BYTES:
        raise ValueError(f"This {what} would embed about {size / 1e6:.0f} MB of weights ({n['source']} source and "
                         f"{n['target']} target tokens); show fewer sites and heads with layers= and heads=.")
    flat, packed = [], []
    for layer, heads in chosen.items():
        weights = _quantise(run.pattern(layer, heads), run.sites[layer].name, heads)  # (h, q, k) uint16
        square = weights.shape[1] == weights.shape[2]
        packed.append(bool(square and not np.triu(weights, 1).any()))
        rows, cols = np.tril_indices(weights.shape[1])
        flat.append(weights[:, rows, cols].reshape(-1) if packed[-1] else weights.reshape(-1))
    return {
        "source": {"tokens": run.tokens["source"], "positions": list(range(n["source"]))},
        "target": {"tokens": run.tokens["target"], "positions": list(range(n["target"]))},
        "sites": [{"name": s.name, "stack": s.stack, "block": s.block, "kind": s.kind, "title": s.label,
                   "label": f"{s.stack} {s.block} {s.kind}", "query": sides[s.name][0], "key": sides[s.name][1]}
                  for s in run.sites],
        "window": None, "layers": list(chosen), "heads": list(chosen.values()), "packed": packed, "scale": SCALE,
        "weights": _b64(np.concatenate(flat)), "outside": None,
    }
