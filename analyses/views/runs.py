"""What a view reads, the same for every model: one run (or a cache of one) and the attention *sites* it offers.

A site's queries and keys come from a batch entry (``site.queries``, ``site.keys``: ``input_ids``, or the
``decoder_input_ids`` of a model with a decoder stack fed separately). A decoder-only or encoder model has one entry
and one site per layer, so its selector offers layers (``blocks.3.attn`` is layer 3); an encoder-decoder model has
two entries, the page's source and target, and its selector offers every site ("encoder 0 self", "decoder 0 cross").
A run keeps one sequence of each entry, with its padding dropped. A run made with ``weighting="norm"`` gives
norm-weighted attention instead of the pattern (``interp.attention.site_pass.norm_weighted``: each key's weight times
its ``||v_j W_O||``, rows renormalised), from the values it captured and the model's ``W_O``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from hooks.names import attn_site, hook_name
from interp.attention.sites import MASK_OF

from .common import model_tokens, visible_token

SIDES = {"input_ids": "source", "decoder_input_ids": "target"}  # the page's name of an entry, where there are two


@dataclass(frozen=True)
class _Place:
    """One entry of a view's selector: a site (a layer, where each layer has one site)."""

    name: str
    n_heads: int
    queries: str = "input_ids"
    keys: str = "input_ids"
    stack: str = ""
    block: int = 0
    kind: str = "self"
    title: str = ""

    @property
    def label(self) -> str:
        return f"{self.stack} {self.block} {self.kind}"


def _places(sites) -> list[_Place]:
    return [_Place(s.name, s.n_heads, s.queries, s.keys, s.stack, s.block, s.kind, s.label) for s in sites]


def _cache_places(cache) -> list[_Place]:
    """A cache's sites: those it records, else one per layer from its attention metadata (or, for a cache of
    patterns made by hand, from the patterns it holds)."""
    sites = getattr(cache, "sites", None)
    if sites:
        return _places(sites)
    if cache.meta is not None:
        return [_Place(attn_site(l), cache.meta.heads(l)[0]) for l in range(len(cache.meta.scaling))]
    layers = sorted(int(k.split(".")[1]) for k in cache.keys() if k.startswith("blocks.") and
                    k.endswith(".attn.hook_pattern"))
    return [_Place(attn_site(l), cache["pattern", l].shape[1] if l in layers else 0)
            for l in range(max(layers) + 1 if layers else 0)]


def places_of(source) -> list[_Place]:
    """The sites a model or cache offers, in ``model.cfg.sites`` order; [] for anything else."""
    cfg = getattr(source, "cfg", None)
    if cfg is not None:
        return _places(cfg.sites)
    return _cache_places(source) if hasattr(source, "meta") else []


def site_indices(places: list[_Place], layers, heads):
    """``layers`` and ``(site, head)`` pairs with site names turned into indices into ``places``."""
    names = [p.name for p in places]

    def index(site):
        if isinstance(site, str):
            if site not in names:
                close = difflib.get_close_matches(site, names, n=3, cutoff=0.5) or names[:3]
                raise KeyError(f"{site!r} is not an attention site of this model; closest: {close} "
                               f"(model.cfg.sites has {len(names)}).")
            return names.index(site)
        return site

    if isinstance(layers, (str, int)):
        layers = [index(layers)]
    elif layers is not None:
        layers = [index(l) for l in layers]
    if heads is not None and len(heads) and isinstance(heads[0], (tuple, list)):
        heads = [(index(l), h) for l, h in heads]
    return layers, heads


