"""Edge circuits on every kind of block (issue 48, item 6): sandwich norms (Gemma 2/3, OLMo2: a norm on each
sublayer's output before the residual add), parallel blocks (GPT-NeoX, Phi: attention and MLP read the same input),
OLMo2's norm over every head's q and k together (post-norm encoders: tests/test_edge_circuit_postnorm.py). One edge
patched either way equals a recomputation by hand from the HF modules themselves; every edge gives the other run and
none the run itself, on both attention paths. Kinds the graph does not cover are refused in one line, and bad input
gets one line (the model left as it was after a metric raises: tests/test_edge_circuits.py, on these kinds too)."""

from __future__ import annotations

import pytest
import torch

import interp
from analyses import edge_attribution, edge_patching, faithfulness, graph_edges, logit_difference
from test_edge_circuits import _head_input_by_hand, _pair
from tests.tiny import tiny_model

TOL = 1e-5

# per family: the MLP's input norm (None: the MLP reads the stream as it is), its output norm (sandwich), and whether
# the block is parallel (the MLP reads the block's input)
KINDS = {"gemma3_text": ("pre_feedforward_layernorm", "post_feedforward_layernorm", False),
         "olmo2": (None, "post_feedforward_layernorm", False),
         "phi": ("input_layernorm", None, True),
         "gpt_neox": ("post_attention_layernorm", None, True),
         "modernbert": ("mlp_norm", None, False)}  # an encoder, read through a classifier on the pooled output


def _load(family, **kw):
    if family == "modernbert":
        from transformers import ModernBertForSequenceClassification
        return interp.load_model(tiny_model(family, cls=ModernBertForSequenceClassification), **kw)
    return interp.load_model(tiny_model(family), **kw)


def _layer(model, l):
    return model.hf.get_submodule(model.structure.layers)[l]


def _capture(model, ids, modules):
    """Each module's input and output on ``ids``."""
    got, handles = {}, []
    for key, module in modules.items():
        handles.append(module.register_forward_hook(
            lambda m, args, out, key=key: got.update({key: (args[0], out[0] if isinstance(out, tuple) else out)})))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return got


def _node(model, family, ids, name):
    """A node's output recomputed by hand: a head's z times its slice of the output projection (times the
    post-attention norm's ``out / in`` of that run, where there is one), an MLP's added output, the first block's
    input."""
    _, out_norm, _ = KINDS[family]
    if name == "input":
        return _capture(model, ids, {"b": _layer(model, 0)})["b"][0]
    if name.startswith("mlp."):
        block = _layer(model, int(name[4:]))
        return _capture(model, ids, {"m": block.get_submodule(out_norm or "mlp")})["m"][1]
    site, head = name.split(":")
    l, h = int(site.split(".")[1]), int(head)
    block, s = _layer(model, l), model.structure
    o_proj = block.get_submodule(s.o_proj[l])
    got = _capture(model, ids, {"o": o_proj})
    z, a = got["o"]
    d = z.shape[-1] // model.cfg.sites[l].n_heads
    result = z[..., h * d:(h + 1) * d] @ o_proj.weight[:, h * d:(h + 1) * d].T
    if s.post_attn_norm[l] is not None:
        with torch.no_grad():
            result = result * block.get_submodule(s.post_attn_norm[l])(a) / a
    return result


def _replace_output(module, value):
    return module.register_forward_hook(lambda m, args, out: value)


def _by_hand(model, family, base, other, up, down):
    """The base run in which only ``down``'s input reads base's stream plus (other's - base's) output of ``up``."""
    delta = _node(model, family, other, up) - _node(model, family, base, up)
    in_norm, out_norm, parallel = KINDS[family]
    n = model.cfg.n_layers
    with torch.no_grad():
        if down == "logits":
            final = model.final_norm()
            h = final.register_forward_pre_hook(lambda m, args: (args[0] + delta,))
            try:
                return model(base).logits
            finally:
                h.remove()
        if down.startswith("mlp."):
            block = _layer(model, int(down[4:]))
            reader = block.get_submodule(in_norm or "mlp")
            x = _capture(model, base, {"x": reader})["x"][0]  # the stream the MLP reads (parallel: the block's input)
            y = x + delta
            y = block.mlp(block.get_submodule(in_norm)(y) if in_norm else y)
            y = block.get_submodule(out_norm)(y) if out_norm else y
            h = _replace_output(block.get_submodule(out_norm or "mlp"), y)
            try:
                return model(base).logits
            finally:
                h.remove()
        return _head_input_by_hand(model, base, down, lambda act, hook: act + delta)


EDGES = [("input", "blocks.1.attn:3.q"), ("blocks.0.attn:1", "blocks.1.attn:1.k"), ("mlp.0", "blocks.1.attn:0.v"),
         ("blocks.0.attn:2", "mlp.1"), ("input", "mlp.0"), ("mlp.1", "logits"), ("blocks.1.attn:3", "logits")]


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", list(KINDS))
def test_one_edge_equals_a_recomputation_by_hand_on_every_kind_of_block(family, attn):
    model = _load(family, attn=attn)
    clean, corrupted = _pair()
    with torch.no_grad():
        plain = {"clean": model(clean).logits, "corrupted": model(corrupted).logits}
    for run, (base, other) in (("clean", (clean, corrupted)), ("corrupted", (corrupted, clean))):
        for up, down in EDGES:
            got = edge_patching(model, clean, corrupted, [(up, down)], run=run).logits
            want = _by_hand(model, family, base, other, up, down)
            assert (got - plain[run]).abs().max() > 1e-4, (up, down)  # the edge matters
            assert (got - want).abs().max() <= TOL, (run, up, down, float((got - want).abs().max()))


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", [*KINDS, "gemma2", "cohere", "opt", "roberta", "distilbert", "electra"])
def test_every_edge_gives_the_other_run_and_none_the_run_on_every_kind_of_block(family, attn):
    model = _load(family, attn=attn)
    clean, corrupted = _pair(1)
    every = [(u.name, r.name) for u, r in graph_edges(model)]
    with torch.no_grad():
        logits = {"clean": model(clean).logits, "corrupted": model(corrupted).logits}
    assert (logits["clean"] - logits["corrupted"]).abs().max() > 1e-2
    for run, other in (("clean", "corrupted"), ("corrupted", "clean")):
        assert (edge_patching(model, clean, corrupted, every, run=run).logits - logits[other]).abs().max() <= TOL
        assert torch.equal(edge_patching(model, clean, corrupted, [], run=run).logits, logits[run])


