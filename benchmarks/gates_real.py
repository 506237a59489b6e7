"""DuoAttention-style gates on a real model (``analyses.long.streaming_gates``), then needle accuracy when the key/value
heads with the lowest gates stream, against as many random key/value heads (equal KV memory). Decoding uses the
streaming cache (``needle_streaming.accuracy``). One process, run it alone.

    cd benchmarks && python gates_real.py --model smollm2 --steps 60 --share 0.25 0.5
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from needle_causal import interval
from needle_streaming import accuracy

import interp
from analyses.data.needles import needle_prompts
from analyses.long.streaming_gates import streaming_gates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--tokens", type=int, default=None, help="passkey prompt length (default 2 * (sink + window))")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--share", type=float, nargs="+", default=[0.25, 0.5], help="shares of key/value heads streaming")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7])
    p.add_argument("--draws", type=int, default=3)
    a = p.parse_args()
    interp.set_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}", flush=True)
    model = interp.load_model(a.model, attn="flash")
    t = time.perf_counter()
    df = streaming_gates(model, sink=a.sink, window=a.window, steps=a.steps, tokens=a.tokens)
    print(f"gates: {a.steps} steps in {time.perf_counter() - t:.0f} s; loss {df.attrs['loss_start']:.4f} -> "
          f"{df.attrs['loss_end']:.4f} (KL {df.attrs['distance_end']:.4f}, mean gate {df.attrs['l1_end']:.3f})",
          flush=True)
    kv = df.groupby(["layer", "kv_head"]).gate.first().sort_values(kind="stable")  # lowest first
    print("gates per layer (key/value heads):")
    for layer, part in kv.groupby(level=0):
        print(f"  {layer:2d}: {' '.join(f'{v:.2f}' for v in part.sort_index().values)}")
    print(f"below 0.5: {int((kv < 0.5).sum())} of {len(kv)} key/value heads", flush=True)
    groups = list(kv.index)
    heads_of = {g: [(int(r.layer), int(r.head)) for r in df.itertuples() if (r.layer, r.kv_head) == g] for g in groups}
    prompts = needle_prompts(model, [a.length], a.depths, seed=1)
    gen = torch.Generator().manual_seed(0)
    print(f"{a.model}, needles in {a.length} tokens at depths {a.depths}, sink {a.sink}, window {a.window}")
    print("| key/value heads streaming | order | needle accuracy | per prompt | KV MiB |")
    acc, kv_bytes = accuracy(model, prompts, [], a.sink, a.window)
    print(f"| 0 | full attention | {interval(acc)[0]:.2f} | {' '.join(f'{x:.2f}' for x in acc)} | "
          f"{kv_bytes / 2**20:.1f} |", flush=True)
    for share in a.share:
        n = round(share * len(groups))
        picks = [("lowest gates", groups[:n])]
        picks += [(f"random draw {d}", [groups[i] for i in torch.randperm(len(groups), generator=gen)[:n].tolist()])
                  for d in range(a.draws)]
        pooled = []
        for name, chosen in picks:
            heads = sorted(h for g in chosen for h in heads_of[g])
            acc, kv_bytes = accuracy(model, prompts, heads, a.sink, a.window)
            pooled += acc if name.startswith("random") else []
            mean, lo, hi = interval(acc)
            print(f"| {n} | {name} | {mean:.2f} [{lo:.2f}, {hi:.2f}] | {' '.join(f'{x:.2f}' for x in acc)} | "
                  f"{kv_bytes / 2**20:.1f} |", flush=True)
        mean, lo, hi = interval(pooled)
        print(f"| {n} | random, {a.draws} draws pooled | {mean:.2f} [{lo:.2f}, {hi:.2f}] | | |", flush=True)


if __name__ == "__main__":
    main()
