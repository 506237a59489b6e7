"""DuoAttention-style gates (Xiao et al. 2024, section 3.2): which heads need the whole context, found by optimisation.

Every key/value head gets a gate ``alpha`` in [0, 1] (DuoAttention gates key/value heads: a head's cache shrinks only
when all its query heads stream). Each of its query heads attends with the mixture

    pattern = alpha * full_pattern + (1 - alpha) * streaming_pattern      (z = pattern @ v mixes the same way)

where the streaming pattern is the softmax over the first ``sink`` and the last ``window`` keys only (exactly what
``interp.stream_heads`` computes). Starting from ``alpha = 1``, Adam lowers

    loss = distance(full model's output, gated model's output) + l1 * mean(alpha)

clamping ``alpha`` to [0, 1] after each step: the L1 term pushes every gate towards streaming, and only heads whose
streaming changes the output on the chosen positions keep a high gate. The distance is the KL divergence of the
next-token distributions (DuoAttention uses the squared error of the last hidden states; the KL needs no scale), or,
for a model without logits, the squared error of the last hidden states relative to their squared norm.

The default inputs are passkey-like, as DuoAttention's synthetic data: needle-in-a-haystack prompts
(``analyses.data.needles.needle_prompts``) followed by their answer, the distance taken on the answer's positions only.
Runs on the eager path (the mixture edits ``hook_attn_scores`` and ``hook_pattern``); a flash model is switched to
eager and back. The model is left as it was found (``model.studying()``).
"""

from __future__ import annotations

import pandas as pd
import torch
import torch.nn.functional as F

from hooks.names import hook_name
from interp.attention.sites import FRONT, head_columns
from interp.runtime.progress import progress
from interp.streaming import check_streamable, stream_heads

from ..data.batches import batch_of

__all__ = ["streaming_gates", "passkey_inputs"]


def passkey_inputs(model, tokens: int, depths=(0.1, 0.3, 0.5), needle_len: int = 8, seed: int = 0):
    """Passkey-like rows, ``(ids (len(depths), tokens + needle_len), positions (same shape, bool))``: each a
    needle-in-a-haystack prompt of ``tokens`` tokens with the needle at one depth, followed by the needle again;
    ``positions`` marks the positions that predict the repeated needle's tokens."""
    from ..data.needles import needle_prompts

    prompts = needle_prompts(model, [tokens], depths, needle_len, seed)
    ids = torch.stack([torch.cat([p.ids, p.answer]) for p in prompts])
    positions = torch.zeros_like(ids, dtype=torch.bool)
    positions[:, tokens - 1:-1] = True
    return ids, positions


def _distance(gated, full, positions) -> torch.Tensor:
    """Per row, the mean over ``positions`` (b, p) of KL(full || gated) of the next-token distributions, or the
    relative squared error of the last hidden states."""
    logits = getattr(gated, "logits", None)
    if logits is not None:
        full_logp = F.log_softmax(full.float(), dim=-1)
        kl = (full_logp.exp() * (full_logp - F.log_softmax(logits.float(), dim=-1))).sum(-1)  # (b, p)
    else:
        h = gated.last_hidden_state.float()
        kl = (h - full.float()).pow(2).sum(-1) / full.float().pow(2).sum(-1).mean().clamp_min(1e-12)
    w = positions.to(kl.dtype)
    return (kl * w).sum(1) / w.sum(1).clamp_min(1)


def _main(output) -> torch.Tensor:
    return output.logits if getattr(output, "logits", None) is not None else output.last_hidden_state


def streaming_gates(model, inputs=None, positions=None, sink: int = 4, window: int = 256, steps: int = 100,
                    lr: float = 0.05, l1: float = 0.05, tokens: int | None = None, seed: int = 0,
                    rows_per_pass: int = 1) -> pd.DataFrame:
    """One row per query head: the head's columns (``stack``, ``kind``, ``site``, ``layer``, ``head``), ``kv_head``
    and ``gate`` (its key/value head's alpha after
    ``steps`` Adam steps; low = can stream). ``df.attrs`` records the loss at the start and the end, the distance
    and the L1 term at the end, and the arguments.

    inputs: token ids ``(b, p)`` (or what ``batch_of`` takes) with ``positions`` ``(b, p)`` bool (default: every real
    position) where the outputs are compared; None: ``passkey_inputs(model, tokens)`` with ``tokens`` default
    ``min(2 * (sink + window), model positions - 8)``, so that a needle in the first half is out of every window.
    Order heads with ``streaming_order(..., order=df)`` (lowest gate first), or ``order="gates"`` in
    ``streaming_curve``. rows_per_pass: rows per forward and backward (their patterns and scores are held for
    the backward: ``2 * layers * heads * p^2`` fp32 numbers per row); the gradients of a step are summed over rows.
    """
    for name, value, least in (("steps", steps, 1), ("rows_per_pass", rows_per_pass, 1), ("lr", lr, 0),
                               ("l1", l1, 0)):
        whole = name in ("steps", "rows_per_pass")
        if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or not value >= least:
            raise ValueError(f"{name} must be {'an integer' if whole else 'a number'} >= {least}; got {value!r}.")
    with stream_heads(model, [], sink=sink, window=window):  # clear errors: the model, sink, window
        pass
    heads = check_streamable(model, "streaming_gates")  # Gemma 3: its global layers (the local ones keep a window)
    cfg = model.cfg
    if inputs is None:
        if tokens is None:
            tokens = min(2 * (sink + window), (cfg.max_positions or 1 << 30) - 8)
        inputs, positions = passkey_inputs(model, tokens, seed=seed)
    batch = batch_of(model, inputs)
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    positions = real if positions is None else torch.as_tensor(positions, dtype=torch.bool, device=ids.device)
    if positions.shape != ids.shape or not bool(positions.any()):
        raise ValueError(f"positions must be a bool mask of the inputs' shape {tuple(ids.shape)} with at least one "
                         f"position; got {tuple(positions.shape)}.")
    pos = real.long().cumsum(1) - 1  # (b, p): each row's own positions (left padding)
    gap = pos[:, :, None] - pos[:, None, :]  # (b, q, k)
    drop = (~((pos[:, None, :] < sink) | (gap < window)) & real[:, None, :] & real[:, :, None])[:, None]  # (b,1,q,k)
    layers = sorted({l for l, _ in heads})
    was = model.attn
    with model.studying():
        try:
            if was != "eager":
                model.set_attn("eager")
            for p in model.hf.parameters():
                p.requires_grad_(False)  # gradients for the gates only; studying() restores the flags
            gates = {l: torch.ones(cfg.kv_heads_per_layer[l], device=model.device, requires_grad=True) for l in layers}
            history = _optimise(model, ids, mask, positions, drop, gates, steps, lr, l1, rows_per_pass)
        finally:
            if model.attn != was:
                model.set_attn(was)
    rows = []
    for l, h in heads:
        group = cfg.heads_per_layer[l] // cfg.kv_heads_per_layer[l]
        rows.append({**head_columns(model, (l, h)), "kv_head": h // group, "gate": float(gates[l][h // group].detach())})
    df = pd.DataFrame(rows, columns=[*FRONT, "kv_head", "gate"])
    df.attrs.update(sink=sink, window=window, steps=steps, lr=lr, l1=l1, rows_per_pass=rows_per_pass, **history)
    return df


def _optimise(model, ids, mask, positions, drop, gates, steps, lr, l1, rows_per_pass: int = 1) -> dict:
    cfg = model.cfg
    with torch.no_grad():
        full = _main(model(ids, mask))
    stash: dict[int, torch.Tensor] = {}
    now = {"drop": drop}  # (rows, 1, q, k): the rows of the pass that runs

    def scores_hook(scores, hook):  # (b, h, q, k): keep the streaming pattern, leave the scores as they are
        stash[hook.layer] = torch.softmax(scores.float().masked_fill(now["drop"].to(scores.device), torch.finfo(
            torch.float32).min), dim=-1)
        return scores

    def pattern_hook(pattern, hook):  # (b, h, q, k): the mixture, one gate per key/value head
        l = hook.layer
        group = cfg.heads_per_layer[l] // cfg.kv_heads_per_layer[l]
        a = gates[l].repeat_interleave(group).to(pattern.device)[None, :, None, None]
        return a * pattern + (1 - a) * stash.pop(l).to(pattern.dtype)

    hooks = [([hook_name("attn_scores", l) for l in gates], scores_hook),
             ([hook_name("pattern", l) for l in gates], pattern_hook)]
    opt = torch.optim.Adam(list(gates.values()), lr=lr)
    n_gates = sum(g.numel() for g in gates.values())
    b = ids.shape[0]
    chunks = [slice(i, min(b, i + rows_per_pass)) for i in range(0, b, rows_per_pass)]
    first = None
    bar = progress(total=steps + 1, desc=f"streaming gates: {steps} Adam steps and a last measuring pass", unit="pass")
    with torch.enable_grad(), model.hooks(hooks):
        for step in range(steps + 1):  # the last pass only measures
            opt.zero_grad()
            distance = 0.0
            for rows in chunks:  # gradients summed over passes of a few rows: the patterns of one pass in memory
                now["drop"] = drop[rows]
                part = _distance(model(ids[rows], None if mask is None else mask[rows]), full[rows],
                                 positions[rows]).sum() / b
                if step < steps:
                    part.backward()
                distance += float(part.detach())
            reg = sum(g.sum() for g in gates.values()) / n_gates
            loss = distance + l1 * float(reg.detach())
            first = loss if first is None else first
            bar.update(1)
            if step == steps:
                break
            (l1 * reg).backward()
            opt.step()
            with torch.no_grad():
                for g in gates.values():
                    g.clamp_(0.0, 1.0)
    bar.close()  # not after an error: a log gets no "done" line for a stage that failed
    return {"loss_start": first, "loss_end": loss, "distance_end": distance, "l1_end": float(reg.detach())}
