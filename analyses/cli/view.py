"""`interp view [head|grid]`: an interactive view as one offline HTML page."""

from __future__ import annotations

from pathlib import Path

from .common import (load_score_modules, score_module_option, UserError, _check_out_file, _id_line, _load,
                     _model_options, _parse_heads, _prompts, _rank_zero_path, _read_csv)


def add_parser(sub) -> None:
    """`interp view`: its options."""
    p = sub.add_parser("view", help="an interactive view as one offline HTML page: a head view or the grid of heads")
    p.add_argument("kind", nargs="?", choices=["head", "grid"], default="head",
                   help="head (default): lines between query and key tokens; grid: every head as a thumbnail")
    _model_options(p)
    p.add_argument("--text", default=None, help="text (or token ids) to run; default an example prompt")
    p.add_argument("--layers", default=None, help="head: layers or sites to offer, e.g. 17,18 or blocks.17.attn "
                   "(default all)")
    p.add_argument("--heads", default=None, help="head: SITE.HEAD or LAYER.HEAD list, e.g. 17.4,18.6 (instead of "
                   "--layers)")
    p.add_argument("--window", type=int, nargs=2, metavar=("START", "STOP"), default=None,
                   help="show positions START..STOP-1 of a longer text")
    p.add_argument("--score", default=None, help="grid: the score that frames the thumbnails first")
    p.add_argument("--csv", type=Path, default=None, help="grid: scores from this table (a report's heads.csv) "
                   "instead of running detect_heads")
    p.add_argument("--weighting", choices=("raw", "norm"), default="raw",
                   help="head: raw (the attention weights) or norm (norm-weighted attention: each key's share of the "
                        "head's output norm, ||w_ij v_j W_O|| / sum_k ||w_ik v_k W_O||)")
    p.add_argument("--out", type=Path, required=True, help="the .html page to write")
    p.add_argument("--force", action="store_true")
    score_module_option(p)
    p.set_defaults(func=cmd_view)


def cmd_view(args) -> int:
    load_score_modules(args)
    from ..views import attention_grid, head_view
    from ..views.report import example_prompt

    if args.out.suffix.lower() not in (".html", ".htm"):
        raise UserError(f"--out {str(args.out)!r}: a view is one .html page")
    _check_out_file(args.out, args.force)
    if args.kind == "grid" and (args.layers or args.heads or args.weighting != "raw"):
        raise UserError("--layers, --heads and --weighting go with `interp view head`; the grid shows every head's "
                        "attention weights")
    from ..data.seq2seq import is_seq2seq

    model = _load(args)
    text = args.text if args.text is not None else example_prompt(model, _prompts(args, model), args.seed)
    if isinstance(text, str) and model.tokenizer is None:
        import torch

        text = torch.tensor(_id_line(text, "--text"))
    if is_seq2seq(model) and args.text is not None:
        text = (text, text)  # the decoder copies the source (what a denoising model such as BART does)
    window = tuple(args.window) if args.window else None
    if args.kind == "grid":
        scores = _read_csv(args.csv) if args.csv is not None else None
        view = attention_grid(model, text, score=args.score, scores=scores, window=window)
    else:
        layers = None if args.layers is None else [int(x) if x.isdigit() else x  # an index, or a seq2seq site
                                                   for x in args.layers.replace(",", " ").split()]
        view = head_view(model, text, layers=layers, heads=_parse_heads(args.heads, model), window=window,
                         weighting=args.weighting)
    view.save(_rank_zero_path(args.out), overwrite=args.force)
    print(args.out)
    return 0
