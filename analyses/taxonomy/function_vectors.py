"""Function-vector heads (Todd et al. 2024, "Function Vectors in Large Language Models").

In-context-learning tasks (``data/icl_tasks.json``: antonyms, country-capital, English-French, written for this
project; ``uppercase`` generated from the bundled corpus's words) are shown as few-shot prompts
``"Q: x1\\nA: y1\\n\\nQ: x2\\nA: y2\\n\\n...Q: x\\nA:"``; the answer is the first token of ``" y"`` (multi-token
answers are judged by their first token).

- Each head's **mean output** ``z`` at the final token over the task's few-shot prompts.
- **Causal indirect effect** (CIE): on prompts whose demonstrations have their labels shuffled (the same inputs,
  answers permuted among them), the head's ``z`` at the final token is set to its mean; CIE = P(answer) patched -
  P(answer) on the shuffled prompt. ``function_vector`` = the CIE averaged over prompts and tasks (Todd et al.
  average over tasks too); intervals are a 95% bootstrap over the pooled prompts. Label threshold 0.02 (a rise of
  two points of probability).
- **The function vector** of a task: the sum over the top heads of their mean ``z`` through ``W_O``; added to the
  residual stream (``hook_resid_pre`` of one layer, Todd et al. use about a third of the depth) at the final
  position of zero-shot prompts ``"Q: x\\nA:"``, it should raise the accuracy (``fv_accuracy``).
"""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path

import pandas as pd
import torch

from hooks.names import hook_name
from interp.model.config import real_sites
from interp.streaming import cache_kwarg, output_cache

from ..data.batches import _main_output, batch_of
from ..explain.composition import head_weights
from ..causal.engine import copies_per_forward, scan
from ..data.bootstrap import check_n_bootstrap, mean_interval
from ..data.stability import split_half
from .base import refuse_non_lm

__all__ = ["icl_tasks", "icl_prompts", "function_vector_scores", "function_vector", "fv_accuracy", "task_accuracy"]

ICL_TASKS = Path(__file__).resolve().parents[1] / "data" / "icl_tasks.json"


@cache
def icl_tasks() -> dict[str, tuple[tuple[str, str], ...]]:
    """The bundled tasks: name -> (input, answer) pairs; ``uppercase`` from the corpus's lowercase words."""
    from ..data.prompts import corpus_sentences

    tasks = {k: tuple(tuple(p) for p in v) for k, v in json.loads(ICL_TASKS.read_text(encoding="utf-8"))["tasks"].items()}
    words = sorted({w for s in corpus_sentences() for w in re.findall(r"\b[a-z]{3,}\b", s)})
    tasks["uppercase"] = tuple((w, w.upper()) for w in words[:400])
    return tasks


def icl_prompts(model, pairs, n_prompts: int = 16, n_shots: int = 5, seed: int = 0,
                shuffled: bool = False) -> tuple[dict, torch.Tensor]:
    """``(batch, answers)``: ``n_prompts`` prompts of ``n_shots`` demonstrations then a query (``n_shots=0``:
    zero-shot), and the first token of each query's answer. ``shuffled``: the demonstrations' answers permuted
    among them (the same draw as unshuffled with the same seed). Pairs the tokenizer cannot read (more than a tenth
    of the prompts' or the answers' tokens its unknown token) are refused."""
    from ..data.prompts import refuse_unreadable

    if model.tokenizer is None:
        raise ValueError("Function-vector prompts are text: this model has no tokenizer.")
    pairs = list(pairs)
    if len(pairs) < n_shots + 1:
        raise ValueError(f"a task needs at least n_shots + 1 = {n_shots + 1} pairs; got {len(pairs)}.")
    g = torch.Generator().manual_seed(seed)
    texts, answers = [], []
    for _ in range(n_prompts):
        pick = [pairs[i] for i in torch.randperm(len(pairs), generator=g)[:n_shots + 1].tolist()]
        demos, (x, y) = pick[:-1], pick[-1]
        labels = [b for _, b in demos]
        if shuffled and n_shots > 1:
            order = torch.randperm(n_shots, generator=g).tolist()
            if order == list(range(n_shots)):
                order = order[1:] + order[:1]
            labels = [labels[i] for i in order]
        texts.append("".join(f"Q: {a}\nA: {b}\n\n" for (a, _), b in zip(demos, labels)) + f"Q: {x}\nA:")
        answers.append(model.tokenizer(" " + y, add_special_tokens=False)["input_ids"][0])
    batch, answers = model.to_batch(texts), torch.tensor(answers)
    mask = batch.get("attention_mask")
    fix = ("Give tasks={name: [(input, answer), ...]} in words this tokenizer knows, or use a model whose tokenizer "
           "reads English text.")
    for what, ids in (("prompts", batch["input_ids"] if mask is None else batch["input_ids"][mask.bool()]),
                      ("answers", answers)):
        refuse_unreadable(model, ids, f"The ICL {what} of pairs such as {pairs[0]!r}", fix)
    return batch, answers


