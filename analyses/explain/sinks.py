"""Attention sinks, dormant heads and massive activations, each checked causally.

A head moves ``w_ij * (v_j W_O)`` from key j into row i, so a sink that draws the weight but whose value is near
zero moves nothing (Kobayashi et al. 2020; Guo et al. 2024's *dormant* heads). Here:

- ``sink_heads``: per head, the first token's share of the weight (``sink_weight``, the registry's ``sink``) and of
  the norm-weighted output (``sink_output``, the same score with ``weighting="norm"``), the sink key's output norm
  against the other keys' (``sink_value_ratio``), and ``dormant = sink_weight - sink_output``: the weight the sink
  takes without moving anything, with 95% intervals over prompts. The registry's ``dormant`` score (a label) is
  this column (``dormant_frame``).
- ``massive_activations``: per layer, the residual dimensions above 100 and 1,000x the layer's median magnitude
  (Sun et al. 2024), where they sit, the first block where they appear and what writes them there (the attention
  or the MLP of that block, from the residual stream before, between and after them).
- ``sink_value_ablation`` and ``massive_dims_ablation``: zeroing the sink's value in the dormant heads against as
  many random sink heads (the change in loss), and setting the massive dimensions to their median at the first
  token against as many random dimensions (the sink heads' weight on the sink), both with bootstrap intervals.

Imports ``interp`` and ``analyses``' head scores; it will move into a sub-package of causal studies.
"""

from __future__ import annotations

import pandas as pd
import torch

from hooks.names import hook_name
from interp.tokens.inputs import pad_ids
from interp.runtime.progress import progress
from interp.attention.site_pass import each_site
from interp.attention.sites import FRONT, is_layered

from ..heads import registry
from ..data.bootstrap import check_n_bootstrap, mean_interval, ratio_interval, resample_counts
from ..heads.detect import prompt_sets
from ..heads.scores import Tally, rule_pairs, score_batch

__all__ = ["sink_heads", "dormant_frame", "massive_activations", "sink_value_ablation", "massive_dims_ablation"]

_DORMANT = "dormant"  # the registry's score this module computes (dormant_frame)
MASSIVE = (100.0, 1000.0)  # Sun et al. 2024: |x| > 100 and > 1000 x the median |x| of the layer's hidden states


class _SinkTally:
    """The sink score on the raw and on the norm-weighted attention in one pass, and each prompt's ratio of the sink
    key's output norm to the mean of the other real keys' (prompt, site, head)."""

    weighting = "norm"  # the pass carries the value norms

    def __init__(self, model, record, n_prompts: int, max_len: int):
        self.raw = Tally(model, [record], n_prompts, max_len)
        self.norm = Tally(model, [record], n_prompts, max_len, "norm")
        n_heads = max(s.n_heads for s in model.cfg.sites)
        self.ratio = torch.full((n_prompts, len(model.cfg.sites), n_heads), float("nan"), dtype=torch.float64)

    def mark_nonfinite(self, index: int, bad: torch.Tensor) -> None:
        self.raw.mark_nonfinite(index, bad)

    def add_site(self, read, index: torch.Tensor, pairs: dict) -> None:
        self.raw.add_site(read, index, pairs)
        self.norm.add_site(read, index, pairs)
        norms, valid = read.value_norms.double().cpu(), read.key_valid.cpu()  # (b, h, k), (b, k)
        first = valid.int().argmax(dim=1)
        rows = torch.arange(len(first))
        others = valid.clone()
        others[rows, first] = False
        mean_other = (norms * others[:, None]).sum(-1) / others.sum(-1, keepdim=True).clamp(min=1)
        self.ratio[index, read.index, : norms.shape[1]] = norms[rows, :, first] / mean_other.clamp(min=1e-30)


