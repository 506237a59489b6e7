"""Published head tables as checks: which heads of a known model a paper puts in which class, as data, and a check of
a head table (``detect_heads``, the atlas) against them.

An *expectation set* names a model's shape and lists entries; each entry is one class of one paper: the heads as
``(layer, head)``, the registered score (``analyses.heads.registry``) that tests them and how:

- ``"top"``: the head ranks in the top ``k`` heads of the model by that score;
- ``"negative"``: the score is below 0 and the head ranks among the ``k`` lowest (a negative direct effect: Wang et
  al.'s negative name movers);
- ``"label"``: the head carries the score's label (its value clears the score's threshold).

A head's rank counts the heads whose score is at least as high as its own (as low, for ``"negative"``), itself
included: a tie (scores within ``TIE``) never lifts a head into the top ``k``. A head whose score was not computed
(no column, no row, or NaN) is ``"not measured"``, never a pass.

``"gpt2-small"`` is GPT-2 small's table (Wang et al. 2022; McDougall et al. 2023). The ``k`` of each entry is ours:
the papers name heads, not ranks under our scores; each ``k`` leaves room for heads the papers name in the same
class beside these (backup name movers, other induction heads) and is written in the row that tests it.

A set of your own: ``register_expectations(ExpectationSet(...))`` in Python, or a JSON file given wherever a set's
name goes (``load_expectations``):

    {"name": "my-model", "layers": 6, "heads": 8,
     "entries": [{"class": "induction", "heads": ["4.3", "5.1"], "score": "induction", "test": "top", "k": 5,
                  "citation": "our notes, table 2"}]}

>>> needs_scores("gpt2-small")[:3]
('name_mover', 's_inhibition', 'induction')
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..heads import registry

__all__ = ["EXPECTATION_SETS", "Expectation", "ExpectationSet", "TESTS", "check_expectations", "check_shape",
           "expectation_set", "head_table", "load_expectations", "needs_scores", "register_expectations",
           "summary_line"]

TESTS = ("top", "negative", "label")
STATUSES = ("pass", "fail", "not measured")
TIE = 1e-6  # scores closer than this (relative, for scores over 1) are tied


@dataclass(frozen=True)
class Expectation:
    """One class of one paper: ``heads`` as ``(layer, head)``, tested by the registered score ``score`` with
    ``test`` (``TESTS``; ``k`` for ``"top"`` and ``"negative"``); ``citation`` says where (paper, section, figure)."""

    cls: str
    heads: tuple[tuple[int, int], ...]
    score: str
    test: str = "top"
    k: int | None = None
    citation: str = ""

    def how(self) -> str:
        """The test in words, as a row of the check shows it."""
        if self.test == "top":
            return f"in the top {self.k} by {self.score}"
        if self.test == "negative":
            return f"{self.score} < 0, among the {self.k} lowest"
        return f"carries the {registry.score(self.score).gives} label"


@dataclass(frozen=True)
class ExpectationSet:
    """A named table of expected heads for a model of ``n_layers`` layers of ``n_heads`` heads each."""

    name: str
    model: str
    n_layers: int
    n_heads: int
    entries: tuple[Expectation, ...] = field(default_factory=tuple)

    def __post_init__(self):
        _check_set(self)


EXPECTATION_SETS: dict[str, ExpectationSet] = {}


def register_expectations(expected: ExpectationSet, replace: bool = False) -> ExpectationSet:
    """Add a set under its name (``replace=True``: over a set of the same name, but never over ``"gpt2-small"``)."""
    if not isinstance(expected, ExpectationSet):
        raise TypeError(f"register_expectations takes an ExpectationSet; got {type(expected).__name__}.")
    old = EXPECTATION_SETS.get(expected.name)
    if old is GPT2_SMALL or (old is not None and not replace):
        why = "is interp's own" if old is GPT2_SMALL else "is registered already; pass replace=True to replace it"
        raise ValueError(f"The expectation set {expected.name!r} {why}; give yours another name.")
    EXPECTATION_SETS[expected.name] = expected
    return expected


def expectation_set(name_or_set) -> ExpectationSet:
    """A set by name, a JSON file of one (``load_expectations``), or the set itself."""
    if isinstance(name_or_set, ExpectationSet):
        return name_or_set
    if not isinstance(name_or_set, (str, Path)):
        raise TypeError(f"An expectation set is a name, a JSON file or an ExpectationSet; got "
                        f"{type(name_or_set).__name__}.")
    if str(name_or_set) in EXPECTATION_SETS:
        return EXPECTATION_SETS[str(name_or_set)]
    if str(name_or_set).endswith(".json") or Path(name_or_set).is_file():
        return load_expectations(name_or_set)
    close = difflib.get_close_matches(str(name_or_set), list(EXPECTATION_SETS), n=2)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(f"Unknown expectation set {str(name_or_set)!r}.{hint} Sets are {', '.join(EXPECTATION_SETS)}; "
                     "a set of your own: register_expectations(ExpectationSet(...)) or a JSON file.")


def load_expectations(path) -> ExpectationSet:
    """A set from a JSON file (module docstring): heads as ``"layer.head"`` strings or ``[layer, head]`` pairs."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"No expectation file at {path}; give a JSON file or one of {', '.join(EXPECTATION_SETS)}.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entries = tuple(Expectation(e["class"], _heads(e["heads"]), e["score"],
                                    e.get("test", "top"), e.get("k"), e.get("citation", ""))
                        for e in data["entries"])
        return ExpectationSet(data["name"], data.get("model", data["name"]), data["layers"], data["heads"], entries)
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text (UTF-8) file; an expectation set is a JSON file.") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path} is not an expectation set ({type(e).__name__}: {e}); it needs name, layers, heads "
                         "and entries of class, heads ('layer.head'), score, test, k, citation.") from None


