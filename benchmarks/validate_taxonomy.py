"""Causal validation of the head taxonomy (issue 24): for each class, mean-ablate its top heads and, as a control,
the same number of heads drawn at random from the same layers (5 draws), and measure the task the class is named
for; check that top-k sets computed on two disjoint halves of the data overlap; check that the function vector
raises zero-shot accuracy.

    python benchmarks/validate_taxonomy.py --model smollm2            # the bundled SmolLM2-135M
    python benchmarks/validate_taxonomy.py --quick                    # a tiny random model: seconds (tested)

Tasks: successor -> accuracy at predicting the next item of 3 consecutive ordinal items (" Monday Tuesday
Wednesday" -> " Thursday"); copy_suppression -> the logit of the correct token in the second copy of repeated
random tokens (ablating copy suppressors should raise it); name_mover, s_inhibition -> IOI logit difference on
held-out prompts; function_vector -> few-shot accuracy. Intervals: 95% bootstrap over prompts of the mean change.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import interp  # noqa: E402
from analyses.causal.ablation import ablate_heads  # noqa: E402
from analyses.taxonomy.function_vectors import (_mean_z, fv_accuracy, function_vector, function_vector_scores, icl_prompts,  # noqa: E402
                                       icl_tasks, task_accuracy)
from analyses.data.batches import _main_output  # noqa: E402
from analyses.data.bootstrap import mean_interval  # noqa: E402
from analyses.taxonomy.weights import _bundled_lists, copy_suppression_scores, ordinal_lists, successor_scores  # noqa: E402
from analyses.taxonomy.behaviour import copy_suppression_behaviour_scores  # noqa: E402
from analyses.taxonomy.ioi import _ioi, name_mover_scores, s_inhibition_scores  # noqa: E402
from analyses.data.tasks import induction_task  # noqa: E402


def _top(df, column, k, extra=None):
    ranked = df if extra is None or not extra(df).any() else df[extra(df)]  # none qualifies: the top by score
    ranked = ranked.sort_values(column, ascending=False).head(k)
    return [(int(l), int(h)) for l, h in zip(ranked["layer"], ranked["head"])], ranked


def _random_like(model, heads, draws, seed):
    rng = random.Random(seed)
    chosen = set(heads)
    out = []
    for _ in range(draws):
        pick = []
        for layer, _ in heads:
            pool = [(layer, h) for h in range(model.cfg.heads_per_layer[layer]) if (layer, h) not in chosen | set(pick)]
            pick.append(rng.choice(pool) if pool else (layer, 0))
        out.append(pick)
    return out


def _effect(model, per_example, heads, reference):
    """Per-prompt change of the task measure with ``heads`` mean-ablated (mean over ``reference``)."""
    base = per_example()
    with ablate_heads(model, heads, method="mean", reference=reference):
        ablated = per_example()
    return ablated - base, base


def _causal(model, heads, per_example, reference, draws, seed, n_bootstrap=1000):
    delta, base = _effect(model, per_example, heads, reference)
    mean, lo, hi = mean_interval(delta[:, None], n_bootstrap, seed)
    controls = [float(_effect(model, per_example, r, reference)[0].mean()) for r in _random_like(model, heads, draws, seed)]
    return {"baseline": float(base.mean()), "class_delta": float(mean[0]), "class_lo": float(lo[0]),
            "class_hi": float(hi[0]), "random_delta_mean": sum(controls) / len(controls),
            "random_delta_min": min(controls), "random_delta_max": max(controls)}


# -- the tasks ---------------------------------------------------------------------------------------------------
def successor_task(model, n=None):
    """Prompts of 3 consecutive items (with spaces) and the next item's first token, from the bundled lists."""
    tok = model.tokenizer
    texts, answers = [], []
    for items in _bundled_lists().values():
        for i in range(len(items) - 3):
            ids = tok(" " + items[i + 3], add_special_tokens=False)["input_ids"]
            texts.append("".join(" " + x for x in items[i:i + 3]))
            answers.append(ids[0])
    if n is not None:
        texts, answers = texts[:n], answers[:n]
    return model.to_batch(texts), torch.tensor(answers)


def _accuracy(model, batch, answers):
    return lambda: task_accuracy(model, batch, answers)


