"""Our EAP-IG against its reference implementation (hannamw/EAP-IG), side by side on the same model, prompts and steps:
the Spearman between the two edge rankings, CPU time and peak memory (issue 49).

The model: SmolLM2-135M (our bundled GGUF, converted to an HF folder by ``interp.load_model``): EAP-IG reads
TransformerLens models, and TransformerLens's ``from_pretrained`` needs the model hub, so its child builds the
``HookedTransformer`` offline from that same folder: a ``HookedTransformerConfig`` with the fields TransformerLens's own
Llama conversion sets (``loading_from_pretrained.py``, ``LlamaForCausalLM``; ``rotary_base`` from the folder's
``rope_parameters``), and the weights through TransformerLens's ``convert_llama_weights``, unfolded and uncentred so
the computation is HF's. Its logits on the clean prompts are checked against ours before anything is compared.

The prompts: ``ioi_task(model, n)``'s prompts that need no padding (EAP-IG pads on the right and reads
``input_lengths``; ours pads on the left: with no padding both read the same tokens at the same positions), or
``induction_task`` (no padding). The metric: the logit difference at the last position (IOI) or the second copy's loss
(induction), each example's summed by EAP-IG and divided by its count (``attribute`` divides by the examples), averaged
by ours: the same scale.

What differs by construction, and how it is reconciled (never by changing their code's arithmetic):

- EAP-IG's grouped-query attention is ungrouped (``ungroup_grouped_query_attention``: a k and v input per query
  head); ours keeps the key/value head's one input. The gradient with respect to a shared input is the sum over the
  query heads that read it, so their k/v scores are summed over each group before comparing.
- Its scores are ``(corrupted - clean) . grad``, ours ``(clean - corrupted) . grad`` at the same interpolation points
  (``alpha = k / steps``, ``k = 0 .. steps - 1``, from the corrupted embeddings towards the clean): theirs are negated.
- It allocates its score matrix on ``"cuda"`` by name; on a machine without CUDA the child maps that one allocation
  to the CPU (``torch.zeros(..., device="cuda")`` in ``eap.attribute``), nothing else.

Each side runs in a fresh process (ours in this interpreter, EAP-IG in a virtualenv of its own with the
TransformerLens it needs, as ``bench_vs_kvpress.py`` does kvpress), interleaved ``--repeats`` times; a side's CPU time
is that of the attribution call (one thread), its peak the growth of the process's peak RSS over its RSS after loading
(``/proc/self/clear_refs``).

The virtualenv: ``$INTERP_BENCH_EAPIG_VENV``, else ``~/.cache/interp-bench/eapig-venv``, created on first use with
``torch==<this torch>``, ``transformer-lens==2.16.1``, ``transformers<5``, ``datasets<3``, ``pyarrow<17`` (numpy 1, which that TransformerLens pins), matplotlib, and EAP-IG
from ``--eap-ig DIR`` (a checkout of https://github.com/hannamw/EAP-IG; it is not on the package registry).

    OMP_NUM_THREADS=1 python benchmarks/bench_vs_eapig.py --eap-ig /path/to/EAP-IG --task ioi --n 32 --steps 5
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

from peak import grown_mib, reset_peak  # benchmarks/peak.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("INTERP_BENCH_EAPIG_VENV", Path.home() / ".cache" / "interp-bench" / "eapig-venv"))
PINS = ["transformer-lens==2.16.1", "transformers<5", "datasets<3", "pyarrow<17", "matplotlib"]
QUIET = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1",
         "TOKENIZERS_PARALLELISM": "false"}


# -- the environment ---------------------------------------------------------------------------------------------
def ensure_venv(eap_ig: Path | None) -> Path:
    """The EAP-IG virtualenv's python, created on first use; exits with the reason where it cannot be had."""
    import torch

    python = VENV / "bin" / "python"
    if not python.exists():
        if eap_ig is None or not (eap_ig / "src" / "eap" / "attribute.py").exists():
            raise SystemExit(f"{VENV} does not exist yet: give --eap-ig DIR, a checkout of hannamw/EAP-IG (the folder "
                             f"with src/eap/attribute.py); got {eap_ig}.")
        print(f"creating {VENV} (python -m venv; pip install torch {' '.join(PINS)} and EAP-IG): a few minutes",
              flush=True)
        VENV.parent.mkdir(parents=True, exist_ok=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        steps = [[sys.executable, "-m", "venv", str(VENV)],
                 [*pip, f"torch=={torch.__version__.split('+')[0]}", *PINS],
                 [*pip, "--no-deps", str(eap_ig)]]
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"EAP-IG's environment could not be built: `{' '.join(step)}` failed:\n"
                                 f"{done.stderr[-2000:]}")
    done = subprocess.run([str(python), "-c", "import eap.attribute, transformer_lens, transformers, torch; "
                           "from importlib.metadata import version; print(version('transformer-lens'), "
                           "transformers.__version__, torch.__version__)"],
                          capture_output=True, text=True, env={**os.environ, **QUIET})
    if done.returncode != 0:
        raise SystemExit(f"EAP-IG is not importable in {VENV} (delete the folder to rebuild it):\n"
                         f"{done.stderr[-2000:]}")
    tl, tf, pt = done.stdout.split()
    print(f"EAP-IG in {VENV}: transformer-lens {tl}, transformers {tf}, torch {pt}", flush=True)
    return python