def sink_heads(model, prompts=None, n_prompts: int = 32, seq_len: int | None = None, seed: int = 0,
               batch_size: int = 8, n_bootstrap: int = 1000, thresholds: dict | None = None) -> pd.DataFrame:
    """One row per head of every site the sink score applies to: ``sink_weight`` (the mean weight a row puts on the
    first token), ``sink_output`` (the first token's share of the head's output norm, norm-weighted attention),
    ``sink_value_ratio`` (``||v_0 W_O||`` over the mean ``||v_j W_O||`` of the other real keys), ``dormant``
    (``sink_weight - sink_output``), each with ``_lo`` and ``_hi`` (95% bootstrap over prompts), and the labels
    ``is_sink`` and ``is_dormant`` (a sink head whose ``dormant`` clears its threshold: the registry's thresholds, or
    ``thresholds``; the registry's ``dormant`` label reads the column alone). Prompts as ``detect_heads`` takes
    them (default: ``n_prompts`` corpus prompts of up to ``seq_len`` tokens)."""
    check_n_bootstrap(n_bootstrap)
    record = registry.score("sink")
    ((_, rows, what),) = prompt_sets(model, [record], prompts, n_prompts, seq_len, seed)
    max_len = max(len(v) for row in rows for v in row.values())
    tally = _SinkTally(model, record, len(rows), max_len)
    with model.studying(), torch.no_grad():
        for start in progress(range(0, len(rows), batch_size), desc=f"sinks: {len(rows)} prompts", unit="batch"):
            index = torch.arange(start, min(len(rows), start + batch_size))
            score_batch(model, [rows[i] for i in index], index, [record], tally)
    raw, norm = tally.raw.frame(n_bootstrap, seed), tally.norm.frame(n_bootstrap, seed)
    at = {s.name: i for i, s in enumerate(model.cfg.sites)}
    site_at, head_at = torch.tensor([at[s] for s in raw.site]), torch.tensor(raw["head"].tolist())
    counts = resample_counts(len(rows), n_bootstrap, seed)
    taken = tally.raw.sums["sink"][:, site_at, head_at] - tally.norm.sums["sink"][:, site_at, head_at]
    dormant = ratio_interval(taken, tally.raw.rows["sink"][:, site_at].double(), counts=counts)
    ratio = tally.ratio[:, site_at, head_at]
    ratio_mean = ratio.nanmean(0)
    _, ratio_lo, ratio_hi = mean_interval(ratio.nan_to_num(), counts=counts)
    df = raw[FRONT].copy()
    for name, frame in (("sink_weight", raw), ("sink_output", norm)):
        df[name], df[f"{name}_lo"], df[f"{name}_hi"] = frame["sink"], frame["sink_lo"], frame["sink_hi"]
    df["sink_value_ratio"], df["sink_value_ratio_lo"], df["sink_value_ratio_hi"] = (
        ratio_mean.numpy(), ratio_lo.numpy(), ratio_hi.numpy())
    df["dormant"], df["dormant_lo"], df["dormant_hi"] = (t.numpy() for t in dormant)
    limits = {**registry.DEFAULT_THRESHOLDS, **(thresholds or {})}
    sink, dormant_limit = limits[record.name], limits[_DORMANT]
    df["is_sink"] = df.sink_weight >= sink
    df["is_dormant"] = df.is_sink & (df.dormant >= dormant_limit)  # a sink head whose sink moves little
    df.attrs.update(inputs=what, thresholds={record.name: sink, _DORMANT: dormant_limit}, attn=model.attn)
    return df


def dormant_frame(model, names, seed: int = 0, n_bootstrap: int = 1000, thresholds=None, context=None,
                  **_) -> pd.DataFrame:
    """The registry's runner of ``dormant``: ``sink_heads``'s ``dormant`` column and its interval, per head.

    The label's threshold, 0.2 (the registry's record), was chosen by the causal check, not by a gap: neither model
    has one (over SmolLM2-135M's sink heads ``dormant`` runs evenly from 0.06 to 0.34 at 10-90%, over Gemma 3
    270M's from 0.06 to 0.28). Swept from 0.1 to 0.5 (``benchmarks/sinks_real.py``, ``notebooks/sinks.md``): below
    0.2 the check cannot run (more heads clear it than there are other sink heads to compare with); at 0.2, zeroing
    the first token's value in the heads that clear it changes the next-token loss less than in as many other sink
    heads drawn at random, with the two 95% intervals apart, on both models (SmolLM2: 100 heads, +0.018 [-0.031,
    0.072] against +0.61 [0.53, 0.68]; Gemma 3: 19 heads, +0.17 [0.14, 0.20] against +0.55 [0.45, 0.65]). The
    lowest such threshold labels every head the check vouches for; higher ones leave fewer heads, whose effects
    and their controls' shrink together until the check no longer separates them (Gemma 3 at 0.3, SmolLM2 at 0.4)."""
    df = sink_heads(model, seq_len=context, seed=seed, n_bootstrap=n_bootstrap, thresholds=thresholds)
    out = df[[*FRONT, "dormant", "dormant_lo", "dormant_hi"]]
    out.attrs["inputs"] = df.attrs["inputs"]
    return out


