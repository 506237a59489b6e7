"""Attribution patching against activation patching on a real model, in one process: agreement over all heads
(Spearman and Pearson of the effects) and the time of each. With ``--peers``: the IOI activation-patching scan
against plain hooks, TransformerLens's bridge and nnsight, in one process, interleaved (``bench_scan_peers.py``;
it makes the peers' virtualenv on first use and runs there; ``--n``, ``--rounds``, ``--layer-step`` go to it).

    python benchmarks/bench_patching.py --model smollm2 --threads 2
    python benchmarks/bench_patching.py --peers --threads 1 --n 8 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import pandas as pd
import torch

import interp
from analyses import activation_patching, attribution_patching, induction_task


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--n", type=int, default=8, help="sequences of the induction task")
    p.add_argument("--length", type=int, default=12, help="tokens in each copy")
    p.add_argument("--no-exact", action="store_true", help="attribution's forward-equivalents only (no exact scan)")
    p.add_argument("--peers", action="store_true", help="the IOI scan against plain hooks, TransformerLens, nnsight")
    args, rest = p.parse_known_args(argv)
    if args.peers:
        from bench_scan_peers import run_in_venv

        return run_in_venv(["--model", args.model, "--threads", str(args.threads or 1), "--n", str(args.n), *rest])
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.threads:
        interp.set_threads(args.threads)
    model = interp.load_model(args.model, attn="flash", device="cpu")
    clean, corrupted, metric = induction_task(model, n=args.n, length=args.length)
    attribution_patching(model, clean[:1], corrupted[:1], induction_task(model, 1, args.length)[2])  # warm-up
    t_attr, t_forward, c_attr, c_forward = [], [], [], []
    for _ in range(3):  # interleaved, medians; CPU seconds too (steadier on a shared machine)
        t0, c0 = time.perf_counter(), time.process_time()
        estimate = attribution_patching(model, clean, corrupted, metric)
        t_attr.append(time.perf_counter() - t0)
        c_attr.append(time.process_time() - c0)
        with torch.no_grad():
            t0, c0 = time.perf_counter(), time.process_time()
            model(corrupted)
            t_forward.append(time.perf_counter() - t0)
            c_forward.append(time.process_time() - c0)
    t_attr, t_forward = float(np.median(t_attr)), float(np.median(t_forward))
    c_attr, c_forward = float(np.median(c_attr)), float(np.median(c_forward))
    costs = (f"attribution patching {t_attr:.2f} s, one plain forward {t_forward:.3f} s: {t_attr / t_forward:.2f} "
             f"forward-equivalents (a clean forward, a corrupted forward and its backward; medians of 3); by CPU time "
             f"{c_attr:.2f} s / {c_forward:.3f} s = {c_attr / c_forward:.2f}; 1-min load {os.getloadavg()[0]:.2f}")
    if args.no_exact:
        print(f"# {args.model}, induction task: {args.n} sequences of 2 x {args.length} tokens (+ BOS), torch "
              f"{torch.__version__}, {torch.get_num_threads()} threads\n{costs}")
        return 0
    t0 = time.perf_counter()
    exact = activation_patching(model, clean, corrupted, metric)
    t_act = time.perf_counter() - t0
    a, b = exact["effect"].to_numpy(), estimate["effect"].to_numpy()
    top = exact.reindex(exact["effect"].abs().sort_values(ascending=False).index).head(8)
    rank = {h: i for i, h in enumerate(zip(*estimate.reindex(estimate["effect"].abs().sort_values(ascending=False)
                                                              .index)[["layer", "head"]].to_numpy().T))}
    print(f"# {args.model}, induction task: {args.n} sequences of 2 x {args.length} tokens (+ BOS), "
          f"{len(exact)} heads, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"clean {exact.attrs['clean']:.3f}, corrupted {exact.attrs['corrupted']:.3f} ({exact.attrs['metric']})")
    spearman = np.corrcoef(pd.Series(a).rank(), pd.Series(b).rank())[0, 1]  # Pearson on ranks
    print(f"Spearman {spearman:.3f}, Pearson {np.corrcoef(a, b)[0, 1]:.3f} (effects, all heads)")
    print(f"activation patching {t_act:.1f} s, attribution patching {t_attr:.2f} s: {t_act / t_attr:.0f}x\n{costs}")
    print("| head | activation effect | attribution effect | attribution rank |\n|---|---:|---:|---:|")
    for r in top.itertuples():
        est = float(estimate.set_index(["layer", "head"]).loc[(r.layer, r.head), "effect"])
        print(f"| {r.layer}.{r.head} | {r.effect:.3f} | {est:.3f} | {rank[(r.layer, r.head)] + 1} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
