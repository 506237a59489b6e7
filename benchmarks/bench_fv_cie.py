"""The function-vector CIE (analyses.taxonomy.function_vectors) both ways on one model, side by side in one process: the
whole prompt once per head (``method="full"``) and the prompts' keys and values cached once, then the final token
for a whole layer's heads per forward (``method="cached"``, the default). Prints each run's seconds, the speed-up,
the largest difference between the two scores and the Spearman correlation of their rankings.

    python benchmarks/bench_fv_cie.py --model smollm2 --tasks antonyms --prompts 8
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import interp  # noqa: E402
from analyses.taxonomy.function_vectors import function_vector_scores  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tasks", default="antonyms")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    interp.set_threads(args.threads)
    model = interp.load_model(args.model)
    tasks = args.tasks.split(",")
    runs, seconds = {}, {}
    for method in ("cached", "full"):
        t = time.perf_counter()
        runs[method] = function_vector_scores(model, tasks=tasks, n_prompts=args.prompts, n_shots=args.shots,
                                              n_bootstrap=200, method=method)
        seconds[method] = time.perf_counter() - t
    for df in runs.values():
        df.attrs = {}  # mean z tensors: pandas compares attrs when it concatenates
    a, b = runs["full"]["function_vector"], runs["cached"]["function_vector"]
    print(f"{args.model}, tasks {tasks}, {args.prompts} prompts of {args.shots} shots, {len(a)} heads, "
          f"{args.threads} thread(s); load average at the end: {os.getloadavg()[0]:.2f}")
    print(f"full: {seconds['full']:.1f} s; cached: {seconds['cached']:.1f} s; speed-up "
          f"{seconds['full'] / seconds['cached']:.1f}x")
    print(f"largest |full - cached| {float((a - b).abs().max()):.2e} (largest |score| {float(a.abs().max()):.2e}); "
          f"Spearman {a.corr(b, method='spearman'):.6f}; top 5 full "
          f"{runs['full'].nlargest(5, 'function_vector')[['layer', 'head']].values.tolist()}, cached "
          f"{runs['cached'].nlargest(5, 'function_vector')[['layer', 'head']].values.tolist()}")


if __name__ == "__main__":
    main()
