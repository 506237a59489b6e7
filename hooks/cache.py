"""ActivationCache: the tensors captured by ``run_with_cache``, addressed by hook name."""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .names import _ALIASES, HOOK_TABLE, get_act_name, unknown_name_error

__all__ = ["ActivationCache", "AttentionMeta"]

_SHORT = {spec.short: spec for spec in HOOK_TABLE if spec.norm is None}  # norms: cache["scale", l, "ln1"] (get_act_name)


@dataclass
class AttentionMeta:
    """What is needed to rebuild attention patterns from cached q and k, exactly as the eager path does: the run's
    values beside the model's attention sites, which are the one record of each site's settings.

    sites: per index, the model's attention site (``interp.attention.sites.Site``: ``name``, ``scale`` as the model passed it,
    head counts, ``window`` (keys before, keys after; a causal site's after is 0), ``softcap``, ``causal``,
    ``key_mask``, ...; index = layer where each layer has one site). attention_mask: (b, k) with 1 for real tokens,
    or None for no padding. sinks: index -> (h,) sink logits, their values in this run, for sites with sinks.
    masks: each batch entry's padding mask by name (``"attention_mask"``, ``"decoder_attention_mask"``; None: no
    padding): a site's keys are masked by its ``key_mask`` entry. biases: index -> position bias added to the
    scores (T5's relative bias). views: rebuild scores from views of q and k laid out as the projections' (an
    encoder-decoder's eager path multiplies those) instead of contiguous copies (a decoder's, after rotary), so the
    same kernel gives the same bits.
    """

    sites: list
    attention_mask: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)
    sinks: dict[int, torch.Tensor] = field(default_factory=dict)
    masks: dict[str, torch.Tensor | None] = field(default_factory=dict)
    biases: dict[int, torch.Tensor] = field(default_factory=dict)
    views: bool = False

    @property
    def scaling(self) -> list[float]:
        """Per site, the score scale the model passes to its attention."""
        return [s.scale for s in self.sites]

    @property
    def causal(self) -> bool:
        return all(s.causal for s in self.sites)

    def heads(self, layer: int) -> tuple[int, int]:
        """(query heads, key/value heads) of ``layer``."""
        return self.sites[layer].n_heads, self.sites[layer].n_kv_heads

    def window(self, layer: int) -> tuple[int | None, int | None]:
        site = self.sites[layer]
        return site.window if site.window is not None else (None, 0 if site.causal else None)

    def softcap(self, layer: int) -> float | None:
        return self.sites[layer].softcap

    def key_mask(self, layer: int | None) -> torch.Tensor | None:
        """The padding mask ``(b, k)`` of ``layer``'s keys (its site's batch entry), or None for no padding."""
        if layer is None or not self.masks:
            return self.attention_mask
        return self.masks.get(self.sites[layer].key_mask)


