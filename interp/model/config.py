"""ModelConfig: the shape of a hooked model as its attention calls showed it, and its attention sites."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from ..tokens.inputs import adds_bos, position_limit
from ..structure.head_slicing import CONFIG_KEY
from ..attention.sites import Site
from ..structure.layered import Structure

__all__ = ["ModelConfig", "TLConfigFields", "real_sites"]


class TLConfigFields:
    """TransformerLens's config names (``model.cfg.X`` as its notebooks read them) over a config's own facts
    (``vocab_size``, ``max_positions``, ``n_kv_heads``, ``mlp_width``, ``mlp_act``, ``norm_kind``, ``positions``) and
    the live model it belongs to (``owner``, for the fields that are its settings: device, fold_ln, tokenizer).
    A field that means nothing for the model raises one line (an AttributeError, so ``hasattr`` says False)."""

    _folds_norms = True  # whether model.W_* can be read with the norm folded in (fold_ln): "LNPre"/"RMSPre"

    @property
    def d_vocab(self) -> int:
        """TransformerLens's name of ``vocab_size``."""
        return self.vocab_size

    @property
    def n_ctx(self) -> int | None:
        """TransformerLens's name of ``max_positions``."""
        return self.max_positions

    @property
    def n_key_value_heads(self) -> int:
        """TransformerLens's name of ``n_kv_heads``."""
        return self.n_kv_heads

    def _model(self, name: str):
        model = self.owner() if callable(self.owner) else None
        if model is None:
            raise AttributeError(f"cfg.{name} is a setting of a loaded model; this config has none attached "
                                 "(read it from model.cfg).")
        return model

    @property
    def device(self):
        """Where the model's inputs go (``model.device``), as TransformerLens's ``cfg.device``."""
        return self._model("device").device

    @property
    def dtype(self):
        return self._model("dtype").dtype

    @property
    def normalization_type(self) -> str:
        """TransformerLens's: ``"LN"`` or ``"RMS"``, with ``"Pre"`` appended when ``model.W_*`` have the norm
        folded in (``fold_ln``, as TransformerLens's ``"LNPre"``/``"RMSPre"``)."""
        if self.norm_kind is None:
            raise AttributeError(f"cfg.normalization_type means nothing for this {self.family} model: interp found "
                                 "no final norm in it.")
        folded = self._folds_norms and getattr(self._model("normalization_type"), "fold_ln", False)
        return self.norm_kind + ("Pre" if folded else "")

    @property
    def default_prepend_bos(self) -> bool:
        """Whether ``to_tokens(text)`` prepends a BOS token by default: here the tokenizer's own convention
        (TransformerLens prepends one for most models; ``notebooks/transformerlens.md``)."""
        return adds_bos(self._model("default_prepend_bos").tokenizer)

    @property
    def tokenizer_name(self) -> str | None:
        tok = self._model("tokenizer_name").tokenizer
        return getattr(tok, "name_or_path", None) or None

    @property
    def model_name(self) -> str:
        return getattr(self._model("model_name").hf.config, "_name_or_path", "") or self.family

    @property
    def attn_only(self) -> bool:
        return self.mlp_width is None

    @property
    def d_mlp(self) -> int:
        return self._fact("d_mlp", self.mlp_width)

    @property
    def act_fn(self) -> str:
        return self._fact("act_fn", self.mlp_act)

    @property
    def positional_embedding_type(self) -> str:
        return self._fact("positional_embedding_type", self.positions)

    def _fact(self, name: str, value):
        if value is None:
            raise AttributeError(f"cfg.{name} means nothing for this {self.family} model: interp found none in its "
                                 "HF config.")
        return value



