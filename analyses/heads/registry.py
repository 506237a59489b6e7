"""The registry of head scores: every score a head can get, ours or a user's, is one record here, and every list of
score names in the package (``detect_heads``'s choices, the labels and their order, the thresholds, the CLI's help,
the report's grid, the views, the docs' table) is read from it.

A score is computed one of four ways (``HeadScore.how``):

- ``"target"``: a *target rule* says, for each query position, the key position it should attend to (or a set
  of them); the head's score is the mean weight on the targets over the rows that have one. Computed from the
  pattern on the eager path and from q, k and the logsumexp on the flash path (O(number of targets), never n x n),
  on every attention site it applies to, at any context length (``analyses.heads.scores``).
- ``"argmax"``: the offset of each row's top-1 key from its query (Voita et al.'s positional heads), from the
  flash path's tiled statistics or the pattern.
- ``"weights"`` and ``"behaviour"``: read from the weights, or from forward passes of their own (retrieval, function
  vectors, the IOI classes, dormant heads); ``runner`` names the function that computes them.

A user adds a target-rule score from their own file, without touching the package:

    import torch, analyses

    @analyses.head_score("punctuation", threshold=0.3, sites=("causal", "bidirectional", "cross"),
                         definition="the weight on the most recent punctuation token")
    def punctuation(ids, key_ids, tokenizer):
        ...  # (batch, pos) LongTensor: each query's target key position, -1 where it has none

after which ``detect_heads(model, scores=["punctuation"])``, ``interp heads --score-module FILE``, the report and the
views take it like ours.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .record_check import check_record

__all__ = ["DEFAULT_THRESHOLDS", "HeadScore", "LABEL_COLUMNS", "LABEL_ORDER", "columns", "is_fraction", "labelled",
           "of_column", "reserved_columns", "table_columns", "SCORE_DEFINITIONS", "SITE_KINDS", "head_score",
           "names", "register", "restore", "score", "scores", "snapshot", "unregister"]

SITE_KINDS = ("causal", "bidirectional", "cross")  # the kinds of attention site a score can apply to
LABEL_COLUMNS = ("label", "labels", "evidence")  # what labelling adds to a head table, after the scores
INTERVAL_ENDS = ("lo", "hi")  # each value score's bootstrap interval: <name>_lo, <name>_hi


@dataclass(frozen=True)
class HeadScore:
    """One head score.

    name: the column it fills. definition: one line, shown wherever the score is. citation: where it comes from.
    threshold: the score a head needs for its label (None: a measure without a label). label: the class it gives
    (default: its name). precedence: lower is more specific; a head's primary label is the most specific class it
    clears. how: ``"target"``, ``"argmax"``, ``"weights"`` or ``"behaviour"``. sites: the site kinds it applies to
    (``SITE_KINDS``). prompts: what it is computed on when ``detect_heads`` generates the prompts: ``"repeated"``
    (repeated random tokens), ``"corpus"`` (plain English; random tokens on a model without a tokenizer),
    ``"task"``, ``"needle"`` or ``"weights"``. needs: what it needs of the model (``"tokenizer"``,
    ``"unembedding"``). rule: the target rule (``how="target"``). column: the column its label reads (default:
    its name). runner: ``"module:function"`` computing a weights or behaviour score: called as
    ``function(model, names, seed=, n_bootstrap=, thresholds=, context=)`` with every asked-for score it computes,
    it returns one row per head (``layer``, ``head`` or the head columns) with a column per score. default: computed when no
    scores are named. builtin: ours (a user's score cannot take its name). fraction: whether the score is a share
    in [0, 1] (None: so for target-rule and argmax scores). extra: columns its runner writes beside its own
    (``table_columns``). check: the task its class is tested on causally (``analyses.atlas.class_ablation``)."""

    name: str
    definition: str
    how: str = "target"
    citation: str = ""
    threshold: float | None = 0.4
    label: str | None = None
    precedence: int = 50
    sites: tuple[str, ...] = ("causal", "bidirectional")
    prompts: str = "corpus"
    needs: tuple[str, ...] = ()
    rule: Callable | str | None = field(default=None, compare=False)  # a function, or "module:function" (ours)
    column: str | None = None
    runner: str | None = None
    default: bool = False
    builtin: bool = False
    fraction: bool | None = None  # a share in [0, 1]; None: true of target-rule and argmax scores
    extra: tuple[str, ...] = ()  # further columns its runner writes (name_mover's io_attention)
    check: str | None = None  # the behaviour its class is ablated on (analyses.atlas.class_ablation: copy, ordinal, ...)

    @property
    def label_column(self) -> str:
        return self.column or self.name

    @property
    def gives(self) -> str:
        return self.label or self.name

    def applies_to(self, site_kind: str) -> bool:
        return site_kind in self.sites

    @property
    def function(self) -> Callable:
        """The target rule (ours are named as ``"module:function"`` so that reading the registry imports no torch)."""
        if isinstance(self.rule, str):
            module, name = self.rule.split(":")
            return getattr(importlib.import_module(module), name)
        return self.rule

    def call_rule(self, **available):
        """The target rule called with the arguments it names (``ids``, ``key_ids``, ``tokenizer``), each tensor a
        copy of its own: a rule that edits ``ids`` in place changes nothing another score reads (``key_ids`` is
        the same copy as ``ids`` where they were the same tensor)."""
        rule = self.function
        wanted = inspect.signature(rule).parameters
        given = {k: v for k, v in available.items() if k in wanted}
        copies = {id(v): v.clone() for v in given.values() if hasattr(v, "clone")}
        return rule(**{k: copies.get(id(v), v) for k, v in given.items()})


_REGISTRY: dict[str, HeadScore] = {}


def table_columns(record: HeadScore) -> tuple[str, ...]:
    """The head-table columns one score fills (an argmax score's ``_offset``, ``_fraction``, else its value and its
    interval's ``_lo``, ``_hi``; then ``extra``): what ``order_columns`` lays out and ``register`` keeps apart."""
    values = [f"{record.name}_offset", f"{record.name}_fraction"] if record.how == "argmax" else [record.name]
    intervals = [] if record.how == "argmax" else [f"{record.name}_{end}" for end in INTERVAL_ENDS]
    return (*values, *intervals, *record.extra)


def reserved_columns(but: str | None = None) -> dict[str, str]:
    """Each column a head table can hold -> what fills it: the head's name, the labels, each score (but ``but``)."""
    from interp.attention.sites import FRONT

    owner = {c: "the head's name" for c in FRONT} | {c: "the labels" for c in LABEL_COLUMNS}
    for r in _REGISTRY.values():
        if r.name != but:
            owner.update({c: f"score {r.name!r}" for c in (r.name, *table_columns(r))})
    return owner


def register(record: HeadScore, replace: bool = False) -> HeadScore:
    """Add a score. A user's score may replace a user's score of the same name (a notebook cell run again); ours
    cannot be replaced. A score that would fill a column something else fills (``reserved_columns``) is refused."""
    check_record(record, SITE_KINDS)
    old = _REGISTRY.get(record.name)
    if old is not None and old.builtin:
        raise ValueError(f"{record.name!r} is one of interp's own scores; give your score another name.")
    if old is not None and not replace:
        raise ValueError(f"A score named {record.name!r} is registered already; pass replace=True to replace it.")
    taken = {} if record.builtin else reserved_columns(but=record.name)  # ours: a test (and no torch for --help)
    clash = next((c for c in table_columns(record) if c in taken), None)
    if clash is not None:
        raise ValueError(f"A score named {record.name!r} would fill the head table's column {clash!r}, which "
                         f"{taken[clash]} fills; give your score another name.")
    _REGISTRY[record.name] = record
    return record


def snapshot() -> dict[str, HeadScore]:
    """The records registered now, for ``restore``."""
    return dict(_REGISTRY)


def restore(saved: dict[str, HeadScore]) -> None:
    """The registry as ``snapshot`` saw it: what a user's module registered before it failed is undone."""
    _REGISTRY.clear()
    _REGISTRY.update(saved)


def _home(rule) -> set[str]:
    """Where a user's rule comes from: its module (a notebook's cells are all ``__main__``) and its file (one file
    imported under two module names is one home)."""
    if isinstance(rule, str):
        return {rule.split(":")[0]}
    code = getattr(rule, "__code__", None)
    return {str(getattr(rule, "__module__", None)), *([code.co_filename] if code is not None else [])}


def unregister(name: str) -> None:
    """Remove a user's score (ours stay)."""
    record = score(name)
    if record.builtin:
        raise ValueError(f"{name!r} is one of interp's own scores and cannot be removed.")
    del _REGISTRY[name]


def head_score(name: str, *, threshold: float | None = 0.4, definition: str = "", citation: str = "",
               sites: tuple[str, ...] = ("causal", "bidirectional"), prompts: str = "corpus",
               needs: tuple[str, ...] = (), precedence: int = 19, label: str | None = None, default: bool = True):
    """Register a target-rule head score from outside the package (a decorator).

    The decorated function takes any of ``ids`` (the query side's token ids, ``(batch, pos)``), ``key_ids`` (the key
    side's: the same on a self-attention site, the source on a cross-attention one) and ``tokenizer`` (the model's,
    or None), and returns either a ``(batch, pos)`` LongTensor of each query position's target key position, -1
    where a row has none, or a triple ``(batch, query, key)`` of 1-D LongTensors for rows with several targets
    (integer tensors in either form: a float one is refused; a pair listed twice is one target). It gets copies of
    the ids, so editing them in place changes no other score. It is called row by row on the unpadded tokens, so
    positions count from each prompt's first real token. A head's score is its mean weight on the targets over the
    rows that have one, with a 95% bootstrap interval over prompts; ``threshold`` (None: no label) gives it the
    label ``label`` (default: the name). sites: where it applies, of ``SITE_KINDS``. prompts: ``"corpus"`` (plain
    English text, the default) or ``"repeated"`` (repeated random tokens) when detect_heads generates them;
    ``precedence`` places its label among the classes (lower: more specific; the literature's classes are 10-15,
    cross-attention 16-18, the pattern classes 20-26). default: computed when ``detect_heads`` (and ``interp
    heads``, the report) is given no score names, beside ours."""
    def decorate(rule: Callable) -> Callable:
        old = _REGISTRY.get(name)
        if old is not None and not old.builtin and not _home(old.rule) & _home(rule):
            where = getattr(old.rule, "__module__", "?")
            raise ValueError(f"A score named {name!r} is registered already, from {where}; "
                             f"{getattr(rule, '__module__', None)} may not replace it: give this score another name, "
                             "or call analyses.heads.registry.unregister(name) first to replace it on purpose.")
        register(HeadScore(name=name, definition=definition or (rule.__doc__ or name).strip().splitlines()[0],
                           citation=citation, threshold=threshold, label=label, precedence=precedence,
                           sites=tuple(sites), prompts=prompts, needs=tuple(needs), rule=rule, default=default),
                 replace=True)
        return rule
    return decorate


def score(name: str) -> HeadScore:
    """The record of one score; an unknown name is refused with the closest ones and the full list."""
    if name not in _REGISTRY:
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=2)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"Unknown score {name!r}.{hint} Scores are {', '.join(_REGISTRY)} (a score of your own: "
                         "analyses.head_score; on the command line, --score-module).")
    return _REGISTRY[name]


