"""Streaming heads against NVIDIA kvpress on the same needle prompts and the same head sets: KV-cache bytes actually
held, peak RSS, prefill and decode-step time and needle accuracy.

Conditions, each (condition, length) in a fresh process, interleaved (every condition at one length, then the next):

- ``full``: plain HF sdpa attention and its ``DynamicCache`` (kvpress's environment, no press);
- ``kvpress duo``: kvpress's ``DuoAttentionPress`` told our head set (its ``streaming_mask``: the key/value heads
  that stream; sink 4, recent 256 as ours). Its own patterns come from the DuoAttention repository or BookSum over
  the network (``load_attention_pattern``, ``duo_attention_on_the_fly``), which this machine cannot reach, and the
  point is the same heads on both sides;
- ``kvpress snapkv``: ``SnapKVPress`` (window 64) at the same KV budget as our head set, the press that suits a needle
  task best of kvpress's others: it keeps, per key/value head, the keys the prompt's last 64 queries (the question)
  attend to, so it can keep the needle where a fixed window cannot (StreamingLLM's press is our streaming heads
  applied to every head). On Gemma 3 it compresses the global layers only, as kvpress does for Gemma 3's multimodal
  class; its ratio there is set so that it holds as many entries as ours;
- ``ours``: ``interp.stream_heads`` with its ``StreamingCache`` (our flash path).

Head sets: ``retrieval``: every key/value head that serves one of the model's retrieval heads (``retrieval_heads``,
the heads above 0.1 in notebooks/long_context.md, or ``--retrieval-heads``) keeps full attention, every other one
that can stream streams; ``gates``: the ``--gate-share`` of key/value heads with the lowest
DuoAttention-style gates (``analyses.long.streaming_gates``, 40 steps, cached under ``~/.cache/interp-bench``) stream.

Needle accuracy: the share of the needle's tokens greedy decoding reproduces in place (``needle_prompts``, seed 1,
depths 0.1 / 0.5 / 0.9). KV bytes: what the cache's tensors hold after the last prompt's decoding. Peak: the growth
of the child's peak RSS over its RSS after loading and a warm-up (``/proc/self/clear_refs``; glibc's mmap threshold
fixed at 128 KiB in every child, as in bench_streaming.py). Times: CPU time (one thread) of the prefill and of a
decoding step, averaged over prompts and steps.

kvpress 0.5.5 pins ``transformers<5.3``, so it runs in a virtualenv of its own, created on first use (``python -m
venv``, then ``pip install torch==<this torch> kvpress==0.5.5``) under ``$INTERP_BENCH_VENV``, else
``~/.cache/interp-bench/kvpress-venv``; it reads the HF folders our bundled models are converted to.

    OMP_NUM_THREADS=1 python benchmarks/bench_vs_kvpress.py           # SmolLM2 at 2k, 4k, 8k; Gemma 3 at 2k, 4k
    OMP_NUM_THREADS=1 python benchmarks/bench_vs_kvpress.py --quick   # both models at 2k
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from peak import grown_mib, reset_peak, status_bytes  # benchmarks/peak.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("INTERP_BENCH_VENV", Path.home() / ".cache" / "interp-bench" / "kvpress-venv"))
KVPRESS = "0.5.5"
SINK, WINDOW = 4, 256
RETRIEVAL = {"smollm2": "18.7 20.6 18.6 23.2 17.3 18.8 20.3 21.8 22.7", "gemma3": "5.1 11.2 5.0"}
QUIET = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1",
         "MALLOC_MMAP_THRESHOLD_": "131072"}


# -- the environment ---------------------------------------------------------------------------------------------
def ensure_venv() -> Path:
    """The kvpress virtualenv's python, created on first use; exits with the reason where kvpress cannot be had."""
    import torch

    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"creating {VENV} (python -m venv; pip install torch=={torch.__version__.split('+')[0]} "
              f"kvpress=={KVPRESS}): a few minutes", flush=True)
        VENV.parent.mkdir(parents=True, exist_ok=True)
        steps = [[sys.executable, "-m", "venv", str(VENV)],
                 [str(python), "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}",
                  f"kvpress=={KVPRESS}"]]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"kvpress could not be installed: `{' '.join(step)}` failed:\n{done.stderr[-2000:]}")
    done = subprocess.run([str(python), "-c", "import kvpress, transformers, torch; print(transformers.__version__, "
                           "torch.__version__)"], capture_output=True, text=True, env={**os.environ, **QUIET})
    if done.returncode != 0:
        raise SystemExit(f"kvpress is not importable in {VENV} (delete the folder to rebuild it):\n"
                         f"{done.stderr[-2000:]}")
    print(f"kvpress {KVPRESS} in {VENV}: transformers {done.stdout.split()[0]}, torch {done.stdout.split()[1]}",
          flush=True)
    return python


