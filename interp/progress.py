"""Progress bars for the studies that take more than a few seconds, in a terminal and in notebooks.

On by default where someone is watching: stderr is a terminal, or the code runs in a Jupyter kernel (the widget
bar when ipywidgets is installed, a text bar otherwise, never tqdm's "IProgress not found" warning). Off in
scripts whose stderr goes to a file or pipe, in tests, and when asked: ``interp.set_progress(False)`` or
``INTERP_PROGRESS=0`` in the environment (``1`` forces them on).

    import interp
    interp.set_progress(False)        # quiet studies
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable

__all__ = ["progress", "progress_enabled", "set_progress"]

_state: dict[str, bool | None] = {"on": None}  # None: decided by where the output goes


def set_progress(on: bool | None) -> None:
    """Show progress bars (True), hide them (False), or decide by where stderr goes (None, the default)."""
    if on not in (True, False, None):
        raise ValueError(f"set_progress takes True, False or None; got {on!r}.")
    _state["on"] = on


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    ip = getattr(shell, "get_ipython", lambda: None)() if shell is not None else None
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def progress_enabled() -> bool:
    if _state["on"] is not None:
        return bool(_state["on"])
    env = os.environ.get("INTERP_PROGRESS")
    if env is not None and env.strip() != "":
        return env.strip().lower() not in ("0", "false", "no", "off")
    return _in_notebook() or bool(getattr(sys.stderr, "isatty", lambda: False)())


def progress(iterable: Iterable | None = None, total: int | None = None, desc: str = "", unit: str = "it"):
    """``tqdm(iterable, total=, desc=, unit=)`` where progress is shown, else the iterable itself (or a do-nothing
    bar with ``update`` and ``close`` when no iterable is given)."""
    if not progress_enabled():
        return iterable if iterable is not None else _Silent()
    if _in_notebook() and importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.notebook import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, file=sys.stderr, dynamic_ncols=True)


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass
