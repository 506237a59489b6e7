"""Retrieval-head detection against Wu et al.'s (2024) detector, on the same needle prompts: peak memory, time, the
longest prompt each can take within a memory budget, and the scores, which must agree.

Wu et al.'s code (github nightdessert/Retrieval_Head, ``retrieval_head_detection.py``) prefills the prompt but its
last token with the KV cache, then decodes greedily one token at a time with ``output_attentions=True`` on their
patched modeling files' plain ("torch") attention; at each step, for each layer and head, the top-1 key of the
step's attention row scores ``1 / |needle|`` when it lies inside the needle and holds the token just generated; a
trial counts when the answer recalls more than half the needle, and a head's score is its mean over counted trials.
``wu_trial`` below re-implements that rule on an unmodified HF model, as a user without their patched files would:

- ``wu_eager``: HF eager attention throughout (``attn_implementation="eager"``, the only HF attention that returns
  attention weights); the prefill materialises each layer's ``(heads, n, n)`` pattern;
- ``wu_split``: their code's split, prefill on a fused kernel (they use flash-attention 2; on a CPU the stand-in is
  HF's sdpa), then eager attention with ``output_attentions`` for the decoding steps only;
- ``ours``: ``analyses.long.retrieval.retrieval_heads`` (our flash path; each step's top-1 key from one query row).

Same prompts (``needle_prompts``: lengths x depths, seed 0, 8 random digits), same protocol on both sides: as many
decoding steps as the needle has tokens (Wu et al. decode up to 50 and stop at a newline; steps past the answer can
only add hits a head makes while the model keeps copying) and our counting rule (at least ``min_recall`` of the
needle's tokens generated; Wu et al. use ROUGE-1 recall > 50 on the decoded text). The benchmark asserts that every
trial generates the same tokens, counts the same way, and that every head's score is the same on all three.

Each (task, length) runs in a fresh process, interleaved (ours, wu_split, wu_eager at one length, then the next):
the child loads its model, runs a 16-token warm-up, resets its peak RSS (``/proc/self/clear_refs``, 5) and reports the
growth of the peak (VmHWM) over its RSS before the trials, wall-clock and CPU time. ``wu_eager`` is not started where
its predicted growth, ``(8 heads + 5) n^2`` bytes (the fp32 scores and their scaled / masked / softmaxed copy live
two at a time, the additive fp32 mask and its bool source once) exceeds ``--budget-gib`` (default 16): the table says
so instead of swapping the machine. The longest length each reaches within the budget: measured where the model's
positions allow, else extrapolated (eager by the formula, the others by their measured growth per token).

    OMP_NUM_THREADS=1 python benchmarks/bench_vs_wu.py                 # SmolLM2, 1k-8k, depths 0.1 0.5 0.9
    python benchmarks/bench_vs_wu.py --quick                           # toy model, 40 and 64 tokens
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

import torch

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("ours", "wu_split", "wu_eager")


def _status(field: str) -> int:
    """A /proc/self/status value in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def eager_bytes(heads: int, n: int) -> int:
    """What HF's eager prefill of ``n`` tokens adds at its peak: two (heads, n, n) fp32 score tensors at a time and
    the (n, n) fp32 additive mask with its bool source."""
    return (8 * heads + 5) * n * n


def wu_trial(hf, ids: torch.Tensor, needle: tuple[int, int], n_steps: int, split: bool = False):
    """Wu et al.'s rule on one prompt. ids: (p,); needle: (start, end) positions of the answer in ids.

    Prefill ``ids[:-1]`` with the KV cache, then feed the last prompt token and decode greedily ``n_steps`` tokens
    with ``output_attentions=True``; at each step a head hits when the top-1 key of its attention row lies inside the
    needle and holds the generated token. split: prefill with sdpa, decode with eager (their flash / torch split).
    Returns the generated ids (n_steps,) and each head's hit count (l, h)."""
    from interp.streaming import cache_kwarg, output_cache

    name = cache_kwarg(hf)
    hf.set_attn_implementation("sdpa" if split else "eager")
    start, end = needle
    hits, generated = None, []
    with torch.no_grad():
        out = hf(input_ids=ids[None, :-1], use_cache=True, logits_to_keep=1)
        if split:
            hf.set_attn_implementation("eager")
        token = ids[-1]
        for _ in range(n_steps):
            out = hf(input_ids=token.view(1, 1), use_cache=True, output_attentions=True, logits_to_keep=1,
                     **{name: output_cache(out)})
            token = out.logits[0, -1].argmax()
            rows = torch.stack([a[0, :, -1] for a in out.attentions])  # (l, h, k): this step's attention row
            top = rows.topk(1, dim=-1).indices[..., 0]  # (l, h)
            hit = (top >= start) & (top < end) & (ids[top.clamp(max=len(ids) - 1)] == token)
            hits = hit.long() if hits is None else hits + hit.long()
            generated.append(int(token))
    return torch.tensor(generated), hits


