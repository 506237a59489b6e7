"""Long-context head scores in O(n) memory: peak memory and time against a plain HF sdpa forward of the same length.

For each model and length, each task runs in a fresh subprocess (the only honest peak on CPU), the tasks
interleaved (sdpa, scores, retrieval at one length, then the next length):

- ``sdpa``: HF's own sdpa attention, one forward of the prompt (``logits_to_keep=1``: the LM head on the last
  row only, as generation does; the n x vocabulary logits would otherwise dominate the peak);
- ``scores``: ``detect_heads(model, prompts=...)`` on our flash path: previous-token, self, sink, duplicate-token,
  induction and positional on one prompt BOS + x + x (x random ordinary tokens), stopping after the last attention;
- ``norm_scores``: the same scores read on norm-weighted attention (``weighting="norm"``: each key's ``||v_j W_O||``
  and each row's sum of ``w_ik ||v_k W_O||``, one more statistic of the tiled pass), on the same prompt;
- ``user_score``: ``detect_heads(model, scores=["punctuation"])`` on a prompt of the same length made of corpus text
  (random tokens have no punctuation), the score defined in a user's own file (``notebooks/examples/punctuation_heads.py``, registered with ``analyses.head_score``), on our flash path;
- ``sdpa_decode``: HF sdpa, the prefill of a needle prompt with the KV cache and greedy decoding of as many tokens
  as the needle has (the
  same loop as ``run_needle``, without hooks): generation's own memory (the KV cache, growing each step);
- ``retrieval``: one needle-in-a-haystack trial (``analyses.long.retrieval``) on the same prompt: the prefill on our flash
  path and greedy decoding of the needle (8 digits, 16 tokens with the space before each), each head's top-1 key
  read at every step; compared with
  ``sdpa_decode``.

Memory: each child loads the model, runs a short warm-up, resets its peak RSS (``/proc/self/clear_refs``, 5), runs
the task and reports its peak (VmHWM) and the RSS before it; the table shows the task's growth over the loaded
model and the total peak, both as a ratio to sdpa's. Eager attention's projected size is ``heads x n^2`` fp32 per
layer (the pattern alone). The slope is the growth per 1k tokens between the shortest and longest lengths; linear
memory doubles when n doubles (ratio 2, quadratic 4).

Time: wall-clock and the child's CPU time (``time.process_time``) over the task. With one thread the CPU time is
close to what an idle machine would show; on a machine shared with other work the wall-clock ratio moves with the
load from one child to the next, the CPU-time ratio much less.

    python benchmarks/bench_long_context.py                 # SmolLM2 at 4k, 8k (Gemma 3 with --gemma)
    python benchmarks/bench_long_context.py --gemma --lengths   # Gemma 3 alone
    python benchmarks/bench_long_context.py --quick         # toy model, 32 and 64 tokens: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("sdpa", "scores", "norm_scores", "user_score", "sdpa_decode", "retrieval")
_REFERENCE = {"sdpa": "sdpa", "scores": "sdpa", "norm_scores": "sdpa", "user_score": "sdpa",
              "sdpa_decode": "sdpa_decode",
              "retrieval": "sdpa_decode"}
USER_SCORE = ROOT / "notebooks" / "examples" / "punctuation_heads.py"  # a score defined outside the package
SCORE_KINDS = ["previous_token", "self", "sink", "duplicate_token", "induction", "positional"]


def _status(field: str) -> int:
    """A /proc/self/status value in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _prompt(model, n: int):
    import torch

    from analyses.data.prompts import _ordinary_ids, _special_frame

    prefix, _ = _special_frame(model)
    pool = _ordinary_ids(model)
    g = torch.Generator().manual_seed(0)
    half = (n - len(prefix) + 1) // 2
    x = pool[torch.randint(len(pool), (half,), generator=g)]
    return torch.cat([torch.tensor(prefix, dtype=torch.long), x, x])[:n]


