"""HookedModel: a HuggingFace model whose attention step is ours, with named hook points."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from einops import rearrange
from transformers.pytorch_utils import Conv1D

from hooks import HOOK_TABLE, ActivationCache, AttentionMeta, HookPoint, HookRegistry, NameFilter, spec_for

from .attention import ATTN_KEYS, LayerHooks, attach_layer_hooks, attached_layer_hooks, detach_layer_hooks
from .distributed import input_device, onloaded
from .families import check_supported
from .inputs import check_inputs, fix_permissions, pad_ids, padded_positions, position_limit, texts_of, tokenize
from .pruning import CONFIG_KEY, check_head_counts, save_pruned
from .sites import Site
from .structure import Structure, attention_keys, discover, set_attention_key

__all__ = ["HookedModel", "ModelConfig"]

_ATTN_KINDS = ("q", "k", "v", "attn_scores", "pattern", "z", "lse")
_MODULE_KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "result")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a hooked model, as its attention calls showed it (``interp.structure``).

    ``n_heads``/``n_kv_heads``: query and key/value heads; a pruned model (``analyses.prune_model``) has fewer
    heads in some layers: ``heads_per_layer``/``kv_heads_per_layer`` hold every layer's own counts as the
    weights hold them. A layer that lost every head keeps one zeroed placeholder head so that transformers can
    run it; such layers are listed in ``empty_layers`` and their placeholder is not a head in any analysis.
    ``d_head`` is the query/key head size and ``d_head_v`` the value head size (they differ in multi-head latent
    attention). ``block``: ``"pre-norm"``, ``"post-norm"`` or ``"parallel"`` (attention and MLP side by side).
    ``max_positions`` is None when the model has no position limit in its config.
    """

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    causal: bool
    max_positions: int | None
    vocab_size: int
    family: str
    heads_per_layer: tuple[int, ...] = ()
    kv_heads_per_layer: tuple[int, ...] = ()
    empty_layers: tuple[int, ...] = ()
    d_head_v: int = 0
    block: str = "pre-norm"
    sites: tuple[Site, ...] = ()  # one per layer, ``blocks.{l}.attn`` (``interp.sites``)

    def __post_init__(self):
        if not self.heads_per_layer:
            object.__setattr__(self, "heads_per_layer", (self.n_heads,) * self.n_layers)
        if not self.kv_heads_per_layer:
            object.__setattr__(self, "kv_heads_per_layer", (self.n_kv_heads,) * self.n_layers)
        if not self.d_head_v:
            object.__setattr__(self, "d_head_v", self.d_head)
        if len(self.heads_per_layer) != self.n_layers or len(self.kv_heads_per_layer) != self.n_layers:
            raise ValueError(f"heads_per_layer and kv_heads_per_layer need {self.n_layers} entries; got "
                             f"{self.heads_per_layer} and {self.kv_heads_per_layer}.")

    @property
    def pruned(self) -> bool:
        return bool(self.empty_layers) or any(h != self.n_heads for h in self.heads_per_layer)

    def heads(self) -> list[tuple[int, int]]:
        """Every real ``(layer, head)``, layer by layer; an emptied layer's placeholder is not one."""
        return [(l, h) for l, n in enumerate(self.heads_per_layer) if l not in self.empty_layers for h in range(n)]

    @property
    def stacks(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.stack for s in self.sites))


def _config_of(hf, structure: Structure) -> ModelConfig:
    c = hf.config
    layers = structure.layer_attn
    heads, kv_heads = tuple(l.n_heads for l in layers), tuple(l.n_kv_heads for l in layers)
    if getattr(c, CONFIG_KEY, None):  # pruned: the original counts are the config's
        n_heads = c.num_attention_heads
        n_kv_heads = getattr(c, "num_key_value_heads", None) or n_heads
    else:
        n_heads, n_kv_heads = max(heads), max(kv_heads)
    max_positions = position_limit(c)
    vocab_size = getattr(c, "vocab_size", None) or hf.get_input_embeddings().num_embeddings
    return ModelConfig(
        n_layers=structure.n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_head=layers[0].d_head,
        d_model=structure.d_model,
        causal=all(l.causal for l in layers),
        max_positions=max_positions if isinstance(max_positions, int) else None,
        vocab_size=int(vocab_size),
        family=c.model_type,
        heads_per_layer=heads,
        kv_heads_per_layer=kv_heads,
        empty_layers=tuple(sorted(int(l) for l, kept in (getattr(c, CONFIG_KEY, None) or {}).items() if not kept)),
        d_head_v=layers[0].d_head_v,
        block=structure.kind,
        sites=tuple(_site(l, a, structure.o_proj[l]) for l, a in enumerate(layers)),
    )


