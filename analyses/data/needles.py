"""Needle-in-a-haystack prompts for retrieval heads (``analyses.long.retrieval``), in both protocols: ours
(``needle_prompts``: " The secret code is" and random spaced digits, the question asking for it again) and Wu et
al.'s (``wu_needle_prompts``, ``wu_grid``: a natural sentence " The special magic number for <city> is <digits>.",
their question, insertion after a full stop and grid), with ROUGE-1 recall (``rouge1_recall``) and the newline stop
of their decoding. ``analyses.long.retrieval``'s docstring states each protocol in full, with where ours differs.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from numbers import Real

import torch

from .prompts import _ordinary_ids, _special_frame, haystack, refuse_unreadable

PROTOCOLS = ("interp", "wu2024")  # ours, and Wu et al. 2024's (Retrieval_Head)

__all__ = ["PROTOCOLS", "NeedlePrompt", "check_protocol", "needle_prompts", "rouge1_recall", "shortest_needle_prompt",
           "shortest_wu_prompt", "wu_grid", "wu_needle_prompts", "wu_needle_span"]

_INTRO, _QUESTION = " The secret code is", "\n\nQuestion: What is the secret code? Answer: The secret code is"


@dataclass
class NeedlePrompt:
    """ids: (p,) the prompt. needle: (start, end) positions of the needle's random tokens, the span a head is
    scored on; ``answer`` is ``ids[start:end]``. planted: where the answer's tokens were put, where that differs
    from the span (wu2024: the span is found as Wu et al.'s code finds it, ``wu_needle_span``); ``reference`` is
    ``ids`` there."""

    ids: torch.Tensor
    needle: tuple[int, int]
    length: int
    depth: float
    text: str | None = None  # wu2024: the answer as text, ROUGE-1's reference
    planted: tuple[int, int] | None = None  # None: the needle span

    @property
    def answer(self) -> torch.Tensor:
        return self.ids[self.needle[0]:self.needle[1]] if self.needle[0] >= 0 else self.ids[:0]

    @property
    def reference(self) -> torch.Tensor:
        start, end = self.planted or self.needle
        return self.ids[start:end]


def wu_needle_span(ids, answer) -> tuple[int, int]:
    """Wu et al.'s ``find_needle_idx`` (``retrieval_head_detection.py``): the first window of ``len(answer)`` tokens
    of ``ids``, from the left (windows at the end run short), whose token set holds more than 90% of the answer's
    distinct tokens; ``(-1, -1)`` where none does (then no head scores on that trial). The window can start before
    the planted answer: one token earlier whenever the answer's last token repeats one before it.

    >>> wu_needle_span([9, 5, 1, 2, 1, 7], [1, 2, 1]), wu_needle_span([9, 5], [1])
    ((1, 4), (-1, -1))
    """
    ids, want = [int(t) for t in ids], {int(t) for t in answer}
    n = len(answer)
    for i in range(len(ids)):
        if want and len(set(ids[i:i + n]) & want) / len(want) > 0.9:
            return i, i + n
    return -1, -1


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
    ``insert_needle``; at depth 1 at the very end), then the question. ``prompt.needle`` is the span Wu et al.'s
    ``find_needle_idx`` finds for the answer (``wu_needle_span``), ``prompt.planted`` where its tokens were put,
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
            planted = (start, start + len(code))
            span = wu_needle_span(ids, code if tok is None else tok(text, add_special_tokens=False)["input_ids"])
            out.append(NeedlePrompt(torch.tensor(ids), span, length, float(depth), text, planted))
    return out


def _newline_stop(tok):
    """Wu et al.'s stop: the generated token is a newline (theirs: ``'<0x0A>'`` or id 144; here any token whose text
    holds one). None without a tokenizer (the decoding runs to its step limit)."""
    if tok is None:
        return None
    seen: dict[int, bool] = {}
    return lambda t: seen.setdefault(t, "\n" in tok.decode([t]))


def check_protocol(protocol) -> str:
    """``protocol`` if it is one of ``PROTOCOLS`` (the needle prompts this module builds), else one line naming them."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {list(PROTOCOLS)} (\"interp\": 8 random digits, |needle| greedy "
                         f"steps; \"wu2024\": Wu et al.'s natural-sentence needle, up to 50 steps stopping at a "
                         f"newline, ROUGE-1 recall); got {protocol!r}.")
    return protocol
