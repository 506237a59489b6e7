"""HookedModel: a HuggingFace model whose attention step is ours, with named hook points."""

from __future__ import annotations

import copy
import inspect
import os
from pathlib import Path
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from einops import rearrange
from transformers.pytorch_utils import Conv1D

from hooks import HOOK_TABLE, ActivationCache, AttentionMeta, HookPoint, HookRegistry, NameFilter, spec_for

from .attention import ATTN_KEYS, LayerHooks, attach_layer_hooks, attached_layer_hooks
from .families import Family, check_supported
from .pruning import check_head_counts, head_counts, kept_heads

__all__ = ["HookedModel", "ModelConfig", "fix_permissions", "pad_ids", "padded_positions", "tokenize"]

_ATTN_KINDS = ("q", "k", "v", "attn_scores", "pattern", "z", "lse")
_MODULE_KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "result")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a hooked model. ``n_heads``/``n_kv_heads`` are the HF config's values; a pruned model
    (``analyses.prune_model``) has fewer heads in some layers: ``heads_per_layer``/``kv_heads_per_layer``
    hold every layer's own counts as the weights hold them (empty tuples mean ``n_heads``/``n_kv_heads`` in every
    layer). A layer that lost every head keeps one zeroed placeholder head so that transformers can run it;
    such layers are listed in ``empty_layers`` and their placeholder is not a head in any analysis."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    causal: bool
    max_positions: int
    vocab_size: int
    family: str
    heads_per_layer: tuple[int, ...] = ()
    kv_heads_per_layer: tuple[int, ...] = ()
    empty_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.heads_per_layer:
            object.__setattr__(self, "heads_per_layer", (self.n_heads,) * self.n_layers)
        if not self.kv_heads_per_layer:
            object.__setattr__(self, "kv_heads_per_layer", (self.n_kv_heads,) * self.n_layers)
        if len(self.heads_per_layer) != self.n_layers or len(self.kv_heads_per_layer) != self.n_layers:
            raise ValueError(f"heads_per_layer and kv_heads_per_layer need {self.n_layers} entries; got "
                             f"{self.heads_per_layer} and {self.kv_heads_per_layer}.")

    @property
    def pruned(self) -> bool:
        return bool(self.empty_layers) or any(h != self.n_heads for h in self.heads_per_layer)

    def heads(self) -> list[tuple[int, int]]:
        """Every real ``(layer, head)``, layer by layer; an emptied layer's placeholder is not one."""
        return [(l, h) for l, n in enumerate(self.heads_per_layer) if l not in self.empty_layers for h in range(n)]


def _config_of(hf, family: Family) -> ModelConfig:
    c = hf.config
    n_heads = c.num_attention_heads
    heads_per_layer, kv_heads_per_layer = head_counts(c)
    return ModelConfig(
        n_layers=c.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=getattr(c, "num_key_value_heads", None) or n_heads,
        d_head=getattr(c, "head_dim", None) or c.hidden_size // n_heads,
        d_model=c.hidden_size,
        causal=family.causal,
        max_positions=c.max_position_embeddings,
        vocab_size=c.vocab_size,
        family=family.name,
        heads_per_layer=heads_per_layer,
        kv_heads_per_layer=kv_heads_per_layer,
        empty_layers=tuple(l for l, kept in kept_heads(c).items() if not kept),
    )


