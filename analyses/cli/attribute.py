"""`interp attribute`: direct logit attribution of every head and MLP, or the logit lens, on every model: a head is a
row per ``(site, head)`` of the stack that feeds the logits (an encoder-decoder model's decoder self- and
cross-attention sites alike)."""

from __future__ import annotations

from pathlib import Path

from .common import (UserError, _at_least, _check_out_file, _emit, _format_option, _id_line, _load, _model_options,
                     _parse_heads, _positive_int, _Progress, _text_or_ids, _token, load_score_modules,
                     score_module_option)


def add_parser(sub) -> None:
    """`interp attribute`: its options."""
    p = sub.add_parser("attribute", help="direct logit attribution of every head and MLP (or the logit lens)")
    _model_options(p)
    _format_option(p)
    p.add_argument("--text", default=None, help="the input (default: the induction task's second copy; an "
                   "encoder-decoder model's: the copy task's last target token); an encoder-decoder model's source")
    p.add_argument("--target", default=None, help="encoder-decoder models: the target so far, fed to the decoder "
                   "behind its start token (default: none, the first target token is attributed)")
    p.add_argument("--answer", default=None, help="the next token to attribute (a token or its id)")
    p.add_argument("--wrong", default=None, help="attribute logit[answer] - logit[wrong]")
    p.add_argument("--lens", action="store_true", help="print the logit lens instead")
    p.add_argument("--n-prompts", type=_positive_int, default=16)
    p.add_argument("--top", type=_positive_int, default=20, help="table: the largest components")
    p.add_argument("--qk", default=None, metavar="HEADS", help="explain why these heads attend where they do (LAYER.HEAD "
                   "or SITE.HEAD, comma-separated): their attention scores split exactly into query-side and key-side "
                   "components, with the causal check")
    p.add_argument("--pairs", default=None, help="--qk: the (query, key) pairs to explain: top1 (each query's top key) "
                   "or a registered target-rule score, e.g. previous_token or induction (yours with --score-module; "
                   "default: induction on the default prompts, top1 with --text)")
    score_module_option(p)
    p.add_argument("--draws", type=_at_least(0), default=20, help="--qk: random head sets for the causal check "
                   "(0: no causal check)")
    p.add_argument("--plot", type=Path, default=None, help="--qk: save the first head's figure here (.png, .pdf, .svg)")
    p.add_argument("--force", action="store_true", help="--plot: replace a file that exists there")
    p.set_defaults(func=cmd_attribute)


def cmd_attribute(args) -> int:
    if args.qk is not None:
        return _cmd_qk(args)
    if args.pairs is not None or args.plot is not None or args.force or args.score_module:
        raise UserError("--pairs, --plot, --force and --score-module go with --qk HEADS (the heads whose attention to "
                        "explain)")
    from ..causal.attribution import token_ids
    from ..explain.logit_attribution import direct_logit_attribution, logit_lens
    from ..data.seq2seq import is_seq2seq

    with _Progress(["load", "attribution"]) as progress:
        progress("load")
        model = _load(args)
        seq2seq = is_seq2seq(model)
        if args.target is not None and not seq2seq:
            raise UserError("--target is an encoder-decoder model's target so far; a decoder-only model reads "
                            "--text alone")
        if args.text is None:
            if args.target is not None:
                raise UserError("--target goes with --text (the source) and --answer")
            inputs, answer, what = _default_inputs(model, args, seq2seq)
            wrong = None
        else:
            if args.answer is None:
                raise UserError("--text needs --answer (the next token to attribute), and optionally --wrong")
            answer = token_ids(model, _token(args.answer), 1, "--answer")
            wrong = None if args.wrong is None else token_ids(model, _token(args.wrong), 1, "--wrong")
            inputs = _text_or_ids(args.text, model)
            if seq2seq:  # the decoder reads its start token and the target so far; its last position predicts answer
                inputs, what = _pair(model, inputs, args.target, answer), f"source {args.text!r}"
                what += f", target {args.target!r}" if args.target else ", the first target token"
            else:
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


def _default_inputs(model, args, seq2seq: bool):
    """(inputs, answer, description): the induction task's second copy (its last token), or on an encoder-decoder
    model the copy task, teacher-forced (its last target token)."""
    if seq2seq:
        from ..data.seq2seq import copy_task

        batch = copy_task(model, n=args.n_prompts, length=12, seed=args.seed)
        return batch, batch["labels"][:, -1], f"the copy task ({args.n_prompts} pairs), last target token"
    from ..data.tasks import induction_task

    clean, _, _ = induction_task(model, n=args.n_prompts, length=12, seed=args.seed)
    return clean[:, :-1], clean[:, -1], "the induction task's second copy, last token"


