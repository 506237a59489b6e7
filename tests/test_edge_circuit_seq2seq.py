"""Edge circuits on a pre-norm encoder-decoder (issue 48, items 2 and 6: T5). Two residual streams: encoder nodes
feed encoder inputs and every cross-attention head's k and v (through the encoder's final norm), decoder nodes feed
decoder self-attention, cross-attention q, decoder MLPs and the logits. One edge patched either way equals a
recomputation by hand from the HF modules (only that receiver's input moves by the sender's output difference,
through the receiver's own norm), on both attention paths; on an attention-only T5 one edge clean equals
``path_patching`` of that sender through that receiver's q, k or v; every edge gives the other run and none the
run itself; EAP's score is the exact gradient at the receiver's input dotted with the sender's difference, both
computed here by hand; bad input gets one line and the model is left as it was."""

from __future__ import annotations

import pytest
import torch

import interp
from hooks.names import hook_name
from analyses import (edge_attribution, edge_patching, faithfulness, graph_edges, logit_difference, path_patching,
                      select_circuit)
from test_edge_circuits import each_edge_matches_by_hand, left_as_it_was
from test_seq2seq import _tiny as tiny_seq2seq

TOL = 1e-5


def _pair(seed=0, src=7, tgt=5):
    g = torch.Generator().manual_seed(seed)
    make = lambda: {"input_ids": torch.randint(3, 100, (2, src), generator=g),  # noqa: E731
                    "decoder_input_ids": torch.randint(3, 100, (2, tgt), generator=g)}
    return make(), make()


def _t5(attn="flash", attention_only=False, family="t5"):
    model = interp.load_model(tiny_seq2seq(family), attn=attn)
    if attention_only:  # no MLP carries a sender's effect another way: each MLP's last linear map zeroed
        for stack in ("encoder", "decoder"):
            for block, path in zip(model._blocks[stack], model.stack_structure.mlp[stack]):
                last = [m for m in block.get_submodule(path).modules() if getattr(m, "weight", None) is not None][-1]
                with torch.no_grad():
                    last.weight.zero_()
                    if last.bias is not None:
                        last.bias.zero_()
    return model


def _attention(hf, site: str):
    """The HF attention module of an interp site name (``decoder.blocks.1.cross_attn``)."""
    stack, _, block, kind = site.split(".")
    return getattr(hf, stack).block[int(block)].layer[1 if kind == "cross_attn" else 0].get_submodule(
        "EncDecAttention" if kind == "cross_attn" else "SelfAttention")


def _hf_run(model, batch, hooks=()):
    """The HF model's logits on ``batch`` with ``hooks`` (``(module, "pre" | "post", fn)``) on its modules."""
    handles = [m.register_forward_pre_hook(fn) if when == "pre" else m.register_forward_hook(fn)
               for m, when, fn in hooks]
    try:
        with torch.no_grad():
            return model.hf(input_ids=batch["input_ids"], decoder_input_ids=batch["decoder_input_ids"],
                            use_cache=False).logits
    finally:
        for h in handles:
            h.remove()


def _grab(model, batch, module, which="input"):
    got = {}
    _hf_run(model, batch, [(module, "post", lambda m, args, out: got.update(x=args[0] if which == "input" else out))])
    return got["x"]


def _node(model, batch, name):
    """A node's output, read off the HF modules: an input embedding, a head's z times its columns of ``o``, an
    MLP's ``DenseReluDense`` output."""
    hf = model.hf
    if name.endswith(".input"):
        stack = getattr(hf, name.split(".")[0])
        ids = batch["input_ids" if name.startswith("encoder") else "decoder_input_ids"]
        with torch.no_grad():
            return stack.embed_tokens(ids)
    if ".mlp." in name:
        stack, _, l = name.split(".")
        return _grab(model, batch, getattr(hf, stack).block[int(l)].layer[-1].DenseReluDense, "output")
    site, head = name.split(":")
    o = _attention(hf, site).o
    z, d = _grab(model, batch, o), model.sites[site].d_head
    h = int(head)
    return z[..., h * d:(h + 1) * d] @ o.weight[:, h * d:(h + 1) * d].T


