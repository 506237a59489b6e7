"""`interp report`'s wall time, CPU time and stage times, for one source tree or several run alternately (a
before/after comparison under the same load), each as a user runs it: a fresh process, `--threads N`.

    python benchmarks/bench_report.py --model smollm2 --threads 1                   # this tree
    git worktree add /tmp/before <commit>                                           # then, side by side:
    python benchmarks/bench_report.py --model smollm2 --threads 1 --tree /tmp/before --tree . --repeats 2

Prints one row per run: the tree, the process's wall seconds (start-up and loading included, the plain forward's
timing excluded), the report's wall and CPU seconds,
a plain forward of the model beside them (4 x 64 tokens, the median of 3, timed in the same process just before
the report, and the report's wall time as a multiple of it), each stage's (``load`` is loading the model), and
the load average before and after. CPU seconds are the steadier
number on a shared machine: another process taking the core slows a one-thread run's wall clock, much less its
CPU seconds.

    python benchmarks/bench_report.py --model smollm2 --threads 1 --flops        # where the arithmetic is

``--flops`` runs the report once under torch's FlopCounterMode and prints each stage's floating-point operations
(the matmuls forward and backward; torch does not count its CPU attention kernel, which is about 2% of the report's
profile at these lengths) as forward-equivalents, as the seconds they take at the plain forward's own rate on
this machine (its FLOPs over its time: the time the stage would take if it did nothing but the model's arithmetic, as
fast as a plain forward does it), and at the rate of the model's fastest linear layer timed alone (each of its shapes
on 256 rows): a floor for this arithmetic with torch's matmul kernels on this core. The counter slows every op, so the report
is not timed here; the counts are exact, the rates CPU seconds (steady beside other processes, with one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# a plain forward of 4 x 64 tokens (ids inside the vocabulary), the median of 3 after a warm-up: the scale of both
# child scripts below
_FORWARD = """
import torch