def _pair(model, source, target: str | None, answer) -> dict:
    """An encoder-decoder batch: the source, and the decoder fed its start token and ``target``'s tokens (no special
    tokens added), so that its last position predicts ``answer``."""
    import torch

    from interp.tokens.inputs import encode

    if target is None:
        ids = []
    elif model.tokenizer is None:
        ids = _id_line(target, "--target")
    else:
        ids = encode(model.tokenizer, target, add_special_tokens=False)
    batch = source if isinstance(source, dict) else {"input_ids": source, "attention_mask": None}
    labels = torch.tensor([[*ids, int(answer[0])]], device=model.device)
    return {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask"),
            "decoder_input_ids": model.decoder_inputs(labels)}


def _cmd_qk(args) -> int:
    """`interp attribute --qk HEADS`: each head's scores split into query-side and key-side components."""
    from ..explain.qk_attribution import qk_attribution
    from ..explain.qk_causal import causal_summary
    from ..data.seq2seq import is_seq2seq

    if args.lens or args.answer is not None or args.wrong is not None:
        raise UserError("--qk explains attention scores: it takes no --lens, --answer or --wrong")
    load_score_modules(args)
    _check_pairs(args.pairs)
    if args.plot is not None and args.plot.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise UserError(f"--plot is a .png, .pdf or .svg file; got {str(args.plot)!r}")
    if args.plot is not None:
        _check_out_file(args.plot, args.force)  # a file there is the user's: replaced only with --force
    with _Progress(["load", "attribution"]) as progress:
        progress("load")
        model = _load(args)
        heads = _parse_heads(args.qk, model)
        seq2seq = is_seq2seq(model)
        if args.text is not None:
            inputs = _text_or_ids(args.text, model)
            if seq2seq:  # the decoder reads the source itself, teacher-forced (a copy)
                source = inputs["input_ids"] if hasattr(inputs, "keys") else inputs
                inputs = {"input_ids": source, "decoder_input_ids": model.decoder_inputs(source)}
            pairs = args.pairs or "top1"
        elif seq2seq:
            from ..data.seq2seq import copy_task

            inputs, pairs = copy_task(model, n=args.n_prompts, length=12, seed=args.seed), args.pairs or "top1"
        else:
            from ..data.tasks import induction_task

            inputs, pairs = induction_task(model, n=args.n_prompts, length=12, seed=args.seed)[0], args.pairs or "induction"
        progress("attribution")
        try:
            df = qk_attribution(model, inputs, heads, pairs=pairs, causal=args.draws > 0, draws=args.draws,
                                seed=args.seed)
        except ValueError as err:
            raise UserError(str(err)) from None
    if args.plot is not None:
        from ..views.qk_view import qk_attribution_plot
        from ..views.plots import save_figure

        first = (df["site"].iloc[0], int(df["head"].iloc[0]))
        save_figure(qk_attribution_plot(df, head=first), args.plot, overwrite=args.force)
    if args.format != "table":
        _emit(df, args.format)
        return 0
    print(f"# why heads attend: {len(df.attrs['pairs'])} pairs ({pairs if isinstance(pairs, str) else 'given'}), "
          f"scores split exactly (largest error {df.attrs['max_error']:.2e}), path {df.attrs['path']}")
    for (site, head), rows in df.groupby(["site", "head"], sort=False):
        print(f"\n## {site} head {head}: largest terms on the key side, then on the query side")
        for side in ("key", "query"):
            best = rows.dropna(subset=[side]).sort_values(side, ascending=False).head(args.top)
            _emit(best[["label", side, "total"]], "table")
    summary = causal_summary(df.attrs["causal"])
    if not summary.empty:
        print("\n## causal check: the top heads of a side removed from that side's path, against random heads")
        _emit(summary.drop(columns=["stack", "kind"]), "table")
    if args.plot is not None:
        print(f"\nfigure: {args.plot}")
    return 0


def _check_pairs(pairs: str | None) -> None:
    """``--pairs`` is what its help says: top1 or a registered target-rule score (a user's from --score-module)."""
    from ..heads import registry

    targets = registry.names(("target",))
    if pairs is not None and pairs != "top1" and pairs not in targets:
        registry.score(pairs)  # an unknown name: the registry's message, with the closest names
        raise UserError(f"--pairs is top1 or a target-rule score ({', '.join(targets)}; yours with --score-module); "
                        f"got {pairs!r}")
