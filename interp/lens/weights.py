"""TransformerLens's weight attributes on a ``HookedModel``: ``W_Q``, ``W_K``, ``W_V``, ``W_O``, ``b_Q`` ... stacked
``(layer, head, ...)``, ``W_E``, ``W_pos``, ``W_U``, ``b_U``, the factored ``OV``/``QK`` circuits (``LowRank``),
``model.blocks[l].attn`` and ``mod_dict``; read from the HF weights when asked (never copied into the model).

Shapes as TransformerLens's: ``W_Q (l, h, m, d)``, ``W_K``/``W_V (l, h, m, d)`` with key/value heads repeated
for grouped-query attention (the grouped ones under ``_W_K``/``_W_V (l, g, m, d)``, and ``_b_K``/``_b_V``),
``W_O (l, h, d, m)``, ``b_Q (l, h, d)``, ``b_O (l, m)``, ``W_E (vocab, m)``, ``W_pos (positions, m)``,
``W_U (m, vocab)``, ``b_U (vocab,)``; in the model's dtype, on its input device.

``model.fold_ln`` (default True, TransformerLens's ``fold_ln``): the norm each head reads its input through is
folded in, its weight into the rows of W_Q, W_K, W_V and its bias into b_Q, b_K, b_V; a LayerNorm's (which
centres its output) weights are then centred over d_model; the final norm the same way into W_U and b_U. Value
biases stay in b_V (TransformerLens's ``fold_value_biases`` moves them to b_O) and the model itself is not
changed (no ``center_writing_weights``: its activations are the HF model's).
"""

from __future__ import annotations

import torch

from .circuits import LowRank, head_biases, head_weights
from ..tokens.inputs import position_limit
from ..structure.norms import mlp_norm_reads, norm_bias, norm_centres, norm_scale, norm_weight
from ..attention.sites import is_layered

__all__ = ["WeightsMixin"]

_HEAD_KEYS = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O")


# TransformerLens's stacked weights, ``model.W_Q`` ...: each a property reading ``_stacked(name)``; name -> its doc
_STACKED = {
    "W_Q": "(l, h, m, d) query weights (fold_ln: norm folded in).",
    "W_K": "(l, h, m, d) key weights, key/value heads repeated (GQA).",
    "W_V": "(l, h, m, e) value weights, key/value heads repeated.",
    "W_O": "(l, h, e, m) output weights.",
    "b_Q": "(l, h, d) query biases (zeros where there are none).",
    "b_K": "(l, h, d) key biases, key/value heads repeated.",
    "b_V": "(l, h, e) value biases, key/value heads repeated.",
    "b_O": "(l, m) output-projection biases.",
    "_W_K": "(l, g, m, d) key weights per key/value head.",
    "_W_V": "(l, g, m, e) value weights per key/value head.",
    "_b_K": "(l, g, d) key biases per key/value head.",
    "_b_V": "(l, g, e) value biases per key/value head.",
}


