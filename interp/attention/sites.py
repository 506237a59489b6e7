"""Attention sites: every model is a list of them, and every head is a ``(site, head)``.

A site is one attention module as the model calls it: ``blocks.3.attn`` in a decoder-only or encoder-only model
(one site per layer), ``encoder.blocks.1.attn``, ``decoder.blocks.0.attn`` and ``decoder.blocks.0.cross_attn`` in
an encoder-decoder model. ``model.cfg.sites`` lists them in call order and ``model.sites`` maps name -> Site.
A site's name is the prefix of its hook points (``f"{site.name}.hook_z"``), and what differs between kinds of
model is data on it: its stack, kind, and which batch entries its queries and keys come from.

``check_heads`` is the one reader of head lists for every study: ``(site, head)`` pairs on every model, and on a
model with one site per layer ``(layer, head)`` as the shorthand (returned as such, so existing code keeps
working). ``head_columns`` gives the leading columns of every per-head result table, the same on every model.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["FRONT", "MASK_OF", "Site", "all_heads", "check_heads", "head_columns", "head_key", "is_layered", "one_site_per_layer", "row_head", "site_of",
           "with_head_columns"]

FRONT = ["stack", "kind", "site", "layer", "head"]  # the columns that name a head, first in every head table
MASK_OF = {"input_ids": "attention_mask", "decoder_input_ids": "decoder_attention_mask"}


@dataclass(frozen=True)
class Site:
    """One attention module: its hook prefix (``name``), stack (``"decoder"`` or ``"encoder"``), block index
    within the stack, kind (``"self"`` or ``"cross"``), shape, the scale the model passes, and the features its
    attention has (window ``(before, after)`` or None, soft-cap, where its sink logits live, whether its family's
    eager softmax runs in float32: ``interp.attention.paths.softmax_upcasts``). ``queries``/``keys``: the batch
    entries its queries and keys are computed from (``"input_ids"`` or ``"decoder_input_ids"``)."""

    name: str
    stack: str
    block: int
    kind: str
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_head_v: int
    scale: float
    causal: bool
    o_proj: str | None = None  # path from the attention module to the linear map that reads z
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    sinks: str | None = None  # path (from the block) of the per-head sink logits, when the site has them
    softmax_fp32: bool = True  # the family's eager softmax runs in float32, else in the scores' dtype
    queries: str = "input_ids"
    keys: str = "input_ids"

    @property
    def label(self) -> str:
        return "cross-attention" if self.kind == "cross" else f"{self.stack} self-attention"

    @property
    def query_mask(self) -> str:
        """The batch entry that masks this site's query positions (where its z lives)."""
        return MASK_OF[self.queries]

    @property
    def key_mask(self) -> str:
        return MASK_OF[self.keys]


def is_layered(model) -> bool:
    """Whether the model has one site per layer (decoder-only or encoder-only): ``(layer, head)`` is a shorthand
    for ``(f"blocks.{layer}.attn", head)`` there."""
    return len({s.stack for s in model.cfg.sites}) == 1 and all(s.kind == "self" for s in model.cfg.sites)


def all_heads(model) -> list:
    """Every head of the model in site order: ``(layer, head)`` on a layered model (a pruned model's own head
    numbers; the placeholder of a layer that lost every head is not a head), else ``(site, head)``."""
    return model.cfg.heads()


def site_of(model, head) -> Site:
    """The site of a head as ``check_heads`` returns it, or of a ``(site name, head)`` pair on any model."""
    return model.sites[head[0]] if isinstance(head[0], str) else model.cfg.sites[head[0]]


def head_key(model, site: Site, head: int) -> tuple:
    """``(site, head)`` as ``check_heads`` returns it: ``(layer, head)`` on a layered model."""
    return (site.block, head) if is_layered(model) else (site.name, head)


def head_columns(model, head) -> dict:
    """The leading columns of a head's row in every result table: ``stack``, ``kind``, ``site``, ``layer`` (the
    block in its stack) and ``head``."""
    s = site_of(model, head)
    return {"stack": s.stack, "kind": s.kind, "site": s.name, "layer": s.block, "head": int(head[1])}


def with_head_columns(model, df):
    """A layered model's head table (``layer``, ``head`` rows) with ``stack``, ``kind`` and ``site`` put before its
    ``layer`` column, so that it starts as every head table does (``FRONT``); a table that has them is returned
    as it is. ``df.attrs`` are kept."""
    if "site" in df or "layer" not in df:
        return df
    sites = [model.cfg.sites[int(layer)] for layer in df["layer"]]
    out = df.copy()
    at = list(out.columns).index("layer")
    for name in ("site", "kind", "stack"):
        out.insert(at, name, [getattr(s, "name" if name == "site" else name) for s in sites])
    out.attrs = dict(df.attrs)
    return out