def _copied_logit(model, clean, start, stop):
    def per_example():
        with model.studying(), torch.no_grad():
            logits = _main_output(model(clean))[:, start - 1:stop - 1].float().cpu()  # predicts clean[start:stop]
        targets = clean[:, start:stop].cpu()
        return logits.gather(-1, targets[..., None])[..., 0].mean(-1).double()
    return per_example


def _logit_diff(model, batch, metric):
    def per_example():
        with model.studying(), torch.no_grad():
            out = model(batch["input_ids"], batch["attention_mask"])
        return metric.per_example(out, batch).double().cpu()
    return per_example


def _overlap(a, b):
    return len(set(a) & set(b)) / max(1, len(a))


def validate(model, classes, k, draws, quick, seed=0):
    results = {}
    n_ioi = 8 if quick else 16
    if "successor" in classes:
        t = time.time()
        lists = ordinal_lists(model)
        names = sorted(lists)
        halves = [{n: lists[n] for n in names[i::2]} for i in (0, 1)]
        full = successor_scores(model)
        tops = [_top(successor_scores(model, lists=h, n_bootstrap=200), "successor", k)[0] for h in halves]
        heads, ranked = _top(full, "successor", k)
        batch, answers = successor_task(model, 16 if quick else None)
        results["successor"] = {"top": ranked, "column": "successor", "stability": _overlap(*tops),
                                "measure": "next-item accuracy",
                                **_causal(model, heads, _accuracy(model, batch, answers), batch, draws, seed),
                                "seconds": time.time() - t}
    if "copy_suppression" in classes:
        t = time.time()
        n = 40 if quick else 200
        full = copy_suppression_scores(model, n_tokens=2 * n)
        g = torch.Generator().manual_seed(seed + 1)
        from analyses.data.prompts import _ordinary_ids

        pool = _ordinary_ids(model)
        sample = pool[torch.randperm(len(pool), generator=g)[:2 * n]]
        tops = [_top(copy_suppression_scores(model, tokens=sample[i::2], n_bootstrap=200), "copy_suppression", k)[0]
                for i in (0, 1)]
        heads, ranked = _top(full, "copy_suppression", k)
        clean, _, _ = induction_task(model, n=8 if quick else 40, length=10 if quick else 25, seed=seed + 2)
        length = 10 if quick else 25
        start = clean.shape[1] - length + 1
        results["copy_suppression"] = {"top": ranked, "column": "copy_suppression", "stability": _overlap(*tops),
                                       "measure": "logit of the repeated token (2nd copy)",
                                       **_causal(model, heads, _copied_logit(model, clean, start, clean.shape[1]),
                                                 clean, draws, seed), "seconds": time.time() - t}
    if "name_mover" in classes or "s_inhibition" in classes:
        tasks = [_ioi(model, n_ioi, s)[:3] for s in (seed, seed + 1)]
        held, _, held_metric = _ioi(model, n_ioi, seed + 2)[:3]
        measure = _logit_diff(model, held, held_metric)
        t = time.time()
        movers = [name_mover_scores(model, task=task, n_bootstrap=200) for task in tasks]
        is_mover = lambda df: df["io_attention"] > 0  # noqa: E731
        heads, ranked = _top(movers[0], "name_mover", k, is_mover)
        if "name_mover" in classes:
            results["name_mover"] = {"top": ranked, "column": "name_mover", "measure": "IOI logit difference",
                                     "stability": _overlap(*(_top(m, "name_mover", k, is_mover)[0] for m in movers)),
                                     **_causal(model, heads, measure, held, draws, seed), "seconds": time.time() - t}
        if "s_inhibition" in classes:
            t = time.time()
            inhibit = [s_inhibition_scores(model, task=task, name_movers=m, n_bootstrap=200)
                       for task, m in zip(tasks, movers)]
            heads, ranked = _top(inhibit[0], "s_inhibition", k)
            results["s_inhibition"] = {"top": ranked, "column": "s_inhibition", "measure": "IOI logit difference",
                                       "receivers": inhibit[0].attrs["receivers"],
                                       "stability": _overlap(*(_top(s, "s_inhibition", k)[0] for s in inhibit)),
                                       **_causal(model, heads, measure, held, draws, seed), "seconds": time.time() - t}
    if "function_vector" in classes:
        t = time.time()
        n_prompts, n_shots = (2, 2) if quick else (4, 5)
        halves = [function_vector_scores(model, tasks=["antonyms"], n_prompts=n_prompts, n_shots=n_shots, seed=s,
                                         n_bootstrap=200) for s in (seed, seed + 1)]
        heads, ranked = _top(halves[0], "function_vector", k)
        fv_heads = _top(halves[0], "function_vector", 10)[0]  # Todd et al.: the top heads are shared across tasks
        layer = model.cfg.n_layers // 3
        steering = {}
        names = ["antonyms"] if quick else list(icl_tasks())
        for name in names:
            clean, _ = icl_prompts(model, icl_tasks()[name], 4 if quick else 16, n_shots, seed)
            vector = function_vector(model, _mean_z(model, clean), fv_heads)
            acc = fv_accuracy(model, icl_tasks()[name], vector, layer, n_prompts=8 if quick else 50, seed=seed + 5)
            steering[name] = {"zero_shot": acc["zero_shot"], "with_fv": acc["with_fv"]}
        batch, answers = icl_prompts(model, icl_tasks()[names[0]], 8 if quick else 40, n_shots, seed + 3)
        results["function_vector"] = {"top": ranked, "column": "function_vector",
                                      "measure": f"{n_shots}-shot accuracy ({names[0]})",
                                      "stability": _overlap(*(_top(h, "function_vector", k)[0] for h in halves)),
                                      "steering": steering, "steering_layer": layer,
                                      **_causal(model, heads, _accuracy(model, batch, answers), batch, draws, seed),
                                      "seconds": time.time() - t}
    if "copy_suppression_behaviour" in classes:
        results["copy_suppression_behaviour"] = behaviour(model, k, draws, quick, seed)
    return results


