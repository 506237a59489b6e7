"""Causal check of retrieval heads (Wu et al. 2024): needle-in-a-haystack accuracy with the top-k retrieval heads
zero-ablated, against k random heads (5 draws), on a bundled model. One process, run it alone.

1. Retrieval heads from ``retrieval_heads`` at ``--detect-lengths`` x depths 0.1, 0.5, 0.9 (seed 0).
2. Needle accuracy at ``--test-lengths`` x depths 0.1, 0.3, 0.5, 0.7, 0.9 on fresh needles (seed 1): unablated,
   with the top-k retrieval heads zero-ablated (``analyses.ablate_heads``), and with k random other heads (5 draws).
   Accuracy = the share of the needle's tokens greedy decoding reproduces in place; 95% intervals resample the
   trials (and, for random heads, the draws with them).

    python benchmarks/needle_causal.py --model smollm2 --k 10
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

import interp
from analyses import ablate_heads
from analyses.data.bootstrap import mean_interval
from analyses.long.retrieval import retrieval_heads, run_needle
from analyses.data.needles import needle_prompts


def accuracy(model, prompts) -> list[float]:
    out = []
    for p in prompts:
        generated, _ = run_needle(model, p)
        out.append(float((generated == p.answer).float().mean()))
    return out


def interval(values: list[float], n_bootstrap: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    mean, lo, hi = mean_interval(torch.tensor(values, dtype=torch.float64), n_bootstrap, seed)
    return float(mean), float(lo), float(hi)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--detect-lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--test-lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--draws", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"threads {os.environ.get('OMP_NUM_THREADS', 'unset')}, load {os.getloadavg()[0]:.1f}", flush=True)
    model = interp.load_model(args.model, attn="flash")
    t = time.perf_counter()
    df = retrieval_heads(model, lengths=args.detect_lengths, context=max(args.detect_lengths),
                         depths=(0.1, 0.5, 0.9), n_bootstrap=1000)
    ranked = df.sort_values("retrieval", ascending=False)
    print(f"detection ({time.perf_counter() - t:.0f} s), trials: {df.attrs['trials']}", flush=True)
    print(f"heads above 0.1: {int((df.retrieval > 0.1).sum())} of {len(df)}")
    print(ranked.head(12).to_string(index=False), flush=True)
    top = [tuple(map(int, x)) for x in ranked[["layer", "head"]].values[: args.k]]
    others = [tuple(map(int, x)) for x in ranked[["layer", "head"]].values[args.k:]]
    prompts = needle_prompts(model, args.test_lengths, args.depths, seed=1)
    results = {}
    with model.studying():
        results["none"] = accuracy(model, prompts)
        print(f"unablated: {interval(results['none'])}", flush=True)
        with ablate_heads(model, top):
            results["top"] = accuracy(model, prompts)
        print(f"top-{args.k} retrieval heads ablated: {interval(results['top'])}", flush=True)
        g = torch.Generator().manual_seed(0)
        random_all = []
        for draw in range(args.draws):
            heads = [others[i] for i in torch.randperm(len(others), generator=g)[: args.k].tolist()]
            with ablate_heads(model, heads):
                acc = accuracy(model, prompts)
            random_all += acc
            print(f"random draw {draw} {heads}: {interval(acc)}", flush=True)
        results["random"] = random_all
    print(f"random {args.k} heads, {args.draws} draws pooled: {interval(random_all)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"top": top, "scores": ranked.head(20).values.tolist(), "results": results,
                       "trials": df.attrs["trials"]}, f)


if __name__ == "__main__":
    main()
