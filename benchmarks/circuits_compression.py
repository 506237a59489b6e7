"""What streaming or pruning heads cuts from a task's circuit (issue 49): ``compression_table`` on a real model.

For each task (IOI, induction, the needle task): an EAP-IG circuit of ``--edges`` edges (``select_circuit``); head
sets of a fixed share of the heads that can stream (``streamable_heads``: all of SmolLM2's, Gemma 3's global layers'),
taken in three orders: the retrieval order (the head atlas's retrieval score, lowest first), DuoAttention-style gates
(``streaming_gates`` fitted with the same sink and window, lowest gate first) and random orders (``--draws`` seeds);
each set streamed (``--sink``, ``--window``) and pruned (zero-ablated). Per row: the circuit's edges cut, the
faithfulness the circuit keeps without them, the task metric with the compression applied. Prints one JSON line per
task (CPU seconds of this process, load average, date) and a markdown table at the end.

    OMP_NUM_THREADS=1 python benchmarks/circuits_compression.py --model smollm2 --atlas notebooks/atlas/smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import pandas as pd
import torch
from scipy.stats import spearmanr

import interp
from analyses import (compression_table, edge_attribution, induction_task, ioi_task, needle_task, select_circuit)
from analyses.long.streaming import streaming_order
from analyses.long.streaming_gates import streaming_gates
from interp.streaming import KVHeadsNote, streamable_heads


def _retrieval(path: str) -> pd.DataFrame:
    """The atlas's retrieval score per head, as ``streaming_order`` takes a score table."""
    with open(path) as f:
        atlas = json.load(f)
    return pd.DataFrame([{"layer": h["layer"], "head": h["head"], "retrieval": h["values"]["retrieval"]["value"]}
                         for h in atlas["heads"]])


def _task(model, name: str, n: int, length: int, needle_length: int):
    if name == "ioi":
        return ioi_task(model, n=n)
    if name == "induction":
        return induction_task(model, n=n, length=length)
    return needle_task(model, needle_length)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--atlas", required=True, help="a saved atlas JSON with the retrieval score of every head")
    p.add_argument("--tasks", nargs="+", default=["ioi", "induction", "needle"])
    p.add_argument("--n", type=int, default=4, help="IOI and induction prompts")
    p.add_argument("--length", type=int, default=12, help="induction: tokens per copy")
    p.add_argument("--needle-length", type=int, default=256)
    p.add_argument("--edges", type=int, default=300)
    p.add_argument("--steps", type=int, default=5, help="EAP-IG steps")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--gate-steps", type=int, default=30)
    p.add_argument("--gate-tokens", type=int, default=64)
    p.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5])
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--bootstrap", type=int, default=200)
    p.add_argument("--reprint", default=None, help="print the tables again from a saved output of this script")
    a = p.parse_args()
    if a.reprint:
        with open(a.reprint) as f:
            lines = [json.loads(line) for line in f if line.startswith('{"task"')]
        tables = [pd.DataFrame(line["rows"]) for line in lines]
        _markdown(pd.concat(tables), None)
        return
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", KVHeadsNote)
    info = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg(),
            "threads": torch.get_num_threads(), "command": " ".join(sys.argv)}
    print(json.dumps(info), flush=True)
    model = interp.load_model(a.model, attn="flash")
    heads = streamable_heads(model)
    t = time.process_time()
    gates = streaming_gates(model, sink=a.sink, window=a.window, steps=a.gate_steps, tokens=a.gate_tokens)
    print(json.dumps({"gates_cpu_s": round(time.process_time() - t, 1), "loss_start": gates.attrs["loss_start"],
                      "loss_end": gates.attrs["loss_end"], "mean_gate": float(gates["gate"].mean())}), flush=True)
    orders = {"retrieval": streaming_order(model, order=_retrieval(a.atlas)),
              "gates": streaming_order(model, order=gates)}
    orders.update({f"random{s}": streaming_order(model, order="random", seed=s) for s in range(a.draws)})
    sets = {}
    for f in a.fractions:
        k = round(f * len(heads))
        sets.update({f"{name}@{f:g}": order[:k] for name, order in orders.items()})
    tables = []
    for task in a.tasks:
        t = time.process_time()
        clean, corrupted, metric = _task(model, task, a.n, a.length, a.needle_length)
        scores = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=a.steps)
        circuit = select_circuit(model, scores, edges=a.edges)
        df = compression_table(model, clean, corrupted, metric, circuit, sets, sink=a.sink, window=a.window,
                               n_bootstrap=a.bootstrap)
        df.insert(0, "task", task)
        tables.append(df)
        print(json.dumps({"task": task, "cpu_s": round(time.process_time() - t, 1), "load": os.getloadavg(),
                          **{k: v for k, v in df.attrs.items()}, "rows": df.to_dict("records")}), flush=True)
    _markdown(pd.concat(tables), len(heads))


def _markdown(df: pd.DataFrame, n_heads: int) -> None:
    """One row per (task, method, share): the retrieval order, the gates, and the random draws' mean [min, max]."""
    df = df.copy()
    df["order"], df["share"] = zip(*[(s.split("@")[0], s.split("@")[1]) for s in df["set"]])
    df["order"] = df["order"].str.replace(r"random\d+", "random", regex=True)
    print(f"\n| task | method | share (heads{'' if n_heads is None else f' of {n_heads}'}) | order | edges cut / n | partial | faithfulness kept "
          "[95%; random: min, max of the draws] (whole circuit) | metric kept [random: min, max] |")
    print("|---|---|---|---|---|---|---|---|")
    for (task, method, share, order), g in df.groupby(["task", "method", "share", "order"], sort=False):
        cut, part = g["edges_cut"], g["edges_partial"]
        if len(g) == 1:
            r = g.iloc[0]
            cells = (f"{r.edges_cut} / {r.edges}", f"{r.edges_partial}",
                     f"{r.kept:.3f} [{r.kept_lo:.3f}, {r.kept_hi:.3f}] ({r.faithfulness:.3f})", f"{r.metric_kept:.3f}")
        else:
            cells = (f"{cut.mean():.0f} [{cut.min()}, {cut.max()}] / {g.edges.iloc[0]}", f"{part.mean():.0f}",
                     f"{g.kept.mean():.3f} [{g.kept.min():.3f}, {g.kept.max():.3f}] ({g.faithfulness.iloc[0]:.3f})",
                     f"{g.metric_kept.mean():.3f} [{g.metric_kept.min():.3f}, {g.metric_kept.max():.3f}]")
        print(f"| {task} | {method} | {share} ({g.heads.iloc[0]}) | {order} | " + " | ".join(cells) + " |")
    print("\n| task | method | Spearman over head sets: faithfulness kept vs metric kept | edges cut vs metric kept |")
    print("|---|---|---|---|")
    for (task, method), g in df.groupby(["task", "method"], sort=False):
        kept, cut = spearmanr(g["kept"], g["metric_kept"])[0], spearmanr(g["edges_cut"], g["metric_kept"])[0]
        print(f"| {task} | {method} | {kept:.2f} | {cut:.2f} |")


if __name__ == "__main__":
    main()
