"""`interp ablate`: the effect of ablating each head alone (ablation_scan)."""

from __future__ import annotations

from .common import _Progress, _emit, _format_option, _load, _model_options, _parse_heads, _positive_int, _prompts


def add_parser(sub) -> None:
    """`interp ablate`: its options."""
    p = sub.add_parser("ablate", help="the effect of ablating each head alone")
    _model_options(p)
    _format_option(p)
    p.add_argument("--method", choices=["zero", "mean", "resample"], default="zero")
    p.add_argument("--heads", default=None, help="SITE.HEAD or LAYER.HEAD list, e.g. 1.0,1.3 or "
                   "decoder.blocks.0.cross_attn.1 (default: all heads)")
    p.add_argument("--n-prompts", type=_positive_int, default=32)
    p.set_defaults(func=cmd_ablate)


def cmd_ablate(args) -> int:
    from ..causal.ablation import ablation_scan
    from ..data.prompts import study_inputs

    with _Progress(["load", "ablation scan"]) as progress:
        progress("load")
        model = _load(args)
        inputs, metric, what = study_inputs(model, _prompts(args, model), n=args.n_prompts, seed=args.seed)
        # mean: each head's mean output over these inputs; resample: its output on another input of the batch
        reference = None if args.method == "zero" else inputs if args.method == "mean" else _rolled(inputs)
        progress("ablation scan")
        df = ablation_scan(model, inputs, metric, method=args.method, heads=_parse_heads(args.heads, model),
                           reference=reference)
    if args.format == "table":
        print(f"# {metric.name} on {what}; baseline {df['baseline'].iloc[0]:.4f}")
    _emit(df, args.format)
    return 0


def _rolled(inputs):
    """The batch shifted by one sequence, so that every sequence gets another's activations."""
    import torch

    if isinstance(inputs, dict):
        return {k: None if v is None else torch.roll(v, 1, dims=0) for k, v in inputs.items()}
    return torch.roll(inputs, 1, dims=0)
