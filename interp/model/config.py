"""ModelConfig: the shape of a hooked model as its attention calls showed it, and its attention sites."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..tokens.inputs import position_limit
from ..structure.head_slicing import CONFIG_KEY
from ..attention.sites import Site
from ..structure.layered import Structure

__all__ = ["ModelConfig", "real_sites"]


@dataclass(frozen=True)
class ModelConfig:
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
    def d_vocab(self) -> int:
        """TransformerLens's name of ``vocab_size``."""
        return self.vocab_size

    @property
    def n_ctx(self) -> int | None:
        """TransformerLens's name of ``max_positions``."""
        return self.max_positions

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
    )