@dataclass
class _Run:
    """One sequence (or source-target pair) of a run: a site's pattern comes from ``cache.pattern(index)``;
    ``keep`` drops each entry's padding, ``tokens`` labels each entry."""

    cache: object
    batch: int
    keep: dict  # {entry: (p,) bool, or None where the sequence has no padding}
    tokens: dict  # {entry: labels}, padding dropped
    places: list  # every site, in model.cfg.sites order
    available: list[int]  # sites whose patterns the cache can give
    name: str
    model: object = None
    weighting: str = "raw"  # "norm": patterns are norm-weighted (the model's run captured v)

    @property
    def multi(self) -> bool:
        """Whether the sites read more than one sequence (an encoder-decoder model's source and target)."""
        return len(self.tokens) > 1

    @property
    def unit(self) -> str:
        return "site" if self.multi else "layer"

    @property
    def heads_per_layer(self) -> list[int]:
        return [p.n_heads for p in self.places]

    @classmethod
    def of(cls, source, text_or_tokens, batch: int, layers: list[int] | None, weighting: str = "raw") -> _Run:
        from hooks import ActivationCache
        from interp import HookedModel
        from interp.attention.site_pass import WEIGHTINGS

        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting is one of {WEIGHTINGS} (the attention weights, or norm-weighted attention); "
                             f"got {weighting!r}.")
        if isinstance(source, HookedModel):
            return cls._from_model(source, text_or_tokens, batch, layers, weighting)
        if isinstance(source, ActivationCache):
            if weighting != "raw":
                raise ValueError("weighting='norm' reads each head's W_O, which a cache does not hold: pass the model "
                                 "and the text or tokens instead of the cache.")
            return cls._from_cache(source, text_or_tokens, batch)
        raise TypeError(f"A view reads a HookedModel with text or tokens, or an ActivationCache from "
                        f"run_with_cache; got {type(source).__name__}.")

    @classmethod
    def _from_model(cls, model, inputs, batch: int, layers: list[int] | None, weighting: str = "raw") -> _Run:
        places = places_of(model)
        entries = _entries(places)
        feed = _model_batch(model, inputs, entries)
        n = feed[entries[0]].shape[0]
        if not 0 <= batch < n:
            raise IndexError(f"batch {batch} is out of range: the input holds {n} {_what(entries)}.")
        if any(feed[e].shape[0] != n for e in entries):
            raise ValueError(f"{n} source and {feed[entries[-1]].shape[0]} target sequences: give one target per "
                             "source.")
        rows = {e: feed[e][batch] if feed[MASK_OF[e]] is None else feed[e][batch][feed[MASK_OF[e]][batch].bool()]
                for e in entries}  # padding dropped: each sequence runs alone
        unit = "site" if len(entries) > 1 else "layer"
        layers = range(len(places)) if layers is None else layers
        bad = [l for l in layers if not 0 <= l < len(places)]
        if bad:
            raise IndexError(f"{unit} {bad[0]} is out of range: this model has {unit}s 0..{len(places) - 1}.")
        kinds = ("q", "k", "v") if weighting == "norm" else ("q", "k")
        names = [hook_name(kind, places[l].name) for l in layers for kind in kinds]
        first, *rest = entries
        with model.studying(), torch.no_grad():
            _, cache = model.run_with_cache(rows[first][None], None, names=names, **{e: rows[e][None] for e in rest})
        name = f"{type(model.hf).__name__} ({model.attn} path{', norm-weighted' if weighting == 'norm' else ''})"
        return cls(cache, 0, dict.fromkeys(entries), {e: model_tokens(model, r) for e, r in rows.items()}, places,
                   list(layers), name, model, weighting)

    @classmethod
    def _from_cache(cls, cache, tokens, batch: int) -> _Run:
        places = _cache_places(cache)
        entries = _entries(places)
        rebuilds = cache.meta is not None or bool(getattr(cache, "sites", None))  # q and k give the pattern
        available = [i for i, p in enumerate(places) if p.n_heads and (
            hook_name("pattern", p.name) in cache
            or rebuilds and hook_name("q", p.name) in cache and hook_name("k", p.name) in cache)]
        if not available:
            unit = "site" if len(entries) > 1 else "layer"
            raise KeyError(f"This cache holds neither q and k nor patterns of any {unit}; run_with_cache captures q "
                           "and k by default.")
        n_batch, lengths = None, {}
        for i in available:  # each entry's padded length, from the sites captured
            p = places[i]
            if hook_name("pattern", p.name) in cache:
                n_batch, _, lengths[p.queries], lengths[p.keys] = cache[hook_name("pattern", p.name)].shape
            else:
                n_batch, lengths[p.queries] = cache[hook_name("q", p.name)].shape[:2]
                lengths[p.keys] = cache[hook_name("k", p.name)].shape[1]
        if not 0 <= batch < n_batch:
            raise IndexError(f"batch {batch} is out of range: the cache holds {n_batch} {_what(entries)}.")
        masks = _cache_masks(cache)
        keep, labels = {}, {}
        for entry, given in zip(entries, _token_lists(tokens, entries)):
            mask = masks.get(entry)
            keep[entry] = None if mask is None else mask[batch].bool().cpu()
            n_pos = lengths.get(entry, 0 if mask is None else mask.shape[1])  # an entry no captured site reads
            labels[entry] = _labels_of(given, batch, n_pos, keep[entry], SIDES[entry] if len(entries) > 1 else "")
        return cls(cache, batch, keep, labels, places, available, "cached run")

    def pattern(self, index: int, heads: list[int]) -> torch.Tensor:
        """(h, q, k) float32 on the CPU, padding dropped on both sides."""
        place = self.places[index]
        p = self.cache.pattern(index, heads)[self.batch].float().cpu()
        if self.weighting == "norm":  # a model's run: one sequence, no padding
            from interp.attention.site_pass import key_output_norms, norm_weighted
            from interp.lens.circuits import output_grams

            v = self.cache[hook_name("v", place.name)][self.batch][None]  # (1, k, g, e)
            norms = key_output_norms(v, output_grams(self.model, [index])[index])[0, heads].cpu()  # (h, k)
            p = norm_weighted(p, norms)
        if self.keep[place.queries] is not None:
            p = p[:, self.keep[place.queries]]
        return p if self.keep[place.keys] is None else p[:, :, self.keep[place.keys]]