@pytest.mark.parametrize("family", ["phi", "gpt_neox"])
def test_a_parallel_blocks_heads_do_not_feed_its_own_mlp(family):
    model = interp.load_model(tiny_model(family))
    pairs = {(u.name, r.name) for u, r in graph_edges(model)}
    assert ("blocks.0.attn:0", "mlp.0") not in pairs and ("blocks.0.attn:0", "mlp.1") in pairs
    assert ("mlp.0", "mlp.1") in pairs and ("input", "mlp.0") in pairs
    with pytest.raises(ValueError, match="no edge blocks.1.attn:2 -> mlp.1: .*parallel block"):
        edge_patching(model, *_pair(), [("blocks.1.attn:2", "mlp.1")])
    pre = {(u.name, r.name) for u, r in graph_edges(interp.load_model(tiny_model("gemma3_text")))}
    assert ("blocks.0.attn:0", "mlp.0") in pre  # a sequential block's heads do


def test_models_the_graph_does_not_cover_are_refused_in_one_line_naming_why():
    from test_seq2seq import _tiny as tiny_seq2seq

    for model, why in ((interp.load_model(tiny_model("deepseek_v3")), "q, k and v input at its projection.*q_a_layernorm"),
                       (interp.load_model(tiny_seq2seq("bart")), "BartForConditionalGeneration's blocks are post-norm"),
                       (interp.load_model(tiny_model("gemma3_text", attention_bias=True)),
                        "output projection adds a bias before the norm")):
        with pytest.raises(ValueError, match=why) as err:
            graph_edges(model)
        assert "\n" not in str(err.value)
    # post-norm encoders are covered (tests/test_edge_circuit_postnorm.py): BERT is no longer refused
    assert len(graph_edges(interp.load_model(tiny_model("bert")))) == 110
    assert graph_edges(interp.load_model(tiny_seq2seq("t5")))  # a pre-norm encoder-decoder has a graph (test_edge_circuit_seq2seq)


@pytest.mark.parametrize("family", ["gemma3_text", "phi"])
def test_bad_input_on_new_kinds_gets_one_line(family):
    model = interp.load_model(tiny_model(family))
    clean, corrupted = _pair(3)
    n_kv = model.cfg.sites[1].n_kv_heads
    for edge, why in (((f"blocks.1.attn:0", "blocks.1.attn:0.q"), "no edge blocks.1.attn:0 -> blocks.1.attn:0.q"),
                      (("input", f"blocks.1.attn:{n_kv}.k"), f"No downstream input 'blocks.1.attn:{n_kv}.k'"),
                      (("blocks.0.attn:9", "logits"), "No upstream node 'blocks.0.attn:9'")):
        with pytest.raises(ValueError, match=why):
            edge_patching(model, clean, corrupted, [edge])
    flat = lambda out, inputs: out.logits[:, -1, 0].mean() * 0.0  # noqa: E731  (computed from the output, constant)
    with pytest.raises(ValueError, match="gradient is 0 at every one"):
        edge_attribution(model, clean, corrupted, flat, method="eap")
    scores = edge_attribution(model, clean, corrupted, logit_difference(5, 7), method="eap")
    with pytest.raises(ValueError, match="the same on both runs"):
        faithfulness(model, clean, corrupted, flat, scores, sizes=(3,), n_random=1)


@pytest.mark.parametrize("family", ["gemma3_text", "olmo2", "phi", "gpt_neox"])
def test_eap_on_the_flash_path_equals_the_eager_path_on_every_kind_of_block(family):
    clean, corrupted = _pair(5)
    metric = logit_difference(5, 7)
    got = {attn: edge_attribution(_load(family, attn=attn), clean, corrupted, metric, method="eap")
           for attn in ("eager", "flash")}
    assert got["eager"]["score"].abs().max() > 0.01
    assert set(got["eager"]["input"]) == {"q", "k", "v", "mlp", "logits"}
    assert (got["eager"]["score"] - got["flash"]["score"]).abs().max() <= 1e-4


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "gemma3_text", "phi"])
def test_gradients_carried_back_by_the_columns_weight_equal_autograd_through_the_projection(family, monkeypatch):
    """Edge attribution carries a head's column gradient back by ``g @ W[cols]`` and the norm's backward batched over
    the receivers sharing it; autograd through each receiver's own projection and norm gives the same scores (GPT-2:
    a transposed Conv1D and a LayerNorm; GPT-NeoX: interleaved q/k/v columns; Gemma 3: sandwich norms)."""
    from analyses.circuits import taps

    model = interp.load_model(tiny_model(family), attn="flash")
    clean, corrupted = _pair(4)
    metric = logit_difference(5, 7)
    fast = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=2)
    reading = taps.reading
    monkeypatch.setattr(taps, "reading", lambda model, r: reading(model, r)._replace(weight=None))
    slow = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=2)
    assert fast["score"].abs().max() > 0.1
    assert (fast["score"] - slow["score"]).abs().max() <= 1e-5 * fast["score"].abs().max()
