"""The IOI activation-patching scan (every head's z, one head at a time, logit difference) in our toolkit against
the same scan written the way a user of each peer writes it, all in one process, interleaved:

- plain hooks: the HF model (its default attention), a forward pre-hook on each layer's ``o_proj`` that puts the
  clean run's slice of one head into its input, one forward per head;
- TransformerLens 4.3's bridge (``TransformerBridge.boot_transformers`` in compatibility mode) and its own
  ``patching.generic_activation_patch`` with ``layer_head_vector_patch_setter`` on ``hook_z``, one forward per head;
- nnsight 0.8.1: ``LanguageModel.trace`` editing ``o_proj.input`` in place, one trace per head.

Each scan includes its clean run. The prompts are the rows of ``ioi_task`` that need no padding (TransformerLens's
patching runs without an attention mask), so every tool computes the same thing, and the values must agree (the
largest difference from ours is printed). The peers live in a virtualenv of their own that sees this interpreter's
torch and transformers (``tests.test_transformers_compat.inner_venv``), created on first use under
``~/.cache/interp/bench-peers``; the script then runs itself there. Run through ``bench_patching.py --peers``:

    python benchmarks/bench_patching.py --peers --threads 1 --n 8 --rounds 2
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TQDM_DISABLE", "1")  # TransformerLens's patching bar (read when tqdm is imported)
PEERS = ("transformer-lens==4.3.0", "nnsight==0.8.1")


def venv_python() -> str:
    """The peers' virtualenv (made and filled with pip on first use); returns its python."""
    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "interp" / "bench-peers"
    python = home / "venv" / "bin" / "python"
    if not (home / "ready").exists():
        sys.path.insert(0, str(ROOT))
        from tests.test_transformers_compat import inner_venv

        print(f"# making the peers' virtualenv in {home} (pip install {' '.join(PEERS)})", file=sys.stderr)
        python = Path(inner_venv(home / "venv"))
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *PEERS], check=True)
        (home / "ready").write_text(" ".join(PEERS) + "\n")
    return str(python)


def run_in_venv(argv: list[str]) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([venv_python(), __file__, *argv], env=env).returncode


def _task(ours, n: int):
    """``n`` IOI prompts of ``ioi_task`` that need no padding (clean and corrupted), and their metric."""
    from analyses import ioi_task

    clean, corrupted, metric = ioi_task(ours, n=8 * n)
    full = (clean["attention_mask"].bool().all(1) & corrupted["attention_mask"].bool().all(1)).nonzero().flatten()
    if len(full) < n:
        raise SystemExit(f"only {len(full)} unpadded IOI prompts of {8 * n}; ask for fewer (--n).")
    rows = full[:n]
    return clean["input_ids"][rows], corrupted["input_ids"][rows], metric.rows(rows)