def behaviour(model, k, draws, quick, seed=0):
    """The behavioural copy-suppression signature (analyses.taxonomy.behaviour) of the top-k weight-based copy
    suppressors, of k heads drawn at random from the same layers (``draws`` sets), and of all heads."""
    t = time.time()
    heads, _ = _top(copy_suppression_scores(model, n_tokens=80 if quick else 400), "copy_suppression", k)
    df = copy_suppression_behaviour_scores(model, n_prompts=8 if quick else 32, seed=seed).set_index(["layer", "head"])
    columns = ["copy_suppression_behaviour", "cs_attends_predicted", "cs_predicted_effect"]

    def mean(rows):
        return {c: float(rows[c].mean()) for c in columns}

    controls = [mean(df.loc[r]) for r in _random_like(model, heads, draws, seed)]
    ranked = df.sort_values("copy_suppression_behaviour", ascending=False).head(k).reset_index()
    return {"kind": "behaviour", "weight_heads": heads, "per_head": df.loc[heads].reset_index().to_dict("records"),
            "weight_heads_mean": mean(df.loc[heads]), "all_heads_mean": mean(df),
            "random_mean": {c: sum(x[c] for x in controls) / len(controls) for c in columns},
            "random_min": {c: min(x[c] for x in controls) for c in columns},
            "random_max": {c: max(x[c] for x in controls) for c in columns},
            "top": ranked, "overlap_with_weights": _overlap(heads, [(int(l), int(h)) for l, h in
                                                                    zip(ranked["layer"], ranked["head"])]),
            "seconds": time.time() - t}


