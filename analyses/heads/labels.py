"""Scores and labels of heads: every score's name (and which models it applies to), threshold and one-line
definition, the order of the classes (most specific first), a head's primary label and every label it clears, and
the strongest heads of each class. What a table of scores is read with, whichever module computed the scores
(``analyses.heads.scores``, the taxonomy, retrieval, ``analyses.data.seq2seq``'s cross-attention scores)."""

from __future__ import annotations

import pandas as pd

from interp.attention.sites import is_layered, one_site_per_layer

from . import registry
from .registry import DEFAULT_THRESHOLDS, LABEL_ORDER, SCORE_DEFINITIONS

__all__ = ["DEFAULT_THRESHOLDS", "SCORE_DEFINITIONS", "LABEL_ORDER", "NO_CLASS", "choose_scores", "has_evidence",
           "head_labels", "label_evidence", "label_heads", "resolve_thresholds", "site_kind", "strongest_heads"]

# -- which scores a model takes ---------------------------------------------------------------------------------
def site_kind(site) -> str:
    """A site's kind as the registry's ``sites`` name them: ``"causal"``, ``"bidirectional"`` or ``"cross"``."""
    return "cross" if site.kind == "cross" else "causal" if site.causal else "bidirectional"


def _takes(model) -> str:
    """The scores a model takes, as one sentence for an error message."""
    kinds = {site_kind(s) for s in model.cfg.sites}
    layered = is_layered(model)
    ok = [r.name for r in registry.scores() if set(r.sites) & kinds and (layered or r.how in ("target", "argmax"))]
    return f"This model takes {', '.join(ok)}."


def choose_scores(names, model) -> list[registry.HeadScore]:
    """detect_heads's ``scores`` on ``model`` as registry records, in registry order. None asks for the defaults:
    every default score that applies to one of the model's sites (next_token on bidirectional sites, the
    cross-attention scores on an encoder-decoder model's cross-attention sites), less those that need a tokenizer
    (the natural-text scores) on a model without one or an encoder-decoder model, whose generated prompts are random
    tokens. A name that is no score, or a score that does not apply to the model, is refused with the reason and the
    scores the model takes."""
    kinds = {site_kind(s) for s in model.cfg.sites}
    if names is None:  # a score that needs text only where detect_heads generates text (a tokenizer, one stack)
        text = getattr(model, "tokenizer", None) is not None and is_layered(model)
        return [r for r in registry.scores() if r.default and set(r.sites) & kinds
                and (text or "tokenizer" not in r.needs)]
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ValueError(f"scores is empty; pass None for the defaults, or some of the scores. {_takes(model)}")
    records = [registry.score(n) for n in names]
    for r in records:
        if not set(r.sites) & kinds:
            where = " or ".join(f"{k} attention" for k in r.sites)
            raise TypeError(f"The score {r.name!r} applies to {where} sites; this model's sites are "
                            f"{' and '.join(sorted(kinds))}. {_takes(model)}")
        if r.how in ("weights", "behaviour") and not is_layered(model):
            raise TypeError(f"The score {r.name!r} is read from one residual stream and its unembedding (or the "
                            f"model's own generation); an encoder-decoder model has two stacks. {_takes(model)}")
    chosen = {r.name for r in records}
    return [r for r in registry.scores() if r.name in chosen]


# -- labels ----------------------------------------------------------------------------------------------
NO_CLASS = ("none", "nan")  # the primary labels that name no class: measured and cleared none, or not measured at all
def head_labels(df: pd.DataFrame, thresholds: dict[str, float] | None = None) -> pd.Series:
    """Every class a head's scores clear, most specific first, joined by ``+`` (``"induction+sink"``), or ``""``.
    A score clears its threshold when it is at least the threshold, read from the score's label column
    (``positional_fraction`` for ``positional``; ``analyses.heads.registry``).
    Only scores present as columns take part. A head none of whose scores was measured (all NaN) gets ``"nan"``:
    not measured, which ``""`` (measured, and no class cleared) would misstate."""
    limits = resolve_thresholds(thresholds)
    cleared, measured = {}, pd.Series(False, index=df.index)
    for record in registry.labelled():
        kind, column = record.gives, record.label_column
        if column in df:
            hit = df[column].astype(float) >= limits[record.name]
            cleared[kind] = hit if kind not in cleared else cleared[kind] | hit
            measured |= df[column].notna()
            if kind == "name_mover" and "io_attention" in df:
                cleared[kind] &= df["io_attention"].astype(float) > 0
    table = pd.DataFrame(cleared, index=df.index)
    if not len(table.columns) or not len(table):
        return pd.Series("", index=df.index, name="labels", dtype=object)
    labels = table.apply(lambda row: "+".join(k for k, hit in row.items() if hit), axis=1).rename("labels")
    return labels.where(measured, "nan")


