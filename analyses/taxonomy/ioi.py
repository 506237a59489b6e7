"""Task-based head classes on indirect object identification (Wang et al. 2022, "Interpretability in the Wild"):
name movers and S-inhibition heads, on ``tasks.ioi_task`` (clean: "When Mary and John went to the store, John
gave a drink to" -> " Mary"; corrupted: the first clause names two other people).

- ``name_mover``: the head's direct logit attribution to ``logit[IO] - logit[S]`` at the last position (END),
  final norm frozen at the run's scale as in ``attribution.direct_logit_attribution``, as a fraction of the
  model's logit difference (mean over prompts of the head's part / mean over prompts of the logit difference).
  ``io_attention``: the head's attention END -> IO minus END -> S (both occurrences of S added). A head is
  labelled a name mover when ``name_mover`` clears its threshold (0.1) and ``io_attention > 0`` (Wang et al.:
  name movers attend to IO more than S and copy what they attend to).
- ``s_inhibition``: path patching (``patching.path_patching``, via the queries) from each earlier head into the
  top name movers' queries (up to ``n_receivers`` heads labelled name mover, else the top ``name_mover`` heads):
  the normalised effect, 0 at the corrupted run and 1 at the clean run (Wang et al. find S-inhibition heads this
  way). Threshold 0.1.

Intervals: 95% percentile bootstrap over prompts of the ratio of means.
"""

from __future__ import annotations

import math
import warnings

import pandas as pd
import torch

from hooks.names import hook_name
from interp.model.config import real_sites

from ..causal.attribution import _unembedding, frozen_norm
from ..data.batches import _main_output
from ..heads.labels import resolve_thresholds
from ..data.metrics import Metric
from ..data.bootstrap import check_n_bootstrap, ratio_interval
from ..data.stability import split_half
from .base import refuse_non_lm

__all__ = ["name_mover_scores", "s_inhibition_scores"]


def _rows(model, name: str, value, lo, hi, extra: dict | None = None) -> pd.DataFrame:
    heads = [(l, h) for l in range(model.cfg.n_layers) for h in range(model.cfg.heads_per_layer[l])]
    df = pd.DataFrame({"layer": [l for l, _ in heads], "head": [h for _, h in heads]})
    df[name], df[f"{name}_lo"], df[f"{name}_hi"] = value.numpy(), lo.numpy(), hi.numpy()
    for column, values in (extra or {}).items():
        df[column] = values
    real = set(model.cfg.heads())
    return df[[(l, h) in real for l, h in zip(df["layer"], df["head"])]].reset_index(drop=True)


def _ioi(model, n_prompts: int, seed: int):
    from ..data.tasks import ioi_task

    clean, corrupted, metric = ioi_task(model, n=n_prompts, seed=seed)
    return clean, corrupted, metric, metric.correct.cpu(), metric.wrong.cpu()