def child(model_name: str, n: int, task: str) -> dict:
    """Run one task in this (fresh) process; return its peak memory and time."""
    import torch

    import interp
    from analyses import detect_heads
    from analyses.long.retrieval import retrieval_heads

    model = interp.load_model(model_name, attn="flash")
    ids = _prompt(model, n)
    if task == "sdpa":
        model.hf.set_attn_implementation("sdpa")

        def run():
            with torch.no_grad():
                model.hf(input_ids=ids[None], use_cache=False, logits_to_keep=1)
    elif task == "sdpa_decode":
        model.hf.set_attn_implementation("sdpa")
        from analyses.data.needles import needle_prompts

        prompt = needle_prompts(model, [n], [0.5])[0]
        needle, name = prompt.ids, interp.cache_kwarg(model.hf)  # read once, outside the timed loop

        def run():  # as many greedy tokens as the retrieval trial decodes: the needle's (16 with a tokenizer)
            with torch.no_grad():
                out = model.hf(input_ids=needle[None], use_cache=True, logits_to_keep=1)
                for _ in range(len(prompt.answer)):
                    token = out.logits[:, -1].argmax(-1, keepdim=True)
                    out = model.hf(input_ids=token, use_cache=True, logits_to_keep=1,
                                   **{name: interp.output_cache(out)})
    elif task in ("scores", "norm_scores"):
        def run():
            return detect_heads(model, prompts=ids[None], scores=SCORE_KINDS, n_bootstrap=100,
                                weighting="norm" if task == "norm_scores" else "raw")
    elif task == "user_score":
        import importlib.util

        from analyses.data.prompts import haystack

        spec = importlib.util.spec_from_file_location("punctuation_heads", USER_SCORE)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        if model.tokenizer is not None:  # corpus text (it has punctuation), BOS first, as long as the others' prompt
            text = haystack(model.tokenizer, n - 1, torch.Generator().manual_seed(0))
            ids = torch.tensor([int(ids[0]), *text[: n - 1]])

        def run():
            return detect_heads(model, prompts=ids[None], scores=["punctuation"], n_bootstrap=100)
    else:
        def run():
            return retrieval_heads(model, context=n, lengths=[n], depths=[0.5], n_bootstrap=100)
    warm = ids[:16]
    with torch.no_grad():  # first-call allocations (thread pools, kernels) are not the task's
        if task.startswith("sdpa"):
            model.hf(input_ids=warm[None], use_cache=False, logits_to_keep=1)
        else:
            detect_heads(model, prompts=warm[None], scores=SCORE_KINDS, n_bootstrap=10,
                         weighting="norm" if task == "norm_scores" else "raw")
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    out = run()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = _status("VmHWM")
    extra = {}
    if task == "retrieval":
        extra = {"trial": out.attrs["trials"][0],
                 "top": out.nlargest(3, "retrieval")[["layer", "head", "retrieval"]].values.tolist()}
    if task in ("scores", "norm_scores"):
        extra = {"top_induction": out.nlargest(3, "induction")[["layer", "head", "induction"]].values.tolist()}
    if task == "user_score":
        extra = {"top_punctuation": out.nlargest(3, "punctuation")[["layer", "head", "punctuation"]].values.tolist()}
    cfg = model.cfg
    return {"model": model_name, "n": n, "task": task, "before_mib": before / 1024, "peak_mib": peak / 1024,
            "grew_mib": (peak - before) / 1024, "seconds": seconds, "cpu_seconds": cpu, "heads": cfg.n_heads,
            "layers": cfg.n_layers,
            **extra}


def _spawn(model_name: str, n: int, task: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, __file__, "--child", model_name, str(n), task], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{model_name} {n} {task} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(model_name: str, lengths: list[int], tasks: list[str]) -> list[dict]:
    rows = []
    for n in lengths:  # interleaved: every task at one length, then the next length
        for task in tasks:
            row = _spawn(model_name, n, task)
            rows.append(row)
            print(f"  {model_name} {n:>6} {task:<11} grew {row['grew_mib']:8.1f} MiB  peak {row['peak_mib']:8.1f} MiB"
                  f"  {row['seconds']:7.1f} s  cpu {row['cpu_seconds']:7.1f} s", flush=True)
    return rows


def report(rows: list[dict]) -> list[str]:
    lines = ["x ref: against sdpa (one forward) for sdpa and the scores, sdpa_decode (prefill + the needle's tokens) "
             "for retrieval",
             "model     n      task         grew MiB   x ref  peak MiB   x ref   time s   x ref    cpu s   x ref  "
             "eager pattern/layer"]
    by = {(r["model"], r["n"], r["task"]): r for r in rows}
    for r in rows:
        ref = by.get((r["model"], r["n"], _REFERENCE[r["task"]]))
        eager_gib = r["heads"] * r["n"] ** 2 * 4 / 1024 ** 3
        ratio = (lambda key: r[key] / ref[key] if ref and ref[key] > 0 else float("nan"))
        lines.append(f"{r['model']:<9} {r['n']:<6} {r['task']:<11} {r['grew_mib']:9.1f} {ratio('grew_mib'):7.2f} "
                     f"{r['peak_mib']:9.1f} {ratio('peak_mib'):7.2f} {r['seconds']:8.1f} {ratio('seconds'):7.2f} "
                     f"{r['cpu_seconds']:8.1f} {ratio('cpu_seconds'):7.2f}  "
                     f"{eager_gib:8.3f} GiB")
    for model in dict.fromkeys(r["model"] for r in rows):
        for task in TASKS:
            pts = sorted((r["n"], r["grew_mib"]) for r in rows if r["model"] == model and r["task"] == task)
            if len(pts) >= 2:
                (n0, m0), (n1, m1) = pts[0], pts[-1]
                slope = (m1 - m0) / (n1 - n0) * 1000
                growth = f"x{m1 / m0:.2f}" if m0 > 0 else "n/a (no growth at the shortest)"
                lines.append(f"slope {model} {task}: {slope:.1f} MiB per 1k tokens; growth {growth} for "
                             f"length x{n1 / n0:.1f} (linear: x{n1 / n0:.1f}, quadratic: x{(n1 / n0) ** 2:.1f})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "N", "TASK"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="toy model at 32 and 64 tokens")
    parser.add_argument("--gemma", action="store_true", help="also Gemma 3 270M at --gemma-lengths")
    parser.add_argument("--lengths", type=int, nargs="*", default=[4096, 8192],
                        help="SmolLM2's lengths; none (a bare --lengths) runs Gemma 3 alone")
    parser.add_argument("--gemma-lengths", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if args.child:
        model, n, task = args.child
        print(json.dumps(child(model, int(n), task)))
        return
    load = os.getloadavg()
    print(f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; fp32; cpu count {os.cpu_count()}; "
          f"load average at start {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)
    plan = [("toy-induction", [32, 64])] if args.quick else [("smollm2", args.lengths)] if args.lengths else []
    if args.gemma and not args.quick:
        plan.append(("gemma3", args.gemma_lengths))
    rows = [row for model, lengths in plan for row in measure(model, lengths, args.tasks)]
    print("\n".join(report(rows)))
    load = os.getloadavg()
    print(f"load average at end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} (times are wall-clock on a shared machine)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
