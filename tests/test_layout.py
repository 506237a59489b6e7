"""The house (issue 23): imports go one way, ``hooks`` <- ``interp`` <- ``analyses``, with no import cycle among the
modules of the three packages (function-local imports count: they are cycles that wait for the first call), and every
module is at most 400 lines. Rooms named by what they hold (issue 36): no shim kept for a former name, streaming in
one sub-package, no plot in a study, no test helper in the library, every package shipped, and hook names built from
``hooks.names``. Read from the source with ``ast``: nothing is imported to check it (but the one import of
``tests.tiny``)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hooks", "interp", "analyses")  # lowest first: each may import only the ones before it
MAX_LINES = 400


def modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of ``packages`` under ``root`` (a package is its __init__)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _targets(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, known) -> list[str]:
    """The modules an import statement names (``from x import y`` names x.y where y is a module, else x)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        parts = (name if is_package else name.rsplit(".", 1)[0]).split(".")
        parts = parts[:len(parts) - node.level + 1]
        root = ".".join(parts + ([node.module] if node.module else []))
    else:
        root = node.module or ""
    return [f"{root}.{a.name}" if f"{root}.{a.name}" in known else root for a in node.names]


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``found`` it imports anywhere in its file (function-local imports included)."""
    edges = {}
    for name, path in found.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(name, path.name == "__init__.py", node, found):
                    while target not in found and "." in target:  # a name inside a module: the module
                        target = target.rsplit(".", 1)[0]
                    if target in found and target != name:
                        deps.add(target)
        edges[name] = deps
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges) + 100))

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def upward_imports(edges: dict[str, set[str]], packages=PACKAGES) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a package imports one above it (interp importing analyses, ...)."""
    rank = {p: i for i, p in enumerate(packages)}
    return sorted((a, b) for a, deps in edges.items() for b in deps
                  if rank[b.split(".")[0]] > rank[a.split(".")[0]])


def test_imports_go_hooks_interp_analyses_and_form_no_cycle():
    found = modules(ROOT)
    assert {"hooks", "interp.model.hooked", "analyses.heads.detect", "analyses.views.report"} <= set(found)
    edges = import_graph(found)
    assert sum(map(len, edges.values())) > 100  # the parser sees the imports (a few hundred)
    assert upward_imports(edges) == [], "imports must go hooks <- interp <- analyses"
    assert cycles(edges) == [], ("import cycles (function-local imports count): move what both sides need into a "
                                 "module below them")


# Issue 47: each package's rooms (sub-packages), lowest first. A room imports only the rooms before it and its own
# modules; a package's top-level modules (``interp/utils.py``, the ``__init__``s) stand above all of its rooms.
ROOMS = {
    "hooks": [],
    "interp": ["runtime", "tokens", "attention", "structure", "lens", "model", "streaming"],
    "analyses": ["data", "heads", "causal", "explain", "long", "taxonomy", "circuits", "atlas", "views", "cli"],
}
MAX_MODULES = 16  # per folder; cli/ (one module per verb) and views/ (one per view) may hold more
ROOMY = ("analyses.cli", "analyses.views")


def room(module: str) -> tuple[str, int]:
    """(package, rank of the module's room): a room's index in ``ROOMS``, top-level modules above every room."""
    parts = module.split(".")
    rooms = ROOMS[parts[0]]
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in rooms):
        return parts[0], rooms.index(parts[1])
    return parts[0], len(rooms)


def _room(module: str) -> int:
    """0: a study (a room of analyses below views/), 1: a view (analyses/views/), 2: the CLI (analyses/cli/)."""
    return 2 if module.startswith("analyses.cli") else 1 if module.startswith("analyses.views") else 0


