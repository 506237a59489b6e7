"""The report's sink finding (``analyses.explain.sinks``): of the heads that park their weight on the first token, how
many are dormant (the sink takes the weight and moves little of the output), what zeroing the first token's value in
them does to the loss against as many other sink heads drawn at random, and which block writes the massive
activations that make the first token a sink (Sun et al. 2024).

Kept cheap, as every stage of the report: a few corpus prompts and draws (``_PROMPTS``, ``_CHECK_PROMPTS``,
``_DRAWS``), a few seconds on SmolLM2-135M with one thread; ``notebooks/sinks.md`` has the full runs. Causal
decoders only (the loss check and the residual stream read one site per block); other models keep the plain count.
"""

from __future__ import annotations

import html

from interp.attention.sites import is_layered

from ..explain.sinks import massive_activations, sink_heads, sink_value_ablation

__all__ = ["sinks_apply", "sinks_finding", "sinks_section"]

_PROMPTS = 8  # corpus prompts for the sink heads and the massive activations
_CHECK_PROMPTS = 4  # prompts of the loss check
_DRAWS = 3  # random sets of other sink heads


def sinks_apply(model) -> bool:
    """Whether the report has a sink stage for the model: a causal decoder with one attention site per block."""
    return is_layered(model) and bool(model.cfg.causal)


def sinks_section(model, seed: int = 0) -> dict:
    """The summary's ``sinks`` entry (``sinks_apply(model)`` must hold)."""
    sinks = sink_heads(model, n_prompts=_PROMPTS, seed=seed, n_bootstrap=200)
    dormant = sinks[sinks.is_dormant].sort_values("dormant", ascending=False)
    entry = {"prompts": sinks.attrs["inputs"], "thresholds": sinks.attrs["thresholds"],
             "n_sink": int(sinks.is_sink.sum()), "n_dormant": int(len(dormant)),
             "dormant": [{"head": f"{int(r.layer)}.{int(r.head)}", "weight": round(float(r.sink_weight), 3),
                          "output": round(float(r.sink_output), 3)} for r in dormant.head(3).itertuples()]}
    n_others = int((sinks.is_sink & ~sinks.is_dormant).sum())
    if entry["n_dormant"] and n_others:
        # as many other sink heads as dormant ones: where fewer remain, the most dormant heads, as many as there are
        checked = dormant.head(min(len(dormant), n_others))
        chosen = sinks.assign(is_dormant=sinks.index.isin(checked.index))
        check = sink_value_ablation(model, chosen, n_prompts=_CHECK_PROMPTS, seed=seed, n_random=_DRAWS,
                                    n_bootstrap=200).set_index("condition")
        entry["value_check"] = {
            "dormant": [float(check.loc["dormant", c]) for c in ("delta_loss", "delta_loss_lo", "delta_loss_hi")],
            "draws": [float(check.loc[f"random {i}", "delta_loss"]) for i in range(_DRAWS)],
            "prompts": check.attrs["inputs"], "n_heads": len(checked)}
    massive = massive_activations(model, n_prompts=_PROMPTS, seed=seed)
    entry["massive"] = [{"dim": int(dim), "block": int(rows.first_layer.iloc[0]), "writer": str(rows.writer.iloc[0]),
                         "max_abs": round(float(rows.max_abs.max()), 1), "first_token": bool(
                             (rows.first_token_share == 1.0).all())} for dim, rows in massive.groupby("dim")]
    return entry


def sinks_finding(entry: dict | None) -> str:
    """The sentence the report's sink line ends with (HTML, escaped), or "" without a ``sinks`` entry."""
    if not entry or not entry["n_sink"]:
        return ""
    esc = html.escape
    n_sink, n_dormant = entry["n_sink"], entry["n_dormant"]
    threshold = entry["thresholds"].get("dormant")
    text = (f" Read on norm-weighted attention, <b>{n_dormant} of {n_sink}</b> sink heads on "
            f"{esc(entry['prompts'])} are dormant (their first token takes at least {threshold:g} more of the weight "
            "than of the output)")
    if entry["dormant"]:
        text += ", e.g. " + ", ".join(f"{esc(d['head'])} (weight {d['weight']:.2f}, output {d['output']:.2f})"
                                      for d in entry["dormant"])
    check = entry.get("value_check")
    if check:
        mean, lo, hi = check["dormant"]
        draws = check["draws"]
        some = "them" if check["n_heads"] == n_dormant else f"the {check['n_heads']} most dormant"
        text += (f"; zeroing the first token's value in {some} changes the loss by {mean:+.3f} [{lo:+.3f}, "
                 f"{hi:+.3f}] on {esc(check['prompts'])}, in as many other sink heads by {min(draws):+.3f} to "
                 f"{max(draws):+.3f} ({len(draws)} draws)")
    text += "."
    if entry["massive"]:
        parts = [f"dim {m['dim']} (up to {m['max_abs']:,.0f}, from {_source(m)}"
                 f"{', at the first token only' if m['first_token'] else ''})" for m in entry["massive"]]
        text += " Massive activations (over 100 and 1,000x the median): " + "; ".join(parts) + "."
    else:
        text += " No massive activation (over 100 and 1,000x the median) on these prompts."
    return text + ' <a href="#classes">scores</a>'


def _source(m: dict) -> str:
    """Where a massive dim is first written: the embedding, block N's attention or MLP, or block N (parallel)."""
    writer = {"attn": "attention", "mlp": "MLP"}.get(m["writer"])
    if m["writer"] == "embedding":
        return "the embedding"
    return f"block {m['block']}'s {writer}" if writer else f"block {m['block']}"
