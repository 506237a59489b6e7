"""benchmarks/bench_forward.py with TransformerLens 4.x installed: ``HookedTransformer`` is gone, so the script
times 4.x's ``TransformerBridge`` instead, or leaves the row out with a line saying why; it never crashes.
TransformerLens is not installed here: fake modules in sys.modules stand for each version."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import interp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_forward  # noqa: E402


class _Bridge:
    booted = []

    def __init__(self, hf):
        self.hf = hf

    @classmethod
    def boot_transformers(cls, name, hf_model=None, device=None):
        cls.booted.append((name, hf_model, device))
        return cls(hf_model)

    def run_with_cache(self, ids):
        return self.hf(input_ids=ids), {"blocks.0.attn.hook_z": None}


def _fake_transformer_lens(monkeypatch, bridge=None):
    """A TransformerLens 4.x with no HookedTransformer; ``bridge``: its model_bridge.TransformerBridge (None: none)."""
    tl = types.ModuleType("transformer_lens")
    tl.__version__ = "4.3.0"
    monkeypatch.setitem(sys.modules, "transformer_lens", tl)
    if bridge is None:
        monkeypatch.setitem(sys.modules, "transformer_lens.model_bridge", None)  # import raises ImportError
    else:
        sub = types.ModuleType("transformer_lens.model_bridge")
        sub.TransformerBridge = bridge
        tl.model_bridge = sub
        monkeypatch.setitem(sys.modules, "transformer_lens.model_bridge", sub)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50, n_positions=16)).eval()
    return interp.load_model(hf, attn="flash"), torch.randint(0, 50, (1, 8))


def test_transformer_lens_4_is_timed_through_its_bridge(monkeypatch, tiny):
    model, ids = tiny
    _fake_transformer_lens(monkeypatch, _Bridge)
    name, (prepare, run) = bench_forward.transformer_lens_row(model.hf, ids)
    assert "bridge" in name and _Bridge.booted[-1][1] is model.hf
    prepare()
    assert model.hf.config._attn_implementation == "eager"  # the bridge's own attention
    logits, cache = run()
    assert "blocks.0.attn.hook_z" in cache


def test_a_transformer_lens_with_neither_api_leaves_the_row_out_and_says_why(monkeypatch, tiny, capsys):
    model, ids = tiny
    _fake_transformer_lens(monkeypatch, bridge=None)
    table = bench_forward.variants(model, ids, has_tl=True)
    assert not any("TransformerLens" in name for name in table)
    assert "ours eager, capture patterns" in table
    out = capsys.readouterr().out
    assert "no TransformerLens row" in out and "4.3.0" in out and "HookedTransformer" in out


def test_a_bridge_that_cannot_boot_leaves_the_row_out_and_says_why(monkeypatch, tiny):
    class Offline(_Bridge):
        @classmethod
        def boot_transformers(cls, *a, **k):
            raise OSError("gpt2's tokenizer is not cached")

    model, ids = tiny
    _fake_transformer_lens(monkeypatch, Offline)
    name, why = bench_forward.transformer_lens_row(model.hf, ids)
    assert name is None and "OSError" in why and "tokenizer" in why
