"""Sharded studies: ``detect_heads`` over 512 prompts on MiniLM, one process against ``torchrun`` with 2 processes.

Three ways to run the same study (``detect_heads(model, n_prompts=512)``: 512 repeated random token sequences for
induction and duplicate-token scores and 512 corpus prompts for the others, 64 tokens, batches of 32, 1000
bootstrap resamples), each a fresh launch, interleaved, ``--repeats`` times:

- ``1 x 1``: one process, 1 thread;
- ``2 x 1``: ``torchrun --nproc_per_node 2``, 1 thread each (gloo): each rank scores every other batch, the
  per-prompt sums are added over ranks;
- ``1 x 2``: one process, 2 threads (for reference: the other way to use two cores).

Reported per launch: the study's time (after a warm-up study on 4 prompts; under torchrun from a barrier before
to the end of the call on rank 0), its parts (prompts built, batches scored, sums combined, bootstrap) and the
launch's wall time (interpreter start, imports, model load and the study). The sharded result is checked against
the single-process one (max difference of every numeric column).

    python benchmarks/bench_distributed.py                 # 3 repeats; prints the table and the machine
    python benchmarks/bench_distributed.py --repeats 1 --n-prompts 128
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()


# -- one launch (a worker) -----------------------------------------------------------------------------------------
def _worker(n_prompts: int, out: str | None) -> None:
    import pandas as pd
    import torch
    import torch.distributed as dist

    import interp
    from analyses.heads import detect as heads, scores
    from interp.runtime import distributed

    parts: dict[str, float] = {}

    def timed(owner, name: str, label: str) -> None:  # add the time spent in owner.name to parts[label]
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[label] = parts.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, wrapper)

    timed(heads, "repeated_random_tokens", "prompts")
    timed(heads, "corpus_prompts", "prompts")
    timed(heads, "score_batch", "batches")
    timed(distributed, "all_sum", "combine")
    timed(scores.Tally, "frame", "bootstrap")
    with distributed.launched():
        model = interp.load_model("minilm", device="cpu")
        heads.detect_heads(model, n_prompts=4, n_bootstrap=10)  # warm-up
        parts.clear()
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        df = heads.detect_heads(model, n_prompts=n_prompts)
        seconds = time.perf_counter() - start
        record = {"rank": distributed.rank(), "study_s": seconds, "threads": torch.get_num_threads(),
                  "ranks": distributed.world_size(), **{f"{k}_s": v for k, v in parts.items()}}
        Path(f"{out}.rank{distributed.rank()}.json").write_text(json.dumps(record))  # not stdout: ranks interleave
        if distributed.rank_zero() and out is not None:
            pd.to_pickle(df, out)


# -- the driver ----------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(kind: str, n_prompts: int, out: Path) -> dict:
    threads = "2" if kind == "1 x 2" else "1"
    for stale in out.parent.glob(f"{out.name}.rank*.json"):
        stale.unlink()
    worker = [str(HERE), "--worker", "--n-prompts", str(n_prompts), "--out", str(out)]
    if kind == "2 x 1":
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                   str(_free_port()), *worker]
    else:
        command = [sys.executable, *worker]
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONWARNINGS": "ignore"}
    start, cpu_before = time.perf_counter(), _children_cpu()
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(2 if kind == "2 x 1" else 1)]
    first = next(r for r in records if r["rank"] == 0)
    # batches: the slowest rank's share (the others wait for it in the combine step)
    return {**first, "batches_s": max(r.get("batches_s", 0.0) for r in records), "wall_s": wall,
            "cpu_s": _children_cpu() - cpu_before}


def _children_cpu() -> float:
    """CPU seconds (user + system) used by finished child processes so far."""
    usage = os.times()
    return usage.children_user + usage.children_system


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-prompts", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.n_prompts, args.out)
        return

    import pandas as pd
    import torch

    kinds = ["1 x 1", "2 x 1", "1 x 2"]
    load = os.getloadavg()
    print(f"# {datetime.date.today()}, {_cpu()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"# python benchmarks/bench_distributed.py --n-prompts {args.n_prompts} --repeats {args.repeats}")
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    for repeat in range(args.repeats):
        for kind in kinds if repeat % 2 == 0 else kinds[::-1]:  # interleaved, order alternating
            out = tmp / f"bench_distributed_{kind.replace(' ', '')}.pkl"
            runs[kind].append(_launch(kind, args.n_prompts, out))
            run = runs[kind][-1]
            print(f"  {kind}: study {run['study_s']:.2f} s, wall {run['wall_s']:.2f} s, CPU {run['cpu_s']:.2f} s "
                  f"(CPU / wall {run['cpu_s'] / run['wall_s']:.2f})", flush=True)
    single = pd.read_pickle(tmp / "bench_distributed_1x1.pkl")
    sharded = pd.read_pickle(tmp / "bench_distributed_2x1.pkl")
    numbers = single.select_dtypes("number").columns
    difference = float((single[numbers] - sharded[numbers]).abs().max().max())

    base = statistics.median(r["study_s"] for r in runs["1 x 1"])
    base_wall = statistics.median(r["wall_s"] for r in runs["1 x 1"])
    print(f"\nprocesses x threads | study s (median) | speedup | wall s | wall speedup | prompts s | batches s | "
          "combine s | bootstrap s")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind in kinds:
        med = {key: statistics.median(r.get(key, 0.0) for r in runs[kind])
               for key in ("study_s", "wall_s", "prompts_s", "batches_s", "combine_s", "bootstrap_s")}
        print(f"| {kind} | {med['study_s']:.2f} | {base / med['study_s']:.2f}x | {med['wall_s']:.2f} | "
              f"{base_wall / med['wall_s']:.2f}x | {med['prompts_s']:.2f} | {med['batches_s']:.2f} | "
              f"{med['combine_s']:.3f} | {med['bootstrap_s']:.2f} |")
    load = os.getloadavg()
    print(f"\nsharded vs single-process result: max difference {difference:.2e}")
    print(f"# load average at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
