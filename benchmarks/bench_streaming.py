"""Streaming heads' real memory: KV-cache bytes, peak memory and decode time per token, full attention against
25/50/75% of the heads streaming (``interp.stream_heads`` + its ``StreamingCache``), side by side in one process.

The streaming heads are whole key/value groups (every query head of a chosen key/value head, chosen at random with a
fixed seed): on a grouped-query model only those shrink the cache (SmolLM2: 9 query heads on 3 key/value heads per
layer). Each configuration prefills the same prompt into its cache and decodes ``--new`` tokens greedily; the rounds
are interleaved (full, 25, 50, 75, then again) on a needle-in-a-haystack prompt
(``analyses.long.retrieval``) and the median over rounds is reported. KV bytes are what the cache
holds after decoding (``interp.kv_cache_bytes``). Peak memory: the growth of the process's peak RSS over its RSS
before the configuration (``/proc/self/clear_refs`` resets the peak, ``malloc_trim`` returns freed memory first).
glibc raises its mmap threshold to the size of freed blocks, so that the streaming kernel's per-tile buffers
(a few MiB, freed at once) then stay in the heap and inflate the peak (SmolLM2, 2k-token prefill in a fresh process,
75% streaming: +238 to +370 MiB, against +88 MiB with a fixed threshold; full attention +149 to +167 MiB): the
benchmark runs with ``MALLOC_MMAP_THRESHOLD_=131072`` (fixed), unless ``--glibc-default``.
Held: the RSS growth still there after decoding (freed memory returned first), the cache alive.
Times: the process's CPU time (``time.process_time``, one thread: robust to other work on a shared machine) and
wall-clock time.

    OMP_NUM_THREADS=1 python benchmarks/bench_streaming.py                    # SmolLM2, 2,048-token prompt
    OMP_NUM_THREADS=1 python benchmarks/bench_streaming.py --tokens 8192      # 8k
    python benchmarks/bench_streaming.py --quick                              # tiny model: checks the script runs
"""

from __future__ import annotations

import argparse
import os
import sys
import statistics
import time

import torch

import interp
from analyses.data.needles import needle_prompts
from peak import reset_peak, status_bytes  # benchmarks/peak.py, beside this script


def streaming_heads(model, fraction: float, seed: int = 0) -> list[tuple[int, int]]:
    """Every query head of ``fraction`` of the key/value heads (rounded), chosen at random among the layers that
    can stream (full attention: Gemma 3's global layers)."""
    cfg = model.cfg
    layers = sorted({l for l, _ in interp.streaming.streamable_heads(model)})
    groups = [(l, g) for l in layers for g in range(cfg.kv_heads_per_layer[l])]
    picked = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed))[: round(fraction * len(groups))]
    heads = []
    for i in sorted(picked.tolist()):
        l, g = groups[i]
        per = cfg.heads_per_layer[l] // cfg.kv_heads_per_layer[l]
        heads += [(l, q) for q in range(g * per, (g + 1) * per)]
    return heads


