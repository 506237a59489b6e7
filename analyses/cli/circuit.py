"""`interp circuit`: edge attribution (EAP or EAP-IG) of a task, the circuit of the top edges and its faithfulness
curve by exact edge patching, written to a folder: edges.csv, faithfulness.csv, faithfulness.png, the saved circuit
(circuit.json), its view (circuit.html) and figure (circuit.png). `interp circuit diff A.json B.json`: the edges
added, removed or rescored from A to B (exit 1 when any, 0 when none)."""

from __future__ import annotations

import sys
from pathlib import Path

from .common import UserError, _check_out, _load, _model_options, _positive_int, _Progress

TASKS = ("ioi", "induction", "greater-than")


def add_parser(sub) -> None:
    """`interp circuit`: its options."""
    p = sub.add_parser("circuit", help="edge attribution (EAP, EAP-IG), a circuit of heads and its faithfulness; "
                       "`circuit diff A.json B.json` compares two saved circuits")
    p.add_argument("diff", nargs="*", metavar="diff A.json B.json", help="compare two saved circuits instead")
    _model_options(p)
    p.add_argument("--task", choices=TASKS, default="ioi")
    p.add_argument("--method", choices=["eap", "eap-ig"], default="eap-ig")
    p.add_argument("--steps", type=_positive_int, default=5, help="EAP-IG's interpolation steps")
    p.add_argument("--edges", type=_positive_int, default=200, help="the circuit's size: the top edges by |score|")
    p.add_argument("--refine", action="store_true", help="prune each circuit from twice as many top edges by exact "
                   "patching (refine_circuit): edges that act only together, missed by per-edge scores; costs "
                   "about 2n (1 + log2 n) patched runs per size")
    p.add_argument("--n-prompts", type=_positive_int, default=16, help="prompts of the task")
    p.add_argument("--random", type=int, default=5, help="random circuits per size on the faithfulness curve")
    p.add_argument("--out", default=None, help="folder for edges.csv, faithfulness.csv, faithfulness.png, "
                   "circuit.json, circuit.html and circuit.png")
    p.add_argument("--atlas", type=Path, default=None, help="a head atlas of the model (interp atlas's JSON): each "
                   "head's labels on hover in circuit.html")
    p.add_argument("--force", action="store_true", help="write into a folder that is not empty")
    p.set_defaults(func=cmd_circuit)


def _task(model, name: str, n: int, seed: int):
    from ..circuits.tasks import greater_than_task
    from ..data.tasks import induction_task, ioi_task

    if name == "ioi":
        return ioi_task(model, n=n, seed=seed)
    if name == "induction":
        return induction_task(model, n=n, length=12, seed=seed)
    return greater_than_task(model, n=n, seed=seed)


