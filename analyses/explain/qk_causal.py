"""The causal check of ``qk_attribution``: a path intervention on one side of one head.

An attribution says which upstream heads' outputs the head's scores are made of; it does not say the head needs them.
For the ``top`` upstream heads of a side (largest mean term on that side), we remove their output from the residual
stream that side reads, and from nothing else: the head's keys (or queries) are recomputed from ``x - r`` with the
model's own norms, projection, q/k norm and RoPE (the norm's scale recomputed, as path patching does: Wang et al.
2022), every other head and the other side keeping the run's values; the attention weight on the pairs is then read
from the kernel's own logsumexp. The same is done for ``top`` random heads of the same layers, ``draws`` times: the
top heads matter when their drop stands out of that distribution. A head's output in a block that normalises its
attention output (Gemma 2/3) is removed as the exact split counts it: through that norm frozen at the run.
"""

from __future__ import annotations

import math

import torch

import pandas as pd

from hooks.names import hook_name
from interp.attention.sites import head_columns, site_of

from .qk_parts import _rotate, block_hook, frozen, key_prefix, out_hook, qk_norm, run_until, stack_sites

__all__ = ["causal_check", "causal_summary"]


def causal_check(model, batch, head, pairs, df: pd.DataFrame, rec, top: int = 3, draws: int = 20,
                 seed: int = 0) -> list[dict]:
    """Records per side (``key``, ``query``) and intervention: the ``top`` heads (``control="top"``) and ``draws``
    random sets of as many heads from the same layers (``"random"``): ``removed`` (labels), ``baseline`` and
    ``weight`` (mean attention on the pairs before and after), ``drop`` (their difference)."""
    site = site_of(model, head)
    columns = head_columns(model, head)
    mine = df[(df["site"] == site.name) & (df["head"] == head[1]) & (df["component"] == "head")]
    generator = torch.Generator().manual_seed(seed)
    records = []
    for side, column in (("k", "key"), ("q", "query")):
        rows = mine.dropna(subset=[column])
        if rows.empty:
            continue
        ranked = rows.sort_values(column, ascending=False)
        label = {(r.source_site, int(r.source_head)): r.label for r in rows.itertuples()}
        chosen = [(r.source_site, int(r.source_head)) for r in ranked.head(top).itertuples()]
        baseline = _weight(model, batch, site, head[1], side, [], pairs, rec)
        sets = [("top", 0, chosen)] + [("random", d, _draw(chosen, list(label), generator)) for d in range(draws)]
        for control, draw, removed in sets:
            after = _weight(model, batch, site, head[1], side, removed, pairs, rec)
            records.append({**columns, "side": column, "control": control, "draw": draw,
                            "removed": "+".join(label[r] for r in removed), "baseline": baseline, "weight": after,
                            "drop": baseline - after})
    return records


def _draw(chosen: list, pool: list, generator: torch.Generator) -> list:
    """As many heads as ``chosen``, each from the same site as one of them where that site has others left."""
    picked: list = []
    for where, _ in chosen:
        same = [h for h in pool if h[0] == where and h not in chosen and h not in picked]
        rest = same or [h for h in pool if h not in chosen and h not in picked] or [h for h in pool if h not in picked]
        picked.append(rest[int(torch.randint(len(rest), (1,), generator=generator))])
    return picked