@dataclass(frozen=True)
class ModelConfig(TLConfigFields):
    """Shape of a hooked model, as its attention calls showed it (``interp.structure.layered``).

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
    # one per layer, ``blocks.{l}.attn`` (``interp.attention.sites``); left out of the repr, which printed every site's record
    sites: tuple[Site, ...] = field(default=(), repr=False)
    # TransformerLens's facts read from the HF config (``tl_facts``); None where the model has no such thing
    mlp_width: int | None = None  # TransformerLens's d_mlp
    mlp_act: str | None = None  # its act_fn, as the HF config names it
    norm_kind: str | None = None  # "LN" (centres) or "RMS", from the final norm
    positions: str | None = None  # its positional_embedding_type
    # the live model, for the fields that are its settings (device, fold_ln, tokenizer): set by HookedModel
    owner: object = field(default=None, repr=False, compare=False)

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
    def empty_sites(self) -> tuple[str, ...]:
        """The sites of ``empty_layers`` (as an encoder-decoder model's config lists its sites pruned empty)."""
        return tuple(s.name for s in self.sites if s.block in self.empty_layers)

    @property
    def stacks(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.stack for s in self.sites))



def real_sites(model) -> list[Site]:
    """The attention sites that have heads, in site order: every site but the placeholder of one pruned of every
    head (``cfg.empty_sites``: a layer in ``empty_layers``, or an encoder-decoder site), whose zeroed head is not a
    head in any analysis. The per-site form of ``cfg.heads()``; on a model with one site per layer
    ``[s.block for s in real_sites(model)]`` are its layers that have heads."""
    cfg = model.cfg
    empty = set(cfg.empty_sites)
    return [s for s in cfg.sites if s.name not in empty]

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
        sites=structure.layer_attn,
        **tl_facts(hf, structure),
    )


def tl_facts(hf, structure: Structure | None = None, norm=None) -> dict:
    """The HF config's facts TransformerLens's config names: MLP width and activation, the norm's kind (from
    the final norm, ``interp.structure.norms``; or ``norm``, given) and how positions enter."""
    from ..structure.norms import norm_centres
    from ..structure.probe import _is_norm

    c = getattr(hf.config, "text_config", None) or hf.config
    d_mlp = next((getattr(c, k) for k in ("intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim")
                  if getattr(c, k, None)), None)
    if d_mlp is None and c.model_type in ("gpt2", "gpt_neo", "gptj"):
        d_mlp = 4 * structure.d_model  # GPT-2's n_inner=None
    act = next((getattr(c, k) for k in ("hidden_activation", "hidden_act", "activation_function", "feed_forward_proj")
                if isinstance(getattr(c, k, None), str)), None)
    if structure is not None:  # the final norm, else (post-norm: BERT) the first block's first norm
        block = hf.get_submodule(structure.layers)[0]
        norm = hf.get_submodule(structure.final_norm) if structure.final_norm else next(
            (m for m in block.modules() if _is_norm(m) and getattr(m, "weight", None) is not None), None)
    d_model = structure.d_model if structure is not None else getattr(c, "d_model", None) or c.hidden_size
    norm_kind = None if norm is None else "LN" if norm_centres(norm, d_model) else "RMS"
    if getattr(c, "rope_theta", None) or getattr(c, "rope_scaling", None) or getattr(c, "rotary_dim", None) \
            or getattr(c, "position_embedding_type", None) in ("rope", "rotary"):
        positions = "rotary"
    elif getattr(c, "relative_attention_num_buckets", None):
        positions = "relative_positional_bias"
    elif getattr(c, "alibi", False) or c.model_type in ("bloom", "mpt"):
        positions = "alibi"
    elif getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None):
        positions = "standard"
    else:
        positions = None
    return {"mlp_width": int(d_mlp) if d_mlp else None, "mlp_act": act, "norm_kind": norm_kind,
            "positions": positions}


class ModelRef:
    """A weak reference to the model a config belongs to: copies and pickles of the config drop it."""

    def __init__(self, model=None):
        self._ref = None if model is None else weakref.ref(model)

    def __call__(self):
        return None if self._ref is None else self._ref()

    def __reduce__(self):
        return (ModelRef, ())

    def __deepcopy__(self, memo):
        return ModelRef()

