"""The oldest transformers we support (5.17, the GPU image's) passes the parity tests too.

The default run uses whatever pip installed (5.24 when this was written). This test makes a virtualenv that sees
the installed packages (`--system-site-packages`) but has transformers 5.17.0 of its own, installed from the
package index, and runs the parity, family, encoder-decoder, sliding-window, streaming and retrieval tests in it. Found with it: transformers 5.17's T5
copies its config into each stack, so `set_attn_implementation` on the model left both stacks on HF's attention
(`interp.structure.probe.set_attention_key` sets every copy). And that 5.17 names the KV cache `past_key_values` in a
forward's arguments and outputs where 5.24 names it `cache`: retrieval scoring and streaming caches passed `cache=`,
which 5.17 handed on to the attention function (refused there) or to `generate` (an unused-argument error); they now
take the name from the model (`interp.cache_kwarg`, `interp.output_cache`), and the streaming and retrieval tests run
here too.

The inner virtualenv sees the packages of the interpreter running the tests, whichever it is (the system's, a
virtualenv's, a conda env's): a `.pth` file adds the outer interpreter's site directories after the inner one's, so
its own transformers comes first. (`--system-site-packages` would give it the *base* interpreter's packages, which in
a virtualenv lack torch: the suite failed for every user who followed the README inside a venv.)

Needs the package index (pip install); it fails, never skips, when it cannot be reached.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

OLDEST = "5.17.0"
ROOT = Path(__file__).resolve().parents[1]
TESTS = ["tests/test_parity.py", "tests/test_families.py", "tests/test_seq2seq.py", "tests/test_window_memory.py",
         "tests/test_streaming.py", "tests/test_streamed.py", "tests/test_retrieval.py"]


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def _site_dirs() -> list[str]:
    """The site directories of the interpreter running the tests, in its order (a venv's own, then any it inherits)."""
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    return [d for d in dict.fromkeys([*site.getsitepackages(), *user, *sys.path]) if d and Path(d).is_dir()
            and Path(d).name in ("site-packages", "dist-packages")]


def inner_venv(path: Path) -> str:
    """A virtualenv at `path` that sees this interpreter's packages after its own; returns its python."""
    made = _run([sys.executable, "-m", "venv", str(path)])
    assert made.returncode == 0, made.stderr
    python = str(path / "bin" / "python")
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    # `import` lines of a .pth run at start-up; addsitedir appends and also reads those directories' .pth files
    # (editable installs), so the inner environment's own packages stay first
    lines = [f"import site; site.addsitedir({d!r})" for d in _site_dirs()]
    (Path(purelib) / "_outer_site.pth").write_text("\n".join(lines) + "\n")
    return python


def test_inner_venv_sees_the_running_interpreters_packages(tmp_path):
    python = inner_venv(tmp_path / "venv")
    code = "import torch, transformers, einops, pandas, pytest, interp; print(torch.__file__)"
    done = _run([python, "-c", code], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    import torch
    assert Path(done.stdout.strip()) == Path(torch.__file__)


def test_parity_tests_pass_with_the_oldest_supported_transformers(tmp_path):
    python = inner_venv(tmp_path / "venv")
    pip = _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"transformers=={OLDEST}"])
    assert pip.returncode == 0, f"pip could not install transformers {OLDEST}:\n{pip.stderr[-2000:]}"
    version = _run([python, "-c", "import transformers; print(transformers.__version__)"])
    assert version.stdout.strip() == OLDEST, version.stdout + version.stderr

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-m 'not slow and not gpu'",
                 *TESTS], cwd=ROOT, env=env)
    tail = (done.stdout + done.stderr)[-3000:]
    assert done.returncode == 0, f"parity tests under transformers {OLDEST} failed:\n{tail}"
    assert " passed" in done.stdout and " failed" not in done.stdout, tail