# -- massive activations -------------------------------------------------------------------------------------------
def _batches(model, rows: list[dict], batch_size: int, desc: str):
    """(index, input_ids, attention_mask) of each left-padded batch of a causal model's prompts, with progress."""
    for start in progress(range(0, len(rows), batch_size), desc=desc, unit="batch"):
        index = torch.arange(start, min(len(rows), start + batch_size))
        ids, mask = pad_ids([rows[i]["input_ids"] for i in index], left=True, pad_id=model.pad_token_id)
        yield index, ids.to(model.device), mask.to(model.device)


def _residuals(model, rows: list[dict], batch_size: int) -> dict:
    """The residual stream before, between and after each block at every real token: ``{"pre", "mid", "post"}``
    each ``(layer, tokens, d_model)`` float32 (``mid`` None on parallel blocks), and ``pos`` ``(tokens,)`` each
    token's position counted from its prompt's first real token."""
    n_layers = model.cfg.n_layers
    kinds = ("pre", "mid", "post") if hook_name("resid_mid", 0) in model.hook_dict else ("pre", "post")
    found = {k: [[] for _ in range(n_layers)] for k in kinds}
    positions = []
    with model.studying(), torch.no_grad():
        for _, ids, mask in _batches(model, rows, batch_size, f"massive activations: {len(rows)} prompts"):
            real = mask.bool()

            def keep(x, hook):
                layer, kind = int(hook.name.split(".")[1]), hook.name.rsplit("_", 1)[1]
                found[kind][layer].append(x[real].float().cpu())

            names = [hook_name(f"resid_{k}", l) for l in range(n_layers) for k in kinds]
            with model.hooks([(names, keep)]):
                model(ids, mask)
            positions.append((real.long().cumsum(1) - 1)[real].cpu())
    out = {k: torch.stack([torch.cat(v) for v in found[k]]) for k in kinds}
    return {"mid": None, **out, "pos": torch.cat(positions)}


def _causal_rows(model, prompts, n_prompts, seq_len, seed, what: str) -> tuple[list[dict], str]:
    if not is_layered(model) or not model.cfg.causal:
        raise ValueError(f"{what} reads the residual stream of a decoder-only model, one site per block; "
                         f"{type(model.hf).__name__} is not one.")
    ((_, rows, inputs),) = prompt_sets(model, [registry.score("sink")], prompts, n_prompts, seq_len, seed)
    return rows, inputs


