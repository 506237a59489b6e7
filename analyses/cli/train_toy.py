"""`interp train-toy`: train the toy induction model (the bundled default)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .common import UserError, _check_out, _threads_option


def add_parser(sub) -> None:
    """`interp train-toy`: its options."""
    p = sub.add_parser("train-toy", help="train the toy induction model (the bundled default)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="training steps (default: train_toy_model's, 3000)")
    _threads_option(p)
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_train_toy)


def cmd_train_toy(args) -> int:
    import inspect

    import torch

    from ..data.toy import train_toy_model

    _check_out(args.out, args.force)
    from interp.runtime import distributed

    if distributed.world_size() > 1:
        raise UserError("train-toy trains in one process; run it without torchrun")
    steps = args.steps if args.steps is not None else inspect.signature(train_toy_model).parameters["steps"].default
    if steps < 1:
        raise UserError(f"--steps must be at least 1; got {steps}")
    bar, done = None, [0]
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=steps, file=sys.stderr, unit="step", leave=False)

    def progress(record: dict) -> None:
        if bar is not None:
            bar.update(record["step"] - done[0])
            done[0] = record["step"]
            bar.set_postfix(loss=f"{record['loss']:.3f}", second_copy=f"{record['loss_second_copy']:.3f}")

    command = f"interp train-toy --out {args.out} --seed {args.seed} --steps {steps} --threads {torch.get_num_threads()}"
    try:
        from interp.runtime.files import staged_folder

        with staged_folder(args.out, overwrite=args.force) as staging:  # the folder appears whole, or not at all
            metrics = train_toy_model(staging, seed=args.seed, steps=steps, progress=progress, command=command)
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(metrics, indent=2))
    return 0
