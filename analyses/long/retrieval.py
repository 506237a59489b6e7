"""Retrieval heads (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality").

A needle sentence carrying a random token sequence is placed at a depth of a long haystack, a question follows,
and the model reproduces the sequence by greedy decoding with its KV cache. At each generated token, each head's
top-1 attended key comes from ``interp.attention.stats`` on that step's single query row (O(n), never n x n); the head
scores ``1 / |needle|`` when that key lies inside the needle and holds the token being generated. A head's
retrieval score is its mean over trials (lengths x depths), counting, as Wu et al. do, only the trials the model
answered; 95% intervals resample the trials, and ``df.attrs["stability"]["retrieval"]`` compares the scores of the
counted trials' two halves (``analyses.data.stability``).

Two protocols share the prompts' haystack (the project's own text, ``analyses/data/sentences.txt``, sentences
shuffled and repeated to the length), the decoding loop (``run_needle``) and the scoring rule; the prompts are
``analyses.data.needles``'s:

- ``"interp"`` (default): the needle " The secret code is 7 3 9 ..." (``needle_len`` spaced digits, on SmolLM2 a
  space and a digit token each), decoded for exactly |needle| steps; a trial counts when at least ``min_recall``
  of the needle's tokens were generated.
- ``"wu2024"``: Wu et al.'s protocol as their code runs it (github.com/nightdessert/Retrieval_Head,
  ``retrieval_head_detection.py``, commit 3ac171a). Theirs: three needles (``haystack_for_detect/needles.jsonl``,
  e.g. "The best thing to do in Beijing is to take a walk in Chaoyang Park and have a cup of Espresso in the
  evening.", the answer span "take a walk ... evening"), each in its own haystack; lengths
  ``round(linspace(min, max, 20))``, depths ``round(linspace(0, 100, 10))`` percent (``wu_grid``); the haystack cut
  to the length less a 200-token buffer and the needle, inserted at ``int(len * depth)`` moved back to just after a
  full stop (at 100% at the very end); the prompt
  ``context + "Based on the content of the book, Question: {q}\nAnswer:"``;
  the answer's span found by token-set overlap > 0.9 (``find_needle_idx``: the first window of |answer| tokens
  whose token set holds more than 90% of the answer's distinct tokens; it starts before the answer when the
  answer's last token repeats an earlier one, and it is found here the same way, ``needles.wu_needle_span``, the
  trials recording ``span`` and ``planted``); greedy decoding of up to 50 tokens, each step scored, stopping
  after a newline token; a trial counted when ``rouge_score``'s ROUGE-1 recall of the answer in the response,
  x100, exceeds 50; a head's score the mean of its per-trial scores over counted trials (a trial's score can pass
  1 when the model repeats the answer). Here: the needle " The special magic number for <city> is <needle_len
  digits>." (random city of 16, random digits; the answer span the digits), their question, their insertion and
  decoding rule, and, where the tokenizer has a chat template, their chat prompt (they use it for
  their chat models; an instruct model such as SmolLM2-135M-Instruct otherwise answers "<|im_end|>\n", and the
  newline ends every trial unanswered); each prompt exactly ``length`` tokens (no buffer); ``rouge1_recall`` is
  rouge_score's tokeniser
  without its Porter stemmer (equal on digits). A model without a tokenizer gets random ordinary tokens as
  haystack and a needle ``key + random tokens``, the question being the key again (copying the sequence is then
  what an induction head does), no stop token, and ROUGE-1 recall on token ids.
"""

from __future__ import annotations

import math
import warnings
from numbers import Real

import pandas as pd
import torch

from interp.runtime.progress import progress
from interp.attention.site_pass import each_site
from interp.streaming import cache_kwarg, output_cache

from ..data.bootstrap import check_n_bootstrap
from ..data.needles import (NeedlePrompt, _check_needle_len, _id_recall, _newline_stop, check_protocol, needle_prompts,
                      rouge1_recall, shortest_needle_prompt, shortest_wu_prompt, wu_grid, wu_needle_prompts)
from ..data.stability import halves, stability

__all__ = ["run_needle", "retrieval_step_hits", "retrieval_heads", "retrieval_frame"]

# "interp": our needle (random digits), |needle| greedy steps, token recall >= min_recall. "wu2024": Wu et al.'s
# (github.com/nightdessert/Retrieval_Head, retrieval_head_detection.py): a natural sentence, up to 50 greedy steps
# stopping at a newline, ROUGE-1 recall > min_recall. The module docstring and BENCHMARKS.md (issue 38) say more.


def retrieval_step_hits(top: torch.Tensor, token: int, ids: torch.Tensor, needle: tuple[int, int]) -> torch.Tensor:
    """top: (l, h) absolute key positions of each head's top-1 weight at one generation step; token: the token that
    step generated. Returns (l, h) booleans: the position lies inside the needle and holds ``token``."""
    inside = (top >= needle[0]) & (top < needle[1])
    held = ids[top.clamp(0, len(ids) - 1)]
    return inside & (held == token)


def run_needle(model, prompt: NeedlePrompt, n_steps: int | None = None,
               stop=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding of up to ``n_steps`` (default |needle|) tokens with the KV cache; returns the generated ids
    ``(steps,)`` and each head's top-1 absolute key position at each step ``(steps, l, h)`` (-1 for a pruned
    model's missing heads). stop: None, or ``stop(token_id) -> bool``, called after each step has been read: True
    ends the decoding there (the stopping token is kept and scored, as Wu et al.'s loop does)."""
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
            if stop is not None and stop(int(token)):
                break
    return torch.tensor(generated, dtype=torch.long), top[: len(generated)]


# -- the runner ----------------------------------------------------------------------------------------------------
def _halves_stability(per_trial: torch.Tensor, real: torch.Tensor) -> dict:
    """``analyses.data.stability`` on the mean score of the counted trials' two halves (even and odd trials: each spans
    every length), over the model's real heads; ``trials`` the two halves' sizes. Fewer than 2 trials: NaN."""
    if len(per_trial) < 2:
        return {"spearman": math.nan, "top_k_overlap": math.nan, "k": 0, "unstable": True,
                "trials": [len(per_trial), 0]}
    first, second = halves(len(per_trial))
    out = stability(per_trial[first][:, real].mean(0), per_trial[second][:, real].mean(0))
    return {**out, "trials": [len(first), len(second)]}


def retrieval_heads(model, context: int | None = None, lengths=None, depths=None, needle_len: int = 8,
                    min_recall: float = 0.5, n_bootstrap: int = 1000, seed: int = 0, protocol: str = "interp",
                    max_new_tokens: int = 50) -> pd.DataFrame:
    """Each head's retrieval score: one row per (layer, head) with ``retrieval``, ``retrieval_lo``/``_hi``.

    protocol: ``"interp"`` (default): a needle of ``needle_len`` random digits, exactly |needle| greedy steps, a
        trial counted when at least ``min_recall`` of the needle's tokens were generated. ``"wu2024"``: Wu et al.'s
        (their ``retrieval_head_detection.py``): the needle a sentence ("The special magic number for <city> is
        <needle_len digits>."), their question, greedy decoding of up to ``max_new_tokens`` (50) stopping after a
        newline, a trial counted when the ROUGE-1 recall of the answer in the response exceeds ``min_recall``
        (``rouge1_recall``; without a tokenizer, on token ids). Both score a step ``1 / |answer|`` for each head
        whose top-1 key lies in the answer's span and holds the token generated, and average over counted trials.
    context: the longest prompt in tokens (default: the model's positions, at most 8192); lengths: prompt lengths
        (default: ``context // 2`` and ``context``; wu2024: 4 lengths evenly from ``context // 4``, ``wu_grid``);
        depths: where the needle sits (fractions in [0, 1]; default (0.1, 0.5, 0.9); wu2024: 0, 25, 50, 75, 100%).
    needle_len: the needle's random digits (random tokens without a tokenizer); min_recall: in [0, 1].

    ``df.attrs``: ``trials`` (each trial's length, depth, needle tokens, steps, recall, whether it counted),
    ``trials_run`` and ``trials_counted``, ``protocol``, ``needle_tokens``, and ``stability["retrieval"]``: the
    scores of the counted trials' two halves compared (``analyses.data.stability``). No trial counted: NaN scores
    (labelled ``"nan"``) and a warning.
    """
    cfg = model.cfg
    check_protocol(protocol)
    if not cfg.causal:
        raise ValueError("Retrieval heads are read while a causal model generates; this model is bidirectional.")
    check_n_bootstrap(n_bootstrap)
    if isinstance(min_recall, bool) or not isinstance(min_recall, Real) or not 0 <= min_recall <= 1:
        raise ValueError(f"min_recall is the share of the needle's tokens a trial must generate to count, in [0, 1] "
                         f"(Wu et al.: 0.5); got {min_recall!r}.")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens (wu2024: the most tokens decoded per trial; Wu et al.: 50) must be a "
                         f"positive integer; got {max_new_tokens!r}.")
    _check_needle_len(model, needle_len)
    wu = protocol == "wu2024"
    context = min(cfg.max_positions, 8192) if context is None else context
    shortest = shortest_wu_prompt(model, needle_len) if wu else shortest_needle_prompt(model, needle_len)
    parts = 4 if wu else 2  # the default shortest length is context // parts
    low = parts * shortest if lengths is None else 1
    if isinstance(context, bool) or not isinstance(context, int) or not low <= context <= cfg.max_positions:
        why = (f": the default lengths start at context // {parts}, and on this model a needle prompt ({protocol} "
               f"protocol, needle_len {needle_len}) takes at least {shortest} tokens" if lengths is None else "")
        raise ValueError(f"context must be an integer in [{low}, {cfg.max_positions}] (the model's positions){why}; "
                         f"got {context!r}.")
    if wu:
        grid = wu_grid(context // 4, context, 4, 5)
        lengths = grid[0] if lengths is None else tuple(lengths)
        depths = grid[1] if depths is None else tuple(depths)
        prompts = wu_needle_prompts(model, lengths, depths, needle_len, seed)
    else:
        lengths = (context // 2, context) if lengths is None else tuple(lengths)
        depths = (0.1, 0.5, 0.9) if depths is None else tuple(depths)
        prompts = needle_prompts(model, lengths, depths, needle_len, seed)
    stop = _newline_stop(model.tokenizer) if wu else None
    n_heads = max(cfg.heads_per_layer)
    scores, trials = [], []
    with model.studying():
        for p in progress(prompts, total=len(prompts), desc="retrieval: " + ("wu2024 " if wu else "") + "needle trials", unit="trial"):
            answer, reference = p.answer, p.reference  # the span scored; the tokens planted
            n_steps = min(max_new_tokens, cfg.max_positions - len(p.ids) + 1) if wu else len(answer)
            generated, top = run_needle(model, p, n_steps, stop)
            hits = torch.stack([retrieval_step_hits(top[t], int(generated[t]), p.ids, p.needle)
                                for t in range(len(generated))])  # (steps, l, h)
            if not wu:
                recall = float(torch.isin(answer, generated).float().mean())
                counted = recall >= min_recall
            else:
                tok = model.tokenizer
                recall = (_id_recall(reference, generated) if tok is None else
                          rouge1_recall(p.text, tok.decode(generated.tolist(), skip_special_tokens=True).strip()))
                counted = recall > min_recall  # Wu et al.: rouge1 recall * 100 > 50
            trials.append({"length": len(p.ids), "depth": p.depth, "needle_tokens": len(reference),
                           "steps": len(generated), "recall": recall, "counted": counted,
                           "exact": bool(torch.equal(generated[: len(reference)], reference)),
                           **({"span": list(p.needle), "planted": list(p.planted)} if p.planted else {})})
            if counted:  # each hit 1 / |span| (Wu et al.: 1 / (needle_end - needle_start)); no span found: 0
                scores.append(hits.sum(0).double() / max(len(answer), 1))  # (l, h)
    layer = torch.arange(cfg.n_layers).repeat_interleave(n_heads)
    head = torch.arange(n_heads).repeat(cfg.n_layers)
    real_heads = set(cfg.heads())
    real = torch.tensor([(int(l), int(h)) in real_heads for l, h in zip(layer, head)])
    if scores:
        per_trial = torch.stack(scores).flatten(1)  # (trials, l * h)
        g = torch.Generator().manual_seed(seed)
        draws = torch.randint(len(scores), (n_bootstrap, len(scores)), generator=g)
        boot = per_trial[draws].mean(1)  # (n_bootstrap, l * h)
        mean = per_trial.mean(0)
        lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=0)
    else:
        per_trial = torch.zeros(0, cfg.n_layers * n_heads, dtype=torch.float64)
        mean = lo = hi = torch.full((cfg.n_layers * n_heads,), float("nan"), dtype=torch.float64)
        rule = (f"answered with ROUGE-1 recall above {min_recall}" if wu else
                f"generated at least {min_recall} of its needle")
        warnings.warn(f"retrieval ({protocol}): no trial counted (none of the {len(trials)} {rule}), so no head was "
                      f"measured: the scores are NaN and their label "
                      "'nan'. A model that cannot copy the needle has no retrieval heads to find; try shorter "
                      "lengths or a lower min_recall.", RuntimeWarning, stacklevel=2)
    df = pd.DataFrame({"layer": layer.numpy(), "head": head.numpy(), "retrieval": mean.numpy(),
                       "retrieval_lo": lo.numpy(), "retrieval_hi": hi.numpy()})
    df = df[real.numpy()].reset_index(drop=True)
    sizes = sorted({t["needle_tokens"] for t in trials})
    needle = (f"{needle_len} random tokens" if model.tokenizer is None
              else f"{needle_len} random digits ({'/'.join(map(str, sizes))} tokens)")
    if wu:
        chat = model.tokenizer is not None and bool(getattr(model.tokenizer, "chat_template", None))
        rule = (f"wu2024 (Wu et al. 2024): needle sentences 'The special magic number for <city> is <number>.' with "
                f"{needle}{' in the chat template' if chat else ''}, greedy decoding of up to {max_new_tokens} tokens "
                f"stopping at a newline, a trial counted when ROUGE-1 recall > {min_recall}")
    else:
        rule = f"interp: needles of {needle}, |needle| greedy steps, a trial counted when recall >= {min_recall}"
    df.attrs.update(trials=trials, inputs=f"needle-in-a-haystack, {rule}; lengths {list(lengths)}, depths "
                                          f"{list(depths)}", min_recall=min_recall,
                    needle_tokens=sizes[0] if len(sizes) == 1 else sizes, protocol=protocol,
                    trials_run=len(trials), trials_counted=len(scores),
                    stability={"retrieval": _halves_stability(per_trial, real)})
    return df


def retrieval_frame(model, names: list[str], seed: int = 0, n_bootstrap: int = 1000, context: int | None = None,
                    protocol: str | None = None, **_) -> pd.DataFrame:
    """The registry's runner of ``retrieval`` (``detect_heads(model, scores=["retrieval"], context=...,
    protocol=...)``)."""
    with model.studying():
        return retrieval_heads(model, context=context, seed=seed, n_bootstrap=n_bootstrap,
                               protocol="interp" if protocol is None else protocol)