def _scans(ours, folder: str, clean, corrupted, metric):
    """name -> a function of the heads running the whole scan (clean run included), returning the metric per head."""
    import pandas as pd
    import torch
    from nnsight import LanguageModel
    from transformer_lens import patching
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from analyses import activation_patching

    batch = {"input_ids": corrupted, "attention_mask": None}
    value = lambda logits: float(metric(type("Output", (), {"logits": logits})(), batch))  # noqa: E731
    d = ours.cfg.d_head
    tokenizer = AutoTokenizer.from_pretrained(folder)

    plain = AutoModelForCausalLM.from_pretrained(folder).eval()

    def plain_hooks(heads):
        o_proj = [layer.self_attn.o_proj for layer in plain.model.layers]
        source = {}
        handles = [o.register_forward_pre_hook(lambda m, args, l=l: source.__setitem__(l, args[0].detach()))
                   for l, o in enumerate(o_proj)]
        with torch.no_grad():
            plain(clean)
        for handle in handles:
            handle.remove()
        values = []
        for l, h in heads:
            def patch(module, args, l=l, h=h):
                x = args[0].clone()
                x[..., h * d:(h + 1) * d] = source[l][..., h * d:(h + 1) * d]
                return (x,)

            handle = o_proj[l].register_forward_pre_hook(patch)
            with torch.no_grad():
                values.append(value(plain(corrupted).logits))
            handle.remove()
        return values

    bridge = TransformerBridge.boot_transformers(folder, hf_model=AutoModelForCausalLM.from_pretrained(folder),
                                                 tokenizer=tokenizer, device="cpu")
    bridge.enable_compatibility_mode(disable_warnings=True)

    def transformer_lens(heads):
        with torch.no_grad():
            _, cache = bridge.run_with_cache(clean, names_filter=lambda name: name.endswith("attn.hook_z"))
            index = pd.DataFrame(heads, columns=["layer", "head"])
            return patching.generic_activation_patch(bridge, corrupted, cache, value, activation_name="z",
                                                     patch_setter=patching.layer_head_vector_patch_setter,
                                                     index_df=index).tolist()

    lm = LanguageModel(AutoModelForCausalLM.from_pretrained(folder).eval(), tokenizer=tokenizer)

    def nnsight(heads):
        layers, source = lm.model.layers, {}  # (a dict filled inside the trace: nnsight runs its body apart)
        with torch.no_grad():
            with lm.trace(clean):
                for l in range(len(layers)):
                    source[l] = layers[l].self_attn.o_proj.input.save()
            values = []
            for l, h in heads:
                with lm.trace(corrupted):
                    x = layers[l].self_attn.o_proj.input
                    x[:, :, h * d:(h + 1) * d] = source[l][:, :, h * d:(h + 1) * d]
                    logits = lm.lm_head.output.save()
                values.append(value(logits))
        return values

    def interp_scan(heads):
        return activation_patching(ours, clean, corrupted, metric, heads=heads)["metric"].tolist()

    return {"interp": interp_scan, "plain hooks": plain_hooks, "TransformerLens bridge": transformer_lens,
            "nnsight": nnsight}


def main(argv=None) -> int:
    import argparse

    import numpy as np
    import torch

    import interp

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--n", type=int, default=8, help="IOI prompts")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each tool once per round)")
    p.add_argument("--layer-step", type=int, default=1, help="scan every k-th layer's heads (1: every head)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    interp.set_threads(args.threads)
    ours = interp.load_model(args.model, device="cpu")
    clean, corrupted, metric = _task(ours, args.n)
    heads = [(l, h) for l in range(0, ours.cfg.n_layers, args.layer_step) for h in range(ours.cfg.n_heads)]
    scans = _scans(ours, ours.hf.name_or_path, clean, corrupted, metric)
    for scan in scans.values():  # warm-up: one head each
        scan(heads[-1:])
    times, cpu = {name: [] for name in scans}, {name: [] for name in scans}
    values = {}
    load = [os.getloadavg()[0]]
    for r in range(args.rounds):
        order = list(scans)[r % len(scans):] + list(scans)[:r % len(scans)]  # a different tool first each round
        for name in order:
            t0, c0 = time.perf_counter(), time.process_time()
            values[name] = scans[name](heads)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            load.append(os.getloadavg()[0])
            print(f"#   round {r + 1}: {name} {times[name][-1]:.1f} s, {cpu[name][-1]:.1f} CPU s", file=sys.stderr,
                  flush=True)
    import transformers
    print(f"# IOI activation-patching scan: {args.model}, {args.n} prompts x {clean.shape[1]} tokens, {len(heads)} "
          f"heads (z, all positions), one process, {args.rounds} interleaved rounds, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, "
          f"1-min load {min(load):.2f}-{max(load):.2f}")
    median = {name: float(np.median(t)) for name, t in times.items()}
    median_cpu = {name: float(np.median(t)) for name, t in cpu.items()}
    print("| scan | wall s (median) | CPU s (median) | wall s per head | rounds: wall / CPU s | max abs diff from ours "
          "| ours faster by: wall, CPU |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for name, t in median.items():
        diff = float(np.max(np.abs(np.array(values[name]) - np.array(values["interp"]))))
        runs = ", ".join(f"{x:.1f} / {c:.1f}" for x, c in zip(times[name], cpu[name]))
        print(f"| {name} | {t:.1f} | {median_cpu[name]:.1f} | {t / len(heads):.3f} | {runs} | {diff:.1e} | "
              f"{t / median['interp']:.2f}x, {median_cpu[name] / median_cpu['interp']:.2f}x |")
    for what, table in (("wall", median), ("CPU", median_cpu)):
        t, name = min((t, name) for name, t in table.items() if name != "interp")
        print(f"ours against the fastest peer by {what} time ({name}): {t / table['interp']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
