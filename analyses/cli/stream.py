"""`interp stream`: streaming curves (heads turned into sink + recent-window heads a share at a time, in the order of
a score), written as a CSV and a figure; with --save, a copy whose first --fraction of heads stream for good."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from .common import (UserError, _Progress, _check_out, _emit, _format_option, _load, _model_options, _positive_int,
                     _prompts, _rank_zero_path, _refuse_seq2seq)

ORDERS = ("retrieval", "importance", "random", "gates")


def add_parser(sub) -> None:
    """`interp stream`: its options."""
    p = sub.add_parser("stream", help="streaming curves (sinks + a recent window per head); optionally save a "
                                      "streaming model")
    _model_options(p)
    _format_option(p)
    p.add_argument("--order", default="retrieval,random",
                   help=f"comma-separated orders, first to stream first: {', '.join(ORDERS)} (default "
                        "retrieval,random: lowest retrieval score first, against random orders; gates: "
                        "DuoAttention-style gates fitted on passkey-like inputs, 100 forward and backward passes)")
    p.add_argument("--sink", type=int, default=4, help="first keys every streaming head keeps (default 4)")
    p.add_argument("--window", type=_positive_int, default=256, help="recent keys each query sees (default 256)")
    p.add_argument("--step", type=float, default=0.1, help="share of all heads streamed more per step")
    p.add_argument("--tokens", type=_positive_int, default=None,
                   help="length of each input row (default: the model's positions, at most 1024); without --prompts")
    p.add_argument("--rows", type=_positive_int, default=4, help="input rows (default 4); without --prompts")
    p.add_argument("--steps", type=_positive_int, default=100, help="order gates: optimisation steps of the "
                   "DuoAttention-style gates (default 100)")
    p.add_argument("--seeds", type=_positive_int, default=3, help="random orders: how many seeds (default 3)")
    p.add_argument("--context", type=_positive_int, default=None, metavar="TOKENS",
                   help="retrieval order only: the longest needle-in-a-haystack prompt (default --tokens); the "
                        "gates order fits on passkey prompts of 2 x (--sink + --window) tokens")
    p.add_argument("--out", type=Path, required=True, help="folder for streaming_curve.csv and streaming_curve.png")
    p.add_argument("--save", type=Path, default=None, help="folder to save a streaming model to (interp.stream_model)")
    p.add_argument("--fraction", type=float, default=None, help="with --save: share of heads that stream, taken "
                   "in the first --order")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_stream)


def _check_args(args) -> list[str]:
    orders = [o.strip() for o in args.order.split(",") if o.strip()]
    unknown = [o for o in orders if o not in ORDERS]
    if unknown or not orders:
        raise UserError(f"--order takes {', '.join(ORDERS)} (comma-separated); got {args.order!r}")
    if args.context is not None and "retrieval" not in orders:
        raise UserError(f"--context sets the length of the retrieval order's needle prompts, and --order "
                        f"{args.order} has no retrieval order; drop --context, or add retrieval to --order")
    if args.sink < 0:
        raise UserError(f"--sink is a number of keys, at least 0; got {args.sink}")
    if not 0 < args.step <= 1:
        raise UserError(f"--step is a share of the heads in (0, 1]; got {args.step}")
    if args.save is not None:
        if args.fraction is None:
            raise UserError("--save needs --fraction: the share of heads that stream, e.g. 0.5")
        if not 0 < args.fraction <= 1:
            raise UserError(f"--fraction is a share of the heads in (0, 1]; got {args.fraction}")
        from interp.runtime.model_files import check_model_folder

        check_model_folder(args.save, args.force)  # --force replaces only what interp wrote there
    elif args.fraction is not None:
        raise UserError("--fraction goes with --save DIR (where the streaming model is written)")
    _check_out(args.out, args.force)
    return orders


def cmd_stream(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import pandas as pd

    from interp.runtime import distributed
    from interp import stream_model
    from interp.streaming import KVHeadsNote, check_streamable
    from interp.streaming.cache import kv_note
    from interp.runtime.model_files import save_model

    from ..long.streaming import streaming_curve, streaming_inputs, streaming_order
    from ..views.study_plots import streaming_curve_plot
    from ..data.prompts import study_inputs

    orders = _check_args(args)
    with _Progress(["load", "orders", "streaming curves"]) as progress:
        progress("load")
        model = _load(args)
        _refuse_seq2seq(model, "interp stream", "streaming heads keep a causal decoder's sinks and recent past.")
        check_streamable(model, "interp stream")
        prompts = _prompts(args, model)
        tokens = args.tokens or min(model.cfg.max_positions or 1024, 1024)
        if prompts is not None:
            inputs, metric, what = study_inputs(model, prompts, seed=args.seed)
        else:
            inputs, metric, what = streaming_inputs(model, tokens, args.rows, args.seed)
            if tokens <= args.sink + args.window:
                raise UserError(f"--tokens {tokens} <= --sink + --window ({args.sink + args.window}): every head "
                                "would still see every key; give a smaller --window or longer --tokens")
        progress("orders")
        ranked = {}
        for order in orders:
            if order == "retrieval":
                from ..long.retrieval import retrieval_heads

                ranked[order] = retrieval_heads(model, context=args.context or tokens, seed=args.seed)
            elif order == "gates":  # DuoAttention-style gates on passkey-like inputs (100 eager forward+backward)
                from ..long.streaming_gates import streaming_gates

                ranked[order] = streaming_gates(model, sink=args.sink, window=args.window, seed=args.seed,
                                                 steps=args.steps)
            else:
                ranked[order] = order
        progress("streaming curves")
        seeds = tuple(range(args.seed, args.seed + args.seeds))
        curves = [streaming_curve(model, inputs, metric, order=ranked[o], step=args.step, seeds=seeds, sink=args.sink,
                                  window=args.window) for o in orders]
    df = pd.concat(curves, ignore_index=True)
    df.attrs.update(curves[0].attrs)
    out = _rank_zero_path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "streaming_curve.csv", index=False)
    ax = streaming_curve_plot(df)
    ax.set_title(f"streaming curve: {getattr(model, 'source_name', args.model)}", fontsize=10)
    ax.figure.savefig(out / "streaming_curve.png", dpi=100)
    if args.format == "table":
        print(f"# {metric.name} on {what}; sink {args.sink}, window {args.window}; kv_heads: the key/value heads "
              f"(of {sum(model.cfg.kv_heads_per_layer)}) whose cache shrinks, those all of whose query heads stream")
        table = df.groupby(["order", "fraction_streaming"], sort=False).agg(
            metric=("metric", "mean"), lo=("metric", "min"), hi=("metric", "max"),
            kv_heads=("kv_heads_streaming", "mean"), kv_fraction=("kv_fraction", "mean"))
        _emit(table.reset_index(), "table")
    else:
        _emit(df, args.format)
    if distributed.rank_zero():
        print(f"wrote {args.out / 'streaming_curve.csv'} and {args.out / 'streaming_curve.png'}", file=sys.stderr)
    if args.save is not None:
        heads = streaming_order(model, inputs, metric, ranked[orders[0]], seed=args.seed)
        heads = heads[:round(args.fraction * len(heads))]
        with warnings.catch_warnings():  # its note is printed below, in one line
            warnings.simplefilter("ignore", KVHeadsNote)
            streamed = stream_model(model, heads, sink=args.sink, window=args.window)
        save_model(streamed, _rank_zero_path(args.save), overwrite=args.force)  # whole, or not at all
        if distributed.rank_zero():
            named = ", ".join(f"{l}.{h}" for l, h in heads[:12]) + (", ..." if len(heads) > 12 else "")
            print(f"saved a model whose {len(heads)} heads ({named}) stream "
                  f"(sink {args.sink}, window {args.window}) to {args.save}", file=sys.stderr)
            note = kv_note(heads, model.cfg.heads_per_layer, model.cfg.kv_heads_per_layer)
            if note:
                print(note, file=sys.stderr)
    return 0
