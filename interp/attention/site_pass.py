"""One pass over a model's attention sites: a forward that hands each site, as it runs, to a study.

Every study that reads attention (head scores, the long view, retrieval, a user's own score) runs on this pass
instead of writing its own hooks. For each attention site of the forward, in call order, ``visit(read)`` gets a
``SiteRead``: the site's settings (``interp.attention.sites.Site``: scale, window, soft-cap, sinks, causal, key/value
groups), which rows and keys are real, and what the path computed, ``q``, ``k`` and the logsumexp on the flash path
or the ``pattern`` on the eager one. ``read.weights(b, q, k)`` gives the weight of any (batch, query, key) pairs and
``read.top_keys()`` each row's top-1 key either way, never building an n x n matrix on the flash path. The forward
stops right after the last site asked for.

With ``value_norms`` (the heads' ``W_O W_O^T`` per site) each read also carries every key's output norm per head, ``||v_j W_O^h||`` (Kobayashi et
al. 2020: key j moves ``w_ij v_j W_O`` into row i), and ``read.weights(..., weighting="norm")`` gives the
*norm-weighted* attention ``||w_ij v_j W_O|| / sum_k ||w_ik v_k W_O||``: the share of the head's output norm that
key j contributes. Its row sums ``sum_k w_ik ||v_k W_O||`` come from the pattern (eager) or as one more statistic
of the tiled pass (flash, ``interp.attention.stats``): O(n) memory either way.

    def visit(read):
        w = read.weights(b, q, k)  # (n_pairs, h)
    each_site(model, {"input_ids": ids, "attention_mask": mask}, visit)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from hooks.names import hook_name

from .sites import Site
from .stats import attention_stats, pair_weights

__all__ = ["SiteRead", "each_site", "key_output_norms", "norm_weighted", "WEIGHTINGS"]

WEIGHTINGS = ("raw", "norm")  # attention weights as the softmax gives them, or norm-weighted (value_norms)


@dataclass
class SiteRead:
    """One site of one forward. ``q: (b, q, h, d)``, ``k: (b, k, g, d)`` and ``lse: (b, h, q)`` on the flash path,
    ``pattern: (b, h, q, k)`` on the eager path (the other fields None); ``bias``: the position bias the model
    added (T5), ``sinks: (h,)`` the sink logits (GPT-OSS); ``query_valid: (b, q)`` and ``key_valid: (b, k)``: real
    (unpadded) positions. ``value_norms: (b, h, k)``: each key's ``||v_j W_O^h||`` (``each_site(value_norms=grams)``),
    else None."""

    index: int
    site: Site
    query_valid: torch.Tensor
    key_valid: torch.Tensor
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    pattern: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    value_norms: torch.Tensor | None = None
    _norm_totals: torch.Tensor | None = None

    @property
    def n_heads(self) -> int:
        return self.pattern.shape[1] if self.pattern is not None else self.q.shape[2]

    @property
    def offset(self) -> int:
        """The key position of query row 0: 0 on a cross-attention site; on a self-attention site the queries are the
        last of the keys (a decode step is one query row against the whole cache)."""
        n_q = self.pattern.shape[2] if self.pattern is not None else self.q.shape[1]
        n_k = self.pattern.shape[3] if self.pattern is not None else self.k.shape[1]
        return 0 if self.site.kind == "cross" else n_k - n_q

    @property
    def window(self) -> tuple[int | None, int | None]:
        """(keys before, keys after) the query it may see; a causal site's ``after`` is 0."""
        before, after = self.site.window or (None, None)
        return before, 0 if self.site.causal and after is None else after

    def weights(self, b: torch.Tensor, qi: torch.Tensor, kj: torch.Tensor, weighting: str = "raw") -> torch.Tensor:
        """The weight of every ``(batch, query, key)`` pair in every head, float32 ``(n_pairs, h)``: read from the
        pattern, or rebuilt as ``exp(cap(scale q.k) + bias - lse)`` one block of pairs at a time. A pair outside the
        site's window, causal triangle or real keys weighs 0. ``weighting="norm"``: the norm-weighted attention
        ``w_ij ||v_j W_O|| / sum_k w_ik ||v_k W_O||`` instead (0 in a row whose keys all move nothing)."""
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting is one of {WEIGHTINGS}; got {weighting!r}.")
        device = self.pattern.device if self.pattern is not None else self.q.device
        b, qi, kj = b.to(device), qi.to(device), kj.to(device)
        if self.pattern is not None:
            w = self.pattern[b, :, qi, kj].float()
        else:
            w = pair_weights(self.q, self.k, self.lse, self.site.scale, b, qi, kj, softcap=self.site.softcap,
                             bias=self.bias)
            w = w * (self._inside(qi, kj) & self.key_valid.to(device)[b, kj])[:, None]
        if weighting == "raw":
            return w
        totals = self.norm_totals()  # (b, h, q)
        norms = self.value_norms.to(device)[b, :, kj]  # (n, h)
        denominator = totals[b, :, qi]
        return torch.where(denominator > 0, w * norms / denominator.clamp(min=1e-30), 0.0)

    def norm_totals(self) -> torch.Tensor:
        """(b, h, q): each row's ``sum_k w_ik ||v_k W_O||``, the denominator of norm-weighted attention: from the
        pattern, or one more statistic of the tiled pass over q, k and the logsumexp (O(n) memory)."""
        if self.value_norms is None:
            raise ValueError("norm-weighted attention needs each key's ||v W_O||: run each_site(..., "
                             "value_norms=interp.lens.circuits.output_grams(model, sites)).")
        if self._norm_totals is None:
            if self.pattern is not None:
                pattern = self.pattern.float() * self.key_valid.to(self.pattern.device)[:, None, None, :]
                self._norm_totals = torch.einsum("bhqk,bhk->bhq", pattern, self.value_norms.float())
            else:
                stats = self.stats(fields=(), key_values={"norm": self.value_norms})
                self._norm_totals = stats.key_values["norm"]
        return self._norm_totals

    def top_keys(self, last: int | None = None) -> torch.Tensor:
        """Each row's top-1 key ``(b, h, q)`` among the keys it may see (-1 where it sees none); ``last``: only the
        last rows (a generating step reads the last one)."""
        n_q = self.pattern.shape[2] if self.pattern is not None else self.q.shape[1]
        first = 0 if last is None else max(0, n_q - last)
        if self.pattern is not None:
            pattern = self.pattern[:, :, first:]
            qi = torch.arange(first, n_q, device=pattern.device)
            kj = torch.arange(pattern.shape[3], device=pattern.device)
            allowed = self._inside(qi[:, None], kj[None]) & self.key_valid.to(pattern.device)[:, None, :]
            top = pattern.masked_fill(~allowed[:, None], -1.0).argmax(dim=-1)
            return top.masked_fill(~allowed.any(-1)[:, None], -1)
        bias = self.bias if self.bias is None or not first else self.bias[..., first:, :]
        stats = attention_stats(self.q[:, first:].transpose(1, 2), self.k.transpose(1, 2), 1.0,
                                causal=self.site.causal, window=self.window, key_valid=self.key_valid, bias=bias,
                                fields=("top_index",), query_offset=self.offset + first)
        return stats.top_index

    def nonfinite_heads(self) -> torch.Tensor:
        """(h,) whether each head's pattern (eager), or q, k and logsumexp (flash), held NaN or inf at real tokens.
        On the flash path one finite sum of everything proves all of it finite; only otherwise look per head."""
        real = self.query_valid.to(self.pattern.device if self.pattern is not None else self.q.device)
        if self.pattern is not None:
            return ~torch.isfinite(self.pattern.transpose(1, 2)[real]).flatten(2).all(-1).all(0)
        total = self.q.sum(dtype=torch.float32) + self.k.sum(dtype=torch.float32) + self.lse.sum()
        if bool(torch.isfinite(total)):
            return torch.zeros(self.n_heads, dtype=torch.bool)
        group = self.q.shape[2] // self.k.shape[2]
        keys = torch.isfinite(self.k[self.key_valid.to(real.device)]).all(-1).all(0).repeat_interleave(group)  # (h,)
        rows = (torch.isfinite(self.q).all(-1) & torch.isfinite(self.lse).transpose(1, 2))[real].all(0)  # (h,)
        return ~(rows & keys)

    def stats(self, **kwargs):
        """``interp.attention.stats.attention_stats`` of this site on the flash path, with its settings and logsumexp."""
        if self.q is None:
            raise ValueError("SiteRead.stats reads q, k and the logsumexp of the flash path; this read is eager.")
        return attention_stats(self.q.transpose(1, 2), self.k.transpose(1, 2), self.site.scale, self.lse,
                               causal=self.site.causal, window=self.window, key_valid=self.key_valid,
                               softcap=self.site.softcap, sinks=self.sinks, bias=self.bias, query_offset=self.offset,
                               **kwargs)

    def norm_stats(self, **kwargs):
        """``stats`` of the norm-weighted attention (``read.value_norms`` needed): ``w_ij n_j / sum_k w_ik n_k`` is
        the softmax of the scores plus ``log n_j``, so every statistic of the tiled pass (top-1 key, sink, distance
        buckets, entropy) is read on it with that per-key bias, O(n) memory (its logsumexp recomputed; a sink logit
        moves nothing, so it takes no share)."""
        if self.q is None or self.value_norms is None:
            raise ValueError("SiteRead.norm_stats reads the flash path's q and k and each key's ||v W_O|| "
                             "(each_site(..., value_norms=...)).")
        norms = self.value_norms.float().to(self.q.device)  # (b, h, k)
        log_norms = torch.where(norms > 0, norms.clamp(min=1e-30).log(), float("-inf"))
        bias = log_norms[:, :, None, :].expand(-1, -1, self.q.shape[1], -1)  # a view: (b, h, q, k), no n x n memory
        if self.bias is not None:
            bias = bias + self.bias
        return attention_stats(self.q.transpose(1, 2), self.k.transpose(1, 2), self.site.scale, None,
                               causal=self.site.causal, window=self.window, key_valid=self.key_valid,
                               softcap=self.site.softcap, bias=bias, query_offset=self.offset, **kwargs)

    def _inside(self, qi: torch.Tensor, kj: torch.Tensor) -> torch.Tensor:
        before, after = self.window
        qi = qi + self.offset
        inside = torch.ones(torch.broadcast_shapes(qi.shape, kj.shape), dtype=torch.bool, device=qi.device)
        if before is not None:
            inside &= kj >= qi - before
        if after is not None:
            inside &= kj <= qi + after
        return inside


