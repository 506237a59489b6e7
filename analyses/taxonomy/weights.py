"""Weight-based head classes of the literature: successor heads and copy-suppression (negative) heads.

Both read a head's OV circuit on a token's *effective embedding* and map the result to logits:

    block0(t)  = the residual stream after block 0 on the one-token input [t] with block 0's attention removed
                 (its heads zero-ablated): W_E t (+ position 0's embedding where the model adds one) + MLP0 of it,
                 with whatever norms the model applies around MLP0 (McDougall et al. 2023's effective embedding:
                 ``get_effective_embedding`` in their code, whose default leaves attention 0 out).
    mlp0(t)    = MLP0's contribution alone: block0(t) minus the block's input and minus what the ablated attention
                 still writes (its output bias, where the model has one) (Gould et al. 2023: ``mlp0(W_E)``, without
                 the residual).
    out_h(x)   = norm_l(x) @ W_V^h @ W_O^h   (norm_l: the norm layer l's attention reads its input through,
                 applied as the model applies it; biases left out)
    logits_h(x) = out_h(x) through the post-attention norm (where the model has one) and the final norm, their
                 scales frozen (a positive number per row, which changes no ranking), then W_U (no bias).

Every head of every layer is scored on the same effective embedding, layer 0 included.

- ``successor`` (Gould et al. 2023, "Successor Heads: Recurring, Interpretable Attention Heads In The Wild"): over
  their succession dataset (``data/ordinal_lists.json``'s ``gould2023``: numbers 1-200, number words, cardinal
  words, days, months and their short forms, letters; a leading space; days and months wrap), the share of items
  ``t`` for which ``logits_h(mlp0(t))``, among the successor tokens of ``t``'s own task, is largest at ``succ(t)``
  (ties count). Published threshold 0.4. Variants, by argument: ``embedding="block0"`` (the residual kept),
  ``candidates="list"`` (every token of the list, not only its successors), ``"ordinal"`` (every token of every
  list), ``"vocab"`` (the whole vocabulary); ``lists="bundled"`` (this project's lists, with and without the
  space). Today's score before issue 38 was ``lists="bundled", embedding="block0", candidates="list"``.
- ``copy_suppression`` (McDougall et al. 2023, "Copy Suppression: Comprehensively Understanding an Attention
  Head"): the share of tokens ``t`` for which ``logits_h(block0(t))`` puts ``t`` itself among the ``k`` (10) most
  *negative* logits of the whole vocabulary (their OV test of GPT-2 small's L10H7: 84.7% of all tokens). The paper
  scores every token of the vocabulary; ``tokens="all"`` does that (a GPU's job for a 50k+ vocabulary: every row
  is a whole-vocabulary product); the default is a uniform sample of non-special tokens (as many, up to 1000, as
  fit about a minute of one CPU thread), an unbiased estimate of that share with its bootstrap interval.

Intervals: 95% percentile bootstrap over items (ordinal items, tokens). Stability (``analyses.data.stability``): each
score on the even and the odd items, in ``df.attrs["stability"][name]``.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from functools import cache
from pathlib import Path

import pandas as pd
import torch

from hooks.names import hook_name
from interp.model.config import real_sites
from interp.runtime.distributed import onloaded
from interp.runtime.progress import progress as interp_progress

from ..causal.ablation import ablate_heads
from ..causal.attribution import _unembedding, frozen_norm
from ..explain.composition import ov_circuit
from ..data.bootstrap import check_n_bootstrap, mean_interval
from ..data.stability import split_half
from .base import check_k, refuse_non_lm, refuse_stacks

__all__ = ["successor_scores", "copy_suppression_scores", "effective_embedding", "ordinal_lists", "ORDINAL_LISTS"]

ORDINAL_LISTS = Path(__file__).resolve().parents[1] / "data" / "ordinal_lists.json"
EMBEDDINGS = ("mlp0", "block0")
CANDIDATES = ("targets", "list", "ordinal", "vocab")
_BUDGET = 8e11  # multiply-adds the default token sample of copy_suppression may cost: about a minute of one thread
_CELLS = 1 << 24  # floats in one block of logits (64 MiB): rows x vocabulary columns are computed in such blocks
_EMBED_CHUNK = 4096  # one-token inputs per forward of block 0


@cache
def _datasets() -> dict[str, dict]:
    data = json.loads(ORDINAL_LISTS.read_text(encoding="utf-8"))
    return {"bundled": {"lists": data["lists"], "variants": (("", ""), ("_space", " ")), "cyclic": ()},
            "gould2023": {"lists": data["gould2023"]["lists"], "variants": (("", data["gould2023"]["prefix"]),),
                          "cyclic": tuple(data["gould2023"]["cyclic"])}}


def _bundled_lists() -> dict[str, tuple[str, ...]]:
    return {k: tuple(v) for k, v in _datasets()["bundled"]["lists"].items()}


def ordinal_lists(model, dataset: str = "gould2023") -> dict[str, list[tuple[int, int]]]:
    """An ordinal dataset in the model's tokenizer: name -> ``(token, successor token)`` id pairs.

    dataset: ``"gould2023"`` (Gould et al.'s succession dataset: each item with a leading space, days and months
    wrapping around) or ``"bundled"`` (this project's lists, each once as written and once with a leading space:
    ``"days"``, ``"days_space"``). An item is kept where it is one token (not the tokenizer's unknown token); a pair
    where both items are kept and adjacent in the list; a list where it keeps at least 2 pairs."""
    if dataset not in _datasets():
        raise ValueError(f"dataset must be one of {sorted(_datasets())}; got {dataset!r}.")
    if model.tokenizer is None:
        raise ValueError("ordinal_lists needs the model's tokenizer; give lists={name: [token ids in order]} "
                         "instead.")
    tok, spec = model.tokenizer, _datasets()[dataset]
    unknown = [tok.unk_token_id] if tok.unk_token_id is not None else []
    out = {}
    for name, items in spec["lists"].items():
        items = list(items) + ([items[0]] if name in spec["cyclic"] else [])
        for suffix, prefix in spec["variants"]:
            ids = [tok(prefix + item, add_special_tokens=False)["input_ids"] for item in items]
            ids = [[] if a == unknown else a for a in ids]  # an item the tokenizer cannot read is not kept
            singles = [a[0] for a in ids if len(a) == 1]
            pairs = [(a[0], b[0]) for a, b in zip(ids, ids[1:]) if len(a) == 1 and len(b) == 1]
            if name in spec["cyclic"]:
                singles = singles[:-1]  # the first item again, at the end
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


def effective_embedding(model, ids, kind: str = "block0") -> torch.Tensor:
    """The effective embedding of token ids ``ids: (n,)``: ``(n, d_model)`` float32, ``kind`` ``"block0"`` or
    ``"mlp0"`` (see the module docstring). Block 0 runs on 4096 one-token inputs at a time."""
    refuse_stacks(model, "effective_embedding")
    if kind not in EMBEDDINGS:
        raise ValueError(f"kind must be one of {EMBEDDINGS}; got {kind!r}.")
    ids = torch.as_tensor(ids).long().flatten()
    layer0 = [(0, h) for h in range(model.cfg.heads_per_layer[0])] if 0 in _scored_layers(model) else []
    names = ("resid_post",) if kind == "block0" else ("resid_post", "resid_pre", "attn_out")
    kept, out = {}, []

    def keep(resid, hook):
        kept[hook.name] = resid[:, 0].detach().float()

    hooks = [(hook_name(name, 0), keep) for name in names]
    ablated = ablate_heads(model, layer0) if layer0 else nullcontext()
    with model.studying(), torch.no_grad(), model.hooks(hooks), ablated:
        for chunk in ids.split(_EMBED_CHUNK):
            model(chunk[:, None].to(model.device))
            x = kept[hook_name("resid_post", 0)]
            if kind == "mlp0":  # what MLP0 adds: the block's output less its input and the ablated attention's bias
                x = x - kept[hook_name("resid_pre", 0)] - kept[hook_name("attn_out", 0)]
            out.append(x.cpu())
    return torch.cat(out)


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


def _head_values(model, eff: torch.Tensor, desc: str):
    """Each scored layer's ``(layer, values, w_o, w_u)``: ``values: (h, n, e)`` the effective embedding ``eff``
    through each head's input norm and W_V (``_readout``), with a progress bar named ``desc``."""
    with model.studying():
        for layer in interp_progress(_scored_layers(model), desc=desc, unit="layer"):
            norm_in, w_v, w_o, w_u = _readout(model, layer)
            yield layer, _head_inputs(model, norm_in, eff) @ w_v, w_o, w_u


def _vocab_count(values: torch.Tensor, w_o: torch.Tensor, w_u: torch.Tensor, target: torch.Tensor,
                 side: str) -> torch.Tensor:
    """For one head, ``values: (n, e)`` (its inputs times W_V), ``w_o: (e, m)``, ``w_u: (vocab, m)``: per row, how
    many logits of the whole vocabulary are strictly ``side`` (``"below"`` or ``"above"``) the logit of
    ``target[i]`` (the target itself not counted). Columns in blocks of at most ``_CELLS`` logits, in the cheaper
    multiplication order (``_cost``)."""
    n, (e, m), vocab = len(values), w_o.shape, len(w_u)
    direct = n * m <= e * (m + n)  # (values @ W_O) @ W_U.T, else values @ (W_O @ W_U.T)
    out = values @ w_o  # (n, m)
    own = (out * w_u[target]).sum(-1)  # (n,)
    count = torch.zeros(n, dtype=torch.int32)
    rows = torch.arange(n)
    width = max(1, _CELLS // max(n, e))
    compare = torch.lt if side == "below" else torch.gt
    for start in range(0, vocab, width):
        block = w_u[start:start + width]  # (c, m)
        logits = out @ block.T if direct else values @ (w_o @ block.T)  # (n, c)
        inside = (target >= start) & (target < start + len(block))
        logits[rows[inside], target[inside] - start] = own[inside]  # the target is neither below nor above itself
        # a uint8 sum into int32: twice as fast as summing the booleans (which adds in int64)
        count += compare(logits, own[:, None]).view(torch.uint8).sum(-1, dtype=torch.int32)
    return count


def _cost(n: int, e: int, m: int, vocab: int) -> int:
    """Multiply-adds of one head's whole-vocabulary logits on ``n`` rows."""
    return vocab * min(n * m, e * (m + n))  # the order _vocab_count picks


def _auto_tokens(model) -> int:
    """The default sample of copy_suppression: the most tokens, from 100 to 1000, whose whole-vocabulary logits on
    every head cost at most ``_BUDGET`` multiply-adds (SmolLM2-135M: 360; Gemma 3 270M, 262k tokens: 100)."""
    cfg = model.cfg
    e, m, vocab = cfg.d_head_v or cfg.d_head, cfg.d_model, cfg.vocab_size
    heads = sum(cfg.heads_per_layer[layer] for layer in _scored_layers(model))
    fits = [n for n in range(100, 1001, 10) if heads * _cost(n, e, m, vocab) <= _BUDGET]
    return fits[-1] if fits else 100


def _frame(model, name: str, hits: dict[int, torch.Tensor], n_bootstrap: int, seed: int) -> pd.DataFrame:
    rows = []
    for layer, layer_hits in hits.items():  # (items, h)
        mean, lo, hi = mean_interval(layer_hits, n_bootstrap, seed)
        for head in range(layer_hits.shape[1]):
            rows.append({"layer": layer, "head": head, name: float(mean[head]), f"{name}_lo": float(lo[head]),
                         f"{name}_hi": float(hi[head])})
    df = pd.DataFrame(rows, columns=["layer", "head", name, f"{name}_lo", f"{name}_hi"])
    every = torch.cat(list(hits.values()), dim=1).double()  # (items, heads), the frame's row order
    df.attrs["stability"] = {name: split_half(every, items="items")}  # even against odd items (tokens, list items)
    return df


def successor_scores(model, lists=None, embedding: str = "mlp0", candidates: str = "targets",
                     n_bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Every head's successor score (Gould et al. 2023; module docstring): one row per (layer, head) with
    ``successor``, ``successor_lo``, ``successor_hi``.

    lists: None (Gould et al.'s succession dataset in the model's tokenizer, ``ordinal_lists``), ``"bundled"``
    (this project's lists), ``{name: [token ids in order]}`` or ``{name: [(token, successor), ...]}``.
    embedding: ``"mlp0"`` (published) or ``"block0"``. candidates: where the argmax is taken: ``"targets"``
    (published: the successor tokens of the item's own list), ``"list"`` (every token of its list), ``"ordinal"``
    (every token of every list), ``"vocab"`` (the whole vocabulary). ``df.attrs``: ``items`` (the number scored),
    ``lists`` (their names), ``embedding``, ``candidates``, ``stability`` (even vs odd items).
    """
    refuse_non_lm(model, "The successor score")
    check_n_bootstrap(n_bootstrap)
    if embedding not in EMBEDDINGS:
        raise ValueError(f"embedding must be one of {EMBEDDINGS}; got {embedding!r}.")
    if candidates not in CANDIDATES:
        raise ValueError(f"candidates must be one of {CANDIDATES}; got {candidates!r}.")
    if lists is None or isinstance(lists, str):
        pairs = ordinal_lists(model, "gould2023" if lists is None else lists)
    else:
        pairs = _as_pairs(lists)
    if not pairs:
        raise ValueError("No ordinal list has 2 single-token successor pairs in this tokenizer; give lists=.")
    vocab = model.cfg.vocab_size
    bad = [t for p in pairs.values() for pair in p for t in pair if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab}).")
    sources = torch.tensor([a for p in pairs.values() for a, _ in p])
    targets = torch.tensor([b for p in pairs.values() for _, b in p])
    # the items in groups that share their candidate tokens: (rows of the items, candidate ids, successor's index)
    groups, start = [], 0
    every = sorted({t for p in pairs.values() for pair in p for t in pair})
    for p in pairs.values():
        own = {"targets": sorted({b for _, b in p}), "list": sorted({t for pair in p for t in pair}),
               "ordinal": every}.get(candidates)
        if own is not None:
            groups.append((torch.arange(start, start + len(p)), torch.tensor(own),
                           torch.tensor([own.index(b) for _, b in p])))
        start += len(p)
    eff = effective_embedding(model, sources, embedding)
    hits = {}
    for layer, values, w_o, w_u in _head_values(model, eff, "successor"):
        layer_hits = torch.zeros(len(sources), len(values), dtype=torch.bool)
        if candidates == "vocab":
            for head in range(len(values)):
                layer_hits[:, head] = _vocab_count(values[head], w_o[head], w_u, targets, "above") == 0
        else:
            out = values @ w_o  # (h, n, m)
            for rows, ids, succ in groups:
                logits = out[:, rows] @ w_u[ids].T  # (h, items, candidates)
                best = logits.max(-1).values
                layer_hits[rows] = (logits[:, torch.arange(len(rows)), succ] >= best).T
        hits[layer] = layer_hits
    df = _frame(model, "successor", hits, n_bootstrap, seed)
    df.attrs.update(items=len(sources), lists=list(pairs), embedding=embedding, candidates=candidates)
    return df


def copy_suppression_scores(model, tokens=None, n_tokens: int | None = None, k: int = 10, n_bootstrap: int = 1000,
                            seed: int = 0) -> pd.DataFrame:
    """Every head's negative copy score (McDougall et al. 2023; module docstring): one row per (layer, head) with
    ``copy_suppression``, ``copy_suppression_lo``, ``copy_suppression_hi``.

    tokens: the token ids to score; ``"all"`` (every non-special token of the vocabulary, the paper's statistic;
    slow on a CPU); default ``n_tokens`` non-special tokens drawn uniformly with ``seed`` (None: as many, from 100
    to 1000, as fit about a minute of one CPU thread: 360 on SmolLM2-135M, 100 on Gemma 3's 262k-token vocabulary;
    the interval and the stability say what that sample buys). k: a token counts when it is among the ``k`` most
    negative logits of the whole vocabulary. ``df.attrs``: ``tokens`` (how many), ``k``, ``stability`` (even vs
    odd tokens).
    """
    from ..data.prompts import _ordinary_ids

    refuse_non_lm(model, "The copy-suppression score")
    check_n_bootstrap(n_bootstrap)
    check_k(model, k)
    if isinstance(tokens, str):
        if tokens != "all":
            raise ValueError(f"tokens must be token ids, 'all' or None (a sample of n_tokens); got {tokens!r}.")
        tokens = _ordinary_ids(model)
    elif tokens is None:
        n_tokens = _auto_tokens(model) if n_tokens is None else n_tokens
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 2:
            raise ValueError(f"n_tokens must be an integer of at least 2 (two halves for the stability); "
                             f"got {n_tokens!r}.")
        pool = _ordinary_ids(model)
        g = torch.Generator().manual_seed(seed)
        tokens = pool[torch.randperm(len(pool), generator=g)[:n_tokens]]
    tokens = torch.as_tensor(tokens).long().flatten()
    if tokens.numel() == 0 or int(tokens.min()) < 0 or int(tokens.max()) >= model.cfg.vocab_size:
        raise ValueError(f"tokens must be ids in [0, {model.cfg.vocab_size}); got {tokens.tolist()[:5]}...")
    eff = effective_embedding(model, tokens, "block0")
    hits = {}
    for layer, values, w_o, w_u in _head_values(model, eff, "copy suppression"):
        layer_hits = torch.zeros(len(tokens), len(values), dtype=torch.bool)
        for head in range(len(values)):
            layer_hits[:, head] = _vocab_count(values[head], w_o[head], w_u, tokens, "below") < k
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
    refuse_non_lm(model, f"The score {names[0]!r}" if len(names) == 1 else f"The scores {', '.join(names)} each")
    check_n_bootstrap(n_bootstrap)
    frames = []
    if "successor" in names:
        frames.append(successor_scores(model, n_bootstrap=n_bootstrap, seed=seed))
    if "copy_suppression" in names:
        frames.append(copy_suppression_scores(model, n_bootstrap=n_bootstrap, seed=seed))
    if "copy_suppression_behaviour" in names:
        from .behaviour import copy_suppression_behaviour_scores

        frames.append(copy_suppression_behaviour_scores(model, n_bootstrap=n_bootstrap, seed=seed))
    if "name_mover" in names or "s_inhibition" in names:
        from .ioi import _ioi, name_mover_scores, s_inhibition_scores

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
    attrs, stable = {}, {}
    for frame in frames:
        attrs.update({k: v for k, v in frame.attrs.items() if k not in ("mean_z", "stability")})
        stable.update(frame.attrs.get("stability", {}))
    df.attrs.update(taxonomy=attrs)
    if stable:
        df.attrs["stability"] = stable
    return df
