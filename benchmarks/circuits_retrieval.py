"""Which upstream heads feed the retrieval heads at long context (issue 49, item 4): EAP on the needle task, the
retrieval heads' incoming edges against QK attribution's leaders, and the top edges' exact effects against random
edges into the same inputs.

1. ``edge_attribution(model, clean, corrupted, metric, method="eap")`` on ``needle_task(model, length)`` (flash path,
   O(n) per layer): every edge scored.
2. The retrieval heads' incoming edges (their q, and their key/value head's k and v): the five senders EAP ranks
   first by ``|score|`` into the k inputs (and into the q inputs) against QK attribution's five largest key-side
   (and query-side) components (``qk_attribution`` on the answer rows' top-1 keys, no causal check): the overlap.
3. Exact effects: each of the ``--exact`` top edges into those inputs, and as many random edges into the same inputs,
   made clean alone in the corrupted run. An edge ``u -> r`` is patched as ``edge_patching`` defines it (r's reading
   of the stream gets ``u``'s clean output minus its corrupted one, through r's own norm and columns:
   ``analyses.circuits.graph.reading``), by one hook on r's projection, so a patched run holds one forward's
   memory at any length (``edge_patching`` keeps every node's output of both runs; at 8,192 tokens on SmolLM2 that
   is 10 GiB). With ``--check`` the first edge is also patched by ``edge_effects`` (short prompts only).

Memory: the growth of the process's peak resident size during EAP over the resident size before it
(``eap_grew_mib``), the peak then (``eap_peak_mib``) and the peak of the whole run (``peak_mib``), from
``benchmarks/peak.py``.

    OMP_NUM_THREADS=1 python benchmarks/circuits_retrieval.py --model smollm2 --length 8192
    OMP_NUM_THREADS=1 python benchmarks/circuits_retrieval.py --model toy-induction --heads 1.1 1.3 --length 64 --check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
from peak import grown_mib, reset_peak, status_bytes  # benchmarks/peak.py, beside this script

import interp
from analyses import edge_attribution, edge_effects, needle_task, qk_attribution
from analyses.causal.engine import _run, kept_logits
from analyses.causal.patching import paired_batches, scalar_metric
from analyses.circuits.graph import node_of, node_readers, reading, receiver_of
from analyses.circuits.patching import node_hook, node_output
from interp.runtime.progress import progress, stage

RETRIEVAL = {"smollm2": ["18.6", "18.7", "20.6"], "gemma3": ["5.1", "11.2"]}


def _node_name(model, row) -> str:
    """QK attribution's component as a graph node name (None for biases)."""
    if row["component"] == "head":
        return f"{row['source_site']}:{int(row['source_head'])}"
    if row["component"] == "mlp":
        return f"mlp.{int(row['source_layer'])}"
    return "input" if row["component"] in ("embed", "pos_embed") else None