def _site(layer: int, a, o_proj: str | None) -> Site:
    """The site of one layer: a causal model's stack is a decoder, a bidirectional one's an encoder."""
    return Site(name=f"blocks.{layer}.attn", stack="decoder" if a.causal else "encoder", block=layer, kind="self",
                n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, d_head=a.d_head, d_head_v=a.d_head_v, scale=a.scale,
                causal=a.causal, o_proj=o_proj, window=a.window, softcap=a.softcap, sinks=a.sinks is not None)


def _replace_first(output, fn):
    """Apply fn to a module's output tensor, or to the first element of a tuple output."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    return (fn(output[0]), *output[1:])


class _Handles(list):
    """Several torch hook handles removed together."""

    def remove(self) -> None:
        for handle in self:
            handle.remove()


def _take_over(hf: torch.nn.Module) -> None:
    """A HF model has one wrapper at a time: an earlier HookedModel on it loses its hooks now (so that they never
    fire in a newer one's probe or runs) and refuses to run from here on."""
    for module in hf.modules():
        previous = attached_layer_hooks(module)
        if previous is not None:
            owner = previous.owner()
            if owner is not None:
                owner._drop_torch_hooks()
            detach_layer_hooks(module)


@contextmanager
def studying(model):
    """``model.studying()`` of a HookedModel or Seq2SeqHookedModel (both keep ``hf``, ``_registry`` and
    ``_sync_module_hooks``): eval mode and the global RNG untouched inside; every module's mode, every parameter's
    ``requires_grad`` and the hooks on every point restored on exit, also after an exception."""
    hf, registry = model.hf, model._registry
    modes = [(m, m.training) for m in hf.modules()]
    # by name: accelerate replaces an offloaded weight's Parameter object each time it loads it
    requires = [(name, p.requires_grad) for name, p in hf.named_parameters()]
    hooks = {name: list(point.fns) for name, point in registry.points.items()}
    devices = sorted({p.device.index or 0 for p in hf.parameters() if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            hf.eval()
            yield model
    finally:
        for m, training in modes:
            m.training = training
        for name, flag in requires:
            hf.get_parameter(name).requires_grad_(flag)
        if any(point.fns != hooks[name] for name, point in registry.points.items()):
            for name, point in registry.points.items():
                point.fns[:] = hooks[name]
            model._sync_module_hooks()


class _Wrapper:
    """What both model wrappers (``HookedModel``, ``interp.seq2seq.Seq2SeqHookedModel``) do the same way with their
    hook registry (``_registry``) and torch hook handles (``_torch_handles``, made by ``_attach``)."""

    def studying(self):
        """The state every analysis runs in, and restores (a context manager).

        Inside: eval mode (no dropout, so a study is deterministic) and the global RNG untouched. On exit,
        also after an exception: every module's train/eval mode, every parameter's ``requires_grad`` and the
        hooks on every point are as they were before.
        """
        return studying(self)

    @contextmanager
    def hooks(self, fwd_hooks: Iterable[tuple[NameFilter, Callable]] = ()):
        """``with model.hooks([(name_or_filter, fn), ...]):`` hooks active inside the block only."""
        self._check_attached()
        with self._registry.hooks(fwd_hooks):
            yield self

    def reset_hooks(self) -> None:
        """Remove every hook added through this model."""
        self._registry.clear()

    @property
    def device(self) -> torch.device:
        """Where inputs go: the input embedding's device (with a device map, its execution device)."""
        return input_device(self.hf)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    def hook_names(self) -> list[str]:
        return self._registry.names()

    def _check_attached(self, key: bool = True) -> None:
        """Another HookedModel built on the same HF model takes over its attention hooks: refuse to run
        this one silently without them."""
        if not self._owns_hf():
            raise RuntimeError(
                "This model's HF model was wrapped again by a newer interp model (interp.load_model on the "
                "same instance), which now owns its hooks and attention path. Use the newer one, or wrap a copy: "
                "interp.load_model(copy.deepcopy(hf))."
            )
        if key:
            self._check_attention_key()

    def _check_attention_key(self) -> None:
        """Our attention must be the one that runs: after ``model.hf.set_attn_implementation("sdpa")`` a study would
        see no hook fire (every ablation delta 0.0, a cache without q, k or z) and say nothing."""
        key = ATTN_KEYS.get(getattr(self, "attn", None))
        if key is None:  # still being built
            return
        holders = self.__dict__.get("_attn_holders")
        if holders is None:  # the model and each sub-model with a config of its own (attention_keys)
            holders = self.__dict__["_attn_holders"] = [m for m, _ in attention_keys(self.hf)]
        for holder in holders:
            found = holder.config._attn_implementation
            if found != key:
                raise RuntimeError(
                    f"The HF model's attention implementation is {found!r}, not interp's {key!r}: it was switched "
                    f"behind the wrapper (model.hf.set_attn_implementation), so interp's attention, hooks, caches "
                    f"and studies would not run. Call model.set_attn({self.attn!r}) (or 'eager'/'flash') to switch "
                    "back; for HF's own attention, load a separate copy of the model.")

    def _switch_attn(self, attn: str) -> None:
        """Set the attention implementation of the HF model to our eager or flash path (refusing hooks that the
        flash path cannot fire); the caller checks that every attention then calls it."""
        self._check_attached(key=False)  # switching back from an implementation set behind the wrapper is the fix
        if attn not in ATTN_KEYS:
            raise ValueError(f"attn must be 'eager' or 'flash'; got {attn!r}.")
        if attn == "flash":
            eager_only = [n for n in self._registry.active() if spec_for(n).eager_only]
            if eager_only:
                raise ValueError(f"Remove the hooks on {eager_only} before switching to the flash path (eager only).")
        set_attention_key(self.hf, ATTN_KEYS[attn])
        self.attn = attn

    def _check_points(self, points: list[HookPoint]) -> None:
        if self.attn == "flash":
            bad = [p.name for p in points if spec_for(p.name).eager_only]
            if bad:
                raise ValueError(
                    f"{bad[0]} exists only on the eager path (the flash path never builds the n x n matrix). "
                    "Call model.set_attn('eager'), or capture q and k and use cache.pattern(layer, heads) "
                    "(an encoder-decoder model: cache.pattern(site prefix, heads))."
                )

    def _keep_handles(self, wanted: set[str]) -> None:
        """Torch hooks exactly on the keys in ``wanted``: remove the others, attach the missing ones."""
        for key in list(self._torch_handles):
            if key not in wanted:
                self._torch_handles.pop(key).remove()
        for key in wanted - self._torch_handles.keys():
            self._torch_handles[key] = self._attach(key)


_ENCODER_DECODER: list[type] = []  # the encoder-decoder wrapper, registered by interp.seq2seq (no import cycle)


def _encoder_decoder(hf) -> bool:
    return bool(getattr(getattr(hf, "config", None), "is_encoder_decoder", False)) and callable(
        getattr(hf, "get_encoder", None))


class HookedModel(_Wrapper):
    """A HF model (``.hf``) with our attention, hook points and activation cache: the one public class for
    decoder-only, encoder-only and encoder-decoder models.

    ``model(input_ids, attention_mask=None)`` returns the HF model's own output. Inputs may be token ids
    ``(b, p)`` or ``(p,)``, the mapping ``to_tokens`` returns, or text (tokenized with ``to_tokens``). The model
    is a list of attention sites (``model.cfg.sites``, ``interp.sites``): one per layer here; an encoder-decoder
    HF model (T5, BART, ...) gets encoder, decoder and cross-attention sites, and its instance runs the
    encoder-decoder feeding of ``interp.seq2seq`` (``HookedModel(t5)`` is such an instance; ``isinstance(model,
    HookedModel)`` holds for every model).
    """

    def __new__(cls, hf=None, *args, **kwargs):
        if cls is HookedModel and _encoder_decoder(hf) and _ENCODER_DECODER:
            cls = _ENCODER_DECODER[0]
        return super().__new__(cls)

    def __init__(self, hf: torch.nn.Module, tokenizer=None, attn: str = "flash", structure: Structure | None = None):
        check_supported(hf.config)
        self.hf = hf
        self.tokenizer = tokenizer
        _take_over(hf)  # before the probe, so that an earlier wrapper's hooks cannot fire in it
        self.structure = structure if structure is not None else discover(hf)
        s = self.structure
        self.cfg = _config_of(hf, s)
        self._blocks = hf.get_submodule(s.layers)
        self._attn_modules = [block.get_submodule(path) for block, path in zip(self._blocks, s.attn)]
        self.attn_scales = tuple(l.scale for l in s.layer_attn)  # what the model passes, not module.scaling
        self.sites = {site.name: site for site in self.cfg.sites}
        check_head_counts(self)

        points = [HookPoint("hook_embed")]
        for layer in range(self.cfg.n_layers):
            for spec in HOOK_TABLE:
                if not spec.per_layer or not self._has_point(spec.short, layer):
                    continue
                read_only = None
                if spec.short == "resid_mid" and s.resid_mid[layer][1] == "input":
                    read_only = ("in this pre-norm block it is the input of "
                                 f"{s.resid_mid[layer][0]}, not a module's output; edit hook_attn_out instead")
                elif spec.short == "lse":
                    read_only = "it is derived from the scores; edit hook_attn_scores or hook_pattern instead"
                points.append(HookPoint(spec.name(layer), layer, read_only))
        self._registry = HookRegistry(points, on_change=self._sync_module_hooks, check=self._check_points)
        self._torch_handles: dict[str, object] = {}
        self._takes_position_ids = "position_ids" in inspect.signature(hf.forward).parameters
        self._layer_hooks = []
        for layer, module in enumerate(self._attn_modules):
            lh = LayerHooks({k: self._registry[f"blocks.{layer}.attn.hook_{k}"] for k in _ATTN_KINDS}, owner=self)
            lh.causal = s.layer_attn[layer].causal  # what the probe found, not the module's is_causal flag
            attach_layer_hooks(module, lh)
            self._layer_hooks.append(lh)
        self.attn: str | None = None
        self.set_attn(attn)

    def _has_point(self, kind: str, layer: int) -> bool:
        """Whether this model has the per-layer point ``kind`` in ``layer`` (parallel blocks have no resid_mid;
        hook_result needs an output projection that reads z)."""
        s = self.structure
        return {"resid_mid": s.resid_mid[layer] is not None, "mlp_out": s.mlp[layer] is not None,
                "result": s.o_proj[layer] is not None}.get(kind, True)

    def _drop_torch_hooks(self) -> None:
        for handle in self._torch_handles.values():
            handle.remove()
        self._torch_handles.clear()

    # -- copies ----------------------------------------------------------------------------------------
    def __deepcopy__(self, memo) -> HookedModel:
        """A copy with its own HF model and its own hook points, holding the same hook functions."""
        kwargs = {"structure": self.structure} if hasattr(self, "structure") else {}
        clone = type(self)(copy.deepcopy(self.hf, memo), copy.deepcopy(self.tokenizer, memo), self.attn, **kwargs)
        clone._add_hooks(self._hook_functions())
        return clone

    def __getstate__(self) -> dict:
        return {"hf": self.hf, "tokenizer": self.tokenizer, "attn": self.attn, "hooks": self._hook_functions()}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["hf"], state["tokenizer"], state["attn"])
        self._add_hooks(state["hooks"])

    def _hook_functions(self) -> dict[str, list]:
        return {name: list(point.fns) for name, point in self._registry.points.items() if point.fns}

    def _add_hooks(self, functions: dict[str, list]) -> None:
        for name, fns in functions.items():
            for fn in fns:
                self._registry.add(name, fn)

    # -- attention path --------------------------------------------------------------------------------
    def _owns_hf(self) -> bool:
        return attached_layer_hooks(self._attn_modules[0]) is self._layer_hooks[0]

    def set_attn(self, attn: str) -> HookedModel:
        """Switch between the exact ``"eager"`` path and the fused ``"flash"`` path."""
        self._switch_attn(attn)
        self._probe()  # the config's record of the key is not proof (composite models keep one per sub-config)
        return self

    def _probe(self) -> None:
        """Run two tokens and check that our attention function really ran (HF may ignore the key)."""
        fired = []
        with self.studying(), self.hooks([("blocks.0.attn.hook_z", lambda z, hook: fired.append(hook.name))]):
            with torch.no_grad():
                self(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long))
        if not fired:
            raise NotImplementedError(
                f"{type(self.hf).__name__} did not call interp's attention function; it does not dispatch through "
                "transformers' attention interface, so it is not supported."
            )

    # -- hooks -----------------------------------------------------------------------------------------
    def _sync_module_hooks(self) -> None:
        """Attach a torch hook where a module-level point has listeners; detach it where none are left."""
        for lh in self._layer_hooks:
            lh.refresh()
        if not self._owns_hf():  # taken over by a newer wrapper: never put hooks on its modules again
            self._drop_torch_hooks()
            return
        wanted = {"hook_embed"} if self._registry["hook_embed"] else set()
        for layer in range(self.cfg.n_layers):
            wanted.update(f"blocks.{layer}.{kind}" for kind in _MODULE_KINDS
                          if self._registry.points.get(spec_name(layer, kind)))
        self._keep_handles(wanted)

    def _attach(self, key: str):
        if key == "hook_embed":
            point = self._registry["hook_embed"]
            return self.hf.get_input_embeddings().register_forward_hook(lambda m, i, out: point(out))
        _, layer, kind = key.split(".")
        layer = int(layer)
        block, point, s = self._blocks[layer], self._registry[spec_name(layer, kind)], self.structure
        if kind == "resid_pre":
            def pre(module, args, kwargs):
                if args:
                    return (point(args[0]), *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": point(kwargs["hidden_states"])}
            return block.register_forward_pre_hook(pre, with_kwargs=True)
        if kind == "result":
            return block.get_submodule(s.o_proj[layer]).register_forward_hook(self._result_hook(point))
        if kind in ("resid_post", "attn_out"):
            module = block.get_submodule(s.o_proj[layer] or s.attn[layer]) if kind == "attn_out" else block
            return module.register_forward_hook(lambda m, i, out: _replace_first(out, point))
        # resid_mid and mlp_out: some blocks run their MLP on (b * p, m) (OPT); hooks always see (b, p, m)
        shape: list[int] = []

        def remember(module, args, kwargs):
            shape[:] = (args[0] if args else kwargs["hidden_states"]).shape[:-1]

        handles = [block.register_forward_pre_hook(remember, with_kwargs=True)]

        def shaped(t):
            if t.ndim == 2 and len(shape) == 2:
                return point(t.reshape(*shape, t.shape[-1])).reshape(t.shape)
            return point(t)

        if kind == "resid_mid" and s.resid_mid[layer][1] == "input":
            def observe(module, args, kwargs):
                shaped(args[0] if args else kwargs["hidden_states"])  # the block adds its residual from its own variable
            handles.append(block.get_submodule(s.resid_mid[layer][0]).register_forward_pre_hook(observe, with_kwargs=True))
        else:
            module = block.get_submodule(s.mlp[layer] if kind == "mlp_out" else s.resid_mid[layer][0])
            handles.append(module.register_forward_hook(lambda m, i, out: _replace_first(out, shaped)))
        return _Handles(handles)

    def _result_hook(self, point: HookPoint):
        """Replace the output projection by a per-head sum, so that an edit to hook_result reaches the model."""
        h, e = self.cfg.heads_per_layer[point.layer], self.cfg.d_head_v

        def hook(o_proj, args, out):
            z = rearrange(args[0], "b p (h e) -> b p h e", h=h, e=e)
            with onloaded(o_proj):  # accelerate has put an offloaded weight back by the time this hook runs
                if isinstance(o_proj, Conv1D):
                    w = rearrange(o_proj.weight, "(h e) m -> h e m", h=h)
                else:
                    w = rearrange(o_proj.weight, "m (h e) -> h e m", h=h)
                result = torch.einsum("bphe,hem->bphm", z, w)
                bias = o_proj.bias  # the loaded tensor (accelerate puts a new meta Parameter in its place on exit)
            edited = point(result)
            if edited is result:  # observed only: keep the projection's own output, bit for bit
                return out
            summed = edited.sum(dim=2)
            return summed if bias is None else summed + bias

        return hook

    # -- inputs ----------------------------------------------------------------------------------------
    def to_tokens(self, text: str | Sequence[str], max_length: int | None = None):
        """Tokenize text into ``{"input_ids": (b, p), "attention_mask": (b, p)}``, padded (left for causal
        models, right for encoders) and on the model's device."""
        if self.tokenizer is None:
            raise ValueError("This model has no tokenizer; pass token ids (b, p) instead of text.")
        texts = texts_of(text)
        rows = tokenize(self.tokenizer, texts, max_length=max_length)
        ids, mask = pad_ids(rows, left=self.cfg.causal, pad_id=self.pad_token_id)
        return {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}

    @property
    def pad_token_id(self) -> int:
        """The id put on padded positions (masked out, so any id works): the tokenizer's or config's pad, else
        its end-of-sequence token, else 0."""
        for source in (self.tokenizer, self.hf.config):
            for attr in ("pad_token_id", "eos_token_id"):
                value = getattr(source, attr, None)
                value = value[0] if isinstance(value, (list, tuple)) and value else value
                if isinstance(value, int) and 0 <= value < self.cfg.vocab_size:
                    return value
        return 0

    def to_str_tokens(self, tokens) -> list[str] | list[list[str]]:
        """Token strings of text, of ids ``(p,)`` or of a batch ``(b, p)`` (a list per sequence)."""
        if isinstance(tokens, Mapping):
            tokens = tokens["input_ids"]
        if isinstance(tokens, str):
            tokens = self.to_tokens(tokens)["input_ids"][0]
        ids = torch.as_tensor(tokens)
        if ids.ndim == 2:
            return [self.to_str_tokens(row) for row in ids]
        if self.tokenizer is None:
            return [str(int(i)) for i in ids]
        return self.tokenizer.convert_ids_to_tokens(ids.tolist())

    def _inputs(self, inputs, attention_mask=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return check_inputs(inputs, attention_mask, self.cfg.vocab_size, self.cfg.max_positions, self.device,
                            self.to_tokens if self.tokenizer is not None else None)

    # -- running ---------------------------------------------------------------------------------------
    def __call__(self, inputs, attention_mask=None, **kwargs):
        """Run the HF model. With padding, a causal model gets ``position_ids = cumsum(mask) - 1`` (as HF's
        ``generate`` does), so that each left-padded row is computed exactly as if it ran alone; pass
        ``position_ids`` to override."""
        self._check_attached()
        ids, mask = self._inputs(inputs, attention_mask)
        if self.cfg.causal:
            kwargs.setdefault("use_cache", False)  # analysis needs no KV cache, and hooks must not edit one
            if mask is not None and self._takes_position_ids and "position_ids" not in kwargs and not bool(mask.all()):
                kwargs["position_ids"] = padded_positions(mask)
        return self.hf(input_ids=ids, attention_mask=mask, **kwargs)

    forward = __call__

    def run_with_hooks(self, inputs, attention_mask=None, fwd_hooks: Iterable = (), **kwargs):
        with self.hooks(fwd_hooks):
            return self(inputs, attention_mask, **kwargs)

    def default_cache_names(self) -> list[str]:
        """What ``run_with_cache`` captures by default: all but opt-in points and, on flash, eager-only ones."""
        return [n for n in self.hook_names()
                if not spec_for(n).opt_in and not (self.attn == "flash" and spec_for(n).eager_only)]

    def run_with_cache(self, inputs, attention_mask=None, names: NameFilter | None = None, detach: bool = True,
                       fwd_hooks: Iterable = (), device=None, **kwargs) -> tuple[object, ActivationCache]:
        """Run once and capture activations (references, not copies) into an ActivationCache. ``fwd_hooks`` are
        active during the run and fire before the capture, so the cache holds what they return. Each tensor stays
        on its layer's device (a model split by ``device_map``), or with ``device`` is moved there as it is
        captured (gathered on one device; ``cache.to(device)`` does it afterwards)."""
        ids, mask = self._inputs(inputs, attention_mask)
        selected = self.default_cache_names() if names is None else [p.name for p in self._registry.resolve(names)]
        store: dict[str, torch.Tensor] = {}

        def save(tensor, hook):
            tensor = tensor.detach() if detach else tensor
            store[hook.name] = tensor if device is None else tensor.to(device)

        with self.hooks([*fwd_hooks, (selected, save)]):
            output = self(ids, mask, **kwargs)
        order = {n: i for i, n in enumerate(self.hook_names())}
        store = dict(sorted(store.items(), key=lambda kv: order[kv[0]]))
        cache = ActivationCache(store, self.attention_meta(mask))
        return output, cache if device is None else cache.to(device)

    def attention_meta(self, attention_mask: torch.Tensor | None = None) -> AttentionMeta:
        """What rebuilding this model's patterns from q and k needs: per layer the scale, the window of keys,
        the soft-cap and the sink logits (their values now), and the padding of the run."""
        layers = self.structure.layer_attn
        with onloaded(*(self._blocks[l] for l, a in enumerate(layers) if a.sinks is not None)):
            sinks = {l: self._blocks[l].get_parameter(a.sinks).detach().float().clone()
                     for l, a in enumerate(layers) if a.sinks is not None}
        return AttentionMeta(
            list(self.attn_scales), self.cfg.causal, self.cfg.n_heads, self.cfg.n_kv_heads,
            None if attention_mask is None or bool(attention_mask.all()) else attention_mask,
            heads_per_layer=self.cfg.heads_per_layer, kv_heads_per_layer=self.cfg.kv_heads_per_layer,
            windows=[a.window for a in layers], softcaps=[a.softcap for a in layers], sinks=sinks,
        )

    def save_pretrained(self, folder) -> Path:
        """Save the HF model and its tokenizer into ``folder`` (``interp.load_model(folder)`` loads it back,
        pruned heads included). Files get the usual permissions (read for all, as the umask allows), not the
        owner-only mode that transformers' temporary-file writes leave on the weights."""
        folder = Path(folder)
        if self.cfg.pruned:
            save_pruned(self.hf, folder)
        else:
            self.hf.save_pretrained(folder)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(folder)
        fix_permissions(folder)
        return folder

    # -- description -----------------------------------------------------------------------------------
    def summary(self) -> dict:
        return {
            "class": type(self.hf).__name__,
            **{k: v for k, v in asdict(self.cfg).items() if k != "sites"},
            "sites": [site.name for site in self.cfg.sites],
            "attn": self.attn,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "n_params": sum(p.numel() for p in self.hf.parameters()),
            "tokenizer": type(self.tokenizer).__name__ if self.tokenizer is not None else None,
        }

    def __repr__(self) -> str:
        c = self.cfg
        heads = f"{c.n_heads} heads ({c.n_kv_heads} kv)"
        if c.pruned:
            heads = f"pruned heads {list(c.heads_per_layer)} ({list(c.kv_heads_per_layer)} kv)"
        return (f"HookedModel({type(self.hf).__name__}: {c.n_layers} layers x {heads}, d_model {c.d_model}, "
                f"attn={self.attn!r})")


def spec_name(layer: int, kind: str) -> str:
    """Concrete name of a per-layer module-level point, e.g. (3, "resid_pre") -> blocks.3.hook_resid_pre."""
    return f"blocks.{layer}.attn.hook_{kind}" if kind == "result" else f"blocks.{layer}.hook_{kind}"