def name_mover_scores(model, n_prompts: int = 32, seed: int = 0, n_bootstrap: int = 1000, task=None) -> pd.DataFrame:
    """Every head's ``name_mover`` score with its interval and ``io_attention`` (module docstring); one row per
    (layer, head). task: ``(clean, corrupted, metric)`` from ``ioi_task`` (default: ``ioi_task(model,
    n_prompts, seed)``). Heads whose score cannot be measured (the model's mean logit difference is 0 or not
    finite, or the head's attribution is not finite) are NaN, with a warning saying why; they are labelled ``"nan"``."""
    refuse_non_lm(model, "The name-mover score")
    check_n_bootstrap(n_bootstrap)
    clean, _, metric = task if task is not None else _ioi(model, n_prompts, seed)[:3]
    io, s = metric.correct.cpu(), metric.wrong.cpu()
    unembed = _unembedding(model)
    ids, mask = clean["input_ids"], clean["attention_mask"]
    n, last = ids.shape[0], model.cfg.n_layers - 1
    layers = [s.block for s in real_sites(model)]
    names = ([hook_name("resid_post", last)] + [hook_name("result", l) for l in layers]
             + [hook_name("pattern", l) for l in layers])
    before = model.attn
    try:
        if before != "eager":
            model.set_attn("eager")  # the END row of each pattern
        with model.studying(), torch.no_grad():
            out, cache = model.run_with_cache(ids, mask, names=names, device="cpu")
    finally:
        if model.attn != before:
            model.set_attn(before)
    rows = torch.arange(n)
    logits = _main_output(out)[:, -1].float().cpu()
    diff = logits[rows, io] - logits[rows, s]  # (n,)
    norm = model.hf.get_submodule(model.structure.final_norm)
    apply, _ = frozen_norm(norm, cache[hook_name("resid_post", last)][:, -1].float())
    w_u = unembed.weight.detach().float().cpu()
    direction = w_u[io] - w_u[s]  # (n, m)
    tokens = ids.cpu()
    is_io = (tokens == io[:, None]).float()  # (n, p)
    is_s = (tokens == s[:, None]).float()
    n_heads = max(model.cfg.heads_per_layer)
    dla = torch.zeros(n, model.cfg.n_layers, n_heads)
    attn = torch.full((model.cfg.n_layers, n_heads), float("nan"))
    for l in layers:
        result = cache["result", l][:, -1].float().transpose(0, 1)  # (h, n, m)
        part = (apply(result) * direction).sum(-1).T  # (n, h)
        dla[:, l, :part.shape[1]] = part
        end_row = cache["pattern", l][:, :, -1].float()  # (n, h, k)
        attn[l, :end_row.shape[1]] = ((end_row * is_io[:, None]).sum(-1) - (end_row * is_s[:, None]).sum(-1)).mean(0)
    real = [(l, h) for l in range(model.cfg.n_layers) for h in range(model.cfg.heads_per_layer[l])]
    flat = torch.stack([dla[:, l, h] for l, h in real], 1)
    value, lo, hi = ratio_interval(flat, diff, n_bootstrap, seed)
    _warn_unmeasured(value, float(diff.mean()), n)
    df = _rows(model, "name_mover", value, lo, hi, {"io_attention": [float(attn[l, h]) for l, h in real]})
    df.attrs.update(logit_difference=float(diff.mean()), prompts=n,
                    stability={"name_mover": split_half(flat, diff)})  # even against odd prompts
    return df


def _warn_unmeasured(value: torch.Tensor, difference: float, n: int) -> None:
    """A warning saying why some name-mover scores are NaN (not measured, not a head that moves no name)."""
    bad = int(value.isnan().sum())
    if not bad:
        return
    why = (f"the model's mean logit difference logit(IO) - logit(S) over the {n} IOI prompts is {difference:.3g}, "
           "so a head's share of it is undefined" if difference == 0 or not math.isfinite(difference)
           else "their direct logit attribution is not finite (check the weights for NaN or inf)")
    warnings.warn(f"name_mover: {bad} head(s) were not measured: {why}. Their scores are NaN and their label 'nan', "
                  "not 'none'.", RuntimeWarning, stacklevel=3)


class _Recording(Metric):
    """A metric that keeps each call's per-example values (in call order)."""

    def __init__(self, inner: Metric):
        self.inner, self.name, self.higher_is_better, self.calls = inner, inner.name, inner.higher_is_better, []

    def per_example(self, output, inputs):
        value = self.inner.per_example(output, inputs)
        self.calls.append(value.detach().double().cpu())
        return value


