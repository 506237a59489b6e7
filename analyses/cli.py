"""The ``interp`` command line: ``interp info MODEL`` (more subcommands build on this table of parsers).

User mistakes print one line to stderr and exit 2, with no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main", "build_parser"]


class UserError(Exception):
    """A mistake in the command line or its inputs: reported in one line, exit code 2."""


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="toy-induction", help="bundled name (toy-induction, minilm) or model folder")
    p.add_argument("--attn", choices=["flash", "eager"], default="flash")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")


def _load(args):
    import interp

    return interp.load_model(args.model, attn=args.attn, device=args.device, dtype=args.dtype)


def cmd_info(args) -> int:
    if args.model_pos:
        args.model = args.model_pos
    model = _load(args)
    summary = model.summary()
    if args.format == "json":
        print(json.dumps({**summary, "hook_names": model.hook_names()}, indent=2))
        return 0
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")
    print(f"\nhook names ({len(model.hook_names())}):")
    from hooks import HOOK_TABLE

    for spec in HOOK_TABLE:
        if spec.per_layer and spec.name(0) not in model.hook_names():
            continue
        print(f"  {spec.template:<34} {spec.shape:<14} {spec.meaning}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="interp", description="Attention-head interpretability for HF models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("info", help="model summary and its hook names")
    p.add_argument("model_pos", nargs="?", metavar="MODEL", help="bundled name or model folder")
    _add_model_options(p)
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the weight-loading bar is noise in a command's output
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except (UserError, FileNotFoundError, NotADirectoryError, ModuleNotFoundError, NotImplementedError,
            ValueError, IndexError, KeyError) as err:
        message = err.args[0] if err.args else str(err)
        print(f"interp {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