def label_evidence(df: pd.DataFrame, thresholds: dict[str, float] | None = None) -> pd.Series:
    """For a class that two or more scores in the table give (``induction`` and ``induction_text``: the same class
    on random tokens and on corpus text), which of them a head clears: ``"induction: both"`` (``"all"`` for more
    than two), ``"induction: induction_text only"``, or for three or more the cleared ones joined by ``+``; classes
    joined by ``"; "``, ``""`` for a head that clears no such class. ``head_labels`` gives the class on either."""
    limits = resolve_thresholds(thresholds)
    if not len(df):
        return pd.Series([], index=df.index, name="evidence", dtype=object)
    by_class: dict[str, list] = {}
    for record in registry.labelled():
        if record.label_column in df:
            by_class.setdefault(record.gives, []).append(record)
    notes = [pd.Series("", index=df.index, dtype=object)]
    for kind, records in by_class.items():
        if len(records) < 2:
            continue
        hits = pd.DataFrame({r.name: df[r.label_column].astype(float) >= limits[r.name] for r in records})
        every = "both" if len(records) == 2 else "all"
        notes.append(hits.apply(lambda row, kind=kind, every=every: "" if not row.any() else f"{kind}: {every}"
                                if row.all() else f"{kind}: {'+'.join(n for n, hit in row.items() if hit)} only",
                                axis=1).astype(object))
    joined = pd.concat(notes, axis=1).apply(lambda row: "; ".join(n for n in row if n), axis=1)
    return joined.astype(object).rename("evidence")


def has_evidence(df: pd.DataFrame) -> bool:
    """Whether some class of the table is given by two or more of its score columns (``label_evidence``)."""
    kinds = [r.gives for r in registry.labelled() if r.label_column in df]
    return len(kinds) != len(set(kinds))


def label_heads(df: pd.DataFrame, thresholds: dict[str, float] | None = None) -> pd.Series:
    """Each head's primary class: the most specific class whose score clears its threshold (order:
    ``LABEL_ORDER``, induction and duplicate-token before previous-token, positional before self and sink),
    ``"none"``, or ``"nan"`` where none of the head's scores was measured (all NaN). ``head_labels`` gives every
    class a head clears."""
    labels = head_labels(df, thresholds)
    return labels.map(lambda text: text.split("+")[0] if text else "none").rename("label")


def resolve_thresholds(thresholds: dict[str, float] | None,
                       defaults: dict[str, float] | None = None) -> dict[str, float]:
    """The default thresholds (``DEFAULT_THRESHOLDS``, or ``defaults``) updated with ``thresholds``; unknown names
    and values outside (0, 1] are refused."""
    defaults = DEFAULT_THRESHOLDS if defaults is None else defaults
    thresholds = dict(thresholds or {})
    unknown = sorted(set(thresholds) - set(defaults))
    if unknown:
        raise ValueError(f"Unknown threshold name(s) {unknown}; thresholds are set per kind: {sorted(defaults)}.")
    bad = {k: v for k, v in thresholds.items() if not (isinstance(v, (int, float)) and 0 < v <= 1)}
    if bad:
        raise ValueError(f"Thresholds are fractions in (0, 1]; got {bad}.")
    return {**defaults, **thresholds}


def strongest_heads(df: pd.DataFrame, per_class: int = 3, order: tuple[str, ...] = LABEL_ORDER) -> pd.DataFrame:
    """The ``per_class`` highest-scoring heads of each class that some head clears, classes in ``order`` (most
    specific first, ``LABEL_ORDER``): columns ``class``, ``layer``, ``head``, ``score`` and its 95%
    interval ``lo``/``hi`` (where the frame has one), ``labels``, and ``site`` first where the table's sites are not
    one per layer. A short table where a 30-layer model labels hundreds of heads (most of them sinks)."""
    sites = not one_site_per_layer(df)
    columns = {}
    for r in registry.labelled():  # a class two scores give ranks by the first in the table (induction, then _text)
        if r.label_column in df:
            columns.setdefault(r.gives, r.label_column)
    rows = []
    for kind in order:
        column = columns.get(kind, kind)
        if column not in df or "labels" not in df:
            continue
        cleared = df[df["labels"].fillna("").str.split("+").apply(lambda labels: kind in labels)]
        for r in cleared.sort_values(column, ascending=False).head(per_class).itertuples():
            rows.append({"class": kind, **({"site": r.site} if sites else {}), "layer": int(r.layer),
                         "head": int(r.head), "score": float(getattr(r, column)),
                         "lo": float(getattr(r, f"{column}_lo", float("nan"))),
                         "hi": float(getattr(r, f"{column}_hi", float("nan"))), "labels": r.labels})
    return pd.DataFrame(rows, columns=["class", *(["site"] if sites else []), "layer", "head", "score", "lo", "hi",
                                       "labels"])
