"""Saving a model into a folder that may hold an earlier one: ``save_model(model, folder, overwrite)``.

interp writes a manifest beside the model it saves, ``interp-files.json``: the files (and folders) that this save
wrote, with their sizes. That is how a later save knows what it may replace. With ``overwrite`` (the CLI's
``--force``) a new save replaces the files the manifest lists and removes those it does not write again, so no file
of the earlier model is left beside the new one (a tokenizer the new model lacks would load with it). A file the
manifest does not list, or one whose size changed since, is the user's and is never replaced or removed: when it is
a file a model loader reads (config, weights, tokenizer; ``_LOADED``), the save is refused, since the folder would
then load a mixture; any other file (notes, a results table) stays where it is.

The files are written into a staging folder first (``interp.runtime.files.staged_folder``): a full disk or an error midway
leaves the folder as it was, and is reported as an ``OSError`` (safetensors raises its own error type).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
from pathlib import Path

from .files import staged_folder

__all__ = ["MANIFEST", "save_model", "check_model_folder"]

MANIFEST = "interp-files.json"
# What transformers' from_pretrained and interp.load_model read from a folder (config, weights, tokenizer and
# processor files): patterns rather than one tokenizer's names, since the earlier model may have had another kind.
_LOADED = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "*.bin",
           "*.bin.index.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
           "*.model", "*.tiktoken", "chat_template*", "additional_chat_templates", "preprocessor_config.json",
           "processor_config.json")


def _size(path: Path) -> int | None:
    return None if path.is_dir() else path.stat().st_size


def _ours(folder: Path) -> set[str]:
    """The names in ``folder`` that interp wrote there: listed by its manifest, with the size it recorded."""
    try:
        files = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return set()  # no manifest, or not one of ours: every file is the user's
    if not isinstance(files, dict):
        return set()
    ours = {MANIFEST}
    for name, size in files.items():
        path = folder / str(name)
        if (isinstance(name, str) and Path(name).name == name and name not in ("", ".", "..") and path.exists()
                and not path.is_symlink() and _size(path) == size):
            ours.add(name)
    return ours


def _foreign(folder: Path, ours: set[str]) -> list[str]:
    """The files of ``folder`` that a model loader reads and that interp did not write."""
    return sorted(p.name for p in folder.iterdir()
                  if p.name not in ours and any(fnmatch.fnmatch(p.name, pattern) for pattern in _LOADED))


def check_model_folder(folder, overwrite: bool = False) -> None:
    """Refuse a folder ``save_model`` would not write: a file; a non-empty folder without ``overwrite``; with it, a
    folder holding model files interp did not write (they would load beside the new model). Checked before any work,
    so that a long command does not fail at its end."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{str(folder)!r} is a file; give a folder to save the model in.")
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(f"{str(folder)!r} exists and is not empty; pass --force (overwrite=True) to replace "
                              "the model interp saved there (files interp did not write are kept).")
    foreign = _foreign(folder, _ours(folder))
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise FileExistsError(f"{str(folder)!r} holds {shown}, which interp did not write there (its {MANIFEST} does "
                              "not list them, or they changed since); a model saved beside them would load with "
                              "them, and --force replaces only what interp wrote: remove them yourself, or save to "
                              "another folder.")


def save_model(model, folder, overwrite: bool = False) -> Path:
    """``model.save_pretrained`` into ``folder``, whole or not at all, with a manifest of what it wrote; with
    ``overwrite``, the files an earlier save of interp left there and this one does not write are removed (see the
    module doc). A full disk is an ``OSError`` naming the folder; the folder is then as it was."""
    from safetensors import SafetensorError

    folder = Path(folder)
    check_model_folder(folder, overwrite)
    ours = _ours(folder) if folder.is_dir() else set()
    with staged_folder(folder, overwrite=True) as staging:
        try:
            model.save_pretrained(staging)
        except SafetensorError as err:
            raise _write_error(err, folder) from None
        written = {p.name: _size(p) for p in sorted(staging.iterdir())}
        clash = sorted(n for n in written if (folder / n).exists() and n not in ours)
        if clash:
            raise FileExistsError(f"{str(folder)!r} holds {', '.join(clash[:5])}, which interp did not write there; "
                                  "--force replaces only what interp wrote: remove them yourself, or save to "
                                  "another folder.")
        (staging / MANIFEST).write_text(json.dumps({"written_by": "interp", "files": written}, indent=1) + "\n",
                                        encoding="utf-8")
    for name in sorted(ours - set(written) - {MANIFEST}):  # the earlier model's files this one does not have
        path = folder / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    return folder


def _write_error(err: Exception, folder: Path) -> OSError:
    """safetensors' error (``Error while serializing: IoError(Os { code: 28, ... })``) as the OSError it wraps."""
    text = str(err)
    code = re.search(r"code: (\d+)", text)
    if code:
        number = int(code.group(1))
        return OSError(number, f"{os.strerror(number)} while saving the model (nothing was written)", str(folder))
    first = (text.strip().splitlines() or [type(err).__name__])[0]
    return OSError(f"cannot save the model to {str(folder)!r} (nothing was written): {first}")
