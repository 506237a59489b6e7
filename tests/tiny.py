"""Tiny random models of any transformers model type, for the tests and the benchmarks (``tests.tiny``: not part of
the installed library; the benchmarks put the repository's root on ``sys.path``).

``tiny_config(model_type)`` sets every size field a config class has (hidden 64, 2 layers, 4 heads on 2
key/value heads, head dim 16, vocabulary 99, sliding windows of 4 keys) and ``tiny_model`` builds the
masked-LM or causal-LM class of that type in eval mode. Weights are drawn with ``initializer_range`` 0.2, ten
times HF's usual 0.02: at the default scale attention scores are about 0.01, every pattern is nearly uniform
and a missing feature (a soft-cap, a window, a sink) changes the output by almost nothing, so a parity test
could not notice it.

    >>> from tests.tiny import tiny_model
    >>> tiny_model("llama").config.num_hidden_layers
    2
"""

from __future__ import annotations

import inspect

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                    MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                                                    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES)

__all__ = ["FAMILIES", "tiny_config", "tiny_model", "model_class"]

VOCAB = 99

# The families the parity tests cover (issue 11's list), and what each needs beyond the generic sizes so that
# its distinguishing feature is on: sliding windows shorter than the test sequences, both layer types where
# a model mixes them, a soft-cap that bites.
FAMILIES: dict[str, dict] = {
    "gpt2": {}, "gpt_neox": {}, "llama": {}, "mistral": {}, "mixtral": {}, "qwen2": {}, "qwen3": {},
    "qwen3_moe": {}, "gemma": {}, "gemma2": {"attn_logit_softcapping": 5.0, "final_logit_softcapping": None},
    "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"]}, "phi": {}, "phi3": {}, "olmo": {},
    "olmo2": {}, "opt": {"word_embed_proj_dim": 64}, "stablelm": {}, "starcoder2": {}, "smollm3": {},
    "cohere": {}, "granite": {}, "gpt_oss": {}, "deepseek_v3": {"num_key_value_heads": 4}, "bert": {}, "roberta": {}, "distilbert": {},
    "modernbert": {},
}

_SIZES = {
    ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "model_dim"): 64,
    ("num_hidden_layers", "n_layer", "num_layers", "n_layers"): 2,
    ("num_attention_heads", "n_head", "num_heads", "n_heads"): 4,
    ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"): 2,
    ("head_dim", "attention_head_dim", "kv_channels"): 16,
    ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "hidden_dim"): 96,
    ("vocab_size",): VOCAB,
    ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx"): 256,
    ("num_local_experts", "num_experts", "n_routed_experts"): 4,
    ("num_experts_per_tok",): 2,
    ("moe_intermediate_size", "shared_expert_intermediate_size"): 32,
    ("sliding_window", "local_attention"): 4,
    ("q_lora_rank",): 32, ("kv_lora_rank",): 16, ("qk_rope_head_dim",): 8, ("qk_nope_head_dim",): 8,
    ("v_head_dim",): 12, ("first_k_dense_replace",): 1, ("n_group",): 1, ("topk_group",): 1,
    ("initializer_range", "init_std"): 0.2,
}
# Encoder-decoder configs name their sizes per stack (BART's encoder_layers, T5's num_decoder_layers and d_kv); only
# for those types, so that no decoder-only family's tiny config changes.
_SEQ2SEQ_SIZES = {
    ("encoder_layers", "decoder_layers", "num_decoder_layers"): 2,
    ("encoder_attention_heads", "decoder_attention_heads"): 4,
    ("encoder_ffn_dim", "decoder_ffn_dim", "d_ff"): 96,
    ("d_kv",): 16,
    ("decoder_vocab_size",): VOCAB,
}
_SPECIAL_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id",
                   "mask_token_id", "decoder_start_token_id")


def tiny_config(model_type: str, **overrides):
    """A small config of ``model_type``: every size field its class takes set to the sizes above, and the same for
    its sub-configs (the text and vision configs of a multimodal model)."""
    cls = CONFIG_MAPPING[model_type]
    params = inspect.signature(cls.__init__).parameters
    sizes = {**_SIZES, **_SEQ2SEQ_SIZES} if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES else _SIZES
    kwargs = {name: value for names, value in sizes.items() for name in names if name in params}
    sub_configs = getattr(cls, "sub_configs", None) or {}
    if sub_configs:
        default = cls()
        for name in sub_configs:
            sub_type = getattr(getattr(default, name, None), "model_type", None)
            if name in params and sub_type in CONFIG_MAPPING and sub_type != model_type:
                kwargs[name] = tiny_config(sub_type)
    kwargs.update({name: 0 for name in _SPECIAL_TOKENS if name in params})
    if model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:  # a config field in real checkpoints (T5's too)
        kwargs["decoder_start_token_id"] = 0
    if "kv_lora_rank" in params:  # multi-head latent attention: keys and values come one per query head
        kwargs.update({name: 4 for name in ("num_key_value_heads",) if name in params})
    kwargs.update(FAMILIES.get(model_type, {}))
    kwargs.update(overrides)
    return cls(**kwargs)


def model_class(model_type: str, seq2seq: bool = False):
    """The masked-LM class of an encoder type, else the causal-LM class, else the base model class (for an
    encoder-decoder type pass ``seq2seq=True``: its conditional-generation class)."""
    for names in ((MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,) if seq2seq else
                  (MODEL_FOR_MASKED_LM_MAPPING_NAMES, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES)):
        name = names.get(model_type)
        if isinstance(name, (list, tuple)):
            name = name[0]
        if name is not None and hasattr(transformers, name):
            return getattr(transformers, name)
    raise KeyError(f"transformers has no model class for {model_type!r}")


def tiny_model(model_type: str, seed: int = 0, cls=None, **overrides) -> torch.nn.Module:
    """A tiny random model of ``model_type`` in eval mode (``cls`` defaults to ``model_class(model_type)``)."""
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    return (cls or model_class(model_type))(config).eval()
