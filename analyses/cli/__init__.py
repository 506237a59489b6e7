"""The ``interp`` command line: one module per verb, which parses, calls and prints. May import every room of
``analyses`` (views included); nothing imports it.

    interp info [MODEL]                         model summary and hook names
    interp heads      [--model M]               classify every head (detect_heads)
    interp ablate     [--model M]               effect of ablating each head alone (ablation_scan)
    interp prune      [--model M] [--save DIR]  pruning curves, importance vs random; save a pruned model
    interp stream     --out DIR [--save DIR]    streaming curves (retrieval order vs random); save a streaming model
    interp plot       --layer L --head H --out PNG [--text T]   one head's attention map
    interp plot       heads|ablation|pruning [--csv FILE] --out PNG   a score grid, scan or curve
    interp view       [head|grid] --out HTML [--text T]   an interactive view, one offline page
    interp patch      [--model M]               activation, attribution or path patching of every head
    interp attribute  [--model M]               direct logit attribution (or --lens: the logit lens)
    interp circuit    --out DIR [--task T]      edge attribution, a circuit, its faithfulness, JSON and view
    interp circuit    diff A.json B.json        edges added, removed or rescored (exit 1 if any)
    interp train-toy  --out DIR                 train the toy induction model
    interp report     --out DIR                 everything above as one HTML page
    interp atlas      --out DIR [--model M]     a versioned head atlas: JSON, its page, each head's view
    interp atlas      diff A.json B.json        which heads changed label or left their intervals (exit 1 if any)
    interp expect     --model PATH --expect gpt2-small   check the heads against a published head table

User mistakes print one line to stderr and exit 2, with no traceback.

Each verb is one module of this package (``analyses/cli/VERB.py``: ``add_parser(sub)`` declares its options,
``cmd_VERB(args)`` checks them, calls the studies and prints); what two verbs share is in ``common.py``.
This module builds the argparse tree from the verbs and holds the error boundary (``main``). Heavy imports (torch,
transformers, the studies) happen inside ``cmd_VERB``, so ``interp --help`` stays fast.

Under ``torchrun --nproc_per_node N -m analyses.cli ...`` (or ``accelerate launch``) every command runs unchanged:
the studies split their prompts across the ranks, and only rank 0 prints and writes files.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys

from . import ablate, atlas, attribute, circuit, expect, heads, info, patch, plot, prune, report, stream, train_toy, view
from .common import BUNDLED_NAMES, _one_line, _Parser, _SCRATCH, _set_threads, _user_mistake

__all__ = ["main", "build_parser", "BUNDLED_NAMES"]

# the verbs, in the order `interp --help` lists them
VERBS = (info, heads, ablate, prune, stream, plot, view, patch, attribute, circuit, train_toy, report, atlas, expect)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="interp", description="Attention-head interpretability for HF models.",
                     formatter_class=argparse.RawDescriptionHelpFormatter,
                     epilog="Run `interp COMMAND --help` for a command's options.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for verb in VERBS:
        verb.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        hint = ""
        if getattr(args, "model", None) is not None and not extra[0].startswith("-"):
            hint = f"; the model is an option: `interp {args.command} --model {extra[0]}`"
        parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    from transformers.utils import logging as hf_logging  # here, not above: `interp --help` imports no torch

    hf_logging.disable_progress_bar()  # the weight-loading bar is noise in a command's output
    from interp.runtime import distributed

    with distributed.launched(getattr(args, "device", None)):  # under torchrun: join its process group
        return _run(args, distributed.rank_zero())


def _run(args, main_rank: bool) -> int:
    try:
        with contextlib.ExitStack() as stack:
            if not main_rank:  # every rank computes; rank 0 alone prints
                stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
            if getattr(args, "threads", None) is not None:
                _set_threads(args.threads)
            return args.func(args)
    except BrokenPipeError:  # e.g. `interp heads | head`
        return 0
    except Exception as err:  # noqa: BLE001
        if not _user_mistake(err):
            raise
        if main_rank:
            print(f"interp {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    finally:
        for folder in _SCRATCH:
            shutil.rmtree(folder, ignore_errors=True)
        _SCRATCH.clear()
