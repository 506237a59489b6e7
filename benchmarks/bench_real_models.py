"""detect_heads on a bundled real model against a plain HF sdpa forward over the same tokens, and the report's
wall time, in one process (the report in a subprocess, as a user runs it).

The plain forward runs the very batches detect_heads runs (the same prompts, sorted by length, padded the same
way, ``batch_size`` per forward), with HF's own sdpa attention and no hooks. Both are timed interleaved.

    python benchmarks/bench_real_models.py --model smollm2 --threads 2 [--report]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import interp
from analyses import detect_heads
from analyses.data.prompts import corpus_prompts, repeated_random_tokens
from interp.tokens.inputs import pad_ids, padded_positions


def batches(model, n_prompts: int, seq_len: int, batch_size: int, seed: int = 0):
    """The batches detect_heads runs with its defaults: repeated random tokens, then corpus prompts."""
    generator = torch.Generator().manual_seed(seed)
    sets = [repeated_random_tokens(model, n_prompts, seq_len, generator),
            corpus_prompts(model, n_prompts, seq_len, generator)]
    out = []
    for prompts in sets:
        order = torch.argsort(torch.tensor([len(p) for p in prompts]), stable=True)
        for start in range(0, len(prompts), batch_size):
            rows = [prompts[i] for i in order[start:start + batch_size]]
            out.append(pad_ids(rows, left=model.cfg.causal, pad_id=model.pad_token_id))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--report", action="store_true", help="also time `interp report --model MODEL`")
    args = p.parse_args(argv)
    if args.threads:
        interp.set_threads(args.threads)
    model = interp.load_model(args.model, attn="flash", device="cpu")
    kwargs = dict(n_prompts=100, seq_len=64, batch_size=32)
    work = batches(model, **kwargs)
    hf = model.hf

    def plain():
        hf.set_attn_implementation("sdpa")
        try:
            with torch.no_grad():
                for ids, mask in work:
                    hf(input_ids=ids, attention_mask=mask, position_ids=padded_positions(mask), use_cache=False)
        finally:
            model.set_attn("flash")

    def heads():
        detect_heads(model, **kwargs)

    times = {"plain HF sdpa forward": [], "detect_heads (flash)": []}
    plain(), heads()  # warm-up
    for _ in range(args.repeats):
        for name, fn in zip(times, (plain, heads)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    tokens = sum(int(mask.sum()) for _, mask in work)
    print(f"# {args.model}, {len(work)} batches, {tokens} tokens (200 prompts of up to 64), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.repeats} interleaved repeats (median)")
    print("| variant | median s | x plain forward |\n|---|---:|---:|")
    base = statistics.median(times["plain HF sdpa forward"])
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {statistics.median(ts) / base:.3f} |")
    if args.report:
        with tempfile.TemporaryDirectory() as out:
            threads = ["--threads", str(args.threads)] if args.threads else []
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "analyses.cli", "report", "--model", args.model, "--out", out,
                            "--force", *threads], check=True, capture_output=True)
            print(f"\n`interp report --model {args.model}` wall time: {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
