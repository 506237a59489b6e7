"""Streaming heads (interp.streaming): each chosen head sees only the first ``sink`` and the last ``window`` keys
up to and including each query.

The reference is the plain model on the eager path with a hook on ``hook_attn_scores`` that sets the excluded
scores of those heads to -inf, positions counted from each row's first real token (left padding). Weights of the
attention are scaled up so that patterns are far from uniform and a wrong mask shows in the logits.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import padded_batch, tiny_hf
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

import interp
from interp.streaming import StreamingLayer, streamable_heads, streaming_attention
from interp.streaming.cache import STREAM_ATTR

# most tests here stream part of a key/value group on purpose: the note that says so is tested on its own
pytestmark = pytest.mark.filterwarnings("ignore::interp.streaming.KVHeadsNote")
TOL = {"eager": 0.0, "flash": 1e-5}
SINK, WINDOW = 2, 5


def _gemma3():
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                           layer_types=["full_attention"] * 2, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return Gemma3ForCausalLM(cfg).eval()


def _sharp(family: str):
    hf = _gemma3() if family == "gemma3" else tiny_hf(family, **({} if family == "gpt2" else
                                                                  {"max_position_embeddings": 128}))
    with torch.no_grad():  # scale up so that attention is far from uniform
        for name, p in hf.named_parameters():
            if any(k in name for k in ("q_proj", "k_proj", "c_attn")) and p.ndim == 2:
                p.mul_(6.0)
    return hf


def _kv(model, cache) -> dict:
    """The cache argument under this transformers' name (``cache`` in 5.24, ``past_key_values`` in 5.17)."""
    return {interp.cache_kwarg(model.hf): cache}


HEADS = [(0, 0), (0, 1), (1, 2)]  # on the GQA models (2 kv heads of 2 query heads) layer 0's kv head 0 streams
FAMILIES = ["llama", "qwen2", "gemma3", "gpt2"]


def _reference_hook(mask, heads, sink, window):
    real = mask.bool()
    pos = mask.cumsum(1) - 1  # (b, p): each row's own positions
    gap = pos[:, :, None] - pos[:, None, :]  # (b, q, k)
    drop = ~((pos[:, None, :] < sink) | (gap < window)) & real[:, None, :] & real[:, :, None]

    def hook(scores, hook):  # (b, h, q, k)
        scores = scores.clone()
        for l, h in heads:
            if l == hook.layer:
                scores[:, h] = scores[:, h].masked_fill(drop, float("-inf"))
        return scores

    return hook


def _logits(model, ids, mask, hooks=()):
    with torch.no_grad():
        return model.run_with_hooks(ids, mask, fwd_hooks=list(hooks)).logits


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", FAMILIES)
def test_streaming_equals_an_explicit_mask(family, attn):
    hf = _sharp(family)
    ref_model = interp.load_model(copy.deepcopy(hf), attn="eager")
    ours = interp.load_model(copy.deepcopy(hf), attn=attn)
    ids, mask = padded_batch(True, lengths=(40, 29, 12))
    valid = mask.bool()
    plain = _logits(ref_model, ids, mask)
    expected = _logits(ref_model, ids, mask, [(lambda n: n.endswith("hook_attn_scores"),
                                              _reference_hook(mask, HEADS, SINK, WINDOW))])
    assert (expected - plain)[valid].abs().max() > 1e-3  # the mask matters on these inputs
    with interp.stream_heads(ours, HEADS, sink=SINK, window=WINDOW):
        got = _logits(ours, ids, mask)
    err = (got - expected)[valid].abs().max().item()
    assert err <= TOL[attn], f"{family}/{attn}: {err:.3g}"
    # one row alone (no padding) is that row of the padded batch
    with interp.stream_heads(ours, HEADS, sink=SINK, window=WINDOW):
        alone = _logits(ours, ids[1:2, -29:], None)
    assert (alone[0] - got[1, -29:]).abs().max() <= 1e-5


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_streaming_nothing_or_everything_is_the_plain_model(attn):
    hf = _sharp("llama")
    model = interp.load_model(hf, attn=attn)
    ids, mask = padded_batch(True, lengths=(20, 13))
    plain = _logits(model, ids, mask)
    with interp.stream_heads(model, []):
        assert torch.equal(_logits(model, ids, mask), plain)
    with interp.stream_heads(model, model.cfg.heads(), sink=0, window=20):  # every window covers the row
        wide = _logits(model, ids, mask)
    valid = mask.bool()
    if attn == "eager":
        assert torch.equal(wide, plain)
    else:
        assert (wide - plain)[valid].abs().max() <= 1e-5