def wu_scores(hf, prompts, min_recall: float = 0.5, split: bool = False):
    """Wu et al.'s scores over ``prompts`` (``NeedlePrompt``s): each head's mean of hits / |needle| over the counted
    trials (NaN where none counted), as (l, h) float64, and each trial's generated ids, hits and whether it counted."""
    per_trial, trials = [], []
    for p in prompts:
        generated, hits = wu_trial(hf, p.ids, p.needle, len(p.answer), split)
        recall = float(torch.isin(p.answer, generated).float().mean())
        counted = recall >= min_recall
        trials.append({"generated": generated.tolist(), "hits": hits.tolist(), "counted": counted, "recall": recall})
        if counted:
            per_trial.append(hits.double() / len(p.answer))
    if not per_trial:
        return torch.full_like(hits, float("nan"), dtype=torch.float64), trials
    return torch.stack(per_trial).mean(0), trials


def child(model_name: str, n: int, task: str, prompt_file: str, depths: list[float]) -> dict:
    """Run one task at one length in this (fresh) process."""
    import interp
    from interp.model.bundled import bundled_folder

    saved = torch.load(prompt_file)
    from analyses.data.needles import NeedlePrompt

    prompts = [NeedlePrompt(torch.tensor(p["ids"]), tuple(p["needle"]), p["length"], p["depth"]) for p in saved]
    if task == "ours":
        from analyses.long.retrieval import retrieval_heads
        from analyses.data.needles import needle_prompts

        model = interp.load_model(model_name, attn="flash")
        again = needle_prompts(model, [n], depths)
        assert all(torch.equal(a.ids, p.ids) and a.needle == p.needle for a, p in zip(again, prompts))
        with torch.no_grad():
            model.hf(input_ids=prompts[0].ids[None, :16], use_cache=False, logits_to_keep=1)

        def run():
            df = retrieval_heads(model, context=n, lengths=[n], depths=depths, n_bootstrap=100)
            return df["retrieval"].tolist(), [t["counted"] for t in df.attrs["trials"]]
        heads = model.cfg.n_heads
    else:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(bundled_folder(model_name), attn_implementation="eager",
                                                  dtype=torch.float32).eval()
        with torch.no_grad():
            hf(input_ids=prompts[0].ids[None, :16], use_cache=False, logits_to_keep=1)

        def run():
            scores, trials = wu_scores(hf, prompts, split=task == "wu_split")
            return scores.flatten().tolist(), [t["counted"] for t in trials]
        heads = hf.config.num_attention_heads
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    scores, counted = run()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = _status("VmHWM")
    return {"model": model_name, "n": n, "task": task, "before_mib": before / 2**20, "peak_mib": peak / 2**20,
            "grew_mib": (peak - before) / 2**20, "seconds": seconds, "cpu_seconds": cpu, "heads": heads,
            "scores": scores, "counted": counted, "trials": len(prompts)}


