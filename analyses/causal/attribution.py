"""Attribution: first-order patching estimates, direct logit attribution and the logit lens.

- ``attribution_patching`` (Nanda 2023; Syed et al. 2023): activation patching's ``patched - corrupted`` for every
  head at once, estimated as ``(z_clean - z_corrupted) . d metric / d z`` at the corrupted run, summed over the
  batch and positions: one clean forward, one corrupted forward and one backward.
- the final norm frozen at a run's scale (``frozen_norm``) and token ids read from user input (``token_ids``), which
  direct logit attribution and the logit lens (``analyses.explain.logit_attribution``) build on.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

import pandas as pd

from hooks.names import hook_name
from interp.tokens.inputs import encode
from interp.structure.norms import norm_centres, norm_eps
from interp.attention.sites import FRONT, check_heads, head_columns, site_of

from ..data.batches import check_position as _check_position
from .engine import Shard, _arguments, _run, kept_logits
from .patching import paired_batches, scalar_metric

__all__ = ["attribution_patching", "frozen_norm", "token_ids"]


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

    Every kind of model (``interp.attention.sites``): one row per (site, head), with the head's columns first (``stack``,
    ``kind``, ``site``, ``layer``, ``head``); an encoder-decoder model's batches hold ``decoder_input_ids`` too.
    """
    if by not in ("head", "head_pos"):
        raise ValueError(f"by must be 'head' or 'head_pos'; got {by!r}.")
    metric = scalar_metric(metric)
    clean, corrupted = paired_batches(model, clean, corrupted)
    heads = model.cfg.heads() if heads is None else check_heads(model, heads)
    sites = list(dict.fromkeys(site_of(model, head).name for head in heads))
    names = [hook_name("z", site) for site in sites]
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
    keep = kept_logits(model, metric, corrupted)  # the logits the metric reads, and no others
    with model.studying():
        with torch.no_grad():
            args, kwargs = _arguments(clean)
            out, cache = model.run_with_cache(*args, names=names, **kwargs, **keep)
            clean_value = metric(out, clean)
        deltas, z_corrupted = {}, {}

        def opening(z, point):  # z + delta: the gradient w.r.t. delta is the total derivative w.r.t. z
            deltas[point.name] = torch.zeros_like(z, requires_grad=True)
            z_corrupted[point.name] = z.detach()
            return z + deltas[point.name]

        with torch.enable_grad():
            for p in model.hf.parameters():
                p.requires_grad_(False)
            with model.hooks([(names, opening)]), _contiguous_output_layer(model):
                out = _run(model, corrupted, **keep)
            per_example = metric.per_example(out, corrupted).float()
            value = per_example.mean() if n is None else per_example.sum() / n
            if not value.requires_grad:
                raise TypeError(f"attribution_patching differentiates the metric; {metric.name} returned a value "
                                "without a gradient. Use a metric from analyses.data.metrics or one returning a tensor.")
            grads = torch.autograd.grad(value, [deltas[name] for name in names], allow_unused=True)
        with torch.no_grad():
            corrupted_value = metric(out, corrupted)
            estimates = {}
            for name, grad in zip(names, grads):
                diff = cache[name].float() - z_corrupted[name].float()  # (b, p, h, e)
                estimates[name] = (diff * grad.float()).sum(3) if grad is not None else torch.zeros(diff.shape[:3])
    return clean_value, corrupted_value, estimates


@contextmanager
def _contiguous_output_layer(model):
    """The output layer's input made contiguous. With ``logits_to_keep`` it is a slice of the last positions (a
    strided view), and on a view that needs a gradient torch's matmul does not fold the batch into one matrix
    product: it runs a batched product against the weight expanded per row, forward and backward (on SmolLM2 with
    12 of 25 positions kept, 0.37 s of a 2.2 s attribution run on one thread, against 0.7 s for a whole forward).
    A copy of the kept rows costs next to nothing and gives the same values."""
    layer = getattr(model.hf, "get_output_embeddings", lambda: None)()
    handle = None if layer is None else layer.register_forward_pre_hook(
        lambda module, args: (args[0].contiguous(), *args[1:]) if args and torch.is_tensor(args[0]) else None)
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


# -- the final norm, frozen --------------------------------------------------------------------------------------
def frozen_norm(norm, x: torch.Tensor):
    """The final norm at the residual ``x: (n, m)`` with its scale frozen: ``(apply, bias)`` where ``apply(c)``
    maps a component ``c: (..., n, m)`` linearly and ``apply(x) + bias`` equals ``norm(x)``.

    LayerNorm: ``gamma * (c - mean(c)) / sigma(x)`` and bias ``beta``. RMSNorm (any weight convention, such as
    Gemma's ``1 + w``): ``w_eff * c / rms(x)``, with ``w_eff`` read off the module on a vector of ones.
    """
    eps = norm_eps(norm, x.shape[-1])
    x = x.float()
    if isinstance(norm, torch.nn.LayerNorm) or ("RMS" not in type(norm).__name__ and "LayerNorm" in type(norm).__name__
                                                and norm_centres(norm, x.shape[-1])):
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


def _one_token(model, text: str, what: str) -> int:
    if model.tokenizer is None:
        raise ValueError(f"{what} is text but this model has no tokenizer; give a token id.")
    ids = encode(model.tokenizer, text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{what} {text!r} is {len(ids)} tokens; give one token (e.g. with its leading space).")
    return ids[0]


def _unembedding(model):
    from ..data.seq2seq import is_seq2seq

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
