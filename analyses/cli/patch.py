"""`interp patch`: activation, attribution or path patching of every head."""

from __future__ import annotations

from .common import (UserError, _Progress, _circuit_options, _emit, _format_option, _load, _model_options, _parse_heads,
                     _refuse_seq2seq, _text_or_ids, _token)


def add_parser(sub) -> None:
    """`interp patch`: its options."""
    p = sub.add_parser("patch", help="activation, attribution or path patching of every head")
    _model_options(p)
    _format_option(p)
    _circuit_options(p)
    p.add_argument("--method", choices=["activation", "attribution", "path"], default="activation")
    p.add_argument("--what", choices=["z", "q", "k", "v", "pattern"], default="z",
                   help="activation patching: which activation of a head is patched (pattern: eager path only)")
    p.add_argument("--by", choices=["head", "head_pos"], default="head")
    p.add_argument("--receivers", default=None, help="path patching: LAYER.HEAD list the paths end in")
    p.add_argument("--via", choices=["q", "k", "v"], default="q", help="path patching: the receivers' input")
    p.set_defaults(func=cmd_patch)


def cmd_patch(args) -> int:
    from ..causal.attribution import attribution_patching
    from ..causal.patching import activation_patching, path_patching

    with _Progress(["load", args.method]) as progress:
        progress("load")
        model = _load(args)
        if args.method == "path":
            _refuse_seq2seq(model, "--method path", "use --method activation or attribution (per site and head).")
        clean, corrupted, metric, what = _circuit_inputs(args, model)
        progress(args.method)
        if args.method == "activation":
            df = activation_patching(model, clean, corrupted, metric, by=args.by, what=args.what)
        elif args.method == "attribution":
            df = attribution_patching(model, clean, corrupted, metric, by=args.by)
        else:
            if not args.receivers:
                raise UserError("--method path needs --receivers LAYER.HEAD,... (the heads the path ends in)")
            df = path_patching(model, clean, corrupted, _parse_heads(args.receivers, model), metric, via=args.via)
    if args.format == "table":
        a = df.attrs
        print(f"# {args.method} patching of {a.get('what', 'z')} on {what}; {a['metric']}: clean {a['clean']:.4f}, "
              f"corrupted {a['corrupted']:.4f}; effect 0 = corrupted, 1 = clean")
        df = df.reindex(df["effect"].abs().sort_values(ascending=False).index).head(args.top)
    _emit(df, args.format)
    return 0


def _circuit_inputs(args, model):
    """(clean, corrupted, metric, description): the induction task by default, or --clean/--corrupted texts with
    --answer/--wrong tokens (a logit difference at the last position)."""
    from ..causal.attribution import token_ids
    from ..data.metrics import logit_difference
    from ..data.tasks import induction_task

    from ..data.seq2seq import copy_patching_task, is_seq2seq

    if is_seq2seq(model):
        if args.clean is not None or args.corrupted is not None:
            raise UserError("--clean/--corrupted are for decoder-only models; an encoder-decoder model is patched on "
                            "the copy task (omit them), or from Python with analyses.activation_patching on batches.")
        clean, corrupted, metric = copy_patching_task(model, n=args.n_prompts, seed=args.seed)
        return clean, corrupted, metric, (f"the copy task ({args.n_prompts} pairs; corrupted: the first half of "
                                          "each source replaced)")
    if args.clean is None and args.corrupted is None:
        clean, corrupted, metric = induction_task(model, n=args.n_prompts, length=12, seed=args.seed)
        return clean, corrupted, metric, f"the induction task ({args.n_prompts} sequences [BOS, x, x] against [BOS, y, x])"
    if args.clean is None or args.corrupted is None or args.answer is None or args.wrong is None:
        raise UserError("give --clean, --corrupted, --answer and --wrong together (or none of them for the "
                        "induction task)")
    clean, corrupted = _text_or_ids(args.clean, model), _text_or_ids(args.corrupted, model)
    answer, wrong = (int(token_ids(model, _token(v), 1, name)[0]) for v, name in ((args.answer, "--answer"),
                                                                                    (args.wrong, "--wrong")))
    return clean, corrupted, logit_difference(answer, wrong), f"{args.clean!r} against {args.corrupted!r}"
