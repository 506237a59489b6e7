"""A class of heads checked causally: its heads zero-ablated together against random heads of the same layers, as a
distribution over draws (REFERENCE.md: validate every label causally). The report's "does each class do what its name
says" and the atlas's per-class check read it from here.

On a causal LM the test is the in-context gain on repeated random tokens ``[BOS, x, x]``: the first copy's loss minus
the second's, which induction heads make (Olsson et al. 2022).
"""

from __future__ import annotations

import torch

from ..heads import registry
from .ablation import _set_values
from ..heads.labels import LABEL_ORDER
from ..data.metrics import first_copy_loss, second_copy_loss
from ..data.toy import repeated_sequences

__all__ = ["PROPERTY", "class_ablation"]

PROPERTY = "sink"  # most heads of a large model are sinks: a property shown beside the classes, not a class


def class_ablation(model, heads, seed: int = 0, n: int = 8, length: int = 16, draws: int = 5,
                   per_class: int = 8) -> dict | None:
    """Each class's strongest heads (primary label, at most ``per_class``) zero-ablated together, against ``draws``
    sets of as many random heads from the same layers (from other layers where the class leaves too few), on ``n``
    repeated random sequences ``[BOS, x, x]`` (``|x| = length``): the second copy's loss, and the share of the
    in-context gain (first-copy loss minus second-copy loss) that the ablation removes. None for a model that is not
    a causal LM (no copy task). One forward per set of heads, from the set's first layer on (``engine.scan``)."""
    if not getattr(model.cfg, "causal", False) or len({s.queries for s in model.cfg.sites}) > 1 or \
            getattr(model.hf, "get_output_embeddings", lambda: None)() is None:
        return None
    generator = torch.Generator().manual_seed(seed)
    ids = repeated_sequences(n, length, model.cfg.vocab_size, generator, model.hf.config.bos_token_id)
    batch = {"input_ids": ids.to(model.device), "attention_mask": None}
    per_layer = model.cfg.heads_per_layer
    sets, kinds = [], []  # per class: its heads, then its random draws (one ablated run each)
    for kind in LABEL_ORDER:
        if kind == PROPERTY:
            continue
        column = registry.of_column(kind).label_column
        members = heads[heads["label"] == kind]
        if not len(members) or column not in members:
            continue
        top = members.sort_values(column, ascending=False).head(per_class)
        chosen = [(int(l), int(h)) for l, h in zip(top["layer"], top["head"])]
        taken = set(chosen)
        draws_of_kind = []
        for d in range(draws):
            g = torch.Generator().manual_seed(seed + 1 + d)
            pick = []
            for layer, _ in chosen:  # a head of the same layer; where the class fills it, of any layer
                free = lambda ls: [(l, h) for l in ls for h in range(per_layer[l])  # noqa: E731
                                   if (l, h) not in taken and (l, h) not in pick]
                others = free([layer]) or free(range(len(per_layer)))
                if others:
                    pick.append(others[int(torch.randint(len(others), (1,), generator=g))])
            draws_of_kind.append(pick)
        kinds.append((kind, chosen))
        sets += [chosen, *draws_of_kind]
    clean, values = _second_copy_losses(model, batch, sets)
    first, clean_second = clean
    gain = first - clean_second
    share = (lambda value: (value - clean_second) / gain if gain > 0 else float("nan"))
    rows = []
    for i, (kind, chosen) in enumerate(kinds):
        value, random_values = values[i * (draws + 1)], values[i * (draws + 1) + 1:(i + 1) * (draws + 1)]
        rows.append({"class": kind, "heads": [f"{l}.{h}" for l, h in chosen], "ablated": value,
                     "random": random_values, "share": share(value), "random_share": [share(v) for v in random_values]})
    return {"task": f"{n} repeated random sequences [BOS, x, x] of {ids.shape[1]} tokens (|x| = {length})",
            "n": n, "tokens": int(ids.shape[1]), "first_copy_loss": first,
            "second_copy_loss": clean_second, "draws": draws, "rows": rows}


def _second_copy_losses(model, batch, sets: list) -> tuple[tuple[float, float], list[float]]:
    """The clean run's (first-copy, second-copy) loss, and the second-copy loss with each set of heads zero-ablated:
    through the scan engine (``ablation._set_values``), which replays the clean run's blocks before a set's first
    layer (exact, ``engine.Prefix``; most classes sit in later layers) and, since the second-copy loss reads only
    the second copy's logits (``Metric.trailing``), computes the output layer there only. The first-copy loss: one
    clean forward that keeps the first copy's logits, before the second's."""
    baseline, values = _set_values(model, batch, second_copy_loss, sets)
    with model.studying(), torch.no_grad():
        first = first_copy_loss(model(batch["input_ids"]), batch)
    return (first, baseline), values