def _by_hand(model, base, other, up, down):
    """The base run in which only ``down``'s input reads its stream plus (other's - base's) output of ``up``,
    through ``down``'s own norm: for a head, its columns of the projection recomputed from that; for an MLP, its
    output recomputed; for the logits, the decoder's final norm's input moved."""
    hf = model.hf
    delta = _node(model, other, up) - _node(model, base, up)
    if down == "logits":
        return _hf_run(model, base, [(hf.decoder.final_layer_norm, "pre", lambda m, args: (args[0] + delta,))])
    if ".mlp." in down:
        stack, _, l = down.split(".")
        ff = getattr(hf, stack).block[int(l)].layer[-1]
        x = _grab(model, base, ff.layer_norm)
        with torch.no_grad():
            y = ff.DenseReluDense(ff.layer_norm(x + delta))
        return _hf_run(model, base, [(ff.DenseReluDense, "post", lambda m, args, out: y)])
    site, rest = down.split(":")
    head, which = int(rest.split(".")[0]), rest.split(".")[1]
    attn = _attention(hf, site)
    if site.endswith("cross_attn") and which in ("k", "v"):
        norm = hf.encoder.final_layer_norm  # keys and values: the encoder's final stream through its final norm
    else:
        stack, _, block, kind = site.split(".")
        norm = getattr(hf, stack).block[int(block)].layer[1 if kind == "cross_attn" else 0].layer_norm
    x = _grab(model, base, norm)
    proj, d = getattr(attn, which), model.sites[site].d_head
    cols = slice(head * d, (head + 1) * d)
    with torch.no_grad():
        value = norm(x + delta) @ proj.weight[cols].T

    def put(m, args, out):
        out = out.clone()
        out[..., cols] = value
        return out
    return _hf_run(model, base, [(proj, "post", put)])


EDGES = [("encoder.input", "encoder.blocks.1.attn:2.q"), ("encoder.blocks.0.attn:1", "encoder.blocks.1.attn:3.k"),
         ("encoder.blocks.1.attn:0", "encoder.mlp.1"), ("encoder.mlp.0", "encoder.blocks.1.attn:1.v"),
         ("encoder.blocks.0.attn:1", "decoder.blocks.1.cross_attn:2.k"),  # an encoder node into cross-attention
         ("encoder.mlp.1", "decoder.blocks.0.cross_attn:0.v"), ("encoder.input", "decoder.blocks.1.cross_attn:3.k"),
         ("decoder.input", "decoder.blocks.1.attn:0.k"), ("decoder.blocks.0.attn:3", "decoder.blocks.0.cross_attn:1.q"),
         ("decoder.blocks.0.cross_attn:2", "decoder.mlp.0"), ("decoder.mlp.0", "decoder.blocks.1.attn:2.v"),
         ("decoder.mlp.1", "logits"), ("decoder.blocks.1.cross_attn:3", "logits")]


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_one_edge_equals_a_recomputation_by_hand_from_the_hf_modules(attn):
    model = _t5(attn)
    clean, corrupted = _pair()
    plain = {"clean": _hf_run(model, clean), "corrupted": _hf_run(model, corrupted)}
    each_edge_matches_by_hand(model, clean, corrupted, EDGES, _by_hand, plain)


def test_the_graph_has_two_streams_and_cross_attention_keys_read_the_encoder():
    model = _t5()
    pairs = {(u.name, r.name) for u, r in graph_edges(model)}
    cross_k = {u for u, r in pairs if r == "decoder.blocks.0.cross_attn:0.k"}
    encoder = {"encoder.input", "encoder.mlp.0", "encoder.mlp.1"} | {f"encoder.blocks.{l}.attn:{h}"
                                                                      for l in (0, 1) for h in range(4)}
    assert cross_k == encoder  # every encoder node, and only those
    assert {u for u, r in pairs if r == "decoder.blocks.0.cross_attn:0.q"} == {
        "decoder.input", *(f"decoder.blocks.0.attn:{h}" for h in range(4))}  # the same block's self-attention
    assert {u for u, r in pairs if r == "logits"} == {u for u, _ in pairs if u.startswith("decoder")}
    assert ("decoder.blocks.0.cross_attn:1", "decoder.mlp.0") in pairs
    assert not any(u.startswith("decoder") and r.startswith("encoder") for u, r in pairs)


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", ["t5", "mbart"])  # mBART: pre-norm too, with biases and LayerNorms
def test_every_edge_gives_the_other_run_and_none_the_run(family, attn):
    model = _t5(attn, family=family)
    clean, corrupted = _pair(1, src=9, tgt=4)  # source and target of different lengths
    every = [(u.name, r.name) for u, r in graph_edges(model)]
    logits = {"clean": _hf_run(model, clean), "corrupted": _hf_run(model, corrupted)}
    assert (logits["clean"] - logits["corrupted"]).abs().max() > 1e-2
    for run, other in (("clean", "corrupted"), ("corrupted", "clean")):
        assert (edge_patching(model, clean, corrupted, every, run=run).logits - logits[other]).abs().max() <= TOL
        assert torch.equal(edge_patching(model, clean, corrupted, [], run=run).logits, logits[run])


