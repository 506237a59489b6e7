"""`interp heads`: classify every head (detect_heads)."""

from __future__ import annotations

from .common import _Progress, _emit, _format_option, _load, _model_options, _positive_int, _prompts


def add_parser(sub) -> None:
    """`interp heads`: its options."""
    p = sub.add_parser("heads", help="classify every head (previous-token, induction, ...)")
    _model_options(p)
    _format_option(p)
    p.add_argument("--kinds", "--scores", dest="kinds", default=None,
                   help="comma-separated score kinds (default: all attention-pattern kinds that apply); on request also "
                        "successor, copy_suppression, copy_suppression_behaviour, name_mover, s_inhibition, "
                        "function_vector, retrieval")
    p.add_argument("--context", type=_positive_int, default=None, metavar="TOKENS",
                   help="with --scores retrieval: the longest needle-in-a-haystack prompt (default: the model's "
                        "positions, at most 8192)")
    p.add_argument("--n-prompts", type=_positive_int, default=100)
    p.set_defaults(func=cmd_heads)


def cmd_heads(args) -> int:
    from ..heads import detect_heads

    with _Progress(["load", "heads"]) as progress:
        progress("load")
        model = _load(args)
        kinds = args.kinds.split(",") if args.kinds else None
        progress("heads")
        df = detect_heads(model, kinds=kinds, prompts=_prompts(args, model), n_prompts=args.n_prompts, seed=args.seed,
                          context=args.context)
    if args.format == "table":
        keep = [c for c in df.columns if not c.endswith(("_lo", "_hi"))]
        df = df[keep]
    _emit(df, args.format)
    return 0
