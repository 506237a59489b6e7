"""`interp atlas`: a versioned head atlas of a model (JSON + HTML page); `interp atlas diff A.json B.json`: which
heads changed label or moved outside their intervals (exit 1 when any did, 0 when none)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from .common import (UserError, _Progress, _load, _model_options, _positive_int, _rank_zero_path, load_score_modules,
                     score_help, score_module_option)
from .expect import add_expect_argument, check_expect_model, check_expectations_csv, run_expectations


def add_parser(sub) -> None:
    """`interp atlas`: its options (and `interp atlas diff A B`)."""
    p = sub.add_parser("atlas", help="a versioned head atlas (JSON + HTML page); `atlas diff A.json B.json` compares "
                       "two", description="Write OUT/NAME.json (every score with its interval and stability, labels, "
                       "digests of weights, tokenizer and prompts, versions, a causal check per class), OUT/NAME.html "
                       "(the page) and OUT/NAME_heads.html (each head's view). `interp atlas diff A.json B.json` says "
                       "which heads of A changed label or moved outside A's intervals in B: exit 0 when none, 1 when "
                       "some did.")
    p.add_argument("diff", nargs="*", metavar="diff A.json B.json", help="compare two atlases instead of writing one")
    _model_options(p)
    p.add_argument("--out", type=Path, default=None, help="the folder to write into (created if missing)")
    p.add_argument("--name", default=None, help="the files' name (default: the --model name, or its folder's name)")
    p.add_argument("--scores", default=None,
                   help=f"comma-separated registered scores (default: every one that applies, but the task-prompted "
                        f"IOI and ICL scores: those take minutes each; the atlas records what ran and why not). "
                        f"{score_help()}")
    score_module_option(p)
    p.add_argument("--n-prompts", type=_positive_int, default=64, help="prompts per attention-pattern score (64)")
    p.add_argument("--seq-len", type=_positive_int, default=64, help="their length in tokens (64)")
    p.add_argument("--context", type=_positive_int, default=1024,
                   help="retrieval's longest needle-in-a-haystack prompt (1024; cut to the model's positions)")
    p.add_argument("--draws", type=_positive_int, default=10, help="random head sets per class in the causal check")
    p.add_argument("--force", action="store_true", help="replace an atlas of the same name that interp atlas wrote "
                   "(a file it did not write is never replaced)")
    add_expect_argument(p)
    p.set_defaults(func=cmd_atlas)


def cmd_atlas(args) -> int:
    if args.diff:
        return _cmd_diff(args)
    from interp.runtime.progress import progress_lines_off_a_terminal

    from ..atlas.atlas import build_atlas, ours, save_atlas
    from ..views.atlas import write_atlas_pages

    if args.out is None:
        raise UserError("--out is needed: the folder the atlas's JSON and pages go to (e.g. --out atlas)")
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {str(args.out)!r} is a file; give a folder path")
    if args.prompts is not None:
        raise UserError("--prompts does not apply: an atlas records prompts it can generate again (--n-prompts, "
                        "--seq-len, --seed)")
    name = args.name if args.name is not None else (
        re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(str(args.model)).name).strip(".") or "atlas")
    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*", name):  # no folder, no "..": the files stay in --out
        raise UserError(f"--name is a file name without a folder (letters, digits, '_', '-', '.', not starting with "
                        f"'.'); got {name!r}: choose the folder with --out")
    files = [args.out / f"{name}{end}" for end in (".json", ".html", "_heads.html")]
    if args.expect is not None:
        check_expectations_csv(args.out / f"{name}_expectations.csv", args.force)
    for path in files:
        if path.exists() and not args.force:
            raise UserError(f"{str(path)!r} exists; pass --force to replace it (only a file interp atlas wrote is "
                            "replaced)")
        if path.exists() and not ours(path):
            raise UserError(f"{str(path)!r} exists and is not a file interp atlas wrote; it is not replaced, even "
                            "with --force: move it away or choose another --out or --name")
    load_score_modules(args)
    scores = [s.strip() for s in args.scores.split(",") if s.strip()] if args.scores else None
    with _Progress(["load", "atlas"], lines="interp atlas") as progress, progress_lines_off_a_terminal():
        progress("load")
        model = _load(args)
        check_expect_model(model, args.expect)  # a model of the wrong shape is refused before the atlas runs
        progress("atlas")
        atlas = build_atlas(model, scores=scores, n_prompts=args.n_prompts, seq_len=args.seq_len,
                            context=args.context, seed=args.seed, draws=args.draws, source=str(args.model))
    out = _rank_zero_path(args.out / files[0].name).parent
    out.mkdir(parents=True, exist_ok=True)
    save_atlas(atlas, out / files[0].name, overwrite=args.force)
    write_atlas_pages(model, atlas, out, name, overwrite=args.force)
    labelled = sum(h["label"] not in ("none", "nan") for h in atlas["heads"])
    print(f"wrote {files[0]}, {files[1]} and {files[2]}: {len(atlas['heads'])} heads ({labelled} labelled), "
          f"{len(atlas['scores'])} scores ({len(atlas['not_run'])} not run), {atlas['cost']['cpu_s']} s of CPU time")
    return run_expectations(model, atlas, args.expect, out / f"{name}_expectations.csv",  # --expect: exit 1 on a miss
                            n_prompts=args.n_prompts, seed=args.seed)


def _cmd_diff(args) -> int:
    from ..atlas.atlas import diff_atlas, load_atlas

    if args.diff[0] != "diff" or len(args.diff) != 3:
        raise UserError(f"`interp atlas` takes no positional arguments but `diff A.json B.json`; got "
                        f"{' '.join(args.diff)!r}")
    a_path, b_path = (Path(p) for p in args.diff[1:])
    for path in (a_path, b_path):
        if not path.is_file():
            raise UserError(f"{str(path)!r} is not a file; pass two atlas JSON files written by `interp atlas`")
    result = diff_atlas(load_atlas(a_path), load_atlas(b_path))
    for note in result["notes"]:
        print(f"note: {note}")
    for item in result["missing"]:
        print(f"missing in {b_path}: {item}")
    for item in result["added"]:
        print(f"only in {b_path}: {item}")
    for change in result["changed"]:
        print(f"{change['head']}: {'; '.join(change['what'])}")
    n = len(result["changed"]) + len(result["missing"]) + len(result["added"])
    if n:
        print(f"{len(result['changed'])} heads changed, {len(result['missing'])} missing, {len(result['added'])} "
              f"only in the second ({a_path} -> {b_path})", file=sys.stderr)
        return 1
    print(f"no head changed label or left its interval ({a_path} -> {b_path})")
    return 0