def test_one_edge_clean_equals_path_patching_on_an_attention_only_t5():
    model = _t5(attention_only=True)
    clean, corrupted = _pair(2)
    metric = logit_difference(5, 7)
    cases = [("decoder.blocks.1.cross_attn", via, ["encoder.blocks.0.attn", "encoder.blocks.1.attn"]) for via in "kv"]
    cases += [("decoder.blocks.1.cross_attn", "q", ["decoder.blocks.0.attn", "decoder.blocks.0.cross_attn",
                                                    "decoder.blocks.1.attn"]),
              ("decoder.blocks.1.attn", "k", ["decoder.blocks.0.attn", "decoder.blocks.0.cross_attn"])]
    for receiver_site, via, sender_sites in cases:
        for sender, receiver in ((0, 1), (2, 3)):
            df = path_patching(model, clean, corrupted, [(receiver_site, receiver)], metric,
                               senders=[(s, sender) for s in sender_sites], via=via, heads_per_forward=1)
            for site in sender_sites:
                got = edge_patching(model, clean, corrupted, [(f"{site}:{sender}", f"{receiver_site}:{receiver}.{via}")],
                                    metric, run="corrupted")
                want = df.set_index(["site", "head"]).loc[(site, sender), "metric"]
                assert abs(got - want) <= TOL, (receiver_site, via, site, sender, got, want)
                assert abs(got - df.attrs["corrupted"]) > 1e-4  # the path carries something


def _gradient_by_hand(model, batch, metric, down):
    """d metric / d x_down at ``batch`` (the corrupted run): a zero added to the stream only ``down`` reads (through
    its own norm), the HF modules run with that, the gradient taken with respect to the zero."""
    hf = model.hf
    site, rest = down.split(":")
    head, which = int(rest.split(".")[0]), rest.split(".")[1]
    if site.endswith("cross_attn") and which in ("k", "v"):
        norm = hf.encoder.final_layer_norm
    else:
        stack, _, block, kind = site.split(".")
        norm = getattr(hf, stack).block[int(block)].layer[1 if kind == "cross_attn" else 0].layer_norm
    x = _grab(model, batch, norm)
    eps = torch.zeros_like(x, requires_grad=True)
    proj, d = getattr(_attention(hf, site), which), model.sites[site].d_head
    cols = slice(head * d, (head + 1) * d)

    def put(m, args, out):
        out = out.clone()
        out[..., cols] = norm(x + eps) @ proj.weight[cols].T
        return out
    handle = proj.register_forward_hook(put)
    try:
        with torch.enable_grad():
            out = model.hf(input_ids=batch["input_ids"], decoder_input_ids=batch["decoder_input_ids"], use_cache=False)
            (grad,) = torch.autograd.grad(metric.per_example(out, batch).mean(), eps)
    finally:
        handle.remove()
    return grad


def test_eap_is_the_exact_gradient_at_the_receiver_dotted_with_the_senders_difference_by_hand():
    model = _t5("eager")
    clean, corrupted = _pair(3)
    metric = logit_difference(5, 7)
    scores = {attn: edge_attribution(_t5(attn), clean, corrupted, metric, method="eap") for attn in ("eager", "flash")}
    assert (scores["eager"]["score"] - scores["flash"]["score"]).abs().max() <= 1e-4
    df = scores["eager"].set_index(["upstream", "downstream"])["score"]
    for up, down in [("encoder.blocks.0.attn:1", "decoder.blocks.1.cross_attn:2.k"),
                     ("encoder.mlp.1", "decoder.blocks.0.cross_attn:0.v"),
                     ("decoder.blocks.0.attn:3", "decoder.blocks.0.cross_attn:1.q"),
                     ("encoder.input", "encoder.blocks.1.attn:2.q")]:
        grad = _gradient_by_hand(model, corrupted, metric, down)
        want = float((grad * (_node(model, clean, up) - _node(model, corrupted, up))).sum().detach())
        assert abs(want) > 1e-3, (up, down)
        assert abs(df[(up, down)] - want) <= 1e-4 * max(1.0, abs(want)), (up, down, df[(up, down)], want)
    ig = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=1)
    assert (ig["score"] - scores["eager"]["score"]).abs().max() <= 1e-6  # one step is EAP
    assert set(scores["eager"]["input"]) == {"q", "k", "v", "mlp", "logits"}


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_recomputing_both_stacks_blocks_in_the_backward_gives_the_same_scores(attn):
    model = _t5(attn)
    clean, corrupted = _pair(6)
    metric = logit_difference(5, 7)
    runs = {r: edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=2, recompute=r)
            for r in (False, True)}
    assert runs[False]["score"].abs().max() > 1e-3
    assert (runs[False]["score"] - runs[True]["score"]).abs().max() <= 1e-6 * runs[False]["score"].abs().max()
    assert all("forward" not in b.__dict__ for stack in model._blocks.values() for b in stack)