class WeightsMixin:
    """Weights of ``HookedModel`` (it keeps ``hf``, ``cfg``, ``structure``, ``_blocks``, the site accessors).
    ``W_Q`` ... ``b_O`` and the per key/value head ``_W_K`` ... are properties made from ``_STACKED``."""

    fold_ln = True

    # -- per head --------------------------------------------------------------------------------------------
    def _check_stackable(self, what: str) -> None:
        if not is_layered(self):
            raise NotImplementedError(
                f"model.{what} stacks one attention site per layer; an encoder-decoder model has several stacks. "
                "Read one site's weights with interp.lens.circuits.head_weights(model, 'encoder.blocks.0.attn') (and "
                "head_biases).")
        if len(set(self.cfg.heads_per_layer)) > 1 or len(set(self.cfg.kv_heads_per_layer)) > 1:
            raise NotImplementedError(f"model.{what}: this pruned model's layers have different head counts "
                                      f"{list(self.cfg.heads_per_layer)}; read them per layer with "
                                      "interp.lens.circuits.head_weights(model, layer).")

    def _layer_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """One layer's weights and biases in float64, folded as ``fold_ln`` says."""
        w = {**head_weights(self, layer, fold_norms=False), **head_biases(self, layer)}
        norm = self.in_norm_of(self.cfg.sites[layer])
        if not self.fold_ln or norm is None:
            return w
        m = self.cfg.d_model
        gamma, beta = norm_weight(norm, m).to(w["W_Q"].device), norm_bias(norm, m)
        for x in "QKV":
            if beta is not None:
                w[f"b_{x}"] = w[f"b_{x}"] + torch.einsum("hmd,m->hd", w[f"W_{x}"], beta.to(w["W_Q"].device))
            w[f"W_{x}"] = gamma[:, None] * w[f"W_{x}"]
            if norm_centres(norm, m):
                w[f"W_{x}"] = w[f"W_{x}"] - w[f"W_{x}"].mean(-2, keepdim=True)
        return w

    def _stacked(self, key: str) -> torch.Tensor:
        self._check_stackable(key.lstrip("_"))
        name = key.lstrip("_")
        parts = [self._layer_weights(l)[name] for l in range(self.cfg.n_layers)]
        out = torch.stack(parts).to(self.dtype)
        group = self.cfg.n_heads // self.cfg.n_kv_heads
        if name in ("W_K", "W_V", "b_K", "b_V") and not key.startswith("_") and group > 1:
            out = out.repeat_interleave(group, dim=1)  # TransformerLens repeats key/value heads
        return out

    @property
    def OV(self) -> LowRank:  # noqa: N802
        """Every head's ``W_V @ W_O`` ``(l, h, m, m)``, kept factored."""
        return LowRank(self.W_V, self.W_O)

    @property
    def QK(self) -> LowRank:  # noqa: N802
        """Every head's ``W_Q @ W_K.T`` ``(l, h, m, m)``, kept factored (position-blind: RoPE is not in it)."""
        return LowRank(self.W_Q, self.W_K.transpose(-2, -1))

    # -- embeddings and unembedding --------------------------------------------------------------------------
    @property
    def W_E(self) -> torch.Tensor:  # noqa: N802
        """``(vocab, m)``: the input embedding table (a scale the embedding module applies, as Gemma's, is not in it)."""
        return self.hf.get_input_embeddings().weight.detach().to(self.device)

    def position_table(self) -> torch.nn.Embedding | None:
        """The learned position table (GPT-2's ``wpe``, BERT's ``position_embeddings``), found as the embedding with
        one row per position outside the blocks; None for rotary or relative positions."""
        limit = position_limit(self.hf.config)
        blocks = set()
        for stack in (self._blocks.values() if isinstance(self._blocks, dict) else [self._blocks]):
            blocks |= set(stack.modules())
        tokens = self.hf.get_input_embeddings()
        found = [m for m in self.hf.modules() if isinstance(m, torch.nn.Embedding) and m is not tokens
                 and m not in blocks and m.num_embeddings == limit and m.embedding_dim == self.cfg.d_model]
        return found[0] if len(found) == 1 else None

    @property
    def W_pos(self) -> torch.Tensor:  # noqa: N802
        """``(positions, m)``: the learned position table; refused for rotary or relative positions."""
        table = self.position_table()
        if table is None:
            raise NotImplementedError(f"{type(self.hf).__name__} has no learned position table (its positions are "
                                      "rotary or relative, applied inside attention), so there is no W_pos.")
        return table.weight.detach().to(self.device)

    def final_norm(self) -> torch.nn.Module | None:
        """The norm the last block's output goes through before the output layer, or None."""
        path = getattr(self.structure, "final_norm", None)
        return None if path is None else self.hf.get_submodule(path)

    def block_norm(self, layer: int, mlp_input: bool = False) -> torch.nn.Module:
        """The norm block ``layer``'s attention (``mlp_input``: its MLP) reads the residual stream through; the
        stream it reads: ``norm_input(layer, mlp_input)``."""
        if self.cfg.block == "post-norm":
            raise NotImplementedError("Post-norm blocks (BERT) normalise after each sublayer: a block's input has no "
                                      "norm of its own to apply; use apply_ln=False or the final stream.")
        if not mlp_input:
            norm = self.in_norm_of(self.cfg.sites[layer])
        else:
            norm = self._norms.get(f"blocks.{layer}.ln2", (None,))[0]
        if norm is None:
            raise NotImplementedError(f"Block {layer}'s {'MLP' if mlp_input else 'attention'} reads the stream "
                                      f"through no norm interp found ({self.cfg.block} blocks).")
        return norm

    def norm_input(self, layer: int, mlp_input: bool = False) -> str:
        """The hook kind of the stream ``block_norm(layer, mlp_input)`` reads: ``"resid_pre"`` (attention's norm,
        and a parallel block's MLP norm) or ``"resid_mid"`` (a pre-norm block's MLP norm)."""
        return mlp_norm_reads(self.cfg.block) if mlp_input else "resid_pre"

    @property
    def W_U(self) -> torch.Tensor:  # noqa: N802
        """``(m, vocab)``: the output layer (fold_ln: the final norm folded in, centred for a LayerNorm)."""
        return self._unembed()[0]

    @property
    def b_U(self) -> torch.Tensor:  # noqa: N802
        """``(vocab,)``: the output bias, zeros where there is none (fold_ln: plus the final norm's bias @ W_U)."""
        return self._unembed()[1]

    def _unembed(self) -> tuple[torch.Tensor, torch.Tensor]:
        head = self.hf.get_output_embeddings()
        if head is None or not is_layered(self):
            raise NotImplementedError(f"{type(self.hf).__name__} has no output layer to read W_U from"
                                      + ("" if head is None else " as one stream (an encoder-decoder model)") + ".")
        if not self.cfg.causal:  # BERT's masked-LM head: dense, activation and a norm sit before its output layer
            raise NotImplementedError(f"{type(self.hf).__name__} is an encoder: its output layer reads the stream "
                                      "through the masked-LM head's own layers (dense, activation, norm), so no "
                                      "W_U, b_U maps the residual stream to the logits. Read the logits with "
                                      "model(ids, return_type='logits').")
        w_u = head.weight.detach().float().T  # (m, vocab)
        b_u = torch.zeros(w_u.shape[1], device=w_u.device)
        if getattr(head, "bias", None) is not None:
            b_u = b_u + head.bias.detach().float()
        extra = getattr(self.hf, "final_logits_bias", None)
        if isinstance(extra, torch.Tensor):
            b_u = b_u + extra.detach().float().reshape(-1).to(b_u.device)
        norm = self.final_norm()
        if self.fold_ln and norm is not None:
            m = self.cfg.d_model
            beta = norm_bias(norm, m)
            if beta is not None:
                b_u = b_u + beta.float().to(w_u.device) @ w_u
            w_u = norm_weight(norm, m).float().to(w_u.device)[:, None] * w_u
            if norm_centres(norm, m):
                w_u = w_u - w_u.mean(0, keepdim=True)
        return w_u.to(self.device, self.dtype), b_u.to(self.device, self.dtype)

    # -- modules -----------------------------------------------------------------------------------------------
    @property
    def blocks(self) -> list[_Block]:
        """TransformerLens's ``model.blocks``: ``model.blocks[l].attn.W_Q`` ``(h, m, d)``, ``.hook_resid_pre``
        (a HookPoint), ``.attn.hook_pattern``; ``.ln1``, ``.ln2``, ``.mlp`` and any other attribute: the HF
        block's modules."""
        self._check_stackable("blocks")
        return [_Block(self, l) for l in range(self.cfg.n_layers)]

    @property
    def embed(self) -> _Named:
        """TransformerLens's ``model.embed``: ``.W_E``; called on tokens, the HF embedding's output."""
        return _Named(self.hf.get_input_embeddings(), W_E=lambda: self.W_E)

    @property
    def unembed(self) -> _Named:
        """TransformerLens's ``model.unembed``: ``.W_U``, ``.b_U``; called on a normalised stream, ``x @ W_U + b_U``."""
        return _Named(self.hf.get_output_embeddings(), W_U=lambda: self.W_U, b_U=lambda: self.b_U,
                      call=lambda x: x.to(self.dtype) @ self.W_U + self.b_U)

    @property
    def ln_final(self) -> _Named:
        """TransformerLens's ``model.ln_final``: the final norm; with ``fold_ln`` (its weight is in ``W_U``) it only
        centres and rescales, as TransformerLens's ``LNPre``/``RMSPre``, so ``unembed(ln_final(x))`` is the logits."""
        norm = self.final_norm()
        if norm is None:
            stacks = [w for w in self._norms if w.endswith(".ln_final")]  # an encoder-decoder's, one per stack
            raise NotImplementedError(
                f"{type(self.hf).__name__} has no final norm interp found, so no ln_final." if not stacks else
                f"{type(self.hf).__name__} has one final norm per stack, not one ln_final: its hook points are "
                f"{', '.join(stacks)} (.hook_scale, .hook_normalized).")

        def call(x):
            if not self.fold_ln:
                return norm(x)
            centred = x.float() - x.float().mean(-1, keepdim=True) if norm_centres(norm, x.shape[-1]) else x.float()
            return (centred / norm_scale(norm, x)).to(x.dtype)
        return _norm_named(self, norm, "ln_final", call)

    def tl_named_parameters(self):
        """``(TransformerLens name, tensor)`` pairs: ``embed.W_E``, ``pos_embed.W_pos`` (learned positions),
        ``blocks.{l}.attn.W_Q`` ... ``b_O`` and ``unembed.W_U``/``b_U``, as this model's ``W_*`` give them (with
        ``fold_ln``: folded, so computed tensors, not the HF parameters)."""
        yield "embed.W_E", self.W_E
        if self.position_table() is not None:
            yield "pos_embed.W_pos", self.W_pos
        stacked = {key: getattr(self, key) for key in _HEAD_KEYS}
        for layer in range(self.cfg.n_layers):
            for key, value in stacked.items():
                yield f"blocks.{layer}.attn.{key}", value[layer]
        if self.hf.get_output_embeddings() is not None and self.cfg.causal:
            yield "unembed.W_U", self.W_U
            yield "unembed.b_U", self.b_U

    @property
    def mod_dict(self) -> dict[str, object]:
        """Name -> module: every hook point (``hook_dict``), every block and attention module by its hook prefix
        (``blocks.3``, ``blocks.3.attn``, ``decoder.blocks.0.cross_attn``), ``embed`` and ``unembed``."""
        out: dict[str, object] = {"embed": self.hf.get_input_embeddings()}
        unembed = self.hf.get_output_embeddings()
        if unembed is not None:
            out["unembed"] = unembed
        for site in self.cfg.sites:
            block = site.name.rsplit(".", 1)[0]
            stack = self._blocks[site.stack] if isinstance(self._blocks, dict) else self._blocks
            out.setdefault(block, stack[site.block])
            out[site.name] = self._site_modules[site.name]
        return {**out, **self.hook_dict}