# -- what a child runs (both environments: nothing here imports our package) -------------------------------------
def _cache_bytes(cache) -> int:
    """The bytes of the key/value tensors a transformers cache holds (a StreamingCache's streamed parts included)."""
    names = ("keys", "values", "stream_keys", "stream_values")
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (getattr(layer, n, None) for n in names)
               if t is not None and hasattr(t, "numel"))


def _needles(hf, prompts, new_cache, prefill_context):
    """Prefill each prompt into a fresh cache (inside ``prefill_context()``), decode the needle's length greedily.
    Returns per-prompt accuracy, the mean prefill and decode-step CPU seconds, and the last cache's bytes."""
    import torch

    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    acc, prefill, steps, kv = [], [], [], 0
    for p in prompts:
        ids, answer = torch.tensor(p["ids"]), torch.tensor(p["ids"][p["needle"][0]:p["needle"][1]])
        cache = new_cache()
        with torch.no_grad():
            t = time.process_time()
            with prefill_context():
                out = hf(input_ids=ids[None], use_cache=True, logits_to_keep=1, **{name: cache})
            prefill.append(time.process_time() - t)
            generated = []
            for _ in range(len(answer)):
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                generated.append(int(token))
                t = time.process_time()
                out = hf(input_ids=token, use_cache=True, logits_to_keep=1, **{name: cache})
                steps.append(time.process_time() - t)
        acc.append(float((torch.tensor(generated) == answer).float().mean()))
        kv = _cache_bytes(cache)
    return acc, sum(prefill) / len(prefill), sum(steps) / len(steps), kv


def _measure(run) -> dict:
    before = reset_peak()
    start = time.perf_counter()
    acc, prefill, step, kv = run()
    return {"accuracy": acc, "prefill_cpu_s": prefill, "step_cpu_ms": step * 1e3, "kv_mib": kv / 2**20,
            "grew_mib": grown_mib(before), "peak_mib": status_bytes("VmHWM") / 2**20,
            "seconds": time.perf_counter() - start}


def child_kvpress(spec: dict) -> dict:
    """full / kvpress duo / kvpress snapkv in kvpress's environment."""
    from contextlib import nullcontext

    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    import kvpress

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    hf = AutoModelForCausalLM.from_pretrained(spec["folder"], dtype=torch.float32, attn_implementation="sdpa").eval()
    layers = hf.model.layers
    sliding = [bool(getattr(layer.self_attn, "is_sliding", False)) for layer in layers]

    class GivenHeads(kvpress.DuoAttentionPress):
        """DuoAttentionPress with the streaming key/value heads given (its patterns are fetched over the network)."""

        def post_init_from_model(self, model):
            self.sink_size, self.recent_size = spec["sink"], spec["window"]
            self.streaming_mask = torch.zeros(len(layers), hf.config.num_key_value_heads, dtype=torch.bool)
            for l, g in spec["stream_kv"]:
                self.streaming_mask[l, g] = True

    class GlobalSnapKV(kvpress.SnapKVPress):
        """SnapKV on the full-attention layers only (kvpress does the same for Gemma 3's multimodal class)."""

        def forward_hook(self, module, input, kwargs, output):
            return output if sliding[module.layer_idx] else super().forward_hook(module, input, kwargs, output)

    press = {"full": None, "kvpress duo": GivenHeads() if spec["condition"] == "kvpress duo" else None,
             "kvpress snapkv": GlobalSnapKV(compression_ratio=spec["snap_ratio"], window_size=64)
             if spec["condition"] == "kvpress snapkv" else None}[spec["condition"]]
    prompts = json.loads(Path(spec["prompts"]).read_text())
    with torch.no_grad():
        hf(input_ids=torch.tensor(prompts[0]["ids"][:16])[None], use_cache=False, logits_to_keep=1)
    return _measure(lambda: _needles(hf, prompts, lambda: DynamicCache(config=hf.config),
                                     (lambda: press(hf)) if press is not None else nullcontext))


def child_ours(spec: dict) -> dict:
    """Our streaming heads and StreamingCache, in the project's environment."""
    from contextlib import nullcontext

    import torch

    import interp

    interp.set_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = interp.load_model(spec["model"], attn="flash")
    prompts = json.loads(Path(spec["prompts"]).read_text())
    heads = [tuple(h) for h in spec["stream_heads"]]
    with torch.no_grad():
        model.hf(input_ids=torch.tensor(prompts[0]["ids"][:16])[None], use_cache=False, logits_to_keep=1)
    with interp.stream_heads(model, heads, sink=spec["sink"], window=spec["window"]) as s:
        return _measure(lambda: _needles(model.hf, prompts, s.new_cache, nullcontext))


# -- the parent --------------------------------------------------------------------------------------------------
def head_sets(model, name: str, retrieval: list[tuple[int, int]], gate_share: float, gate_steps: int,
              wanted=("retrieval", "gates")) -> dict:
    """{set name: the key/value heads (layer, kv head) that stream}, for the ``wanted`` sets (Gemma 3's gates are
    fitted on its global layers' key/value heads, the ones that can stream)."""
    from interp.streaming import streamable_heads

    cfg = model.cfg
    group = {l: cfg.heads_per_layer[l] // cfg.kv_heads_per_layer[l] for l in range(cfg.n_layers)}
    kv = sorted({(l, h // group[l]) for l, h in streamable_heads(model)})
    keep = {(l, h // group[l]) for l, h in retrieval}
    sets = {"retrieval": [g for g in kv if g not in keep]} if "retrieval" in wanted else {}
    if "gates" in wanted:
        import pandas as pd

        path = VENV.parent / f"gates-{name}-steps{gate_steps}.csv"
        if not path.exists():
            from analyses.long.streaming_gates import streaming_gates

            print(f"gates: streaming_gates({name}, sink {SINK}, window {WINDOW}, steps {gate_steps}), cached in "
                  f"{path}; SmolLM2 about 10 minutes on one thread", flush=True)
            df = streaming_gates(model, sink=SINK, window=WINDOW, steps=gate_steps)
            df[["layer", "head", "kv_head", "gate"]].to_csv(path, index=False)
        gates = pd.read_csv(path).groupby(["layer", "kv_head"]).gate.first().sort_values(kind="stable")
        sets["gates"] = sorted((int(l), int(g)) for l, g in list(gates.index)[: round(gate_share * len(gates))])
    return sets


def _spec(model, name, condition, stream_kv, n, prompt_file) -> dict:
    """What one child needs: the streaming query heads (ours), key/value heads (duo) and SnapKV's ratio on the
    layers it compresses, set so that it holds what our StreamingCache holds on those layers."""
    from interp.model.bundled import bundled_folder
    from interp.streaming.heads import layer_windows

    cfg = model.cfg
    group = {l: cfg.heads_per_layer[l] // cfg.kv_heads_per_layer[l] for l in range(cfg.n_layers)}
    full_layers = [l for l, w in enumerate(layer_windows(model)) if w is None]
    everything = sum(cfg.kv_heads_per_layer[l] for l in full_layers) * n
    kept = everything - len(stream_kv) * (n - min(n, SINK + WINDOW))
    return {"model": name, "folder": str(bundled_folder(name)), "condition": condition, "prompts": prompt_file,
            "sink": SINK, "window": WINDOW, "stream_kv": [list(g) for g in stream_kv],
            "stream_heads": [[l, g * group[l] + i] for l, g in stream_kv for i in range(group[l])],
            "snap_ratio": 1 - kept / everything}


def _spawn(python: str, spec: dict, tmp: Path) -> dict:
    file = tmp / "spec.json"
    file.write_text(json.dumps(spec))
    env = {**os.environ, **QUIET, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", "1")}
    if python == sys.executable:
        env["PYTHONPATH"] = str(ROOT)
    else:
        env.pop("PYTHONPATH", None)  # kvpress's environment must not see our package or its transformers
    done = subprocess.run([python, str(Path(__file__).resolve()), "--child", str(file)], capture_output=True, text=True, env=env, cwd=tmp)
    if done.returncode != 0:
        raise RuntimeError(f"{spec['model']} {spec['condition']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_model(name: str, lengths: list[int], depths: list[float], args, python: Path, tmp: Path) -> list[dict]:
    import interp
    from analyses.data.needles import needle_prompts

    model = interp.load_model(name, attn="flash")
    retrieval = [tuple(int(x) for x in h.split(".")) for h in (args.retrieval_heads or RETRIEVAL[name].split())]
    sets = head_sets(model, name, retrieval, args.gate_share, args.gate_steps, args.sets)
    print(f"{name}: retrieval heads {' '.join('%d.%d' % h for h in retrieval)}; key/value heads streaming: "
          + "; ".join(f"{s} {len(kv)}" for s, kv in sets.items()), flush=True)
    plan = {}
    for n in lengths:
        file = tmp / f"{name}-{n}.json"
        file.write_text(json.dumps([{"ids": p.ids.tolist(), "needle": list(p.needle)}
                                    for p in needle_prompts(model, [n], depths, seed=1)]))
        plan[n] = [_spec(model, name, "full", [], n, str(file))]
        plan[n] += [{**_spec(model, name, c, kv, n, str(file)), "set": s} for s, kv in sets.items()
                    for c in ("kvpress duo", "kvpress snapkv", "ours")]
    del model
    rows = []
    for n in lengths:
        for spec in plan[n]:
            here = spec["condition"] == "ours"
            row = {**_spawn(sys.executable if here else str(python), spec, tmp), "model": name, "n": n,
                   "condition": spec["condition"], "set": spec.get("set", ""), "streaming_kv": len(spec["stream_kv"]),
                   "snap_ratio": spec["snap_ratio"] if spec["condition"] == "kvpress snapkv" else None}
            rows.append(row)
            print(f"  {name} {n:>6} {row['condition']:<15} {row['set']:<9} acc {_mean(row['accuracy']):.2f} "
                  f"KV {row['kv_mib']:7.1f} MiB  grew {row['grew_mib']:7.1f}  peak {row['peak_mib']:7.1f} MiB  "
                  f"prefill {row['prefill_cpu_s']:6.1f} s  step {row['step_cpu_ms']:6.1f} ms", flush=True)
    return rows


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def report(rows: list[dict]) -> list[str]:
    lines = ["| model | tokens | condition | heads streaming (set) | needle accuracy (per depth) | KV MiB held | "
             "x full | peak growth MiB | x full | prefill CPU s | decode step CPU ms | x full |", "|" + "---|" * 12]
    for r in rows:
        full = next(f for f in rows if f["model"] == r["model"] and f["n"] == r["n"] and f["condition"] == "full")
        heads = f"{r['streaming_kv']} kv ({r['set']})" if r["set"] else "none"
        if r["snap_ratio"] is not None:
            heads += f", ratio {r['snap_ratio']:.2f}"
        lines.append(f"| {r['model']} | {r['n']:,} | {r['condition']} | {heads} | {_mean(r['accuracy']):.2f} "
                     f"({' '.join(f'{a:.2f}' for a in r['accuracy'])}) | {r['kv_mib']:.1f} | "
                     f"{r['kv_mib'] / full['kv_mib']:.2f} | {r['grew_mib']:.0f} | {r['grew_mib'] / full['grew_mib']:.2f} | "
                     f"{r['prefill_cpu_s']:.1f} | {r['step_cpu_ms']:.1f} | {r['step_cpu_ms'] / full['step_cpu_ms']:.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="2,048 tokens only, both models")
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"], choices=["smollm2", "gemma3"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192], help="SmolLM2's")
    parser.add_argument("--gemma-lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    parser.add_argument("--retrieval-heads", nargs="+", help="layer.head (one model only)")
    parser.add_argument("--sets", nargs="+", default=["retrieval", "gates"], choices=["retrieval", "gates"],
                        help="head sets (gates: fitted once per model, SmolLM2 about 10 minutes, then cached)")
    parser.add_argument("--gate-share", type=float, default=0.75, help="share of key/value heads streaming (gates)")
    parser.add_argument("--gate-steps", type=int, default=40)
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    if args.child:
        spec = json.loads(Path(args.child).read_text())
        print(json.dumps(child_ours(spec) if spec["condition"] == "ours" else child_kvpress(spec)))
        return
    if args.retrieval_heads and len(args.models) != 1:
        parser.error("--retrieval-heads names one model's heads: give --models with one model")
    if args.quick:
        args.lengths, args.gemma_lengths = [2048], [2048]
    load = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; fp32; "
          f"cpu count {os.cpu_count()}; load average at start {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)
    python = ensure_venv()
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            lengths = args.lengths if name == "smollm2" else args.gemma_lengths
            rows += run_model(name, lengths, args.depths, args, python, Path(tmp))
    print("\n".join(report(rows)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    load = os.getloadavg()
    print(f"{time.strftime('%H:%M %Z')}; load average at end {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")


if __name__ == "__main__":
    main()
