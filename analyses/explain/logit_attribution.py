"""Direct logit attribution and the logit lens over the stack that feeds the logits, written once over sites.

The readout stack is the model's decoder stack: every block of a decoder-only model, the decoder blocks of an
encoder-decoder model (T5, BART, ...), each with its sites (self-attention, and cross-attention where the block has
it) writing into one residual stream. What differs between models is found on the run, not listed per family:

- the final norm: among the norms beside the blocks (or none, as in BART), the one with which the output layer
  reproduces the run's logits; a constant the logits are multiplied by (T5's ``d_model ** -0.5`` with tied
  embeddings, Cohere's ``logit_scale``) is read off the same run;
- post-norm blocks (BART, Marian): a block whose output is a norm's output normalises the stream itself after each
  sublayer; each such norm is frozen at this run's scale (affine), so every component's contribution is carried
  through it and the split stays exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pandas as pd
from transformers.pytorch_utils import Conv1D

from hooks.names import hook_name
from interp.model.config import real_sites
from interp.runtime.distributed import onloaded
from interp.attention.sites import FRONT, head_columns, is_layered
from interp.tokens.display import display_tokens

from ..causal.attribution import _check_position, frozen_norm, token_ids
from ..data.batches import _main_output, batch_of
from ..causal.engine import _arguments

__all__ = ["direct_logit_attribution", "logit_lens"]


# -- the readout stack ---------------------------------------------------------------------------------------------
def _stack(model) -> tuple[list, list[list]]:
    """The readout stack's block modules and, per block, its sites in call order; clear errors where there is none."""
    sites = [s for s in model.cfg.sites if s.stack == "decoder"]
    unembed = model.hf.get_output_embeddings()
    if not sites or unembed is None:
        raise NotImplementedError(
            "Logit attribution needs a causal LM (a decoder stack) with an output layer; this model has "
            f"{'no output layer' if unembed is None else 'bidirectional attention only (an encoder)'}.")
    blocks = model._blocks["decoder"] if isinstance(model._blocks, dict) else model._blocks
    real = set(real_sites(model))  # not a site pruned empty: its zeroed placeholder head is not a head
    per_block = [[s for s in sites if s.block == b and s in real] for b in range(len(blocks))]
    return blocks, per_block


def _readout_stack(model) -> str | None:
    """The stack whose block hooks the readout reads (``hooks.names.hook_name``'s ``stack``): None where the model
    has one stack (``blocks.N.hook_...``), ``"decoder"`` in an encoder-decoder model (``decoder.blocks.N.hook_...``)."""
    return None if is_layered(model) else "decoder"


def _out_name(stack: str | None, site) -> str:
    return hook_name("cross_attn_out" if site.kind == "cross" else "attn_out", site.block, stack)


def _is_norm(module) -> bool:
    return "Norm" in type(module).__name__


def _readout(model, blocks, final: torch.Tensor, logits: torch.Tensor):
    """``(norm or None, scale, logit bias (vocab,) or None)`` with which ``scale * unembed(norm(final)) + bias``
    is the run's logits: the candidate norms are those beside the blocks (siblings of the block list), the final
    norm a decoder-only model's probe found, and none; the one that reproduces the logits best wins (exactly
    where nothing else sits on the logits)."""
    unembed = model.hf.get_output_embeddings()
    holder = next((m for m in model.hf.modules() if any(c is blocks for c in m.children())), None)
    candidates = [None] + ([m for m in holder.children() if _is_norm(m)] if holder is not None else [])
    known = getattr(getattr(model, "structure", None), "final_norm", None)  # what a decoder-only probe found
    if known is not None and all(model.hf.get_submodule(known) is not c for c in candidates):
        candidates.append(model.hf.get_submodule(known))
    bias = getattr(model.hf, "final_logits_bias", None)  # BART's family adds a buffer to its logits (no module)
    bias = None if bias is None else bias.detach().float().reshape(-1).to(logits.device)
    target = logits - (0.0 if bias is None else bias)
    best = None
    with torch.no_grad(), onloaded(unembed, *[c for c in candidates if c is not None]):
        for norm in candidates:
            computed = unembed(final if norm is None else norm(final)).float().to(logits.device)  # (n, vocab)
            scale = float((computed * target).sum() / (computed * computed).sum().clamp(min=1e-30))
            error = float((target - scale * computed).abs().max())
            exact = error <= 1e-4 * max(1.0, float(target.abs().max()))
            if not exact:
                scale = 1.0
            if best is None or error < best[0]:
                best = (error, norm, scale if abs(scale - 1.0) > 1e-6 else 1.0)
    return best[1], best[2], bias


def _norm_calls(blocks, position: int):
    """Record, per block, every norm's (input, output) at ``position`` during a run: torch hooks, removed by
    ``close()``."""
    calls: list[list] = [[] for _ in blocks]
    handles = []
    for index, block in enumerate(blocks):
        for module in block.modules():
            if _is_norm(module):
                def hook(m, args, out, index=index):
                    x, y = args[0], out[0] if isinstance(out, tuple) else out
                    if x.ndim == 3:
                        calls[index].append((m, x[:, position].detach().float(), y[:, position].detach().float()))
                handles.append(module.register_forward_hook(hook))
    return calls, handles


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-5 * max(1.0, float(b.abs().max())), rtol=1e-5))