def _probabilities(output, answers: torch.Tensor) -> torch.Tensor:
    logits = _main_output(output)[:, -1].float()
    return logits.softmax(-1)[torch.arange(len(answers)), answers.to(logits.device)].cpu()


def _mean_z(model, batch) -> dict[int, torch.Tensor]:
    """Each layer's mean z at the final position: ``{layer: (h, d)}``."""
    layers = [s.block for s in real_sites(model)]
    with model.studying(), torch.no_grad():
        _, cache_ = model.run_with_cache(batch["input_ids"], batch["attention_mask"],
                                         names=[hook_name("z", l) for l in layers])
    return {l: cache_["z", l][:, -1].float().mean(0).cpu() for l in layers}


def function_vector_scores(model, tasks=None, n_prompts: int = 16, n_shots: int = 5, seed: int = 0,
                           n_bootstrap: int = 1000, method: str = "cached") -> pd.DataFrame:
    """Every head's ``function_vector`` score (mean causal indirect effect; module docstring) with its interval;
    one row per (layer, head). tasks: names of bundled tasks or ``{name: [(input, answer), ...]}`` (default: all
    bundled). ``df.attrs["mean_z"]`` holds each task's mean z per layer (for ``function_vector``),
    ``df.attrs["shuffled_probability"]`` each task's P(answer) on the shuffled prompts.

    method: ``"cached"`` (default) runs the shuffled prompts but their final token once and keeps their keys and
    values; each forward then computes only the final token, for a whole layer's heads at once (one copy of the
    batch per head). ``"full"`` runs the whole prompt once per head (the earlier implementation; the same numbers
    up to float rounding, tested). The patch is at the final position only, so no earlier position changes.
    """
    refuse_non_lm(model, "The function-vector score")
    check_n_bootstrap(n_bootstrap)
    if method not in ("cached", "full"):
        raise ValueError(f"method must be 'cached' or 'full'; got {method!r}.")
    tasks = _resolve(tasks)
    heads = model.cfg.heads()
    effects, mean_zs, base = [], {}, {}
    for name, pairs in tasks.items():
        clean, answers = icl_prompts(model, pairs, n_prompts, n_shots, seed)
        shuffled, _ = icl_prompts(model, pairs, n_prompts, n_shots, seed, shuffled=True)
        shuffled = batch_of(model, shuffled)
        mean_zs[name] = means = _mean_z(model, clean)
        cie = _cie_cached if method == "cached" else _cie_full
        p0, patched = cie(model, shuffled, answers, means, heads)
        base[name] = float(p0.mean())
        effects.append(torch.stack([p - p0 for p in patched], 1))  # (n_prompts, heads)
    value, lo, hi = mean_interval(torch.cat(effects), n_bootstrap, seed)
    df = pd.DataFrame({"layer": [l for l, _ in heads], "head": [h for _, h in heads],
                       "function_vector": value.numpy(), "function_vector_lo": lo.numpy(),
                       "function_vector_hi": hi.numpy()})
    df.attrs.update(mean_z=mean_zs, shuffled_probability=base, tasks=list(tasks), n_shots=n_shots, method=method,
                    stability={"function_vector": split_half(torch.cat(effects))})  # even against odd prompts
    return df


def _cie_full(model, shuffled, answers, means, heads):
    """P(answer) on the shuffled prompts, and with each head's final-token z set to its mean: whole forwards."""
    calls = []

    def metric(output, batch):
        calls.append(_probabilities(output, answers))
        return float(calls[-1].mean())

    def hooks_for(group, copies):
        b = shuffled["input_ids"].shape[0]

        def hook(z, point):
            z = z.clone()
            for i, (l, h) in enumerate(group):
                if l == point.layer:
                    z[i * b:(i + 1) * b, -1, h] = means[l][h].to(z.dtype)
            return z

        return [(hook_name("z", l), hook) for l in sorted({l for l, _ in group})]

    scan(model, shuffled, heads, lambda head: head[0], hooks_for, metric, copies_per_forward(model, shuffled, None))
    return calls[0], calls[1:]


