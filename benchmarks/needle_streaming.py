"""Needle-in-a-haystack accuracy when heads stream (sinks + a recent window, ``interp.stream_heads``): the top-k
retrieval heads (Wu et al. 2024) against k random other heads, and DuoAttention's split (every head streams but the
retrieval heads). Decoding uses the streaming cache (``s.new_cache()``): what a streaming key/value head forgot is
really gone. One process, run it alone.

1. Retrieval heads: ``--retrieval-heads 18.7 20.6 ...`` (layer.head, e.g. from notebooks/long_context.md), or
   detected with ``retrieval_heads`` at ``--detect-lengths`` x depths 0.1, 0.5, 0.9 (seed 0), top ``--k``.
2. Needle accuracy at ``--length`` x ``--depths`` on fresh needles (seed 1), the needle outside the window of the
   answer's queries: the share of the needle's tokens greedy decoding reproduces in place; 95% intervals resample
   the trials (and, for random heads, the draws with them).

    python benchmarks/needle_streaming.py --retrieval-heads 18.7 20.6 18.6 23.2 17.3 18.8 20.3 21.8 22.7
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from needle_causal import interval

import interp
from analyses.long.retrieval import retrieval_heads
from analyses.data.needles import needle_prompts


def accuracy(model, prompts, heads, sink: int, window: int) -> tuple[list[float], int]:
    """Per prompt, the share of the needle reproduced in place; and the KV bytes of the last prompt's cache."""
    out, kv = [], 0
    name = interp.cache_kwarg(model.hf)  # "cache" (transformers 5.24) or "past_key_values" (5.17)
    for p in prompts:
        with interp.stream_heads(model, heads, sink=sink, window=window) as s, torch.no_grad():
            cache = s.new_cache() if heads else None
            res = model.hf(input_ids=p.ids[None], use_cache=True, logits_to_keep=1, **{name: cache})
            generated = []
            for _ in range(len(p.answer)):
                token = res.logits[:, -1].argmax(-1, keepdim=True)
                generated.append(int(token))
                res = model.hf(input_ids=token, use_cache=True, logits_to_keep=1, **{name: interp.output_cache(res)})
            kv = interp.kv_cache_bytes(interp.output_cache(res))
        out.append(float((torch.tensor(generated) == p.answer).float().mean()))
    return out, kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--retrieval-heads", nargs="*", default=None, help="layer.head, best first")
    parser.add_argument("--detect-lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7])
    parser.add_argument("--k", type=int, default=9)
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=256)
    args = parser.parse_args()
    interp.set_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    print(f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}", flush=True)
    model = interp.load_model(args.model, attn="flash")
    if args.retrieval_heads:
        top = [tuple(int(x) for x in h.split(".")) for h in args.retrieval_heads][: args.k]
    else:
        t = time.perf_counter()
        df = retrieval_heads(model, lengths=args.detect_lengths, context=max(args.detect_lengths),
                             depths=(0.1, 0.5, 0.9), n_bootstrap=200)
        top = [(int(r.layer), int(r.head)) for r in df.nlargest(args.k, "retrieval").itertuples()]
        print(f"detection ({time.perf_counter() - t:.0f} s): {top}", flush=True)
    everyone = interp.streaming.streamable_heads(model)  # Gemma 3: its global layers' heads (the others keep a window)
    others = [h for h in everyone if h not in top]
    prompts = needle_prompts(model, [args.length], args.depths, seed=1)
    g = torch.Generator().manual_seed(0)
    conditions = [("full attention", []), (f"top {len(top)} retrieval heads stream", top)]
    conditions += [(f"{len(top)} random other heads stream (draw {d})",
                    sorted(others[i] for i in torch.randperm(len(others), generator=g)[: len(top)].tolist()))
                   for d in range(args.draws)]
    conditions += [(f"all but the top {len(top)} retrieval heads stream", others), ("every head that can stream streams", everyone)]
    print(f"{args.model}, {args.length} tokens, depths {args.depths}, sink {args.sink}, window {args.window}; "
          f"retrieval heads {['%d.%d' % h for h in top]}", flush=True)
    pooled = []
    for name, heads in conditions:
        t = time.perf_counter()
        acc, kv = accuracy(model, prompts, heads, args.sink, args.window)
        mean, lo, hi = interval(acc)
        if "random" in name:
            pooled += acc
        print(f"| {name} | {len(heads)} | {mean:.2f} [{lo:.2f}, {hi:.2f}] | {' '.join(f'{a:.2f}' for a in acc)} "
              f"| {kv / 2**20:.1f} | {time.perf_counter() - t:.0f} s |", flush=True)
    if pooled:
        mean, lo, hi = interval(pooled)
        print(f"| random other heads, {args.draws} draws pooled | {len(top)} | {mean:.2f} [{lo:.2f}, {hi:.2f}] | | | |")


if __name__ == "__main__":
    main()
