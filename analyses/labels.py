"""Scores and labels of heads: every score's name (and which models it applies to), threshold and one-line
definition, the order of the classes (most specific first), a head's primary label and every label it clears, and
the strongest heads of each class. What a table of scores is read with, whichever module computed the scores
(``analyses.scores``, the taxonomy, retrieval, ``analyses.seq2seq``'s cross-attention scores)."""

from __future__ import annotations

import difflib

import pandas as pd
from interp.sites import one_site_per_layer

__all__ = ["DEFAULT_THRESHOLDS", "KINDS", "TAXONOMY_SCORES", "RETRIEVAL_SCORES", "CROSS_KINDS", "SCORE_DEFINITIONS",
           "LABEL_ORDER", "NO_CLASS", "choose_scores", "head_labels", "label_heads", "resolve_thresholds", "strongest_heads"]

# -- the scores' names: the one list each kind of score is read from -----------------------------------------
WEIGHT_SCORES = ("previous_token", "next_token", "self", "sink", "duplicate_token", "induction")
KINDS = WEIGHT_SCORES + ("positional",)  # the attention-pattern scores of self-attention heads (analyses.scores)

# ARENA's 0.4 for previous/current/induction; Gu et al.'s 0.3 for sinks; Voita et al.'s 0.9 for positional.
DEFAULT_THRESHOLDS = {
    "previous_token": 0.4,
    "next_token": 0.4,
    "self": 0.4,
    "sink": 0.3,
    "duplicate_token": 0.4,
    "induction": 0.4,
    "positional": 0.9,
    # the literature's head taxonomy (analyses.taxonomy, taxonomy_ioi, function_vectors); Gould et al.'s 0.4
    "successor": 0.4,
    "copy_suppression": 0.4,
    "name_mover": 0.1,  # a tenth of the IOI logit difference written directly, and END->IO > END->S attention
    "s_inhibition": 0.1,  # a tenth of the clean-corrupted gap through the name movers' queries
    "function_vector": 0.02,  # two points of P(answer) on shuffled-label prompts
    "retrieval": 0.1,  # Wu et al. 2024: fewer than 5% of heads score above 0.1
}
TAXONOMY_SCORES = ("successor", "copy_suppression", "copy_suppression_behaviour", "name_mover", "s_inhibition",
                   "function_vector")  # copy_suppression_behaviour: a score without a published threshold, no label
RETRIEVAL_SCORES = ("retrieval",)  # causal models, read while they generate (analyses.retrieval)
CROSS_KINDS = ("alignment", "source_sink", "source_positional")  # cross-attention heads (analyses.seq2seq)
CROSS_THRESHOLDS = {"alignment": 0.4, "source_sink": 0.3, "source_positional": 0.9}



# -- which scores a model takes ---------------------------------------------------------------------------------
def _score_list(model: str | None = None) -> str:
    """The scores a model of this kind takes (every score when None), as one sentence for an error message."""
    pattern = [k for k in KINDS if not (model == "causal" and k == "next_token")]
    groups = {"attention-pattern scores": pattern}
    if model != "encoder-decoder":
        groups["on request"] = [*TAXONOMY_SCORES, *(RETRIEVAL_SCORES if model != "bidirectional" else ())]
    if model in (None, "encoder-decoder"):
        groups["cross-attention scores (encoder-decoder models)"] = list(CROSS_KINDS)
    return "; ".join(f"{group}: {', '.join(names)}" for group, names in groups.items())


def check_score_names(names) -> None:
    """Every name is a score of some model: an unknown one is refused with the closest names and the full list."""
    every = KINDS + TAXONOMY_SCORES + RETRIEVAL_SCORES + CROSS_KINDS
    for name in names:
        if name not in every:
            close = difflib.get_close_matches(str(name), every, n=2)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"Unknown score kind {name!r}.{hint} Scores are {_score_list()}.")


def choose_scores(names, model: str) -> dict[str, list[str]]:
    """detect_heads's ``scores``/``kinds`` on a model of this kind (``"causal"``, ``"bidirectional"`` or
    ``"encoder-decoder"``) as ``{"pattern", "cross", "taxonomy", "retrieval"}``, each a list in canonical order.
    None asks for the defaults: every attention-pattern score that applies (next_token on bidirectional heads
    only), and on an encoder-decoder the cross-attention scores. A name that is no score, or a score that does not
    apply to such a model, is refused with the reason and the scores the model takes."""
    seq2seq = model == "encoder-decoder"
    if names is None:
        pattern = [k for k in KINDS if not (model == "causal" and k == "next_token")]
        return {"pattern": pattern, "cross": list(CROSS_KINDS) if seq2seq else [], "taxonomy": [], "retrieval": []}
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ValueError(f"kinds is empty; pass None for the defaults, or some of the scores ({_score_list(model)}).")
    check_score_names(names)
    chosen = {group: [n for n in every if n in names] for group, every in
              (("pattern", KINDS), ("cross", CROSS_KINDS), ("taxonomy", TAXONOMY_SCORES),
               ("retrieval", RETRIEVAL_SCORES))}
    takes = f"This model takes {_score_list(model)}."
    if seq2seq and chosen["taxonomy"]:
        raise TypeError(f"The score(s) {chosen['taxonomy']} read one residual stream and its unembedding; an "
                        f"encoder-decoder model has two stacks. {takes}")
    if seq2seq and chosen["retrieval"]:
        raise TypeError("retrieval is read while a decoder-only model copies a needle out of the long prompt it "
                        "generates from (analyses.retrieval); it is not implemented for encoder-decoder models. "
                        f"{takes}")
    if not seq2seq and chosen["cross"]:
        raise TypeError(f"The score(s) {chosen['cross']} describe cross-attention heads (decoder queries on the "
                        "encoder's output), which only encoder-decoder models (T5, BART) have; this model's heads "
                        f"are all self-attention. {takes}")
    if model == "causal" and "next_token" in chosen["pattern"]:
        raise ValueError("next_token needs a bidirectional model: under causal masking no row sees the next token.")
    if model == "bidirectional" and chosen["retrieval"]:
        raise ValueError("Retrieval heads are read while a causal model generates; this model is bidirectional.")
    return chosen


