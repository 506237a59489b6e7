"""EAP and EAP-IG against exact edge patching on a real model's task, and the circuits' faithfulness (issue 48).

For a task (IOI or induction): every edge scored by EAP and by EAP-IG; the exact effect of making each edge alone
clean in the corrupted run (``edge_patching(..., run="corrupted")`` minus the corrupted run) for the top edges by
EAP-IG's |score| and for random edges; Spearman of each estimate against the exact effects; the faithfulness curve of
EAP-IG's circuits with CPR/CMD beside random circuits of the same sizes. Prints one JSON line.

    OMP_NUM_THREADS=1 python benchmarks/circuits_real.py --model smollm2 --task ioi --top 300 --random 100
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from scipy.stats import spearmanr

import interp
from analyses import edge_attribution, edge_patching, faithfulness, induction_task, ioi_task


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--task", choices=["ioi", "induction"], default="ioi")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=300)
    p.add_argument("--random", type=int, default=100)
    p.add_argument("--sizes", type=int, nargs="+", default=[25, 50, 100, 200, 400, 800])
    p.add_argument("--n-random-circuits", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = interp.load_model(args.model)
    clean, corrupted, metric = (ioi_task(model, n=args.n) if args.task == "ioi"
                                else induction_task(model, n=args.n, length=12))
    out = {"model": args.model, "task": args.task, "n": args.n, "steps": args.steps}
    cpu = time.process_time()
    eap = edge_attribution(model, clean, corrupted, metric, method="eap")
    out["eap_cpu_s"] = time.process_time() - cpu
    cpu = time.process_time()
    ig = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=args.steps)
    out["eap_ig_cpu_s"] = time.process_time() - cpu
    out.update(edges=len(ig), clean=ig.attrs["clean"], corrupted=ig.attrs["corrupted"])
    rng = np.random.default_rng(0)
    top = list(ig["abs_score"].sort_values(ascending=False).index[:args.top])
    rest = [i for i in ig.index if i not in set(top)]
    chosen = top + list(rng.choice(rest, size=min(args.random, len(rest)), replace=False))
    cpu = time.process_time()
    base = edge_patching(model, clean, corrupted, [], metric, run="corrupted")
    exact = np.array([edge_patching(model, clean, corrupted, [(ig.at[i, "upstream"], ig.at[i, "downstream"])],
                                    metric, run="corrupted") - base for i in chosen])
    out["exact_cpu_s_per_edge"] = (time.process_time() - cpu) / len(chosen)
    for name, frame in (("eap_ig", ig), ("eap", eap)):
        est = frame.loc[chosen, "score"].to_numpy()
        out[f"spearman_{name}_top"] = float(spearmanr(est[:len(top)], exact[:len(top)])[0])
        out[f"spearman_{name}_all"] = float(spearmanr(est, exact)[0])
        out[f"abs_error_{name}_median"] = float(np.median(np.abs(est - exact)))
    cpu = time.process_time()
    curve = faithfulness(model, clean, corrupted, metric, ig, sizes=args.sizes, n_random=args.n_random_circuits)
    out["faithfulness_cpu_s"] = time.process_time() - cpu
    out["curve"] = curve.round(4).to_dict("records")
    out.update({k: curve.attrs[k] for k in ("cpr", "cmd", "cpr_random", "cmd_random")})
    circuit = ig.loc[ig["abs_score"].sort_values(ascending=False).index[:args.sizes[-1]]]
    out["top_k_edges"] = [f"{u} -> {d}" for u, d in zip(circuit["upstream"], circuit["downstream"])
                          if d.endswith(".k")][:10]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