def test_the_model_is_unchanged_after_the_block_also_after_an_exception():
    model = interp.load_model(_sharp("llama"), attn="flash")
    ids, mask = padded_batch(True)
    before = _logits(model, ids, mask)
    state = {k: v.clone() for k, v in model.hf.state_dict().items()}
    with pytest.raises(KeyError):
        with interp.stream_heads(model, HEADS, sink=1, window=2):
            assert not torch.equal(_logits(model, ids, mask), before)
            raise KeyError("inside")
    assert all(STREAM_ATTR not in m.__dict__ for m in model.hf.modules())
    assert torch.equal(_logits(model, ids, mask), before)
    assert all(torch.equal(v, model.hf.state_dict()[k]) for k, v in state.items())
    assert copy.deepcopy(model).hf is not None  # copies made inside a block do not stream
    with interp.stream_heads(model, HEADS, sink=1, window=2):
        clone = copy.deepcopy(model)
    assert torch.equal(_logits(clone, ids, mask), before)


@pytest.mark.parametrize("bad, match", [
    (dict(heads=[(0, 9)]), "out of range"), (dict(heads=[(5, 0)]), "layers run"), (dict(heads=[("blocks.0.atn", 1)]), "did you mean"), (dict(heads="0.1"), "pairs"),
    (dict(heads=[(0, 1.0)]), "pairs"), (dict(sink=-1), "sink must be"), (dict(window=0), "window must be"),
    (dict(window=True), "window must be"), (dict(sink=2.5), "sink must be"),
])
def test_bad_arguments_are_refused_clearly(bad, match):
    model = interp.load_model(tiny_hf("llama"), attn="eager")
    args = dict(heads=HEADS, sink=SINK, window=WINDOW) | bad
    with pytest.raises(ValueError, match=match):
        with interp.stream_heads(model, **args):
            pass
    assert all(STREAM_ATTR not in m.__dict__ for m in model.hf.modules())


def test_encoders_sliding_layers_and_nesting_are_refused():
    with pytest.raises(ValueError, match="causal decoder-only"):
        with interp.stream_heads(interp.load_model(tiny_hf("bert"), attn="eager"), [(0, 0)]):
            pass
    sliding = interp.load_model(tiny_hf("mistral", sliding_window=4), attn="eager")
    with pytest.raises(NotImplementedError, match="sliding window of 4 keys"):
        with interp.stream_heads(sliding, [(0, 0)]):
            pass
    model = interp.load_model(tiny_hf("llama"), attn="eager")
    with interp.stream_heads(model, [(0, 0)]):
        with pytest.raises(RuntimeError, match="nesting"):
            with interp.stream_heads(model, [(1, 0)]):
                pass
        assert STREAM_ATTR in model._attn_modules[0].__dict__  # the outer block still streams


# -- the kernel ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sink, window", [(0, 1), (3, 4), (2, 64)])
def test_the_kernel_equals_a_dense_mask_with_padding_and_sparse_ranks(sink, window):
    g = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 3, 37, 8
    q, k, v = (torch.randn(b, h, n, d, generator=g) * 3 for _ in range(3))
    k_real = torch.ones(b, n, dtype=torch.bool)
    k_real[1, :6] = False  # left padding
    k_rank = k_real.long().cumsum(1) - 1
    k_rank[0] = torch.arange(n) + torch.arange(n) // 10 * 3  # gaps, as a streaming cache's kept entries have
    q_rank = torch.where(k_real, k_rank, torch.full_like(k_rank, -1))
    out, lse = streaming_attention(q, k, v, q_rank, k_rank, k_real, sink, window, 0.3)
    gap = q_rank[:, :, None] - k_rank[:, None, :]
    allowed = (gap >= 0) & ((k_rank[:, None, :] < sink) | (gap < window)) & k_real[:, None, :]
    scores = (q @ k.transpose(2, 3) * 0.3).masked_fill(~allowed[:, None], float("-inf"))
    rows = q_rank >= 0
    expected = torch.softmax(scores, -1) @ v
    assert (out - expected).transpose(1, 2)[rows].abs().max() <= 1e-5
    assert (lse - torch.logsumexp(scores, -1)).transpose(1, 2)[rows].abs().max() <= 1e-5
    assert out.transpose(1, 2)[~rows].abs().max() == 0
    # grouped-query attention: every query head reads key/value head 0
    grouped, _ = streaming_attention(q, k[:, :1], v[:, :1], q_rank, k_rank, k_real, sink, window, 0.3,
                                     kv_index=torch.zeros(h, dtype=torch.long))
    scores = (q @ k[:, :1].transpose(2, 3) * 0.3).masked_fill(~allowed[:, None], float("-inf"))
    assert (grouped - torch.softmax(scores, -1) @ v[:, :1]).transpose(1, 2)[rows].abs().max() <= 1e-5