# -- what a child runs (both environments: nothing at module level imports our package) --------------------------
def _measured(run):
    """``run()``'s result, its CPU seconds and the growth of peak RSS over the RSS before it (MiB)."""
    before = reset_peak()
    cpu = time.process_time()
    result = run()
    return result, time.process_time() - cpu, grown_mib(before)


def _metric_value(torch, logits, spec, per_example: bool = False):
    """The task's metric from logits ``(b, p, vocab)``: IOI's logit difference at the last position, or the
    induction second copy's mean next-token loss; summed over the batch unless ``per_example``."""
    if spec["task"] == "ioi":
        last = logits[:, -1].float()
        rows = torch.arange(last.shape[0])
        value = last[rows, torch.tensor(spec["correct"])] - last[rows, torch.tensor(spec["wrong"])]
    else:
        start, stop = spec["span"]
        tokens = torch.tensor(spec["clean"])
        logp = logits[:, start:stop].float().log_softmax(-1)
        value = -logp.gather(-1, tokens[:, start + 1:stop + 1, None])[..., 0].mean(-1)
    return value if per_example else value.sum()


def child_eapig(spec: dict) -> dict:
    import torch
    import transformers
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_llama_weights

    import eap.attribute as attribute_module
    from eap.attribute import attribute
    from eap.graph import Graph

    folder = Path(spec["folder"])
    raw = json.loads((folder / "config.json").read_text())
    theta = raw.get("rope_parameters", {}).get("rope_theta", raw.get("rope_theta", 10000.0))
    hf_cfg = transformers.LlamaConfig.from_pretrained(folder, rope_theta=theta)
    hf = transformers.LlamaForCausalLM.from_pretrained(folder, config=hf_cfg, torch_dtype=torch.float32)
    c = hf.config
    cfg = HookedTransformerConfig(
        d_model=c.hidden_size, d_head=c.hidden_size // c.num_attention_heads, n_heads=c.num_attention_heads,
        d_mlp=c.intermediate_size, n_layers=c.num_hidden_layers, n_ctx=min(c.max_position_embeddings, 2048),
        eps=c.rms_norm_eps, d_vocab=c.vocab_size, act_fn=c.hidden_act,
        n_key_value_heads=c.num_key_value_heads if c.num_key_value_heads != c.num_attention_heads else None,
        normalization_type="RMS", positional_embedding_type="rotary", rotary_adjacent_pairs=False,
        rotary_dim=c.hidden_size // c.num_attention_heads, rotary_base=theta, final_rms=True, gated_mlp=True,
        original_architecture="LlamaForCausalLM", dtype=torch.float32, device="cpu", default_prepend_bos=False)
    model = HookedTransformer(cfg)
    model.load_and_process_state_dict(convert_llama_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                      center_unembed=False, fold_value_biases=False,
                                      refactor_factored_attn_matrices=False)
    del hf
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    model.cfg.use_split_qkv_input = True
    model.cfg.use_attn_result = True
    model.cfg.use_hook_mlp_in = True
    model.cfg.ungroup_grouped_query_attention = True

    clean, corrupted = torch.tensor(spec["clean"]), torch.tensor(spec["corrupted"])
    with torch.no_grad():
        logits_clean = model(clean)
    metric_clean = _metric_value(torch, logits_clean, spec, per_example=True)

    def tokenize(model, inputs, max_length=None):  # the prompts arrive as token ids: no tokenizer, no padding
        tokens = torch.tensor(inputs)
        mask = torch.ones_like(tokens)
        return tokens, mask, mask.sum(1), tokens.shape[1]

    class _CPU:  # eap.attribute allocates its score matrix on "cuda" by name; that one allocation goes to the CPU
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*args, device=None, **kwargs):
            return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)

    attribute_module.tokenize_plus = tokenize
    attribute_module.torch = _CPU()

    def metric(logits, clean_logits, input_lengths, label):
        return _metric_value(torch, logits, spec)

    graph = Graph.from_model(model)
    batch = [(spec["clean"], spec["corrupted"], None)]
    _, cpu, grew = _measured(lambda: attribute(model, graph, batch, metric, method="EAP-IG-inputs",
                                               ig_steps=spec["steps"], quiet=True))
    scores = {name: float(edge.score) for name, edge in graph.edges.items()}
    return {"side": "eapig", "cpu_s": cpu, "grew_mib": grew, "metric_clean": metric_clean.tolist(),
            "group": cfg.n_heads // (cfg.n_key_value_heads or cfg.n_heads), "n_layers": cfg.n_layers,
            "scores": scores}


