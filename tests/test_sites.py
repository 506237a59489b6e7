"""One model of heads (issue 23): every model is a list of attention sites, every head a (site, head), one public
class and one version of each study with the same leading columns on every model."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_hf
from test_seq2seq import _tiny

import interp
from analyses import (ablate_heads, ablation_scan, activation_patching, attribution_patching, head_importance, lm_loss,
                      path_patching)
from analyses.data.metrics import target_loss
from analyses.data.seq2seq import copy_task, is_seq2seq
from hooks import ActivationCache
from interp.attention.sites import FRONT, check_heads, head_columns
from interp.lens.resid import ModelCache


@pytest.fixture(scope="module")
def llama():
    return interp.HookedModel(tiny_hf("llama"), attn="eager")


@pytest.fixture(scope="module")
def t5():
    return interp.load_model(_tiny("t5"), attn="eager")


def test_every_model_is_one_public_class_with_sites(llama, t5):
    assert type(llama) is type(t5) is interp.HookedModel  # no subclass per architecture: what differs is data
    assert type(interp.HookedModel(_tiny("bart"))) is interp.HookedModel  # the class itself takes seq2seq models
    assert type(copy.deepcopy(t5)) is interp.HookedModel
    assert (llama.cfg.stacks, t5.cfg.stacks) == (("decoder",), ("encoder", "decoder"))
    assert [s.name for s in llama.cfg.sites] == [f"blocks.{l}.attn" for l in range(llama.cfg.n_layers)]
    assert {s.stack for s in llama.cfg.sites} == {"decoder"} and all(s.causal for s in llama.cfg.sites)
    assert llama.sites["blocks.1.attn"].n_heads == llama.cfg.heads_per_layer[1]
    kinds = {(s.stack, s.kind) for s in t5.cfg.sites}
    assert kinds == {("encoder", "self"), ("decoder", "self"), ("decoder", "cross")}
    cross = next(s for s in t5.cfg.sites if s.kind == "cross")
    assert (cross.queries, cross.keys, cross.query_mask) == ("decoder_input_ids", "input_ids", "decoder_attention_mask")
    bert = interp.HookedModel(tiny_hf("bert"))
    assert {s.stack for s in bert.cfg.sites} == {"encoder"} and not any(s.causal for s in bert.cfg.sites)


def test_one_cache_class_rebuilds_any_sites_pattern_the_same_way_on_every_model(llama, t5):
    """``cache.pattern(site name or layer, heads)`` from a run's q and k equals that run's own pattern bit for bit,
    on a decoder-only model (left padding) and an encoder-decoder one (T5's position bias, cross-attention)."""
    ids = torch.randint(1, 99, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    for model, batch in ((llama, {"input_ids": ids, "attention_mask": mask}), (t5, copy_task(t5, 3, 6))):
        _, eager = model.run_with_cache(batch)
        _, qk = model.run_with_cache(batch, names=lambda n: n.endswith(("hook_q", "hook_k")))
        # one class on every model: ModelCache, the ActivationCache that knows its model (TransformerLens's methods)
        assert type(eager) is type(qk) is ModelCache and isinstance(qk, ActivationCache)
        assert is_seq2seq(qk) == is_seq2seq(model)
        assert [s.name for s in qk.sites] == [s.name for s in model.cfg.sites]
        for site in model.cfg.sites:
            heads = [0, site.n_heads - 1]
            assert f"{site.name}.hook_pattern" not in list(qk)  # not kept: built on access (issue 53)
            assert torch.equal(qk.pattern(site.name, heads), eager[f"{site.name}.hook_pattern"][:, heads]), site.name
            assert torch.equal(qk[f"{site.name}.hook_pattern"], qk.pattern(site.name)), site.name
    assert torch.equal(qk.pattern(0, 1), qk.pattern(t5.cfg.sites[0].name, 1))  # t5: an index into its sites
    _, cache = llama.run_with_cache(ids, names=lambda n: n.endswith(("hook_q", "hook_k")))
    assert torch.equal(cache.pattern("blocks.1.attn", 2), cache.pattern(1, 2))  # a layered model: layer or site
    with pytest.raises(KeyError, match="not an attention site of this model; give a site such as"):
        cache.pattern("decoder.blocks.1.attn")


def test_a_layered_model_takes_site_names_wherever_it_takes_layers(llama):
    assert check_heads(llama, [("blocks.1.attn", 2), (0, 1)]) == [(0, 1), (1, 2)]
    assert check_heads(llama, ("blocks.0.attn", 1)) == [(0, 1)]
    ids = torch.randint(1, 99, (2, 8), generator=torch.Generator().manual_seed(0))
    by_layer = ablation_scan(llama, ids, lm_loss, heads=[(0, 1), (1, 2)])
    by_site = ablation_scan(llama, ids, lm_loss, heads=[("blocks.0.attn", 1), ("blocks.1.attn", 2)])
    assert by_layer.equals(by_site)
    with torch.no_grad(), ablate_heads(llama, [("blocks.1.attn", 0)]):
        a = llama(ids).logits
    with torch.no_grad(), ablate_heads(llama, [(1, 0)]):
        b = llama(ids).logits
    assert torch.equal(a, b) and not torch.equal(a, llama(ids).logits)
    corrupted = ids.flip(0)
    for study in (lambda heads: activation_patching(llama, ids, corrupted, lm_loss, heads=heads),
                  lambda heads: attribution_patching(llama, ids, corrupted, lm_loss, heads=heads),
                  lambda heads: path_patching(llama, ids, corrupted, [(1, 3)], lm_loss, senders=heads),
                  lambda heads: head_importance(llama, ids, lm_loss, ablated=heads)):
        assert study([(0, 1), (0, 2)]).equals(study([("blocks.0.attn", 1), ("blocks.0.attn", 2)]))
    with pytest.raises(ValueError, match="not an attention site of this model; did you mean 'blocks.1.attn'"):
        check_heads(llama, [("blocks.1.atn", 0)])
    with pytest.raises(ValueError, match="Head 99 is out of range"):
        check_heads(llama, [("blocks.1.attn", 99)])


def test_an_encoder_decoder_model_refuses_layer_numbers_with_the_fix(t5):
    with pytest.raises(ValueError, match=r"ambiguous in a model with several stacks; .*\(site, head\) pairs"):
        check_heads(t5, [(0, 1)])
    site = t5.cfg.sites[-1].name
    assert check_heads(t5, [(site, 1)]) == [(site, 1)]


def test_ablation_scan_has_the_same_columns_on_every_model(llama, t5):
    ids = torch.randint(1, 99, (2, 8), generator=torch.Generator().manual_seed(0))
    decoder = ablation_scan(llama, ids, lm_loss)
    seq2seq = ablation_scan(t5, copy_task(t5, 4, 6), target_loss())
    assert list(decoder.columns) == list(seq2seq.columns) == [*FRONT, "metric", "delta", "baseline"]
    assert decoder[["stack", "kind"]].drop_duplicates().values.tolist() == [["decoder", "self"]]
    assert set(seq2seq["kind"]) == {"self", "cross"} and set(seq2seq["stack"]) == {"encoder", "decoder"}
    assert head_columns(llama, (1, 2)) == {"stack": "decoder", "kind": "self", "site": "blocks.1.attn", "layer": 1,
                                           "head": 2}


def test_path_patching_on_an_encoder_decoder_model_equals_the_two_runs_by_hand(t5):
    """An encoder head sends into a cross-attention head's keys (they read the encoder's output)."""
    batch = copy_task(t5, 3, 6, seed=1)
    other = torch.randint(3, 24, batch["input_ids"].shape, generator=torch.Generator().manual_seed(5))
    corrupted = {**batch, "input_ids": other}
    metric, receiver, via = target_loss(batch["labels"]), ("decoder.blocks.1.cross_attn", 2), "k"
    df = path_patching(t5, batch, corrupted, [receiver], metric, via=via, heads_per_forward=5)
    alone = path_patching(t5, batch, corrupted, [receiver], metric, via=via, heads_per_forward=1)
    assert list(df.columns[:5]) == FRONT and (df["metric"] - alone["metric"]).abs().max() <= 1e-5
    assert set(df["site"]) == {"encoder.blocks.0.attn", "encoder.blocks.1.attn", "decoder.blocks.0.attn",
                               "decoder.blocks.0.cross_attn", "decoder.blocks.1.attn"}
    z = [f"{s.name}.hook_z" for s in t5.cfg.sites]
    feed = {k: batch.get(k) for k in ("decoder_input_ids", "decoder_attention_mask")}
    _, c = t5.run_with_cache(batch["input_ids"], batch["attention_mask"], names=z, **feed)
    _, x = t5.run_with_cache(corrupted["input_ids"], batch["attention_mask"], names=z, **feed)
    for sender in [("encoder.blocks.0.attn", 1), ("encoder.blocks.1.attn", 3), ("decoder.blocks.0.attn", 0)]:
        def freeze(act, hook):
            out = x[hook.name].clone()
            if hook.name == f"{sender[0]}.hook_z":
                out[:, :, sender[1]] = c[hook.name][:, :, sender[1]]
            return out

        name = f"{receiver[0]}.hook_{via}"
        _, mixed = t5.run_with_cache(corrupted["input_ids"], batch["attention_mask"], names=[name],
                                     fwd_hooks=[(z, freeze)], **feed)

        def put(act, hook):
            act = act.clone()
            act[:, :, receiver[1]] = mixed[name][:, :, receiver[1]]
            return act

        with torch.no_grad():
            out = t5.run_with_hooks(corrupted["input_ids"], batch["attention_mask"], fwd_hooks=[(name, put)], **feed)
        got = df.set_index(["site", "head"]).loc[sender, "metric"]
        assert abs(got - metric(out, corrupted)) <= 1e-5, sender
    decoder_only = df[df["stack"] == "decoder"]  # decoder heads cannot reach keys computed from the encoder
    assert (decoder_only["metric"] - df.attrs["corrupted"]).abs().max() <= 1e-5
    assert (df[df["stack"] == "encoder"]["metric"] - df.attrs["corrupted"]).abs().max() > 1e-4


def test_a_decoder_with_cross_attention_layers_fed_by_another_model_is_refused_by_name():
    """mllama's text model: its cross-attention layers read vision states the wrapper does not feed (and a forward
    without them skips those layers), so they cannot be sites yet: refused before the probe, naming the layers."""
    from transformers import MllamaForCausalLM, MllamaTextConfig

    config = MllamaTextConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1],
                              max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with pytest.raises(NotImplementedError, match=r"cross_attention_layers=\[1\].*vision or encoder states"):
        interp.load_model(MllamaForCausalLM(config))
