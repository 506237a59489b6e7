"""`interp attribute`: direct logit attribution of every head and MLP, or the logit lens."""

from __future__ import annotations

from .common import (UserError, _Progress, _emit, _format_option, _load, _model_options, _positive_int, _refuse_seq2seq,
                     _text_or_ids, _token)


def add_parser(sub) -> None:
    """`interp attribute`: its options."""
    p = sub.add_parser("attribute", help="direct logit attribution of every head and MLP (or the logit lens)")
    _model_options(p)
    _format_option(p)
    p.add_argument("--text", default=None, help="the input (default: the induction task's second copy)")
    p.add_argument("--answer", default=None, help="the next token to attribute (a token or its id)")
    p.add_argument("--wrong", default=None, help="attribute logit[answer] - logit[wrong]")
    p.add_argument("--lens", action="store_true", help="print the logit lens instead")
    p.add_argument("--n-prompts", type=_positive_int, default=16)
    p.add_argument("--top", type=_positive_int, default=20, help="table: the largest components")
    p.set_defaults(func=cmd_attribute)


def cmd_attribute(args) -> int:
    from ..attribution import token_ids
    from ..logit_attribution import direct_logit_attribution, logit_lens

    with _Progress(["load", "attribution"]) as progress:
        progress("load")
        model = _load(args)
        _refuse_seq2seq(model, "interp attribute (its prompts and --text are decoder-only inputs)",
                        "call analyses.direct_logit_attribution or logit_lens on a batch with decoder_input_ids "
                        "(the decoder stack), or use interp patch --method attribution.")
        if args.text is None:
            from ..tasks import induction_task

            clean, _, _ = induction_task(model, n=args.n_prompts, length=12, seed=args.seed)
            inputs, answer, wrong = clean[:, :-1], clean[:, -1], None
            what = "the induction task's second copy, last token"
        else:
            if args.answer is None:
                raise UserError("--text needs --answer (the next token to attribute), and optionally --wrong")
            inputs = _text_or_ids(args.text, model)
            answer = token_ids(model, _token(args.answer), 1, "--answer")
            wrong = None if args.wrong is None else token_ids(model, _token(args.wrong), 1, "--wrong")
            what = repr(args.text)
        progress("attribution")
        if args.lens:
            df = logit_lens(model, inputs, answer=answer)
        else:
            df = direct_logit_attribution(model, inputs, answer, wrong)
    if args.format == "table" and not args.lens:
        print(f"# direct logit attribution on {what}: logit{' difference' if wrong is not None else ''} "
              f"{df.attrs['logit']:.4f}, remainder {df.attrs['remainder']:.2e}")
        df = df.reindex(df["attribution"].abs().sort_values(ascending=False).index).head(args.top)
    _emit(df, args.format)
    return 0
