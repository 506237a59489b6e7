"""A process's peak memory on Linux, for the benchmarks that set peaks side by side in fresh processes
(``bench_vs_kvpress.py``, ``bench_vs_eapig.py``, ``bench_circuits_long.py``, ``bench_streaming.py``) and for
``circuits_retrieval.py``'s own. Standard library only: the children of the peer comparisons run in the peers' own
virtualenvs."""

from __future__ import annotations

from pathlib import Path

__all__ = ["grown_mib", "reset_peak", "status_bytes"]


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` field (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak() -> int:
    """Give freed memory back (glibc's ``malloc_trim``), reset the peak (``/proc/self/clear_refs``, 5) and return the
    resident bytes now: what ``grown_mib`` measures from."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return status_bytes("VmRSS")


def grown_mib(before: int) -> float:
    """The growth of the peak resident size over ``before`` (``reset_peak``'s), in MiB."""
    return (status_bytes("VmHWM") - before) / 2**20