# -- direct logit attribution --------------------------------------------------------------------------------------
def direct_logit_attribution(model, inputs, answer, wrong=None, position: int = -1) -> pd.DataFrame:
    """Each component's direct contribution to ``logit[answer] - logit[wrong]`` (or ``logit[answer]``) at
    ``position`` (of the decoder's positions), averaged over the batch.

    answer, wrong: a token id, one per sequence, or a one-token string. The residual stream of the decoder stack
    entering the final norm is the sum of the embedding (``hook_resid_pre`` of block 0), every head's projected
    output (self- and cross-attention sites alike), every MLP's output and the output projections' biases; with
    the final norm's scale frozen at this run's value the norm is affine, and each part maps to the logit through
    the unembedding. In post-norm blocks (BART) each norm on the stream is frozen the same way.

    Rows: ``component`` (``embed``, ``head``, ``mlp``, ``bias``: output-projection, norm and unembedding biases,
    and ``remainder``), then the head's columns (``stack``, ``kind``, ``site``, ``layer``, ``head``; ``mlp`` rows
    have ``stack`` and ``layer``), ``attribution``. A constant the model multiplies its logits by (T5, Cohere,
    Granite) is found on the run and applied (``df.attrs["logit_scale"]``). They sum to the model's logit
    (difference) exactly: ``remainder`` is what the decomposition does not explain, 0 up to float error where the
    architecture allows an exact split (pre- and post-norm and parallel blocks) and nonzero where a norm or scale
    sits on a branch (Gemma 2/3's post-attention norms, Granite's residual multiplier) or on the logits
    (soft-capping). ``df.attrs`` holds the logit (difference) and the remainder.
    """
    blocks, per_block = _stack(model)
    batch = batch_of(model, inputs)
    queries = next(s for s in model.cfg.sites if s.stack == "decoder").queries
    n = batch[queries].shape[0]
    position = _check_position(position, batch[queries].shape[1])
    answer = token_ids(model, answer, n, "answer")
    wrong = None if wrong is None else token_ids(model, wrong, n, "wrong")
    stack, last = _readout_stack(model), len(blocks) - 1
    hooks = set(model.hook_names())
    names = ([hook_name("resid_pre", 0, stack)] + [hook_name("resid_post", b, stack) for b in range(len(blocks))]
             + [hook_name("z", s) for sites in per_block for s in sites]
             + [_out_name(stack, s) for sites in per_block for s in sites]
             + [name for b in range(len(blocks)) if (name := hook_name("mlp_out", b, stack)) in hooks])
    calls, handles = _norm_calls(blocks, position)
    try:
        with model.studying(), torch.no_grad():
            args, kwargs = _arguments(batch)
            out, cache = model.run_with_cache(*args, names=names, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    device = model.device
    at = {name: cache[name][:, position].float().to(device) for name in names if "hook_z" not in name}  # (n, m)
    logits = _main_output(out)[:, position].float().to(device)  # (n, vocab)
    rows_ = torch.arange(n)
    target = logits[rows_, answer] - (logits[rows_, wrong] if wrong is not None else 0.0)
    final = at[hook_name("resid_post", last, stack)]
    norm, scale, logit_bias = _readout(model, blocks, final, logits)
    unembed = model.hf.get_output_embeddings()
    with onloaded(unembed):  # weights offloaded by a device map are read here, outside a forward
        w_u = unembed.weight.detach().float().to(device)
        direction = w_u[answer] - (w_u[wrong] if wrong is not None else 0.0)  # (n, m)
        u_bias = None if getattr(unembed, "bias", None) is None else unembed.bias.detach().float().to(device)
    del w_u
    # components: (row, vector (n, m) at the position); every norm on the stream maps all of them
    parts = [({"component": "embed"}, at[hook_name("resid_pre", 0, stack)])]
    bias = torch.zeros_like(final)
    stream = at[hook_name("resid_pre", 0, stack)]

    def through(norm_module, x_in):  # freeze a norm on the stream at its input x_in; map every part through it
        nonlocal parts, bias
        apply, beta = frozen_norm(norm_module, x_in)
        parts = [(row, apply(v)) for row, v in parts]
        bias = apply(bias) + beta

    for b, block_sites in enumerate(per_block):
        post = next((c for c in calls[b] if _close(c[2], at[hook_name("resid_post", b, stack)])), None)
        for site in block_sites:
            o_proj = model.o_proj_of(site)
            if o_proj is None:
                continue
            z = cache[hook_name("z", site)][:, position].float().to(device)  # (n, h, e)
            with onloaded(o_proj):
                w = o_proj.weight.detach().float().to(device)
                w = w if isinstance(o_proj, Conv1D) else w.T  # Conv1D (h e, m) or Linear (m, h e)
                result = torch.einsum("nhe,hem->hnm", z, w.reshape(z.shape[1], z.shape[2], -1))
                if getattr(o_proj, "bias", None) is not None:
                    bias = bias + o_proj.bias.detach().float().to(device)
            parts += [({"component": "head", **head_columns(model, (site.name, h))}, result[h])
                      for h in range(result.shape[0])]
            stream = stream + at[_out_name(stack, site)]
            if post is not None:  # post-norm: the stream is normalised after each sublayer
                normed = next((c for c in calls[b] if _close(c[1], stream)), None)
                if normed is not None:
                    through(normed[0], normed[1])
                    stream = normed[2]
        mlp_row = {"component": "mlp", "stack": "decoder", "layer": b}
        mlp = at.get(hook_name("mlp_out", b, stack))  # what the MLP adds; where there is no hook, by difference
        if post is not None:  # post-norm: the block's last norm comes after the MLP's add, with or without a hook
            parts.append((mlp_row, post[1] - stream if mlp is None else mlp))
            through(post[0], post[1])
        else:
            parts.append((mlp_row, at[hook_name("resid_post", b, stack)] - stream if mlp is None else mlp))
        stream = at[hook_name("resid_post", b, stack)]
    if norm is not None:
        with onloaded(norm):
            through(norm, final)

    def attribute(c):  # (n, m) -> the batch mean of its logit contribution
        return float(scale * (c * direction).sum(-1).mean())

    rows = [{**row, "attribution": attribute(v)} for row, v in parts]
    bias_value = attribute(bias)
    for extra in (u_bias, logit_bias):
        if extra is not None:
            bias_value += float((extra[answer] - (extra[wrong] if wrong is not None else 0.0)).mean())
    rows.append({"component": "bias", "attribution": bias_value})
    explained = sum(r["attribution"] for r in rows)
    total = float(target.mean())
    rows.append({"component": "remainder", "attribution": total - explained})
    df = pd.DataFrame(rows, columns=["component", *FRONT, "attribution"])
    df["layer"], df["head"] = df["layer"].astype("Int64"), df["head"].astype("Int64")
    df.attrs.update(logit=total, remainder=total - explained, logit_scale=scale, answer=answer.tolist(),
                    wrong=None if wrong is None else wrong.tolist(), position=position, stack="decoder")
    return df


# -- the logit lens ------------------------------------------------------------------------------------------------
def logit_lens(model, inputs, answer=None, position: int = -1, k: int = 5) -> pd.DataFrame:
    """The decoder stack's residual stream after each block read as the model's final prediction: through the
    final norm (as it is, not frozen), the unembedding and any constant scale or bias on the logits, at
    ``position``, probabilities averaged over the batch.

    Rows: ``layer`` (``-1`` is the embedding), ``top_tokens`` (the ``k`` most probable, as strings when the
    model has a tokenizer), ``top_prob``, and with ``answer`` its ``answer_prob`` and ``answer_rank`` (0 best).
    """
    blocks, _ = _stack(model)
    batch = batch_of(model, inputs)
    queries = next(s for s in model.cfg.sites if s.stack == "decoder").queries
    n = batch[queries].shape[0]
    position = _check_position(position, batch[queries].shape[1])
    vocab = model.cfg.vocab_size
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"k is how many top tokens to list: an integer from 1 to the vocabulary size {vocab}; "
                         f"got {k!r}.")
    answer = None if answer is None else token_ids(model, answer, n, "answer")
    stack = _readout_stack(model)
    names = [hook_name("resid_pre", 0, stack)] + [hook_name("resid_post", b, stack) for b in range(len(blocks))]
    unembed = model.hf.get_output_embeddings()
    with model.studying(), torch.no_grad():
        args, kwargs = _arguments(batch)
        out, cache = model.run_with_cache(*args, names=names, **kwargs)
        logits = _main_output(out)[:, position].float()
        norm, scale, bias = _readout(model, blocks, cache[names[-1]][:, position].to(logits.device), logits)
        rows = []
        for layer, name in zip(range(-1, len(blocks)), names):
            x = cache[name][:, position]
            read = scale * unembed(x if norm is None else norm(x)).float()
            probs = F.softmax(read if bias is None else read + bias.to(read.device), dim=-1)  # (n, vocab)
            mean = probs.mean(0)
            top = mean.topk(k)
            tokens = top.indices.tolist()
            if model.tokenizer is not None:
                tokens = display_tokens(model.tokenizer, tokens)
            row = {"layer": layer, "top_tokens": tokens, "top_prob": float(top.values[0])}
            if answer is not None:
                chosen = probs[torch.arange(n), answer.to(probs.device)]
                row["answer_prob"] = float(chosen.mean())
                row["answer_rank"] = float((probs > chosen[:, None]).sum(-1).float().mean())
            rows.append(row)
    df = pd.DataFrame(rows)
    df.attrs.update(stack="decoder", position=position)
    return df
