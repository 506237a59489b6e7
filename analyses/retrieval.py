"""Retrieval heads (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality").

A needle sentence carrying a random token sequence is placed at a depth of a long haystack, a question follows,
and the model reproduces the sequence by greedy decoding with its KV cache. At each generated token, each head's
top-1 attended key comes from ``interp.stats`` on that step's single query row (O(n), never n x n); the head
scores ``1 / |needle|`` when that key lies inside the needle and holds the token being generated. A head's
retrieval score is its mean over trials (lengths x depths), counting, as Wu et al. do, only the trials the model
answered (at least ``min_recall`` of the needle's tokens generated); 95% intervals resample the trials.

Prompts come from the project's own text (``analyses/data/sentences.txt``, sentences shuffled and repeated to
the length) and a needle "The secret code is 7 3 9 ...". A model without a tokenizer gets random ordinary tokens
as haystack and a needle ``key + random tokens``, the question being the key again: copying the sequence is then
what an induction head does.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from numbers import Real

import pandas as pd
import torch

from interp.progress import progress
from interp.site_pass import each_site
from interp.streaming import cache_kwarg, output_cache

from .prompts import _ordinary_ids, _special_frame, haystack, refuse_unreadable
from .bootstrap import check_n_bootstrap

__all__ = ["NeedlePrompt", "needle_prompts", "shortest_needle_prompt", "run_needle", "retrieval_step_hits",
           "retrieval_heads"]

_INTRO, _QUESTION = " The secret code is", "\n\nQuestion: What is the secret code? Answer: The secret code is"


@dataclass
class NeedlePrompt:
    """ids: (p,) the prompt. needle: (start, end) positions of the needle's random tokens; ``answer`` is
    ``ids[start:end]``."""

    ids: torch.Tensor
    needle: tuple[int, int]
    length: int
    depth: float

    @property
    def answer(self) -> torch.Tensor:
        return self.ids[self.needle[0]:self.needle[1]]


def _check_needle_len(model, needle_len) -> None:
    """A positive integer; without a tokenizer the needle's distinct ordinary tokens and its 2-token key must fit
    the vocabulary (a needle was silently cut to what did)."""
    if isinstance(needle_len, bool) or not isinstance(needle_len, int) or needle_len < 1:
        raise ValueError(f"needle_len must be a positive integer (the needle's random digits, or random tokens for a "
                         f"model without a tokenizer); got {needle_len!r}.")
    if model.tokenizer is None and needle_len + 2 > len(pool := _ordinary_ids(model)):
        raise ValueError(f"needle_len {needle_len}: a needle of distinct random tokens and its 2-token key need "
                         f"{needle_len + 2} ordinary tokens, and this model's vocabulary has {len(pool)}; use "
                         f"needle_len <= {len(pool) - 2}.")


def _check_needle(model, lengths, depths, needle_len) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """lengths: positive integers up to the model's positions; depths: fractions in [0, 1] (neither empty); and
    ``_check_needle_len``."""
    _check_needle_len(model, needle_len)
    lengths, depths = tuple(lengths), tuple(depths)
    if not depths or any(isinstance(d, bool) or not isinstance(d, Real) or not 0 <= d <= 1 for d in depths):
        raise ValueError(f"depths are fractions of the haystack in [0, 1], at least one (e.g. (0.1, 0.5, 0.9)); "
                         f"got {depths}.")
    top = model.cfg.max_positions
    if not lengths or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= top for n in lengths):
        raise ValueError(f"lengths are prompt lengths in tokens, integers in [1, {top}] (the model's positions), at "
                         f"least one; got {lengths}.")
    return lengths, depths


def _needle_parts(model, needle_len: int, g: torch.Generator) -> tuple[list[int], list[int], list[int]]:
    """One needle's (intro, code, question) token ids: with a tokenizer the sentence "The secret code is" and
    ``needle_len`` random digits (often two tokens each: a space and the digit), else a random 2-token key and
    ``needle_len`` random distinct tokens, the question being the key again."""
    tok = model.tokenizer
    if tok is None:
        pool = _ordinary_ids(model)
        picked = pool[torch.randperm(len(pool), generator=g)[: needle_len + 2]]
        key, code = picked[:2].tolist(), picked[2:].tolist()
        return key, code, key
    digits = torch.randint(10, (needle_len,), generator=g).tolist()
    code = tok(" " + " ".join(map(str, digits)), add_special_tokens=False)["input_ids"]
    return (tok(_INTRO, add_special_tokens=False)["input_ids"], code,
            tok(_QUESTION, add_special_tokens=False)["input_ids"])


def shortest_needle_prompt(model, needle_len: int = 8) -> int:
    """The fewest tokens a needle prompt takes on this model (a haystack of one token): start tokens, intro,
    needle, stop and question."""
    intro, code, question = _needle_parts(model, needle_len, torch.Generator().manual_seed(0))
    return len(_special_frame(model)[0]) + len(intro) + len(code) + 1 + len(question) + 1


def needle_prompts(model, lengths, depths, needle_len: int = 8, seed: int = 0) -> list[NeedlePrompt]:
    """One prompt of each length (tokens) at each depth (0 = start of the haystack, 1 = its end), a fresh random
    needle each. ``len(prompt.answer)`` is the needle's length in tokens (with a tokenizer, ``needle_len`` digits
    are often twice as many tokens)."""
    lengths, depths = _check_needle(model, lengths, depths, needle_len)
    g = torch.Generator().manual_seed(seed)
    prefix, _ = _special_frame(model)
    tok = model.tokenizer
    out = []
    for length in lengths:
        for depth in depths:
            intro, code, question = _needle_parts(model, needle_len, g)
            if tok is None:
                pool = _ordinary_ids(model)
                filler = lambda n: pool[torch.randint(len(pool), (n,), generator=g)].tolist()  # noqa: E731
            else:
                filler = lambda n: haystack(tok, n, g)  # noqa: E731
            n_hay = length - len(prefix) - len(intro) - len(code) - 1 - len(question)
            if n_hay < 1:
                raise ValueError(f"length {length} leaves no room for a haystack: on this model a needle prompt's "
                                 f"other parts (start tokens, intro, a needle of {len(code)} tokens, a stop and the "
                                 f"question) take {length - n_hay} tokens, so a length needs at least "
                                 f"{length - n_hay + 1}; give longer lengths (or a smaller needle_len).")
            hay = filler(n_hay)
            at = round(depth * n_hay)
            stop = [] if tok is None else tok(".", add_special_tokens=False)["input_ids"][:1]
            tail = stop or filler(1)
            start = len(prefix) + at + len(intro)
            ids = prefix + hay[:at] + intro + code + tail + hay[at:] + question
            refuse_unreadable(model, ids, "The needle prompt", "Use a model whose tokenizer reads English text and "
                              "digits.")
            out.append(NeedlePrompt(torch.tensor(ids), (start, start + len(code)), length, float(depth)))
    return out


def retrieval_step_hits(top: torch.Tensor, token: int, ids: torch.Tensor, needle: tuple[int, int]) -> torch.Tensor:
    """top: (l, h) absolute key positions of each head's top-1 weight at one generation step; token: the token that
    step generated. Returns (l, h) booleans: the position lies inside the needle and holds ``token``."""
    inside = (top >= needle[0]) & (top < needle[1])
    held = ids[top.clamp(0, len(ids) - 1)]
    return inside & (held == token)


def run_needle(model, prompt: NeedlePrompt, n_steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding of ``n_steps`` (default |needle|) tokens with the KV cache; returns the generated ids
    ``(n_steps,)`` and each head's top-1 absolute key position at each step ``(n_steps, l, h)`` (-1 for a pruned
    model's missing heads)."""
    cfg = model.cfg
    n_steps = len(prompt.answer) if n_steps is None else n_steps
    top = torch.full((n_steps, cfg.n_layers, max(cfg.heads_per_layer)), -1, dtype=torch.long)
    step = [0, len(prompt.ids)]  # step, positions seen including the current query

    def visit(read) -> None:  # one query row (the last) against the whole cache (a sliding layer's: its window)
        at = read.top_keys(last=1)[0, :, -1].cpu()  # (h,)
        top[step[0], read.index, : len(at)] = step[1] - read.key_valid.shape[1] + at

    generated = []
    with torch.no_grad():
        cache, ids, name = None, prompt.ids[None].to(model.device), cache_kwarg(model.hf)
        for t in range(n_steps):
            step[0], step[1] = t, len(prompt.ids) + t
            out = each_site(model, {"input_ids": ids, "attention_mask": None}, visit, stop=False, use_cache=True,
                            logits_to_keep=1, **{name: cache})
            cache = output_cache(out)
            token = out.logits[0, -1].argmax()
            generated.append(int(token))
            ids = token.view(1, 1)
    return torch.tensor(generated), top


def retrieval_heads(model, context: int | None = None, lengths=None, depths=(0.1, 0.5, 0.9), needle_len: int = 8,
                    min_recall: float = 0.5, n_bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Each head's retrieval score: one row per (layer, head) with ``retrieval``, ``retrieval_lo``/``_hi``.

    context: the longest prompt in tokens (default: the model's positions, at most 8192); lengths: prompt lengths
    (default ``context // 2`` and ``context``, so context is at least twice ``shortest_needle_prompt``); depths:
    where the needle sits in the haystack (fractions in [0, 1]); needle_len: the needle's random digits (random
    tokens without a tokenizer); min_recall: in [0, 1]. ``df.attrs["trials"]`` lists each trial's length, depth,
    needle tokens, recall and whether it counted; ``df.attrs["needle_tokens"]`` the needles' length in tokens.
    No trial counted: NaN scores (labelled ``"nan"``) and a warning.
    """
    cfg = model.cfg
    if not cfg.causal:
        raise ValueError("Retrieval heads are read while a causal model generates; this model is bidirectional.")
    check_n_bootstrap(n_bootstrap)
    if isinstance(min_recall, bool) or not isinstance(min_recall, Real) or not 0 <= min_recall <= 1:
        raise ValueError(f"min_recall is the share of the needle's tokens a trial must generate to count, in [0, 1] "
                         f"(Wu et al.: 0.5); got {min_recall!r}.")
    _check_needle_len(model, needle_len)
    context = min(cfg.max_positions, 8192) if context is None else context
    low = 2 * shortest_needle_prompt(model, needle_len) if lengths is None else 1
    if isinstance(context, bool) or not isinstance(context, int) or not low <= context <= cfg.max_positions:
        why = (f": the default lengths are context // 2 and context, and on this model a needle prompt (needle_len "
               f"{needle_len}) takes at least {low // 2} tokens" if lengths is None else "")
        raise ValueError(f"context must be an integer in [{low}, {cfg.max_positions}] (the model's positions){why}; "
                         f"got {context!r}.")
    lengths = (context // 2, context) if lengths is None else tuple(lengths)
    prompts = needle_prompts(model, lengths, depths, needle_len, seed)
    n_heads = max(cfg.heads_per_layer)
    scores, trials = [], []
    with model.studying():
        for p in progress(prompts, total=len(prompts), desc="retrieval: needle trials", unit="trial"):
            generated, top = run_needle(model, p)
            answer = p.answer
            hits = torch.stack([retrieval_step_hits(top[t], int(generated[t]), p.ids, p.needle)
                                for t in range(len(generated))])  # (steps, l, h)
            recall = float(torch.isin(answer, generated).float().mean())
            counted = recall >= min_recall
            trials.append({"length": len(p.ids), "depth": p.depth, "needle_tokens": len(answer), "recall": recall,
                           "counted": counted, "exact": bool(torch.equal(generated, answer))})
            if counted:
                scores.append(hits.sum(0).double() / len(answer))  # (l, h)
    layer = torch.arange(cfg.n_layers).repeat_interleave(n_heads)
    head = torch.arange(n_heads).repeat(cfg.n_layers)
    if scores:
        per_trial = torch.stack(scores).flatten(1)  # (trials, l * h)
        g = torch.Generator().manual_seed(seed)
        draws = torch.randint(len(scores), (n_bootstrap, len(scores)), generator=g)
        boot = per_trial[draws].mean(1)  # (n_bootstrap, l * h)
        mean = per_trial.mean(0)
        lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=0)
    else:
        mean = lo = hi = torch.full((cfg.n_layers * n_heads,), float("nan"), dtype=torch.float64)
        warnings.warn(f"retrieval: no trial counted (none of the {len(trials)} generated at least min_recall "
                      f"{min_recall} of its needle), so no head was measured: the scores are NaN and their label "
                      "'nan'. A model that cannot copy the needle has no retrieval heads to find; try shorter "
                      "lengths or a lower min_recall.", RuntimeWarning, stacklevel=2)
    df = pd.DataFrame({"layer": layer.numpy(), "head": head.numpy(), "retrieval": mean.numpy(),
                       "retrieval_lo": lo.numpy(), "retrieval_hi": hi.numpy()})
    real = set(cfg.heads())
    df = df[[(l, h) in real for l, h in zip(df["layer"], df["head"])]].reset_index(drop=True)
    sizes = sorted({t["needle_tokens"] for t in trials})
    needle = (f"{needle_len} random tokens" if model.tokenizer is None
              else f"{needle_len} random digits ({'/'.join(map(str, sizes))} tokens)")
    df.attrs.update(trials=trials, inputs=f"needle-in-a-haystack: lengths {list(lengths)}, depths {list(depths)}, "
                                          f"needles of {needle}", min_recall=min_recall,
                    needle_tokens=sizes[0] if len(sizes) == 1 else sizes)
    return df


def retrieval_frame(model, names: list[str], seed: int = 0, n_bootstrap: int = 1000, context: int | None = None,
                    **_) -> pd.DataFrame:
    """The registry's runner of ``retrieval`` (``detect_heads(model, scores=["retrieval"], context=...)``)."""
    with model.studying():
        return retrieval_heads(model, context=context, seed=seed, n_bootstrap=n_bootstrap)
