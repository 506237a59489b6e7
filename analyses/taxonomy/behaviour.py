"""The behavioural signature of copy suppression (McDougall et al. 2023, "Copy Suppression: Comprehensively
Understanding an Attention Head", section 3): on natural text, a copy-suppression head attends from a position to an
earlier token that the model, at that position and before the head, predicts, and its output lowers that token's
logit. ``analyses.taxonomy.weights``'s ``copy_suppression`` reads the same mechanism off the weights; this reads it off a run.

On windows of the bundled corpus (``n_prompts`` windows of ``seq_len`` tokens cut from the running text, each
after the tokenizer's leading special tokens; or token ids given as ``tokens``), for every head (l, h) and every
query position q >= 2:

    key(q)     = the earlier position the head attends to most, among positions 1 .. q-1 (position 0, the BOS or
                 first token where most heads park their attention, and q itself are left out)
    t(q)       = the token at key(q)
    predicted  = t(q) is among the ``k`` (default 10) largest logits of the logit lens at the head's input:
                 the final norm and the unembedding applied to ``blocks.{l}.hook_resid_pre`` at q
    effect     = the head's direct effect on t(q)'s logit at q: z_h(q) @ W_O^h, through the post-attention norm
                 (where the model has one, e.g. Gemma) and the final norm with their scales frozen at this run's
                 values, dotted with t(q)'s unembedding row (no bias)

Columns (one row per (layer, head)):

- ``copy_suppression_behaviour``: the share of query positions where t(q) is predicted *and* effect < 0.
- ``cs_attends_predicted``: the share of query positions where t(q) is predicted (the paper's attention half).
- ``cs_predicted_effect``: the mean effect over the positions where t(q) is predicted, in logits (negative:
  the head suppresses what it attends to; NaN where no position qualifies).

Every window has the same number of query positions, so the mean over windows is the mean over positions;
intervals (``_lo``/``_hi``) are a 95% percentile bootstrap over windows. No threshold is published for this
signature, so it labels no head: compare a head with the others (``benchmarks/validate_taxonomy.py
--behaviour`` compares the weight-based copy suppressors with random heads of the same layers).
"""

from __future__ import annotations

import pandas as pd
import torch

from hooks.names import hook_name
from interp.model.config import real_sites
from interp.runtime.distributed import onloaded
from interp.tokens.inputs import encode

from ..causal.attribution import _unembedding, frozen_norm
from ..explain.composition import head_weights
from ..data.bootstrap import check_n_bootstrap, mean_interval
from ..data.stability import split_half
from .base import check_k, refuse_non_lm

__all__ = ["copy_suppression_behaviour_scores", "corpus_windows"]


def corpus_windows(model, n_prompts: int = 32, seq_len: int = 64, seed: int = 0) -> torch.Tensor:
    """``(n_prompts, seq_len)`` token ids: the tokenizer's leading special tokens, then a window of the bundled
    corpus's running text (sentences joined by spaces) starting at a random token (``seed``)."""
    from ..data.prompts import _special_frame, corpus_sentences, refuse_unreadable

    if model.tokenizer is None:
        raise ValueError("corpus_windows tokenizes the bundled corpus: this model has no tokenizer; give tokens= "
                         "(a (batch, positions) tensor of token ids).")
    prefix, _ = _special_frame(model)
    stream = torch.tensor(encode(model.tokenizer, " ".join(corpus_sentences()), add_special_tokens=False))
    refuse_unreadable(model, stream, "The bundled corpus", "Give tokens= (a (batch, positions) tensor of token ids "
                      "of text this tokenizer reads).")
    body = seq_len - len(prefix)
    if body < 3 or len(stream) < body:
        raise ValueError(f"seq_len must leave at least 3 tokens after {len(prefix)} special token(s) and fit the "
                         f"corpus ({len(stream)} tokens); got {seq_len}.")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(stream) - body + 1, (n_prompts,), generator=g)
    rows = [torch.cat([torch.tensor(prefix, dtype=torch.long), stream[s:s + body]]) for s in starts.tolist()]
    return torch.stack(rows)


def _check_tokens(model, tokens) -> torch.Tensor:
    ids = torch.as_tensor(tokens)
    if ids.dim() != 2 or ids.shape[1] < 3 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"tokens must be integer token ids of shape (batch, positions) with at least 3 positions; "
                         f"got shape {tuple(ids.shape)} and dtype {ids.dtype}.")
    if int(ids.min()) < 0 or int(ids.max()) >= model.cfg.vocab_size:
        raise ValueError(f"tokens must be ids in [0, {model.cfg.vocab_size}); got values from {int(ids.min())} to "
                         f"{int(ids.max())}.")
    return ids.long()


def _top_k(unembed, norm, resid: torch.Tensor, k: int, chunk: int = 256) -> torch.Tensor:
    """``(n, k)`` ids of the k largest logit-lens logits of each row of ``resid: (n, m)``, in chunks of rows."""
    out = []
    for i in range(0, resid.shape[0], chunk):
        part = resid[i:i + chunk]
        out.append(unembed(norm(part)).float().topk(k, dim=-1).indices.cpu())
    return torch.cat(out)


