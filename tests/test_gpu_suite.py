"""The GPU suite (benchmarks/gpu_suite.py) rehearsed on the CPU with tiny sizes, so that it cannot rot between
the rare sessions that are lent a GPU: every step of every part runs and writes its section."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about 80 s on the CPU VM: `python -m pytest -m slow tests/test_gpu_suite.py`
def test_gpu_suite_rehearses_every_part_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--part", "all", "--device",
                           "cpu", "--quick", "--out", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    for part, wanted in ((1, ["collected", "TFLOP/s"]), (2, ["x HF sdpa", "ours flash"]), (3, ["| tokens |", "flash"]),
                         (4, ["norm-weighted", "EAP-IG", "bfloat16"])):
        text = (tmp_path / f"gpu_part{part}.md").read_text()
        assert "(exit 0," in text and "exit 1" not in text, text[-2000:]
        for word in wanted:
            assert word in text, f"part {part} lacks {word!r}:\n{text[-2000:]}"


def test_gpu_suite_refuses_cuda_without_a_device_in_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():  # on a GPU machine there is nothing to refuse; the suite itself is the check
        return
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--part", "1", "--out",
                           str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