def massive_activations(model, prompts=None, n_prompts: int = 8, seq_len: int | None = None, seed: int = 0,
                        batch_size: int = 8, criterion: tuple[float, float] = MASSIVE) -> pd.DataFrame:
    """Residual dimensions of massive magnitude (Sun et al. 2024): one row per (layer, dim) whose largest ``|x|``
    after block ``layer`` (``hook_resid_post``) exceeds ``criterion[0]`` and ``criterion[1]`` times the median
    ``|x|`` of that layer's hidden states (real tokens of every prompt, every dimension).

    Columns: ``layer``, ``dim``, ``max_abs``, ``value`` (signed, at the largest), ``median_abs`` (the layer's),
    ``ratio``, ``n_tokens`` and ``positions`` (where it is massive, counted from each prompt's first token; at most
    8 shown), ``first_token_share`` (of those tokens, the share at position 0), ``first_layer`` (the first block
    after which the dim is massive), ``writer`` (at that block, ``"attn"`` or ``"mlp"``: the sublayer whose write
    to the dim is larger at the massive tokens, from the residual stream before, between and after them; ``"block"``
    on parallel blocks; ``"embedding"`` when already massive before block 0). ``df.attrs["dim_median"]``: (layer,
    dim) the median of each dim over real tokens, signed (what ``massive_dims_ablation`` sets them to)."""
    rows, inputs = _causal_rows(model, prompts, n_prompts, seq_len, seed, "massive_activations")
    res = _residuals(model, rows, batch_size)
    post, pos = res["post"], res["pos"]
    medians = post.abs().flatten(1).median(dim=1).values  # (layer,)
    massive = (post.abs() > criterion[0]) & (post.abs() > criterion[1] * medians[:, None, None])  # (l, t, m)
    embedded = (res["pre"][0].abs() > criterion[0]) & (res["pre"][0].abs() > criterion[1] * medians[0])
    any_layer = massive.any(1)  # (l, m)
    first = torch.where(any_layer.any(0), any_layer.int().argmax(0), -1)  # (m,)
    out = []
    for layer, dim in any_layer.nonzero().tolist():
        hits = massive[layer, :, dim]
        column = post[layer, :, dim]
        at = int(column.abs().argmax())
        where = sorted(set(pos[hits].tolist()))
        born = int(first[dim])
        out.append({"layer": layer, "dim": dim, "max_abs": float(column.abs().max()), "value": float(column[at]),
                    "median_abs": float(medians[layer]), "ratio": float(column.abs().max() / medians[layer]),
                    "n_tokens": int(hits.sum()), "positions": ",".join(map(str, where[:8])) + (
                        ",..." if len(where) > 8 else ""),
                    "first_token_share": float((pos[hits] == 0).double().mean()), "first_layer": born,
                    "writer": _writer(res, born, dim, massive[born, :, dim], bool(embedded[:, dim].any()))})
    columns = ["layer", "dim", "max_abs", "value", "median_abs", "ratio", "n_tokens", "positions",
               "first_token_share", "first_layer", "writer"]
    df = pd.DataFrame(out, columns=columns)
    df.attrs.update(inputs=inputs, criterion=criterion, dim_median=post.median(dim=1).values.numpy(),
                    layer_median_abs=medians.numpy())
    return df


def _writer(res: dict, layer: int, dim: int, hits: torch.Tensor, embedded: bool) -> str:
    """Which sublayer of block ``layer`` writes dim ``dim`` at the massive tokens ``hits``."""
    if embedded:
        return "embedding"
    if res["mid"] is None:
        return "block"
    attn = (res["mid"][layer, hits, dim] - res["pre"][layer, hits, dim]).abs().mean()
    mlp = (res["post"][layer, hits, dim] - res["mid"][layer, hits, dim]).abs().mean()
    return "mlp" if mlp > attn else "attn"


# -- causal checks -------------------------------------------------------------------------------------------------
def _effect_rows(effects: dict[str, torch.Tensor], heads: dict[str, list], n_bootstrap: int, seed: int,
                 column: str) -> pd.DataFrame:
    """One row per condition: the mean over prompts of its per-prompt effect ``(prompts,)`` with a 95% bootstrap
    interval (one set of resamples for every condition), and a ``random`` row pooling the random draws."""
    names = list(effects)
    draws = [n for n in names if n.startswith("random")]
    if draws:
        effects = {**effects, "random": torch.stack([effects[n] for n in draws]).mean(0)}
        heads = {**heads, "random": [f"{len(draws)} draws"]}
    counts = resample_counts(len(next(iter(effects.values()))), n_bootstrap, seed)
    out = []
    for name, values in effects.items():
        mean, lo, hi = mean_interval(values[:, None], counts=counts)
        out.append({"condition": name, "what": " ".join(map(str, heads[name])), column: float(mean[0]),
                    f"{column}_lo": float(lo[0]), f"{column}_hi": float(hi[0])})
    return pd.DataFrame(out)


def _prompt_losses(model, rows: list[dict], batch_size: int, hooks=()) -> torch.Tensor:
    """(prompts,) each prompt's mean next-token cross-entropy over its real tokens."""
    losses = torch.zeros(len(rows), dtype=torch.float64)
    for index, ids, mask in _batches(model, rows, batch_size, "sinks: loss"):
        with model.hooks(list(hooks(mask) if callable(hooks) else hooks)):
            logits = model(ids, mask).logits.float()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(),
                                                reduction="none").view(len(index), -1)
        scored = mask[:, 1:].bool() & mask[:, :-1].bool()
        losses[index] = ((nll * scored).sum(1) / scored.sum(1).clamp(min=1)).double().cpu()
    return losses