def copy_suppression_behaviour_scores(model, tokens=None, n_prompts: int = 32, seq_len: int = 64, k: int = 10,
                                      n_bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Every head's behavioural copy-suppression signature (module docstring): one row per (layer, head) with
    ``copy_suppression_behaviour`` (and ``_lo``/``_hi``), ``cs_attends_predicted`` (and ``_lo``/``_hi``) and
    ``cs_predicted_effect``. tokens: ``(batch, positions)`` ids without padding (default: ``corpus_windows``)."""
    refuse_non_lm(model, "The behavioural copy-suppression score")
    check_n_bootstrap(n_bootstrap)
    check_k(model, k)
    ids = _check_tokens(model, corpus_windows(model, n_prompts, seq_len, seed) if tokens is None else tokens)
    s = model.structure
    unembed = _unembedding(model)
    final_norm = model.hf.get_submodule(s.final_norm)
    layers = [s.block for s in real_sites(model)]
    last = model.cfg.n_layers - 1
    post = {l: s.post_attn_norm[l] for l in layers if s.post_attn_norm and s.post_attn_norm[l]}
    names = [hook_name("resid_post", last)]
    for l in layers:
        names += [hook_name("resid_pre", l), hook_name("z", l)]
        names += [hook_name(x, l) for x in (("pattern",) if model.attn == "eager" else ("q", "k"))]
        names += [hook_name("attn_out", l)] if l in post else []
    n, p = ids.shape
    with model.studying(), torch.no_grad():
        _, cache = model.run_with_cache(ids.to(model.device), names=names, device="cpu")
        final = cache[hook_name("resid_post", last)].float().reshape(n * p, -1)
        with onloaded(unembed, final_norm):
            w_u = unembed.weight.detach().float().cpu()
            apply_final, _ = frozen_norm(final_norm, final)
        keys = torch.arange(p)
        allowed = (keys[None, :] >= 1) & (keys[None, :] < keys[:, None])  # (q, k): positions 1 .. q-1
        rows, hits, suppressed = [], [], []
        for l in layers:
            resid = cache[hook_name("resid_pre", l)].reshape(n * p, -1)
            with onloaded(unembed, final_norm):
                top = _top_k(unembed, final_norm, resid.to(model.device), k).reshape(n, p, k)
            pattern = cache.pattern(l).float()  # (b, h, q, k): cached, or rebuilt from q and k as eager does
            key = pattern.masked_fill(~allowed, float("-inf")).argmax(-1)[:, :, 2:]  # (b, h, q-2)
            attended = ids[torch.arange(n)[:, None, None], key]  # (b, h, q-2)
            predicted = (attended[..., None] == top[:, None, 2:, :]).any(-1)  # (b, h, q-2)
            z = cache[hook_name("z", l)].float()  # (b, p, h, e)
            w_o = head_weights(model, l, fold_norms=False)["W_O"].float().cpu()  # (h, e, m)
            out = torch.einsum("bphe,hem->hbpm", z, w_o).reshape(z.shape[2], n * p, -1)  # (h, b*p, m)
            if l in post:
                norm = model._blocks[l].get_submodule(post[l])
                with onloaded(norm):
                    apply_post, _ = frozen_norm(norm, cache[hook_name("attn_out", l)].float().reshape(n * p, -1))
                out = apply_post(out)
            out = apply_final(out).reshape(-1, n, p, out.shape[-1])[:, :, 2:]  # (h, b, q-2, m)
            rows_u = w_u[attended]  # (b, h, q-2, m)
            effect = (out.permute(1, 0, 2, 3) * rows_u).sum(-1)  # (b, h, q-2)
            hits.append(predicted)
            suppressed.append(predicted & (effect < 0))
            for h in range(z.shape[2]):
                chosen = effect[:, h][predicted[:, h]]
                rows.append({"layer": l, "head": h, "cs_predicted_effect":
                             float(chosen.double().mean()) if chosen.numel() else float("nan")})
    df = pd.DataFrame(rows)
    stable = {}
    for name, parts in (("copy_suppression_behaviour", suppressed), ("cs_attends_predicted", hits)):
        per_window = torch.cat([x.double().mean(-1) for x in parts], 1)  # (b, heads)
        mean, lo, hi = mean_interval(per_window, n_bootstrap, seed)
        df[name], df[f"{name}_lo"], df[f"{name}_hi"] = mean.numpy(), lo.numpy(), hi.numpy()
        stable[name] = split_half(per_window, items="windows")  # the ranking on the even against the odd windows
    df = df[["layer", "head", "copy_suppression_behaviour", "cs_attends_predicted", "cs_predicted_effect",
             "copy_suppression_behaviour_lo", "copy_suppression_behaviour_hi", "cs_attends_predicted_lo",
             "cs_attends_predicted_hi"]]
    df.attrs.update(windows=n, positions=p, k=k, query_positions=p - 2, stability=stable)
    return df