def scores(how: tuple[str, ...] | None = None, site_kind: str | None = None) -> list[HeadScore]:
    """Every registered score (of the ``how`` kinds and applying to ``site_kind``, when given), in registration
    order: ours first."""
    return [r for r in _REGISTRY.values() if (how is None or r.how in how)
            and (site_kind is None or r.applies_to(site_kind))]


def names(how: tuple[str, ...] | None = None, site_kind: str | None = None) -> tuple[str, ...]:
    return tuple(r.name for r in scores(how, site_kind))


class _Live:
    """A read-only view of the registry, current whenever it is read (a user's score included)."""

    def __init__(self, read: Callable[[], dict | tuple]):
        self._read = read

    def __getitem__(self, key):
        return self._read()[key]

    def __len__(self) -> int:
        return len(self._read())

    def __repr__(self) -> str:
        return repr(self._read())


class _LiveMap(_Live, Mapping):
    def __iter__(self):
        return iter(self._read())


class _LiveSequence(_Live, Sequence):
    def __add__(self, other) -> tuple:
        return tuple(self._read()) + tuple(other)


def labelled() -> list[HeadScore]:
    """The scores that give a label (a threshold), most specific first (by precedence, then registration)."""
    return sorted((r for r in _REGISTRY.values() if r.threshold is not None), key=lambda r: r.precedence)


