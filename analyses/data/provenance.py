"""What identifies a result's inputs, so that it can be checked again: the model's weights and tokenizer digests, the
versions that computed it, and the prompts' digests. The head atlas (``analyses.atlas``) and saved circuits
(``analyses.circuits.saved``) record the same facts through these functions.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import torch

from .batches import unpadded_rows

__all__ = ["IDENTITY", "batch_digest", "identity_changes", "model_record", "prompts_digest", "tokenizer_digest", "versions", "weights_digest"]


IDENTITY = (("model", "weights_sha256"), ("model", "tokenizer_sha256"), ("versions", "interp"),
            ("versions", "transformers"), ("versions", "torch"), ("versions", "attn"))  # what makes two results comparable


def weights_digest(model) -> str:
    """sha256 over the model's state dict in name order: each tensor's name, dtype, shape and bytes. The weights as
    loaded (a de-quantized GGUF's fp32 tensors), so the digest also changes when the conversion does."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.hf.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def tokenizer_digest(model) -> str | None:
    """sha256 of the tokenizer's serialisation (a fast tokenizer's tokenizer.json text; else its vocabulary sorted),
    None without a tokenizer."""
    tok = model.tokenizer
    if tok is None:
        return None
    backend = getattr(tok, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def versions(model) -> dict:
    """The versions that computed a result (interp, transformers, torch, Python) and the attention path."""
    import transformers

    import interp

    return {"interp": interp.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "python": platform.python_version(), "attn": model.attn}


def model_record(model, source: str | None = None) -> dict:
    """The model a result was computed on: its name, where it was loaded from, its class and size, the weights and
    tokenizer digests."""
    c = model.cfg
    name = getattr(model, "source_name", None) or Path(getattr(model.hf.config, "name_or_path", "") or "").name
    return {"name": name or type(model.hf).__name__, "source": source, "class": type(model.hf).__name__,
            "parameters": sum(p.numel() for p in model.hf.parameters()),
            "sites": len(c.sites), "heads": sum(s.n_heads for s in c.sites),
            "weights_sha256": weights_digest(model), "tokenizer_sha256": tokenizer_digest(model)}


def prompts_digest(rows: list[dict]) -> str:
    """sha256 of a prompt set's token ids (each row's entries in name order, as int64 with their lengths): the same
    digest means the same prompts, so a result can be checked again on them."""
    digest = hashlib.sha256()
    for row in rows:
        for entry in sorted(row):
            ids = torch.as_tensor(row[entry]).long().cpu()
            digest.update(f"{entry}:{len(ids)};".encode())
            digest.update(ids.numpy().astype("<i8").tobytes())
    return digest.hexdigest()


def batch_digest(batch: dict) -> str:
    """``prompts_digest`` of a padded batch (``input_ids`` with its ``attention_mask``): its padding does not count."""
    return prompts_digest(unpadded_rows(batch))


def identity_changes(a: dict, b: dict) -> list[str]:
    """What differs between two results' ``model`` and ``versions`` records (``IDENTITY``), one line each:
    ``"model weights_sha256: x -> y"``."""
    notes = []
    for section, key in IDENTITY:
        x, y = (r.get(section, {}).get(key) for r in (a, b))
        if x != y:
            notes.append(f"{section} {key}: {x} -> {y}")
    return notes