def _entries(places) -> list[str]:
    """The batch entries the sites read, ``input_ids`` first."""
    return sorted({e for p in places for e in (p.queries, p.keys)} or {"input_ids"}, key=list(MASK_OF).index)


def _what(entries) -> str:
    return "pair(s)" if len(entries) > 1 else "sequence(s)"


def _model_batch(model, inputs, entries: list[str]) -> dict:
    """``{entry: ids (b, p), mask entry: (b, p) or None}`` of what a view is given: a model whose sites read two
    sequences takes a (source, target) pair or a batch dict (``analyses.data.seq2seq.pair_batch``)."""
    if len(entries) > 1:
        from ..data.seq2seq import pair_batch

        return pair_batch(model, inputs)
    if inputs is None:
        raise ValueError("head_view(model, text_or_tokens): give the text (or token ids) to run.")
    ids, mask = model._inputs(inputs)
    return {"input_ids": ids, "attention_mask": mask}


def _cache_masks(cache) -> dict:
    """Each entry's padding mask ``(b, p)`` (None: no padding) as the run had it."""
    if hasattr(cache, "target_mask"):  # a cache that records each entry's mask
        return {"input_ids": cache.source_mask, "decoder_input_ids": cache.target_mask}
    return {"input_ids": None if cache.meta is None else cache.meta.attention_mask}


def _token_lists(tokens, entries: list[str]) -> list:
    """The labels given for each entry: one list (or ``(b, p)``) for one sequence; for two, a (source, target) pair
    or the batch dict the cache was run on."""
    if isinstance(tokens, str):
        example = ("(source tokens, target tokens), e.g. model.tokenizer.convert_ids_to_tokens of each"
                   if len(entries) > 1 else "its token strings, e.g. model.to_str_tokens(ids)")
        raise TypeError(f"A cache cannot tokenize text: pass {example}, or give the model and the text instead of "
                        "the cache.")
    if isinstance(tokens, Mapping):
        return [tokens.get(e) for e in entries]
    if len(entries) == 1:
        return [tokens]
    if tokens is not None and not (isinstance(tokens, (tuple, list)) and len(tokens) == 2):
        raise TypeError("An encoder-decoder cache is labelled with (source tokens, target tokens), or the batch "
                        f"dict it was run on; got {type(tokens).__name__}.")
    return [None, None] if tokens is None else list(tokens)


def _labels_of(tokens, batch: int, n_pos: int, keep: torch.Tensor | None, side: str) -> list[str]:
    """Token labels of one sequence, padding dropped (positions where none are given)."""
    n_real = n_pos if keep is None else int(keep.sum())
    if tokens is None:
        tokens = [str(i) for i in range(n_pos)]  # the real positions keep their numbers
    elif isinstance(tokens, torch.Tensor) and tokens.ndim == 2 or \
            isinstance(tokens, Sequence) and tokens and isinstance(tokens[0], (list, tuple, torch.Tensor)):
        tokens = tokens[batch]
    labels = [visible_token(t.item() if isinstance(t, torch.Tensor) else t) for t in tokens]
    if keep is not None and len(labels) == len(keep):
        labels = [t for t, k in zip(labels, keep.tolist()) if k]
    if len(labels) != n_real:
        raise ValueError(f"{len(labels)} {side + ' ' if side else ''}token labels for a {side or 'sequence'} of "
                         f"{n_real} real positions.")
    return labels
