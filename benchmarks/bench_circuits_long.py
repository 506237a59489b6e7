"""Edge attribution at long context: EAP on a needle-retrieval task, peak memory against HF sdpa's forward and backward
of the same prompt (issue 49).

For each model and length, each task runs in a fresh subprocess (the only honest peak on CPU), interleaved:

- ``sdpa_fb``: HF's own sdpa attention, one forward of the needle task's clean prompt and one backward of the
  metric to the input embeddings (the weights frozen, as attribution has them): what any gradient-based attribution
  at that length needs at least. Logits only where the metric reads them (``logits_to_keep``).
- ``eap``: ``edge_attribution(model, clean, corrupted, metric, method="eap")`` on our flash path: every edge of the
  graph scored (a clean and a corrupted forward, one backward); from 4,096 tokens on each block is recomputed in the
  backward (``recompute``), so the backward holds the block inputs and one block's activations.
- ``eap_kept``: the same with ``recompute=False``: every block's activations kept for the backward.

The task: ``analyses.needle_task`` (a needle prompt of that length, the needle teacher-forced after the question;
the metric its tokens' mean loss; the corrupted prompt another needle of as many tokens). Memory: each child loads the
model, runs a short warm-up, resets its peak RSS (``/proc/self/clear_refs``), runs the task and reports the growth of
its peak over the RSS before it. HF eager's backward would hold at least each layer's ``heads x n^2`` fp32 pattern
(and its gradient) for every layer: that projection is printed beside the runs, not run.

    OMP_NUM_THREADS=1 python benchmarks/bench_circuits_long.py --model smollm2 --lengths 2048 8192
    OMP_NUM_THREADS=1 python benchmarks/bench_circuits_long.py --quick     # toy model, 64 tokens: the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from peak import grown_mib, reset_peak, status_bytes  # benchmarks/peak.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("sdpa_fb", "eap", "eap_kept")


def child(model_name: str, n: int, task: str) -> dict:
    import torch

    import interp
    from analyses import edge_attribution, needle_task

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = interp.load_model(model_name)
    clean, corrupted, metric = needle_task(model, n)
    start, stop = metric._span()
    keep = clean.shape[1] - start
    if task == "sdpa_fb":
        hf = model.hf
        hf.config._attn_implementation = "sdpa"
        for module in hf.modules():  # every attention module reads the config it was built with
            if hasattr(module, "config") and hasattr(module.config, "_attn_implementation"):
                module.config._attn_implementation = "sdpa"
        embed = hf.get_input_embeddings()
        for p in hf.parameters():
            p.requires_grad_(False)

        def run():
            x = embed(clean).detach().requires_grad_(True)
            out = hf(inputs_embeds=x, logits_to_keep=keep)
            logp = out.logits[:, :stop - start].float().log_softmax(-1)
            loss = -logp.gather(-1, clean[:, start + 1:stop + 1, None]).mean()
            loss.backward()
            return float(loss)
    else:
        def run():
            frame = edge_attribution(model, clean, corrupted, metric, method="eap",
                                     recompute=False if task == "eap_kept" else None)
            return len(frame)
    short = needle_task(model, min(n, 64))  # warm-up: kernels, allocator pools
    if task.startswith("eap"):
        edge_attribution(model, *short, method="eap")
    before = reset_peak()
    cpu, wall = time.process_time(), time.perf_counter()
    value = run()
    return {"model": model_name, "n": int(clean.shape[1]), "task": task, "value": value,
            "grew_mib": grown_mib(before), "peak_mib": status_bytes("VmHWM") / 2**20,
            "rss_before_mib": before / 2**20, "cpu_s": time.process_time() - cpu,
            "wall_s": time.perf_counter() - wall,
            "eager_pattern_gib": 2 * model.cfg.n_layers * model.cfg.n_heads * clean.shape[1] ** 2 * 4 / 2**30}


def _spawn(model_name: str, n: int, task: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TRANSFORMERS_VERBOSITY": "error", "MALLOC_MMAP_THRESHOLD_": "131072"}
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", model_name, str(n), task],
                          capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{model_name} {n} {task} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--quick", action="store_true", help="toy model at 64 tokens")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        name, n, task = args.child
        print(json.dumps(child(name, int(n), task)))
        return
    if args.quick:
        args.model, args.lengths = "toy-induction", [64]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}", flush=True)
    rows = []
    for n in args.lengths:
        for task in args.tasks:
            print(f"{args.model} {n} {task} ...", flush=True)
            rows.append(_spawn(args.model, n, task))
            r = rows[-1]
            print(f"    {r['n']} tokens: grew {r['grew_mib']:.0f} MiB (peak {r['peak_mib']:.0f} MiB), cpu "
                  f"{r['cpu_s']:.1f} s, wall {r['wall_s']:.1f} s", flush=True)
        base = next((r for r in rows if r["n"] >= n and r["task"] == "sdpa_fb"), None)
        for r in rows:
            if base and r["task"].startswith("eap") and r["n"] == base["n"]:
                print(f"  {args.model} {r['n']}: {r['task']} / sdpa_fb growth {r['grew_mib'] / base['grew_mib']:.2f}x, "
                      f"peak {r['peak_mib'] / base['peak_mib']:.2f}x; HF eager's patterns and their gradients "
                      f"alone: {r['eager_pattern_gib']:.1f} GiB", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
