"""HookedModel: a HuggingFace model whose attention step is ours, with named hook points: one class for decoder-only,
encoder-only and encoder-decoder models.

What differs between kinds of model is data chosen once, when the wrapper is built (``interp.model.wrapper.Kind``): how
discovery finds the attention sites and hook points (``interp.model.layered`` for one site per layer, ``interp.model.seq2seq``
for encoder and decoder stacks with cross-attention), how a batch feeds the HF model, and what ``cache.pattern``
needs to rebuild a site's pattern. Everything else (hooks, copies, the attention path, caching) is keyed by site
and is the same code for every model.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path

import torch

from hooks import AttentionMeta, HookRegistry, NameFilter, spec_for

from ..attention.paths import LayerHooks, attach_layer_hooks, attached_layer_hooks
from ..attention.masks import window_aware
from ..structure.families import check_supported
from ..tokens.inputs import check_inputs, fix_permissions
from .layered import LAYERED
from .config import ModelRef, TLConfigFields
from ..structure.head_slicing import save_pruned
from ..lens.resid import ModelCache
from ..lens.tokens import _UNSET, TokensMixin, pad_mask
from ..lens.weights import WeightsMixin
from .seq2seq import SEQ2SEQ, decoder_inputs
from ..structure.layered import Structure
from .wrapper import _hand_back_when_dropped, _take_over, _Wrapper

__all__ = ["HookedModel"]

_ATTN_KINDS = ("q", "k", "v", "attn_scores", "pattern", "z", "lse")
_SETTINGS = ("return_type", "fold_ln", "use_attn_result")  # TransformerLens-style settings a copy keeps (interp.lens.tokens, tl_weights)
_ON_BUILD: list = []  # run on every new HookedModel: interp.streaming.model attaches the streaming heads a config records


class _Stop(Exception):
    """Raised by stop_at_layer's hook to end the forward early."""


def _encoder_decoder(hf) -> bool:
    return bool(getattr(getattr(hf, "config", None), "is_encoder_decoder", False)) and callable(
        getattr(hf, "get_encoder", None))