def test_a_circuit_of_t5_is_chosen_and_evaluated():
    model = _t5()
    clean, corrupted = _pair(4)
    metric = logit_difference(5, 7)
    scores = edge_attribution(model, clean, corrupted, metric, method="eap-ig", steps=3)
    circuit = select_circuit(model, scores, edges=150)
    assert 0 < len(circuit) < 150 and "logits" in set(circuit["downstream"])
    # what is kept reaches the logits: encoder nodes only through cross-attention's keys and values, decoder MLPs
    # through their own node (the receiver "decoder.mlp.l" is the node "decoder.mlp.l")
    into_cross = circuit[circuit["down_site"].str.endswith("cross_attn") & circuit["input"].isin(["k", "v"])]
    assert set(circuit["up_kind"][circuit["upstream"].str.startswith("encoder")].index) and len(into_cross)
    kept_mlps = set(circuit["downstream"][circuit["input"] == "mlp"])
    assert kept_mlps and kept_mlps <= set(circuit["upstream"])
    curve = faithfulness(model, clean, corrupted, metric, scores, sizes=(20, 200), n_random=1, n_bootstrap=20)
    total = len(graph_edges(model))
    assert curve.attrs["total_edges"] == total
    full = faithfulness(model, clean, corrupted, metric, scores, sizes=(total,), n_random=0, n_bootstrap=20)
    assert abs(full["faithfulness"].iloc[0] - 1) <= 1e-4 and abs(full["complement"].iloc[0]) <= 1e-4


def test_bad_edges_on_t5_get_one_line():
    model = _t5()
    clean, corrupted = _pair()
    for edge, why in ((("decoder.blocks.0.attn:0", "decoder.blocks.0.cross_attn:0.k"),
                       "no edge decoder.blocks.0.attn:0 -> decoder.blocks.0.cross_attn:0.k: .*cross-attention's k and "
                       "v read the encoder's nodes"),
                      (("encoder.blocks.0.attn:0", "decoder.blocks.0.attn:0.q"), "no edge encoder.blocks.0.attn:0"),
                      (("decoder.mlp.1", "decoder.blocks.1.attn:0.q"), "no edge decoder.mlp.1"),
                      (("mlp.0", "logits"), "No upstream node 'mlp.0'.*'<stack>.mlp.<layer>'"),
                      (("decoder.input", "decoder.mlp.5"), "No downstream input 'decoder.mlp.5'")):
        with pytest.raises(ValueError, match=why) as err:
            edge_patching(model, clean, corrupted, [edge])
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("study", ["attribution", "patching", "faithfulness"])
def test_the_t5_model_is_left_as_it_was_also_when_the_metric_raises(study):
    model = _t5()
    model.hf.train()
    model.hf.decoder.block[0].layer[1].EncDecAttention.k.weight.requires_grad_(False)
    left_as_it_was(model, *_pair(7), study, ("encoder.input", "decoder.blocks.0.cross_attn:0.k"))


