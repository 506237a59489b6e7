"""Successor and copy suppression as the papers define them against the scores before issue 38: top heads, the
Spearman correlation of each old/new pair over every head, CPU time, and each score's stability (two disjoint
halves of its items, ``analyses.data.stability``).

    OMP_NUM_THREADS=1 python benchmarks/published_taxonomy.py --model smollm2
    OMP_NUM_THREADS=1 python benchmarks/published_taxonomy.py --model gemma3 --json out.json

Scores: ``successor`` (published: Gould et al.'s dataset, MLP0's output, argmax among the task's successors),
``successor_old`` (the score before issue 38: the bundled lists, block 0 with its residual, argmax among the
list's tokens), the published score with the argmax over every ordinal token and over the whole vocabulary;
``copy_suppression`` (the default sample of uniform non-special tokens, as many as fit about a minute of one
thread; whole-vocabulary ranks), ``copy_suppression_1000`` (1000 tokens) and ``copy_suppression_old`` (the
200-token sample of before). ``--only`` picks runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import interp  # noqa: E402
from analyses.data.stability import spearman  # noqa: E402
from analyses.taxonomy.weights import copy_suppression_scores, successor_scores  # noqa: E402

RUNS = {
    "successor": lambda m: successor_scores(m),
    "successor_old": lambda m: successor_scores(m, lists="bundled", embedding="block0", candidates="list"),
    "successor_ordinal": lambda m: successor_scores(m, candidates="ordinal"),
    "successor_vocab": lambda m: successor_scores(m, candidates="vocab"),
    "copy_suppression": lambda m: copy_suppression_scores(m),
    "copy_suppression_1000": lambda m: copy_suppression_scores(m, n_tokens=1000),
    "copy_suppression_old": lambda m: copy_suppression_scores(m, n_tokens=200),
}
PAIRS = [("successor", "successor_old"), ("successor", "successor_ordinal"), ("successor", "successor_vocab"),
         ("copy_suppression", "copy_suppression_old"), ("copy_suppression", "copy_suppression_1000"),
         ("copy_suppression_1000", "copy_suppression_old"), ("successor", "copy_suppression"),
         ("successor_old", "copy_suppression_old")]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--only", nargs="*", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = interp.load_model(args.model)
    frames, out = {}, {"model": args.model, "scores": {}, "spearman": {}}
    for name in args.only:
        start = time.process_time()
        df = RUNS[name](model)
        seconds = time.process_time() - start
        column = "successor" if name.startswith("successor") else "copy_suppression"
        frames[name] = df[column].to_numpy().copy()
        top = df.sort_values(column, ascending=False).head(args.top)
        stable = df.attrs["stability"][column]
        out["scores"][name] = {
            "cpu_s": round(seconds, 1), "items": df.attrs.get("items", df.attrs.get("tokens")),
            "top": [f"L{l}H{h} {v:.3f} [{lo:.3f}, {hi:.3f}]" for l, h, v, lo, hi in
                    zip(top.layer, top["head"], top[column], top[f"{column}_lo"], top[f"{column}_hi"])],
            "stability": {k: (round(v, 3) if isinstance(v, float) else v) for k, v in stable.items()}}
        print(name, json.dumps(out["scores"][name]), flush=True)
    for a, b in PAIRS:
        if a in frames and b in frames:
            out["spearman"][f"{a} vs {b}"] = round(spearman(frames[a], frames[b]), 3)
    print(json.dumps(out["spearman"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
