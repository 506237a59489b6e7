"""The permanent streaming conversion (``interp.stream_model``, issue 26): the converted model computes exactly what
the ``stream_heads`` block computes, on both paths, in forward and in ``generate`` (with a StreamingCache by
default), survives save/load, copies and pickles, composes with pruning, and leaves the user's model untouched."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from conftest import padded_batch, tiny_hf
from test_streaming import FAMILIES, HEADS, SINK, WINDOW, _logits, _sharp
from transformers import DynamicCache

import interp
from analyses import ablate_heads, prune_model
from interp.streaming import StreamingCache, StreamingLayer, streaming_record
from interp.streaming.cache import STREAM_ATTR
from interp.streaming.model import CONFIG_KEY

# most tests here stream part of a key/value group on purpose: the note that says so is tested on its own
pytestmark = pytest.mark.filterwarnings("ignore::interp.streaming.KVHeadsNote")


@pytest.fixture(scope="module")
def batch():
    return padded_batch(True, lengths=(40, 29, 12))


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_converted_model_is_the_streaming_block_bit_for_bit(family, attn, batch, tmp_path):
    ids, mask = batch
    model = interp.load_model(_sharp(family), attn=attn)
    plain = _logits(model, ids, mask)
    state = {k: v.clone() for k, v in model.hf.state_dict().items()}
    with interp.stream_heads(model, HEADS, sink=SINK, window=WINDOW):
        expected = _logits(model, ids, mask)
    assert (expected - plain)[mask.bool()].abs().max() > 1e-3  # streaming matters on these inputs
    streamed = interp.stream_model(model, HEADS, sink=SINK, window=WINDOW)
    assert torch.equal(_logits(streamed, ids, mask), expected)
    assert torch.equal(_logits(streamed, ids, mask), expected)  # and stays so: not a one-shot block
    # the user's model: same outputs, weights, config, no streaming spec
    assert torch.equal(_logits(model, ids, mask), plain)
    assert all(torch.equal(v, model.hf.state_dict()[k]) for k, v in state.items())
    assert getattr(model.hf.config, CONFIG_KEY, None) is None
    assert all(STREAM_ATTR not in m.__dict__ for m in model.hf.modules())
    assert streaming_record(streamed) == {"sink": SINK, "window": WINDOW, "heads": HEADS}
    # save and load, a copy, a pickle, the other path
    streamed.save_pretrained(tmp_path)
    loaded = interp.load_model(tmp_path, attn=attn)
    assert torch.equal(_logits(loaded, ids, mask), expected)
    assert torch.equal(_logits(copy.deepcopy(streamed), ids, mask), expected)
    assert torch.equal(_logits(pickle.loads(pickle.dumps(streamed)), ids, mask), expected)
    other = interp.load_model(tmp_path, attn="flash" if attn == "eager" else "eager")
    assert (_logits(other, ids, mask) - expected)[mask.bool()].abs().max() <= 1e-5
    assert torch.equal(_logits(other.set_attn(attn), ids, mask), expected)  # switching paths keeps streaming
    bare = interp.load_model(copy.deepcopy(streamed.hf), attn=attn)  # a copy of the HF model, wrapped again
    assert torch.equal(_logits(bare, ids, mask), expected)
    # a forward with HF's own cache (use_cache=True builds a DynamicCache) computes the same
    with torch.no_grad():
        cached = streamed.hf(input_ids=ids[1:2, -29:], use_cache=True).logits
    assert (cached[0] - expected[1, -29:]).abs().max() <= 1e-5


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_generate_uses_a_streaming_cache_and_equals_the_masked_model(attn):
    model = interp.load_model(_sharp("llama"), attn=attn)
    ids = torch.randint(1, 99, (2, 30), generator=torch.Generator().manual_seed(1))
    heads = [(0, 0), (0, 1), (1, 2), (1, 3), (1, 0)]  # kv head 0 of layer 0 and kv head 1 of layer 1 stream
    new = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, return_dict_in_generate=True)
    with interp.stream_heads(model, heads, sink=SINK, window=WINDOW):
        masked = model.hf.generate(ids, **{interp.cache_kwarg(model.hf): DynamicCache()}, **new).sequences
    streamed = interp.stream_model(model, heads, sink=SINK, window=WINDOW)
    out = streamed.hf.generate(ids, **new)
    assert torch.equal(out.sequences, masked)
    assert not torch.equal(model.hf.generate(ids, **new).sequences, masked)  # streaming changed the tokens
    cache = out.past_key_values
    assert isinstance(cache, StreamingCache)
    for layer in cache.layers:
        assert isinstance(layer, StreamingLayer)
        assert layer.stream_keys.shape == (2, 1, SINK + WINDOW, 8)  # only sink + window entries
    assert interp.kv_cache_bytes(cache) == interp.streaming_kv_bytes(model, heads, 30 + 39, SINK, WINDOW, batch=2)
    # padding: a DynamicCache, under which the masked model gives the same tokens
    pad_ids, pad_mask = padded_batch(True, lengths=(20, 13))
    with interp.stream_heads(model, heads, sink=SINK, window=WINDOW):
        masked = model.hf.generate(pad_ids, attention_mask=pad_mask, **new).sequences
    out = streamed.hf.generate(pad_ids, attention_mask=pad_mask, **new)
    assert type(out.past_key_values) is DynamicCache
    assert torch.equal(out.sequences, masked)
    # an active attention hook: a DynamicCache too (a StreamingCache runs without hooks)
    with streamed.hooks([("blocks.0.attn.hook_z", lambda z, hook: z)]):
        out = streamed.hf.generate(ids, **new)
    assert type(out.past_key_values) is DynamicCache


def test_pruning_and_streaming_compose_in_either_order(batch, tmp_path):
    ids, mask = batch
    model = interp.load_model(_sharp("llama"), attn="flash")
    gone = [(0, 1), (1, 1)]
    with interp.stream_heads(model, HEADS, sink=SINK, window=WINDOW), ablate_heads(model, gone):
        expected = _logits(model, ids, mask)
    valid = mask.bool()
    both = prune_model(interp.stream_model(model, HEADS, sink=SINK, window=WINDOW), gone)
    assert both.cfg.heads_per_layer == (3, 3)
    assert streaming_record(both)["heads"] == [(0, 0), (1, 1)]  # (0, 1) was pruned; original (1, 2) is now (1, 1)
    assert (_logits(both, ids, mask) - expected)[valid].abs().max() <= 1e-5
    pruned = prune_model(model, gone)
    other = interp.stream_model(pruned, [(0, 0), (1, 1)], sink=SINK, window=WINDOW)
    assert getattr(other.hf.config, CONFIG_KEY)["heads"] == {0: [0], 1: [2]}  # original numbering
    assert (_logits(other, ids, mask) - expected)[valid].abs().max() <= 1e-5
    both.save_pretrained(tmp_path)
    loaded = interp.load_model(tmp_path, attn="flash")
    assert torch.equal(_logits(loaded, ids, mask), _logits(both, ids, mask))
    # layer 0 keeps original heads 0, 2, 3 on 3 key/value heads: the streamed head's key/value head shrinks
    out = loaded.hf.generate(ids[:1, -12:], max_new_tokens=10, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.past_key_values.layers[0], StreamingLayer)


@pytest.mark.parametrize("bad, error, match", [
    (dict(heads=[(0, 9)]), ValueError, "out of range"), (dict(heads=[(5, 0)]), ValueError, "layers run"),
    (dict(sink=-1), ValueError, "sink must be"), (dict(window=0), ValueError, "window must be"),
    (dict(window=2.5), ValueError, "window must be"),
])
def test_bad_arguments_are_refused_clearly(bad, error, match):
    model = interp.load_model(tiny_hf("llama"), attn="eager")
    with pytest.raises(error, match=match):
        interp.stream_model(model, **(dict(heads=HEADS, sink=SINK, window=WINDOW) | bad))
    assert getattr(model.hf.config, CONFIG_KEY, None) is None


def test_sliding_layers_encoders_a_second_conversion_and_hooks_are_refused():
    sliding = interp.load_model(tiny_hf("mistral", sliding_window=4), attn="eager")
    with pytest.raises(NotImplementedError, match="sliding window of 4 keys"):
        interp.stream_model(sliding, [(0, 0)])
    with pytest.raises(ValueError, match="causal decoder-only"):
        interp.stream_model(interp.load_model(tiny_hf("bert"), attn="eager"), [(0, 0)])
    model = interp.load_model(tiny_hf("llama"), attn="eager")
    streamed = interp.stream_model(model, [(0, 0)])
    with pytest.raises(ValueError, match="converts a model once"):
        interp.stream_model(streamed, [(1, 0)])
    with pytest.raises(RuntimeError, match="nesting"):  # a block on a converted model: its layers already stream
        with interp.stream_heads(streamed, [(1, 0)]):
            pass
    with interp.stream_heads(model, [(0, 0)]):
        with pytest.raises(RuntimeError, match="open stream_heads block"):
            interp.stream_model(model, [(1, 0)])
    with model.hooks([("blocks.0.attn.hook_z", lambda z, hook: z)]):
        with pytest.raises(ValueError, match="Remove the hooks"):
            interp.stream_model(model, [(0, 0)])


def test_a_bad_record_in_a_folder_is_refused_clearly(tmp_path):
    model = interp.load_model(tiny_hf("llama"), attn="eager")
    streamed = interp.stream_model(model, [(0, 0)])
    streamed.hf.config.interp_streaming_heads = {"sink": 4, "heads": {0: [0]}}
    streamed.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="interp_streaming_heads must be"):
        interp.load_model(tmp_path)


@pytest.mark.parametrize("heads, match", [
    ({"0": [99]}, r"\['heads'\]\[0\] names head 99; heads are whole numbers 0..3"),
    ({"0": [-1]}, r"names head -1; heads are whole numbers 0..3"),
    ({"0": [True]}, r"names head True; heads are whole numbers 0..3"),
    ({"0": [1.7]}, r"names head 1.7; heads are whole numbers 0..3"),
    ({"0": ["a"]}, r"names head 'a'; heads are whole numbers 0..3"),
    ({"0": 1}, r"\['heads'\]\[0\] must be a list of head numbers; got 1"),
    ({"2": [0]}, r"names layer '2'; this model's layers are 0..1"),
    ({"-1": [0]}, r"names layer '-1'; this model's layers are 0..1"),
    ({"x": [0]}, r"names layer 'x'; this model's layers are 0..1"),
])
def test_a_record_that_does_not_describe_the_model_is_refused(tmp_path, heads, match):
    """A record naming head 99, -1 or true loaded and quietly dropped the head, 1.7 became head 1, 'a' gave a raw
    error: each is now a ValueError naming the field, the value and the valid range."""
    model = interp.load_model(tiny_hf("llama"), attn="eager")
    streamed = interp.stream_model(model, [(0, 0)])
    streamed.hf.config.interp_streaming_heads = {"sink": 4, "window": 8, "heads": heads}
    streamed.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        interp.load_model(tmp_path)


@pytest.mark.parametrize("field, value, match", [("sink", -1, r"\['sink'\] must be a whole number >= 0"),
                                                 ("window", 2.5, r"\['window'\] must be a whole number >= 1"),
                                                 ("window", True, r"\['window'\] must be a whole number >= 1")])
def test_a_record_with_a_bad_sink_or_window_names_the_field(tmp_path, field, value, match):
    model = interp.load_model(tiny_hf("llama"), attn="eager")
    streamed = interp.stream_model(model, [(0, 0)])
    streamed.hf.config.interp_streaming_heads = {"sink": 4, "window": 8, "heads": {"0": [0]}} | {field: value}
    streamed.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        interp.load_model(tmp_path)


def test_a_record_of_a_pruned_model_counts_heads_as_the_unpruned_model(tmp_path):
    """Heads are numbered as in the unpruned model: one that pruning removed no longer streams, one beyond the
    unpruned model's count is refused."""
    model = interp.load_model(tiny_hf("llama"), attn="eager")
    pruned = prune_model(interp.stream_model(model, [(0, 0), (0, 3)]), [(0, 0), (0, 1)])
    assert streaming_record(pruned)["heads"] == [(0, 1)]  # original head 3 is now head 1; head 0 went
    pruned.hf.config.interp_streaming_heads["heads"] = {0: [0, 4]}
    with pytest.raises(ValueError, match=r"names head 4; heads are whole numbers 0..3 \(numbered as in the unpruned"):
        streaming_record(pruned)
