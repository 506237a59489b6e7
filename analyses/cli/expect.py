"""`interp expect`: check a model's heads against a published head table (``analyses.atlas.expectations``).

    interp expect --model PATH --expect gpt2-small [--out DIR]

``add_expect_argument`` and ``run_expectations`` are what another verb (``interp atlas --expect``) calls: the first
declares ``--expect``, the second checks a head table it already has (computing only the scores the set needs that
the table lacks) and prints one row per expected head and a summary line. Exit status: 0 when every expected head
passes, 1 when one fails or was not measured, 2 on a user's mistake (an unknown set, a model of another shape).
"""

from __future__ import annotations

from pathlib import Path

from .common import UserError, _check_out, _load, _model_options, _positive_int

CSV_NAME = "expectations.csv"
_HEADER = "class,layer,head,score,value,lo,hi,rank,of,test,status,why,citation"  # check_expectations's columns


def check_expectations_csv(path: Path, force: bool) -> None:
    """The CSV ``run_expectations`` will write may be new; an existing one needs ``force`` and is replaced only when
    it is one we wrote (it starts with our header): a user's file of that name is never overwritten."""
    if not path.exists():
        return
    if not force:
        raise UserError(f"{str(path)!r} exists; pass --force to replace it (only an expectations CSV interp wrote is "
                        "replaced)")
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            ours = f.readline().strip() == _HEADER
    except OSError:
        ours = False
    if not ours:
        raise UserError(f"{str(path)!r} exists and is not an expectations CSV interp wrote; it is not replaced, even "
                        "with --force: move it away or choose another --out (or --name)")


def add_parser(sub) -> None:
    """`interp expect`: its options."""
    p = sub.add_parser("expect", help="check a model's heads against a published head table (gpt2-small)")
    _model_options(p)
    add_expect_argument(p, required=True)
    p.add_argument("--n-prompts", type=_positive_int, default=100, help="prompts of the attention-pattern scores")
    p.add_argument("--out", type=Path, default=None, help=f"a folder to write {CSV_NAME} into")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out")
    p.set_defaults(func=cmd_expect)


def add_expect_argument(parser, required: bool = False) -> None:
    """Declare ``--expect SET|FILE.json`` on a verb's parser."""
    parser.add_argument("--expect", default=None, required=required, metavar="SET|FILE.json",
                        help="check the heads against a published table: gpt2-small (Wang et al. 2022's IOI classes, "
                             "McDougall et al. 2023's copy suppression; needs GPT-2 small's weights, a local folder), "
                             "or a JSON file of your own (notebooks/expectations.md); exit status 1 when a head fails "
                             "or is not measured")


def cmd_expect(args) -> int:
    if args.out is not None:
        _check_out(args.out, args.force)
        check_expectations_csv(args.out / CSV_NAME, args.force)
    model = _load(args)
    check_expect_model(model, args.expect)
    return run_expectations(model, None, args.expect, args.out, n_prompts=args.n_prompts, seed=args.seed)


def check_expect_model(model, name) -> None:
    """Refuse, before anything long runs, a model that is not the shape of the set ``name`` (None: no set asked
    for, nothing to check)."""
    if name is not None:
        from ..atlas.expectations import check_shape, expectation_set

        expected = expectation_set(name)
        check_shape(expected, model.cfg.n_layers, model.cfg.heads_per_layer)


def run_expectations(model, df_or_atlas, name, out_dir=None, n_prompts: int = 100, seed: int = 0) -> int:
    """Check ``model``'s heads against the expectation set ``name`` (a registered name, a JSON file, or an
    ``ExpectationSet``; None: no set asked for, returns 0 and does nothing); print one row per expected head and the
    summary line; write the rows as CSV to ``out_dir`` (a ``.csv`` path, or a folder: ``expectations.csv`` in it)
    when given. ``df_or_atlas``: a head table, an atlas (``build_atlas``'s dict) or None; the scores the set needs
    that it lacks are computed with ``detect_heads`` (scores needing a tokenizer are left not measured on a model
    without one). Returns the exit status: 0 when every expected head passes, else 1."""
    if name is None:
        return 0
    import pandas as pd

    from interp.runtime import distributed

    from ..atlas.expectations import check_expectations, expectation_set, head_table, needs_scores
    from ..heads.detect import detect_heads
    from ..heads.registry import score
    from .common import _emit

    check_expect_model(model, name)  # before any score is computed
    expected = expectation_set(name)
    table = None if df_or_atlas is None else head_table(df_or_atlas)
    have = set() if table is None else set(table.columns)
    missing = [s for s in needs_scores(expected) if s not in have and score(s).label_column not in have]
    skipped = [s for s in missing if "tokenizer" in score(s).needs and model.tokenizer is None]
    run = [s for s in missing if s not in skipped]
    if run:
        more = detect_heads(model, scores=run, n_prompts=n_prompts, seed=seed)
        if table is None:
            table = more
        else:
            keep = ["layer", "head"] + [c for c in more.columns if c not in table.columns]
            attrs = dict(table.attrs)
            table = table.merge(more[keep], on=["layer", "head"], how="left")
            table.attrs.update(attrs)
    if table is None:
        table = pd.DataFrame({"layer": [l for l, h in model.cfg.heads()], "head": [h for l, h in model.cfg.heads()]})
    checked = check_expectations(table, expected, model)
    unrun = checked["score"].isin(skipped) & (checked["status"] == "not measured")
    checked.loc[unrun, "why"] = checked.loc[unrun, "score"] + " needs a tokenizer; this model has none"
    shown = checked.assign(head=[f"{l}.{h}" for l, h in zip(checked["layer"], checked["head"])])
    _emit(shown[["class", "head", "score", "value", "lo", "hi", "rank", "of", "status", "why"]], "table")
    print(checked.attrs["summary"])
    if out_dir is not None and distributed.rank_zero():  # under torchrun every rank checks; rank 0 writes
        path = Path(out_dir) if str(out_dir).endswith(".csv") else Path(out_dir) / CSV_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        checked.to_csv(path, index=False)
    return 0 if (checked["status"] == "pass").all() else 1

