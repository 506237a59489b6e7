"""How many CPU threads torch uses, decided once for the CLI and the Python API alike.

torch starts with one thread per core. On a machine where other work keeps cores busy that oversubscribes them:
measured here (2 cores, one other busy process), two threads ran a study up to 10x slower than one. ``"auto"``
takes the cores that are idle now (the CPUs this process may run on, minus those busy over a 0.2 s sample of
``/proc/stat``, at least one; the 1-minute load average only where there is no ``/proc/stat``: it still counts the
user's own previous run for a minute after it ended). ``load_model`` applies it unless the user chose a number already: ``torch.set_num_threads`` called before
(any count other than torch's own default), ``interp.set_threads``, or ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``
in the environment. It is decided once per process, at the first ``load_model``.

    import interp
    interp.set_threads(1)          # or "auto"; load_model then leaves the choice alone
"""

from __future__ import annotations

import os
import time

import torch

__all__ = ["apply_auto_threads", "auto_threads", "set_threads", "threads_chosen_by_user"]

_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_state = {"ours": None, "explicit": False}  # the count interp set last (None: never); by set_threads?


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cpu_times() -> dict[int, tuple[int, int]] | None:
    """CPU index -> (idle ticks, all ticks) from /proc/stat, or None where it cannot be read (not Linux)."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        name, *ticks = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and len(ticks) >= 5:
            ticks = [int(t) for t in ticks[:8]]  # user nice system idle iowait irq softirq steal (not guest)
            out[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
    return out or None


def _busy_now(interval: float = 0.2) -> float | None:
    """How many of this process's CPUs were busy over the last ``interval`` seconds (None: cannot tell)."""
    first = _cpu_times()
    if first is None:
        return None
    time.sleep(interval)
    second = _cpu_times() or {}
    try:
        mine = os.sched_getaffinity(0)
    except AttributeError:
        mine = set(first)
    busy = 0.0
    for cpu in mine & set(first) & set(second):
        idle, total = (b - a for a, b in zip(first[cpu], second[cpu]))
        busy += 1 - idle / total if total > 0 else 0.0
    return busy


def auto_threads() -> int:
    """The idle cores now: the CPUs this process may use minus those busy now (a 0.2 s sample), at least 1."""
    busy = _busy_now()
    if busy is None:  # no /proc/stat: the 1-minute load average is all there is
        busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(_cpus(), _cpus() - round(busy)))


def threads_chosen_by_user() -> bool:
    """Whether the user already chose torch's thread count (environment, torch.set_num_threads, set_threads)."""
    if any(os.environ.get(name) for name in _ENV):
        return True
    current = torch.get_num_threads()
    if _state["ours"] is not None:
        return current != _state["ours"] or _state["explicit"]
    return current not in (_cpus(), (os.cpu_count() or current))


def set_threads(threads: int | str = "auto") -> int:
    """Set torch's CPU threads: a positive integer, or ``"auto"`` (the idle cores now). Returns the count.

    An explicit call counts as the user's choice: ``load_model`` will not change it afterwards.
    """
    if threads == "auto":
        n = auto_threads()
    else:
        try:
            n = int(threads)
        except (TypeError, ValueError):
            n = 0
        if isinstance(threads, bool) or n < 1 or str(n) != str(threads).strip():
            raise ValueError(f"threads must be a positive integer or 'auto'; got {threads!r}.")
    torch.set_num_threads(n)
    _state.update(ours=n, explicit=True)
    return n


def apply_auto_threads() -> int | None:
    """``"auto"``, once per process, unless the user chose a count (``threads_chosen_by_user``): the count set, or
    None. Once only, so that results within a session never change with a thread count that moved between calls."""
    if _state["ours"] is not None or threads_chosen_by_user():
        return None
    n = auto_threads()
    torch.set_num_threads(n)
    _state.update(ours=n, explicit=False)
    return n
