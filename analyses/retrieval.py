"""Retrieval heads (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context Factuality").

A needle sentence carrying a random token sequence is placed at a depth of a long haystack, a question follows,
and the model reproduces the sequence by greedy decoding with its KV cache. At each generated token, each head's
top-1 attended key comes from ``interp.stats`` on that step's single query row (O(n), never n x n); the head
scores ``1 / |needle|`` when that key lies inside the needle and holds the token being generated. A head's
retrieval score is its mean over trials (lengths x depths), counting, as Wu et al. do, only the trials the model
answered; 95% intervals resample the trials, and ``df.attrs["stability"]["retrieval"]`` compares the scores of the
counted trials' two halves (``analyses.stability``).

Two protocols share the prompts' haystack (the project's own text, ``analyses/data/sentences.txt``, sentences
shuffled and repeated to the length), the decoding loop (``run_needle``) and the scoring rule:

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
  the answer's span found by token-set overlap > 0.9; greedy decoding of up to 50 tokens, each step scored, stopping
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
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from numbers import Real

import pandas as pd
import torch

from interp.progress import progress
from interp.site_pass import each_site
from interp.streaming import cache_kwarg, output_cache

from .prompts import _ordinary_ids, _special_frame, haystack, refuse_unreadable
from .bootstrap import check_n_bootstrap
from .stability import halves, stability

__all__ = ["PROTOCOLS", "NeedlePrompt", "needle_prompts", "wu_needle_prompts", "wu_grid", "shortest_needle_prompt",
           "run_needle", "retrieval_step_hits", "rouge1_recall", "retrieval_heads"]

# "interp": our needle (random digits), |needle| greedy steps, token recall >= min_recall. "wu2024": Wu et al.'s
# (github.com/nightdessert/Retrieval_Head, retrieval_head_detection.py): a natural sentence, up to 50 greedy steps
# stopping at a newline, ROUGE-1 recall > min_recall. The module docstring and BENCHMARKS.md (issue 38) say more.
PROTOCOLS = ("interp", "wu2024")

_INTRO, _QUESTION = " The secret code is", "\n\nQuestion: What is the secret code? Answer: The secret code is"


@dataclass
class NeedlePrompt:
    """ids: (p,) the prompt. needle: (start, end) positions of the needle's random tokens; ``answer`` is
    ``ids[start:end]``."""

    ids: torch.Tensor
    needle: tuple[int, int]
    length: int
    depth: float
    text: str | None = None  # wu2024: the answer as text, ROUGE-1's reference

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


# -- Wu et al.'s protocol ------------------------------------------------------------------------------------------
_CITIES = ("Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hanoi", "Dakar", "Perth", "Bergen", "Cusco", "Tbilisi",
           "Lyon", "Accra", "Manaus", "Dublin", "Kyoto")
_WU_NEEDLE = " The special magic number for {city} is"
_WU_QUESTION = "Based on the content of the book, Question: What is the special magic number for {city}?\nAnswer:"
_SLOT = "\ue000"  # a private-use character: where the user's message goes in a chat template
_ROUGE_SPLIT = re.compile(r"[^a-z0-9]+")


def _rouge_tokens(text: str) -> list[str]:
    """rouge_score's tokeniser (``tokenize.tokenize``) without its stemmer: lowercase, every run of characters
    outside ``[a-z0-9]`` a separator, empty pieces dropped."""
    return [t for t in _ROUGE_SPLIT.split(text.lower()) if t]


def rouge1_recall(reference: str, response: str) -> float:
    """ROUGE-1 recall of ``response`` against ``reference`` in [0, 1], as ``rouge_score`` computes it (Wu et al.:
    ``RougeScorer(['rouge1'], use_stemmer=True).score(real_needle, response)['rouge1'].recall``): unigram counts
    clipped to the reference's, over the reference's unigrams (0 for an empty reference). The Porter stemmer is
    left out (no dependency); stemming only merges words, so this is never above rouge_score's, and equal on a
    needle of digits.

    >>> rouge1_recall("take a walk in Chaoyang Park", "Take a walk, in the park!")
    0.8333333333333334
    """
    ref, got = Counter(_rouge_tokens(reference)), Counter(_rouge_tokens(response))
    return sum((ref & got).values()) / max(sum(ref.values()), 1)


def _id_recall(answer: torch.Tensor, generated: torch.Tensor) -> float:
    """ROUGE-1 recall on token ids (a model without a tokenizer has no words): clipped counts over the answer's."""
    ref, got = Counter(answer.tolist()), Counter(generated.tolist())
    return sum((ref & got).values()) / max(sum(ref.values()), 1)