# -- real memory in generate -----------------------------------------------------------------------------------
def _gemma3_mixed():
    """Gemma 3's layout: sliding-window layers (9 keys) around a full-attention one."""
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           sliding_window=9, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return Gemma3ForCausalLM(cfg).eval()


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_gemma3_global_layers_stream_beside_sliding_layers(attn):
    """Gemma 3's layout: sliding-window layers around a full-attention one. The global layer's heads stream (the
    explicit-mask reference, both paths, with padding and GQA); a sliding layer's heads are refused by name."""
    hf = _gemma3_mixed()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if any(k in name for k in ("q_proj", "k_proj")) and p.ndim == 2:
                p.mul_(6.0)
    ref_model = interp.load_model(copy.deepcopy(hf), attn="eager")
    ours = interp.load_model(copy.deepcopy(hf), attn=attn)
    heads = [(1, 0), (1, 2), (1, 3)]
    ids, mask = padded_batch(True, lengths=(40, 29, 12))
    valid = mask.bool()
    plain = _logits(ref_model, ids, mask)
    expected = _logits(ref_model, ids, mask, [(lambda n: n.endswith("hook_attn_scores"),
                                              _reference_hook(mask, heads, SINK, WINDOW))])
    assert (expected - plain)[valid].abs().max() > 1e-3
    with interp.stream_heads(ours, heads, sink=SINK, window=WINDOW):
        got = _logits(ours, ids, mask)
    err = (got - expected)[valid].abs().max().item()
    assert err <= TOL[attn], f"gemma3 mixed/{attn}: {err:.3g}"
    with pytest.raises(NotImplementedError, match=r"Layer 0 already has a sliding window of 9 keys.*\[1\]"):
        with interp.stream_heads(ours, [(0, 1)]):
            pass
    assert interp.streaming.streamable_heads(ours) == [(1, h) for h in range(4)]
    from analyses.long.streaming import streaming_order
    assert sorted(streaming_order(ours, order="random", seed=3)) == [(1, h) for h in range(4)]
    # generation: the global layer's one key/value head streams in the cache, the sliding layers keep theirs
    ids = torch.randint(1, 99, (2, 30), generator=torch.Generator().manual_seed(1))
    new = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
    with interp.stream_heads(ours, [(1, h) for h in range(4)], sink=SINK, window=WINDOW) as s:
        assert s.kv_heads == [(1, 0)]
        masked = ours.hf.generate(ids, **_kv(ours, DynamicCache()), **new)
        cache = s.new_cache()
        streamed = ours.hf.generate(ids, **_kv(ours, cache), **new)
    assert torch.equal(streamed, masked)
    assert isinstance(cache.layers[1], StreamingLayer) and cache.layers[1].stream_keys.shape[2] == SINK + WINDOW
    for l in (0, 2):  # the sliding layers hold their window only, as HF's own cache for this config does
        assert cache.layers[l].keys.shape[2] == DynamicCache(config=hf.config).layers[l].sliding_window - 1 == 8


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_generate_with_a_streaming_cache_equals_the_masked_model(attn):
    model = interp.load_model(_sharp("llama"), attn=attn)
    ids = torch.randint(1, 99, (2, 30), generator=torch.Generator().manual_seed(1))
    heads = [(0, 0), (0, 1), (1, 2), (1, 3), (1, 0)]  # kv head 0 of layer 0 and kv head 1 of layer 1 stream
    new = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False)
    with interp.stream_heads(model, heads, sink=SINK, window=WINDOW) as s:
        assert s.kv_heads == [(0, 0), (1, 1)]
        masked_cache = DynamicCache()
        masked = model.hf.generate(ids, **_kv(model, masked_cache), **new)
        cache = s.new_cache()
        streamed = model.hf.generate(ids, **_kv(model, cache), **new)
    plain = model.hf.generate(ids, **new)
    assert torch.equal(streamed, masked)
    assert not torch.equal(masked, plain)  # streaming changed what the model says
    seen = ids.shape[1] + 39  # generate does not feed the last token back
    for layer in cache.layers:
        assert isinstance(layer, StreamingLayer)
        assert layer.stream_keys.shape == (2, 1, SINK + WINDOW, 8)
        assert layer.keys.shape == (2, 1, seen, 8)
    full = interp.kv_cache_bytes(masked_cache)
    assert full == 2 * 2 * 2 * 2 * seen * 8 * 4  # layers, k and v, batch, kv heads, tokens, d, fp32
    assert interp.kv_cache_bytes(cache) == full // 2 + 2 * 2 * 2 * (SINK + WINDOW) * 8 * 4