def _spawn(model_name: str, n: int, task: str, prompt_file: str, depths: list[float]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, __file__, "--child", model_name, str(n), task, prompt_file,
                           *map(str, depths)], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{model_name} {n} {task} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_agreement(rows: list[dict]) -> list[str]:
    """Every task's scores equal ours at each length (the same rule on the same prompts), and the same trials count;
    raises AssertionError naming the heads that differ."""
    lines = []
    for n in sorted({r["n"] for r in rows}):
        ours = next(r for r in rows if r["n"] == n and r["task"] == "ours")
        for r in rows:
            if r["n"] != n or r["task"] == "ours" or r.get("skipped"):
                continue
            assert r["counted"] == ours["counted"], f"{n}: {r['task']} counted {r['counted']}, ours {ours['counted']}"
            a, b = torch.tensor(ours["scores"]), torch.tensor(r["scores"])
            same = torch.isclose(a, b, rtol=0, atol=1e-12, equal_nan=True)
            bad = [(i // ours["heads"], i % ours["heads"], float(a[i]), float(b[i])) for i in (~same).nonzero()[:, 0]]
            assert not bad, f"{n} tokens: {r['task']} disagrees with ours on (layer, head, ours, theirs) {bad[:10]}"
            lines.append(f"agree at {n:>6} tokens: {r['task']} = ours on all {len(a)} heads, "
                         f"{sum(r['counted'])}/{len(r['counted'])} trials counted")
    return lines


def _fit_length(rows: list[dict], task: str, budget: float) -> str:
    pts = sorted((r["n"], r["grew_mib"] * 2**20) for r in rows if r["task"] == task and not r.get("skipped"))
    if len(pts) < 2:
        return "n/a"
    (n0, m0), (n1, m1) = pts[0], pts[-1]
    slope = (m1 - m0) / (n1 - n0)  # bytes per token, linear between the shortest and the longest
    return (f"~{int(n1 + (budget - m1) / slope):,} tokens (extrapolated linearly, {slope / 2**10:.0f} KiB per token)"
            if slope > 0 else "n/a")


def report(rows: list[dict], budget_gib: float, max_positions: int) -> list[str]:
    budget = budget_gib * 2**30
    lines = ["task      n       grew MiB   peak MiB   x ours grew  time s   cpu s   x ours cpu  eager predicted MiB  "
             "top heads (layer.head score)"]
    for r in rows:
        ours = next(o for o in rows if o["n"] == r["n"] and o["task"] == "ours")
        pred = eager_bytes(r["heads"], r["n"]) / 2**20
        if r.get("skipped"):
            lines.append(f"{r['task']:<9} {r['n']:<7} skipped: {r['skipped']}")
            continue
        s = torch.tensor(r["scores"])
        top = [f"{int(i) // r['heads']}.{int(i) % r['heads']} {float(s[i]):.2f}"
               for i in s.nan_to_num(-1).argsort(descending=True)[:3]]
        lines.append(f"{r['task']:<9} {r['n']:<7} {r['grew_mib']:9.1f} {r['peak_mib']:9.1f} "
                     f"{r['grew_mib'] / ours['grew_mib']:10.2f} {r['seconds']:8.1f} {r['cpu_seconds']:7.1f} "
                     f"{r['cpu_seconds'] / ours['cpu_seconds']:10.2f}  {pred:12.1f}        {', '.join(top)}")
    heads = rows[0]["heads"]
    eager_max = int((budget / (8 * heads + 5)) ** 0.5)
    for task in TASKS:
        done = [r["n"] for r in rows if r["task"] == task and not r.get("skipped")]
        reach = max(done) if done else 0
        beyond = f"{eager_max:,} tokens by eager's formula" if task == "wu_eager" else _fit_length(rows, task, budget)
        lines.append(f"within {budget_gib:g} GiB: {task} ran up to {reach:,} tokens (the model has {max_positions:,} "
                     f"positions); beyond: {beyond}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="toy model at 48 and 96 tokens")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--budget-gib", type=float, default=16.0, help="skip eager where it would need more")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if args.child:
        model, n, task, prompt_file, *depths = args.child
        print(json.dumps(child(model, int(n), task, prompt_file, [float(d) for d in depths])))
        return
    if "ours" not in args.tasks:
        parser.error("--tasks must include ours: the other tasks are compared with it")
    import interp
    from analyses.data.needles import needle_prompts

    if args.quick:
        args.model, args.lengths = "toy-induction", [40, 64]
    load = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}; threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"
          f"; fp32; cpu count {os.cpu_count()}; load average at start {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}",
          flush=True)
    model = interp.load_model(args.model, attn="flash")
    positions = model.cfg.max_positions
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for n in args.lengths:  # the prompts once, here; each child reads them
            files[n] = str(Path(tmp) / f"prompts_{n}.pt")
            torch.save([{"ids": p.ids.tolist(), "needle": list(p.needle), "length": p.length, "depth": p.depth}
                        for p in needle_prompts(model, [n], args.depths)], files[n])
        heads = model.cfg.n_heads
        del model
        for n in args.lengths:
            for task in args.tasks:
                if task == "wu_eager" and eager_bytes(heads, n) > args.budget_gib * 2**30:
                    why = (f"eager's prefill would need {eager_bytes(heads, n) / 2**30:.1f} GiB > the "
                           f"{args.budget_gib:g} GiB budget")
                    rows.append({"n": n, "task": task, "skipped": why, "heads": heads})
                    print(f"  {n:>6} {task:<9} {why}", flush=True)
                    continue
                row = _spawn(args.model, n, task, files[n], args.depths)
                rows.append(row)
                if args.json:  # as it goes: a run stopped early keeps what it measured
                    args.json.write_text(json.dumps(rows, indent=1))
                print(f"  {n:>6} {task:<9} grew {row['grew_mib']:8.1f} MiB  peak {row['peak_mib']:8.1f} MiB  "
                      f"{row['seconds']:7.1f} s  cpu {row['cpu_seconds']:7.1f} s  counted {sum(row['counted'])}/"
                      f"{row['trials']}", flush=True)
    print("\n".join(report(rows, args.budget_gib, positions)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print("\n".join(check_agreement(rows)))
    load = os.getloadavg()
    print(f"load average at end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    main()
