"""Circuit tasks: greater-than (Hanna, Liu and Variengien 2023), built from the model's tokenizer as ``ioi_task`` is,
needle retrieval at any length (the model copies a needle from far back), and the check of a user's task ``(clean,
corrupted, metric)``. The IOI and induction tasks are ``analyses.data.tasks``'s.

Needle: a ``needle_prompts`` prompt followed by the needle's tokens (the answer, teacher-forced); the
metric the answer's mean next-token loss (lower is better). The corrupted prompt has another needle of as many
tokens in the haystack, everything else the same, so the answer can no longer be copied from it.

Greater-than: "The war lasted from the year 17YY to the year 17", the metric the probability on the years after YY
minus that on the years up to YY at the last position; the corrupted prompts put "01" in place of YY (no year is
earlier). It needs a tokenizer that writes each two-digit number after "17" as one token (GPT-2's); one that
splits digits (SmolLM2's, Llama's) is refused in one line.
"""

from __future__ import annotations

import copy

import torch

from interp.tokens.inputs import encode

from ..data.metrics import Metric, _main_output, next_token_loss
from ..data.needles import needle_prompts

__all__ = ["GREATER_THAN_NOUNS", "YearMass", "check_task", "greater_than_task", "needle_task"]

GREATER_THAN_NOUNS = ("war", "deal", "trip", "strike", "project", "famine", "drought", "dynasty", "siege", "voyage")
_TEMPLATE = "The {noun} lasted from the year 17{yy} to the year 17"


class YearMass(Metric):
    """Per prompt: the probability on the year tokens after its YY minus that on those up to YY, at the last
    position (higher is better). year_ids: the 100 tokens "00" .. "99"; years: each prompt's YY."""

    higher_is_better = True
    name = "year_mass"

    def __init__(self, year_ids, years):
        self.year_ids, self.years = torch.as_tensor(year_ids).long(), torch.as_tensor(years).long()

    def per_example(self, output, inputs) -> torch.Tensor:
        probs = _main_output(output)[:, -1].float().softmax(-1)[:, self.year_ids.to(_main_output(output).device)]  # (b, 100)
        later = torch.arange(100, device=probs.device)[None, :] > self.years.to(probs.device)[:, None]
        if probs.shape[0] != later.shape[0]:
            raise ValueError(f"year_mass has one year per prompt for {later.shape[0]} prompts; the model ran on "
                             f"{probs.shape[0]}.")
        return (probs * later).sum(-1) - (probs * ~later).sum(-1)

    def trailing(self, inputs) -> int | None:
        return 1

    def rows(self, index: torch.Tensor) -> Metric:
        part = copy.copy(self)
        part.years = self.years[index.to(self.years.device)]
        return part


def _year_ids(tok) -> list[int]:
    """The token of each two-digit year after "the year 17", or a clear error when the tokenizer splits them."""
    stem = encode(tok, "the year 17", add_special_tokens=False)
    found = []
    for yy in range(100):
        ids = encode(tok, f"the year 17{yy:02d}", add_special_tokens=False)
        if len(ids) != len(stem) + 1 or ids[:len(stem)] != stem or tok.decode([ids[-1]]).strip() != f"{yy:02d}":
            raise ValueError(f"greater_than_task needs a tokenizer that writes each two-digit year after '17' as one "
                             f"token (GPT-2's does); this one writes 'the year 17{yy:02d}' as "
                             f"{[tok.decode([i]) for i in ids[len(stem) - 1:]]}. Use a task of your own "
                             "(clean, corrupted, metric) for this model.")
        found.append(ids[-1])
    return found


def greater_than_task(model, n: int = 32, seed: int = 0) -> tuple[dict, dict, Metric]:
    """``(clean, corrupted, metric)`` for greater-than: ``n`` prompts with nouns from ``GREATER_THAN_NOUNS`` and
    years YY drawn from 02..98, the corrupted prompts with "01"; the metric ``YearMass`` (probability on years
    after YY minus up to YY). Padded batches of the same shape, as ``ioi_task``'s."""
    if model.tokenizer is None:
        raise ValueError("greater_than_task builds text prompts: this model has no tokenizer.")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer (the number of prompts); got {n!r}.")
    year_ids = _year_ids(model.tokenizer)
    g = torch.Generator().manual_seed(seed)
    years = torch.randint(2, 99, (n,), generator=g).tolist()
    nouns = [GREATER_THAN_NOUNS[i] for i in torch.randint(len(GREATER_THAN_NOUNS), (n,), generator=g).tolist()]
    clean = model.to_batch([_TEMPLATE.format(noun=w, yy=f"{y:02d}") for w, y in zip(nouns, years)])
    corrupted = model.to_batch([_TEMPLATE.format(noun=w, yy="01") for w in nouns])
    return clean, corrupted, YearMass(year_ids, years)


def needle_task(model, length: int, depth: float = 0.5, needle_len: int = 8, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, Metric]:
    """``(clean, corrupted, metric)`` for retrieving a needle from far back: token ids ``(1, length)``, a
    ``needle_prompts`` prompt (its depth, needle and seed) followed by the needle's ``a`` tokens; the corrupted
    prompt's needle is another of as many tokens (the first ``needle_prompts`` draws with a later seed), put in its
    place; the metric is the clean answer's mean next-token loss at the answer's positions."""
    first = needle_prompts(model, [length], [depth], needle_len=needle_len, seed=seed)[0]
    a = len(first.answer)  # the prompt is drawn again a tokens shorter: the same needle, a shorter haystack
    (prompt,) = needle_prompts(model, [length - a], [depth], needle_len=needle_len, seed=seed)
    start, end = prompt.needle
    answer = prompt.answer
    for other_seed in range(seed + 1, seed + 65):
        (other,) = needle_prompts(model, [length - a], [depth], needle_len=needle_len, seed=other_seed)
        if other.needle[1] - other.needle[0] == end - start and not torch.equal(other.answer, answer):
            break
    else:
        raise ValueError(f"needle_task found no second needle of {end - start} tokens in 64 draws; give another "
                         "needle_len or seed.")
    clean = torch.cat([prompt.ids, answer])[None]
    corrupted = clean.clone()
    corrupted[0, start:end] = other.answer
    first_row = len(prompt.ids) - 1  # the position whose logits predict the answer's first token
    return clean, corrupted, next_token_loss(clean, first_row, first_row + len(answer))


def check_task(task) -> tuple:
    """A user's task as ``(clean, corrupted, metric)``, or a clear error."""
    if not isinstance(task, (tuple, list)) or len(task) != 3 or not callable(task[2]):
        raise ValueError(f"A circuit task is (clean, corrupted, metric) with a callable metric; got "
                         f"{type(task).__name__}{'' if not isinstance(task, (tuple, list)) else f' of {len(task)}'}.")
    return tuple(task)
