"""A streaming curve on a real model: next-token loss on natural text as 10% more heads stream at a time, in
Michel importance order and in random orders, with the KV memory of each step (``analyses.streaming_curve``).

    python benchmarks/streaming_curve_real.py --model smollm2 --tokens 768 --rows 4 --window 64
    python benchmarks/streaming_curve_real.py --model gemma3 --tokens 2048 --rows 2 --window 256 --batch-size 1

``--batch-size``: rows per backward pass of the importance order (``head_importance(batch_size=...)``); Gemma 3's
262k-token vocabulary makes the logits and their gradient 2 GiB per 2,048-token row.
"""

from __future__ import annotations

import argparse
import os

import torch

import interp
from analyses import head_importance, lm_loss, streaming_curve, streaming_curve_plot
from analyses.data.prompts import haystack


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=768)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--plot", default=None, help="write the figure here (PNG)")
    p.add_argument("--batch-size", type=int, default=None, help="rows per backward pass of the importance order")
    a = p.parse_args()
    interp.set_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = interp.load_model(a.model, attn="flash")
    g = torch.Generator().manual_seed(0)  # each row: the corpus sentences in a fresh order (no repeats in a row)
    rows = torch.tensor([haystack(model.tokenizer, a.tokens, g) for _ in range(a.rows)])
    importance = head_importance(model, rows, lm_loss, batch_size=a.batch_size)  # ranks heads, least important first
    curves = [streaming_curve(model, rows, lm_loss, order=o, column=c, seeds=a.seeds, sink=a.sink, window=a.window)
              for o, c in ((importance, "importance"), ("random", None))]
    import pandas as pd

    df = pd.concat(curves)
    df.attrs.update(curves[0].attrs)
    table = df.groupby(["order", "fraction_streaming"]).agg(loss=("metric", "mean"), lo=("metric", "min"),
                                                          hi=("metric", "max"), kv=("kv_fraction", "mean"))
    print(f"{a.model}: {a.rows} rows x {a.tokens} tokens of the project's sentences, sink {a.sink}, window {a.window}, "
          f"random seeds {a.seeds} (lo/hi: range over seeds)")
    print(table.round(3).to_string())
    if a.plot:
        streaming_curve_plot(df).figure.savefig(a.plot, dpi=100)


if __name__ == "__main__":
    main()
