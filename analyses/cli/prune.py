"""`interp prune`: pruning curves, importance against random; with --save, a structurally pruned copy of any model
(its heads are ``(site, head)``: an encoder-decoder model's encoder, decoder and cross-attention sites alike)."""

from __future__ import annotations

import sys
from pathlib import Path

from .common import (UserError, _emit, _format_option, _load, _model_options, _one_line, _positive_int,
                     _Progress, _prompts, _rank_zero_path)


def add_parser(sub) -> None:
    """`interp prune`: its options."""
    p = sub.add_parser("prune", help="pruning curves (importance vs random); optionally save a pruned model")
    _model_options(p)
    _format_option(p)
    p.add_argument("--step", type=float, default=0.1, help="share of the remaining heads pruned per step")
    p.add_argument("--n-prompts", type=_positive_int, default=32)
    p.add_argument("--save", type=Path, default=None, help="folder to save a structurally pruned model to")
    p.add_argument("--fraction", type=float, default=None, help="with --save: share of heads to prune")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_prune)


def cmd_prune(args) -> int:
    from interp.runtime import distributed

    from ..causal.pruning import curve_summary
    from ..data.prompts import study_inputs

    if args.save is not None:  # check before any work
        if args.fraction is None:
            raise UserError("--save needs --fraction: the share of heads to prune by importance, e.g. 0.3")
        if not 0 < args.fraction < 1:
            raise UserError(f"--fraction is a share of the heads in (0, 1); got {args.fraction}")
        from interp.runtime.model_files import check_model_folder

        check_model_folder(args.save, args.force)  # --force replaces only what interp wrote there
    elif args.fraction is not None:
        raise UserError("--fraction goes with --save DIR (where the pruned model is written)")
    with _Progress(["load", *(["importance"] if args.save is not None else []), "pruning curves"]) as progress:
        progress("load")
        model = _load(args)
        inputs, metric, what = study_inputs(model, _prompts(args, model), n=args.n_prompts, seed=args.seed)
        pruned = heads = None
        if args.save is not None:  # before the curves: a model that cannot be sliced is refused at once
            progress("importance")
            pruned, heads = _pruned(model, inputs, metric, args.fraction)
        progress("pruning curves")
        curves = _pruning_curves(model, inputs, metric, args.step, args.seed)
    if args.format == "table":
        print(f"# {metric.name} on {what}")
        threshold = 0.95 if metric.name == "embedding_similarity" else None
        _emit(curve_summary(curves, threshold), "table")
        print()
    _emit(curves, args.format)
    if pruned is not None:
        from interp.runtime.model_files import save_model

        save_model(pruned, _rank_zero_path(args.save), overwrite=args.force)  # whole, or not at all
        if distributed.rank_zero():
            print(f"saved a model without {len(heads)} heads ({', '.join(f'{l}.{h}' for l, h in heads)}) to "
                  f"{args.save}", file=sys.stderr)
    return 0


def _pruning_curves(model, inputs, metric, step: float, seed: int):
    import pandas as pd

    from ..causal.pruning import pruning_curve

    return pd.concat([pruning_curve(model, inputs, metric, order="importance", step=step),
                      pruning_curve(model, inputs, metric, order="random", step=step,
                                    seeds=tuple(range(seed, seed + 3)))])


def _pruned(model, inputs, metric, fraction: float):
    """(the pruned model, the heads it lost): the ``fraction`` of heads least important by Michel et al.'s importance,
    keeping at least one head at every site (layer). A model whose heads cannot be sliced (T5: one relative
    position bias shared by every block's heads) is refused in one line."""
    from interp.attention.sites import row_head

    from ..causal.pruning import head_importance, prune_model

    importance = head_importance(model, inputs, loss=metric)
    n = int(round(fraction * len(importance)))
    sites = importance["site"] if "site" in importance else importance["layer"]
    left = sites.value_counts().to_dict()
    heads = []  # the n least important (ties: in site order), keeping at least one head at every site
    order = importance["importance"].sort_values(kind="stable").index
    for where, r in zip(sites[order], importance.loc[order].itertuples()):
        if len(heads) < n and left[where] > 1:
            heads.append(row_head(model, r))
            left[where] -= 1
    try:
        return prune_model(model, heads), heads
    except NotImplementedError as err:
        raise UserError(f"--save: {_one_line(err)}; drop --save to get the pruning curves") from None