def _weight(model, batch, site, h: int, side: str, removed: list, pairs: list, rec) -> float:
    """Mean attention weight of head ``h`` on ``pairs`` in a forward where the heads ``removed`` are taken out of the
    stream that its ``side`` reads (one forward, stopped after the head's kernel)."""
    group = site.n_heads // site.n_kv_heads
    index = h if side == "q" else h // group
    cross_k = site.kind == "cross" and side == "k"
    by_site: dict[str, list[int]] = {}
    for where, head in removed:
        by_site.setdefault(where, []).append(head)
    held: dict = {}
    hooks = []

    def hold(name):
        def fn(t, hook):
            held[name] = t.detach()
        return fn

    for where, heads in by_site.items():
        hooks.append((hook_name("z", where), hold(f"z:{where}")))
        if rec.post_norms.get(where) is not None:
            src = model.sites[where]
            hooks.append((out_hook(src.name.rsplit(".", 2)[0], src), hold(f"out:{where}")))
    handles = []
    attn = model._site_modules[site.name]
    if cross_k:
        prefix = key_prefix(model, site)
        last = max(s.block for s in stack_sites(model, prefix))
        hooks.append((block_hook("resid_post", prefix, last), hold("x")))
    else:
        def grab(module, args):  # returns None: a pre-hook's return value would replace the norm's input
            if "x" not in held:
                held["x"] = args[0].detach()
        handles.append(model.in_norm_of(site).register_forward_pre_hook(grab))

    def rope(module, args, kwargs):
        table = kwargs.get("position_embeddings")
        if isinstance(table, (tuple, list)) and len(table) == 2:
            held["rope"] = table
    handles.append(attn.register_forward_pre_hook(rope, with_kwargs=True))

    def edit(t, hook):  # (b, p, heads, d): this head's q (or its key/value head's k) from the stream less r
        if removed:
            x = held["x"].double()
            r = torch.zeros_like(x)
            for where, heads in by_site.items():
                w_o = rec.weights(model.sites[where])["W_O"].to(x.device)
                part = torch.einsum("bpke,kem->bpm", held[f"z:{where}"][:, :, heads].double(), w_o[heads])
                if rec.post_norms.get(where) is not None:
                    out = held[f"out:{where}"]
                    part = frozen(rec.post_norms[where], out.reshape(-1, out.shape[-1]))[0](
                        part.reshape(-1, part.shape[-1])).reshape(part.shape)
                r = r + part
            t = t.clone()
            t[:, :, index] += (_side(model, rec, site, side, index, x - r, held.get("rope"))
                               - _side(model, rec, site, side, index, x, held.get("rope"))).to(t.dtype)
        held[side] = t[:, :, index].detach()
        return t

    def other(t, hook):
        held["k" if side == "q" else "q"] = t[:, :, h if side == "k" else h // group].detach()

    def lse(t, hook):
        held["lse"] = t[:, h].detach()  # (b, q)
        b = model._layer_hooks[site.name].bias
        held["bias"] = None if b is None else b[:, h].detach()

    hooks += [(hook_name(side, site.name), edit), (hook_name("k" if side == "q" else "q", site.name), other),
              (hook_name("lse", site.name), lse)]
    try:
        run_until(model, batch, hooks, [site])
    finally:
        for handle in handles:
            handle.remove()
    total = 0.0
    for b, i, j in pairs:
        score = site.scale * float((held["q"][b, i].double() * held["k"][b, j].double()).sum())
        score = score if site.softcap is None else math.tanh(score / site.softcap) * site.softcap
        bias = 0.0 if held["bias"] is None else float(held["bias"][min(b, held["bias"].shape[0] - 1), i, j])
        total += math.exp(score + bias - float(held["lse"][b, i]))
    return total / len(pairs)


def _side(model, rec, site, side: str, index: int, x: torch.Tensor, table) -> torch.Tensor:
    """One head's q (or key/value head's k) ``(b, p, d)`` float64 computed from the stream ``x: (b, p, m)`` with the
    model's modules: the input norm (an encoder's final norm for cross keys), projection, q/k norm, RoPE."""
    norm = rec.final_norm if site.kind == "cross" and side == "k" else model.in_norm_of(site)
    if norm is not None:
        param = next(norm.parameters(), None)
        x = norm(x.to(param.dtype if param is not None else torch.float32)).double()
    weights = rec.weights(site)
    w, b = weights["W_Q" if side == "q" else "W_K"].to(x.device), weights["b_Q" if side == "q" else "b_K"].to(x.device)
    raw = torch.einsum("bpm,hmd->bphd", x, w) + b
    qkn = qk_norm(model._site_modules[site.name], side)
    if qkn is not None:
        dtype = next(qkn.parameters()).dtype
        if sum(p.numel() for p in qkn.parameters()) == raw.shape[-1] or raw.shape[-2] == 1:
            raw = qkn(raw.to(dtype)).double()
        else:
            raw = qkn(raw.flatten(-2).to(dtype)).double().unflatten(-1, raw.shape[-2:])
    out = raw[:, :, index]
    return out if table is None else _rotate(out, tuple(t.to(out.device) for t in table))


def causal_summary(records) -> pd.DataFrame:
    """One row per (head, side) of ``df.attrs["causal"]``: the top heads' drop, the random draws' mean and 5-95%
    range, and the share of random draws whose drop is at least the top heads' (an empirical p-value)."""
    df = pd.DataFrame(records)
    if df.empty:
        return df
    keys = ["stack", "kind", "site", "layer", "head", "side"]
    rows = []
    for key, group in df.groupby(keys, sort=False):
        top = group[group["control"] == "top"].iloc[0]
        rand = group.loc[group["control"] == "random", "drop"]
        rows.append({**dict(zip(keys, key)), "removed": top["removed"], "baseline": top["baseline"],
                     "top_drop": top["drop"], "random_mean": rand.mean() if len(rand) else float("nan"),
                     "random_q05": rand.quantile(0.05) if len(rand) else float("nan"),
                     "random_q95": rand.quantile(0.95) if len(rand) else float("nan"),
                     "share_random_ge_top": float((rand >= top["drop"]).mean()) if len(rand) else float("nan"),
                     "draws": len(rand)})
    return pd.DataFrame(rows)
