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
    from interp.structure import describe

    print("\nfound by the load probe:")
    for line in describe(model.structure):
        print(f"  {line}")
    print(f"\nhook names ({len(model.hook_names())}):")
    from hooks import HOOK_TABLE

    for spec in HOOK_TABLE:
        if spec.per_layer and spec.name(0) not in model.hook_names():
            continue
        print(f"  {spec.template:<34} {spec.shape:<14} {spec.meaning}")
    return 0