for _name, _doc in _STACKED.items():
    setattr(WeightsMixin, _name, property(lambda self, _key=_name: self._stacked(_key), doc=_doc))
del _name, _doc


class _Named:
    """A HF module under a TransformerLens name: the named tensors it lists, its own call if given, else the
    module's; any other attribute is the module's."""

    def __init__(self, module, call=None, **tensors):
        self._module, self._call, self._tensors = module, call, tensors

    def __call__(self, *args, **kwargs):
        return (self._call or self._module)(*args, **kwargs)

    def __getattr__(self, name: str):
        if name in self._tensors:
            return self._tensors[name]()
        return getattr(self._module, name)


def _norm_named(model, norm, where: str, call=None) -> _Named:
    """A norm module under its TransformerLens name: ``.hook_scale``/``.hook_normalized`` are the model's hook points
    (``interp.model.norm_hooks``; one line where the model has none), any other attribute the module's."""
    return _Named(norm, call, **{kind: (lambda kind=kind: model._registry[f"{where}.{kind}"])
                                 for kind in ("hook_scale", "hook_normalized")})


class _Block:
    """One block as TransformerLens shows it (``model.blocks[l]``)."""

    def __init__(self, model, layer: int):
        self._model, self._layer = model, layer
        self.attn = _Attention(model, layer)

    @property
    def ln1(self) -> _Named | None:
        """The norm the attention reads the stream through (the HF module), with its ``hook_scale`` and
        ``hook_normalized`` points; None where there is none (ModernBERT's first block)."""
        norm = self._model.in_norm_of(self._model.cfg.sites[self._layer])
        return None if norm is None else _norm_named(self._model, norm, f"blocks.{self._layer}.ln1")

    @property
    def ln2(self) -> _Named:
        """The norm the MLP reads the stream through (``hook_resid_mid``; a parallel block's input), with its hook
        points."""
        return _norm_named(self._model, self._model.block_norm(self._layer, mlp_input=True), f"blocks.{self._layer}.ln2")

    @property
    def mlp(self):
        path = self._model.structure.mlp[self._layer]
        return None if path is None else self._model._blocks[self._layer].get_submodule(path)

    def __getattr__(self, name: str):
        if name.startswith("hook_"):
            return self._model.hook_dict[f"blocks.{self._layer}.{name}"]
        return getattr(self._model._blocks[self._layer], name)


class _Attention:
    """One layer's attention as TransformerLens shows it (``model.blocks[l].attn``): its W_Q ``(h, m, d)`` ...,
    OV and QK, hook points; any other attribute is the HF attention module's."""

    def __init__(self, model, layer: int):
        self._model, self._layer = model, layer

    def __getattr__(self, name: str):
        model, layer = self._model, self._layer
        if name in _HEAD_KEYS or name in ("_W_K", "_W_V", "_b_K", "_b_V", "OV", "QK"):
            return getattr(model, name)[layer]
        if name.startswith("hook_"):
            return model.hook_dict[f"blocks.{layer}.attn.{name}"]
        return getattr(model._site_modules[f"blocks.{layer}.attn"], name)