def child_ours(spec: dict) -> dict:
    import torch

    import interp
    from analyses import edge_attribution
    from analyses.data.metrics import logit_difference, next_token_loss

    model = interp.load_model(spec["model"], attn=spec["attention"])
    clean, corrupted = torch.tensor(spec["clean"]), torch.tensor(spec["corrupted"])
    if spec["task"] == "ioi":
        metric = logit_difference(spec["correct"], spec["wrong"])
    else:
        metric = next_token_loss(clean, *spec["span"])
    with torch.no_grad():
        logits_clean = model(clean).logits
    metric_clean = _metric_value(torch, logits_clean, spec, per_example=True)
    frame, cpu, grew = _measured(lambda: edge_attribution(model, clean, corrupted, metric, method="eap-ig",
                                                          steps=spec["steps"]))
    keys = zip(frame["up_kind"], frame["up_layer"], frame["up_head"], frame["input"], frame["down_layer"],
               frame["down_head"])
    return {"side": "ours", "cpu_s": cpu, "grew_mib": grew, "metric_clean": metric_clean.tolist(),
            "scores": [[*k, float(s)] for k, s in zip(keys, frame["score"])]}


# -- the comparison ----------------------------------------------------------------------------------------------
def _their_key(name: str, group: int, n_layers: int) -> tuple:
    """EAP-IG's edge name (``a3.h2->a5.h7<k>``, ``input->m0``, ``m4->logits``) as our frame's key ``(up_kind,
    up_layer, up_head, input, down_layer, down_head)``, k/v heads as key/value heads."""
    up, down = name.split("->")
    if up == "input":
        upstream = ("input", -1, -1)
    elif up.startswith("m"):
        upstream = ("mlp", int(up[1:]), -1)
    else:
        layer, head = up[1:].split(".h")
        upstream = ("head", int(layer), int(head))
    if down == "logits":
        return (*upstream, "logits", n_layers, -1)
    if down.startswith("m"):
        return (*upstream, "mlp", int(down[1:]), -1)
    node, which = down[:-1].split("<")
    layer, head = node[1:].split(".h")
    head = int(head) if which == "q" else int(head) // group
    return (*upstream, which, int(layer), head)


def compare(ours: dict, theirs: dict) -> dict:
    import numpy as np
    import pandas as pd

    mine = pd.Series({tuple(row[:6]): row[6] for row in ours["scores"]})
    summed: dict = {}
    for name, score in theirs["scores"].items():
        key = _their_key(name, theirs["group"], theirs["n_layers"])
        summed[key] = summed.get(key, 0.0) - score  # negated: theirs are (corrupted - clean) . grad
    other = pd.Series(summed)
    missing = sorted(set(mine.index) ^ set(other.index))
    if missing:
        raise SystemExit(f"the two graphs do not have the same edges ({len(missing)} differ, e.g. {missing[:3]})")
    other = other[mine.index]
    out = {"edges": len(mine), "spearman_signed": float(mine.corr(other, method="spearman")),
           "spearman_abs": float(mine.abs().corr(other.abs(), method="spearman"))}
    for k in (20, 100, 300):
        a, b = set(mine.abs().nlargest(k).index), set(other.abs().nlargest(k).index)
        out[f"top{k}_overlap"] = len(a & b) / k
    top = mine.abs().nlargest(300).index
    out["spearman_top300_ours"] = float(mine[top].corr(other[top], method="spearman"))
    scale = float(np.abs(mine.to_numpy()).max())
    out["max_abs_diff_over_max_score"] = float(np.abs(mine.to_numpy() - other.to_numpy()).max() / scale)
    out["metric_clean_max_diff"] = float(np.abs(np.array(ours["metric_clean"]) - np.array(theirs["metric_clean"])).max())
    return out


