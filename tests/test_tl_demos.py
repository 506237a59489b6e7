"""TransformerLens's Main Demo and Exploratory Analysis Demo, written as scripts with only the loading lines changed
(``notebooks/tl_demos``), run on the flash and eager paths (issue 37). Slow: SmolLM2 and a few hundred patched runs
each (about 3 and 12 minutes on two shared CPU cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DEMOS = Path(__file__).resolve().parents[1] / "notebooks" / "tl_demos"
EXPECT = {  # what each demo prints, in the same kinds as TransformerLens's
    "main_demo": ["Model loss:", "ablated loss", "Clean logit diff:", "patching: best", "top induction heads",
                  "OV copying score", "OV singular values"],
    "exploratory_demo": ["Average logit difference:", "Calculated average logit diff:", "logit lens:", "per layer:",
                         "top heads:", "attends from the end", "resid_pre patching", "head z patching"],
}


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["flash", "eager"])
@pytest.mark.parametrize("demo", sorted(EXPECT))
def test_transformerlens_demo_runs(demo, attn):
    env = {**os.environ, "PYTHONPATH": str(DEMOS.parents[1])}
    done = subprocess.run([sys.executable, str(DEMOS / f"{demo}.py"), "--attn", attn], capture_output=True, text=True,
                          env=env, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in EXPECT[demo]:
        assert line in done.stdout, (line, done.stdout[-2000:])
    if demo == "exploratory_demo":  # the direct logit attribution reproduces the logit difference exactly
        lines = dict(l.split(":", 1) for l in done.stdout.splitlines() if l.startswith(("Average logit difference",)))
        calc = next(l for l in done.stdout.splitlines() if l.startswith("Calculated average logit diff"))
        want = float(lines["Average logit difference"])
        got = float(calc.split(":")[1].split("original")[0])
        assert abs(got - want) < 1e-3 * max(1.0, abs(want))


def test_only_the_marked_lines_differ_from_transformerlens():
    """Each demo's lines that needed more than the loading change carry a ``# CHANGED:`` comment; the migration page
    states their count."""
    counts = {demo: sum("# CHANGED:" in line for line in (DEMOS / f"{demo}.py").read_text().splitlines())
              for demo in EXPECT}
    page = (DEMOS.parent / "transformerlens.md").read_text()
    for demo, n in counts.items():
        assert f"`{demo}.py`: {n} changed lines" in page, (demo, n)
