"""What cannot be discovered by a probe forward: configuration features that change the attention math but
do not show in the call to the attention interface, refused before any weight is loaded.

Everything else (where blocks, projections, norms and MLPs are; heads, head sizes, scale, soft-cap, sinks and
each layer's window of keys) is found by ``interp.structure.layered.discover`` on the model itself. Models whose
attention does not go through transformers' attention interface (GPT-J, GPT-Neo, Falcon, Bloom, ...) are
refused by that probe, by name.
"""

from __future__ import annotations

__all__ = ["check_supported", "unsupported_features"]


def unsupported_features(config, seq2seq: bool = False) -> list[str]:
    """Attention features of this config that we would compute differently; empty if none. ``seq2seq``: the
    config is loaded as an encoder-decoder model (``interp.model.seq2seq``), so cross-attention is supported."""
    found = []
    for attr, what in (("alibi", "ALiBi position bias"), ("use_alibi", "ALiBi position bias"),
                       ("position_buckets", "relative position buckets (DeBERTa-style)")):
        if getattr(config, attr, None):
            found.append(f"{what} ({attr}={getattr(config, attr)!r})")
    if getattr(config, "reorder_and_upcast_attn", False):
        found.append("GPT-2's reorder_and_upcast_attn=True (honoured only by HF's own eager key)")
    if getattr(config, "add_cross_attention", False) and not getattr(config, "is_encoder_decoder", False):
        found.append("cross-attention in a decoder-only model (add_cross_attention=True; encoder-decoder models "
                     "with is_encoder_decoder=True are supported)")
    elif getattr(config, "is_encoder_decoder", False) and not seq2seq:
        found.append("cross-attention (load the whole encoder-decoder model: interp.load_model and "
                     "interp.HookedModel give it encoder, decoder and cross-attention sites)")
    text = getattr(config, "text_config", None) or config
    crossing = [l for l in getattr(text, "cross_attention_layers", None) or ()
                if l < getattr(text, "num_hidden_layers", 0)]  # layers past the last do not exist
    if crossing:
        found.append(f"cross-attention layers fed by another model's states (cross_attention_layers="
                     f"{crossing}, {getattr(config, 'model_type', '?')}: their keys and values "
                     "come from vision or encoder states that interp's wrapper does not feed, and a forward without "
                     "them skips those layers, so their heads cannot be sites yet; interp's sites are the attention "
                     "modules of decoder-only, encoder-only and encoder-decoder models)")
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type not in (None, "absolute", "rope", "rotary"):
        found.append(f"relative position scores (position_embedding_type={position_type!r})")
    return found


def check_supported(config, seq2seq: bool = False) -> None:
    """Raise NotImplementedError naming any attention feature of ``config`` that we do not implement."""
    found = unsupported_features(config, seq2seq)
    if found:
        raise NotImplementedError(
            f"This {getattr(config, 'model_type', 'model')} model uses {'; '.join(found)}, which interp's attention "
            "does not implement. Computing without it would silently give different patterns, so it is refused."
        )
