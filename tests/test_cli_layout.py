"""The layout of the ``interp`` command (issue 23): one small module per verb under analyses/cli/, no import cycle
among them, and importing the package loads no torch (``interp --help`` stays fast)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import analyses.cli

PACKAGE = Path(analyses.cli.__file__).parent
MODULES = sorted(PACKAGE.glob("*.py"))


def test_every_cli_module_is_at_most_400_lines():
    assert len(MODULES) > 3  # the package, common.py and the verbs
    long = {m.name: n for m in MODULES if (n := len(m.read_text(encoding="utf-8").splitlines())) > 400}
    assert long == {}, f"modules of analyses/cli/ over 400 lines: {long}; split them by verb"


def test_every_verb_module_declares_its_options_and_runs_its_command():
    names = {m.__name__.rsplit(".", 1)[1] for m in analyses.cli.VERBS}
    assert names == {m.stem for m in MODULES} - {"__init__", "__main__", "common"}
    parser = analyses.cli.build_parser()
    choices = parser._subparsers._group_actions[0].choices  # the verbs `interp --help` lists
    for verb in analyses.cli.VERBS:
        command = verb.__name__.rsplit(".", 1)[1].replace("_", "-")
        assert choices[command].get_default("func") is getattr(verb, f"cmd_{command.replace('-', '_')}")


def _imports_of(path: Path) -> list[tuple[int, str | None, list[str]]]:
    """(level, module, names) of every import in a file, function-local ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((0, a.name, []) for a in node.names)
    return found


def test_the_verbs_import_common_and_nothing_imports_the_package_back():
    """Imports go __init__ -> verb -> common (function-local imports count): a verb that imported the package, or
    common that imported a verb, would be a cycle."""
    verbs = {m.stem for m in MODULES} - {"__init__", "__main__", "common"}
    for path in MODULES:
        if path.stem in ("__init__", "__main__"):
            continue
        for level, module, names in _imports_of(path):
            assert not (level == 0 and module and module.startswith("analyses.cli")), (path.name, module)
            assert not (level == 1 and module is None), f"{path.name} imports the package itself: from . import {names}"
            if path.stem == "common" and level == 1:
                assert module not in verbs, f"common.py imports the verb module {module}"


def test_importing_the_cli_loads_no_torch():
    code = ("import sys, analyses.cli\n"
            "print(sorted(m for m in ('torch', 'transformers', 'pandas', 'matplotlib') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
