"""What differs between model families, in one small table, and the allowlist of attention features.

Paths are attribute paths: ``layers`` from the HF base model to its ModuleList of blocks, the rest from a
block. Anything not in this table is refused with a clear error rather than computed differently.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Family", "FAMILIES", "family_of", "check_supported"]


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    layers: str  # base model -> blocks
    attn: str  # block -> module that calls the attention interface
    o_proj: str  # block -> output projection (its input is z, flattened over heads)
    attn_out: str  # block -> module whose output is hook_attn_out
    mlp_out: str  # block -> module whose output is hook_mlp_out
    resid_mid: tuple[str, str]  # (block -> module, "input" of a norm (observe only) | "output")
    causal: bool
    auto_class: str  # transformers class that loads a folder of this family


FAMILIES: tuple[Family, ...] = (
    Family("gpt2", ("gpt2",), layers="h", attn="attn", o_proj="attn.c_proj", attn_out="attn", mlp_out="mlp",
           resid_mid=("ln_2", "input"), causal=True, auto_class="AutoModelForCausalLM"),
    Family("llama", ("llama", "mistral", "qwen2"), layers="layers", attn="self_attn", o_proj="self_attn.o_proj",
           attn_out="self_attn", mlp_out="mlp", resid_mid=("post_attention_layernorm", "input"), causal=True,
           auto_class="AutoModelForCausalLM"),
    Family("bert", ("bert",), layers="encoder.layer", attn="attention.self", o_proj="attention.output.dense",
           attn_out="attention.output.dense", mlp_out="output.dense", resid_mid=("attention", "output"),
           causal=False, auto_class="AutoModel"),
)

_BY_TYPE = {t: fam for fam in FAMILIES for t in fam.model_types}


def family_of(config) -> Family:
    model_type = getattr(config, "model_type", None)
    family = _BY_TYPE.get(model_type)
    if family is None:
        raise NotImplementedError(
            f"Model type {model_type!r} is not supported. Supported model types: {sorted(_BY_TYPE)} "
            "(GPT-2, Llama-style with RoPE and grouped-query attention, BERT-style encoders)."
        )
    return family


def _unsupported(config) -> list[str]:
    """Attention features of this config that we would compute differently; empty if none."""
    found = []
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        found.append(f"sliding-window attention (sliding_window={config.sliding_window})")
    for attr, what in (("attn_logit_softcapping", "logit soft-capping"), ("alibi", "ALiBi position bias")):
        if getattr(config, attr, None):
            found.append(f"{what} ({attr}={getattr(config, attr)!r})")
    if getattr(config, "reorder_and_upcast_attn", False):
        found.append("GPT-2's reorder_and_upcast_attn=True (honoured only by HF's own eager key)")
    if getattr(config, "add_cross_attention", False) or getattr(config, "is_decoder", False) and config.model_type == "bert":
        found.append("cross-attention / BERT as a decoder")
    position_type = getattr(config, "position_embedding_type", "absolute")
    if position_type not in (None, "absolute"):
        found.append(f"relative position scores (position_embedding_type={position_type!r})")
    return found


def check_supported(config) -> Family:
    """The family of ``config``; raises NotImplementedError naming any attention feature we do not implement."""
    family = family_of(config)
    found = _unsupported(config)
    if found:
        raise NotImplementedError(
            f"This {config.model_type} model uses {'; '.join(found)}, which interp's attention does not "
            "implement. Computing without it would silently give different patterns, so loading is refused. "
            "Use a config without it."
        )
    return family
