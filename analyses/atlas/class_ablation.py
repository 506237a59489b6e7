"""A class of heads checked causally: its heads zero-ablated together against random heads of the same layers, as a
distribution over draws (a label is checked causally, as Wang et al. 2022 and Olsson et al. 2022 check theirs). The
report's "does each class do what its name says" and the atlas's per-class check read it from here.

On a causal LM every class is shown on the in-context gain on repeated random tokens ``[BOS, x, x]``: the first
copy's loss minus the second's, which induction heads make (Olsson et al. 2022). A class named for another behaviour
is also checked on that behaviour (``own_task``: the registry's ``check``, the taxonomy's class tests): successor
heads on the next ordinal item, name movers and S-inhibition heads on IOI, copy suppressors on the self-repair test
(ablating them raises the repeated token's logit), retrieval heads on copying a needle. A class is ``confirmed``
when its ablation moves its own measure the way its name predicts, more than every draw of random heads; a class
whose own test does not confirm it says so (``verdict``); an attention-pattern class has no behaviour of its own to
test (its score is its evidence).
"""

from __future__ import annotations

import torch

from ..heads import registry
from interp.tokens.inputs import encode

from ..causal.ablation import _set_values
from ..data.batches import _main_output
from ..heads.labels import LABEL_ORDER
from ..data.metrics import Metric, first_copy_loss, second_copy_loss
from ..data.toy import repeated_sequences

__all__ = ["PROPERTY", "class_ablation", "own_task"]

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
    _own_tests(model, rows, [sets[i * (draws + 1):(i + 1) * (draws + 1)] for i in range(len(kinds))], ids, length,
               seed)
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


def _own_tests(model, rows: list[dict], sets: list[list], copy_ids: torch.Tensor, length: int, seed: int) -> None:
    """Each row's ``own_test`` (task, measure, clean, ablated, random, effect, random_effect: positive effects go the
    way the class's name predicts), ``confirmed`` and ``verdict``, in place; one scan per task."""
    by_task: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        by_task.setdefault(own_task(row["class"]), []).append(i)
    for name, members in by_task.items():
        if name is None:
            for i in members:
                rows[i].update(own_test=None, confirmed=None, verdict="no test of its own: an attention-pattern class "
                               "(its score is its evidence); the copy task's share is shown")
            continue
        if name == "copy":
            for i in members:
                r = rows[i]
                _judge(r, "the copy task (in-context gain on the repeated sequences)", "share of the gain removed",
                       None, r["ablated"], r["random"], r["share"], r["random_share"])
            continue
        try:
            batch, metric, sign, what = _task(model, name, copy_ids.to(model.device), length, seed)
        except (TypeError, ValueError, NotImplementedError) as err:
            for i in members:
                rows[i].update(own_test=None, confirmed=None, verdict=f"not checked: {err}")
            continue
        clean, values = _set_values(model, batch, metric, [s for i in members for s in sets[i]])
        n = len(sets[members[0]])
        for j, i in enumerate(members):
            got = values[j * n:(j + 1) * n]
            _judge(rows[i], what, metric.name, clean, got[0], got[1:], sign * (clean - got[0]),
                   [sign * (clean - v) for v in got[1:]])


def _judge(row: dict, task: str, measure: str, clean, ablated, random, effect, random_effect) -> None:
    ok = effect == effect and effect > 0 and all(effect > v for v in random_effect if v == v)
    row.update(own_test={"task": task, "measure": measure, "clean": clean, "ablated": ablated, "random": random,
                         "effect": effect, "random_effect": random_effect}, confirmed=bool(ok))
    row["verdict"] = (f"confirmed on {task}" if ok else f"not confirmed on {task}: the class's ablation "
                      + ("does not move it the way its name predicts" if not effect > 0 else
                         "moves it no more than a draw of random heads"))


# -- the behaviour each class is named for ---------------------------------------------------------------------------
def own_task(kind: str) -> str | None:
    """The task class ``kind`` is named for (``HeadScore.check`` of a score that gives it); None for a class with none
    of its own (an attention pattern: previous_token, duplicate_token, positional, self; a user's class), shown on the
    copy task, which the induction circuit serves."""
    return next((r.check for r in registry.scores() if r.gives == kind and r.check), None)


class _LogProb(Metric):
    """The mean log-probability of ``targets (b, t)`` at the last ``t`` positions' next-token predictions."""

    higher_is_better = True

    def __init__(self, targets: torch.Tensor, name: str, logit: bool = False, after: bool = False):
        self.targets, self.name, self.logit, self.after = targets, name, logit, after  # after: they follow the ids

    def per_example(self, output, inputs) -> torch.Tensor:
        t = self.targets.shape[1]
        logits = _main_output(output)  # the predictions of the targets: (b, t, vocab)
        logits = (logits[:, -t:] if self.after else logits[:, -t - 1:-1]).float()
        scores = logits if self.logit else logits.log_softmax(-1)
        return scores.gather(-1, self.targets.to(logits.device)[..., None])[..., 0].mean(-1)

    def trailing(self, inputs) -> int:
        return self.targets.shape[1] + (0 if self.after else 1)


def _task(model, name: str, copy_ids: torch.Tensor, length: int, seed: int):
    """``(batch, metric, sign, description)`` of one task: ``sign`` +1 where the class's ablation should lower the
    metric, -1 where it should raise it."""
    if name == "suppression":  # McDougall et al.: ablating copy suppressors raises the repeated token's logit
        return ({"input_ids": copy_ids, "attention_mask": None}, _LogProb(copy_ids[:, -length + 1:],
                "the repeated token's logit in the second copy", logit=True), -1, "the copy-suppression self-repair "
                "test: the repeated token's logit in the second copy of the repeated sequences (ablation should "
                "raise it)")
    if name == "ordinal":
        from ..taxonomy.weights import _bundled_lists

        if model.tokenizer is None:
            raise ValueError("the ordinal task is text; this model has no tokenizer")
        texts, answers = [], []
        for items in _bundled_lists().values():
            for i in range(0, len(items) - 3, 2):
                texts.append("".join(" " + x for x in items[i:i + 3]))
                answers.append(encode(model.tokenizer, " " + items[i + 3], add_special_tokens=False)[0])
        step = -(-len(texts) // 32)  # at most 32 prompts, spread over the lists
        texts, answers = texts[::step], answers[::step]
        batch = model.to_batch(texts)
        return batch, _LogProb(torch.tensor(answers)[:, None], "log P(next item)", after=True), 1, \
            f"{len(texts)} ordinal prompts (' Monday Tuesday Wednesday' -> ' Thursday'): log P(next item)"
    if name == "ioi":
        from ..data.tasks import ioi_task

        clean, _, metric = ioi_task(model, n=16, seed=seed)
        return clean, metric, 1, "16 IOI prompts: logit(IO) - logit(S) at the end"
    from ..data.needles import needle_prompts, shortest_needle_prompt  # "needle"

    tokens = min(4 * shortest_needle_prompt(model), model.cfg.max_positions or 1 << 30) - 16
    prompts = needle_prompts(model, [tokens], (0.1, 0.5, 0.9), seed=seed)
    answer = torch.stack([p.answer for p in prompts])
    ids = torch.stack([torch.cat([p.ids, p.answer]) for p in prompts])
    return {"input_ids": ids.to(model.device), "attention_mask": None}, _LogProb(answer, "log P(needle)"), 1, \
        f"{len(prompts)} needle prompts of {ids.shape[1]} tokens: the needle's log-probability as it is copied"
