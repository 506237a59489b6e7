"""Tiny random models of every supported family (HF testers' sizes), the real MiniLM, and helpers."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

import interp
from interp.tokens.inputs import padded_positions
from interp.structure.probe import set_attention_key

VOCAB = 99

# Threads decided once for the session, before any load_model (which would otherwise pick "auto" at its first call):
# a count that moved between a reference run and ours could change the last bits of a bit-for-bit comparison.
interp.set_threads("auto")


def tiny_hf(family: str, seed: int = 0, **overrides):
    """A tiny random HF model: hidden 32, 2 layers, 4 heads (2 KV heads where GQA exists), vocab 99."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "gpt2":
        cfg = GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, **common, **overrides)
        model = GPT2LMHeadModel(cfg)
    elif family in ("llama", "mistral", "qwen2"):
        cls_cfg, cls = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
                        "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
        kw = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, **common)
        if family != "llama":
            kw["sliding_window"] = None
        kw.update(overrides)
        model = cls(cls_cfg(**kw))
    elif family == "bert":
        cfg = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                         max_position_embeddings=64, vocab_size=VOCAB, pad_token_id=0, **overrides)
        model = BertModel(cfg)
    else:
        raise ValueError(family)
    return model.eval()


TINY_FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "bert"]


def reference_and_ours(family: str, attn: str, ref_impl: str | None = None):
    """(HF reference model with its own eager/sdpa attention, our HookedModel on an identical copy)."""
    hf = family if isinstance(family, torch.nn.Module) else tiny_hf(family)
    ref = copy.deepcopy(hf)
    set_attention_key(ref, ref_impl or ("eager" if attn == "eager" else "sdpa"))
    ours = interp.load_model(copy.deepcopy(hf), attn=attn)
    return ref, ours


def padded_batch(causal: bool, lengths=(10, 7, 4), vocab=VOCAB, seed=0):
    """Token ids (b, p) with padding on the left (causal) or right (encoders), and its mask."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), n), generator=g)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for i, length in enumerate(lengths):
        if causal:
            mask[i, n - length:] = 1
        else:
            mask[i, :length] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def hf_kwargs(model, mask) -> dict:
    """What a HookedModel passes to its HF model besides ids and mask: no KV cache for causal models, and with
    left padding the positions of real tokens (cumsum(mask) - 1), so that a reference HF model gets the same."""
    if not model.cfg.causal:
        return {}
    kwargs = {"use_cache": False}
    if mask is not None and not bool(mask.all()):
        kwargs["position_ids"] = padded_positions(mask)
    return kwargs


def main_output(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def no_torch_hooks(module: torch.nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in module.modules())


@pytest.fixture(scope="session")
def minilm():
    return interp.load_model("minilm", attn="flash", device="cpu")


@pytest.fixture(scope="session")
def minilm_folder():
    return interp.model.loading.resolve_source("minilm")