def downward_only(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs inside one package where a room imports a room above it. The package itself (its
    ``__init__``) is not a room: ``analyses.views`` reads the one table of the views' names there (cycles through it
    are caught by the cycle check)."""
    return sorted((a, b) for a, deps in edges.items() for b in deps
                  if "." in b and room(a)[0] == room(b)[0] and room(b)[1] > room(a)[1])


def test_each_package_folder_is_a_declared_room():
    """Every sub-package of hooks, interp and analyses is in ``ROOMS`` (so its place in the order is declared), and
    every declared room exists."""
    found = sorted(".".join(p.parent.relative_to(ROOT).parts) for package in PACKAGES
                   for p in (ROOT / package).glob("*/__init__.py"))
    declared = sorted(f"{package}.{name}" for package, rooms in ROOMS.items() for name in rooms)
    assert found == declared, "add the new sub-package to ROOMS in its place (lowest first), or remove a stale name"


def test_rooms_import_only_the_rooms_below_them():
    edges = import_graph(modules(ROOT))
    assert downward_only(edges) == [], ("a room imports one above it (ROOMS, lowest first): move what both need into "
                                        "the lower room, or the importer up")


def test_the_room_check_finds_an_arrow_that_runs_back_up():
    edges = {"analyses.data.prompts": {"analyses.heads.registry"}, "analyses.heads.detect": {"analyses.data.prompts"},
             "interp.utils": {"interp.lens.tokens"}, "interp.runtime.progress": {"interp.model.hooked"}}
    assert downward_only(edges) == [("analyses.data.prompts", "analyses.heads.registry"),
                                    ("interp.runtime.progress", "interp.model.hooked")]


def test_no_folder_holds_more_than_16_modules_and_each_room_says_what_it_holds():
    crowded, silent = {}, []
    for package in PACKAGES:
        for folder in [ROOT / package, *(p.parent for p in (ROOT / package).rglob("*/__init__.py"))]:
            name = ".".join(folder.relative_to(ROOT).parts)
            count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
            if count > MAX_MODULES and name not in ROOMY:
                crowded[name] = count
            doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text(encoding="utf-8"))) or ""
            if folder.parent != ROOT and ("import" not in doc.lower() or len(doc) < 40):
                silent.append(name)
    assert crowded == {}, f"folders over {MAX_MODULES} modules: {crowded}; group them into rooms"
    assert silent == [], f"rooms whose docstring does not say what they hold and what they may import: {silent}"


def test_studies_draw_nothing():
    """A plot is a view (issue 36: ``streaming_curve_plot`` lived in a study): no study module imports matplotlib or
    seaborn, so studies run where no plotting library is wanted and every figure has its home in the views."""
    drawing = sorted(name for name, path in modules(ROOT, ("analyses",)).items() if _room(name) == 0
                     for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                     if isinstance(node, (ast.Import, ast.ImportFrom))
                     for target in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
                     if target.split(".")[0] in ("matplotlib", "seaborn"))
    assert drawing == [], f"studies that draw (move the plot into analyses/views/): {drawing}"


def _only_imports(tree: ast.Module) -> bool:
    """A module whose body is nothing but a docstring, imports and ``__all__``: a re-export of other modules."""
    def plain(node):
        return (isinstance(node, (ast.Import, ast.ImportFrom))
                or isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                or isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"])
    return all(plain(node) for node in tree.body)


def shims(found: dict[str, Path]) -> list[str]:
    """Modules kept only so that an old import path works (issue 36: one current name for everything): a module
    (not a package's ``__init__``) that only re-exports others, or a line that says it keeps a former name."""
    words = ("home before", "name before", "names before", "former name", "keeps working", "kept as another name")
    found_shims = []
    for name, path in found.items():
        text = path.read_text(encoding="utf-8")
        if path.name != "__init__.py" and _only_imports(ast.parse(text)):
            found_shims.append(f"{name}: only re-exports")
        found_shims += [f"{name}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1)
                        if any(word in line.lower() for word in words)]
    return found_shims


def test_no_shim_keeps_an_old_name():
    assert shims(modules(ROOT)) == [], "import the name from its home and delete the shim"


def test_the_shim_check_finds_a_re_export_module_and_an_alias(tmp_path):
    files = {"hooks/__init__.py": "", "interp/__init__.py": "from .a import f\n",
             "interp/a.py": "def f():\n    return 1\n\n\ng = f  # its name before\n",
             "analyses/__init__.py": "", "analyses/plots.py": '"""Moved."""\nfrom interp.a import *\n__all__ = ["f"]\n'}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert shims(modules(tmp_path)) == ["interp.a:5: g = f  # its name before", "analyses.plots: only re-exports"]


def test_every_module_of_the_three_packages_is_at_most_400_lines():
    found = modules(ROOT)
    long = {name: n for name, path in found.items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: {long}; split them by responsibility"


def test_the_checks_find_a_function_local_cycle_and_an_upward_import(tmp_path):
    files = {
        "hooks/__init__.py": "",
        "interp/__init__.py": "from .a import f\n",
        "interp/a.py": "def f():\n    from .b import g  # a cycle that waits for the first call\n    return g()\n",
        "interp/b.py": "from interp.a import f\n\ndef g():\n    import analyses.c\n    return f\n",
        "analyses/__init__.py": "",
        "analyses/c.py": "import torch\n",
        "analyses/d.py": "from ..interp import a\nfrom interp.b import g\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = import_graph(modules(tmp_path))
    assert edges["analyses.d"] == {"interp.a", "interp.b"}
    assert cycles(edges) == [["interp.a", "interp.b"]]
    assert upward_imports(edges) == [("interp.b", "analyses.c")]
    edges["interp.a"].discard("interp.b")
    assert cycles(edges) == []


def test_every_view_name_is_importable_from_analyses():
    """The docs write `from analyses import save_figure` (it lives in analyses.views): both packages read one table of
    the views, so a view added there needs no second list."""
    import analyses
    import analyses.views

    missing = sorted(set(analyses.views.__all__) - set(analyses.__all__))
    assert not missing, f"views not exported by analyses: {missing}"
    from analyses import save_figure
    from analyses.views.plots import save_figure as home
    assert save_figure is home


def test_streaming_lives_in_one_sub_package():
    """Issue 36: the streaming heads' modules sit together in ``interp/streaming/``, not side by side in ``interp``."""
    loose = sorted(name for name in modules(ROOT) if name.startswith("interp.stream") and
                   not name.startswith("interp.streaming.") and name != "interp.streaming")
    assert loose == [], f"streaming modules outside interp/streaming/: {loose}"


def test_pyproject_ships_every_package_and_nothing_else():
    """Each folder of the three packages with an ``__init__.py`` is in pyproject's packages list (a missing one is
    absent from a wheel), and the list names nothing else (tests' helpers are not part of the library)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"]
    found = sorted(".".join(p.parent.relative_to(ROOT).parts) for package in PACKAGES
                   for p in (ROOT / package).rglob("__init__.py"))
    assert sorted(listed) == found


def test_test_helpers_live_in_tests():
    """Tiny model builders and fixtures are for the tests and benchmarks (``tests/tiny.py``), not the library."""
    helpers = sorted(name for name in modules(ROOT) if name.rsplit(".", 1)[-1] in ("testing", "tiny", "conftest", "fixtures"))
    assert helpers == [], f"test helpers inside the library: {helpers}; move them under tests/"
    from tests.tiny import tiny_model  # the tests' own import path, which the benchmarks use too

    assert callable(tiny_model)


# Issue 36: the lead's per-layer pass moves these modules' names onto hooks.names; empty the set then.
_HAND_NAMES_PENDING: set[str] = set()


def hand_made_hook_names(found: dict[str, Path]) -> list[str]:
    """f-strings in ``analyses`` that spell a hook or site name (``f"blocks.{l}.attn.hook_z"``, ``f"{site}.hook_q"``)
    instead of asking ``hooks.names`` (``hook_name``, ``attn_site``), which reads the one table of names."""
    hits = []
    for name, path in found.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
                if ".hook_" in text or text.startswith(("blocks.", "hook_")):
                    hits.append(f"{name}:{node.lineno}: {text}")
    return hits


def test_analyses_build_hook_names_from_the_table():
    found = {k: v for k, v in modules(ROOT, ("analyses",)).items() if k not in _HAND_NAMES_PENDING}
    assert hand_made_hook_names(found) == [], "use hooks.names.hook_name(kind, layer or site) / attn_site(layer)"
    pending = hand_made_hook_names({k: v for k, v in modules(ROOT, ("analyses",)).items() if k in _HAND_NAMES_PENDING})
    assert len(pending) <= 4, f"more hand-made names in the pending modules: {pending}"


def cache_paths_by_hand(folders=("tests", "benchmarks")) -> list[str]:
    """Lines of code (docstrings aside) that spell the model cache's folder (``".cache" / "interp"``,
    ``"~/.cache/interp"``) instead of asking for it; the peers' own caches (``interp-bench``) are not the model cache."""
    spelled = re.compile(r"""["']\.cache["']\s*/\s*["']interp["']|\.cache/interp(?![-\w])""")
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name == "test_layout.py":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            docs = set()
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node):
                    docs.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
            found += [f"{path.name}:{i}: {line.strip()}"
                      for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                      if i not in docs and spelled.search(line)]
    return found


def test_the_cache_check_finds_a_hand_spelled_path(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text('"""Reads ~/.cache/interp (a docstring may say so)."""\n'
                                                  'folder = Path.home() / ".cache" / "interp"\nvenv = "~/.cache/interp-bench"\n')
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert cache_paths_by_hand(("tests",)) == ['test_x.py:2: folder = Path.home() / ".cache" / "interp"']
    finally:
        ROOT = root


def test_tests_and_benchmarks_find_models_as_users_do():
    """Issue 52: a test that read SmolLM2's folder from a hard-coded ``~/.cache/interp`` failed when ``INTERP_CACHE``
    pointed elsewhere (and run alone on a fresh machine): tests and benchmarks find a bundled model's folder with
    ``interp.model.bundled.bundled_folder``, which honours ``INTERP_CACHE`` and converts on first use."""
    assert cache_paths_by_hand() == [], "use interp.model.bundled.bundled_folder(name) (or cache_dir())"
