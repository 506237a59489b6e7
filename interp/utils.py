"""TransformerLens's ``utils`` names that interp has: ``from interp import utils; utils.get_act_name("pattern", 3)``,
``utils.lm_cross_entropy_loss``, ``utils.get_corner``, ``utils.test_prompt``."""

from __future__ import annotations

import torch

from hooks import get_act_name
from .lens.tokens import lm_loss

__all__ = ["get_act_name", "get_corner", "get_device", "lm_cross_entropy_loss", "test_prompt", "to_numpy"]


def lm_cross_entropy_loss(logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                          per_token: bool = False) -> torch.Tensor:
    """Next-token cross-entropy of ``logits (b, p, vocab)`` on ``tokens (b, p)``, as TransformerLens's."""
    return lm_loss(logits, tokens, attention_mask, per_token)


def get_corner(tensor, n: int = 3):
    """The top-left ``n x ... x n`` corner of a tensor or a LowRank."""
    if hasattr(tensor, "get_corner"):
        return tensor.get_corner(n)
    return tensor[tuple(slice(n) for _ in range(tensor.ndim))]


def to_numpy(tensor):
    """A tensor (or a nested list of numbers) as a numpy array, detached and on the CPU."""
    import numpy as np

    return tensor.detach().cpu().numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)


def get_device() -> torch.device:
    """TransformerLens's ``utils.get_device``: CUDA if there is one, else Apple's MPS, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    return torch.device("mps" if mps is not None and mps.is_available() else "cpu")


def test_prompt(prompt: str, answer, model, prepend_space_to_answer: bool = True, print_details: bool = True,
                prepend_bos: bool | None = None, top_k: int = 10) -> list:
    """TransformerLens's ``utils.test_prompt``: how the model ranks ``answer`` (a string, its tokens one after the
    other; or a list of strings, their first tokens as rivals) after ``prompt``, printed with the top ``top_k``
    tokens at each answer position. Returns the ranks, ``[[(answer token, rank), ...] per position]`` (rank 0: the
    model's top token); TransformerLens's returns None."""
    answers = [answer] if isinstance(answer, str) else list(answer) if isinstance(answer, (list, tuple)) else []
    if not answers or not all(isinstance(a, str) for a in answers):
        raise TypeError(f"test_prompt's answer is a string or a list of strings; got {answer!r}.")
    if prepend_space_to_answer:
        answers = [a if a.startswith(" ") else " " + a for a in answers]
    prompt_tokens = model.to_tokens(prompt, prepend_bos=prepend_bos)[0]
    answer_ids = [model.to_tokens(a, prepend_bos=False)[0] for a in answers]
    steps = 1 if len(answers) > 1 else len(answer_ids[0])
    rows = torch.stack([torch.cat([prompt_tokens, ids[:steps]]) for ids in answer_ids])
    with torch.no_grad():
        logits = model(rows, return_type="logits").float()
    n = len(prompt_tokens)
    if print_details:
        print("Tokenized prompt:", model.to_str_tokens(prompt_tokens))
        print("Tokenized answer" + ("s:" if len(answers) > 1 else ":"),
              [model.to_str_tokens(ids[:steps]) for ids in answer_ids] if len(answers) > 1
              else model.to_str_tokens(answer_ids[0]))
    ranks = []
    for step in range(steps):
        step_logits = logits[:, n + step - 1]
        probs = step_logits.softmax(-1)
        ids = rows[:, n + step]
        rank = (step_logits > step_logits.gather(1, ids[:, None])).sum(-1)
        ranks.append([(model.to_string(int(i)), int(r)) for i, r in zip(ids, rank)])
        if print_details:
            for row, (i, r) in enumerate(zip(ids, rank)):
                print(f"Rank: {int(r):<8} Logit: {step_logits[row, i].item():5.2f} Prob: {probs[row, i].item():6.2%} "
                      f"Token: |{model.to_string(int(i))}|")
            top = step_logits[0].topk(top_k)
            for k, (value, i) in enumerate(zip(top.values, top.indices)):
                print(f"Top {k}th token. Logit: {value.item():5.2f} Prob: {probs[0, i].item():6.2%} "
                      f"Token: |{model.to_string(int(i))}|")
    if print_details:
        print("Ranks of the answer tokens:", [pair for step in ranks for pair in step])
    return ranks
