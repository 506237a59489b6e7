"""A needle streaming curve on a real model: needle-in-a-haystack accuracy as 10% more heads stream at a time, in the
order of the retrieval score (least retrieval first, Wu et al. 2024) and in random orders, with the KV memory of each
step (``analyses.streaming_curve``).

The needle is read teacher-forced: each prompt (``analyses.data.needles.needle_prompts``: a needle of 8 random digits (16 tokens: a space before each) at a
depth of a haystack of the project's sentences, then the question) is followed by its answer, and the metric is the
share of the answer's digits (not the spaces between them, which need no needle) that the model predicts (greedy)
from the tokens before them. The streaming mask is exact
against the streaming cache (``tests/test_streaming.py``), so this is what decoding with a streaming cache would give
token by token when every earlier token was right. Retrieval scores are detected first at ``--detect-length``
(seed 0; the curve's prompts use seed 1).

    python benchmarks/streaming_needle_curve.py --model smollm2 --length 2048 --plot curve.png --csv smollm2.csv
    python benchmarks/streaming_needle_curve.py --panels smollm2.csv gemma3.csv --plot curves.png  # one figure
"""

from __future__ import annotations

import argparse
import os
import time

import pandas as pd
import torch

import interp
from analyses import streaming_curve, streaming_curve_plot
from analyses.long.retrieval import retrieval_heads
from analyses.data.needles import needle_prompts

NEEDLE = 8


def needle_accuracy(content: torch.Tensor):
    """The metric: the share of the answer's content tokens (``content``: (rows, answer length) bool, the digits,
    not the spaces between them, which any model predicts) that the previous position's argmax predicts."""
    n = content.shape[1]

    def needle_accuracy(output, batch) -> torch.Tensor:
        logits = output.logits if hasattr(output, "logits") else output[0]
        hit = logits[:, -n - 1:-1].argmax(-1) == batch["input_ids"][:, -n:]
        return (hit & content).sum() / content.sum()

    return needle_accuracy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--detect-length", type=int, default=2048)
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7])
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--step", type=float, default=0.1)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--plot", default=None, help="write the figure here (PNG)")
    p.add_argument("--csv", default=None, help="write the curve's rows here")
    p.add_argument("--panels", nargs="+", default=None, help="draw these saved --csv curves side by side (--plot)")
    a = p.parse_args()
    if a.panels:
        return panels(a.panels, a.plot)
    interp.set_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}", flush=True)
    model = interp.load_model(a.model, attn="flash")
    t = time.perf_counter()
    scores = retrieval_heads(model, lengths=[a.detect_length], context=a.detect_length, depths=(0.1, 0.5, 0.9),
                             n_bootstrap=200)
    scores["retrieval"] = scores["retrieval"].fillna(0.0)
    top = scores.nlargest(5, "retrieval")
    print(f"retrieval detection {time.perf_counter() - t:.0f} s; top: "
          + ", ".join(f"{r.layer}.{r.head} {r.retrieval:.2f}" for r in top.itertuples()), flush=True)
    prompts = needle_prompts(model, [a.length], a.depths, needle_len=NEEDLE, seed=1)
    rows = [torch.cat([q.ids, q.answer]) for q in prompts]
    if len({len(r) for r in rows}) != 1:
        raise SystemExit(f"needle prompts of different lengths {sorted({len(r) for r in rows})}; this script needs "
                         "one length (no padding).")
    ids = torch.stack(rows)
    answer = len(prompts[0].answer)
    tok = model.tokenizer
    content = torch.stack([torch.tensor([tok is None or bool(tok.decode([int(t)]).strip()) for t in q.answer])
                           for q in prompts])
    print(f"answer: {answer} tokens, {int(content[0].sum())} of them content (the rest spaces)", flush=True)
    # the LM head on the answer's rows only (Gemma 3's 262k vocabulary on every row would be 8.6 GB per forward)
    model.hf.register_forward_pre_hook(lambda m, args, kwargs: (args, {**kwargs, "logits_to_keep": answer + 1}),
                                       with_kwargs=True)
    t = time.perf_counter()
    curves = [streaming_curve(model, ids, needle_accuracy(content), order=order, seeds=a.seeds, sink=a.sink, window=a.window,
                              step=a.step, higher_is_better=True)
              for order in (scores, "random")]
    df = pd.concat(curves)
    df.attrs.update(curves[0].attrs, metric="needle accuracy (teacher-forced)")
    df.loc[df.order != "random", "order"] = "retrieval (least first)"
    print(f"{a.model}, {a.length} + {answer} tokens, depths {a.depths}, sink {a.sink}, window {a.window}; "
          f"curve {time.perf_counter() - t:.0f} s, load {os.getloadavg()[0]:.1f}")
    table = df.groupby(["order", "fraction_streaming"], sort=False).agg(
        accuracy=("metric", "mean"), lo=("metric", "min"), hi=("metric", "max"), heads=("heads_streaming", "first"),
        kv=("kv_fraction", "mean"))
    print(table.round(3).to_string())
    if a.csv:
        df.assign(sink=a.sink, window=a.window, kv_tokens=df.attrs["kv_tokens"]).to_csv(a.csv, index=False)
    if a.plot:
        ax = streaming_curve_plot(df)
        ax.set_title(f"{a.model}: needle at {a.length} tokens as heads stream")
        ax.figure.savefig(a.plot, dpi=150)


def panels(paths: list[str], out: str) -> None:
    """One figure, a panel per saved curve (its file name, minus .csv, is the panel's title)."""
    import matplotlib.pyplot as plt
    from pathlib import Path

    fig, axes = plt.subplots(1, len(paths), figsize=(6.6 * len(paths), 4.4), layout="constrained", squeeze=False)
    for ax, path in zip(axes[0], paths):
        df = pd.read_csv(path)
        first = df.iloc[0]  # files written before these columns were added ran with the defaults, 2,048 + 16 tokens
        df.attrs.update(metric="needle accuracy (teacher-forced)", sink=int(first.get("sink", 4)),
                        window=int(first.get("window", 256)), kv_tokens=int(first.get("kv_tokens", 2048 + 16)))
        streaming_curve_plot(df, ax=ax)
        ax.set_ylim(-0.02, 1.05)
        ax.set_title(f"{Path(path).stem}: {int(df.heads_streaming.max())} heads can stream")
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
