"""Attribution: first-order patching estimates, direct logit attribution and the logit lens.

- ``attribution_patching`` (Nanda 2023; Syed et al. 2023): activation patching's ``patched - corrupted`` for every
  head at once, estimated as ``(z_clean - z_corrupted) . d metric / d z`` at the corrupted run, summed over the
  batch and positions: one clean forward, one corrupted forward and one backward.
- ``direct_logit_attribution``: with the final norm's scale frozen at the run's value the final norm is affine,
  so the logit (difference) splits into the embedding's, each head's, each MLP's contribution and the biases.
- ``logit_lens`` (nostalgebraist 2020): the residual stream after each layer, through the final norm and the
  unembedding.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

import pandas as pd

from interp.distributed import onloaded
from interp.inputs import encode
from interp.sites import FRONT, check_heads, head_columns, site_of
from interp.tokens import display_tokens

from .engine import Shard, _arguments, _run
from .metrics import _main_output, batch_of
from .patching import paired_batches, scalar_metric

__all__ = ["attribution_patching", "direct_logit_attribution", "logit_lens", "frozen_norm", "token_ids"]


def attribution_patching(model, clean, corrupted, metric, by: str = "head", heads=None) -> pd.DataFrame:
    """First-order estimate of ``activation_patching`` (what="z") for every head (``by="head"``) or head and
    position (``"head_pos"``), from one clean forward and one forward and backward on the corrupted input.

    The estimate of ``patched - corrupted`` is the sum over the batch (and positions, for ``by="head"``) of
    ``(z_clean - z_corrupted) . d metric / d z``, the gradient of the batch metric taken at the corrupted run.
    Exact where the metric is linear in the head's output; worse where a softmax downstream saturates.
    Returns the head's columns (, ``pos``), ``metric`` (corrupted + estimate), ``effect`` (estimate / (clean -
    corrupted)), ``estimate``.

    Under torch.distributed (``torchrun``) each rank differentiates the batch mean over its share of the prompts
    and the per-example terms are gathered, so every rank returns the one-process result; a metric that is not a
    mean over examples (a plain callable) runs whole on every rank.

    Every kind of model (``interp.sites``): one row per (site, head), with the head's columns first (``stack``,
    ``kind``, ``site``, ``layer``, ``head``); an encoder-decoder model's batches hold ``decoder_input_ids`` too.
    """
    if by not in ("head", "head_pos"):
        raise ValueError(f"by must be 'head' or 'head_pos'; got {by!r}.")
    metric = scalar_metric(metric)
    clean, corrupted = paired_batches(model, clean, corrupted)
    heads = model.cfg.heads() if heads is None else check_heads(model, heads)
    sites = list(dict.fromkeys(site_of(model, head).name for head in heads))
    names = [f"{site}.hook_z" for site in sites]
    with Shard(corrupted, metric) as shard:  # this rank's prompts under torch.distributed, else all of them
        clean, corrupted, local = shard.rows(clean), shard.rows(corrupted), shard.metric(metric)
        *values, estimates = _first_order(model, clean, corrupted, local, names,
                                          None if shard.index is None else shard.n)
        clean_value, corrupted_value = shard.means(values)
        # site -> (p, h): the estimate of each head at each position, summed over the batch
        per_site = {site: shard.gather(estimates[name].cpu()).sum(0) for site, name in zip(sites, names)}
    span = clean_value - corrupted_value
    rows = []
    for head in heads:
        per_pos = per_site[site_of(model, head).name][:, head[1]]  # (p,)
        parts = [(None, float(per_pos.sum()))] if by == "head" else list(enumerate(per_pos.tolist()))
        for pos, estimate in parts:
            rows.append({**head_columns(model, head), **({} if pos is None else {"pos": pos}),
                         "metric": corrupted_value + estimate, "effect": estimate / span if span else float("nan"),
                         "estimate": estimate})
    df = pd.DataFrame(rows, columns=[*FRONT, *(["pos"] if by == "head_pos" else []), "metric", "effect", "estimate"])
    df.attrs.update(metric=metric.name, clean=clean_value, corrupted=corrupted_value, by=by, what="z")
    return df


def _first_order(model, clean, corrupted, metric, names, n: int | None):
    """The metric on the clean and the corrupted run, and per z hook in ``names`` the first-order estimate
    ``(z_clean - z_corrupted) . d (batch metric) / dz`` at the corrupted run, per row, position and head ``(b, p,
    h)``. ``n``: None for the whole batch; else these are one rank's rows of ``n`` prompts, the metric returns
    per-example values and the gradient is of their sum / n (the whole batch's mean). Batches with
    ``decoder_input_ids`` run as encoder-decoder batches."""
    with model.studying():
        with torch.no_grad():
            args, kwargs = _arguments(clean)
            out, cache = model.run_with_cache(*args, names=names, **kwargs)
            clean_value = metric(out, clean)
        deltas, z_corrupted = {}, {}

        def opening(z, point):  # z + delta: the gradient w.r.t. delta is the total derivative w.r.t. z
            deltas[point.name] = torch.zeros_like(z, requires_grad=True)
            z_corrupted[point.name] = z.detach()
            return z + deltas[point.name]

        with torch.enable_grad():
            for p in model.hf.parameters():
                p.requires_grad_(False)
            with model.hooks([(names, opening)]):
                out = _run(model, corrupted)
            per_example = metric.per_example(out, corrupted).float()
            value = per_example.mean() if n is None else per_example.sum() / n
            if not value.requires_grad:
                raise TypeError(f"attribution_patching differentiates the metric; {metric.name} returned a value "
                                "without a gradient. Use a metric from analyses.metrics or one returning a tensor.")
            grads = torch.autograd.grad(value, [deltas[name] for name in names], allow_unused=True)
        with torch.no_grad():
            corrupted_value = metric(out, corrupted)
            estimates = {}
            for name, grad in zip(names, grads):
                diff = cache[name].float() - z_corrupted[name].float()  # (b, p, h, e)
                estimates[name] = (diff * grad.float()).sum(3) if grad is not None else torch.zeros(diff.shape[:3])
    return clean_value, corrupted_value, estimates


# -- the final norm, frozen --------------------------------------------------------------------------------------
def _eps(norm, d_model: int) -> float:
    """The norm's epsilon: its attribute, or (OLMo's LayerNorm hard-codes it) solved from the module's output on a
    small input, where the epsilon weighs as much as the input's own scale."""
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(norm, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    param = next(norm.parameters(), None)
    dtype, device = (param.dtype, param.device) if param is not None else (torch.float32, "cpu")
    sign = torch.ones(1, d_model, dtype=dtype, device=device)
    sign[0, 1::2] = -1.0  # mean 0, mean square 1: LayerNorm and RMSNorm see the same scale
    small = 1e-3
    with torch.no_grad():
        ratio = float((norm(sign * small).double() - norm(sign * 0).double()).abs().sum()
                      / (norm(sign).double() - norm(sign * 0).double()).abs().sum()) / small
    # ratio = sqrt(1 + eps) / sqrt(small^2 + eps)
    return max(0.0, (1.0 - ratio**2 * small**2) / (ratio**2 - 1.0))


def frozen_norm(norm, x: torch.Tensor):
    """The final norm at the residual ``x: (n, m)`` with its scale frozen: ``(apply, bias)`` where ``apply(c)``
    maps a component ``c: (..., n, m)`` linearly and ``apply(x) + bias`` equals ``norm(x)``.

    LayerNorm: ``gamma * (c - mean(c)) / sigma(x)`` and bias ``beta``. RMSNorm (any weight convention, such as
    Gemma's ``1 + w``): ``w_eff * c / rms(x)``, with ``w_eff`` read off the module on a vector of ones.
    """
    eps = _eps(norm, x.shape[-1])
    x = x.float()
    if "RMS" not in type(norm).__name__ and (isinstance(norm, torch.nn.LayerNorm) or "LayerNorm" in type(norm).__name__):
        sigma = torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
        weight, bias = getattr(norm, "weight", None), getattr(norm, "bias", None)
        gamma = weight.detach().float().to(x.device) if weight is not None else torch.ones(x.shape[-1], device=x.device)
        beta = bias.detach().float().to(x.device) if bias is not None else torch.zeros(x.shape[-1], device=x.device)
        return (lambda c: gamma * (c.float() - c.float().mean(-1, keepdim=True)) / sigma), beta
    with torch.no_grad():
        param = next(norm.parameters(), None)
        ones = torch.ones(1, x.shape[-1], dtype=param.dtype if param is not None else x.dtype, device=x.device)
        weight = norm(ones).float()[0].to(x.device) * (1.0 + eps) ** 0.5
    rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (lambda c: weight * c.float() / rms), torch.zeros(x.shape[-1], device=x.device)


def token_ids(model, value, n: int, what: str) -> torch.Tensor:
    """``value`` (a token id, one-token string, or one of either per sequence) as ``n`` token ids; clear errors."""
    if isinstance(value, str):
        value = _one_token(model, value, what)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, str) for v in value):
        value = [_one_token(model, v, what) if isinstance(v, str) else v for v in value]
    try:
        ids = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        ids = None
    if ids is None or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{what} must be a token id, a one-token string, or one of either per sequence ({n}); "
                        f"got {value!r}.")
    ids = ids.long().flatten()
    if ids.numel() == 1:
        ids = ids.expand(n)
    if ids.numel() != n or int(ids.min()) < 0 or int(ids.max()) >= model.cfg.vocab_size:
        raise ValueError(f"{what} must be one token id, or one per sequence ({n}), in [0, {model.cfg.vocab_size}); "
                         f"got {value!r}.")
    return ids