def sink_value_ablation(model, sinks: pd.DataFrame | None = None, prompts=None, n_prompts: int = 16,
                        seq_len: int | None = None, seed: int = 0, n_random: int = 10, batch_size: int = 8,
                        n_bootstrap: int = 1000) -> pd.DataFrame:
    """Zero the first token's value in the dormant heads (``sinks``: ``sink_heads``'s table, computed when None),
    and in as many sink heads that are not dormant, drawn ``n_random`` times: the change in each prompt's mean
    next-token loss, with 95% intervals over prompts. A dormant head's sink moves nothing, so removing it should
    change the loss less. Runs on the eager path (the first token's column of each head's pattern set to 0, which
    is zeroing its value for that head alone); the model's path is restored after. Rows: ``dormant``, ``random 0``
    ... and ``random`` (the draws pooled), with ``delta_loss``, ``delta_loss_lo``, ``delta_loss_hi``;
    ``df.attrs["inputs"]`` says which prompts."""
    rows, inputs = _causal_rows(model, prompts, n_prompts, seq_len, seed, "sink_value_ablation")
    sinks = sink_heads(model, prompts, n_prompts, seq_len, seed, batch_size, n_bootstrap) if sinks is None else sinks
    dormant = [(int(l), int(h)) for l, h in sinks.loc[sinks.is_dormant, ["layer", "head"]].to_numpy()]
    pool = [(int(l), int(h)) for l, h in sinks.loc[sinks.is_sink & ~sinks.is_dormant, ["layer", "head"]].to_numpy()]
    if not dormant or len(pool) < len(dormant):
        raise ValueError(f"sink_value_ablation compares the {len(dormant)} dormant heads with as many other sink "
                         f"heads ({len(pool)} here); it needs at least one dormant head and as many others.")
    generator = torch.Generator().manual_seed(seed)
    sets = {"dormant": dormant, **{f"random {i}": [pool[j] for j in torch.randperm(len(pool), generator=generator)
                                                   [: len(dormant)].tolist()] for i in range(n_random)}}
    path = model.attn
    with model.studying(), torch.no_grad():
        try:
            model.set_attn("eager")
            base = _prompt_losses(model, rows, batch_size)
            effects = {name: _prompt_losses(model, rows, batch_size, _zero_sink_hooks(heads)) - base
                       for name, heads in progress(sets.items(), desc="sinks: zero the sink's value", unit="set")}
        finally:
            model.set_attn(path)
    df = _effect_rows(effects, {n: [f"{l}.{h}" for l, h in s] for n, s in sets.items()}, n_bootstrap, seed,
                      "delta_loss")
    df.attrs["inputs"] = inputs
    return df


def _zero_sink_hooks(heads: list[tuple[int, int]]):
    """hooks(mask): pattern hooks setting each head's weight on its row's first real key to 0."""
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)

    def hooks(mask):
        first = mask.int().argmax(dim=1)
        rows = torch.arange(len(first), device=mask.device)

        def zero(pattern, hook, chosen):
            pattern = pattern.clone()
            for h in chosen:
                pattern[rows, h, :, first] = 0.0
            return pattern

        return [(hook_name("pattern", l), lambda p, hook, c=hs: zero(p, hook, c)) for l, hs in by_layer.items()]

    return hooks


