"""The probe forward that ``interp.structure.layered`` (and ``interp.structure.seq2seq``) read a model's structure off: one
forward on our eager path recording every attention call and every module's first input and output, with the
model's attention implementation, modes and RNG restored after; and the small tests applied to what ran (is a
module a norm, a linear map; which ``nn.ModuleList`` holds the blocks)."""

from __future__ import annotations

import re

import torch

from ..attention.paths import EAGER_KEY, Recording
from ..runtime.distributed import input_device

__all__ = ["probe", "attention_keys", "set_attention_key"]


def probe(hf: torch.nn.Module, forward) -> tuple[Recording, _ModuleLog]:
    """``forward()`` once on our eager path in eval mode, recording every attention call and every module that ran;
    the attention implementation, every module's mode and the global RNG are as they were afterwards."""
    _refuse_meta(hf)
    previous = attention_keys(hf)
    modes = [(m, m.training) for m in hf.modules()]
    log = _ModuleLog(hf)
    try:
        set_attention_key(hf, EAGER_KEY)
        hf.eval()
        with Recording() as recording, torch.no_grad(), torch.random.fork_rng(devices=[]):
            forward()
    finally:
        log.remove()
        for m, training in modes:
            m.training = training
        for model, key in previous:
            if model.config._attn_implementation != key:
                model.set_attn_implementation(key)
    return recording, log


def _pretrained(hf: torch.nn.Module) -> list[torch.nn.Module]:
    """``hf`` and every sub-model of it that has a config object of its own (T5's stacks under transformers 5.17
    copy the config, so that setting the top-level key leaves theirs as it was)."""
    seen, models = {id(hf.config)}, [hf]
    for module in hf.modules():
        config = getattr(module, "config", None)
        if (module is not hf and hasattr(module, "set_attn_implementation") and config is not None
                and hasattr(config, "_attn_implementation") and id(config) not in seen):
            seen.add(id(config))
            models.append(module)
    return models


def attention_keys(hf: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """The attention implementation of ``hf`` and of each sub-model with a config of its own."""
    return [(model, model.config._attn_implementation) for model in _pretrained(hf)]


def set_attention_key(hf: torch.nn.Module, key: str) -> None:
    """``hf.set_attn_implementation(key)``, and the same on every sub-model whose config is a copy that the
    top-level call does not reach (transformers 5.17's T5), so that every attention module calls ``key``."""
    for model in _pretrained(hf):
        if model.config._attn_implementation != key:
            model.set_attn_implementation(key)


def _refuse_meta(hf: torch.nn.Module) -> None:
    """A weight on the ``meta`` device has a shape and no values: nothing can run. Offloaded weights (accelerate's
    device maps put them on meta and load them around each forward through a ``_hf_hook``) are fine."""
    hooked: list[str] = []
    empty = []
    for name, module in hf.named_modules():
        if getattr(module, "_hf_hook", None) is not None:
            hooked.append(name + ".")
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        if any(t.is_meta for _, t in tensors) and not any((name + ".").startswith(h) or not h.strip(".")
                                                          for h in hooked):
            empty += [f"{name}.{n}" if name else n for n, t in tensors if t.is_meta]
    if empty:
        raise ValueError(f"{type(hf).__name__} has {len(empty)} weight(s) on the meta device (shapes without values), "
                         f"e.g. {empty[:3]}: it cannot run. Load real weights (interp.load_model(folder) or "
                         "from_pretrained), or materialise them with model.to_empty(device='cpu') and load a state "
                         "dict; to spread a large model over devices use load_model(..., device_map='auto').")


def _probe_ids(hf, n_tokens: int) -> torch.Tensor:
    vocab = int(getattr(hf.config, "vocab_size", None) or hf.get_input_embeddings().num_embeddings)
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(min(4, vocab - 1), vocab, (1, n_tokens), generator=generator)
    return ids.to(input_device(hf))  # the embedding's device (its first weight may be offloaded by a device map)


class _ModuleLog:
    """The first input tensor, first output tensor and call order of every module during the probe."""

    def __init__(self, hf: torch.nn.Module):
        self.inputs: dict[torch.nn.Module, torch.Tensor | None] = {}
        self.outputs: dict[torch.nn.Module, torch.Tensor | None] = {}
        self.order: dict[torch.nn.Module, int] = {}
        self.ended: dict[torch.nn.Module, int] = {}
        self.handles = []
        for module in hf.modules():
            self.handles.append(module.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post))

    def _pre(self, module, args, kwargs):
        if module not in self.order:
            self.order[module] = len(self.order) + len(self.ended)
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("hidden_states")
            self.inputs[module] = tensor if isinstance(tensor, torch.Tensor) else None

    def _post(self, module, args, output):
        if module not in self.outputs:
            self.ended[module] = len(self.order) + len(self.ended)
            if not isinstance(output, torch.Tensor):
                try:
                    output = output[0]
                except (TypeError, IndexError, KeyError):
                    output = None
            self.outputs[module] = output if isinstance(output, torch.Tensor) else None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


_NORM_NAME = re.compile(r"Norm(Gated|PerHead)?\d*$")  # LlamaRMSNorm, CohereLayerNorm, StableLmLayerNormPerHead


def _is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm)) or bool(
        _NORM_NAME.search(type(module).__name__))


def _is_linear(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.ndim == 2 and not isinstance(module, torch.nn.Embedding)


def _close(a: torch.Tensor | None, b: torch.Tensor, tol: float) -> bool:
    """Equal within ``tol``; a tensor flattened over batch and position ((b * p, m), as OPT's MLP runs) counts."""
    if a is None or a.numel() != b.numel() or a.shape[-1] != b.shape[-1]:
        return False
    return bool(((a.float().reshape(b.shape) - b.float()).abs() <= tol).all())


def _find_blocks(hf, attn_modules: list[torch.nn.Module]) -> tuple[str, torch.nn.ModuleList]:
    wanted = set(map(id, attn_modules))
    for name, module in hf.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) != len(attn_modules):
            continue
        owners = []
        for block in module:
            inside = [m for m in block.modules() if id(m) in wanted]
            if len(inside) != 1:
                break
            owners.append(inside[0])
        if owners == attn_modules:
            return name, module
    raise NotImplementedError(
        f"{type(hf).__name__}: could not find a list of blocks with one attention module each "
        f"({len(attn_modules)} attention calls). Models with layers that have no attention (hybrid state-space "
        "models), or several attention modules per block, are not supported."
    )
