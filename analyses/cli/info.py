"""`interp info [MODEL]`: a model's summary, what the load probe found, and its hook names."""

from __future__ import annotations

import json

from .common import _emit, _format_option, _load, _model_options


def add_parser(sub) -> None:
    """`interp info`: its options."""
    p = sub.add_parser("info", help="model summary and its hook names")
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="bundled name or model folder")
    _model_options(p)
    _format_option(p)
    p.set_defaults(func=cmd_info)


def cmd_info(args) -> int:
    if args.model_pos:
        args.model = args.model_pos
    model = _load(args)
    summary = model.summary()
    if args.format == "json":
        print(json.dumps({**summary, "hook_names": model.hook_names()}, indent=2))
        return 0
    if args.format == "csv":
        import pandas as pd

        _emit(pd.DataFrame({"property": list(summary), "value": [str(v) for v in summary.values()]}), "csv")
        return 0
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")
    names = model.hook_names()
    if model.structure is None:  # an encoder-decoder: its sites, and its hook names with the block as {l}
        import re

        print("\nattention sites found by the load probe:")
        for site in model.cfg.sites:
            print(f"  {site.name:<30} {site.kind:<5} {'causal' if site.causal else 'bidirectional':<13} "
                  f"{site.n_heads} heads")
        templates = dict.fromkeys(re.sub(r"blocks\.\d+\.", "blocks.{l}.", n) for n in names)
        print(f"\nhook names ({len(names)}):")
        for template in templates:
            print(f"  {template}")
        return 0
    from interp.structure.layered import describe

    print("\nfound by the load probe:")
    for line in describe(model.structure):
        print(f"  {line}")
    print(f"\nhook names ({len(names)}):")
    from hooks import HOOK_TABLE

    for spec in HOOK_TABLE:
        if not any(spec.name(l) in names for l in range(model.cfg.n_layers)):  # no such point here (optional rows)
            continue
        print(f"  {spec.template:<34} {spec.shape:<14} {spec.meaning}")
    return 0
