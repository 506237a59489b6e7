"""How many CPU threads torch uses, decided once for the CLI and the Python API alike.

torch starts with one thread per core. On a machine where other work keeps cores busy that oversubscribes them:
measured here (2 cores, one other busy process), two threads ran a study up to 10x slower than one. ``"auto"``
takes the cores that are idle now (the CPUs this process may run on, minus the 1-minute load average, at least
one). ``load_model`` applies it unless the user chose a number already: ``torch.set_num_threads`` called before
(any count other than torch's own default), ``interp.set_threads``, or ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``
in the environment. It is decided once per process, at the first ``load_model``.

    import interp
    interp.set_threads(1)          # or "auto"; load_model then leaves the choice alone
"""

from __future__ import annotations

import os

import torch

__all__ = ["apply_auto_threads", "auto_threads", "set_threads", "threads_chosen_by_user"]

_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_state = {"ours": None, "explicit": False}  # the count interp set last (None: never); by set_threads?


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def auto_threads() -> int:
    """The idle cores now: the CPUs this process may use minus the rounded 1-minute load average, at least 1."""
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(_cpus(), _cpus() - busy))


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