def s_inhibition_scores(model, receivers=None, n_receivers: int = 3, n_prompts: int = 32, seed: int = 0,
                        n_bootstrap: int = 1000, task=None, name_movers: pd.DataFrame | None = None,
                        thresholds: dict[str, float] | None = None) -> pd.DataFrame:
    """Every head's ``s_inhibition`` score (path patching into the name movers' queries) with its interval; one
    row per (layer, head), 0 for heads at or after the receivers' last layer (no path). ``df.attrs["receivers"]``
    holds the name movers used, ``df.attrs["receivers_chosen"]`` how they were chosen. receivers: (layer, head)
    pairs (default: ``_default_receivers`` of ``name_mover_scores``)."""
    from ..causal.patching import path_patching

    refuse_non_lm(model, "The S-inhibition score")
    check_n_bootstrap(n_bootstrap)
    clean, corrupted, metric = task if task is not None else _ioi(model, n_prompts, seed)[:3]
    how = "given"
    if receivers is None:
        nm = name_movers if name_movers is not None else name_mover_scores(model, seed=seed, n_bootstrap=10,
                                                                            task=(clean, corrupted, metric))
        receivers, how = _default_receivers(model, nm, thresholds, n_receivers)
    recording = _Recording(metric)
    try:
        df = path_patching(model, clean, corrupted, receivers, recording, via="q")
    except ValueError as err:
        if how == "given":
            raise
        raise ValueError(f"s_inhibition: no receivers were given, and the default ones {receivers} ({how}) cannot "
                         f"be patched: {err} Give receivers=[(layer, head), ...].") from err
    clean_v, corrupted_v, *patched = recording.calls  # (n,) each: clean, corrupted, then one per sender
    num = torch.stack([p - corrupted_v for p in patched], 1)  # (n, senders)
    value, lo, hi = ratio_interval(num, clean_v - corrupted_v, n_bootstrap, seed)
    found = {(int(l), int(h)): i for i, (l, h) in enumerate(zip(df["layer"], df["head"]))}
    heads = model.cfg.heads()
    pick = [found.get(h) for h in heads]
    out = pd.DataFrame({"layer": [l for l, _ in heads], "head": [h for _, h in heads]})
    for name, t in (("s_inhibition", value), ("s_inhibition_lo", lo), ("s_inhibition_hi", hi)):
        out[name] = [float(t[i]) if i is not None else 0.0 for i in pick]
    out.attrs.update(receivers=[tuple(r) for r in receivers], receivers_chosen=how, clean=float(clean_v.mean()),
                     corrupted=float(corrupted_v.mean()),  # stability: the senders, even against odd prompts
                     stability={"s_inhibition": split_half(num, clean_v - corrupted_v)})
    return out


def _default_receivers(model, nm: pd.DataFrame, thresholds, n_receivers: int) -> tuple[list[tuple[int, int]], str]:
    """The receivers S-inhibition is read into when none are given, and how they were chosen: up to
    ``n_receivers`` name movers after layer 0 (a layer-0 head has no earlier head to send into it), the heads
    labelled name mover first, else the highest ``name_mover`` scores there."""
    limit = resolve_thresholds(thresholds)["name_mover"]
    ranked = nm[nm["name_mover"].notna()].sort_values("name_mover", ascending=False)
    labelled = (ranked["name_mover"] >= limit) & (ranked["io_attention"] > 0)
    later = ranked["layer"] > 0
    if (labelled & later).any():
        chosen, how = ranked[labelled & later], "the heads labelled name mover after layer 0"
    else:
        chosen, how = ranked[later], "the highest name_mover scores after layer 0, where no head is labelled name mover"
    early = ranked[labelled & ~later]
    first = [(int(l), int(h)) for l, h in zip(early["layer"], early["head"])]
    if first:
        how += f"; the name mover(s) {first} of layer 0 have no earlier head to send into them"
    if not len(chosen):
        unmeasured = " and its heads after layer 0 have no name_mover score (NaN)" if model.cfg.n_layers > 1 else ""
        raise ValueError(f"s_inhibition: no receivers were given, and the default ones, the top name movers after "
                         f"layer 0 (a head in layer 0 has no earlier head to send into it), do not exist: this model "
                         f"has {model.cfg.n_layers} layer(s){unmeasured}. Give receivers=[(layer, head), ...] in a "
                         "layer after 0, on a model of at least 2 layers.")
    return [(int(l), int(h)) for l, h in zip(chosen["layer"], chosen["head"])][:n_receivers], how
