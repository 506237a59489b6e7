"""What the one model wrapper (``HookedModel``) shares with every kind of model: ``studying`` (the state an analysis
runs in, restored after), the hook context, the checks that our attention is the one that runs, ``_take_over`` (one
wrapper per HF model at a time), and the two records a kind of model fills in: ``Layout`` (what its discovery found)
and ``Kind`` (how a batch feeds it)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from hooks import HookPoint, NameFilter
from hooks.points import remove_at

from ..lens.differences import warn_tl_differences
from ..attention.paths import ATTN_KEYS, attached_layer_hooks, detach_layer_hooks
from ..runtime.distributed import input_device
from ..structure.probe import attention_keys, set_attention_key


@dataclass(frozen=True)
class Layout:
    """What discovery found in one HF model, in the form the wrapper keeps for every kind of model.

    cfg: the model's config (its ``sites``). structure: ``interp.structure.layered.Structure`` of a model with one site per
    layer, None for an encoder-decoder. blocks: the block list (``ModuleList``), or ``{stack: ModuleList}`` where
    there are several stacks. modules: site name -> the attention module that calls our attention function.
    weights: site name -> ``(module, Projections or why there are none, in-norm or None)``, where ``module`` is
    what the site's ``o_proj`` and projection paths are relative to. points: every HookPoint in hook-name order.
    attach: name of a point served by a torch hook on a module -> ``fn(point) -> handle``. stacks: an
    encoder-decoder model's MLPs and norms per stack (``interp.structure.seq2seq.Seq2SeqStructure``), else None.
    norms: where a norm reads the residual stream (``"blocks.3.ln1"``, ``"encoder.ln_final"``) -> (the norm module,
    the hook names of the cached streams whose sum is its input), each with ``{where}.hook_scale``/``hook_normalized``.
    """

    cfg: object
    structure: object
    blocks: object
    modules: dict
    weights: dict
    points: list
    attach: dict
    stacks: object = None
    norms: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Kind:
    """What differs between kinds of model (decoder-/encoder-only: ``interp.model.layered``; encoder-decoder:
    ``interp.model.seq2seq``), chosen once when the wrapper is built.

    build: ``(hf, structure or None) -> Layout``. feed: ``(model, inputs, attention_mask, kwargs) -> (the HF
    model's keyword arguments, {mask name: mask})``. probe_batch: ``model -> kwargs`` of a two-token run.
    meta: ``(model, masks, biases) -> AttentionMeta`` for ``cache.pattern``. shape: ``cfg -> "2 layers x 4 heads"``.
    seq2seq: what ``check_supported`` checks. position_bias: capture each site's position bias for the cache
    (T5). pad_attrs: the tokenizer/config attributes a padding id is taken from, in order.
    """

    build: Callable
    feed: Callable
    probe_batch: Callable
    meta: Callable
    shape: Callable
    seq2seq: bool = False
    position_bias: bool = False
    pad_attrs: tuple[str, ...] = ("pad_token_id", "eos_token_id")


class HookNames(list):
    """A model's hook names: a list, and callable (``model.hook_names()``, the spelling before) for the same list."""

    def __call__(self) -> HookNames:
        return self


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


_ORIGINAL_ATTN = "_interp_original_attention"  # on the HF model: its implementations before its first wrapper


def _hand_back_when_dropped(model) -> None:
    """When ``model`` (a HookedModel) is garbage-collected, its HF model gets back the attention implementations
    it had before its first wrapper and loses our layer hooks, unless a newer wrapper holds it then (nothing of
    the wrapper is kept alive: the layer hooks know their owner by a weak reference)."""
    hf = model.hf
    hf.__dict__.setdefault(_ORIGINAL_ATTN, [key for _, key in attention_keys(hf)])
    weakref.finalize(model, _hand_back, hf).atexit = False


def _hand_back(hf: torch.nn.Module) -> None:
    attached = [(m, attached_layer_hooks(m)) for m in hf.modules()]
    if any(hooks is not None and hooks.owner() is not None for _, hooks in attached):
        return  # a living wrapper holds it
    for module, hooks in attached:
        if hooks is not None:
            detach_layer_hooks(module)
    keys = hf.__dict__.pop(_ORIGINAL_ATTN, None) or []
    for (holder, found), key in zip(attention_keys(hf), keys):
        if found != key:
            holder.set_attn_implementation(key)


@contextmanager
def studying(model):
    """``model.studying()`` of a HookedModel (it keeps ``hf``, ``_registry`` and ``_sync_module_hooks``): eval mode and the global RNG untouched inside; every module's mode, every parameter's
    ``requires_grad`` and the hooks on every point restored on exit, also after an exception."""
    hf, registry = model.hf, model._registry
    modes = [(m, m.training) for m in hf.modules()]
    # by name: accelerate replaces an offloaded weight's Parameter object each time it loads it
    requires = [(name, p.requires_grad) for name, p in hf.named_parameters()]
    hooks = {name: list(point.fns) for name, point in registry.points.items()}
    devices = sorted({p.device.index or 0 for p in hf.parameters() if p.device.type == "cuda"})
    return_type = model.__dict__.get("return_type")  # studies read the HF output, whatever the user's default
    model.__dict__["return_type"] = "output"
    try:
        with torch.random.fork_rng(devices=devices):
            hf.eval()
            yield model
    finally:
        if return_type is None:
            model.__dict__.pop("return_type", None)
        else:
            model.__dict__["return_type"] = return_type
        for m, training in modes:
            m.training = training
        for name, flag in requires:
            hf.get_parameter(name).requires_grad_(flag)
        if any(point.fns != hooks[name] for name, point in registry.points.items()):
            for name, point in registry.points.items():
                point.fns[:] = hooks[name]
            model._sync_module_hooks()


class _Wrapper:
    """What ``HookedModel`` does with its hook registry (``_registry``) and torch hook handles (``_torch_handles``,
    made by ``_attach``), whatever the kind of model."""

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
        fwd_hooks = list(fwd_hooks)
        self._say_differences(fwd_hooks)
        with self._registry.hooks(fwd_hooks):
            yield self

    def _say_differences(self, pairs) -> None:
        """The first time a TransformerLens user (``HookedTransformer.from_pretrained``) hooks a point whose content
        differs from TransformerLens's, say so (``interp.lens.differences``); bad filters are left to the registry."""
        if self.__dict__.get("tl_differences") is None:
            return
        names = []
        for pair in pairs:
            try:
                names += [p.name for p in self._registry.resolve(pair[0])]
            except (TypeError, ValueError, IndexError, KeyError):
                continue
        warn_tl_differences(self, names)

    def reset_hooks(self, including_permanent: bool = False, **_tl_options) -> None:
        """Remove every hook added through this model (TransformerLens's ``reset_hooks``: hooks added with
        ``add_hook(..., is_permanent=True)`` stay unless ``including_permanent``)."""
        permanent = [] if including_permanent else self.__dict__.get("_permanent", [])
        kept = [(h.point, h.fn) for h in permanent if any(f is h.fn for f in h.point.fns)]
        self._registry.clear()
        for point, fn in kept:
            point.fns.append(fn)
        self.__dict__["_permanent"] = [h for h in permanent if any(h.point is p and h.fn is f for p, f in kept)]
        self._sync_module_hooks()

    def _remove_hooks_at(self, point: HookPoint, including_permanent: bool = False) -> None:
        """``hook_point.remove_hooks()`` (TransformerLens's): that point's hooks, permanent ones kept unless asked."""
        remove_at(point, self.__dict__.get("_permanent", []), including_permanent)
        self._sync_module_hooks()

    @property
    def device(self) -> torch.device:
        """Where inputs go: the input embedding's device (with a device map, its execution device)."""
        return input_device(self.hf)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    @property
    def hook_names(self) -> HookNames:
        """Every hook name in firing order: a list (``len(model.hook_names)``, ``for name in model.hook_names``),
        still callable as before (``model.hook_names()``)."""
        return HookNames(self._registry.names())

    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        """TransformerLens's ``hook_dict``: hook name -> its HookPoint."""
        return dict(self._registry.points)

    def add_hook(self, name: NameFilter, hook: Callable, dir: str = "fwd", is_permanent: bool = False) -> list:  # noqa: A002
        """Add ``hook(tensor, hook_point)`` on a name, a list of names or a name predicate until removed (the handles
        returned, ``reset_hooks``); TransformerLens's ``add_hook``. A permanent hook outlives ``reset_hooks()``."""
        if dir != "fwd":
            raise ValueError(f"interp's hooks are forward hooks (dir='fwd'); got dir={dir!r}. For gradients use "
                             "torch.autograd on the tensors a hook sees.")
        self._say_differences([(name, hook)])
        handles = self._registry.add(name, hook)
        if is_permanent:
            self.__dict__.setdefault("_permanent", []).extend(handles)
        return handles

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
        if holders is None:  # the model and each sub-model with a config of its own that took our key
            holders = self.__dict__["_attn_holders"] = [m for m, found in attention_keys(self.hf) if found == key]
        for holder in holders:
            found = holder.config._attn_implementation
            if found != key:
                raise RuntimeError(
                    f"The HF model's attention implementation is {found!r}, not interp's {key!r}: it was switched "
                    f"behind the wrapper (model.hf.set_attn_implementation), so interp's attention, hooks, caches "
                    f"and studies would not run. Call model.set_attn({self.attn!r}) (or 'eager'/'flash') to switch "
                    "back; for HF's own attention, load a separate copy of the model.")

    def _switch_attn(self, attn: str) -> None:
        """Set the attention implementation of the HF model to our eager or flash path (on flash, a layer with a
        hook on its scores or pattern runs eager for that call); the caller checks that every attention calls it."""
        self._check_attached(key=False)  # switching back from an implementation set behind the wrapper is the fix
        if attn not in ATTN_KEYS:
            raise ValueError(f"attn must be 'eager' or 'flash'; got {attn!r}.")
        set_attention_key(self.hf, ATTN_KEYS[attn])
        # the holders whose attention is ours now: a sub-model that refuses a dynamic switch (GOT-OCR2's vision
        # tower, which does not use the attention interface) keeps its own and is not ours to watch
        self.__dict__["_attn_holders"] = [m for m, found in attention_keys(self.hf) if found == ATTN_KEYS[attn]]
        self.attn = attn

    def _keep_handles(self, wanted: set[str]) -> None:
        """Torch hooks exactly on the keys in ``wanted``: remove the others, attach the missing ones."""
        for key in list(self._torch_handles):
            if key not in wanted:
                self._torch_handles.pop(key).remove()
        for key in wanted - self._torch_handles.keys():
            self._torch_handles[key] = self._attach(key)
