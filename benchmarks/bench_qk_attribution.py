"""Why a head attends (``qk_attribution``, issue 39): peak memory of explaining one retrieval head's needle hits at
long context against a plain HF sdpa forward of the same prompt, and SmolLM2's induction heads' key-side leaders
with the causal check.

Memory (default): SmolLM2-135M, retrieval head 20.3 (a greedy needle trial at 1,024 tokens, ``run_needle``: 20.3, 22.7,
23.2 and 18.6 put their top-1 key in the needle at all 16 steps; its retrieval score there, which also asks that
the key hold the token generated, is 0.19, the trial's leaders being 18.6, 18.7 and 20.6; 5.1 and 11.2 lead Gemma 3's
trials in BENCHMARKS.md, not SmolLM2's), a needle prompt of ``--length`` tokens (depth 0.5) with the needle's tokens appended (teacher forcing). Its pairs are
the copy targets: from the position that predicts the needle's k-th token to the needle's k-th token. Each task runs
in a fresh subprocess (the only honest peak on CPU), as ``bench_long_context.py`` measures:

- ``sdpa``: HF's own sdpa attention, one forward of the prompt (``logits_to_keep=1``);
- ``qk``: ``qk_attribution(model, ids, [(5, 1)], pairs=copy targets, draws=--draws)``: the top-1 pass is not needed
  (the pairs are given), one forward recording the components at those positions, and the causal check (per side:
  the baseline, the top 3 heads removed, ``draws`` random sets; each a forward stopped after layer 20).

Each child loads the model, warms up on 16 tokens, resets its peak RSS (``/proc/self/clear_refs``, 5), runs the
task and reports the peak (VmHWM) and the growth over the loaded model.

Induction (``--induction``): SmolLM2's top induction heads (18.6, 17.4, 17.3, 17.5; REFERENCE.md) on 8 prompts
of 100 random ordinary tokens x repeated (x of 50), pairs from the induction target rule, causal check with 20 random
draws: the key-side and query-side leaders and the drops.

    python benchmarks/bench_qk_attribution.py                  # memory at 8,192 tokens
    python benchmarks/bench_qk_attribution.py --induction      # the induction heads' leaders, causally
    python benchmarks/bench_qk_attribution.py --quick          # toy model, 64 tokens: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_long_context import _status  # the /proc/self/status reader of the memory benchmarks

ROOT = Path(__file__).resolve().parents[1]
HEAD = (20, 3)


def _needle(model, n: int):
    """``(ids (p,), pairs)``: a needle prompt of ``n`` tokens and the needle's tokens appended; each pair goes from
    the position that predicts the needle's k-th token to that token in the needle."""
    import torch

    from analyses.data.needles import needle_prompts

    if model.tokenizer is None:  # the toy model: a repeated sequence stands in for a needle
        from analyses.data.toy import repeated_sequences

        ids = repeated_sequences(1, n // 2, model.cfg.vocab_size, torch.Generator().manual_seed(0), 0)[0]
        half = n // 2
        return ids, [(0, half + k, k + 1) for k in range(8, 16)]
    extra = len(needle_prompts(model, [n], [0.5])[0].answer) - 1  # the appended tokens: n in all
    prompt = needle_prompts(model, [n - extra], [0.5])[0]
    answer = prompt.answer
    ids = torch.cat([prompt.ids, answer[:-1]])
    start = prompt.needle[0]
    return ids[:n], [(0, len(prompt.ids) - 1 + k, start + k) for k in range(len(answer)) if len(prompt.ids) - 1 + k < n]


def child(model_name: str, n: int, task: str, draws: int) -> dict:
    import torch

    import interp
    from analyses import qk_attribution
    from analyses.explain.qk_causal import causal_summary

    model = interp.load_model(model_name, attn="flash")
    ids, pairs = _needle(model, n)
    head = HEAD if model.cfg.n_layers > HEAD[0] else (1, 1)
    if task == "sdpa":
        model.hf.set_attn_implementation("sdpa")

        def run():
            with torch.no_grad():
                model.hf(input_ids=ids[None], use_cache=False, logits_to_keep=1)
    else:
        def run():
            return qk_attribution(model, ids[None], [head], pairs=pairs, draws=draws, causal=draws > 0)
    with torch.no_grad():  # first-call allocations (thread pools, kernels) are not the task's
        model.hf(input_ids=ids[None, :16], use_cache=False, logits_to_keep=1)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    out = run()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = _status("VmHWM")
    extra = {}
    if task == "qk":
        extra = {"head": list(head), "pairs": len(pairs), "max_error": out.attrs["max_error"],
                 "mean_weight": sum(r["weight"] for r in out.attrs["pairs"]) / len(pairs),
                 "max_score": max(abs(r["score"]) for r in out.attrs["pairs"]),
                 "key_top": out.nlargest(5, "key")[["label", "key"]].values.tolist(),
                 "query_top": out.nlargest(5, "query")[["label", "query"]].values.tolist(),
                 "causal": causal_summary(out.attrs["causal"]).drop(columns=["stack", "kind", "site"]).to_dict("records")}
    return {"model": model_name, "n": n, "task": task, "before_mib": before / 1024, "peak_mib": peak / 1024,
            "grew_mib": (peak - before) / 1024, "seconds": seconds, "cpu_seconds": cpu, **extra}


def _spawn(model_name: str, n: int, task: str, draws: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, __file__, "--child", model_name, str(n), task, str(draws)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{model_name} {n} {task} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def induction(model_name: str, heads, n_prompts: int, half: int, draws: int) -> None:
    import torch

    import interp
    from analyses import qk_attribution
    from analyses.data.prompts import repeated_random_tokens
    from analyses.explain.qk_causal import causal_summary

    model = interp.load_model(model_name, attn="flash")
    ids = torch.stack(repeated_random_tokens(model, n_prompts, 2 * half + 1, torch.Generator().manual_seed(0)))
    start = time.perf_counter()
    df = qk_attribution(model, ids, heads, pairs="induction", draws=draws)
    print(f"{len(df.attrs['pairs'])} pairs, largest |sum - score| {df.attrs['max_error']:.2e}, "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    for (site, h), rows in df.groupby(["site", "head"], sort=False):
        weight = [r["weight"] for r in df.attrs["pairs"] if r["site"] == site and r["head"] == h]
        print(f"{site} head {h}: mean attention on the induction target {sum(weight) / len(weight):.3f}")
        for side in ("key", "query"):
            top = rows.nlargest(5, side)
            print(f"  {side} side: " + ", ".join(f"{r.label} {getattr(r, side):.2f}" for r in top.itertuples()))
    summary = causal_summary(df.attrs["causal"]).drop(columns=["stack", "kind", "site"])
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.3f}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "N", "TASK", "DRAWS"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="toy model at 64 tokens")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--draws", type=int, default=4, help="random head sets of the causal check (memory run)")
    parser.add_argument("--induction", action="store_true", help="SmolLM2's induction heads, causally")
    args = parser.parse_args()
    if args.child:
        model, n, task, draws = args.child
        print(json.dumps(child(model, int(n), task, int(draws))))
        return
    load = os.getloadavg()
    print(f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; fp32; load average at start "
          f"{load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)
    if args.induction:
        induction("toy-induction" if args.quick else "smollm2",
                  [(1, 0), (1, 1)] if args.quick else [(18, 6), (17, 4), (17, 3), (17, 5)], 8, 50 if not args.quick
                  else 20, 20)
        return
    model, n = ("toy-induction", 64) if args.quick else ("smollm2", args.length)
    rows = [_spawn(model, n, task, args.draws) for task in ("sdpa", "qk")]
    for r in rows:
        print(f"  {model} {n} {r['task']:<5} grew {r['grew_mib']:8.1f} MiB  peak {r['peak_mib']:8.1f} MiB  "
              f"{r['seconds']:7.1f} s  cpu {r['cpu_seconds']:7.1f} s")
    sdpa, qk = rows
    print(f"peak x sdpa {qk['peak_mib'] / sdpa['peak_mib']:.2f}; growth x sdpa {qk['grew_mib'] / sdpa['grew_mib']:.2f}; "
          f"time x sdpa {qk['seconds'] / sdpa['seconds']:.1f}")
    print(json.dumps({k: v for k, v in qk.items() if k in ("head", "pairs", "max_error", "mean_weight", "max_score",
                                                         "key_top", "query_top", "causal")}, indent=1))


if __name__ == "__main__":
    main()