def run_one(model, ids, heads, new: int, sink: int, window: int) -> dict:
    before = reset_peak()
    with interp.stream_heads(model, heads, sink=sink, window=window) as s, torch.no_grad():
        cache = s.new_cache() if heads else None
        start, cpu = time.perf_counter(), time.process_time()
        name = interp.cache_kwarg(model.hf)  # "cache" (transformers 5.24) or "past_key_values" (5.17)
        out = model.hf(input_ids=ids, use_cache=True, logits_to_keep=1, **{name: cache})
        prefill, prefill_cpu = time.perf_counter() - start, time.process_time() - cpu
        token, tokens = out.logits[:, -1].argmax(-1, keepdim=True), []
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(new):
            out = model.hf(input_ids=token, use_cache=True, logits_to_keep=1, **{name: interp.output_cache(out)})
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
        decode, decode_cpu = (time.perf_counter() - start) / new, (time.process_time() - cpu) / new
        kv = interp.kv_cache_bytes(interp.output_cache(out))
        peak = status_bytes("VmHWM") - before
        held = reset_peak() - before  # freed memory returned first: what the live cache and model state hold
        del out
    return {"prefill_s": prefill, "decode_ms": decode * 1e3, "prefill_cpu_s": prefill_cpu,
            "decode_cpu_ms": decode_cpu * 1e3, "kv_bytes": kv, "peak_grew": peak, "held": held,
            "tokens": tokens}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048; 8192 with --tokens)")
    p.add_argument("--new", type=int, default=32, help="greedy tokens decoded (default 32)")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75])
    p.add_argument("--quick", action="store_true", help="the bundled toy model, 48 tokens, window 8: checks it runs")
    p.add_argument("--glibc-default", action="store_true",
                   help="keep glibc's dynamic mmap threshold (default: a fixed 128 KiB one, see the module doc)")
    a = p.parse_args(argv)
    if not a.glibc_default and "MALLOC_MMAP_THRESHOLD_" not in os.environ and argv is None:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)
    if a.quick:
        a.model, a.tokens, a.new, a.window, a.sink, a.rounds = "toy-induction", 48, 4, 8, 2, 1
    interp.set_threads(1)
    model = interp.load_model(a.model, attn="flash")
    ids = needle_prompts(model, [a.tokens], [0.5])[0].ids[None]  # corpus text with a needle at half depth
    plans = {f: streaming_heads(model, f) for f in a.fractions}
    run_one(model, ids[:, :32], plans[a.fractions[-1]], 2, a.sink, a.window)  # warm-up
    rows: dict[float, list[dict]] = {f: [] for f in a.fractions}
    for r in range(a.rounds):
        for f in a.fractions:
            rows[f].append(run_one(model, ids, plans[f], a.new, a.sink, a.window))
            last = rows[f][-1]
            print(f"  round {r} {f:4.0%}: prefill {last['prefill_s']:.2f} s (CPU {last['prefill_cpu_s']:.2f}), decode "
                  f"{last['decode_ms']:.1f} ms/token (CPU {last['decode_cpu_ms']:.1f}), "
                  f"KV {last['kv_bytes'] / 2**20:.1f} MiB, peak +{last['peak_grew'] / 2**20:.0f} MiB, held "
                  f"+{last['held'] / 2**20:.0f} MiB", flush=True)
    full = rows[a.fractions[0]]
    med = lambda rs, k: statistics.median(x[k] for x in rs)  # noqa: E731
    print(f"\nMALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'glibc default')}")
    print(f"{a.model}, prompt {a.tokens} tokens + {a.new} decoded, sink {a.sink}, window {a.window}, "
          f"{torch.get_num_threads()} thread, median of {a.rounds} interleaved rounds")
    print("| heads streaming | kv heads streaming | KV MiB | x full | held MiB | peak growth MiB | x full "
          "| decode CPU ms/token | x full | decode wall ms/token | prefill CPU s | x full | same tokens as full |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for f in a.fractions:
        rs, heads = rows[f], plans[f]
        n_kv = len({(l, h // (model.cfg.heads_per_layer[l] // model.cfg.kv_heads_per_layer[l])) for l, h in heads})
        ratio = lambda k: med(rs, k) / med(full, k)  # noqa: E731
        same = sum(x == y for x, y in zip(rs[0]["tokens"], full[0]["tokens"]))
        share = len(heads) / len(model.cfg.heads())
        print(f"| {len(heads)} ({share:.0%}) | {n_kv} | {med(rs, 'kv_bytes') / 2**20:.1f} | {ratio('kv_bytes'):.2f} "
              f"| {med(rs, 'held') / 2**20:.0f} | {med(rs, 'peak_grew') / 2**20:.0f} | {ratio('peak_grew'):.2f} "
              f"| {med(rs, 'decode_cpu_ms'):.1f} | {ratio('decode_cpu_ms'):.2f} | {med(rs, 'decode_ms'):.1f} "
              f"| {med(rs, 'prefill_cpu_s'):.2f} | {ratio('prefill_cpu_s'):.2f} | {same}/{a.new} |")


if __name__ == "__main__":
    main()
