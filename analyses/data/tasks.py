"""Clean and corrupted inputs for circuit analyses (patching, attribution), for any model.

``ioi_task`` (Wang et al. 2022, indirect object identification): "When Mary and John went to the store, John gave a
drink to" -> " Mary". The corrupted input names two other people in the first clause (Wang et al.'s ABC
distribution), so nothing says who the indirect object is; the metric is the logit difference between the
clean answer and the repeated name.

``induction_task``: the clean input is ``[BOS, x, x]`` with ``x`` random ordinary tokens, the corrupted input
``[BOS, y, x]`` with the first copy replaced by other random tokens, so the second copy can be predicted only
from the clean input's earlier occurrence. The metric is the loss of the clean second copy (``x_1 .. x_{L-1}``,
as ``second_copy_loss``), scored on whichever input the model ran on: low on the clean run, high on the
corrupted one.
"""

from __future__ import annotations

import torch

from interp.tokens.inputs import encode

from .prompts import _ordinary_ids, _special_frame
from .metrics import Metric, next_token_loss

__all__ = ["induction_task", "ioi_task", "IOI_TEMPLATES", "IOI_NAMES"]


def induction_task(model, n: int = 16, length: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, Metric]:
    """``(clean, corrupted, metric)``: token ids ``(n, 1 + 2 * length)`` (or ``2 * length`` without a start
    token) and the second-copy loss of the clean tokens. ``x`` has ``length`` distinct tokens when the vocabulary
    allows."""
    if length < 2:
        raise ValueError(f"length must be at least 2; got {length}.")
    generator = torch.Generator().manual_seed(seed)
    pool = _ordinary_ids(model)
    prefix, _ = _special_frame(model)
    prefix = prefix[:1] if model.cfg.causal else prefix

    def draw() -> torch.Tensor:
        if length <= len(pool):
            return torch.stack([pool[torch.randperm(len(pool), generator=generator)[:length]] for _ in range(n)])
        return pool[torch.randint(len(pool), (n, length), generator=generator)]

    x, y = draw(), draw()
    head = torch.tensor(prefix, dtype=torch.long).expand(n, len(prefix))
    clean, corrupted = torch.cat([head, x, x], dim=1), torch.cat([head, y, x], dim=1)
    offset = len(prefix)
    return clean, corrupted, next_token_loss(clean, offset + length, offset + 2 * length - 1)


IOI_TEMPLATES = (
    "When{A} and{B} went to the store,{B} gave a drink to",
    "After{A} and{B} had lunch,{B} handed the book to",
    "When{A} and{B} arrived at the park,{B} threw the ball to",
    "Then{A} and{B} walked home, and{B} gave a flower to",
)
IOI_NAMES = (" Mary", " John", " Tom", " Sarah", " James", " Anna", " David", " Emma", " Paul", " Lisa")


def ioi_task(model, n: int = 32, seed: int = 0) -> tuple[dict, dict, Metric]:
    """``(clean, corrupted, metric)`` for indirect object identification: ``n`` prompts from ``IOI_TEMPLATES``
    with names drawn from ``IOI_NAMES`` (those the tokenizer keeps as one token), padded batches of the same shape;
    the metric is ``logit[indirect object] - logit[subject]`` at the last position."""
    from .metrics import logit_difference

    if model.tokenizer is None:
        raise ValueError("ioi_task builds text prompts: this model has no tokenizer.")
    tok = model.tokenizer
    ids = {name: encode(tok, name, add_special_tokens=False) for name in IOI_NAMES}
    unknown = [name for name, found in ids.items() if found == [tok.unk_token_id]]
    ids = {name: found[0] for name, found in ids.items() if len(found) == 1 and name not in unknown}
    names = list(ids)
    if len(names) < 4:
        raise ValueError(f"ioi_task needs at least 4 names that are one token each (and not the tokenizer's unknown "
                         f"token); this tokenizer keeps {names}"
                         + (f" and reads {unknown} as its unknown token {tok.unk_token!r}." if unknown else "."))
    generator = torch.Generator().manual_seed(seed)
    clean, corrupted, answers, wrongs = [], [], [], []
    for i in range(n):
        template = IOI_TEMPLATES[i % len(IOI_TEMPLATES)]
        a, b, c, d = (names[j] for j in torch.randperm(len(names), generator=generator)[:4].tolist())
        clean.append(template.format(A=a, B=b))
        corrupted.append(template.replace("{B}", "{X}", 1).format(A=c, X=d, B=b))
        answers.append(ids[a])
        wrongs.append(ids[b])
    clean, corrupted = model.to_batch(clean), model.to_batch(corrupted)
    return clean, corrupted, logit_difference(answers, wrongs)