class HookedModel(TokensMixin, WeightsMixin, _Wrapper):
    """A HF model (``.hf``) with our attention, hook points and activation cache: the one public class for
    decoder-only, encoder-only and encoder-decoder models (``type(model) is HookedModel`` for every one).

    ``model(input_ids, attention_mask=None)`` returns the HF model's own output (``return_type="logits"`` ...:
    ``interp.lens.tokens``). Inputs may be token ids ``(b, p)`` or ``(p,)`` (``to_tokens``), the mapping
    ``to_batch`` returns, or text (tokenized with ``to_batch``). TransformerLens's surface (tokens, weights,
    ``generate``, the cache's residual decompositions): ``interp.lens.tokens``, ``interp.lens.weights``, ``interp.lens.resid``. The model
    is a list of attention sites (``model.cfg.sites``, ``interp.attention.sites``): one per layer (``blocks.{l}.attn``) in a
    decoder-only or encoder-only model; encoder, decoder and cross-attention sites in an encoder-decoder HF model
    (T5, BART, ...), which also takes ``decoder_input_ids`` (and ``decoder_attention_mask``), as keywords or in
    the batch mapping; ``model.decoder_inputs(labels)`` shifts targets right as the model was trained.
    """

    def __init__(self, hf: torch.nn.Module, tokenizer=None, attn: str = "flash", structure: Structure | None = None):
        self._kind = kind = SEQ2SEQ if _encoder_decoder(hf) else LAYERED
        check_supported(hf.config, seq2seq=kind.seq2seq)
        self.hf = hf
        self.tokenizer = tokenizer
        _take_over(hf)  # before the probe, so that an earlier wrapper's hooks cannot fire in it
        _hand_back_when_dropped(self)  # HF's own attention again once this wrapper is gone
        layout = kind.build(hf, structure)
        self.structure = layout.structure  # a layered model's (interp.structure.layered); None for an encoder-decoder
        self.stack_structure = layout.stacks  # an encoder-decoder's MLPs and norms (interp.structure.seq2seq); else None
        self.cfg = layout.cfg
        if isinstance(self.cfg, TLConfigFields):  # cfg.device, cfg.normalization_type ... read this model's settings
            object.__setattr__(self.cfg, "owner", ModelRef(self))
        self._blocks = layout.blocks  # the block list, or {stack: block list}
        self._site_modules = layout.modules  # site name -> attention module
        self._attn_modules = list(layout.modules.values())  # in site order: per layer where there is one site each
        self._weights = layout.weights
        self._norms = layout.norms  # "blocks.3.ln1" -> (norm module, the cached streams it reads)
        self._attach_at = layout.attach
        self.attn_scales = tuple(site.scale for site in self.cfg.sites)  # what the model passes, not module.scaling
        self.sites = {site.name: site for site in self.cfg.sites}
        self._registry = HookRegistry(layout.points, on_change=self._sync_module_hooks)
        for point in layout.points:  # hook_point.add_hook(fn), as TransformerLens, adds through this model
            point.owner = weakref.ref(self)
        self._torch_handles: dict[str, object] = {}
        self._takes_position_ids = "position_ids" in inspect.signature(hf.forward).parameters
        self._layer_hooks: dict[str, LayerHooks] = {}
        for site in self.cfg.sites:
            lh = LayerHooks({k: self._registry[f"{site.name}.hook_{k}"] for k in _ATTN_KINDS}, owner=self)
            lh.causal = site.causal  # what the probe found, not the module's is_causal flag
            lh.window = site.window[0] if site.causal and site.window is not None else None
            lh.softmax_fp32 = site.softmax_fp32  # as the family's own eager softmax
            attach_layer_hooks(self._site_modules[site.name], lh)
            self._layer_hooks[site.name] = lh
        if self.structure is not None:  # a layered model: each module's hooks know its window
            window_aware(hf)
        self.attn: str | None = None
        self.set_attn(attn)
        for build in _ON_BUILD:
            build(self)

    def _drop_torch_hooks(self) -> None:
        for handle in self._torch_handles.values():
            handle.remove()
        self._torch_handles.clear()

    # -- copies ----------------------------------------------------------------------------------------
    def __deepcopy__(self, memo) -> HookedModel:
        """A copy with its own HF model and its own hook points, holding the same hook functions."""
        clone = type(self)(copy.deepcopy(self.hf, memo), copy.deepcopy(self.tokenizer, memo), self.attn,
                           structure=getattr(self, "structure", None))
        clone._add_hooks(self._hook_functions())
        clone.__dict__.update({k: v for k, v in self.__dict__.items() if k in _SETTINGS})
        return clone

    def __getstate__(self) -> dict:
        return {"hf": self.hf, "tokenizer": self.tokenizer, "attn": self.attn, "hooks": self._hook_functions(),
                **{k: v for k, v in self.__dict__.items() if k in _SETTINGS}}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["hf"], state["tokenizer"], state["attn"])
        self._add_hooks(state["hooks"])
        self.__dict__.update({k: v for k, v in state.items() if k in _SETTINGS})

    def _hook_functions(self) -> dict[str, list]:
        return {name: list(point.fns) for name, point in self._registry.points.items() if point.fns}

    def _add_hooks(self, functions: dict[str, list]) -> None:
        for name, fns in functions.items():
            for fn in fns:
                self._registry.add(name, fn)

    # -- attention path --------------------------------------------------------------------------------
    def _owns_hf(self) -> bool:
        first = self.cfg.sites[0].name
        return attached_layer_hooks(self._site_modules[first]) is self._layer_hooks[first]

    def set_attn(self, attn: str) -> HookedModel:
        """Switch every site between the exact ``"eager"`` path and the fused ``"flash"`` path."""
        self._switch_attn(attn)
        self._probe()  # the config's record of the key is not proof (composite models keep one per sub-config)
        return self

    def _probe(self) -> None:
        """Run two tokens and check that our attention function really ran in every site (HF may ignore the key)."""
        fired = set()
        with self.studying(), self.hooks([(lambda n: n.endswith(".hook_z"), lambda z, hook: fired.add(hook.name))]):
            with torch.no_grad():
                self(**self._kind.probe_batch(self))
        if not fired:
            raise NotImplementedError(
                f"{type(self.hf).__name__} did not call interp's attention function; it does not dispatch through "
                "transformers' attention interface, so it is not supported."
            )
        missing = [s for s in self.sites if f"{s}.hook_z" not in fired]
        if missing:
            raise NotImplementedError(f"{type(self.hf).__name__}: {missing} did not call interp's attention function.")

    # -- hooks -----------------------------------------------------------------------------------------
    def _sync_module_hooks(self) -> None:
        """Attach a torch hook where a module-level point has listeners; detach it where none are left."""
        for lh in self._layer_hooks.values():
            lh.refresh()
        if not self._owns_hf():  # taken over by a newer wrapper: never put hooks on its modules again
            self._drop_torch_hooks()
            return
        self._keep_handles({name for name in self._attach_at if self._registry.points[name]})

    def _attach(self, name: str):
        return self._attach_at[name](self._registry[name])

    def o_proj_of(self, site) -> torch.nn.Module | None:
        """The linear map that reads ``site``'s z, or None."""
        return None if site.o_proj is None else self._weights[site.name][0].get_submodule(site.o_proj)

    def projections_of(self, site):
        """``(module, Projections or the reason there are none)``: where the site's heads sit in its q/k/v weights,
        paths relative to ``module`` (the block of a layered model, the attention module of an encoder-decoder)."""
        module, projections, _ = self._weights[site.name]
        return module, projections

    def in_norm_of(self, site) -> torch.nn.Module | None:
        """The norm whose output the site's queries are computed from, or None."""
        return self._weights[site.name][2]

    # -- inputs ----------------------------------------------------------------------------------------
    @property
    def pad_token_id(self) -> int:
        """The id put on padded positions (masked out, so any id works): the tokenizer's or config's pad, else
        its end-of-sequence token (not for an encoder-decoder model), else 0."""
        for source in (self.tokenizer, self.hf.config):
            for attr in self._kind.pad_attrs:  # an encoder-decoder model: its pad token only
                value = getattr(source, attr, None)
                value = value[0] if isinstance(value, (list, tuple)) and value else value
                if isinstance(value, int) and 0 <= value < self.cfg.vocab_size:
                    return value
        return 0

    def _inputs(self, inputs, attention_mask=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids, mask = self._ids(inputs, attention_mask, "input_ids")
        if mask is None and self.tokenizer is not None and not isinstance(inputs, (Mapping, str)):
            mask = pad_mask(ids, self.tokenizer)  # a bare tensor from to_tokens: its dedicated pad tokens (tl_tokens)
        return ids, mask

    def _ids(self, inputs, mask, what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return check_inputs(inputs, mask, self.cfg.vocab_size, self.cfg.max_positions, self.device,
                            self.to_batch if self.tokenizer is not None else None, what=what)

    def decoder_inputs(self, labels: torch.Tensor) -> torch.Tensor:
        """An encoder-decoder model's target ids ``(b, t)`` shifted right behind the decoder start token, as the
        model was trained (teacher forcing): the ``decoder_input_ids`` to run with (``interp.model.seq2seq``)."""
        return decoder_inputs(self, labels)

    # -- running ---------------------------------------------------------------------------------------
    def __call__(self, inputs, attention_mask=None, return_type=_UNSET, loss_per_token: bool = False, **kwargs):
        """Run the HF model on a batch fed as its kind takes it (``interp.model.layered``: with padding, a causal model
        gets ``position_ids = cumsum(mask) - 1`` as HF's ``generate`` does, so that each left-padded row is
        computed exactly as if it ran alone; pass ``position_ids`` to override. ``interp.model.seq2seq``: plus
        ``decoder_input_ids`` and ``decoder_attention_mask``). ``return_type``: "output" (the HF output; the
        default unless ``model.return_type`` says otherwise), "logits", "loss", "both" or None, as TransformerLens
        (``interp.lens.tokens``)."""
        self._check_attached()
        stop = kwargs.pop("stop_at_layer", None)
        inputs = self._text_kwargs(inputs, kwargs)
        batch, _ = self._kind.feed(self, inputs, attention_mask, kwargs)
        if stop is not None:
            return self._stopped(batch, stop)
        return self._returned(self.hf(**batch), batch, return_type, loss_per_token)

    def _stopped(self, batch, stop: int) -> torch.Tensor:
        """TransformerLens's ``stop_at_layer``: the residual stream entering block ``stop`` (negative: counted from
        the end; ``n_layers``: after the last block, before the final norm), the blocks after it not run."""
        n = None if self._kind.seq2seq else self.cfg.n_layers
        if n is None or isinstance(stop, bool) or not isinstance(stop, int) or not -n <= stop <= n:
            raise ValueError(f"stop_at_layer takes a layer in [-{n}, {n}] of a model with one stack of blocks; "
                             f"got {stop!r}.")
        stop = stop + n if stop < 0 else stop
        name = f"blocks.{stop}.hook_resid_pre" if stop < n else f"blocks.{n - 1}.hook_resid_post"
        seen = {}

        def catch(x, hook):
            seen["x"] = x
            raise _Stop

        try:
            with self.hooks([(name, catch)]):
                self.hf(**batch)
        except _Stop:
            pass
        return seen["x"]

    forward = __call__

    def run_with_hooks(self, inputs, attention_mask=None, fwd_hooks: Iterable = (), **kwargs):
        kwargs.pop("reset_hooks_end", None), kwargs.pop("clear_contexts", None), kwargs.pop("bwd_hooks", None)
        with self.hooks(fwd_hooks):
            return self(inputs, attention_mask, **kwargs)

    def default_cache_names(self) -> list[str]:
        """What ``run_with_cache`` captures by default: all but opt-in points and, on flash, eager-only ones."""
        wanted = ("hook_result",) if getattr(self, "use_attn_result", False) else ()
        return [n for n in self.hook_names() if (not spec_for(n).opt_in or n.endswith(wanted))
                and not (self.attn == "flash" and spec_for(n).eager_only)]

    # -- TransformerLens's switches ---------------------------------------------------------------------------
    def set_use_attn_result(self, use: bool) -> None:
        """TransformerLens's switch: with True, ``run_with_cache`` captures ``hook_result`` by default (it always
        exists here, opt-in to the cache because it is ``(b, p, h, m)``)."""
        if use and not any(n.endswith("hook_result") for n in self.hook_names()):
            raise NotImplementedError(f"{type(self.hf).__name__}: interp found no output projection per head, so "
                                      "there is no hook_result to capture.")
        self.use_attn_result = bool(use)

    def set_use_hook_mlp_in(self, use: bool) -> None:
        """A no-op: TransformerLens's ``hook_mlp_in`` is the stream the MLP reads, ``blocks.{l}.hook_resid_mid``
        here, always present; refused for parallel blocks, where the MLP reads ``hook_resid_pre``."""
        if use and self.cfg.block == "parallel":
            raise NotImplementedError("Parallel blocks: the MLP reads blocks.{l}.hook_resid_pre, which has no "
                                      "separate copy to hook; use that.")

    def set_use_split_qkv_input(self, use: bool) -> None:
        """Refused with True: interp has no per-head copies of the q/k/v inputs (TransformerLens's
        ``hook_q_input``...); edit ``hook_q``/``hook_k``/``hook_v`` or ``blocks.{l}.hook_resid_pre`` instead."""
        if use:
            raise NotImplementedError("interp has no hook_q_input/hook_k_input/hook_v_input: patch hook_q, hook_k "
                                      "or hook_v per head, or blocks.{l}.hook_resid_pre for all three.")

    def run_with_cache(self, inputs, attention_mask=None, names: NameFilter | None = None, detach: bool = True,
                       fwd_hooks: Iterable = (), device=None, return_type=_UNSET, remove_batch_dim: bool = False,
                       names_filter: NameFilter | None = None, **kwargs) -> tuple[object, ModelCache]:
        """Run once and capture activations (references, not copies) into an ActivationCache. ``fwd_hooks`` are
        active during the run and fire before the capture, so the cache holds what they return. Each tensor stays
        on its layer's device (a model split by ``device_map``), or with ``device`` is moved there as it is
        captured (gathered on one device; ``cache.to(device)`` does it afterwards). ``cache.pattern(site or
        layer, heads)`` rebuilds any site's pattern on the flash path (position bias and masks as the run had
        them). TransformerLens's ``return_type``, ``remove_batch_dim`` and ``names_filter`` (``names``) are taken;
        the cache has its residual-stream methods (``interp.lens.resid``)."""
        self._check_attached()
        names = names_filter if names is None else names
        loss_per_token = kwargs.pop("loss_per_token", False)
        stop = kwargs.pop("stop_at_layer", None)
        inputs = self._text_kwargs(inputs, kwargs)
        batch, masks = self._kind.feed(self, inputs, attention_mask, kwargs)
        selected = self.default_cache_names() if names is None else [p.name for p in self._registry.resolve(names)]
        store: dict[str, torch.Tensor] = {}
        biases: dict[str, torch.Tensor | None] = {}

        def save(tensor, hook):
            tensor = tensor.detach() if detach else tensor
            store[hook.name] = tensor if device is None else tensor.to(device)

        def bias(tensor, hook):  # the attention function has just stored this call's position bias
            b = self._layer_hooks[hook.name.rsplit(".", 1)[0]].bias
            biases[hook.name.rsplit(".", 1)[0]] = None if b is None else b.detach()

        capture = [(lambda n: n.endswith(".hook_q"), bias)] if self._kind.position_bias else []
        fwd_hooks = list(fwd_hooks)
        self._say_differences([*fwd_hooks, *([(names, save)] if names is not None else [])])  # what the user named
        with self._registry.hooks([*fwd_hooks, (selected, save), *capture]):
            output = self.hf(**batch) if stop is None else self._stopped(batch, stop)
        order = {n: i for i, n in enumerate(self.hook_names())}
        store = dict(sorted(store.items(), key=lambda kv: order[kv[0]]))
        cache = ModelCache(store, self._kind.meta(self, masks, biases), self)
        cache = cache if device is None else cache.to(device)
        if remove_batch_dim:
            cache.remove_batch_dim()
        if stop is not None:  # TransformerLens: the stream entering that block, and what ran before it
            return output, cache
        return self._returned(output, batch, return_type, loss_per_token), cache

    def attention_meta(self, attention_mask: torch.Tensor | None = None) -> AttentionMeta:
        """What rebuilding this model's patterns from q and k needs: per site the scale, the window of keys,
        the soft-cap and the sink logits (their values now), and the padding of the run."""
        return self._kind.meta(self, {"attention_mask": attention_mask}, {})

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
            **{k: v for k, v in asdict(self.cfg).items() if k not in ("sites", "owner")},
            "sites": [site.name for site in self.cfg.sites],
            "attn": self.attn,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "n_params": sum(p.numel() for p in self.hf.parameters()),
            "tokenizer": type(self.tokenizer).__name__ if self.tokenizer is not None else None,
        }

    def __repr__(self) -> str:
        return (f"HookedModel({type(self.hf).__name__}: {self._kind.shape(self.cfg)}, d_model {self.cfg.d_model}, "
                f"attn={self.attn!r})")