def needs_scores(name_or_set) -> tuple[str, ...]:
    """The scores a set's entries are tested by, in entry order, each once: what ``detect_heads(model,
    scores=...)`` has to run for every row to be measured."""
    return tuple(dict.fromkeys(e.score for e in expectation_set(name_or_set).entries))


def check_shape(expected: ExpectationSet, n_layers: int, heads_per_layer) -> None:
    """Refuse a model (or head table) that is not the set's shape."""
    heads = sorted(set(heads_per_layer))
    if n_layers != expected.n_layers or heads != [expected.n_heads]:
        got = f"{n_layers} layers x {'/'.join(map(str, heads))} heads"
        raise ValueError(f"The expectation set {expected.name!r} is for {expected.model}: {expected.n_layers} layers "
                         f"x {expected.n_heads} heads; this model has {got}. Run it on that model (a local folder: "
                         f"interp atlas --model PATH --expect {expected.name}), or register a set for this one.")


def check_expectations(df, name_or_set, model=None) -> pd.DataFrame:
    """Check a head table against an expectation set: one row per expected head.

    df: a head table with ``layer``, ``head`` and score columns (``detect_heads``; ``<score>_lo``/``_hi`` intervals
        shown where present), or an object holding one as ``.heads``. model: checked for the set's shape when given
        (else the table's layers and heads are).
    Returns columns ``class``, ``layer``, ``head``, ``score``, ``value``, ``lo``, ``hi``, ``rank``, ``of`` (the
    heads ranked), ``test``, ``status`` (``"pass"``, ``"fail"`` or ``"not measured"``), ``why``, ``citation``;
    ``df.attrs["summary"]`` is ``summary_line`` of it.
    """
    expected = expectation_set(name_or_set)
    table = head_table(df)
    if model is not None:
        check_shape(expected, model.cfg.n_layers, model.cfg.heads_per_layer)
    else:
        check_shape(expected, int(table["layer"].max()) + 1, (table.groupby("layer")["head"].max() + 1).tolist())
    thresholds = {**registry.DEFAULT_THRESHOLDS, **table.attrs.get("thresholds", {})}
    rows = []
    for entry in expected.entries:
        for layer, head in entry.heads:
            rows.append({"class": entry.cls, "layer": layer, "head": head, "score": entry.score,
                         **_judge(table, entry, layer, head, thresholds), "citation": entry.citation})
    out = pd.DataFrame(rows, columns=["class", "layer", "head", "score", "value", "lo", "hi", "rank", "of", "test",
                                      "status", "why", "citation"])
    out.attrs.update(expectations=expected.name, summary=summary_line(out, expected.name))
    return out


def summary_line(checked: pd.DataFrame, name: str = "") -> str:
    """One line: PASS (every expected head passes), FAIL (one fails) or INCOMPLETE (none fails, some were not
    measured), then how many pass, fail (which) and were not measured (by which scores)."""
    counts = checked["status"].value_counts()
    n_pass, n_fail, n_none = (int(counts.get(s, 0)) for s in STATUSES)
    verdict = "PASS" if n_pass == len(checked) else "FAIL" if n_fail else "INCOMPLETE"
    line = f"{name + ': ' if name else ''}{verdict}: {n_pass} of {len(checked)} expected heads pass, {n_fail} fail"
    if n_fail:
        failed = checked[checked["status"] == "fail"]
        by_class = {c: [f"{l}.{h}" for l, h in zip(rows["layer"], rows["head"])]
                    for c, rows in failed.groupby("class", sort=False)}
        line += " (" + "; ".join(f"{c} {' '.join(heads)}" for c, heads in by_class.items()) + ")"
    line += f", {n_none} not measured"
    if n_none:
        line += f" (scores: {', '.join(dict.fromkeys(checked.loc[checked['status'] == 'not measured', 'score']))})"
    return line


def _judge(table: pd.DataFrame, entry: Expectation, layer: int, head: int, thresholds) -> dict:
    """One expected head's value, interval, rank and verdict."""
    out = {"value": math.nan, "lo": math.nan, "hi": math.nan, "rank": pd.NA, "of": pd.NA, "test": entry.how()}
    column = entry.score if entry.score in table else registry.score(entry.score).label_column
    if column not in table:
        why = table.attrs.get("not_run", {}).get(entry.score)
        return {**out, "status": "not measured", "why": f"{entry.score} did not run: {why}" if why
                else f"{entry.score} was not computed"}
    at = table[(table["layer"] == layer) & (table["head"] == head)]
    value = float(at[column].iloc[0]) if len(at) else math.nan
    out.update(value=value, **{b: float(at[f"{column}_{b}"].iloc[0]) if len(at) and f"{column}_{b}" in table
                               else math.nan for b in ("lo", "hi")})
    if not math.isfinite(value):
        return {**out, "status": "not measured", "why": f"no {entry.score} for {layer}.{head}" if not len(at)
                else f"{entry.score} of {layer}.{head} is not finite"}
    scored = table[column].astype(float)
    scored = scored[scored.map(math.isfinite)]
    if entry.test == "label":
        limit = thresholds.get(entry.score)
        if limit is None:
            return {**out, "status": "not measured", "why": f"{entry.score} has no threshold here, so no label"}
        ok = value >= limit
        return {**out, "status": "pass" if ok else "fail",
                "why": f"{value:.3g} {'>=' if ok else '<'} the {entry.score} threshold {limit:g}"}
    negative = entry.test == "negative"
    tie = TIE * max(1.0, abs(value))  # scores this close are equal: float rounding of two uniform heads differs
    rank = int((scored <= value + tie).sum() if negative else (scored >= value - tie).sum())
    out.update(rank=rank, of=len(scored))
    where = "lowest" if negative else "highest"
    if negative and value >= 0:
        return {**out, "status": "fail", "why": f"{entry.score} {value:.3g} is not negative"}
    ok = rank <= entry.k
    return {**out, "status": "pass" if ok else "fail",
            "why": f"rank {rank} of {len(scored)} ({where} first){'' if ok else f', outside the {entry.k} needed'}"}


def head_table(df) -> pd.DataFrame:
    """The head table of ``df``: a DataFrame itself, the ``.heads`` of an object holding one, or an atlas
    (``build_atlas``'s dict: ``heads`` as rows of ``values``, each ``{"value", "lo", "hi"}``; its thresholds go to
    ``attrs["thresholds"]``, its scores that did not run, with why, to ``attrs["not_run"]``)."""
    if isinstance(df, dict) and isinstance(df.get("heads"), list):
        return _atlas_table(df)
    table = df if isinstance(df, pd.DataFrame) else getattr(df, "heads", df)
    if not isinstance(table, pd.DataFrame) or not {"layer", "head"} <= set(table.columns):
        raise TypeError(f"check_expectations needs a head table with layer and head columns (detect_heads's, an "
                        f"object holding one as .heads, or an atlas); got {type(df).__name__}.")
    return table


def _atlas_table(atlas: dict) -> pd.DataFrame:
    rows = []
    for h in atlas["heads"]:
        row = {"layer": h.get("layer"), "head": h.get("head"), "labels": h.get("labels", "")}
        for column, entry in (h.get("values") or {}).items():
            for part, suffix in (("value", ""), ("lo", "_lo"), ("hi", "_hi")):
                if part in entry:
                    row[column + suffix] = math.nan if entry[part] is None else entry[part]
        rows.append(row)
    table = pd.DataFrame(rows)
    if table.empty or table["layer"].isna().any():
        raise ValueError("The atlas has no (layer, head) rows (a model with one attention site per layer); "
                         "expectation sets name heads by layer.")
    table = table.astype({"layer": int, "head": int})
    table.attrs.update(thresholds={n: s["threshold"] for n, s in (atlas.get("scores") or {}).items()
                                   if s.get("threshold") is not None},
                       not_run=dict(atlas.get("not_run") or {}))
    return table


def _head(text) -> tuple[int, int]:
    """``"layer.head"`` or ``[layer, head]`` as two integers; anything else (``"4"``, ``"0.1.2"``, ``4.3``) is
    refused in one line."""
    parts = text.split(".") if isinstance(text, str) else text if isinstance(text, (list, tuple)) else None
    if parts is None or len(parts) != 2 or not all(
            type(p) is int or isinstance(p, str) and p.strip().isdigit() for p in parts):  # noqa: E721
        raise ValueError(f"a head is written 'layer.head' (e.g. '4.3') or [layer, head]; got {text!r}")
    return int(parts[0]), int(parts[1])


def _heads(heads) -> tuple[tuple[int, int], ...]:
    """An entry's heads: a list of heads (``_head``), never one string (``"4.3"`` would be read as '4', '.', '3')."""
    if not isinstance(heads, (list, tuple)):
        raise ValueError(f"heads is a list of heads, e.g. [\"4.3\", \"5.1\"]; got {heads!r}")
    return tuple(_head(h) for h in heads)


def _check_set(expected: ExpectationSet) -> None:
    def bad(what: str) -> ValueError:
        return ValueError(f"expectation set {expected.name!r}: {what}.")

    if not isinstance(expected.name, str) or not expected.name:
        raise bad("its name is a non-empty string")
    for size in ("n_layers", "n_heads"):
        value = getattr(expected, size)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad(f"{size} is a positive integer; got {value!r}")
    for e in expected.entries:
        if e.test not in TESTS:
            raise bad(f"the test of {e.cls!r} is one of {TESTS}; got {e.test!r}")
        if e.test != "label" and (isinstance(e.k, bool) or not isinstance(e.k, int) or e.k < 1):
            raise bad(f"the {e.test!r} test of {e.cls!r} needs k, a positive integer; got {e.k!r}")
        outside = [f"{l}.{h}" for l, h in e.heads if not (0 <= l < expected.n_layers and 0 <= h < expected.n_heads)]
        if outside or not e.heads:
            raise bad(f"the heads of {e.cls!r} are (layer, head) in {expected.n_layers} x {expected.n_heads}; "
                      f"got {', '.join(outside) or 'none'}")
        record = registry.score(e.score)  # an unknown score is refused with the closest names
        if e.test == "label" and record.threshold is None:
            raise bad(f"the 'label' test of {e.cls!r} needs a score with a threshold; {e.score!r} has none (it "
                      "gives no label): test it with 'top' and k instead")


# -- the published tables ------------------------------------------------------------------------------------------
_WANG = "Wang et al. 2022, Interpretability in the Wild (arXiv:2211.00593)"
GPT2_SMALL = ExpectationSet("gpt2-small", "GPT-2 small (124M, the `gpt2` checkpoint)", 12, 12, (
    Expectation("name mover", ((9, 6), (9, 9), (10, 0)), "name_mover", "top", 5,
                f"{_WANG}, Section 3.1 and Figure 2"),
    Expectation("negative name mover", ((10, 7), (11, 10)), "name_mover", "negative", 3,
                f"{_WANG}, Section 3.1 and Figure 2"),
    Expectation("S-inhibition", ((7, 3), (7, 9), (8, 6), (8, 10)), "s_inhibition", "top", 8,
                f"{_WANG}, Section 3.2 and Figure 2"),
    Expectation("induction", ((5, 5), (5, 8), (5, 9), (6, 9)), "induction", "top", 10,
                f"{_WANG}, Section 3.3 and Figure 2"),
    Expectation("duplicate token", ((0, 1), (0, 10), (3, 0)), "duplicate_token", "top", 10,
                f"{_WANG}, Section 3.3 and Figure 2"),
    Expectation("previous token", ((2, 2), (4, 11)), "previous_token", "top", 10,
                f"{_WANG}, Section 3.3 and Figure 2"),
    Expectation("copy suppression", ((10, 7),), "copy_suppression", "top", 3,
                "McDougall et al. 2023, Copy Suppression: Comprehensively Understanding an Attention Head "
                "(arXiv:2310.04625), abstract and Section 1"),
))
register_expectations(GPT2_SMALL)
