"""Progress bars for the studies that take more than a few seconds, in a terminal and in notebooks.

On by default where someone is watching: stderr is a terminal, or the code runs in a Jupyter kernel (the widget
bar when ipywidgets is installed, a text bar otherwise, never tqdm's "IProgress not found" warning). Off in
scripts whose stderr goes to a file or pipe, in tests, and when asked: ``interp.set_progress(False)`` or
``INTERP_PROGRESS=0`` in the environment (``1`` forces them on). ``"lines"`` (``set_progress("lines")``,
``INTERP_PROGRESS=lines``) writes plain lines instead, for a log: one when a stage starts, one when it ends, and
one every half minute between; the ``interp`` command does that when its stderr is not a terminal.

    import interp
    interp.set_progress(False)        # quiet studies
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import Iterable

__all__ = ["progress", "progress_enabled", "progress_lines_off_a_terminal", "progress_mode", "set_progress", "stage"]

_state: dict[str, bool | str | None] = {"on": None}  # None: decided by where the output goes
_EVERY = 30.0  # seconds between two lines of one stage in "lines" mode


def set_progress(on: bool | str | None) -> None:
    """Show progress bars (True), hide them (False), write a line per stage ("lines", for logs), or decide by
    where stderr goes (None, the default)."""
    if on not in (True, False, None, "lines"):
        raise ValueError(f"set_progress takes True, False, 'lines' or None; got {on!r}.")
    _state["on"] = on


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    ip = getattr(shell, "get_ipython", lambda: None)() if shell is not None else None
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def _mode() -> str | None:
    """"bar", "lines" or None (nothing shown)."""
    on = _state["on"]
    if on is None:
        env = (os.environ.get("INTERP_PROGRESS") or "").strip().lower()
        on = "lines" if env == "lines" else env not in ("0", "false", "no", "off") if env else \
            _in_notebook() or bool(getattr(sys.stderr, "isatty", lambda: False)())
    return "lines" if on == "lines" else "bar" if on else None


def progress_mode() -> str:
    """How progress is shown now: ``"bar"``, ``"lines"`` or ``"off"``."""
    return _mode() or "off"


def progress_enabled() -> bool:
    """Whether progress is shown (as bars or as lines)."""
    return _mode() is not None


@contextlib.contextmanager
def progress_lines_off_a_terminal():
    """For a command line: inside the block, progress is written as lines when stderr is not a terminal (a log
    file, a pipe), unless the user chose (``set_progress``, ``INTERP_PROGRESS``); bars on a terminal as always."""
    before = _state["on"]
    chosen = before is not None or (os.environ.get("INTERP_PROGRESS") or "").strip() != ""
    if not chosen and _mode() is None:
        _state["on"] = "lines"
    try:
        yield
    finally:
        _state["on"] = before


@contextlib.contextmanager
def stage(desc: str):
    """One step of a study that has no loop to count (a bar of one step; in "lines" mode a line when it starts and
    one when it ends)."""
    bar = progress(total=1, desc=desc, unit="step")
    try:
        yield
    except BaseException:
        if not isinstance(bar, _Lines):  # a log gets no "done" line for a step that failed
            bar.close()
        raise
    bar.update(1)
    bar.close()


def progress(iterable: Iterable | None = None, total: int | None = None, desc: str = "", unit: str = "it"):
    """``tqdm(iterable, total=, desc=, unit=)`` where progress is shown (a line per stage in "lines" mode), else
    the iterable itself (or a do-nothing bar with ``update`` and ``close`` when no iterable is given)."""
    mode = _mode()
    if mode is None:
        return iterable if iterable is not None else _Silent()
    if mode == "lines":
        return _Lines(iterable, total, desc, unit)
    if _in_notebook() and importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.notebook import tqdm
    else:
        from tqdm.std import tqdm
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, file=sys.stderr, dynamic_ncols=True)


class _Lines:
    """Progress as plain lines on stderr: ``desc: 0/N unit`` when it starts, the count every ``_EVERY`` seconds,
    and ``desc: N/N unit, done in S s`` when it ends."""

    def __init__(self, iterable, total, desc, unit):
        from . import distributed  # noqa: PLC0415  (torch, only when lines are written)

        self.iterable, self.desc, self.unit, self.n, self.closed = iterable, desc, unit, 0, False
        self.total = total if total is not None or iterable is None else _length(iterable)
        self.quiet = not distributed.rank_zero()  # one log, not one per rank
        self.start = self.last = time.monotonic()
        self._line("")

    def _line(self, end: str) -> None:
        if not self.quiet:
            of = f"/{self.total}" if self.total is not None else ""
            print(f"{self.desc}: {self.n}{of} {self.unit}{end}", file=sys.stderr, flush=True)

    def __iter__(self):
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()  # not after an error: a log gets no "done" line for a stage that failed

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last >= _EVERY and self.n != self.total:
            self.last = now
            self._line(f", {now - self.start:.0f} s")

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line(f", done in {time.monotonic() - self.start:.1f} s")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _length(iterable) -> int | None:
    try:
        return len(iterable)
    except TypeError:
        return None


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass
