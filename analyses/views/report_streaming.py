"""The report's opt-in streaming section (``write_report(..., streaming=True)``, ``interp report --streaming``).

Heads stream (keep ``sink`` first keys and a recent ``window``, ``interp.stream_heads``) 20% of all heads at a time,
in the order of a score the report already computed (lowest induction score first: induction heads copy from far
back, the heads DuoAttention would keep full), against 2 random orders; on rows long enough that a window of an
eighth of them hides most of the context. Causal decoders only: an encoder sees every key both ways and an
encoder-decoder's cross-attention has no recent window.
"""

from __future__ import annotations

import html

import matplotlib.pyplot as plt
import pandas as pd

from ..long.streaming import streaming_curve, streaming_inputs
from .study_plots import streaming_curve_plot

__all__ = ["check_streaming", "streaming_section", "streaming_html", "streaming_finding"]

_TOKENS = 256  # SmolLM2 with 2 threads: 2 rows x 256 tokens, 18 forwards, a few seconds
_ROWS = 2
_STEP = 0.2
_SEEDS = (0, 1)
_SCORE = "induction"


def check_streaming(model) -> None:
    """A clear error where streaming does not apply: it is for causal decoders with a full-attention layer."""
    from interp.streaming import check_streamable

    from ..data.seq2seq import is_seq2seq

    if is_seq2seq(model) or not model.cfg.causal:
        kind = "an encoder-decoder" if is_seq2seq(model) else "an encoder (non-causal)"
        raise ValueError(f"The report's streaming section is for causal decoders (sinks + a recent window of "
                         f"earlier keys); {model.hf.config.model_type} is {kind} model."
                         " Leave out streaming=True / --streaming.")
    check_streamable(model, "The report's streaming section", "Leave out streaming=True / --streaming.")


def streaming_section(model, heads: pd.DataFrame, figures, out, seed: int = 0) -> dict:
    """Run the small streaming curve, add its figure, write ``streaming.csv``; the summary's ``streaming`` entry."""
    tokens = min(_TOKENS, model.cfg.max_positions or _TOKENS)
    sink, window = 4, max(4, tokens // 8)
    inputs, metric, what = streaming_inputs(model, tokens, rows=_ROWS, seed=seed)
    column = _SCORE if _SCORE in heads else None
    scored = None
    if column is not None:
        scored = heads[["layer", "head", column]].copy()
        if scored[column].isna().any():
            column = None
    order = scored if column is not None else "importance"
    curves = [streaming_curve(model, inputs, metric, order=order, column=column, step=_STEP, sink=sink,
                              window=window)]
    curves.append(streaming_curve(model, inputs, metric, order="random", step=_STEP, seeds=_SEEDS, sink=sink,
                                  window=window))
    df = pd.concat(curves, ignore_index=True)
    df.attrs.update(curves[0].attrs)
    df.to_csv(out / "streaming.csv", index=False)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    streaming_curve_plot(df, ax=ax)
    figures.add("streaming", fig)
    table = df.groupby(["order", "fraction_streaming"], sort=False).agg(
        metric=("metric", "mean"), lo=("metric", "min"), hi=("metric", "max"),
        kv_fraction=("kv_fraction", "mean")).reset_index()
    return {"inputs": what, "metric": metric.name, "sink": sink, "window": window, "tokens": tokens,
            "order": column or "importance", "seeds": list(_SEEDS), "step": _STEP,
            "rows": table.to_dict(orient="records")}


def streaming_finding(s: dict | None) -> str | None:
    """One line for the findings list: the metric at half the heads streaming, detector order against random."""
    if not s:
        return None
    rows = pd.DataFrame(s["rows"])
    full = rows[rows.fraction_streaming == 0].metric.iloc[0]
    half = rows.loc[(rows.fraction_streaming - 0.5).abs().groupby(rows.order).idxmin()].set_index("order")
    ranked, rnd = half.loc[s["order"]], half.loc["random"]
    return (f"Streaming {ranked.fraction_streaming * 100:.0f}% of heads (sink {s['sink']}, window {s['window']} of "
            f"{s['tokens']} tokens; KV cache {ranked.kv_fraction * 100:.0f}% of full) in order of "
            f"{html.escape(s['order'])} moves <code>{html.escape(s['metric'])}</code> from {full:.3f} to "
            f"{ranked.metric:.3f}; random orders: {rnd.metric:.3f} ({rnd.lo:.3f}-{rnd.hi:.3f}) "
            '<a href="#streaming">evidence</a>')


def streaming_html(s: dict | None, figures, table) -> str:
    """The section (empty without ``streaming=True``); ``table`` is the page's table writer."""
    if not s:
        return ""
    esc = html.escape
    rows = pd.DataFrame(s["rows"]).rename(columns={"fraction_streaming": "fraction streaming",
                                                   "lo": "min (seeds)", "hi": "max (seeds)",
                                                   "kv_fraction": "KV cache (share of full)"})
    return f"""<h2 id="streaming">Streaming heads</h2>
<p>Heads turned into streaming heads (the first {s['sink']} keys and the last {s['window']} before each query,
<code>interp.stream_heads</code>), {s['step'] * 100:.0f}% of all heads more at each step, in order of
{esc(s['order'])} (lowest first) against {len(s['seeds'])} random orders (mean, range shaded), on
{esc(s['inputs'])}; metric <code>{esc(s['metric'])}</code>. The dotted line: the KV cache a
<code>StreamingCache</code> holds at {s['tokens']} tokens, as a share of full attention's;
<a href="streaming.csv"><code>streaming.csv</code></a>.</p>
{figures.img('streaming', 'streaming curve')}
{table(rows, '{:.3f}')}
"""
