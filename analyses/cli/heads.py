"""`interp heads`: classify every head (detect_heads)."""

from __future__ import annotations

from .common import (_Progress, _emit, _format_option, _load, _model_options, _nonnegative_int, _positive_int,
                     _prompts, load_score_modules, score_help, score_module_option)

_TOP = 20  # rows of the table when --top is not given


def add_parser(sub) -> None:
    """`interp heads`: its options."""
    p = sub.add_parser("heads", help="classify every head (previous-token, induction, ...)")
    _model_options(p)
    _format_option(p)
    p.add_argument("--scores", default=None,
                   help=f"comma-separated registered scores: {score_help()}. The table is sorted by the first one")
    score_module_option(p)
    p.add_argument("--context", type=_positive_int, default=None, metavar="TOKENS",
                   help="the length in tokens of the prompts generated for every score that has one: the "
                        "attention-pattern scores' repeated random tokens and corpus prompts (default 64; an "
                        "encoder-decoder model's copy-task sources, default 12) and retrieval's longest "
                        "needle-in-a-haystack prompt (default: the model's positions, at most 8192); refused with "
                        "--prompts unless retrieval is asked for, and with only taxonomy scores")
    p.add_argument("--protocol", default=None, metavar="NAME",
                   help="retrieval's protocol: interp (default: 8 random digits, as many greedy steps as the needle "
                        "has tokens) or wu2024 (Wu et al. 2024: a natural-sentence needle, up to 50 greedy steps "
                        "stopping at a newline, a trial counted when ROUGE-1 recall > 0.5); refused unless "
                        "--scores asks for retrieval")
    p.add_argument("--weighting", choices=("raw", "norm"), default="raw",
                   help="raw: scores read the attention weights; norm: every target-rule score reads norm-weighted "
                        "attention, ||w_ij v_j W_O|| / sum_k ||w_ik v_k W_O|| (Kobayashi et al. 2020), the share of "
                        "the head's output that comes from its targets (argmax scores stay on the weights)")
    p.add_argument("--n-prompts", type=_positive_int, default=100)
    p.add_argument("--top", type=_nonnegative_int, default=None, metavar="N",
                   help=f"the N heads with the highest score (the first of --scores; without --scores, labelled "
                        f"heads first, the most specific class first, each by its score); 0 shows all. Default: "
                        f"{_TOP} in the table; csv and json keep every head in site order unless --top is given")
    p.set_defaults(func=cmd_heads)


def cmd_heads(args) -> int:
    from interp.runtime.progress import progress_lines_off_a_terminal

    from ..heads.detect import detect_heads

    load_score_modules(args)
    kinds = [k.strip() for k in args.scores.split(",")] if args.scores else None
    with _Progress(["load", "heads"]) as progress, progress_lines_off_a_terminal():
        progress("load")
        model = _load(args)
        progress("heads")
        df = detect_heads(model, scores=kinds, prompts=_prompts(args, model), n_prompts=args.n_prompts, seed=args.seed,
                          context=args.context, protocol=args.protocol, weighting=args.weighting)
    if args.format == "table":
        keep = [c for c in df.columns if not c.endswith(("_lo", "_hi"))]
        df = df[keep]
    df, by = _labels_first(df), None
    top = _TOP if args.top is None and args.format == "table" else args.top
    if top is not None:
        df, by = _ranked(df, kinds)
    shown = df if not top else df.head(top)
    _emit(shown, args.format)
    if args.format == "table" and len(shown) < len(df):
        print(f"# {len(df) - len(shown)} more heads not shown (sorted by {by}); --top 0 shows all")
    return 0


def _labels_first(df):
    """The head columns, then ``label``, ``labels`` and ``evidence``, then the scores."""
    from interp.attention.sites import FRONT

    first = [c for c in (*FRONT, "label", "labels", "evidence") if c in df]
    return df[first + [c for c in df.columns if c not in first]]


def _score_column(kind: str) -> str:
    from ..heads import registry

    record = registry.of_column(kind)
    return record.label_column if record is not None else kind


def _ranked(df, kinds: list[str] | None):
    """The rows sorted for reading, and what they are sorted by: by the first score asked for, highest first (NaN
    last); with no score asked for, labelled heads first, the most specific class first (``LABEL_ORDER``), each by
    its score."""
    import pandas as pd

    from ..heads.labels import LABEL_ORDER

    if kinds and _score_column(kinds[0]) in df:
        column = _score_column(kinds[0])
        return df.sort_values(column, ascending=False, na_position="last", kind="stable"), column
    order = {k: i for i, k in enumerate(LABEL_ORDER)}
    rank = df["label"].map(lambda label: order.get(label, len(order)))
    score = [row[_score_column(label)] if label in order else float("nan")
             for label, (_, row) in zip(df["label"], df.iterrows())]
    key = pd.DataFrame({"rank": rank.to_numpy(), "score": pd.to_numeric(pd.Series(score), errors="coerce")})
    key = key.sort_values(["rank", "score"], ascending=[True, False], na_position="last", kind="stable")
    return df.iloc[key.index.to_numpy()], "label, then its score"
