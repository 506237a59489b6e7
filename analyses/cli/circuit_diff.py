"""`interp circuit diff A.json B.json`: the edges of saved circuit A that B lacks, those only B has and those whose
score moved, as a table (exit 1 when any, 0 when none; 2 with one line on bad input)."""

from __future__ import annotations

import sys
from pathlib import Path

from .common import UserError


def cmd_diff(words: list[str]) -> int:
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
    with_input = table.assign(score_a=table["score_a"].map(_score), score_b=table["score_b"].map(_score))
    print(with_input.to_string(index=False, na_rep="-"))
    counts = table["change"].value_counts()
    print(f"{counts.get('removed', 0)} edges only in {a_path}, {counts.get('added', 0)} only in {b_path}, "
          f"{counts.get('changed', 0)} rescored (of {len(a.edges)} and {len(b.edges)} edges)", file=sys.stderr)
    return 1


def _score(v) -> str:
    return "-" if v != v else f"{v:+.5g}"  # NaN: the edge is not in that circuit
