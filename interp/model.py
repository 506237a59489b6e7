"""HookedModel: a HuggingFace model whose attention step is ours, with named hook points."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from einops import rearrange
from transformers.pytorch_utils import Conv1D

from hooks import HOOK_TABLE, ActivationCache, AttentionMeta, HookPoint, HookRegistry, NameFilter, spec_for

from .attention import LayerHooks, attach_layer_hooks, attached_layer_hooks
from .config import ModelConfig, _config_of, _site  # noqa: F401  (their home before)
from .distributed import onloaded
from .families import check_supported
from .inputs import check_inputs, fix_permissions, pad_ids, padded_positions, texts_of, tokenize
from .pruning import check_head_counts, save_pruned
from .structure import Structure, discover
from .wrapper import _Handles, _replace_first, _take_over, _Wrapper, studying  # noqa: F401  (their home before)

__all__ = ["HookedModel", "ModelConfig"]

_ATTN_KINDS = ("q", "k", "v", "attn_scores", "pattern", "z", "lse")
_MODULE_KINDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "result")


_ENCODER_DECODER: list[type] = []  # the encoder-decoder wrapper, registered by interp.seq2seq (no import cycle)
_ON_BUILD: list = []  # run on every new HookedModel: interp.streamed attaches the streaming heads a config records


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
        for build in _ON_BUILD:
            build(self)

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

    def o_proj_of(self, site) -> torch.nn.Module | None:
        """The linear map that reads ``site``'s z (its path is relative to the block here), or None."""
        return None if site.o_proj is None else self._blocks[site.block].get_submodule(site.o_proj)

    def projections_of(self, site):
        """``(module, Projections or the reason there are none)``: where the site's heads sit in its q/k/v weights,
        paths relative to ``module`` (the block here)."""
        return self._blocks[site.block], self.structure.projections[site.block]

    def in_norm_of(self, site) -> torch.nn.Module | None:
        """The norm whose output the site's attention reads, or None."""
        path = self.structure.attn_in_norm[site.block]
        return None if path is None else self._blocks[site.block].get_submodule(path)

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
