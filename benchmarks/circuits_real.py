"""EAP and EAP-IG against exact edge patching on a real model's task, the circuits' faithfulness, and the heads they
contain beside the head atlas's labels (issue 48).

For a task (IOI or induction): every edge scored by EAP and by EAP-IG; the exact effect of making each edge alone
clean in the corrupted run (``edge_effects``: ``edge_patching(..., run="corrupted")`` minus the corrupted run) for
the top edges by EAP-IG's |score| and for random other edges; Spearman of each estimate against the exact effects;
the faithfulness curve of EAP-IG's circuits with CPR/CMD beside random circuits of the same sizes; the upstream heads
of the top edges into key inputs, with the atlas's label of each (``--atlas``: a saved ``build_atlas`` JSON).
Prints one JSON line (CPU seconds of this process, the load average, the date).

    OMP_NUM_THREADS=1 python benchmarks/circuits_real.py --model smollm2 --task ioi --n 8 --top 300 --random 100 \\
        --atlas notebooks/atlas/smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from scipy.stats import spearmanr

import interp
from analyses import (edge_attribution, edge_effects, faithfulness, induction_task, ioi_task, refine_circuit,
                      select_circuit)


def _labels(path: str | None) -> dict[str, str]:
    """``{"blocks.L.attn:H": classes}`` from a saved atlas (its ``labels`` column, or the label), or ``{}``."""
    if not path:
        return {}
    with open(path) as f:
        atlas = json.load(f)
    return {f"{h['site']}:{h['head']}": h.get("labels") or h["label"] for h in atlas["heads"]}


def _heads_of(frame) -> list[str]:
    return sorted({u for u in frame["upstream"] if ":" in u} | {f"{s}:{h}" for s, h, i in
                   zip(frame["down_site"], frame["down_head"], frame["input"]) if i == "q"})


def _saturation(name: str, inputs) -> dict[tuple[str, int], float]:
    """``{(site, query head): mean over rows of the largest attention weight}`` in the run of ``inputs`` (the corrupted
    prompts, where EAP takes its gradient), over the rows that see at least 4 real keys (a row with one key is 1.0
    whatever the softmax does); an eager copy of the model gives the patterns."""
    model = interp.load_model(name, attn="eager")
    batch = inputs if isinstance(inputs, dict) else {"input_ids": inputs}
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    rows = (mask.cumsum(1) >= 4) & mask.bool()  # (b, p)
    names = [f"{s.name}.hook_pattern" for s in model.cfg.sites]
    with torch.no_grad():
        _, cache = model.run_with_cache(batch["input_ids"], names=names, attention_mask=mask)
    out = {}
    for site, name in zip(model.cfg.sites, names):
        top = cache[name].amax(-1)  # (b, h, q)
        for h in range(site.n_heads):
            out[(site.name, h)] = float(top[:, h][rows].mean())
    return out


def _saturated_split(model, frames, chosen, exact, saturation, high: float, low: float) -> dict:
    """EAP-IG against EAP on the q and k edges of ``chosen`` whose receiver's softmax saturates (mean largest weight
    >= ``high``; a k input: the mean over the query heads of its group) and on those where it does not (< ``low``)."""
    ig = frames["eap_ig"]
    level = []
    for i in chosen:
        site, head, which = ig.at[i, "down_site"], int(ig.at[i, "down_head"]), ig.at[i, "input"]
        if which == "q":
            level.append(saturation[(site, head)])
        elif which == "k":
            s = model.sites[site]
            group = s.n_heads // s.n_kv_heads
            level.append(float(np.mean([saturation[(site, h)] for h in range(head * group, (head + 1) * group)])))
        else:
            level.append(float("nan"))
    level = np.array(level)
    out = {}
    for part, keep in (("saturated", level >= high), ("soft", level < low)):
        out[f"{part}_edges"] = int(keep.sum())
        for name, frame in frames.items():
            est = frame.loc[chosen, "score"].to_numpy()[keep]
            if keep.sum() >= 3:
                out[f"{part}_spearman_{name}"] = float(spearmanr(est, exact[keep])[0])
                out[f"{part}_abs_error_{name}_median"] = float(np.median(np.abs(est - exact[keep])))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--task", choices=["ioi", "induction"], default="ioi")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--length", type=int, default=8, help="induction: tokens per copy")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=300)
    p.add_argument("--random", type=int, default=100)
    p.add_argument("--sizes", type=int, nargs="+", default=[25, 50, 100, 200, 400])
    p.add_argument("--n-random-circuits", type=int, default=3)
    p.add_argument("--refine", type=int, default=0, help="also refine_circuit at this size (0: not)")
    p.add_argument("--atlas", default=None, help="a saved atlas JSON whose labels the circuit's heads are read with")
    p.add_argument("--saturation", type=float, nargs=2, default=None, metavar=("HIGH", "LOW"),
                   help="also split the q/k edges by their receiver's largest attention weight in the corrupted run "
                        "(>= HIGH: saturated; < LOW: soft) and compare EAP-IG with EAP on each")
    p.add_argument("--skip-curve", action="store_true", help="no faithfulness curve (the estimates only)")
    args = p.parse_args()
    torch.set_num_threads(1)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": os.getloadavg(),
           "threads": torch.get_num_threads(), **vars(args)}
    model = interp.load_model(args.model)
    clean, corrupted, metric = (ioi_task(model, n=args.n) if args.task == "ioi"
                                else induction_task(model, n=args.n, length=args.length))
    out["tokens"] = list((clean["input_ids"] if isinstance(clean, dict) else clean).shape)
    cpu = time.process_time()
    eap = edge_attribution(model, clean, corrupted, metric, method="eap")
    out["eap_cpu_s"] = time.process_time() - cpu
    cpu = time.process_time()
    ig = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=args.steps)
    out["eap_ig_cpu_s"] = time.process_time() - cpu
    out.update(edges=len(ig), clean=float(ig.attrs["clean"]), corrupted=float(ig.attrs["corrupted"]))
    rng = np.random.default_rng(0)
    top = list(ig["abs_score"].sort_values(ascending=False, kind="stable").index[:args.top])
    rest = np.setdiff1d(ig.index.to_numpy(), top)
    chosen = top + list(rng.choice(rest, size=min(args.random, len(rest)), replace=False))
    cpu = time.process_time()
    exact = edge_effects(model, clean, corrupted, ig.loc[chosen], metric)
    out["exact_cpu_s"], out["exact_block_fraction"] = time.process_time() - cpu, exact.attrs["block_fraction"]
    exact = exact["effect"].to_numpy()
    for name, frame in (("eap_ig", ig), ("eap", eap)):
        est = frame.loc[chosen, "score"].to_numpy()
        for part, sl in (("top", slice(0, len(top))), ("random", slice(len(top), None)), ("all", slice(None))):
            out[f"spearman_{name}_{part}"] = float(spearmanr(est[sl], exact[sl])[0])
        out[f"abs_error_{name}_median_top"] = float(np.median(np.abs(est[:len(top)] - exact[:len(top)])))
    if args.saturation:
        out["saturation"] = _saturated_split(model, {"eap_ig": ig, "eap": eap}, chosen, exact,
                                             _saturation(args.model, corrupted), *args.saturation)
    out["exact_top10"] = [[ig.at[i, "upstream"], ig.at[i, "downstream"], round(float(e), 4),
                           round(float(ig.at[i, "score"]), 4), round(float(eap.at[i, "score"]), 4)]
                          for i, e in zip(chosen[:10], exact[:10])]
    if args.skip_curve:
        out["load_after"] = os.getloadavg()
        print(json.dumps(out))
        return
    cpu = time.process_time()
    curve = faithfulness(model, clean, corrupted, metric, ig, sizes=args.sizes, n_random=args.n_random_circuits)
    out["faithfulness_cpu_s"] = time.process_time() - cpu
    out["curve"] = curve.round(4).to_dict("records")
    out.update({k: curve.attrs[k] for k in ("cpr", "cmd", "cpr_random", "cmd_random", "forwards_per_point",
                                            "circuits_per_forward")})
    if args.refine:
        cpu = time.process_time()
        refined = faithfulness(model, clean, corrupted, metric, ig, sizes=[args.refine], n_random=0, refine=True)
        out["refined"] = refined.round(4).to_dict("records")
        out["refine_cpu_s"] = time.process_time() - cpu
    labels = _labels(args.atlas)
    into_k = ig[ig["input"] == "k"].sort_values("abs_score", ascending=False, kind="stable").head(10)
    out["top_k_edges"] = [[u, d, round(float(s), 4), labels.get(u, "")]
                          for u, d, s in zip(into_k["upstream"], into_k["downstream"], into_k["score"])]
    if labels:
        prev = {h for h, l in labels.items() if "previous_token" in l}
        senders = [u for u in into_k["upstream"] if ":" in u]
        out["top_k_senders_previous_token"] = f"{sum(u in prev for u in senders)}/{len(senders)}"
        out["previous_token_heads_in_atlas"] = f"{len(prev)}/{len(labels)}"
        for n in (args.sizes[0], args.sizes[min(2, len(args.sizes) - 1)]):
            heads = _heads_of(select_circuit(model, ig, edges=n))
            out[f"circuit_{n}_heads"] = {h: labels.get(h, "") for h in heads}
    out["load_after"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
