"""benchmarks/bench_long_context.py --quick runs (fresh subprocesses, toy model) and prints its table and slope."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about 15 s: two fresh Python processes that load torch and the toy model
def test_quick_mode_prints_the_table_and_slope(tmp_path):
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_long_context.py"), "--quick", "--tasks",
                           "scores", "--json", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "threads: OMP_NUM_THREADS=" in done.stdout
    assert "slope toy-induction scores:" in done.stdout
    import json

    rows = json.loads(out.read_text())
    assert [(r["n"], r["task"]) for r in rows] == [(32, "scores"), (64, "scores")]
    assert all(r["peak_mib"] > 0 and r["seconds"] > 0 for r in rows)
    assert all(len(r["top_induction"]) == 3 for r in rows)