def _replace_first(output, fn):
    """Apply fn to a module's output tensor, or to the first element of a tuple output."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    return (fn(output[0]), *output[1:])


class HookedModel:
    """A HF model (``.hf``) with our attention, hook points and activation cache.

    ``model(input_ids, attention_mask=None)`` returns the HF model's own output. Inputs may be token ids
    ``(b, p)`` or ``(p,)``, the mapping ``to_tokens`` returns, or text (tokenized with ``to_tokens``).
    """

    def __init__(self, hf: torch.nn.Module, tokenizer=None, attn: str = "flash"):
        self.family = check_supported(hf.config)
        self.hf = hf
        self.tokenizer = tokenizer
        self.cfg = _config_of(hf, self.family)
        self._blocks = hf.base_model.get_submodule(self.family.layers)
        if len(self._blocks) != self.cfg.n_layers:
            raise ValueError(f"Expected {self.cfg.n_layers} blocks at {self.family.layers}; found {len(self._blocks)}.")
        check_head_counts(hf, self.family, self.cfg.heads_per_layer, self.cfg.d_head)
        self._attn_modules = [block.get_submodule(self.family.attn) for block in self._blocks]
        self.attn_scales = tuple(float(getattr(m, "scaling", self.cfg.d_head**-0.5)) for m in self._attn_modules)

        points = [HookPoint("hook_embed")]
        norm_input = self.family.resid_mid[1] == "input"
        for layer in range(self.cfg.n_layers):
            for spec in HOOK_TABLE:
                if spec.per_layer:
                    read_only = None
                    if spec.short == "resid_mid" and norm_input:
                        read_only = "on pre-LN models it is not a module output; edit hook_attn_out instead"
                    elif spec.short == "lse":
                        read_only = "it is derived from the scores; edit hook_attn_scores or hook_pattern instead"
                    points.append(HookPoint(spec.name(layer), layer, read_only))
        self._registry = HookRegistry(points, on_change=self._sync_module_hooks, check=self._check_points)
        self._torch_handles: dict[str, object] = {}
        self._takes_position_ids = "position_ids" in inspect.signature(hf.forward).parameters
        self._take_over()
        self._layer_hooks = []
        for layer, module in enumerate(self._attn_modules):
            lh = LayerHooks({k: self._registry[f"blocks.{layer}.attn.hook_{k}"] for k in _ATTN_KINDS}, owner=self)
            attach_layer_hooks(module, lh)
            self._layer_hooks.append(lh)
        self.attn: str | None = None
        self.set_attn(attn)

    def _take_over(self) -> None:
        """A HF model has one wrapper at a time: an earlier HookedModel on it loses its torch module hooks now
        (so that they never fire in this one's runs) and refuses to run from here on."""
        previous = attached_layer_hooks(self._attn_modules[0])
        owner = previous.owner() if previous is not None else None
        if owner is not None and owner is not self:
            owner._drop_torch_hooks()

    def _drop_torch_hooks(self) -> None:
        for handle in self._torch_handles.values():
            handle.remove()
        self._torch_handles.clear()

    # -- copies ----------------------------------------------------------------------------------------
    def __deepcopy__(self, memo) -> HookedModel:
        """A copy with its own HF model and its own hook points, holding the same hook functions."""
        clone = type(self)(copy.deepcopy(self.hf, memo), copy.deepcopy(self.tokenizer, memo), self.attn)
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

    def _check_attached(self) -> None:
        """Another HookedModel built on the same HF model takes over its attention hooks: refuse to run
        this one silently without them."""
        if not self._owns_hf():
            raise RuntimeError(
                "This HookedModel's HF model was wrapped again by a newer HookedModel (interp.load_model on the "
                "same instance), which now owns its hooks and attention path. Use the newer one, or wrap a copy: "
                "interp.load_model(copy.deepcopy(hf))."
            )

    def set_attn(self, attn: str) -> HookedModel:
        """Switch between the exact ``"eager"`` path and the fused ``"flash"`` path."""
        self._check_attached()
        if attn not in ATTN_KEYS:
            raise ValueError(f"attn must be 'eager' or 'flash'; got {attn!r}.")
        if attn == "flash":
            eager_only = [n for n in self._registry.active() if spec_for(n).eager_only]
            if eager_only:
                raise ValueError(f"Remove the hooks on {eager_only} before switching to the flash path (eager only).")
        key = ATTN_KEYS[attn]
        self.hf.set_attn_implementation(key)
        if self.hf.config._attn_implementation != key:
            raise RuntimeError(
                f"transformers did not take our attention function for {type(self.hf).__name__} "
                f"(config._attn_implementation is {self.hf.config._attn_implementation!r}); this class may not "
                "use the attention interface."
            )
        self.attn = attn
        self._probe()
        return self

    def _probe(self) -> None:
        """Run two tokens and check that our attention function really ran (HF may ignore the key)."""
        fired = []
        with self.studying(), self.hooks([("blocks.0.attn.hook_z", lambda z, hook: fired.append(hook.name))]):
            with torch.no_grad():
                self(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long))
        if not fired:
            raise RuntimeError(
                f"{type(self.hf).__name__} did not call interp's attention function; it does not dispatch through "
                "transformers' attention interface, so it is not supported."
            )

    # -- hooks -----------------------------------------------------------------------------------------
    def hook_names(self) -> list[str]:
        return self._registry.names()

    def _check_points(self, points: list[HookPoint]) -> None:
        if self.attn == "flash":
            bad = [p.name for p in points if spec_for(p.name).eager_only]
            if bad:
                raise ValueError(
                    f"{bad[0]} exists only on the eager path (the flash path never builds the n x n matrix). "
                    "Call model.set_attn('eager'), or capture q and k and use cache.pattern(layer, heads)."
                )

    @contextmanager
    def studying(self):
        """The state every analysis runs in, and restores.

        Inside: eval mode (no dropout, so a study is deterministic) and the global RNG untouched. On exit,
        also after an exception: every module's train/eval mode, every parameter's ``requires_grad`` and the
        hooks on every point are as they were before.
        """
        modes = [(m, m.training) for m in self.hf.modules()]
        requires = [(p, p.requires_grad) for p in self.hf.parameters()]
        hooks = {name: list(point.fns) for name, point in self._registry.points.items()}
        devices = sorted({p.device.index or 0 for p in self.hf.parameters() if p.device.type == "cuda"})
        try:
            with torch.random.fork_rng(devices=devices):
                self.hf.eval()
                yield self
        finally:
            for m, training in modes:
                m.training = training
            for p, flag in requires:
                p.requires_grad_(flag)
            if any(point.fns != hooks[name] for name, point in self._registry.points.items()):
                for name, point in self._registry.points.items():
                    point.fns[:] = hooks[name]
                self._sync_module_hooks()

    @contextmanager
    def hooks(self, fwd_hooks: Iterable[tuple[NameFilter, Callable]] = ()):
        """``with model.hooks([(name_or_filter, fn), ...]):`` hooks active inside the block only."""
        self._check_attached()
        with self._registry.hooks(fwd_hooks):
            yield self

    def reset_hooks(self) -> None:
        """Remove every hook added through this model."""
        self._registry.clear()

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
                          if self._registry[spec_name(layer, kind)])
        for key in list(self._torch_handles):
            if key not in wanted:
                self._torch_handles.pop(key).remove()
        for key in wanted - self._torch_handles.keys():
            self._torch_handles[key] = self._attach(key)

    def _attach(self, key: str):
        if key == "hook_embed":
            point = self._registry["hook_embed"]
            return self.hf.get_input_embeddings().register_forward_hook(lambda m, i, out: point(out))
        _, layer, kind = key.split(".")
        layer = int(layer)
        block, point = self._blocks[layer], self._registry[spec_name(layer, kind)]
        fam = self.family
        if kind == "resid_pre":
            def pre(module, args, kwargs):
                if args:
                    return (point(args[0]), *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": point(kwargs["hidden_states"])}
            return block.register_forward_pre_hook(pre, with_kwargs=True)
        if kind == "resid_mid" and fam.resid_mid[1] == "input":
            def observe(module, args):
                point(args[0])  # observe only: the block adds its residual from its own variable
            return block.get_submodule(fam.resid_mid[0]).register_forward_pre_hook(observe)
        if kind == "result":
            return block.get_submodule(fam.o_proj).register_forward_hook(self._result_hook(point))
        path = {"resid_post": "", "attn_out": fam.attn_out, "mlp_out": fam.mlp_out, "resid_mid": fam.resid_mid[0]}[kind]
        module = block.get_submodule(path) if path else block
        return module.register_forward_hook(lambda m, i, out: _replace_first(out, point))

    def _result_hook(self, point: HookPoint):
        """Replace the output projection by a per-head sum, so that an edit to hook_result reaches the model."""
        h, d = self.cfg.heads_per_layer[point.layer], self.cfg.d_head

        def hook(o_proj, args, out):
            z = rearrange(args[0], "b p (h d) -> b p h d", h=h, d=d)
            if isinstance(o_proj, Conv1D):
                w = rearrange(o_proj.weight, "(h d) m -> h d m", h=h)
            else:
                w = rearrange(o_proj.weight, "m (h d) -> h d m", h=h)
            result = torch.einsum("bphd,hdm->bphm", z, w)
            edited = point(result)
            if edited is result:  # observed only: keep the projection's own output, bit for bit
                return out
            summed = edited.sum(dim=2)
            return summed if o_proj.bias is None else summed + o_proj.bias

        return hook

    # -- inputs ----------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    def to_tokens(self, text: str | Sequence[str], max_length: int | None = None):
        """Tokenize text into ``{"input_ids": (b, p), "attention_mask": (b, p)}``, padded (left for causal
        models, right for encoders) and on the model's device."""
        if self.tokenizer is None:
            raise ValueError("This model has no tokenizer; pass token ids (b, p) instead of text.")
        texts = [text] if isinstance(text, str) else list(text)
        if not texts or any(not isinstance(t, str) for t in texts):
            raise ValueError(f"to_tokens takes a non-empty string or list of strings; got {text!r}.")
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
        if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and isinstance(inputs[0], str)):
            inputs = self.to_tokens(inputs)
        if isinstance(inputs, Mapping):
            attention_mask = inputs.get("attention_mask", attention_mask)
            inputs = inputs["input_ids"]
        ids = torch.as_tensor(inputs)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.is_floating_point():
            raise ValueError(f"input_ids must be integer token ids of shape (batch, pos); got {ids.dtype} {tuple(ids.shape)}.")
        if ids.numel() == 0:
            raise ValueError(f"Empty input: input_ids has shape {tuple(ids.shape)}; give at least one token.")
        if ids.shape[1] > self.cfg.max_positions:
            raise ValueError(
                f"Input has {ids.shape[1]} positions but this model takes at most {self.cfg.max_positions} "
                "(max_position_embeddings); truncate or split it."
            )
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"Token ids must lie in [0, {self.cfg.vocab_size}); got ids from {lo} to {hi}.")
        ids = ids.to(self.device)
        if attention_mask is not None:
            attention_mask = torch.as_tensor(attention_mask).to(self.device)
            if attention_mask.ndim == 1:
                attention_mask = attention_mask[None]
            if attention_mask.shape != ids.shape:
                raise ValueError(f"attention_mask must match input_ids {tuple(ids.shape)}; got {tuple(attention_mask.shape)}.")
            if bool((attention_mask.sum(-1) == 0).any()):
                raise ValueError("attention_mask has a row with no real token; every sequence needs at least one.")
        return ids, attention_mask

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
                       **kwargs) -> tuple[object, ActivationCache]:
        """Run once and capture activations (references, not copies) into an ActivationCache."""
        ids, mask = self._inputs(inputs, attention_mask)
        selected = self.default_cache_names() if names is None else [p.name for p in self._registry.resolve(names)]
        store: dict[str, torch.Tensor] = {}

        def save(tensor, hook):
            store[hook.name] = tensor.detach() if detach else tensor

        with self.hooks([(selected, save)]):
            output = self(ids, mask, **kwargs)
        order = {n: i for i, n in enumerate(self.hook_names())}
        store = dict(sorted(store.items(), key=lambda kv: order[kv[0]]))
        meta = AttentionMeta(list(self.attn_scales), self.cfg.causal, self.cfg.n_heads, self.cfg.n_kv_heads,
                             None if mask is None or bool(mask.all()) else mask,
                             heads_per_layer=self.cfg.heads_per_layer, kv_heads_per_layer=self.cfg.kv_heads_per_layer)
        return output, ActivationCache(store, meta)

    def save_pretrained(self, folder) -> Path:
        """Save the HF model and its tokenizer into ``folder`` (``interp.load_model(folder)`` loads it back,
        pruned heads included). Files get the usual permissions (read for all, as the umask allows), not the
        owner-only mode that transformers' temporary-file writes leave on the weights."""
        folder = Path(folder)
        self.hf.save_pretrained(folder)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(folder)
        fix_permissions(folder)
        return folder

    # -- description -----------------------------------------------------------------------------------
    def summary(self) -> dict:
        return {
            "class": type(self.hf).__name__,
            **asdict(self.cfg),
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


def padded_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids ``(b, p)`` that count only real tokens: ``cumsum(mask) - 1``, 0 on left padding."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def pad_ids(rows: Sequence[Sequence[int] | torch.Tensor], left: bool, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token-id sequences into ``input_ids: (b, p)`` and ``attention_mask: (b, p)``, padded on the left
    (causal models) or the right (encoders).

    >>> pad_ids([[5, 6, 7], [8]], left=True)
    (tensor([[5, 6, 7],
            [0, 0, 8]]), tensor([[1, 1, 1],
            [0, 0, 1]]))
    """
    rows = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in rows]
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(n - len(r), n) if left else slice(0, len(r))
        ids[i, span], mask[i, span] = r, 1
    return ids, mask


def tokenize(tokenizer, texts: list[str], max_length: int | None = None) -> list[list[int]]:
    """Token ids of each text, with the tokenizer's special tokens and no padding. The tokenizer's settings
    are not touched, and its warning about sequences longer than the model is silenced: inputs are checked
    against the model's positions where they are run, with an error that says what to do."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return tokenizer(list(texts), truncation=max_length is not None, max_length=max_length)["input_ids"]
    finally:
        hf_logging.set_verbosity(verbosity)


def fix_permissions(folder) -> None:
    """Give every file in ``folder`` the mode a new file gets under the process's umask (usually 0644)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in Path(folder).rglob("*"):
        if path.is_file():
            path.chmod(0o666 & ~umask)