def test_a_streaming_cache_refuses_padding_and_hooks():
    model = interp.load_model(tiny_hf("llama"), attn="flash")
    ids, mask = padded_batch(True, lengths=(8, 5))
    with interp.stream_heads(model, [(0, 0), (0, 1)]) as s, torch.no_grad():
        with pytest.raises(ValueError, match="without padding"):
            model(ids, mask, **_kv(model, s.new_cache()), use_cache=True)
        with pytest.raises(ValueError, match="without attention hooks"):
            model.run_with_hooks(ids[:1], None, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: z)],
                                 **_kv(model, s.new_cache()), use_cache=True)


def test_kv_bytes_formula_is_what_a_streaming_cache_holds():
    model = interp.load_model(tiny_hf("llama", max_position_embeddings=128), attn="flash")
    ids = torch.randint(1, 99, (2, 50), generator=torch.Generator().manual_seed(0))
    heads = [(0, 0), (0, 1), (0, 2), (1, 1)]  # layer 0: kv head 0 streams (kv head 1 keeps a full query head)
    with interp.stream_heads(model, heads, sink=3, window=7) as s, torch.no_grad():
        cache = s.new_cache()
        model(ids, **_kv(model, cache), use_cache=True)
    assert s.kv_heads == [(0, 0)]
    assert interp.kv_cache_bytes(cache) == interp.streaming_kv_bytes(model, heads, 50, sink=3, window=7, batch=2)
    assert interp.streaming_kv_bytes(model, [], 50, batch=2) == 2 * 2 * 2 * 2 * 50 * 8 * 4