def build_spec(args) -> dict:
    import interp
    from analyses import induction_task, ioi_task
    from interp.model.bundled import bundled_folder

    model = interp.load_model(args.model)
    spec = {"model": args.model, "folder": str(bundled_folder(args.model)), "task": args.task, "steps": args.steps,
            "attention": args.attention}
    if args.task == "ioi":
        clean, corrupted, metric = ioi_task(model, n=args.n)
        full = (clean["attention_mask"].bool().all(1) & corrupted["attention_mask"].bool().all(1)).nonzero()[:, 0]
        if len(full) == 0:
            raise SystemExit("none of ioi_task's prompts is free of padding; raise --n")
        spec.update(clean=clean["input_ids"][full].tolist(), corrupted=corrupted["input_ids"][full].tolist(),
                    correct=metric.correct[full].tolist(), wrong=metric.wrong[full].tolist())
    else:
        clean, corrupted, metric = induction_task(model, n=args.n, length=args.length)
        spec.update(clean=clean.tolist(), corrupted=corrupted.tolist(), span=list(metric._span()))
    spec["prompts"] = len(spec["clean"])
    spec["positions"] = len(spec["clean"][0])
    return spec


def _spawn(python: str, side: str, spec_file: Path, tmp: Path) -> dict:
    env = {**os.environ, **QUIET, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", "1")}
    if side == "ours":
        env["PYTHONPATH"] = str(ROOT)
    else:
        env.pop("PYTHONPATH", None)  # EAP-IG's environment must not see our package or its transformers
    done = subprocess.run([python, str(Path(__file__).resolve()), "--child", side, str(spec_file)],
                          capture_output=True, text=True, env=env, cwd=tmp)
    if done.returncode != 0:
        raise RuntimeError(f"the {side} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--eap-ig", type=Path, default=None, help="a checkout of hannamw/EAP-IG (first run only)")
    p.add_argument("--model", default="smollm2", choices=["smollm2"])
    p.add_argument("--task", choices=["ioi", "induction"], default="ioi")
    p.add_argument("--n", type=int, default=32, help="prompts asked of the task (IOI keeps those with no padding)")
    p.add_argument("--length", type=int, default=12, help="induction: the repeated sequence's length")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--attention", choices=["flash", "eager"], default="flash", help="our attention path")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--child", nargs=2, metavar=("SIDE", "SPEC"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        side, file = args.child
        spec = json.loads(Path(file).read_text())
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        result = child_ours(spec) if side == "ours" else child_eapig(spec)
        print(json.dumps(result))
        return
    python = ensure_venv(args.eap_ig)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}", flush=True)
    spec = build_spec(args)
    print(f"{args.model} {args.task}: {spec['prompts']} prompts of {spec['positions']} tokens, EAP-IG steps "
          f"{args.steps}, our path {args.attention}", flush=True)
    runs = {"ours": [], "eapig": []}
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "spec.json"
        file.write_text(json.dumps(spec))
        for r in range(args.repeats):
            for side, exe in (("ours", sys.executable), ("eapig", str(python))):
                print(f"[{r + 1}/{args.repeats}] {side} ...", flush=True)
                runs[side].append(_spawn(exe, side, file, Path(tmp)))
                print(f"    cpu {runs[side][-1]['cpu_s']:.1f} s, peak growth {runs[side][-1]['grew_mib']:.0f} MiB",
                      flush=True)
    result = compare(runs["ours"][0], runs["eapig"][0])
    for side in runs:
        result[f"{side}_cpu_s"] = [round(x["cpu_s"], 2) for x in runs[side]]
        result[f"{side}_peak_growth_mib"] = [round(x["grew_mib"], 1) for x in runs[side]]
    print(json.dumps({"model": args.model, "task": args.task, "prompts": spec["prompts"],
                      "positions": spec["positions"], "steps": args.steps, "attention": args.attention, **result}))


if __name__ == "__main__":
    main()
