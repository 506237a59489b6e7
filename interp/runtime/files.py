"""Writing the user's files so that none is ever half-written or lost.

A file is written to a temporary name beside it and renamed over the target when complete (``os.replace`` is
atomic on one file system), so a full disk or a kill midway leaves the old file as it was, and no partial file.
A folder of outputs (a report, a saved model) is written into a hidden staging folder beside it, and its files
are moved into place only once all of them are written. Nothing is overwritten unless asked (``overwrite``).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_write", "refuse_overwrite", "staged_folder"]


def refuse_overwrite(path: Path, overwrite: bool, what: str = "file") -> None:
    if path.exists() and not overwrite:
        raise FileExistsError(f"{str(path)!r} exists; pass overwrite=True to replace it (the CLI: --force).")


def atomic_write(path: str | os.PathLike, data: str | bytes, overwrite: bool = False, encoding: str = "utf-8") -> Path:
    """Write ``data`` to ``path`` in one step: a temporary file beside it, flushed to disk, renamed over ``path``."""
    path = Path(path)
    refuse_overwrite(path, overwrite)
    if path.is_dir():
        raise IsADirectoryError(f"{str(path)!r} is a folder; give a file name.")
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            _write_all(fd, data.encode(encoding) if isinstance(data, str) else data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@contextmanager
def staged_folder(out: str | os.PathLike, overwrite: bool = False, names: tuple[str, ...] | None = None,
                  earlier: tuple[str, ...] = ()) -> Iterator[Path]:
    """``with staged_folder(out) as tmp:`` write every output into ``tmp``; on success each file in it replaces its
    namesake in ``out`` (created if missing), and each folder in it is merged into its namesake the same way: files
    of ``out`` that the block did not write are left alone (a user's own file in a report's ``figures/`` too), except
    those named in ``earlier``, paths relative to ``out`` that an earlier run of the same program wrote (its outputs,
    not the user's: removed where this run does not write them again). On failure nothing in ``out`` changes and
    ``tmp`` is removed. Without ``overwrite``, any of ``names`` (default: whatever the block writes) that exists in
    ``out`` is an error, raised before anything is moved."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{str(out)!r} is a file; give a folder for the outputs.")
    if names is not None and not overwrite:
        for name in names:
            refuse_overwrite(out / name, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir()
    try:
        yield tmp
        made = sorted(tmp.iterdir())
        if not overwrite:
            for item in made:
                refuse_overwrite(out / item.name, overwrite)
        written = {p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if not p.is_dir()}
        out.mkdir(exist_ok=True)
        _merge(tmp, out)
        for name in sorted(set(earlier) - written):  # an earlier run's outputs this run did not write again
            stale = out / name
            if _relative(name) and stale.is_file() and not stale.is_symlink():
                stale.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _merge(source: Path, target: Path) -> None:
    """Move everything in ``source`` into ``target``: a file replaces its namesake, a folder is merged into its."""
    for item in sorted(source.iterdir()):
        there = target / item.name
        if item.is_dir() and there.is_dir() and not there.is_symlink():
            _merge(item, there)
        else:
            os.replace(item, there)


def _relative(name) -> bool:
    """Whether ``name`` (read from a file the user could edit) is a path that stays inside the folder it is relative
    to."""
    return isinstance(name, str) and bool(name) and not Path(name).is_absolute() and ".." not in Path(name).parts