# -- labels ----------------------------------------------------------------------------------------------
# One line per score, shown where the score is shown (report, views).
SCORE_DEFINITIONS = {
    "induction": "on repeated random tokens, the weight a token puts on the token right after an earlier "
                 "occurrence of itself (Olsson et al. 2022); rows without an earlier occurrence are left out",
    "duplicate_token": "the weight a token puts on earlier occurrences of itself",
    "previous_token": "the weight a token puts on the token just before it (Olsson et al. 2022)",
    "next_token": "the weight a token puts on the token just after it (bidirectional models only)",
    "positional": "the share of rows whose largest weight sits at one fixed offset from the query "
                  "(Voita et al. 2019); the offset is positional_offset",
    "self": "the weight a token puts on itself",
    "sink": "the weight a token puts on the first token of the sequence (Gu et al. 2024)",
    "successor": "the share of ordinal items whose effective embedding the head's OV maps to the next item's logit, "
                 "highest among its list (Gould et al. 2023)",
    "copy_suppression": "the share of tokens whose effective embedding the head's OV maps to that token among the "
                        "10 most negative logits (McDougall et al. 2023)",
    "copy_suppression_behaviour": "on corpus text, the share of positions where the earlier token the head attends "
                                  "to most is among the 10 tokens the logit lens predicts at its input and the "
                                  "head's output lowers that token's logit (McDougall et al. 2023)",
    "name_mover": "on IOI prompts, the head's direct share of logit(IO) - logit(S) at END; a name mover also attends "
                  "END->IO more than END->S (io_attention > 0; Wang et al. 2022)",
    "s_inhibition": "on IOI prompts, the share of the clean-corrupted logit difference the head carries through the "
                    "name movers' queries (path patching; Wang et al. 2022)",
    "function_vector": "the rise in P(answer) when the head's mean few-shot output replaces its output on "
                       "shuffled-label prompts, averaged over ICL tasks (Todd et al. 2024)",
    "retrieval": "while the model copies a random needle out of a long haystack, the share of generated tokens for "
                 "which the head's top-1 key is the needle token being copied (Wu et al. 2024)",
}

# Most specific first: a real induction head also puts most of its attention on the first token (a sink) and a
# previous-token head is also positional (offset -1); the primary label names what is special about the head.
LABEL_ORDER = ("name_mover", "s_inhibition", "function_vector", "successor", "copy_suppression", "retrieval",
               "induction", "duplicate_token", "previous_token", "next_token", "positional", "self", "sink")
# The primary labels that name no class: measured and cleared none, or not measured at all
NO_CLASS = ("none", "nan")


def head_labels(df: pd.DataFrame, thresholds: dict[str, float] | None = None) -> pd.Series:
    """Every class a head's scores clear, most specific first, joined by ``+`` (``"induction+sink"``), or ``""``.
    A score clears its threshold when it is at least the threshold; ``positional`` uses ``positional_fraction``.
    Only scores present as columns take part. A head none of whose scores was measured (all NaN) gets ``"nan"``:
    not measured, which ``""`` (measured, and no class cleared) would misstate."""
    limits = resolve_thresholds(thresholds)
    cleared, measured = {}, pd.Series(False, index=df.index)
    for kind in LABEL_ORDER:
        column = "positional_fraction" if kind == "positional" else kind
        if column in df:
            cleared[kind] = df[column].astype(float) >= limits[kind]
            measured |= df[column].notna()
            if kind == "name_mover" and "io_attention" in df:
                cleared[kind] &= df["io_attention"].astype(float) > 0
    table = pd.DataFrame(cleared, index=df.index)
    if not len(table.columns) or not len(table):
        return pd.Series("", index=df.index, name="labels", dtype=object)
    labels = table.apply(lambda row: "+".join(k for k, hit in row.items() if hit), axis=1).rename("labels")
    return labels.where(measured, "nan")


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
    specific first; an encoder-decoder model's cross-attention classes ``alignment``, ``source_positional``,
    ``source_sink`` where ``order`` names them): columns ``class``, ``layer``, ``head``, ``score`` and its 95%
    interval ``lo``/``hi`` (where the frame has one), ``labels``, and ``site`` first where the table's sites are not
    one per layer. A short table where a 30-layer model labels hundreds of heads (most of them sinks)."""
    sites = not one_site_per_layer(df)
    rows = []
    for kind in order:
        column = f"{kind}_fraction" if kind.endswith("positional") else kind
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
