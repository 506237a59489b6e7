"""benchmarks/bench_report.py on the toy model: the timed report gives every stage and a plain forward for scale, and
``--flops`` each stage's floating-point operations, counted exactly (torch's FlopCounterMode), as forward-equivalents
and seconds at two rates. The figures in BENCHMARKS.md come from it on SmolLM2."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_report  # noqa: E402


def test_flops_per_stage_add_up(capsys):
    bench_report.count_flops("toy-induction", threads=1)
    out = capsys.readouterr().out
    rows = {m[0]: tuple(map(float, m[1:]))  # stage: GFLOP, forward-equivalents, seconds at two rates
            for m in re.findall(r"^\| ([a-z ]+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", out, re.M)}
    assert {"heads", "ablation", "classes", "pruning", "total"} <= set(rows), out
    stages = [v for k, v in rows.items() if k != "total"]
    # forward-equivalents add up to the total (each rounded to 0.1), and every study does arithmetic
    assert abs(sum(v[1] for v in stages) - rows["total"][1]) <= 0.05 * len(stages) + 1e-9
    assert all(rows[s][1] > 0 for s in ("heads", "ablation", "pruning"))
    assert rows["total"][0] > 0 and rows["total"][3] <= rows["total"][2]  # the fastest linear beats a forward
    assert re.search(r"plain forward \(4 x 64 tokens\): [\d.]+ GFLOP in [\d.]+ CPU s = [\d.]+ GFLOP/s on 1 thread", out)


@pytest.mark.slow  # about 45 s, a report in a child process: `python -m pytest -m slow tests/test_bench_report.py`
def test_the_timed_report_gives_every_stage_and_the_forward_for_scale():
    r = bench_report.run_report(Path(__file__).resolve().parents[1], "toy-induction", threads=1)
    assert {"load", "heads", "ablation", "pruning"} <= set(r["stages"])
    assert all(wall >= 0 and cpu >= 0 for wall, cpu in r["stages"].values())
    assert r["forward"] > 0 and r["threads"] == 1