class ActivationCache:
    """Captured activations. ``cache[name]``, or the shorthand ``cache["pattern", 3]``. The one cache class of
    every model: ``cache.pattern(site or layer, heads)`` rebuilds any attention site's pattern from q and k.

    >>> cache = ActivationCache({"blocks.0.attn.hook_z": torch.zeros(1, 2, 3, 4)})
    >>> cache["z", 0].shape
    torch.Size([1, 2, 3, 4])
    """

    def __init__(self, store: dict[str, torch.Tensor], meta: AttentionMeta | None = None):
        self._store = store
        self.meta = meta

    # -- mapping -------------------------------------------------------------------------------------
    def _name(self, key) -> str:
        if isinstance(key, tuple):
            layer = _as_layer(key[1]) if len(key) >= 2 else None
            if not 2 <= len(key) <= 3 or layer is None:
                raise KeyError(f"The shorthand is cache[kind, layer] (or TransformerLens's cache[kind, layer, "
                               f"sublayer]), e.g. cache['pattern', 3]; got {key!r}.")
            kind = key[0]
            spec = _SHORT.get(_ALIASES.get(kind, kind).removeprefix("hook_"))
            if spec is None:
                raise KeyError(f"Unknown hook kind {kind!r}; kinds are {sorted(_SHORT)}.")
            if layer < 0:  # as TransformerLens: counted from the last layer in the cache
                layers = self._layers_of(spec.short) or (  # a flash run's patterns: the layers of its q
                    self._layers_of("q") if spec.short in ("pattern", "attn_scores") else [])
                layer = layers[-1] + 1 + layer if layers else layer
            name = spec.name(layer)
        elif isinstance(key, str) and key not in self._store and "." not in key and not key.startswith("hook_"):
            try:
                name = get_act_name(key)  # TransformerLens's cache["embed"], cache["k6"]
            except ValueError:
                name = key
        else:
            name = key
        if name not in self._store and self._rebuilt(name) is None:
            raise self._missing(name)
        return name

    def _rebuilt(self, name: str) -> str | None:
        """The site whose pattern or scores ``name`` is, where the run cached no n x n matrix but its q and k
        (a flash run): ``cache[name]`` rebuilds it on access, as ``cache.pattern`` does. Else None."""
        if not name.endswith((".hook_pattern", ".hook_attn_scores")) or self.meta is None:
            return None
        site = name.rsplit(".", 1)[0]
        return site if f"{site}.hook_q" in self._store and f"{site}.hook_k" in self._store else None

    def _missing(self, name: str) -> KeyError:
        if name.endswith(("hook_pattern", "hook_attn_scores")) and name.rsplit(".", 1)[0] + ".hook_q" in self._store:
            return KeyError(f"{name} cannot be rebuilt: this cache does not record the run's attention settings "
                            "(make it with model.run_with_cache).")
        if self._store and name not in self._store:
            err = unknown_name_error(name, list(self._store))
            return KeyError(f"{name!r} is not in this cache. {err.args[0].split('. ', 1)[-1]}")
        return KeyError(f"{name!r} is not in this (empty) cache.")

    def __getitem__(self, key) -> torch.Tensor:
        name = self._name(key)
        if name in self._store:
            return self._store[name]
        site = self._rebuilt(name)  # a flash run's pattern or scores: one site's n x n, built now and not kept
        return self.pattern(site) if name.endswith(".hook_pattern") else self.attn_scores(site)

    def __contains__(self, key) -> bool:
        try:
            self._name(key)
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._store)

    def __len__(self) -> int:
        return len(self._store)

    def keys(self):
        return self._store.keys()

    def items(self):
        return self._store.items()

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} tensors: {', '.join(list(self._store)[:4])}{', ...' if len(self) > 4 else ''})"

    @property
    def sites(self) -> list:
        """The model's attention sites in index order (``cache.pattern(i)`` is site i's); [] when not recorded."""
        return [] if self.meta is None or self.meta.sites is None else list(self.meta.sites)

    @property
    def source_mask(self) -> torch.Tensor | None:
        """The padding mask ``(b, p)`` of the run's ``input_ids`` (None: no padding, or not recorded)."""
        return None if self.meta is None else self.meta.masks.get("attention_mask", self.meta.attention_mask)

    @property
    def target_mask(self) -> torch.Tensor | None:
        """The padding mask ``(b, t)`` of an encoder-decoder run's ``decoder_input_ids`` (None: none)."""
        return None if self.meta is None else self.meta.masks.get("decoder_attention_mask")

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> ActivationCache:
        """A copy of the cache with every tensor moved (and, if given, floating tensors cast)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else None)

        meta = self.meta
        if meta is not None:
            mask = None if meta.attention_mask is None else meta.attention_mask.to(device)
            meta = AttentionMeta(**{**meta.__dict__, "attention_mask": mask,
                                    "sinks": {l: t.to(device) for l, t in meta.sinks.items()},
                                    "masks": {n: None if m is None else m.to(device) for n, m in meta.masks.items()},
                                    "biases": {l: t.to(device) for l, t in meta.biases.items()}})
        return ActivationCache({k: move(v) for k, v in self._store.items()}, meta)

    # -- stacking ------------------------------------------------------------------------------------
    def _layers_of(self, kind: str) -> list[int]:
        spec = _SHORT.get(kind.removeprefix("hook_"))
        if spec is None or not spec.per_layer:
            raise KeyError(f"stack() takes a per-layer kind such as 'z' or 'resid_post'; got {kind!r}.")
        prefix, suffix = spec.template.split("{l}")
        middles = (name[len(prefix):len(name) - len(suffix)] for name in self._store
                   if name.startswith(prefix) and name.endswith(suffix))
        return sorted(int(m) for m in middles if m.isdigit())

    def stack(self, kind: str, layers: Sequence[int] | None = None) -> torch.Tensor:
        """One per-layer activation stacked over layers: ``(l, ...)``."""
        layers = self._layers_of(kind) if layers is None else list(layers)
        if not layers:
            raise KeyError(f"No {kind!r} activations in this cache; capture them with run_with_cache(names=...).")
        return torch.stack([self[kind, l] for l in layers])

    def stack_head_results(self, layers: Sequence[int] | None = None) -> tuple[torch.Tensor, list[str]]:
        """Every head's output in d_model, stacked: ``(l * h, b, p, m)`` with labels ``"L{l}H{h}"``.

        Needs ``hook_result`` in the cache (it is opt-in: ``run_with_cache(names=lambda n: "result" in n)``).
        """
        layers = self._layers_of("result") if layers is None else list(layers)
        if not layers:
            raise KeyError("No hook_result in this cache: it is opt-in. Capture it with names=lambda n: 'hook_result' in n.")
        parts, labels = [], []
        for l in layers:
            result = self["result", l]  # (b, p, h, m)
            parts.append(result.permute(2, 0, 1, 3))
            labels += [f"L{l}H{h}" for h in range(result.shape[2])]
        return torch.cat(parts), labels

    # -- patterns from q and k -------------------------------------------------------------------------
    def _site(self, key) -> tuple[int, str]:
        """``(index, hook prefix)`` of a layer number or site index, or of a site's name."""
        meta = self.meta
        sites = None if meta is None or meta.sites is None else [s.name for s in meta.sites]
        layered = sites is None or len({s.stack for s in meta.sites}) == 1
        if isinstance(key, str):
            if sites is not None and key in sites:
                return sites.index(key), key
            example = f"a site such as {sites[0]!r} or {sites[-1]!r}, or " if sites else ""
            raise KeyError(f"{key!r} is not an attention site of this model; give {example}"
                           f"{'a layer' if layered else 'an index'}{f' 0..{len(sites) - 1}' if sites else ''}.")
        n = len(meta.scaling) if meta is not None else None
        key = key if _as_layer(key) is None else _as_layer(key)
        if not isinstance(key, int) or isinstance(key, bool) or n is not None and not 0 <= key < n:
            if not layered:
                raise IndexError(f"Site {key!r} is out of range: sites run 0..{n - 1} ({sites[0]}, ...).")
            span = f"this model's layers run 0..{n - 1}" if n else "layers are integers"
            raise IndexError(f"Layer {key!r} is out of range: {span}.")
        return key, f"blocks.{key}.attn" if sites is None else sites[key]

    def pattern(self, layer: int | str, heads: int | Sequence[int] | None = None) -> torch.Tensor:
        """The attention pattern ``(b, h, q, k)`` of ``heads`` (all if None) of one attention site: a layer
        number where each layer has one site, or any model's site index or name (``"blocks.3.attn"``,
        ``"decoder.blocks.1.cross_attn"``). ``cache["pattern", l]`` on a flash run is ``cache.pattern(l)``.

        Returns the cached pattern if the run was eager; otherwise rebuilds it from the cached q and k
        exactly as the eager path computes it (scores in the model's dtype, soft-cap, position bias, masked
        entries at the dtype's minimum, the softmax in fp32 or, where the site's family takes it so, in the scores'
        dtype), so only the selected heads' n x n matrices are built.
        """
        index, site, heads = self._heads(layer, heads)
        name = f"{site}.hook_pattern"
        if name in self._store:
            pattern = self._store[name]
            return pattern if heads is None else pattern[:, list(heads)]
        scores, heads = self._scores(index, site, heads, layer)
        meta, dtype = self.meta, self._store[f"{site}.hook_q"].dtype
        if index in meta.sinks:  # the sink column joins each row and is dropped after the softmax
            sinks = meta.sinks[index].to(scores.dtype)[heads].reshape(1, -1, 1, 1).expand(*scores.shape[:3], 1)
            combined = torch.cat([scores, sinks], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            return torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(dtype)
        if meta.sites is None or getattr(meta.sites[index], "softmax_fp32", True):
            return torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
        return torch.softmax(scores, dim=-1)  # as the eager path for a family whose softmax is in the scores' dtype

    def attn_scores(self, layer: int | str, heads: int | Sequence[int] | None = None) -> torch.Tensor:
        """The scores ``(b, h, q, k)`` that ``hook_attn_scores`` sees on the eager path (scaled, soft-capped, with
        the position bias and the additive mask: masked entries hold the dtype's minimum), cached or rebuilt from
        q and k as ``pattern`` rebuilds patterns. ``cache["attn_scores", l]`` on a flash run is this."""
        index, site, heads = self._heads(layer, heads)
        name = f"{site}.hook_attn_scores"
        if name in self._store:
            scores = self._store[name]
            return scores if heads is None else scores[:, list(heads)]
        return self._scores(index, site, heads, layer)[0]

    def _heads(self, layer, heads) -> tuple[int, str, list[int] | None]:
        """``(index, site, heads as a list or None)``, the heads checked against the site's."""
        index, site = self._site(layer)
        if isinstance(heads, int):
            heads = [heads]
        if self.meta is not None and heads is not None:
            n_heads = self.meta.heads(index)[0]
            bad = [h for h in heads if not 0 <= h < n_heads]
            if bad:
                what = f"layer {index}" if site == f"blocks.{index}.attn" else site
                raise IndexError(f"Heads of {what} run 0..{n_heads - 1}; got {bad}.")
        return index, site, None if heads is None else list(heads)

    def _scores(self, index: int, site: str, heads, layer) -> tuple[torch.Tensor, list[int]]:
        """The masked scores ``(b, h, q, k)`` of ``heads`` rebuilt from the cached q and k, and the heads."""
        meta = self.meta
        q_name, k_name = f"{site}.hook_q", f"{site}.hook_k"
        if meta is None or q_name not in self._store or k_name not in self._store:
            raise KeyError(f"cache.pattern({layer!r}) needs {q_name} and hook_k in the cache; "
                           "run_with_cache captures them by default.")
        n_heads, n_kv_heads = meta.heads(index)
        q, k = self._store[q_name], self._store[k_name]  # (b, q, h, d), (b, k, g, d)
        heads = list(range(n_heads)) if heads is None else heads
        group = n_heads // n_kv_heads
        q_sel = q[:, :, heads].transpose(1, 2)  # (b, h, q, d)
        k_sel = k[:, :, [h // group for h in heads]].transpose(1, 2)  # (b, h, k, d)
        if not meta.views:  # laid out as the eager path's tensors are, so that the same kernel gives the same bits
            q_sel, k_sel = q_sel.contiguous(), k_sel.contiguous()
        scores = torch.matmul(q_sel, k_sel.transpose(2, 3)) * meta.scaling[index]
        softcap = meta.softcap(index)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        bias = meta.biases.get(index)
        if bias is not None:
            scores = scores + bias[:, heads] if bias.shape[1] > 1 else scores + bias
        mask = additive_mask(meta, q.shape[1], k.shape[1], scores.dtype, scores.device, index)
        return (scores if mask is None else scores + mask), heads


def _as_layer(key) -> int | None:
    """A layer number given as an int, a numpy integer or a 0-dim integer tensor (``topk``'s indices, as
    TransformerLens's demos index with them), or None."""
    if isinstance(key, bool):
        return None
    if isinstance(key, numbers.Integral):
        return int(key)
    if isinstance(key, torch.Tensor) and key.ndim == 0 and not key.is_floating_point() and not key.is_complex():
        return int(key)
    return None


def allowed_keys(meta: AttentionMeta, n_q: int, n_k: int, device, layer: int | None = None) -> torch.Tensor | None:
    """Boolean ``(b or 1, 1, q, k)``: which keys each query may attend to in ``layer``, or None for all.

    Queries are the last ``n_q`` of the ``n_k`` positions; the layer's window bounds how far before and after
    the query a key may be (causal: none after), and padded keys are never allowed.
    """
    before, after = meta.window(layer) if layer is not None else (None, 0 if meta.causal else None)
    allowed = None
    if before is not None or after is not None:
        offset = torch.arange(n_k, device=device)[None] - (torch.arange(n_q, device=device)[:, None] + n_k - n_q)
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
        if before is not None:
            allowed &= offset >= -before
        if after is not None:
            allowed &= offset <= after
        allowed = allowed[None, None]
    keys = meta.key_mask(layer)
    if keys is not None:
        pad = keys.to(device=device, dtype=torch.bool)[:, None, None, :]
        allowed = pad if allowed is None else allowed & pad
    return allowed


def additive_mask(meta: AttentionMeta, n_q: int, n_k: int, dtype, device, layer: int | None = None) -> torch.Tensor | None:
    """HF eager's additive mask: 0 where allowed, the dtype's minimum elsewhere."""
    allowed = allowed_keys(meta, n_q, n_k, device, layer)
    if allowed is None:
        return None
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)