@pytest.mark.parametrize("tokens", [6, 40])  # shorter and longer than the sliding layers' window
def test_kv_bytes_formula_counts_what_sliding_layers_keep(tokens):
    """A sliding-window layer's cache keeps its window (HF's and ours alike), so the formula counts that, not every
    token: with the global heads streaming only the sliding layers' windows and the sinks + window remain."""
    model = interp.load_model(_gemma3_mixed(), attn="flash")
    ids = torch.randint(1, 99, (2, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = interp.output_cache(model(ids, use_cache=True))  # HF's own DynamicCache for this config
    assert interp.kv_cache_bytes(plain) == interp.streaming_kv_bytes(model, [], tokens, sink=2, window=5, batch=2)
    heads = [(1, h) for h in range(4)]
    with interp.stream_heads(model, heads, sink=2, window=5) as s, torch.no_grad():
        cache = s.new_cache()
        model(ids, **_kv(model, cache), use_cache=True)
    per_entry = 2 * 8 * 4 * 2  # keys and values, d_head 8, fp32, 2 rows
    held = 2 * min(tokens, 8) + min(tokens, 2 + 5)  # two sliding layers (8 keys before the query) + the streamed one
    assert interp.kv_cache_bytes(cache) == interp.streaming_kv_bytes(model, heads, tokens, 2, 5, batch=2)
    assert interp.kv_cache_bytes(cache) == held * per_entry


# -- streaming curves ------------------------------------------------------------------------------------------
def test_streaming_curve_steps_metric_and_memory():
    import analyses
    import pandas as pd

    model = interp.load_model(_sharp("llama"), attn="flash")
    ids = torch.randint(1, 99, (3, 40), generator=torch.Generator().manual_seed(0))
    plain = analyses.lm_loss(model(ids), {"input_ids": ids, "attention_mask": None})
    df = analyses.streaming_curve(model, ids, analyses.lm_loss, order="random", step=0.25, seeds=(0, 1), sink=2,
                                  window=4)
    assert list(df["heads_streaming"]) == [0, 2, 4, 6, 8] * 2
    first, last = df.iloc[0], df.iloc[4]
    assert first["metric"] == pytest.approx(plain, abs=1e-6) and first["kv_fraction"] == 1.0
    assert last["kv_heads_streaming"] == 4 and last["kv_fraction"] == pytest.approx(6 / 40)
    assert last["metric"] != pytest.approx(plain, abs=1e-3)  # streaming every head changes the loss
    # a score table: the lowest scores stream first
    scores = pd.DataFrame({"layer": [0] * 4 + [1] * 4, "head": list(range(4)) * 2,
                           "retrieval": [0.9, 0.1, 0.5, 0.0, 0.2, 0.8, 0.3, 0.7]})
    assert analyses.streaming_order(model, order=scores)[:3] == [(0, 3), (0, 1), (1, 0)]
    table = analyses.streaming_curve(model, ids, analyses.lm_loss, order=scores, step=0.5, sink=2, window=4)
    assert list(table["order"]) == ["retrieval"] * 3 and table["seed"].isna().all()
    with pytest.raises(ValueError, match="score to order by"):
        analyses.streaming_order(model, order=scores.rename(columns={"retrieval": "a"}).assign(b=1.0))
    with pytest.raises(ValueError, match="step is"):
        analyses.streaming_curve(model, ids, analyses.lm_loss, step=0)
    with pytest.raises(ValueError, match="window must be"):
        analyses.streaming_curve(model, ids, analyses.lm_loss, window=0)
    assert all(STREAM_ATTR not in m.__dict__ for m in model.hf.modules())
    analyses.streaming_curve_plot(df)


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_heads_that_do_not_stream_are_bit_for_bit_the_plain_models(attn):
    """Layer 0's key/value head 0 streams whole (its query heads 0 and 1), so the flash path runs the fused kernel on
    key/value head 1's query heads alone: their outputs must not move by a bit."""
    model = interp.load_model(_sharp("llama"), attn=attn)
    ids, mask = padded_batch(True, lengths=(40, 29, 12))
    names = ["blocks.0.attn.hook_z"]
    with torch.no_grad():
        _, plain = model.run_with_cache(ids, mask, names=names)
        with interp.stream_heads(model, HEADS, sink=SINK, window=WINDOW):
            _, streamed = model.run_with_cache(ids, mask, names=names)
    real = mask.bool()
    assert torch.equal(streamed["blocks.0.attn.hook_z"][:, :, 2:][real], plain["blocks.0.attn.hook_z"][:, :, 2:][real])
    assert not torch.equal(streamed["blocks.0.attn.hook_z"][:, :, :2], plain["blocks.0.attn.hook_z"][:, :, :2])


def test_the_benchmark_runs(capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_streaming

    bench_streaming.main(["--quick"])
    table = capsys.readouterr().out
    assert "| 6 (75%) | 6 |" in table and "| 0.39 |" in table  # 6 of 8 kv heads keep 10 of 51 entries


def test_right_padding_is_refused_clearly():
    model = interp.load_model(tiny_hf("llama"), attn="eager")
    ids, mask = padded_batch(False, lengths=(8, 5))  # right padding
    with interp.stream_heads(model, [(0, 0)]), pytest.raises(ValueError, match="pad on the left"):
        model(ids, mask)


# -- a cache is read only under the streaming it was made for (issue 35) ----------------------------------------
def test_a_streaming_cache_refuses_other_heads_sink_or_window_and_a_closed_block():
    """Filled under one sink/window and read under another, a cache gave logits off by 4.4 with no error; after its
    block closed, an AttributeError on SplitKV. Now both are a ValueError naming what the cache was made for, raised
    before the cache stores anything; under its own streaming (the same block reopened) it still equals the masked
    model."""
    model = interp.load_model(_sharp("llama"), attn="eager")
    ids = torch.randint(1, 99, (1, 40), generator=torch.Generator().manual_seed(0))
    heads = [(0, 0), (0, 1), (1, 2), (1, 3)]
    with torch.no_grad():
        with interp.stream_heads(model, heads, 2, 3) as s:
            cache = s.new_cache()
            model(ids[:, :30], **_kv(model, cache), use_cache=True)
            masked = model(ids).logits[:, 30:]
        for other, what in [((heads, 4, 8), "sink 4, window 8"), ((heads[:3], 2, 3), "heads 0.0, 0.1, 1.2 with")]:
            refused = pytest.raises(ValueError, match=f"made for .*now runs with .*{what}")
            with interp.stream_heads(model, *other), refused:
                model(ids[:, 30:], **_kv(model, cache), use_cache=True)
        with pytest.raises(ValueError, match="block that made the cache has closed"):
            model(ids[:, 30:], **_kv(model, cache), use_cache=True)
        assert cache.get_seq_length() == 30  # nothing was stored by the refused calls
        with interp.stream_heads(model, heads, 2, 3):
            continued = model(ids[:, 30:], **_kv(model, cache), use_cache=True).logits
    torch.testing.assert_close(continued, masked, atol=1e-5, rtol=0)


def test_a_streaming_cache_on_another_model_is_refused_by_the_attention():
    """A cache whose own check cannot see the model reading it (made for one model, read by a copy without streaming
    heads) is refused by our attention instead of an AttributeError."""
    model = interp.load_model(_sharp("llama"), attn="flash")
    other = interp.load_model(_sharp("llama"), attn="flash")
    ids = torch.randint(1, 99, (1, 20), generator=torch.Generator().manual_seed(0))
    with interp.stream_heads(model, [(0, 0), (0, 1)], 2, 3) as s, torch.no_grad():
        cache = s.new_cache()
        model(ids, **_kv(model, cache), use_cache=True)
        with pytest.raises(ValueError, match="layer 0 now runs with no streaming head"):
            other(ids, **_kv(other, cache), use_cache=True)


def test_a_model_without_a_full_attention_layer_has_no_head_to_stream():
    """Mistral with a sliding window on every layer (as Phi-3, Starcoder2, GPT-OSS): streaming_curve and the report's
    streaming section raised ZeroDivisionError; now a ValueError that says no head can stream, and why."""
    import analyses
    from analyses.views.report_streaming import check_streaming

    model = interp.load_model(tiny_hf("mistral", sliding_window=4), attn="eager")
    assert streamable_heads(model) == []
    ids = torch.randint(1, 99, (2, 20), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="streaming_curve: no head of this mistral model can stream: every layer "
                                         "already has a sliding window of 4 keys"):
        analyses.streaming_curve(model, ids, analyses.lm_loss, window=4)
    with pytest.raises(ValueError, match="streaming section: no head .* Leave out streaming=True"):
        check_streaming(model)


def test_a_note_says_how_many_key_value_heads_really_shrink():
    """Streaming half of SmolLM2's query heads shrank its cache only to 0.82x, said only in the docs: a key/value head
    shrinks only when all its query heads stream. stream_heads and stream_model now say how many do (KVHeadsNote),
    where some streaming heads share their key/value head with heads that do not stream; streaming_curve, whose
    table counts them, stays quiet."""
    import warnings

    import analyses
    from interp.streaming import KVHeadsNote

    model = interp.load_model(tiny_hf("llama"), attn="eager")  # 2 layers of 4 query heads on 2 key/value heads
    note = (r"Streaming these 3 query heads shrinks the cache of 1 of the model's 4 key/value heads: a key/value head "
            r"keeps only sink \+ window entries when all its query heads \(here 2\) stream, and 1 that they read also "
            r"serve heads that do not stream")
    with pytest.warns(KVHeadsNote, match=note) as caught, interp.stream_heads(model, HEADS) as s:
        assert s.kv_heads == [(0, 0)]
    assert caught[0].filename == __file__  # pointed at the caller's line
    with pytest.warns(KVHeadsNote, match=note):
        interp.stream_model(model, HEADS)
    ids = torch.randint(1, 99, (2, 20), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVHeadsNote)
        with interp.stream_heads(model, [(0, 0), (0, 1), (1, 2), (1, 3)]):  # whole groups: nothing to say
            pass
        interp.stream_model(model, [(0, 0), (0, 1)])
        analyses.streaming_curve(model, ids, analyses.lm_loss, step=0.375, seeds=(0,), sink=1, window=4)