def columns() -> tuple[str, ...]:
    """The column each score is read from in a head table (``positional_fraction`` for ``positional``), most specific
    first: what a grid can be coloured by."""
    ranked = sorted(_REGISTRY.values(), key=lambda r: r.precedence)
    return tuple(r.label_column for r in ranked)


def of_column(column: str) -> HeadScore | None:
    """The score a head table's column holds (its value or its label column), or None."""
    return next((r for r in _REGISTRY.values() if column in (r.name, r.label_column)), None)


def is_fraction(column: str) -> bool:
    """Whether a score column is a share in [0, 1] (a grid's colour scale is then 0..1, comparable across models)."""
    record = of_column(column)
    return record is not None and (record.fraction if record.fraction is not None
                                   else record.how in ("target", "argmax"))


def _label_order() -> tuple[str, ...]:
    return tuple(dict.fromkeys(r.gives for r in labelled()))


# Each score's default threshold, each score's one-line definition, and the classes most specific first (a real
# induction head also puts most of its attention on the first token, and a previous-token head is positional too:
# the primary label names what is special about the head). Read live from the registry.
DEFAULT_THRESHOLDS = _LiveMap(lambda: {r.name: r.threshold for r in _REGISTRY.values() if r.threshold is not None})
SCORE_DEFINITIONS = _LiveMap(lambda: {r.name: f"{r.definition} ({r.citation})" if r.citation else r.definition
                                      for r in _REGISTRY.values()})