def plain_forward(model, clock):
    vocab = model.cfg.vocab_size
    ids = torch.randint(min(100, vocab // 2), min(1000, vocab), (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
        times = []
        for _ in range(3):
            t = clock()
            model(ids)
            times.append(clock() - t)
    return ids, sorted(times)[1]
"""

# the report as `interp report --threads N` writes it, with each stage's wall and CPU seconds taken at the stage
# callback write_report has in every version compared (CPU seconds: this process, all its threads)
_SCRIPT = """
import json, sys, time, torch
import interp
interp.set_threads(int(sys.argv[3]))  # the user's choice: load_model keeps it (torch.set_num_threads(2) on 2 CPUs looks
                                      # like torch's default and would be replaced by "auto")
from analyses.views.report import write_report
marks = [("load", time.perf_counter(), time.process_time())]
model = interp.load_model(sys.argv[1])
record = lambda stage: marks.append((stage, time.perf_counter(), time.process_time()))
marks.append(("forward", time.perf_counter(), time.process_time()))
forward = plain_forward(model, time.perf_counter)[1]  # for scale
summary = write_report(model, sys.argv[2], progress=record, overwrite=True)
marks.append(("end", time.perf_counter(), time.process_time()))
stages = {a[0]: (round(b[1] - a[1], 2), round(b[2] - a[2], 2)) for a, b in zip(marks, marks[1:])}
print(json.dumps({"forward": forward, "forward_block": stages.pop("forward")[0], "stages": stages,
                  "head_inputs": sorted(set(summary["head_inputs"].values())), "study": summary["study_inputs"], "threads": summary["threads"]}))
"""


_FLOPS = """
import json, sys, time, torch
import interp
from torch.utils.flop_counter import FlopCounterMode
interp.set_threads(int(sys.argv[3]))
from analyses.views.report import write_report
model = interp.load_model(sys.argv[1])
ids, forward_s = plain_forward(model, time.process_time)
with torch.no_grad(), FlopCounterMode(display=False) as counter:
    model(ids)
forward = counter.get_total_flops()
marks = []
with FlopCounterMode(display=False) as counter:
    record = lambda stage: marks.append((stage, counter.get_total_flops()))
    write_report(model, sys.argv[2], progress=record, overwrite=True)
    marks.append(("end", counter.get_total_flops()))
stages = {a[0]: b[1] - a[1] for a, b in zip(marks, marks[1:])}
rates = {}  # the model's own linear shapes on 256 rows, each timed alone for half a second: what this core gets
for k, n in sorted({(m.in_features, m.out_features) for m in model.hf.modules() if isinstance(m, torch.nn.Linear)}):
    x, w = torch.randn(256, k), torch.randn(n, k)
    torch.nn.functional.linear(x, w)
    t, reps = time.process_time(), 0
    while time.process_time() - t < 0.5:
        torch.nn.functional.linear(x, w)
        reps += 1
    rates[f"{k} -> {n}"] = 2 * 256 * k * n * reps / (time.process_time() - t)
print(json.dumps({"forward_flops": forward, "forward_s": forward_s, "stages": stages, "rates": rates}))
"""


def count_flops(model: str, threads: int) -> None:
    """Each stage's FLOPs, as forward-equivalents and as seconds at the plain forward's rate (``--flops``)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "INTERP_PROGRESS": "0"}
    tree = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = str(tree)
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-c", _FORWARD + _FLOPS, model, out, str(threads)], cwd=tree, env=env,
                              capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"counting the report's FLOPs failed:\n{done.stderr[-3000:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    rate = r["forward_flops"] / r["forward_s"]
    print(f"plain forward (4 x 64 tokens): {r['forward_flops'] / 1e9:.1f} GFLOP in {r['forward_s']:.3f} CPU s = "
          f"{rate / 1e9:.1f} GFLOP/s on {threads} thread(s)")
    best = max(r["rates"].values())
    print("the model's linear layers alone on 256 rows: " + ", ".join(f"{shape} {v / 1e9:.0f}" for shape, v in
                                                                      r["rates"].items()) + " GFLOP/s")
    print(f"| stage | GFLOP | forward-equivalents | s at the forward's rate | s at the fastest linear's "
          f"({best / 1e9:.0f} GFLOP/s) |")
    print("|---|---:|---:|---:|---:|")
    for stage, flops in [*r["stages"].items(), ("total", sum(r["stages"].values()))]:
        print(f"| {stage} | {flops / 1e9:.0f} | {flops / r['forward_flops']:.1f} | {flops / rate:.1f} | "
              f"{flops / best:.1f} |")


def run_report(tree: Path, model: str, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "INTERP_PROGRESS": "0"}
    with tempfile.TemporaryDirectory() as out:
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", _FORWARD + _SCRIPT, model, out, str(threads)], cwd=tree, env=env, check=True,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_without_forward"] = wall - result["forward_block"]  # the process as `interp report` runs it
    return {"wall": wall, "load": (load, os.getloadavg()[0]), **result}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tree", type=Path, action="append", help="a source tree (repeat to compare; default: this one)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--flops", action="store_true", help="count each stage's FLOPs instead of timing the report")
    args = p.parse_args(argv)
    if args.flops:
        count_flops(args.model, args.threads)
        return 0
    trees = [t.resolve() for t in (args.tree or [Path(__file__).resolve().parents[1]])]
    print(f"# interp report --model {args.model} --threads {args.threads}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    print("| tree | process wall s | report wall s | report CPU s | plain forward s (report / forward) "
          "| stages: wall / CPU s | load avg start/end |")
    print("|---|---:|---:|---:|---:|---|---|")
    for _ in range(args.repeats):
        for tree in trees:
            r = run_report(tree, args.model, args.threads)
            report = {k: v for k, v in r["stages"].items() if k != "load"}
            wall, cpu = (sum(v[i] for v in report.values()) for i in (0, 1))
            stages = ", ".join(f"{k} {w:.1f} / {c:.1f}" for k, (w, c) in r["stages"].items())
            print(f"| {tree} | {r['wall_without_forward']:.1f} | {wall:.1f} | {cpu:.1f} | {r['forward']:.3f} ({wall / r['forward']:.0f}x) "
                  f"| {stages} | "
                  f"{r['load'][0]:.2f} / {r['load'][1]:.2f} |", flush=True)
            print(f"<!-- {tree}: heads on {r['head_inputs']}; studies on {r['study']}; {r['threads']} threads -->",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
