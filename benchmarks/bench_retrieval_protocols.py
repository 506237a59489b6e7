"""Retrieval heads under two protocols on the same lengths and depths (issue 38): ours (``"interp"``: 8 random digits,
|needle| greedy steps, token recall >= 0.5) and Wu et al.'s (``"wu2024"``: a natural-sentence needle, up to 50 greedy
steps stopping at a newline, ROUGE-1 recall > 0.5). For each protocol: CPU time (``time.process_time``, run it with
``OMP_NUM_THREADS=1``), trials counted of run, the top 10 heads with their 95% intervals and the split-half
stability (``df.attrs["stability"]["retrieval"]``, ``analyses.data.stability``); then the two protocols compared over all
heads (Spearman, ``analyses.data.stability.spearman``) and their top 10 overlap.

    OMP_NUM_THREADS=1 python benchmarks/bench_retrieval_protocols.py                 # SmolLM2, 512..2048 x 5 depths
    OMP_NUM_THREADS=1 python benchmarks/bench_retrieval_protocols.py --quick         # toy model: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

import interp  # noqa: E402
from analyses.long.retrieval import retrieval_heads  # noqa: E402
from analyses.data.stability import spearman  # noqa: E402


def _top(df, k: int = 10) -> list[tuple]:
    top = df.sort_values("retrieval", ascending=False, kind="stable").head(k)
    return [(f"{int(r.layer)}.{int(r.head)}", round(float(r.retrieval), 3), round(float(r.retrieval_lo), 3),
             round(float(r.retrieval_hi), 3)) for r in top.itertuples()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 1536, 2048])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--protocols", nargs="+", default=["interp", "wu2024"])
    ap.add_argument("--seed", type=int, default=0, help="the needles, haystacks and bootstrap")
    ap.add_argument("--quick", action="store_true", help="toy-induction at 40 and 64 tokens")
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    torch.set_num_threads(1)
    name, lengths = ("toy-induction", [40, 64]) if args.quick else (args.model, args.lengths)
    model = interp.load_model(name)
    frames, out = {}, {"model": name, "seed": args.seed, "lengths": lengths, "depths": args.depths, "attn": model.attn}
    for protocol in args.protocols:
        start = time.process_time()
        df = retrieval_heads(model, context=max(lengths), lengths=lengths, depths=args.depths, protocol=protocol,
                             n_bootstrap=1000, seed=args.seed)
        cpu = time.process_time() - start
        frames[protocol] = df
        trials = df.attrs["trials"]
        row = {"cpu_s": round(cpu, 1), "trials_counted": df.attrs["trials_counted"],
               "trials_run": df.attrs["trials_run"], "mean_steps": sum(t["steps"] for t in trials) / len(trials),
               "top10": _top(df), "stability": df.attrs["stability"]["retrieval"],
               "scores": {f"{int(r.layer)}.{int(r.head)}": float(r.retrieval) for r in df.itertuples()},
               "recall_by_length": {n: [round(t["recall"], 2) for t in trials if t["length"] == n] for n in lengths}}
        out[protocol] = row
        print(f"{protocol}: CPU {row['cpu_s']} s, {row['trials_counted']}/{row['trials_run']} trials counted, "
              f"{row['mean_steps']:.1f} steps per trial", flush=True)
        top = ", ".join(f"{h} {s} [{lo}, {hi}]" for h, s, lo, hi in row["top10"])
        print(f"  top 10 (score [95% interval]): {top}")
        s = row["stability"]
        print(f"  split-half stability: Spearman {s['spearman']:.2f}, top-{s['k']} overlap {s['top_k_overlap']:.2f}, "
              f"halves of {s['trials']} trials, unstable={s['unstable']}")
        print(f"  recall by length: {row['recall_by_length']}", flush=True)
    if len(frames) == 2:
        a, b = (frames[p].set_index(["layer", "head"])["retrieval"] for p in args.protocols)
        b = b.reindex(a.index)
        rho = spearman(torch.tensor(a.to_numpy()), torch.tensor(b.to_numpy()))
        k = min(10, len(a))
        top_a, top_b = set(a.nlargest(k).index), set(b.nlargest(k).index)
        out["compare"] = {"spearman": rho, "top10_shared": len(top_a & top_b), "k": k}
        print(f"{args.protocols[0]} vs {args.protocols[1]}: Spearman {rho:.2f} over {len(a)} heads, top {k} shared "
              f"{len(top_a & top_b)}/{k}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
