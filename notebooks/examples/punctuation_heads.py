"""A head score of your own, outside the package: punctuation heads attend from each position to the most recent
punctuation token. Load it with `import` in Python, or `interp heads --score-module punctuation_heads.py`."""

import torch

import analyses

PUNCTUATION = set(".,;:!?")


def is_punctuation(ids, tokenizer):
    if tokenizer is None:  # a model without a tokenizer (a test's tiny one): call ids 0-9 punctuation
        return ids < 10
    return torch.tensor([[tokenizer.decode([t]).strip() in PUNCTUATION for t in row] for row in ids.tolist()],
                        dtype=torch.bool).reshape(ids.shape)


@analyses.head_score("punctuation", threshold=0.3, sites=("causal", "bidirectional", "cross"),
                     definition="the weight a token puts on the most recent punctuation token at or before it")
def punctuation(ids, key_ids, tokenizer):
    positions = torch.arange(key_ids.shape[1]).expand_as(key_ids)
    last = torch.where(is_punctuation(key_ids, tokenizer), positions, -1).cummax(dim=1).values  # (b, k)
    at = torch.arange(ids.shape[1]).clamp(max=key_ids.shape[1] - 1)  # a query's own position, or the last key
    return last[:, at]