def _print_behaviour(r):
    print("copy_suppression_behaviour (a: top attended earlier token among the logit lens's top 10 at the head's "
          "input; b: the head's direct effect on its logit there; score: share of positions with both a and b < 0)")
    for row in r["per_head"]:
        print(f"  weight-based suppressor {row['layer']}.{row['head']}: score {row['copy_suppression_behaviour']:.3f} "
              f"[{row['copy_suppression_behaviour_lo']:.3f}, {row['copy_suppression_behaviour_hi']:.3f}], a "
              f"{row['cs_attends_predicted']:.3f}, b {row['cs_predicted_effect']:+.3f}")
    for what, m in (("weight-based top heads, mean", r["weight_heads_mean"]),
                    ("random same layers, mean", r["random_mean"]), ("all heads, mean", r["all_heads_mean"])):
        print(f"  {what}: score {m['copy_suppression_behaviour']:.3f}, a {m['cs_attends_predicted']:.3f}, "
              f"b {m['cs_predicted_effect']:+.3f}")
    lo, hi = r["random_min"], r["random_max"]
    print(f"  random same layers, range over draws: score [{lo['copy_suppression_behaviour']:.3f}, "
          f"{hi['copy_suppression_behaviour']:.3f}], b [{lo['cs_predicted_effect']:+.3f}, "
          f"{hi['cs_predicted_effect']:+.3f}]")
    top = ", ".join(f"{int(x.layer)}.{int(x.head)} {x.copy_suppression_behaviour:.3f} (b {x.cs_predicted_effect:+.2f})"
                    for x in r["top"].itertuples())
    print(f"  top heads by the behavioural score: {top}; overlap with the weight-based top: "
          f"{r['overlap_with_weights']:.2f}  ({r['seconds']:.0f} s)")


def print_table(results, k):
    print(f"{'class':<17} {'top heads: score [95% CI]':<60} {'stab.':>5}  measure: baseline, "
          "class-ablated change [95% CI] | random same layers: mean [min, max]")
    for name, r in results.items():
        if r.get("kind") == "behaviour":
            _print_behaviour(r)
            continue
        top = ", ".join(f"{int(x.layer)}.{int(x.head)} {getattr(x, r['column']):.3f} "
                        f"[{getattr(x, r['column'] + '_lo'):.3f}, {getattr(x, r['column'] + '_hi'):.3f}]"
                        for x in r["top"].itertuples())
        print(f"{name:<17} {top:<60} {r['stability']:>5.2f}  {r['measure']}: {r['baseline']:.3f}, "
              f"{r['class_delta']:+.3f} [{r['class_lo']:+.3f}, {r['class_hi']:+.3f}] | "
              f"{r['random_delta_mean']:+.3f} [{r['random_delta_min']:+.3f}, {r['random_delta_max']:+.3f}]"
              f"  ({r['seconds']:.0f} s)")
        if "steering" in r:
            for task, acc in r["steering"].items():
                print(f"{'':<17} function vector (top 10 heads, layer {r['steering_layer']}) on {task}: zero-shot "
                      f"accuracy {acc['zero_shot']:.3f} -> {acc['with_fv']:.3f}")
        if "receivers" in r:
            print(f"{'':<17} receivers (name movers): {r['receivers']}")


def _quick_model():
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from interp.model.bundled import bundled_folder  # found (and converted) as load_model finds it

    folder = bundled_folder("smollm2")
    tok = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
    return interp.load_model(LlamaForCausalLM(cfg).eval(), tokenizer=tok)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--classes", default="successor,copy_suppression,name_mover,s_inhibition,function_vector",
                        help="also copy_suppression_behaviour: the behavioural signature of the weight-based "
                             "copy suppressors against random heads (no ablation)")
    parser.add_argument("--top", type=int, default=4, help="heads per class to ablate")
    parser.add_argument("--draws", type=int, default=5, help="random head sets from the same layers")
    parser.add_argument("--quick", action="store_true", help="a tiny random model with SmolLM2's tokenizer")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    interp.set_threads(1)
    model = _quick_model() if args.quick else interp.load_model(args.model)
    classes = [c.strip() for c in args.classes.split(",") if c.strip()]
    results = {}
    for group in _groups(classes):  # one group at a time, printed and saved as it ends: a long run that is
        done = validate(model, group, args.top, args.draws, args.quick)  # stopped keeps what finished
        results.update(done)
        print_table(done, args.top)
        sys.stdout.flush()
        if args.json:
            out = {n: {k: (v.to_dict("records") if hasattr(v, "to_dict") else v) for k, v in r.items()}
                   for n, r in results.items()}
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print("\nall classes:")
    print_table(results, args.top)
    return results


def _groups(classes):
    """The classes in runs of one, except name_mover and s_inhibition, which share their IOI scores."""
    ioi = [c for c in classes if c in ("name_mover", "s_inhibition")]
    groups, seen = [], False
    for c in classes:
        if c in ioi:
            if not seen:
                groups.append(ioi)
            seen = True
        else:
            groups.append([c])
    return groups


if __name__ == "__main__":
    main()
