"""Encoder-decoder models (T5, BART, mBART, Marian, ...): our attention in both stacks and in cross-attention.

Three kinds of attention run in an encoder-decoder model, each with its own hook prefix:

- ``encoder.blocks.{l}.attn``: bidirectional self-attention over the source;
- ``decoder.blocks.{l}.attn``: causal self-attention over the target;
- ``decoder.blocks.{l}.cross_attn``: queries from the decoder, keys and values from the encoder's output
  (q length = target length, k length = source length).

Each prefix carries the attention hooks of the hook table (``hook_q``, ``hook_k``, ``hook_v``, ``hook_z``,
``hook_lse``; ``hook_attn_scores`` and ``hook_pattern`` on the eager path) and each block the residual hooks
``hook_resid_pre``/``hook_resid_post`` and ``hook_attn_out`` (decoder blocks also ``hook_cross_attn_out``).
T5's relative position bias is added to the scores before the mask, as HF does; on the flash path it is
folded into the additive mask, so the kernel's logsumexp is that of the biased scores.

Where is what: found by one probe forward (``interp.seq2seq_structure``), as for decoder-only models: every attention
call is recorded with its module, and the source and target lengths differ in the probe, so a call whose key
length is the source's and query length the target's is cross-attention.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from hooks import ActivationCache, HookPoint, HookRegistry, NameFilter, spec_for

from .attention import LayerHooks, attach_layer_hooks, attached_layer_hooks
from .families import check_supported
from .inputs import check_inputs, pad_ids, position_limit, texts_of, tokenize
from .model import _ENCODER_DECODER, HookedModel
from .pruning import CONFIG_KEY
from .seq2seq_structure import _discover
from .sites import Site
from .wrapper import _replace_first, _take_over

__all__ = ["Seq2SeqHookedModel", "Site"]

_ATTN_KINDS = ("q", "k", "v", "attn_scores", "pattern", "z", "lse")


@dataclass(frozen=True)
class Seq2SeqConfig:
    """Shape of an encoder-decoder model: its attention sites in call order (encoder, then decoder)."""

    n_encoder_layers: int
    n_decoder_layers: int
    d_model: int
    vocab_size: int
    family: str
    sites: tuple[Site, ...]
    causal: bool = False  # the encoder (and so the model's inputs) are bidirectional: pad on the right
    max_positions: int | None = None  # source and target each (None: relative positions, e.g. T5)

    def heads(self) -> list[tuple[str, int]]:
        """Every ``(site name, head)`` (the placeholder of a site that was pruned empty is not a head)."""
        return [(s.name, h) for s in self.sites if s.name not in self.empty_sites for h in range(s.n_heads)]

    @property
    def stacks(self) -> tuple[str, ...]:
        return ("encoder", "decoder")

    pruned: bool = False  # heads sliced out by analyses.prune_model (interp.pruning.slice_sites)
    empty_sites: tuple[str, ...] = ()  # sites pruned of every head: one zeroed placeholder head each


class Seq2SeqHookedModel(HookedModel):
    """An encoder-decoder HF model (``.hf``) with our attention in every site, hook points and a cache: what
    ``HookedModel(hf)`` and ``interp.load_model`` build for an encoder-decoder HF model.

    ``model(input_ids, attention_mask=None, decoder_input_ids=..., decoder_attention_mask=None)`` returns the
    HF model's output. ``decoder_input_ids`` is required (teacher forcing); ``model.decoder_inputs(labels)``
    shifts target ids right as the model was trained.
    """

    def __init__(self, hf: torch.nn.Module, tokenizer=None, attn: str = "flash"):
        check_supported(hf.config, seq2seq=True)
        self.hf, self.tokenizer = hf, tokenizer
        _take_over(hf)  # one wrapper at a time
        sites, enc_path, dec_path, modules, self._weights = _discover(hf)
        c = hf.config
        self.cfg = Seq2SeqConfig(
            n_encoder_layers=sum(s.stack == "encoder" for s in sites),
            n_decoder_layers=sum(s.stack == "decoder" and s.kind == "self" for s in sites),
            d_model=int(getattr(c, "d_model", None) or c.hidden_size), family=c.model_type,
            vocab_size=int(getattr(c, "vocab_size", None) or hf.get_input_embeddings().num_embeddings),
            sites=tuple(sites), max_positions=position_limit(c), pruned=bool(getattr(c, CONFIG_KEY, None)),
            empty_sites=tuple(name for name, kept in (getattr(c, CONFIG_KEY, None) or {}).items() if not kept))
        self.sites = {s.name: s for s in sites}
        self._modules = modules
        self._blocks = {"encoder": hf.get_encoder().get_submodule(enc_path),
                        "decoder": hf.get_decoder().get_submodule(dec_path)}
        points = []
        for stack in ("encoder", "decoder"):
            for block in range(len(self._blocks[stack])):
                points.append(HookPoint(f"{stack}.blocks.{block}.hook_resid_pre", block))
                for site in (s for s in sites if s.stack == stack and s.block == block):
                    for kind in _ATTN_KINDS:
                        read_only = ("it is derived from the scores; edit hook_attn_scores or hook_pattern instead"
                                     if kind == "lse" else None)
                        points.append(HookPoint(f"{site.name}.hook_{kind}", block, read_only))
                    points.append(HookPoint(self._out_name(site), block))
                points.append(HookPoint(f"{stack}.blocks.{block}.hook_resid_post", block))
        self._registry = HookRegistry(points, on_change=self._sync_module_hooks, check=self._check_points)
        self._torch_handles: dict[str, object] = {}
        self._layer_hooks = {}
        for site in sites:
            lh = LayerHooks({k: self._registry[f"{site.name}.hook_{k}"] for k in _ATTN_KINDS}, owner=self)
            lh.causal = site.causal
            attach_layer_hooks(modules[site.name], lh)
            self._layer_hooks[site.name] = lh
        self.attn: str | None = None
        self.set_attn(attn)

    @staticmethod
    def _out_name(site: Site) -> str:
        prefix = f"{site.stack}.blocks.{site.block}"
        return f"{prefix}.hook_cross_attn_out" if site.kind == "cross" else f"{prefix}.hook_attn_out"

    def _drop_torch_hooks(self) -> None:
        for handle in self._torch_handles.values():
            handle.remove()
        self._torch_handles.clear()

    def _owns_hf(self) -> bool:
        first = next(iter(self._layer_hooks))
        return attached_layer_hooks(self._modules[first]) is self._layer_hooks[first]

    def o_proj_of(self, site: Site) -> torch.nn.Module | None:
        """The linear map that reads ``site``'s z (its path is relative to the attention module here), or None."""
        return None if site.o_proj is None else self._modules[site.name].get_submodule(site.o_proj)

    def projections_of(self, site: Site):
        """``(module, Projections or the reason there are none)``: where the site's heads sit in its q/k/v weights,
        paths relative to ``module`` (the attention module here)."""
        return self._modules[site.name], self._weights[site.name][0]

    def in_norm_of(self, site: Site) -> torch.nn.Module | None:
        """The norm (in the site's block) whose output the site's queries read, or None."""
        return self._weights[site.name][1]

    # -- attention path --------------------------------------------------------------------------------
    def set_attn(self, attn: str) -> Seq2SeqHookedModel:
        """Switch every site between the exact ``"eager"`` path and the fused ``"flash"`` path."""
        self._switch_attn(attn)
        fired = set()
        with self.studying(), self.hooks([(lambda n: n.endswith("hook_z"), lambda z, hook: fired.add(hook.name))]):
            with torch.no_grad():
                one = torch.ones(1, 2, dtype=torch.long, device=self.device)
                self(one, decoder_input_ids=one)
        missing = [s for s in self.sites if f"{s}.hook_z" not in fired]
        if missing:
            raise NotImplementedError(f"{type(self.hf).__name__}: {missing} did not call interp's attention function.")
        return self

    # -- hooks -----------------------------------------------------------------------------------------
    def _sync_module_hooks(self) -> None:
        for lh in self._layer_hooks.values():
            lh.refresh()
        if not self._owns_hf():
            self._drop_torch_hooks()
            return
        wanted = {name for name in self._registry.active() if "resid" in name or name.endswith("_out")}
        self._keep_handles(wanted)

    def _attach(self, name: str):
        point = self._registry[name]
        stack, _, block, hook = name.split(".")
        module = self._blocks[stack][int(block)]
        if hook == "hook_resid_pre":
            def pre(m, args, kwargs):
                if args:
                    return (point(args[0]), *args[1:]), kwargs
                return args, {**kwargs, "hidden_states": point(kwargs["hidden_states"])}
            return module.register_forward_pre_hook(pre, with_kwargs=True)
        if hook in ("hook_attn_out", "hook_cross_attn_out"):
            site = self.sites[f"{stack}.blocks.{block}.{'cross_attn' if hook == 'hook_cross_attn_out' else 'attn'}"]
            attention = self._modules[site.name]
            module = attention.get_submodule(site.o_proj) if site.o_proj else attention
        return module.register_forward_hook(lambda m, i, out: _replace_first(out, point))

    # -- inputs ----------------------------------------------------------------------------------------
    @property
    def pad_token_id(self) -> int:
        for source in (self.tokenizer, self.hf.config):
            value = getattr(source, "pad_token_id", None)
            if isinstance(value, int) and 0 <= value < self.cfg.vocab_size:
                return value
        return 0

    def to_tokens(self, text: str | Sequence[str], max_length: int | None = None) -> dict:
        """Tokenize text into ``{"input_ids", "attention_mask"}``, padded on the right."""
        if self.tokenizer is None:
            raise ValueError("This model has no tokenizer; pass token ids (b, p) instead of text.")
        texts = texts_of(text)
        rows = tokenize(self.tokenizer, texts, max_length=max_length)
        ids, mask = pad_ids(rows, left=False, pad_id=self.pad_token_id)
        return {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}

    def decoder_inputs(self, labels: torch.Tensor) -> torch.Tensor:
        """Target ids shifted right with the decoder start token, as the model was trained (teacher forcing).

        The model's own ``prepare_decoder_input_ids_from_labels`` when its config names the start token (mBART's
        moves the language code to the front); else the start token from the generation config, or the bos token,
        as ``generate`` finds it."""
        labels = torch.as_tensor(labels, device=self.device)
        if getattr(self.hf.config, "decoder_start_token_id", None) is not None:
            return self.hf.prepare_decoder_input_ids_from_labels(labels=labels)
        start = next((v for v in (getattr(getattr(self.hf, "generation_config", None), "decoder_start_token_id", None),
                                  getattr(self.hf.config, "bos_token_id", None)) if isinstance(v, int)), None)
        if start is None:
            raise ValueError(f"{type(self.hf).__name__}'s config and generation config name no decoder start token "
                             "(decoder_start_token_id), so targets cannot be shifted right; set "
                             "model.hf.config.decoder_start_token_id (T5 uses its pad token, 0) or pass "
                             "decoder_input_ids yourself.")
        shifted = labels.new_full(labels.shape, start)
        shifted[..., 1:] = labels[..., :-1]
        return shifted.masked_fill(shifted == -100, self.pad_token_id)

    def _ids(self, inputs, mask, what: str):
        return check_inputs(inputs, mask, self.cfg.vocab_size, self.cfg.max_positions, self.device,
                            self.to_tokens if self.tokenizer is not None else None, what=what)

    # -- running ---------------------------------------------------------------------------------------
    def __call__(self, inputs, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None, **kwargs):
        self._check_attached()
        if decoder_input_ids is None:
            if isinstance(inputs, dict) and "decoder_input_ids" in inputs:
                decoder_input_ids = inputs["decoder_input_ids"]
                decoder_attention_mask = inputs.get("decoder_attention_mask", decoder_attention_mask)
            else:
                raise ValueError(
                    "An encoder-decoder model needs decoder_input_ids (b, t) as well as the encoder's input_ids: "
                    "pass decoder_input_ids=... (e.g. model.decoder_inputs(labels), the targets shifted right), "
                    "or use model.hf.generate(...) to produce them.")
        if isinstance(inputs, dict):
            inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
        ids, mask = self._ids(inputs, attention_mask, "input_ids")
        dec, dec_mask = self._ids(decoder_input_ids, decoder_attention_mask, "decoder_input_ids")
        kwargs.setdefault("use_cache", False)
        return self.hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask,
                       **kwargs)

    forward = __call__

    def run_with_hooks(self, inputs, attention_mask=None, fwd_hooks: Iterable = (), **kwargs):
        with self.hooks(fwd_hooks):
            return self(inputs, attention_mask, **kwargs)

    def default_cache_names(self) -> list[str]:
        return [n for n in self.hook_names() if not (self.attn == "flash" and spec_for(n).eager_only)]

    def run_with_cache(self, inputs, attention_mask=None, names: NameFilter | None = None, detach: bool = True,
                       fwd_hooks: Iterable = (), **kwargs) -> tuple[object, Seq2SeqCache]:
        """Run once and capture activations; ``cache.pattern(prefix_or_index, heads)`` rebuilds any site's
        pattern on the flash path (position bias and masks as the run had them)."""
        decoder_input_ids = kwargs.get("decoder_input_ids")
        if decoder_input_ids is None and not (isinstance(inputs, dict) and "decoder_input_ids" in inputs):
            self(inputs, attention_mask, **kwargs)  # raises the error that says what is missing
        selected = self.default_cache_names() if names is None else [p.name for p in self._registry.resolve(names)]
        store: dict[str, torch.Tensor] = {}
        biases: dict[str, torch.Tensor | None] = {}

        def save(tensor, hook):
            store[hook.name] = tensor.detach() if detach else tensor

        def bias(tensor, hook):  # the attention function has just stored this call's position bias
            site = hook.name.rsplit(".", 1)[0]
            b = self._layer_hooks[site].bias
            biases[site] = None if b is None else b.detach()

        with self.hooks([*fwd_hooks, (selected, save), (lambda n: n.endswith("hook_q"), bias)]):
            output = self(inputs, attention_mask, **kwargs)
        order = {n: i for i, n in enumerate(self.hook_names())}
        store = dict(sorted(store.items(), key=lambda kv: order[kv[0]]))
        ids, mask = self._ids(inputs if not isinstance(inputs, dict) else {k: v for k, v in inputs.items()
                              if k in ("input_ids", "attention_mask")}, attention_mask, "input_ids")
        dec_ids = kwargs.get("decoder_input_ids", inputs.get("decoder_input_ids") if isinstance(inputs, dict) else None)
        dec_mask = kwargs.get("decoder_attention_mask",
                              inputs.get("decoder_attention_mask") if isinstance(inputs, dict) else None)
        _, dec_mask = self._ids(dec_ids, dec_mask, "decoder_input_ids")
        return output, Seq2SeqCache(store, self, mask, dec_mask, biases)

    def __repr__(self) -> str:
        c, s = self.cfg, self.cfg.sites[0]
        return (f"Seq2SeqHookedModel({type(self.hf).__name__}: {c.n_encoder_layers} encoder + {c.n_decoder_layers} "
                f"decoder layers x {s.n_heads} heads, d_model {c.d_model}, attn={self.attn!r})")

    def summary(self) -> dict:
        return {"class": type(self.hf).__name__, "family": self.cfg.family, "attn": self.attn,
                "n_encoder_layers": self.cfg.n_encoder_layers, "n_decoder_layers": self.cfg.n_decoder_layers,
                "sites": [s.name for s in self.cfg.sites], "dtype": str(self.dtype).removeprefix("torch."),
                "device": str(self.device), "n_params": sum(p.numel() for p in self.hf.parameters())}


