"""What edge attribution and exact edge patching cost, in forward-equivalents (issue 48): the floating-point
operations of each, counted as ``bench_report.py --flops`` counts them (torch's FlopCounterMode: the matmuls, forward
and backward; torch does not count its CPU attention kernel), over those of one plain forward of the task's clean
batch (with the metric's kept logits, as the methods run it).

- EAP: at most 3 (one clean forward, one corrupted forward and its backward);
- EAP-IG with ``steps`` s: at most 2 + 2s;
- the exact faithfulness curve: forward-equivalents per point (the circuit, its complement and ``n_random`` random
  circuits: 2 + n_random patched runs) and per patched run (one forward plus the mask products);
- ``edge_effects``: per edge (one patched run from the edge's receiver's block on).

    OMP_NUM_THREADS=1 python benchmarks/bench_circuits.py --model smollm2 --task ioi --n 4
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

import interp
from analyses import edge_attribution, edge_effects, faithfulness, induction_task, ioi_task
from analyses.causal.engine import _run, kept_logits
from analyses.causal.patching import paired_batches, scalar_metric


def flops(fn) -> tuple[float, float]:
    """The FLOPs of ``fn()`` and its CPU seconds (timed apart, without the counter)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    cpu = time.process_time()
    fn()
    return counter.get_total_flops(), time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--task", choices=["ioi", "induction"], default="ioi")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--steps", type=int, nargs="+", default=[2, 5])
    p.add_argument("--sizes", type=int, nargs="+", default=[50])
    p.add_argument("--n-random", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = interp.load_model(args.model)
    clean, corrupted, metric = (ioi_task(model, n=args.n) if args.task == "ioi"
                                else induction_task(model, n=args.n, length=8))
    batch, _ = paired_batches(model, clean, corrupted)
    keep = kept_logits(model, scalar_metric(metric), batch)
    with torch.no_grad():
        forward, forward_s = flops(lambda: _run(model, batch, **keep))
    rows = {}

    def row(name, fn, bound=None, per=1):
        f, s = flops(fn)
        rows[name] = {"gflop": f / 1e9, "forward_equivalents": f / forward / per, "bound": bound,
                      "cpu_s": s / per, "cpu_s_over_forward": s / forward_s / per}

    scores, parts = {}, {}
    from analyses.circuits import attribution
    from analyses.circuits.taps import Taps

    def counted(owner, name, key):  # an inner counter around one function: its FLOPs, also counted by the outer one
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            with FlopCounterMode(display=False) as inner:
                out = fn(*a, **k)
            parts[key] = parts.get(key, 0) + inner.get_total_flops()
            return out
        return fn, wrapper

    def split(name, fn, bound):
        """``row`` plus where the FLOPs beyond the model's passes go (each part counted by a counter of its own inside the
        whole's; the CPU time from a second run without counters)."""
        parts.clear()
        originals = [counted(Taps, "stream_gradients", "receivers"),
                     counted(attribution, "_contract", "edges")]
        Taps.stream_gradients, attribution._contract = originals[0][1], originals[1][1]
        try:
            with FlopCounterMode(display=False) as counter:
                fn()
        finally:
            Taps.stream_gradients, attribution._contract = originals[0][0], originals[1][0]
        f, receivers, edges = counter.get_total_flops(), parts.get("receivers", 0), parts.get("edges", 0)
        cpu = time.process_time()
        fn()
        s = time.process_time() - cpu
        rows[name] = {"gflop": f / 1e9, "forward_equivalents": f / forward, "bound": bound, "cpu_s": s,
                      "cpu_s_over_forward": s / forward_s}
        rows[f"{name}: the model's passes"] = {"forward_equivalents": (f - receivers - edges) / forward}
        rows[f"{name}: each receiver's gradient (g @ W[cols])"] = {"forward_equivalents": receivers / forward}
        rows[f"{name}: node differences and score products (R x senders x tokens x d_model)"] = {
            "forward_equivalents": edges / forward}

    split("eap", lambda: scores.setdefault("eap", edge_attribution(model, clean, corrupted, metric, method="eap")), 3)
    for s in args.steps:
        split(f"eap-ig steps={s}", lambda s=s: scores.setdefault(
            "eap-ig", edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=s)), 2 + 2 * s)
    unpatched = 2  # the clean and the corrupted run, once per curve
    row("faithfulness: 2 unpatched runs + 1 point", lambda: faithfulness(
        model, clean, corrupted, metric, scores["eap"], sizes=args.sizes[:1], n_random=args.n_random))
    rows["faithfulness: per point"] = {
        "forward_equivalents": rows["faithfulness: 2 unpatched runs + 1 point"]["forward_equivalents"] - unpatched,
        "patched_runs": 2 + args.n_random}
    rows["faithfulness: per patched run"] = {
        "forward_equivalents": rows["faithfulness: per point"]["forward_equivalents"] / (2 + args.n_random)}
    top = scores["eap"].sort_values("abs_score", ascending=False).head(20)
    row("edge_effects: per edge (top 20 by EAP, 2 unpatched runs included)",
        lambda: edge_effects(model, clean, corrupted, top, metric), per=len(top))
    tokens = list(batch["input_ids"].shape)
    print(f"{args.model}, {args.task}: {tokens[0]} x {tokens[1]} tokens, {len(scores['eap'])} edges; plain forward "
          f"{forward / 1e9:.2f} GFLOP in {forward_s:.3f} CPU s; {torch.get_num_threads()} thread; "
          f"load {os.getloadavg()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print("| what | forward-equivalents | bound | CPU s / plain forward's |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        ratio = r.get("cpu_s_over_forward")
        print(f"| {name} | {r['forward_equivalents']:.2f} | {r.get('bound') or ''} | "
              f"{'' if ratio is None else f'{ratio:.1f}'} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