def _sink_weight(model, rows: list[dict], heads: list[tuple[int, int]], batch_size: int, edit=None) -> torch.Tensor:
    """(prompts,) the mean over ``heads`` of each prompt's mean weight on its first token (the sink score's pairs),
    with the residual edits ``edit(mask)`` (hooks) active."""
    record = registry.score("sink")
    sites = sorted({layer for layer, _ in heads})
    out = torch.zeros(len(rows), dtype=torch.float64)
    for index, ids, mask in _batches(model, rows, batch_size, "sinks: sink weight"):
        valid = mask.bool()
        pairs = rule_pairs(record, ids, valid, ids, valid, True)
        found = []

        def visit(read):
            w = read.weights(pairs.b, pairs.q, pairs.k).double().cpu()  # (n, h)
            per_prompt = torch.zeros(len(index), w.shape[1], dtype=torch.float64).index_add_(0, pairs.b, w)
            chosen = [h for layer, h in heads if layer == read.site.block]
            found.append(per_prompt[:, chosen] / pairs.rows[:, None].clamp(min=1))

        with model.hooks(edit(mask) if edit is not None else []):
            each_site(model, {"input_ids": ids, "attention_mask": mask}, visit, sites)
        out[index] = torch.cat(found, 1).mean(1)
    return out


def massive_dims_ablation(model, sinks: pd.DataFrame | None = None, massive: pd.DataFrame | None = None,
                          prompts=None, n_prompts: int = 16, seq_len: int | None = None, seed: int = 0,
                          n_random: int = 10, batch_size: int = 8, n_bootstrap: int = 1000) -> pd.DataFrame:
    """Set the massive dimensions (``massive``: ``massive_activations``'s table) to their median at each prompt's
    first token, after every block from the one that writes each, and as many random other dimensions drawn
    ``n_random`` times: the drop in the sink heads' weight on the first token (``sinks``: ``sink_heads``'s table;
    the sink heads after the first writing block), with 95% intervals over prompts. Rows ``massive``, ``random 0``
    ... and ``random`` (the draws pooled), with ``sink_drop``, ``sink_drop_lo``, ``sink_drop_hi``; ``df.attrs``:
    the sink weight without edits, the heads read and the prompts (``inputs``)."""
    rows, inputs = _causal_rows(model, prompts, n_prompts, seq_len, seed, "massive_dims_ablation")
    massive = massive_activations(model, prompts, n_prompts, seq_len, seed, batch_size) if massive is None else massive
    if massive.empty:
        raise ValueError("massive_dims_ablation: the model has no massive activations on these prompts "
                         "(massive_activations found none), so there is nothing to remove.")
    sinks = sink_heads(model, prompts, n_prompts, seq_len, seed, batch_size, n_bootstrap) if sinks is None else sinks
    born = massive.groupby("dim").first_layer.min().to_dict()  # dim -> the block that first writes it
    start = min(born.values())
    after = sinks.is_sink & (sinks.layer > start)
    heads = [(int(l), int(h)) for l, h in sinks.loc[after, ["layer", "head"]].to_numpy()]
    if not heads:
        raise ValueError(f"massive_dims_ablation reads the sink heads after block {start}; there are none.")
    median = torch.as_tensor(massive.attrs["dim_median"])  # (layer, dim)
    generator = torch.Generator().manual_seed(seed)
    others = [d for d in range(median.shape[1]) if d not in born]
    sets = {"massive": sorted(born), **{f"random {i}": sorted(others[j] for j in torch.randperm(
        len(others), generator=generator)[: len(born)].tolist()) for i in range(n_random)}}

    def edit(dims: list[int]):
        def hooks(mask):
            first = mask.int().argmax(dim=1)
            rows_at = torch.arange(len(first), device=mask.device)

            def set_median(x, hook):
                layer = int(hook.name.split(".")[1])
                dims_here = [d for d in dims if born.get(d, start) <= layer]
                x = x.clone()
                x[rows_at[:, None], first[:, None], torch.tensor(dims_here, device=x.device)[None]] = \
                    median[layer, dims_here].to(x)
                return x

            return [([hook_name("resid_post", l) for l in range(start, model.cfg.n_layers)], set_median)]
        return hooks

    with model.studying(), torch.no_grad():
        base = _sink_weight(model, rows, heads, batch_size)
        effects = {name: base - _sink_weight(model, rows, heads, batch_size, edit(dims))
                   for name, dims in progress(sets.items(), desc="sinks: remove massive dims", unit="set")}
    df = _effect_rows(effects, sets, n_bootstrap, seed, "sink_drop")
    df.attrs.update(sink_weight=float(base.mean()), heads=[f"{l}.{h}" for l, h in heads], edited_from=start,
                    inputs=inputs)
    return df