class Seq2SeqCache(ActivationCache):
    """Captured activations of an encoder-decoder run; ``pattern`` takes a site's prefix
    (``"decoder.blocks.1.cross_attn"``) or its index in ``model.cfg.sites``."""

    def __init__(self, store, model: Seq2SeqHookedModel, source_mask, target_mask, biases):
        super().__init__(store, None)
        self.sites = list(model.cfg.sites)
        self.source_mask, self.target_mask, self.biases = source_mask, target_mask, biases

    def _site(self, key) -> Site:
        if isinstance(key, int) and not isinstance(key, bool):
            if not 0 <= key < len(self.sites):
                raise IndexError(f"Site {key} is out of range: sites run 0..{len(self.sites) - 1} ({self.sites[0].name}, ...).")
            return self.sites[key]
        names = {s.name: s for s in self.sites}
        if isinstance(key, str) and key in names:
            return names[key]
        raise KeyError(f"{key!r} is not an attention of this model; give a prefix such as {self.sites[0].name!r} or "
                       f"{self.sites[-1].name!r}, or an index 0..{len(self.sites) - 1}.")

    def pattern(self, layer, heads: int | Sequence[int] | None = None) -> torch.Tensor:
        """The pattern ``(b, h, q, k)`` of ``heads`` (all if None) of one attention site, cached (eager) or
        rebuilt from q and k as the eager path computes it: scores x scale + position bias + additive mask."""
        site = self._site(layer)
        if isinstance(heads, int):
            heads = [heads]
        heads = list(range(site.n_heads)) if heads is None else list(heads)
        bad = [h for h in heads if not 0 <= h < site.n_heads]
        if bad:
            raise IndexError(f"Heads of {site.name} run 0..{site.n_heads - 1}; got {bad}.")
        if f"{site.name}.hook_pattern" in self._store:
            return self._store[f"{site.name}.hook_pattern"][:, heads]
        q_name, k_name = f"{site.name}.hook_q", f"{site.name}.hook_k"
        if q_name not in self._store or k_name not in self._store:
            raise KeyError(f"cache.pattern({site.name!r}) needs {q_name} and {k_name} in the cache; run_with_cache "
                           "captures them by default.")
        q, k = self._store[q_name], self._store[k_name]  # (b, q, h, d), (b, k, g, d)
        group = site.n_heads // site.n_kv_heads
        # (b, h, q, d) views of (b, q, h, d) tensors: laid out as the projections' views that the eager path
        # multiplies, so that the same matmul kernel gives the same bits
        q_sel = q[:, :, heads].transpose(1, 2)
        k_sel = k[:, :, [h // group for h in heads]].transpose(1, 2)
        scores = torch.matmul(q_sel, k_sel.transpose(2, 3)) * site.scale
        bias = self.biases.get(site.name)
        if bias is not None:
            scores = scores + bias[:, heads] if bias.shape[1] > 1 else scores + bias
        n_q, n_k = q.shape[1], k.shape[1]
        allowed = torch.ones(1, 1, n_q, n_k, dtype=torch.bool, device=q.device)
        if site.causal:
            allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)[None, None]
        keys_mask = self.source_mask if site.stack == "encoder" or site.kind == "cross" else self.target_mask
        if keys_mask is not None and not bool(keys_mask.all()):
            allowed = allowed & keys_mask.to(device=q.device, dtype=torch.bool)[:, None, None, :]
        if not bool(allowed.all()):
            zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
            scores = scores + torch.where(allowed, zero, torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)


_ENCODER_DECODER.append(Seq2SeqHookedModel)
