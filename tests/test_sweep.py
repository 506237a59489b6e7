"""The family sweep (benchmarks/sweep_families.py) as a test: every causal-LM and masked-LM model type of the
installed transformers, built tiny; none may crash, and at least 100 must load with parity. About 5 minutes
(`python -m pytest -m slow tests/test_sweep.py`); the README's table comes from the same script."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_no_model_type_crashes_and_at_least_100_load_with_parity(tmp_path):
    import json

    out = tmp_path / "sweep.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sweep_families.py"), "--json", str(out)],
                          capture_output=True, text=True, timeout=3000)
    results = json.loads(out.read_text())
    counts = collections.Counter(r["outcome"] for r in results.values())
    crashes = {t: r["detail"] for t, r in results.items() if r["outcome"] == "crash"}
    assert not crashes, crashes
    assert done.returncode == 0, done.stderr[-2000:]
    assert counts["parity"] >= 100, counts
    assert counts["mismatch"] == 0, {t: r["detail"] for t, r in results.items() if r["outcome"] == "mismatch"}
    for family in ("llama", "gemma2", "gpt_oss", "deepseek_v3", "modernbert", "gpt_neox", "bert"):
        assert results[family]["outcome"] == "parity", (family, results[family])