def wu_grid(low: int, high: int, n_lengths: int = 20, n_depths: int = 10) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Wu et al.'s grid: ``n_lengths`` lengths evenly from ``low`` to ``high`` tokens (rounded) and ``n_depths``
    depths evenly from 0 to 100% (rounded to whole percents, as fractions). Theirs is 20 x 10 (1000..50000
    tokens by default; lengths below 1000 for small models)."""
    for name, value in (("low", low), ("high", high), ("n_lengths", n_lengths), ("n_depths", n_depths)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"wu_grid: {name} must be a positive integer; got {value!r}.")
    if low > high:
        raise ValueError(f"wu_grid: low ({low}) must not exceed high ({high}).")
    lengths = torch.linspace(low, high, n_lengths, dtype=torch.float64).round().long().tolist()
    depths = torch.linspace(0, 100, n_depths, dtype=torch.float64).round().div(100).tolist()
    return tuple(dict.fromkeys(lengths)), tuple(dict.fromkeys(depths))


def _wu_frame(model) -> tuple[list[int], str, list[int]]:
    """(ids before the haystack, text between the haystack and the question, ids after the question). A tokenizer
    with a chat template: Wu et al.'s chat prompt (theirs for Mistral-7B-Instruct and Qwen1.5-Chat), the user's
    message ``<book>{context}</book>\nBased on ... Answer:`` and the assistant's turn opened; else the model's start
    tokens, the haystack, a space and the question (theirs for base models, the question right after the text)."""
    tok = model.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        return _special_frame(model)[0], " ", []
    text = tok.apply_chat_template([{"role": "user", "content": _SLOT}], tokenize=False, add_generation_prompt=True)
    pre, post = text.split(_SLOT)
    return tok(pre + "<book>", add_special_tokens=False)["input_ids"], "</book>\n", \
        tok(post, add_special_tokens=False)["input_ids"]


def _wu_parts(model, needle_len: int, g: torch.Generator, joiner: str = " ") -> tuple[list[int], list[int], list[int],
                                                                                    list[int], str]:
    """One needle's (before, answer, after, question) token ids and the answer's text. With a tokenizer: the
    sentence "The special magic number for <city> is <needle_len digits>." (the answer span the digits alone, a
    leading lone space token kept out as Wu et al.'s span search leaves it out) and Wu et al.'s question after
    ``joiner``; without: today's random key and tokens, the question being the key."""
    tok = model.tokenizer
    if tok is None:
        key, code, question = _needle_parts(model, needle_len, g)
        return key, code, [], question, ""
    city = _CITIES[int(torch.randint(len(_CITIES), (1,), generator=g))]
    number = "".join(map(str, torch.randint(10, (needle_len,), generator=g).tolist()))
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    before, code = encode(_WU_NEEDLE.format(city=city)), encode(" " + number)
    if code and not tok.decode(code[:1]).strip():
        before, code = before + code[:1], code[1:]
    return before, code, encode("."), encode(joiner + _WU_QUESTION.format(city=city)), number


def shortest_wu_prompt(model, needle_len: int = 8) -> int:
    """The fewest tokens a wu2024 needle prompt takes on this model (a haystack of one token)."""
    prefix, joiner, suffix = _wu_frame(model)
    before, code, after, question, _ = _wu_parts(model, needle_len, torch.Generator().manual_seed(0), joiner)
    return len(prefix) + len(before) + len(code) + len(after) + len(question) + len(suffix) + 1


def wu_needle_prompts(model, lengths, depths, needle_len: int = 8, seed: int = 0) -> list[NeedlePrompt]:
    """One prompt of each length (tokens) at each depth, Wu et al.'s layout: the haystack cut to fit, the needle
    sentence inserted at ``int(depth * haystack)`` moved back to just after a full stop (as their
    ``insert_needle``; at depth 1 at the very end), then the question. ``prompt.needle`` spans the answer's tokens,
    ``prompt.text`` is the answer (the ROUGE reference). Their prompt is about 200 tokens shorter than its
    nominal length (``final_context_length_buffer``); ours is exactly ``length`` tokens."""
    lengths, depths = _check_needle(model, lengths, depths, needle_len)
    g = torch.Generator().manual_seed(seed)
    prefix, joiner, suffix = _wu_frame(model)
    tok = model.tokenizer
    stops = set() if tok is None else set(tok(".", add_special_tokens=False)["input_ids"])
    out = []
    for length in lengths:
        for depth in depths:
            before, code, after, question, text = _wu_parts(model, needle_len, g, joiner)
            n_hay = length - len(prefix) - len(before) - len(code) - len(after) - len(question) - len(suffix)
            if n_hay < 1:
                raise ValueError(f"length {length} leaves no room for a haystack: on this model a wu2024 needle "
                                 f"prompt's other parts take {length - n_hay} tokens, so a length needs at least "
                                 f"{length - n_hay + 1}; give longer lengths (or a smaller needle_len).")
            if tok is None:
                pool = _ordinary_ids(model)
                hay = pool[torch.randint(len(pool), (n_hay,), generator=g)].tolist()
            else:
                hay = haystack(tok, n_hay, g)
            at = n_hay if depth == 1 else int(n_hay * depth)
            while stops and 0 < at < n_hay and hay[at - 1] not in stops:
                at -= 1
            start = len(prefix) + at + len(before)
            ids = prefix + hay[:at] + before + code + after + hay[at:] + question + suffix
            refuse_unreadable(model, ids, "The wu2024 needle prompt", "Use a model whose tokenizer reads English "
                              "text and digits.")
            out.append(NeedlePrompt(torch.tensor(ids), (start, start + len(code)), length, float(depth), text))
    return out


def _newline_stop(tok):
    """Wu et al.'s stop: the generated token is a newline (theirs: ``'<0x0A>'`` or id 144; here any token whose text
    holds one). None without a tokenizer (the decoding runs to its step limit)."""
    if tok is None:
        return None
    seen: dict[int, bool] = {}
    return lambda t: seen.setdefault(t, "\n" in tok.decode([t]))


# -- the runner ----------------------------------------------------------------------------------------------------
def _check_protocol(protocol) -> str:
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {list(PROTOCOLS)} (\"interp\": 8 random digits, |needle| greedy "
                         f"steps; \"wu2024\": Wu et al.'s natural-sentence needle, up to 50 steps stopping at a "
                         f"newline, ROUGE-1 recall); got {protocol!r}.")
    return protocol


def _halves_stability(per_trial: torch.Tensor, real: torch.Tensor) -> dict:
    """``analyses.stability`` on the mean score of the counted trials' two halves (even and odd trials: each spans
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
    scores of the counted trials' two halves compared (``analyses.stability``). No trial counted: NaN scores
    (labelled ``"nan"``) and a warning.
    """
    cfg = model.cfg
    _check_protocol(protocol)
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
            answer = p.answer
            n_steps = min(max_new_tokens, cfg.max_positions - len(p.ids) + 1) if wu else len(answer)
            generated, top = run_needle(model, p, n_steps, stop)
            hits = torch.stack([retrieval_step_hits(top[t], int(generated[t]), p.ids, p.needle)
                                for t in range(len(generated))])  # (steps, l, h)
            if not wu:
                recall = float(torch.isin(answer, generated).float().mean())
                counted = recall >= min_recall
            else:
                tok = model.tokenizer
                recall = (_id_recall(answer, generated) if tok is None else
                          rouge1_recall(p.text, tok.decode(generated.tolist(), skip_special_tokens=True).strip()))
                counted = recall > min_recall  # Wu et al.: rouge1 recall * 100 > 50
            trials.append({"length": len(p.ids), "depth": p.depth, "needle_tokens": len(answer),
                           "steps": len(generated), "recall": recall, "counted": counted,
                           "exact": bool(torch.equal(generated[: len(answer)], answer))})
            if counted:
                scores.append(hits.sum(0).double() / len(answer))  # (l, h)
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