LABEL_ORDER = _LiveSequence(_label_order)


# -- interp's own scores ------------------------------------------------------------------------------------------
_SELF = ("causal", "bidirectional")
_TAXONOMY = "analyses.taxonomy.weights:taxonomy_frame"
_OURS = (
    # the literature's classes, computed only on request (analyses.taxonomy.weights, taxonomy_ioi, function_vectors)
    HeadScore("name_mover", "on IOI prompts, the head's direct share of logit(IO) - logit(S) at END; a name mover also "
              "attends END->IO more than END->S (io_attention > 0)", "behaviour", "Wang et al. 2022", 0.1,
              precedence=10, prompts="task", needs=("tokenizer", "unembedding"), runner=_TAXONOMY,
              extra=("io_attention",), check="ioi"),
    HeadScore("s_inhibition", "on IOI prompts, the share of the clean-corrupted logit difference the head carries "
              "through the name movers' queries (path patching)", "behaviour", "Wang et al. 2022", 0.1,
              precedence=11, prompts="task", needs=("tokenizer", "unembedding"), runner=_TAXONOMY, check="ioi"),
    HeadScore("function_vector", "the rise in P(answer) when the head's mean few-shot output replaces its output on "
              "shuffled-label prompts, averaged over ICL tasks", "behaviour", "Todd et al. 2024", 0.02,
              precedence=12, prompts="task", needs=("tokenizer", "unembedding"), runner=_TAXONOMY),
    HeadScore("successor", "the share of ordinal items (Gould et al.'s dataset) whose MLP0 output the head's OV "
              "maps to the next item's logit, highest among the successor tokens of the item's task", "weights",
              "Gould et al. 2023", 0.4, precedence=13,
              prompts="weights", needs=("tokenizer", "unembedding"), runner=_TAXONOMY, fraction=True,
              check="ordinal"),
    HeadScore("copy_suppression", "the share of tokens (a uniform sample of the vocabulary) whose effective embedding "
              "(block 0 without attention) the head's OV maps to that token among the 10 most negative logits of "
              "the whole vocabulary", "weights", "McDougall et al. 2023", 0.4, precedence=14,
              prompts="weights", needs=("tokenizer", "unembedding"), runner=_TAXONOMY, fraction=True,
              check="suppression"),
    HeadScore("copy_suppression_behaviour", "on corpus text, the share of positions where the earlier token the "
              "head attends to most is among the 10 tokens the logit lens predicts at its input and the head's "
              "output lowers that token's logit", "behaviour", "McDougall et al. 2023", None, precedence=14,
              needs=("tokenizer", "unembedding"), runner=_TAXONOMY, fraction=True, check="suppression",
              extra=("cs_attends_predicted", "cs_predicted_effect", "cs_attends_predicted_lo",
                     "cs_attends_predicted_hi")),
    HeadScore("retrieval", "while the model copies a random needle out of a long haystack, the generation steps at "
              "which the head's top-1 key is the needle token being generated, per needle token, averaged over the "
              "trials answered (protocol interp, or Wu et al.'s wu2024)", "behaviour",
              "Wu et al. 2024", 0.1, precedence=15, sites=("causal",), prompts="needle",
              runner="analyses.long.retrieval:retrieval_frame", fraction=True, check="needle"),
    # the attention-pattern classes of self-attention heads
    HeadScore("induction", "the weight a token puts on the token right after an earlier occurrence of itself, on "
              "repeated random tokens; rows without an earlier occurrence are left out", citation="Olsson et al. 2022",
              precedence=20, prompts="repeated", rule="analyses.heads.rules:induction", default=True, check="copy"),
    HeadScore("duplicate_token", "the weight a token puts on earlier occurrences of itself", precedence=21,
              prompts="repeated", rule="analyses.heads.rules:duplicate_token", default=True),
    # The same two classes on the corpus prompts, the text a model sees, where a real head can fall short on
    # random tokens; each gives its sibling's label, so a head takes the class on either (the evidence column says
    # which). About 21% of the rows of 64-token corpus prompts have an earlier occurrence (1,160-1,320 rows in 100
    # prompts on the bundled models), and common tokens spread the weight over several targets, so the scores run
    # lower than on random tokens. Thresholds from the distributions over heads of SmolLM2, Gemma 3 and MiniLM
    # (BENCHMARKS.md, "Natural-text labels (issue 38)"): induction_text 0.14 sits above MiniLM's best head (0.128; a
    # BERT without induction heads, random-token induction <= 0.017) and every other head of the three (<= 0.121),
    # under Gemma 3's 5.3 (0.227) and SmolLM2's 17.5 and 17.3 (0.328, 0.148); duplicate_token_text 0.3 sits above
    # the even tail of SmolLM2's early heads (99th percentile 0.296) that spread weight over repeated common tokens.
    # Thresholds for 64-token prompts (the default seq_len): at 256 tokens more heads clear 0.14 (SmolLM2's 20.2,
    # 20.5, 20.6, random-token induction heads or close). Defaults only where detect_heads generates text (needs).
    HeadScore("induction_text", "the weight a token puts on the token right after an earlier occurrence of itself, "
              "on corpus text (bigram induction); rows without an earlier occurrence are left out",
              citation="Olsson et al. 2022", threshold=0.14, label="induction", precedence=20,
              needs=("tokenizer",), rule="analyses.heads.rules:induction", default=True),
    HeadScore("duplicate_token_text", "the weight a token puts on earlier occurrences of itself, on corpus text",
              threshold=0.3, label="duplicate_token", precedence=21, needs=("tokenizer",),
              rule="analyses.heads.rules:duplicate_token", default=True),
    HeadScore("previous_token", "the weight a token puts on the token just before it, on corpus text (a position, "
              "not a repeat: no random-token sibling needed)", citation="Olsson et al. 2022",
              precedence=22, rule="analyses.heads.rules:previous_token", default=True),
    HeadScore("next_token", "the weight a token puts on the token just after it (bidirectional models only)",
              precedence=23, sites=("bidirectional",), rule="analyses.heads.rules:next_token", default=True),
    HeadScore("positional", "the share of rows whose largest weight sits at one fixed offset from the query; the "
              "offset is positional_offset", "argmax", "Voita et al. 2019", 0.9, precedence=24,
              column="positional_fraction", default=True),
    HeadScore("self", "the weight a token puts on itself", precedence=25, rule="analyses.heads.rules:self_target", default=True),
    HeadScore("sink", "the weight a token puts on the first token of the sequence", citation="Gu et al. 2024",
              threshold=0.3, precedence=26, rule="analyses.heads.rules:sink", default=True),
    # a sink whose sink moves nothing (Guo et al. 2024); 0.2 chosen by the causal check (see dormant_frame, sinks.md)
    HeadScore("dormant", "the weight a token puts on the first token minus the first token's share of the head's "
              "output norm (norm-weighted attention): weight the sink takes without moving anything", "behaviour",
              "Guo et al. 2024", 0.2, precedence=25, runner="analyses.explain.sinks:dormant_frame"),
    # cross-attention heads of encoder-decoder models (decoder queries on the encoder's output)
    HeadScore("alignment", "cross-attention: the weight a target position i puts on source position i (on the copy "
              "task, the token being copied)", precedence=16, sites=("cross",), prompts="task",
              rule="analyses.heads.rules:alignment", default=True),
    HeadScore("source_positional", "cross-attention: the share of target rows whose largest weight sits at one fixed "
              "offset from the aligned source position; the offset is source_positional_offset", "argmax",
              "Voita et al. 2019", 0.9, precedence=17, sites=("cross",), prompts="task",
              column="source_positional_fraction", default=True),
    HeadScore("source_sink", "cross-attention: the weight a target position puts on source position 0", threshold=0.3,
              precedence=18, sites=("cross",), prompts="task", rule="analyses.heads.rules:source_sink", default=True),
)
for _record in _OURS:
    register(HeadScore(**{**_record.__dict__, "builtin": True}))


def markdown_table(ours_only: bool = True) -> str:
    """Every registered score (ours only, by default) as a Markdown table: notebooks/head_scores.md's table."""
    rows = ["| score | computed from | sites | threshold | what it measures | source |", "|---|---|---|---|---|---|"]
    how = {"target": "target rule", "argmax": "row argmax", "weights": "weights", "behaviour": "forward passes"}
    for r in sorted((r for r in _REGISTRY.values() if r.builtin or not ours_only), key=lambda r: r.precedence):
        threshold = "no label" if r.threshold is None else f"{r.threshold:g} on `{r.label_column}`" + (
            f", label `{r.gives}`" if r.gives != r.name else "")
        rows.append(f"| `{r.name}` | {how[r.how]} ({r.prompts}) | {', '.join(r.sites)} | {threshold} | "
                    f"{r.definition} | {r.citation or 'interp'} |")
    return "\n".join(rows)
