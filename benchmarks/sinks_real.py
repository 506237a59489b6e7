"""Sinks, dormant heads and massive activations on a bundled model (issue 50): the generated parts of notebooks/sinks.md.

Run (one model per process, 1 thread), which saves the results as JSON:

    OMP_NUM_THREADS=1 python benchmarks/sinks_real.py run --model smollm2 --save /tmp/sinks_smollm2.json

then write each model's generated section into the notebook (between its ``<!-- sinks_real MODEL -->`` markers):

    python benchmarks/sinks_real.py write /tmp/sinks_smollm2.json /tmp/sinks_gemma3.json --notebook notebooks/sinks.md

What ``run`` measures: ``sink_heads`` (the sink weight, the sink's share of the output, ``dormant``) on 32 corpus
prompts; ``massive_activations`` and ``massive_dims_ablation`` (the massive dims set to their median at the first
token, against random dims); the dormant threshold's sweep (``sink_value_ablation`` at each threshold: the dormant
set against as many other sink heads, 10 draws); ``detect_heads`` read on the weights and on norm-weighted attention,
and every head whose labels differ.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import time

import torch

SWEEP = (0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5)  # dormant thresholds tried against random sink heads


def _timed(out: dict, name: str, fn):
    start = time.process_time()
    value = fn()
    out.setdefault("cpu_s", {})[name] = round(time.process_time() - start, 1)
    return value


def _row(df, condition: str, column: str) -> list[float]:
    r = df.set_index("condition").loc[condition]
    return [float(r[column]), float(r[f"{column}_lo"]), float(r[f"{column}_hi"])]


def run(model_name: str, n_prompts: int, n_random: int, check_prompts: int) -> dict:
    import interp
    from analyses import detect_heads, massive_activations, massive_dims_ablation, sink_heads, sink_value_ablation

    torch.set_num_threads(1)
    out = {"model": model_name, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "threads": torch.get_num_threads(),
           "load_before": open("/proc/loadavg").read().split()[:3]}
    model = interp.load_model(model_name)
    sinks = _timed(out, "sink_heads", lambda: sink_heads(model, n_prompts=n_prompts, n_bootstrap=200))
    sink = sinks[sinks.is_sink]
    out["n_heads"], out["n_sink"] = len(sinks), len(sink)
    q = (0.1, 0.25, 0.5, 0.75, 0.9)
    out["quantiles"] = {col: [round(float(sink[col].quantile(x)), 3) for x in q]
                        for col in ("sink_weight", "sink_output", "dormant", "sink_value_ratio")}
    out["sinks"] = sink[["layer", "head", "sink_weight", "sink_output", "sink_value_ratio", "dormant", "dormant_lo",
                         "dormant_hi"]].round(4).to_dict("records")
    sweep = []
    for t in SWEEP:
        chosen = sinks.assign(is_dormant=sinks.is_sink & (sinks.dormant >= t))
        n_dormant, n_pool = int(chosen.is_dormant.sum()), int((chosen.is_sink & ~chosen.is_dormant).sum())
        entry = {"threshold": t, "n_dormant": n_dormant, "n_pool": n_pool}
        if n_dormant and n_pool >= n_dormant:
            df = _timed(out, f"sink_value_ablation {t}", lambda: sink_value_ablation(
                model, chosen, n_prompts=check_prompts, n_random=n_random, n_bootstrap=1000))
            draws = df[df.condition.str.startswith("random ")]
            entry.update(dormant=_row(df, "dormant", "delta_loss"), random=_row(df, "random", "delta_loss"),
                         draws=[round(float(x), 4) for x in draws.delta_loss],
                         heads=df.set_index("condition").loc["dormant", "what"])
            entry["draws_above"] = int((draws.delta_loss.abs() > abs(entry["dormant"][0])).sum())
        sweep.append(entry)
    out["sweep"] = sweep
    massive = _timed(out, "massive_activations", lambda: massive_activations(model))
    out["massive"] = massive.drop(columns=["median_abs"]).round(3).to_dict("records")
    dims = _timed(out, "massive_dims_ablation", lambda: massive_dims_ablation(
        model, sinks, massive, n_prompts=check_prompts, n_random=n_random, n_bootstrap=1000))
    draws = dims[dims.condition.str.startswith("random ")]
    out["dims_ablation"] = {"massive": _row(dims, "massive", "sink_drop"), "random": _row(dims, "random", "sink_drop"),
                            "draws": [round(float(x), 4) for x in draws.sink_drop],
                            "random_dims": [w for w in draws.what], "dims": dims.set_index("condition").loc[
                                "massive", "what"], "sink_weight": dims.attrs["sink_weight"],
                            "n_heads": len(dims.attrs["heads"]), "edited_from": dims.attrs["edited_from"]}
    raw = _timed(out, "detect_heads raw", lambda: detect_heads(model, n_prompts=n_prompts, n_bootstrap=200))
    norm = _timed(out, "detect_heads norm", lambda: detect_heads(model, n_prompts=n_prompts, n_bootstrap=200,
                                                                  weighting="norm"))
    scores = [c for c in raw.columns if c in norm.columns and f"{c}_lo" in raw.columns]
    changed = []
    for (_, a), (_, b) in zip(raw.iterrows(), norm.iterrows()):
        if a["labels"] != b["labels"]:
            moved = {c: [round(float(a[c]), 3), round(float(b[c]), 3)] for c in scores
                     if abs(float(a[c]) - float(b[c])) >= 0.05}
            changed.append({"head": f"{int(a['layer'])}.{int(a['head'])}", "raw": a["labels"], "norm": b["labels"],
                            "moved": moved})
    out["label_changes"], out["n_prompts"] = changed, n_prompts
    out["load_after"] = open("/proc/loadavg").read().split()[:3]
    return out


# -- the notebook's generated sections ---------------------------------------------------------------------------
def _interval(v: list[float], digits: int = 3) -> str:
    return f"{v[0]:+.{digits}f} [{v[1]:+.{digits}f}, {v[2]:+.{digits}f}]"


def section(r: dict) -> str:
    lines = [f"Generated by `benchmarks/sinks_real.py` ({r['date']}, {r['machine']}, {r['threads']} thread, load "
             f"average {' '.join(r['load_before'])} before and {' '.join(r['load_after'])} after; CPU seconds: "
             + ", ".join(f"{k} {v}" for k, v in r["cpu_s"].items()) + ").", ""]
    qs = r["quantiles"]
    lines += [f"**Sink heads**: {r['n_sink']} of {r['n_heads']} heads put at least the sink threshold on the first "
              f"token ({r['n_prompts']} corpus prompts). Over those sink heads, at 10/25/50/75/90%:", "",
              "| | 10% | 25% | 50% | 75% | 90% |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| `{k}` | " + " | ".join(f"{x:.3f}" for x in v) + " |" for k, v in qs.items()]
    lines += ["", "**The dormant threshold, swept against the causal check** (zero the first token's value in the heads "
              "at or above the threshold, and in as many other sink heads drawn 10 times: the change in next-token "
              "loss, 95% over prompts; `draws above`: random draws whose |change| exceeds the dormant set's):", "",
              "| threshold | dormant heads | other sink heads | dormant set | random sets, pooled | draws above | "
              "random draws |", "|---:|---:|---:|---|---|---:|---|"]
    for s in r["sweep"]:
        if "dormant" not in s:
            lines.append(f"| {s['threshold']:g} | {s['n_dormant']} | {s['n_pool']} | not testable (needs at least "
                         f"one dormant head and as many others) | | | |")
            continue
        lines.append(f"| {s['threshold']:g} | {s['n_dormant']} | {s['n_pool']} | {_interval(s['dormant'])} | "
                     f"{_interval(s['random'])} | {s['draws_above']} of {len(s['draws'])} | "
                     + ", ".join(f"{x:+.3f}" for x in s["draws"]) + " |")
    lines += ["", "**Massive activations** (Sun et al.: > 100 and > 1,000x the layer's median |x|), first and last "
              "layer of each dim:", "", "| dim | layer | max abs | ratio to median | tokens | positions | first "
              "block | writer |", "|---:|---:|---:|---:|---:|---|---:|---|"]
    for dim in sorted({m["dim"] for m in r["massive"]}):
        rows = [m for m in r["massive"] if m["dim"] == dim]
        for m in (rows[0], rows[-1]) if len(rows) > 1 else rows:
            lines.append(f"| {dim} | {m['layer']} | {m['max_abs']:,.0f} | {m['ratio']:,.0f} | {m['n_tokens']} | "
                         f"{m['positions']} | {m['first_layer']} | {m['writer']} |")
    d = r["dims_ablation"]
    lines += ["", f"**Removing the massive dims** (dims {d['dims']} set to their median at each prompt's first token "
              f"after every block from {d['edited_from']} on): the drop in the mean weight the {d['n_heads']} sink "
              f"heads after block {d['edited_from']} put on the first token (without edits {d['sink_weight']:.3f}): "
              f"**{_interval(d['massive'], 4)}**; as many random other dims, 10 draws: {_interval(d['random'], 4)} "
              "pooled (draws " + ", ".join(f"{x:+.4f}" for x in d["draws"]) + ").", ""]
    changes = r["label_changes"]
    lines += [f"**Labels that change when read on norm-weighted attention** (`detect_heads(model, n_prompts="
              f"{r['n_prompts']})` against the same with `weighting=\"norm\"`): {len(changes)} of {r['n_heads']} "
              "heads. Transitions:", ""]
    counts: dict[tuple, int] = {}
    for c in changes:
        counts[(c["raw"], c["norm"])] = counts.get((c["raw"], c["norm"]), 0) + 1
    lines += ["| weights | norm-weighted | heads |", "|---|---|---:|"]
    lines += [f"| {a or 'none'} | {b or 'none'} | {n} |" for (a, b), n in sorted(counts.items(), key=lambda x: -x[1])]
    lines += ["", "<details><summary>every head whose labels change, with the scores that moved by 0.05 or more "
              "(weights -> norm-weighted)</summary>", "", "| head | weights | norm-weighted | scores moved |",
              "|---|---|---|---|"]
    lines += [f"| {c['head']} | {c['raw'] or 'none'} | {c['norm'] or 'none'} | " + ", ".join(
        f"{k} {a:.2f} -> {b:.2f}" for k, (a, b) in c["moved"].items()) + " |" for c in changes]
    lines += ["", "</details>"]
    return "\n".join(lines)


def write(paths: list[str], notebook: str) -> None:
    text = open(notebook).read()
    for path in paths:
        r = json.load(open(path))
        begin, end = f"<!-- sinks_real {r['model']}: begin -->", f"<!-- sinks_real {r['model']}: end -->"
        if begin not in text:
            raise SystemExit(f"{notebook} has no {begin} marker; add the two markers where the section goes.")
        text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: f"{begin}\n{section(r)}\n{end}", text,
                      flags=re.S)
    open(notebook, "w").write(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", default="smollm2")
    r.add_argument("--save", required=True)
    r.add_argument("--n-prompts", type=int, default=32)
    r.add_argument("--check-prompts", type=int, default=8)
    r.add_argument("--n-random", type=int, default=10)
    w = sub.add_parser("write")
    w.add_argument("results", nargs="+")
    w.add_argument("--notebook", default="notebooks/sinks.md")
    args = p.parse_args()
    if args.verb == "run":
        out = run(args.model, args.n_prompts, args.n_random, args.check_prompts)
        with open(args.save, "w") as f:
            json.dump(out, f, indent=1)
    else:
        write(args.results, args.notebook)


if __name__ == "__main__":
    main()