def cmd_circuit(args) -> int:
    if args.diff:
        return _cmd_diff(args.diff)
    from ..circuits.attribution import edge_attribution
    from ..circuits.evaluation import faithfulness
    from ..circuits.graph import check_graph
    from ..views.circuit_plots import faithfulness_plot
    from ..atlas.atlas import load_atlas
    from ..views.circuit_figure import write_circuit
    from ..views.plots import save_figure
    from interp.runtime.progress import progress_lines_off_a_terminal

    if args.random < 0:
        raise UserError(f"--random must be 0 or more; got {args.random}")
    if args.out is None:
        raise UserError("--out is needed: the folder the circuit's files go to (e.g. --out circuit)")
    out = Path(args.out)
    _check_out(out, args.force)
    atlas = None if args.atlas is None else load_atlas(args.atlas)
    with _Progress(["load", args.method, "faithfulness", "write"], lines="circuit") as progress, \
            progress_lines_off_a_terminal():
        progress("load")  # the graph and task are checked with the model: a mistake there is still the only line
        model = _load(args)
        check_graph(model)
        clean, corrupted, metric = _task(model, args.task, args.n_prompts, args.seed)
        progress(args.method)
        df = edge_attribution(model, clean, corrupted, metric, method=args.method, steps=args.steps)
        total = len(df)
        sizes = sorted({max(1, min(total, s)) for s in (args.edges // 8, args.edges // 4, args.edges // 2, args.edges)})
        progress("faithfulness")
        curve = faithfulness(model, clean, corrupted, metric, df, sizes=sizes, n_random=args.random,
                             refine=args.refine)
        chosen = df.loc[curve.attrs["circuits"][sizes[-1]]]  # the largest size's circuit (refined: not twice)
        progress("write")
        out.mkdir(parents=True, exist_ok=True)
        df["in_circuit"] = df.index.isin(chosen.index)
        df.sort_values("abs_score", ascending=False).to_csv(out / "edges.csv", index=False)
        curve.to_csv(out / "faithfulness.csv", index=False)
        ax = faithfulness_plot(curve, title=f"{args.task}, {args.method}: {df.attrs['metric']}")
        save_figure(ax.figure, out / "faithfulness.png", overwrite=True)
        write_circuit(model, df, clean, corrupted, curve, out, task=args.task, source=str(args.model), atlas=atlas)
    last = curve.iloc[-1]
    a = curve.attrs
    print(f"{args.task} ({args.n_prompts} prompts), {args.method}: {df.attrs['metric']} clean {a['clean']:.4f}, "
          f"corrupted {a['corrupted']:.4f}; {total} edges scored")
    how = (f"top {2 * args.edges} pruned to {args.edges} by exact patching" if args.refine
           else f"top {args.edges}, pruned to those reaching the metric")
    print(f"circuit of {int(last['edges'])} edges ({how}): faithfulness "
          f"{last['faithfulness']:.3f} [{last['lo']:.3f}, {last['hi']:.3f}], complement {last['complement']:.3f}, "
          f"random circuits of that size {last['random']:.3f} (max {last['random_max']:.3f})")
    print(f"CPR {a['cpr']:.3f} (random {a['cpr_random']:.3f}), CMD {a['cmd']:.3f} (random {a['cmd_random']:.3f})")
    heads = sorted({u for u in chosen["upstream"] if ":" in u} | {d.rsplit(".", 1)[0] for d in chosen["downstream"]
                                                                  if ":" in d})
    print(f"heads in the circuit ({len(heads)}): {', '.join(heads[:30])}{' ...' if len(heads) > 30 else ''}")
    print(f"wrote {out / 'edges.csv'}, {out / 'faithfulness.csv'}, {out / 'faithfulness.png'}, {out / 'circuit.json'}, "
          f"{out / 'circuit.html'}, {out / 'circuit.png'}")
    return 0


def _cmd_diff(words: list[str]) -> int:
    """`interp circuit diff A.json B.json`: a table of the edges added, removed or rescored; exit 1 when any."""
    from ..circuits.saved import diff_circuits, load_circuit

    if words[0] != "diff" or len(words) != 3:
        raise UserError(f"`interp circuit` takes no positional arguments but `diff A.json B.json`; got "
                        f"{' '.join(words)!r}")
    a_path, b_path = (Path(w) for w in words[1:])
    for path in (a_path, b_path):
        if not path.is_file():
            raise UserError(f"{str(path)!r} is not a file; pass two circuit JSON files written by `interp circuit "
                            "--out DIR` (DIR/circuit.json) or Circuit.save")
    a, b = load_circuit(a_path), load_circuit(b_path)
    table, notes = diff_circuits(a, b)
    for note in notes:
        print(f"note: {note}")
    if table.empty:
        print(f"the same {len(a.edges)} edges with the same scores ({a_path} -> {b_path})")
        return 0
    shown = table.assign(score_a=table["score_a"].map(_score), score_b=table["score_b"].map(_score))
    print(shown.to_string(index=False, na_rep="-"))
    counts = table["change"].value_counts()
    print(f"{counts.get('removed', 0)} edges only in {a_path}, {counts.get('added', 0)} only in {b_path}, "
          f"{counts.get('changed', 0)} rescored (of {len(a.edges)} and {len(b.edges)} edges)", file=sys.stderr)
    return 1


def _score(v) -> str:
    return "-" if v != v else f"{v:+.5g}"  # NaN: the edge is not in that circuit