def _patched_metric(model, batch, metric, keep, delta, receiver) -> float:
    """The run of ``batch`` in which ``receiver`` reads the stream plus ``delta``, through its own norm and columns."""
    read = reading(model, receiver)
    grabbed = {}

    def grab(module, args):
        grabbed["x"] = args[0]

    def put(module, args, out):
        x = grabbed["x"] + delta.to(grabbed["x"].dtype)
        out = out.clone()
        out[..., read.cols] = read.compute(x if read.norm is None else read.norm(x))
        return out

    handles = [read.grab.register_forward_pre_hook(grab), read.module.register_forward_hook(put)]
    try:
        with torch.no_grad():
            return float(metric(_run(model, batch, **keep), batch))
    finally:
        for h in handles:
            h.remove()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--heads", nargs="+", default=None, help="retrieval heads as layer.head (default: the model's)")
    p.add_argument("--exact", type=int, default=5, help="top edges (and as many random ones) patched exactly")
    p.add_argument("--check", action="store_true", help="also patch the first edge with edge_effects")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = interp.load_model(args.model)
    heads = [tuple(int(x) for x in h.split(".")) for h in (args.heads or RETRIEVAL[args.model])]
    clean, corrupted, metric = needle_task(model, args.length)
    metric = scalar_metric(metric)
    start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    before, cpu = reset_peak(), time.process_time()
    eap = edge_attribution(model, clean, corrupted, metric, method="eap")
    eap_cpu, eap_grew, eap_peak = time.process_time() - cpu, grown_mib(before), status_bytes("VmHWM") / 2**20
    sites = {h: model.cfg.sites[h[0]] for h in heads}
    group = {h: h[1] // (sites[h].n_heads // sites[h].n_kv_heads) for h in heads}
    inputs = {h: {"q": f"{sites[h].name}:{h[1]}.q", "k": f"{sites[h].name}:{group[h]}.k",
                  "v": f"{sites[h].name}:{group[h]}.v"} for h in heads}
    answer = metric._span() if hasattr(metric, "_span") else None
    rows = list(range(answer[0], answer[1])) if answer else [-1]
    cpu = time.process_time()
    qk = qk_attribution(model, clean, heads, pairs="top1", queries=rows, causal=False)
    qk_cpu = time.process_time() - cpu
    report = {"model": args.model, "length": args.length, "start": start, "threads": torch.get_num_threads(),
              "eap_cpu_s": eap_cpu, "eap_grew_mib": eap_grew, "eap_peak_mib": eap_peak, "qk_cpu_s": qk_cpu,
              "metric": {k: eap.attrs[k] for k in ("clean", "corrupted")},
              "heads": {}}
    for h in heads:
        mine = qk[(qk["layer"] == h[0]) & (qk["head"] == h[1])]
        entry = {}
        for side, which in (("key", "k"), ("query", "q")):
            ranked = mine.dropna(subset=[side]).assign(a=lambda d: d[side].abs()).sort_values("a", ascending=False)
            qk_top = [n for n in (_node_name(model, r) for _, r in ranked.iterrows()) if n][:5]
            into = eap[eap["downstream"] == inputs[h][which]].sort_values("abs_score", ascending=False)
            eap_top = list(into["upstream"].head(5))
            entry[which] = {"eap_top5": eap_top, "qk_top5": qk_top, "overlap": len(set(eap_top) & set(qk_top))}
        report["heads"][f"{h[0]}.{h[1]}"] = entry
    # exact effects: top edges into the retrieval heads' inputs against random edges into the same inputs
    receivers = sorted({r for h in heads for r in inputs[h].values()})
    into = eap[eap["downstream"].isin(receivers)]
    top = into.sort_values("abs_score", ascending=False).head(args.exact)
    rest = into.drop(top.index)
    rnd = rest.loc[random.Random(args.seed).sample(list(rest.index), min(args.exact, len(rest)))]
    chosen = [("top", r) for _, r in top.iterrows()] + [("random", r) for _, r in rnd.iterrows()]
    clean_b, corrupted_b = paired_batches(model, clean, corrupted)
    keep = kept_logits(model, metric, corrupted_b)
    senders = sorted({node_of(model, r["upstream"]) for _, r in chosen})
    read = node_readers(model)
    names = sorted({node_hook(u) for u in senders})
    cpu = time.process_time()
    with model.studying(), torch.no_grad():
        with stage(f"the {len(senders)} senders' outputs in both runs"):
            outputs = {}
            for which, batch in (("clean", clean_b), ("corrupted", corrupted_b)):
                out, cache = model.run_with_cache(batch["input_ids"], names=names, **keep)
                store = {n: read[n](cache[n]) if n in read else cache[n] for n in names}
                outputs[which] = {u: node_output(store, u) for u in senders}
                if which == "corrupted":
                    base = float(metric(out, corrupted_b))
                del out, cache, store
        found = []
        for kind, r in progress(chosen, desc="exact edges", unit="forward"):
            u = node_of(model, r["upstream"])
            delta = outputs["clean"][u] - outputs["corrupted"][u]
            effect = _patched_metric(model, corrupted_b, metric, keep, delta, receiver_of(model, r["downstream"])) - base
            found.append({"kind": kind, "edge": f"{r['upstream']} -> {r['downstream']}", "eap": float(r["score"]),
                          "exact": effect})
    report["exact_cpu_s"] = time.process_time() - cpu
    report["exact"] = found
    if args.check:
        check = edge_effects(model, clean, corrupted, [(chosen[0][1]["upstream"], chosen[0][1]["downstream"])], metric)
        report["check"] = {"edge_effects": float(check["effect"].iloc[0]), "by_hook": found[0]["exact"]}
    for kind in ("top", "random"):
        values = [abs(f["exact"]) for f in found if f["kind"] == kind]
        report[f"mean_abs_exact_{kind}"] = sum(values) / max(1, len(values))
    report["peak_mib"] = status_bytes("VmHWM") / 2**20  # since the reset before EAP: EAP, QK attribution, patching
    report["load"] = os.getloadavg()
    report["end"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