def _cie_cached(model, shuffled, answers, means, heads):
    """As ``_cie_full``: the prompts but their final token run once with a KV cache; then one forward of the final
    token per layer, row ``r * C + c`` (prompt r, copy c) carrying head c of the layer's C heads."""
    ids, mask = shuffled["input_ids"], shuffled["attention_mask"]
    mask = torch.ones_like(ids) if mask is None else mask
    b = ids.shape[0]
    last = (mask.long().sum(1) - 1)[:, None].to(model.device)  # left padding: the final token's position id
    name = cache_kwarg(model.hf)
    with model.studying(), torch.no_grad():
        out = model(ids[:, :-1], mask[:, :-1], use_cache=True)
        prefix = output_cache(out)

        def final(hooks, copies):
            cache = copy.deepcopy(prefix)
            if copies > 1:
                cache.batch_repeat_interleave(copies)
            with model.hooks(hooks):
                logits = model.hf(input_ids=ids[:, -1:].repeat_interleave(copies, 0).to(model.device),  # a mask
                                  attention_mask=mask.repeat_interleave(copies, 0).to(model.device),  # longer
                                  use_cache=True, position_ids=last.repeat_interleave(copies, 0),  # than the ids
                                  logits_to_keep=1, **{name: cache}).logits[:, -1].float()
            return logits.softmax(-1)[torch.arange(b * copies), answers.repeat_interleave(copies).to(logits.device)]

        p0, patched = final([], 1).cpu(), []
        for layer in sorted({l for l, _ in heads}):
            group = [h for l, h in heads if l == layer]

            def hook(z, point, group=group):
                z = z.clone()
                for c, h in enumerate(group):
                    z[c::len(group), -1, h] = means[point.layer][h].to(z.dtype)
                return z

            p = final([(hook_name("z", layer), hook)], len(group)).cpu()
            patched += [p[c::len(group)] for c in range(len(group))]
    return p0, patched


def _resolve(tasks) -> dict[str, list]:
    bundled = icl_tasks()
    if tasks is None:
        return {k: list(v) for k, v in bundled.items()}
    if isinstance(tasks, str):
        tasks = [tasks]
    if isinstance(tasks, dict):
        return {k: list(v) for k, v in tasks.items()}
    unknown = [t for t in tasks if t not in bundled]
    if unknown:
        raise ValueError(f"Unknown ICL task(s) {unknown}; bundled tasks are {sorted(bundled)}, or give "
                         "{name: [(input, answer), ...]}.")
    return {t: list(bundled[t]) for t in tasks}


def function_vector(model, mean_z: dict[int, torch.Tensor], heads) -> torch.Tensor:
    """The sum over ``heads`` of each head's mean z (``mean_z``: ``{layer: (h, d)}``) through its W_O: ``(d_model,)``."""
    total = None
    for l, h in heads:
        w_o = head_weights(model, l, fold_norms=False)["W_O"][h].float().cpu()  # (e, m)
        part = mean_z[l][h] @ w_o
        total = part if total is None else total + part
    return total


def task_accuracy(model, batch, answers: torch.Tensor, hooks=()) -> torch.Tensor:
    """Per prompt: 1.0 where the argmax at the final position is the answer's first token (under ``hooks``)."""
    batch = batch_of(model, batch)
    with model.studying(), torch.no_grad(), model.hooks(list(hooks)):
        logits = _main_output(model(batch["input_ids"], batch["attention_mask"]))[:, -1].float().cpu()
    return (logits.argmax(-1) == answers).double()


def fv_accuracy(model, pairs, vector: torch.Tensor, layer: int, n_prompts: int = 50, seed: int = 1) -> dict:
    """Zero-shot accuracy with and without ``vector`` added at ``blocks.{layer}.hook_resid_pre``, final position:
    ``{"zero_shot": ..., "with_fv": ...}`` (and per-prompt tensors under ``"per_prompt"``)."""
    batch, answers = icl_prompts(model, pairs, n_prompts, 0, seed)

    def add(resid, hook):
        resid = resid.clone()
        resid[:, -1] += vector.to(resid.device, resid.dtype)
        return resid

    plain = task_accuracy(model, batch, answers)
    steered = task_accuracy(model, batch, answers, [(hook_name("resid_pre", layer), add)])
    return {"zero_shot": float(plain.mean()), "with_fv": float(steered.mean()), "per_prompt": (plain, steered)}