def test_a_t5_circuit_is_saved_and_loaded_back(tmp_path):
    from analyses.circuits.saved import circuit_of, load_circuit

    model = _t5()
    clean, corrupted = _pair(5)
    scores = edge_attribution(model, clean, corrupted, logit_difference(5, 7), method="eap")
    circuit = circuit_of(model, scores, clean, corrupted, edges=30)
    assert circuit.provenance["graph"]["mlp"] == ["encoder.mlp.0", "encoder.mlp.1", "decoder.mlp.0", "decoder.mlp.1"]
    back = load_circuit(circuit.save(tmp_path / "t5.json"), model)
    assert list(back.edges["upstream"]) == list(circuit.edges["upstream"])
    assert list(back.edges["downstream"]) == list(circuit.edges["downstream"])
    from analyses.views.circuit_view import circuit_view

    with pytest.raises(ValueError, match="encoder-decoder model .* does not draw yet") as err:  # not a TypeError
        circuit_view(back)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("family", ["t5", "bart", "mbart", "marian"])
def test_every_seq2seq_family_has_per_head_results_and_mlp_outputs(family):
    """hook_result: each head's share of the output projection (they sum to the attention output less its bias, and an
    edit reaches the model); hook_mlp_out: what the block's MLP adds (T5, mBART: the block's output minus the stream
    before the MLP; BART, Marian: the final norm's input minus it)."""
    model = interp.load_model(tiny_seq2seq(family))
    batch, _ = _pair(6)
    sites = model.cfg.sites
    out_name = lambda s: hook_name("cross_attn_out" if s.kind == "cross" else "attn_out", s.block, s.stack)  # noqa: E731
    names = [f"{s.name}.hook_result" for s in sites] + [out_name(s) for s in sites]
    names += [f"{stack}.blocks.{l}.hook_{kind}" for stack in ("encoder", "decoder") for l in range(2)
              for kind in ("mlp_out", "resid_pre", "resid_post")]
    with torch.no_grad():
        _, cache = model.run_with_cache(batch, names=names)
    for s in sites:
        o = model.o_proj_of(s)
        out = cache[out_name(s)]
        bias = 0 if o.bias is None else o.bias
        assert (cache[f"{s.name}.hook_result"].sum(2) + bias - out).abs().max() <= 1e-5, s.name
    for stack in ("encoder", "decoder"):
        for l in range(2):
            mlp = cache[f"{stack}.blocks.{l}.hook_mlp_out"]
            assert mlp.abs().max() > 1e-3
            if model.stack_structure.kind == "pre-norm":  # the block adds its sublayers' outputs, the MLP's last
                added = cache[f"{stack}.blocks.{l}.hook_resid_post"] - cache[f"{stack}.blocks.{l}.hook_resid_pre"]
                added -= sum(cache[out_name(s)] for s in sites if s.stack == stack and s.block == l)
                assert (added - mlp).abs().max() <= 1e-5, (stack, l)
    site = sites[-1]  # the last cross-attention: zeroing head 1's result = zeroing its z
    zero_result = lambda act, hook: act.index_fill(2, torch.tensor([1]), 0.0)  # noqa: E731
    with torch.no_grad():
        a = model.run_with_hooks(batch, fwd_hooks=[(f"{site.name}.hook_result", zero_result)]).logits
        b = model.run_with_hooks(batch, fwd_hooks=[(f"{site.name}.hook_z", zero_result)]).logits
        plain = model(batch).logits
    assert (a - plain).abs().max() > 1e-4 and (a - b).abs().max() <= 1e-5
    # hook_mlp_out is what the MLP adds: zeroing it equals a block whose MLP adds nothing
    block = model._blocks["decoder"][1]
    mlp = block.get_submodule(model.stack_structure.mlp["decoder"][1])
    handle = mlp.register_forward_hook(lambda m, args, out: torch.zeros_like(out))
    try:
        with torch.no_grad():
            want = model(batch).logits
    finally:
        handle.remove()
    with torch.no_grad():
        got = model.run_with_hooks(batch, fwd_hooks=[("decoder.blocks.1.hook_mlp_out", lambda a, h: a * 0)]).logits
    assert (got - plain).abs().max() > 1e-4 and torch.equal(got, want)


def test_edge_effects_batch_t5_edges_as_copies_and_equal_one_edge_at_a_time():
    from analyses.circuits.patching import edge_effects

    model = _t5()
    clean, corrupted = _pair(5)
    metric = logit_difference(5, 7)
    df = edge_effects(model, clean, corrupted, EDGES, metric)  # several edges per forward, copies of the batch
    assert df.attrs["forwards"] < len(EDGES)
    for (up, down), effect in zip(EDGES, df["effect"]):
        one = edge_patching(model, clean, corrupted, [(up, down)], metric, run="corrupted") - df.attrs["run"]
        assert abs(effect - one) <= TOL, (up, down, effect, one)