class _Done(Exception):
    """Raised after the last site asked for: nothing after it is needed."""


def key_output_norms(v: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Each key's output norm per head, ``||v_j W_O^h||`` (b, h, k), from values ``v: (b, k, g, e)`` and the heads'
    ``gram = W_O W_O^T: (h, e, e)`` (float64): O(n) memory, never the (b, k, h, d_model) vectors themselves."""
    n_heads, n_kv = gram.shape[0], v.shape[2]
    v = v.double().repeat_interleave(n_heads // n_kv, dim=2)  # (b, k, h, e)
    squared = torch.einsum("bkhe,hef,bkhf->bhk", v, gram.to(v.device), v)
    return squared.clamp(min=0).sqrt().float()


def norm_weighted(pattern: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """Norm-weighted attention from a pattern ``(..., h, q, k)`` and each key's ``||v_j W_O^h||`` ``(..., h, k)``:
    ``w_ij n_j / sum_k w_ik n_k`` (Kobayashi et al. 2020), 0 in a row whose keys all move nothing."""
    moved = pattern.float() * norms.float()[..., None, :]
    total = moved.sum(-1, keepdim=True)
    return torch.where(total > 0, moved / total.clamp(min=1e-30), 0.0)


def each_site(model, batch: dict, visit: Callable[[SiteRead], None], sites: Iterable[int] | None = None,
              stop: bool = True, value_norms: Mapping[int, torch.Tensor] | None = None, **kwargs):
    """Run ``model`` once on ``batch`` and call ``visit(read)`` for each site (indices into ``model.cfg.sites``;
    None: all) as it runs, in call order; the forward stops after the last one, or with ``stop=False`` runs to the
    end and its output is returned (a decode step: ``kwargs`` such as ``use_cache`` and the cache go to the model).

    batch: ``{"input_ids", "attention_mask"}`` and, on an encoder-decoder model, ``"decoder_input_ids"`` and
    ``"decoder_attention_mask"`` (masks may be None: no padding). With a KV cache the keys are longer than the
    batch: the cached keys count as real. value_norms: per site index, its heads' ``W_O W_O^T: (h, e, e)``
    (``interp.lens.circuits.output_grams``): each read then also carries ``||v_j W_O^h||`` per key and head
    (``read.value_norms``), for norm-weighted attention (``read.weights(..., weighting="norm")``)."""
    all_sites = model.cfg.sites
    wanted = sorted(set(range(len(all_sites)) if sites is None else sites))
    if not wanted:
        return
    last = wanted[-1]
    valid = {}
    for entry, mask_name in (("input_ids", "attention_mask"), ("decoder_input_ids", "decoder_attention_mask")):
        if batch.get(entry) is not None:
            mask = batch.get(mask_name)
            ids = batch[entry]
            valid[entry] = (torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()).to(model.device)
    eager = model.attn == "eager"
    sinks = model.attention_meta().sinks if any(all_sites[i].sinks for i in wanted) else {}
    held: dict[str, torch.Tensor] = {}
    grams = dict(value_norms or {})
    if value_norms is not None and not set(wanted) <= set(grams):
        raise ValueError(f"value_norms needs W_O W_O^T of every site read ({sorted(set(wanted) - set(grams))} missing); "
                         "build it with interp.lens.circuits.output_grams(model, sites).")
    by_prefix = {all_sites[i].name: i for i in wanted}

    def hold(tensor, hook):  # q and k of a site, released by its lse hook
        held[hook.name] = tensor

    def fire(tensor, hook):  # the site's last hook: its pattern (eager) or its logsumexp (flash)
        prefix = hook.name.rsplit(".", 1)[0]
        index = by_prefix[prefix]
        site = all_sites[index]
        n_keys = tensor.shape[-1] if eager else held[hook_name("k", prefix)].shape[1]
        key_valid = valid[site.keys] if valid[site.keys].shape[1] == n_keys else \
            torch.ones(valid[site.keys].shape[0], n_keys, dtype=torch.bool, device=valid[site.keys].device)
        read = SiteRead(index, site, valid[site.queries], key_valid,
                        bias=model._layer_hooks[prefix].bias if model._kind.position_bias else None,
                        sinks=sinks.get(index))
        if eager:
            read.pattern = tensor
        else:
            read.q, read.k, read.lse = held.pop(hook_name("q", prefix)), held.pop(hook_name("k", prefix)), tensor
        if value_norms is not None:
            v = held.pop(hook_name("v", prefix))
            if v.shape[1] != n_keys:
                raise ValueError(f"norm-weighted attention needs the values of every key; {site.name} saw "
                                 f"{v.shape[1]} values for {n_keys} keys (a KV cache): run it without a cache.")
            read.value_norms = key_output_norms(v, grams[index])
        visit(read)
        if index == last and stop:
            raise _Done

    prefixes = [all_sites[i].name for i in wanted]
    held_kinds = (() if eager else ("q", "k")) + (("v",) if value_norms is not None else ())
    hooks = [([hook_name(kind, p) for p in prefixes for kind in held_kinds], hold)] if held_kinds else []
    hooks.append(([hook_name("pattern" if eager else "lse", p) for p in prefixes], fire))
    extra = {k: batch.get(k) for k in ("decoder_input_ids", "decoder_attention_mask") if batch.get(k) is not None}
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    try:
        with model.hooks(hooks):
            output = model(ids.to(model.device), None if mask is None else mask.to(model.device),
                           **{k: v.to(model.device) for k, v in extra.items()}, **kwargs)
    except _Done:
        return None
    if not stop:
        return output
    raise RuntimeError(f"The attention hook of {all_sites[last].name} did not fire; the model skipped interp's "
                       "attention.")