def row_head(model, row) -> tuple:
    """The head of a result table's row (a namedtuple from ``itertuples`` or a Series) as ``check_heads`` returns
    it: ``(layer, head)`` on a layered model, else ``(site, head)``."""
    return (int(row.layer), int(row.head)) if is_layered(model) else (row.site, int(row.head))


def one_site_per_layer(df) -> bool:
    """Whether a head table is of a model with one site per layer (its sites are ``blocks.{layer}.attn``, or it
    has no ``site`` column): its grids are layers x heads."""
    if "site" not in df:
        return True
    if "layer" not in df:
        return False
    return bool((df["site"] == "blocks." + df["layer"].astype(str) + ".attn").all())


def _is_index(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_pair(pair) -> bool:
    return (isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2
            and (_is_index(pair[0]) or isinstance(pair[0], str)) and _is_index(pair[1]))


def check_heads(model, heads, allow_empty: bool = False, kv: bool = False) -> list:
    """``heads`` as a sorted, deduplicated list in site order; clear errors for anything else.

    Every model takes ``(site, head)`` pairs (``("blocks.0.attn", 1)``, ``("decoder.blocks.0.cross_attn", 2)``);
    a model with one site per layer also takes ``(layer, head)`` and returns ``(layer, head)`` pairs either way.
    Only integers are layer and head numbers (Python or NumPy ints, not bools, floats or strings): a float such
    as 1.9 would otherwise be truncated to another head. kv: the pairs name key/value heads (what k and v
    patching address), checked against each site's key/value head count.
    """
    layered = is_layered(model)
    example = "(layer, head) pairs of integers or (site, head) pairs, e.g. [(0, 1), ('blocks.1.attn', 3)]" if layered else \
        f"(site, head) pairs such as ('{model.cfg.sites[-1].name}', 0), with a site from model.sites " \
        f"({', '.join(s.name for s in model.cfg.sites)})"
    form = f"heads must be {example}" if layered else f"heads of an encoder-decoder model are {example}"
    if _is_pair(heads) and isinstance(heads, tuple):
        heads = [heads]
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Iterable):
        raise ValueError(f"{form}; got {heads!r}.")
    pairs = []
    for pair in heads:
        if not _is_pair(pair):
            raise ValueError(f"{form}; got {pair!r} in {heads!r}.")
        pairs.append(_one(model, pair, layered, kv, form))
    if not pairs and not allow_empty:
        raise ValueError(f"The head list is empty; give at least one pair. {form}.")
    if layered:
        return sorted(set(pairs))
    order = {s.name: i for i, s in enumerate(model.cfg.sites)}
    return sorted(set(pairs), key=lambda p: (order[p[0]], p[1]))


def _one(model, pair, layered: bool, kv: bool, form: str):
    where, head = pair[0], int(pair[1])
    sites = model.sites  # name -> Site
    if isinstance(where, str):
        if where not in sites:
            close = difflib.get_close_matches(where, list(sites), n=3)
            raise ValueError(f"{where!r} is not an attention site of this model"
                             f"{'; did you mean ' + ' or '.join(map(repr, close)) if close else ''}? {form}.")
        site = sites[where]
    elif layered:
        site = None
    else:
        raise ValueError(f"{tuple(pair)!r} names a layer by number, which is ambiguous in a model with several "
                         f"stacks; {form}.")
    if layered:
        layer = site.block if site is not None else int(where)
        _check_layer(model.cfg, layer, head, kv)
        return layer, head
    if site.name in getattr(model.cfg, "empty_sites", ()):
        raise ValueError(f"{site.name} has no heads left (it was pruned empty), so {tuple(pair)!r} is not a head.")
    count = site.n_kv_heads if kv else site.n_heads
    if not 0 <= head < count:
        kind = "Key/value head" if kv else "Head"
        raise ValueError(f"{kind} {head} is out of range in {tuple(pair)!r}: {site.name} has {kind.lower()}s "
                         f"0..{count - 1}" + (" (k and v are patched per key/value head)." if kv else "."))
    return site.name, head


def _check_layer(cfg, l: int, h: int, kv: bool) -> None:
    counts = cfg.kv_heads_per_layer if kv else cfg.heads_per_layer
    if not 0 <= l < len(counts):
        raise ValueError(f"Layer {l} is out of range in {(l, h)}: layers run 0..{len(counts) - 1}.")
    if l in cfg.empty_layers:
        raise ValueError(f"Layer {l} has no heads left (it was pruned empty), so {(l, h)} is not a head.")
    if not 0 <= h < counts[l] and kv:
        group = cfg.heads_per_layer[l] // max(1, counts[l])
        raise ValueError(f"Key/value head {h} is out of range in {(l, h)}: k and v are patched per key/value "
                         f"head, and layer {l} has {counts[l]} (0..{counts[l] - 1}), each serving {group} query "
                         f"heads (query head q reads key/value head q // {group}).")
    if not 0 <= h < counts[l]:
        raise ValueError(f"Head {h} is out of range in {(l, h)}: layer {l} has heads 0..{counts[l] - 1}.")