def _check_position(position, n_pos: int) -> int:
    """A position of the (padded) batch, Python-style: ``-n_pos <= position < n_pos``."""
    try:
        index = None if isinstance(position, bool) else operator.index(position)
    except TypeError:
        index = None
    if index is None or not -n_pos <= index < n_pos:
        raise ValueError(f"position must be an integer in [-{n_pos}, {n_pos}) (the batch has {n_pos} positions; "
                         f"-1 is the last); got {position!r}.")
    return index


def _one_token(model, text: str, what: str) -> int:
    if model.tokenizer is None:
        raise ValueError(f"{what} is text but this model has no tokenizer; give a token id.")
    ids = encode(model.tokenizer, text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{what} {text!r} is {len(ids)} tokens; give one token (e.g. with its leading space).")
    return ids[0]


def _unembedding(model):
    from .seq2seq import is_seq2seq

    if is_seq2seq(model):
        raise TypeError("Logit attribution and the logit lens read one residual stream; an encoder-decoder model "
                        "has two. They do not handle encoder-decoder models yet: use attribution_patching or "
                        "activation_patching, which work per (site, head).")
    head = model.hf.get_output_embeddings()
    if head is None or model.structure.final_norm is None or not model.cfg.causal:
        raise NotImplementedError(
            "Logit attribution needs a causal LM with a final norm before its output layer; this model has "
            f"{'no output layer' if head is None else 'no final norm' if model.structure.final_norm is None else 'bidirectional attention'}.")
    return head


def direct_logit_attribution(model, inputs, answer, wrong=None, position: int = -1) -> pd.DataFrame:
    """Each component's direct contribution to ``logit[answer] - logit[wrong]`` (or ``logit[answer]``) at
    ``position``, averaged over the batch.

    answer, wrong: a token id, one per sequence, or a one-token string. The residual stream entering the final
    norm is the sum of the embedding (``hook_resid_pre`` of block 0: token and position embeddings), every head's
    projected output (``hook_result``), every MLP's output and the output projections' biases; with the final
    norm's scale frozen at this run's value the norm is affine, and each part maps to the logit through the
    unembedding.

    Rows: ``component`` (``embed``, ``head``, ``mlp``, ``bias``: output-projection, final-norm and unembedding
    biases, and ``remainder``), ``layer``, ``head``, ``attribution``. A constant the model multiplies its logits
    by (Cohere, Granite) is found on the run and applied (``df.attrs["logit_scale"]``). They sum to the model's logit (difference)
    exactly: ``remainder`` is what the decomposition does not explain, 0 up to float error where the
    architecture allows an exact split (pre-norm and parallel blocks) and nonzero where a norm or scale sits on a
    branch (Gemma 2/3's post-attention norms, Granite's residual multiplier) or on the logits (soft-capping).
    ``df.attrs`` holds the logit (difference) and the remainder.
    """
    unembed = _unembedding(model)
    batch = batch_of(model, inputs)
    n = batch["input_ids"].shape[0]
    position = _check_position(position, batch["input_ids"].shape[1])
    answer = token_ids(model, answer, n, "answer")
    wrong = None if wrong is None else token_ids(model, wrong, n, "wrong")
    s, last = model.structure, model.cfg.n_layers - 1
    names = (["blocks.0.hook_resid_pre", f"blocks.{last}.hook_resid_post"]
             + [f"blocks.{l}.attn.hook_result" for l in range(model.cfg.n_layers) if s.o_proj[l] is not None]
             + [f"blocks.{l}.hook_mlp_out" for l in range(model.cfg.n_layers) if s.mlp[l] is not None])
    with model.studying(), torch.no_grad():  # every activation on the inputs' device (blocks may live elsewhere)
        out, cache = model.run_with_cache(batch["input_ids"], batch["attention_mask"], names=names, device=model.device)
    rows_ = torch.arange(n)
    logits = _main_output(out)[:, position].float()  # (n, vocab)
    target = logits[rows_, answer] - (logits[rows_, wrong] if wrong is not None else 0.0)
    norm = model.hf.get_submodule(s.final_norm)
    final = cache[f"blocks.{last}.hook_resid_post"][:, position]
    with onloaded(unembed, norm):  # weights offloaded by a device map are read here, outside a forward
        w_u = unembed.weight.detach().float().to(final.device)
        direction = w_u[answer] - (w_u[wrong] if wrong is not None else 0.0)
        u_bias = None if getattr(unembed, "bias", None) is None else unembed.bias.detach().float().to(final.device)
        apply, beta = frozen_norm(norm, final.float())
    del w_u
    scale = _logit_scale(unembed, norm, final, logits)

    def attribute(c):  # c: (..., n, m) at the position -> mean over the batch of its logit contribution
        return scale * (apply(c) * direction).sum(-1).mean(-1)

    rows = [{"component": "embed", "layer": None, "head": None,
             "attribution": float(attribute(cache["blocks.0.hook_resid_pre"][:, position]))}]
    bias = torch.zeros_like(direction[0])
    for layer in range(model.cfg.n_layers):
        if s.o_proj[layer] is not None and layer not in model.cfg.empty_layers:
            result = cache["result", layer][:, position].transpose(0, 1)  # (h, n, m)
            for head, value in enumerate(attribute(result).tolist()):
                rows.append({"component": "head", "layer": layer, "head": head, "attribution": value})
            o_proj = model._blocks[layer].get_submodule(s.o_proj[layer])
            with onloaded(o_proj):
                if getattr(o_proj, "bias", None) is not None:
                    bias = bias + o_proj.bias.detach().float().to(bias.device)
        if s.mlp[layer] is not None:
            rows.append({"component": "mlp", "layer": layer, "head": None,
                         "attribution": float(attribute(cache["mlp_out", layer][:, position]))})
    bias_value = float((apply(bias.expand(n, -1)) * direction).sum(-1).mean() + (beta * direction).sum(-1).mean())
    if u_bias is not None:
        bias_value += float((u_bias[answer] - (u_bias[wrong] if wrong is not None else 0.0)).mean())
    bias_value *= scale
    rows.append({"component": "bias", "layer": None, "head": None, "attribution": bias_value})
    explained = sum(r["attribution"] for r in rows)
    total = float(target.mean())
    rows.append({"component": "remainder", "layer": None, "head": None, "attribution": total - explained})
    df = pd.DataFrame(rows, columns=["component", "layer", "head", "attribution"])
    df["layer"], df["head"] = df["layer"].astype("Int64"), df["head"].astype("Int64")
    df.attrs.update(logit=total, remainder=total - explained, logit_scale=scale, answer=answer.tolist(),
                    wrong=None if wrong is None else wrong.tolist(), position=position)
    return df


def _logit_scale(unembed, norm, final: torch.Tensor, logits: torch.Tensor) -> float:
    """The constant a model multiplies its logits by after the output layer (Cohere's ``logit_scale``, Granite's
    ``1 / logits_scaling``), read off this run: 1.0 when there is none or when the relation is not one constant
    (then the difference shows in the remainder)."""
    with torch.no_grad():
        computed = unembed(norm(final)).float().to(logits.device)  # (n, vocab)
    scale = float((computed * logits).sum() / (computed * computed).sum().clamp(min=1e-30))
    exact = (logits - scale * computed).abs().max() <= 1e-4 * max(1.0, float(logits.abs().max()))
    return scale if bool(exact) and abs(scale - 1.0) > 1e-6 else 1.0


def logit_lens(model, inputs, answer=None, position: int = -1, k: int = 5) -> pd.DataFrame:
    """The residual stream after each layer read as the model's final prediction: through the final norm (as
    it is, not frozen) and the unembedding, at ``position``, probabilities averaged over the batch.

    Rows: ``layer`` (``-1`` is the embedding), ``top_tokens`` (the ``k`` most probable, as strings when the
    model has a tokenizer), ``top_prob``, and with ``answer`` its ``answer_prob`` and ``answer_rank`` (0 best).
    """
    unembed = _unembedding(model)
    batch = batch_of(model, inputs)
    n = batch["input_ids"].shape[0]
    position = _check_position(position, batch["input_ids"].shape[1])
    vocab = model.cfg.vocab_size
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"k is how many top tokens to list: an integer from 1 to the vocabulary size {vocab}; "
                         f"got {k!r}.")
    answer = None if answer is None else token_ids(model, answer, n, "answer")
    names = ["blocks.0.hook_resid_pre"] + [f"blocks.{l}.hook_resid_post" for l in range(model.cfg.n_layers)]
    norm = model.hf.get_submodule(model.structure.final_norm)
    with model.studying(), torch.no_grad():
        _, cache = model.run_with_cache(batch["input_ids"], batch["attention_mask"], names=names)
        rows = []
        for layer, name in zip(range(-1, model.cfg.n_layers), names):
            probs = F.softmax(unembed(norm(cache[name][:, position])).float(), dim=-1)  # (n, vocab)
            mean = probs.mean(0)
            top = mean.topk(k)
            tokens = top.indices.tolist()
            if model.tokenizer is not None:
                tokens = display_tokens(model.tokenizer, tokens)
            row = {"layer": layer, "top_tokens": tokens, "top_prob": float(top.values[0])}
            if answer is not None:
                chosen = probs[torch.arange(n), answer]
                row["answer_prob"] = float(chosen.mean())
                row["answer_rank"] = float((probs > chosen[:, None]).sum(-1).float().mean())
            rows.append(row)
    return pd.DataFrame(rows)
