"""Edge circuits on post-norm encoders (issue 48, item 6; ``analyses.circuits.postnorm``): each node's contribution
carried through every later LayerNorm with the run's own centring and scale, the constants (the output projection's
bias, the norms' betas) in the input node's. Checked on a tiny random BERT, padded, with the metric on the pooled
first token (a sequence classifier) and on the masked-LM logits: one edge patched either way equals a recomputation
by hand from the HF modules (the input node's contribution taken as the stream less every other node's, not as the
code carries it), every edge gives the other run and none the run itself on both attention paths, and each EAP
score equals the gradient at the receiver's input, taken by hand, times the carried difference."""

from __future__ import annotations

import pytest
import torch
from transformers import BertForSequenceClassification

import interp
from analyses import edge_attribution, edge_effects, edge_patching, faithfulness, graph_edges, logit_difference
from test_edge_circuits import each_edge_matches_by_hand
from tests.tiny import tiny_model

TOL = 1e-5
EDGES = [("input", "blocks.1.attn:3.q"), ("blocks.0.attn:1", "blocks.1.attn:1.k"), ("mlp.0", "blocks.1.attn:0.v"),
         ("blocks.0.attn:2", "mlp.1"), ("blocks.1.attn:2", "mlp.1"), ("input", "mlp.0"), ("mlp.1", "logits"),
         ("blocks.1.attn:3", "logits"), ("blocks.0.attn:0", "logits"), ("input", "logits")]


def _load(pooled: bool, **kw):
    return interp.load_model(tiny_model("bert", cls=BertForSequenceClassification if pooled else None), **kw)


def _batches(seed=0):
    """Clean and corrupted inputs, the second row padded after 7 tokens in both."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0
    return [{"input_ids": torch.randint(4, 99, (2, 10), generator=g), "attention_mask": mask} for _ in range(2)]


def _pooled(out, inputs):  # the classifier on the pooled first token
    return (out.logits[:, 0] - out.logits[:, 1]).mean()


def _norms(model, j):
    """Norm ``j`` on the stream: block ``j // 2``'s LayerNorm after attention (even) or after the MLP (odd)."""
    block = model.hf.bert.encoder.layer[j // 2]
    return block.attention.output.LayerNorm if j % 2 == 0 else block.output.LayerNorm


def _trace(model, batch):
    """One run read off the HF modules: per norm its input and output, each head's result, each MLP's output."""
    got, handles = {}, []
    layers = model.hf.bert.encoder.layer
    for l, block in enumerate(layers):
        for j in (2 * l, 2 * l + 1):
            handles.append(_norms(model, j).register_forward_hook(
                lambda m, a, o, j=j: got.update({("in", j): a[0], ("out", j): o})))
        handles.append(block.attention.output.dense.register_forward_hook(
            lambda m, a, o, l=l: got.update({("z", l): a[0]})))
        handles.append(block.output.dense.register_forward_hook(lambda m, a, o, l=l: got.update({("mlp", l): o})))
    handles.append(layers[0].register_forward_pre_hook(lambda m, a: got.update({"x0": a[0]})))
    try:
        with torch.no_grad():
            model.hf(**batch)
    finally:
        for h in handles:
            h.remove()
    return got


def _raw(model, tr, name):
    """A head's result (its z through its columns of the output projection) or an MLP's output, and the norm it is
    added before."""
    if name.startswith("mlp."):
        l = int(name[4:])
        return tr[("mlp", l)], 2 * l + 1
    l, h = int(name.split(".")[1]), int(name.split(":")[1])
    w = model.hf.bert.encoder.layer[l].attention.output.dense.weight
    return tr[("z", l)][..., h * 16:(h + 1) * 16] @ w[:, h * 16:(h + 1) * 16].T, 2 * l


def _stream(tr, k):
    return tr["x0"] if k == 0 else tr[("out", k - 1)]


def _contribution(model, tr, name, k):
    """``name``'s contribution to stream ``k`` (after ``k`` norms): its output carried through each norm by hand
    (centred, times the weight, over the run's own standard deviation); the input node's: the stream less every
    other node's."""
    if name == "input":
        others = [f"blocks.{l}.attn:{h}" for l in range(2) for h in range(4) if 2 * l < k]
        others += [f"mlp.{l}" for l in range(2) if 2 * l + 1 < k]
        return _stream(tr, k) - sum(_contribution(model, tr, o, k) for o in others)
    c, start = _raw(model, tr, name)
    for j in range(start, k):
        norm, y = _norms(model, j), tr[("in", j)]
        scale = torch.sqrt(y.var(-1, unbiased=False, keepdim=True) + norm.eps)
        c = (c - c.mean(-1, keepdim=True)) / scale * norm.weight
    return c


def _where(down):
    """The stream (norms before it) a receiver reads."""
    if down == "logits":
        return 4
    if down.startswith("mlp."):
        return 2 * int(down[4:]) + 1
    return 2 * int(down.split(".")[1])


def _at_receiver(model, down, add):
    """HF hooks that give receiver ``down`` its stream ``add(stream)`` and nothing else: a head's q, k or v columns
    recomputed from it, the MLP's first module's input, the last norm's output."""
    layers = model.hf.bert.encoder.layer
    if down == "logits":
        return layers[-1].output.LayerNorm.register_forward_hook(lambda m, a, o: add(o))
    if down.startswith("mlp."):
        return layers[int(down[4:])].intermediate.register_forward_pre_hook(lambda m, a: (add(a[0]),))
    l, rest = int(down.split(".")[1]), down.split(":")[1]
    h, which = int(rest.split(".")[0]), rest.split(".")[1]
    proj = getattr(layers[l].attention.self, {"q": "query", "k": "key", "v": "value"}[which])
    cols = slice(h * 16, (h + 1) * 16)

    def post(m, a, o):
        o = o.clone()
        o[..., cols] = torch.nn.functional.linear(add(a[0]), m.weight[cols], m.bias[cols])
        return o
    return proj.register_forward_hook(post)


def _by_hand(model, base, other, up, down):
    k = _where(down)
    delta = _contribution(model, _trace(model, other), up, k) - _contribution(model, _trace(model, base), up, k)
    handle = _at_receiver(model, down, lambda x: x + delta)
    try:
        with torch.no_grad():
            return model.hf(**base).logits
    finally:
        handle.remove()


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("pooled", [True, False])
def test_one_edge_equals_a_recomputation_by_hand_from_the_hf_modules(pooled, attn):
    model = _load(pooled, attn=attn)
    clean, corrupted = _batches()
    with torch.no_grad():
        plain = {"clean": model.hf(**clean).logits, "corrupted": model.hf(**corrupted).logits}
    each_edge_matches_by_hand(model, clean, corrupted, EDGES, _by_hand, plain)


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("pooled", [True, False])
def test_every_edge_gives_the_other_run_and_none_the_run(pooled, attn):
    model = _load(pooled, attn=attn)
    clean, corrupted = _batches(1)
    every = [(u.name, r.name) for u, r in graph_edges(model)]
    with torch.no_grad():
        logits = {"clean": model.hf(**clean).logits, "corrupted": model.hf(**corrupted).logits}
    assert (logits["clean"] - logits["corrupted"]).abs().max() > 1e-1
    for run, other in (("clean", "corrupted"), ("corrupted", "clean")):
        assert (edge_patching(model, clean, corrupted, every, run=run).logits - logits[other]).abs().max() <= TOL
        assert torch.equal(edge_patching(model, clean, corrupted, [], run=run).logits, logits[run])


def test_edge_effects_replaying_blocks_equal_single_patched_runs():
    model = _load(True)
    clean, corrupted = _batches(2)
    effects = edge_effects(model, clean, corrupted, EDGES, _pooled, memory_budget=1)  # one edge per forward
    with torch.no_grad():
        start = float(_pooled(model.hf(**corrupted), corrupted))
    for (up, down), effect in zip(EDGES, effects["effect"]):
        alone = float(_pooled(edge_patching(model, clean, corrupted, [(up, down)], run="corrupted"), corrupted))
        assert abs(effect - (alone - start)) <= 1e-5, (up, down)
    # block 0 replayed for the 9 edges into block 1 or the metric (checked against a full forward once), not for
    # input -> mlp.0
    assert effects["effect"].abs().min() > 1e-3 and effects.attrs["block_fraction"] == 11 / 20


def _gradient(model, batch, down):
    """d metric / d (the stream ``down`` reads) at ``batch``'s run, by hand: a zero needing a gradient added there."""
    zero = torch.zeros(2, 10, 64, requires_grad=True)
    handle = _at_receiver(model, down, lambda x: x + zero)
    try:
        (grad,) = torch.autograd.grad(_pooled(model.hf(**batch), batch), zero)
    finally:
        handle.remove()
    return grad


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_eap_is_the_gradient_at_the_receiver_times_the_carried_difference(attn):
    model = _load(True, attn=attn)
    clean, corrupted = _batches(3)
    scores = edge_attribution(model, clean, corrupted, _pooled, method="eap")
    assert set(scores["input"]) == {"q", "k", "v", "mlp", "logits"} and scores["score"].abs().max() > 1e-2
    at = {(u, d): s for u, d, s in zip(scores["upstream"], scores["downstream"], scores["score"])}
    traces = {"clean": _trace(model, clean), "corrupted": _trace(model, corrupted)}
    for up, down in EDGES:
        k = _where(down)
        delta = _contribution(model, traces["clean"], up, k) - _contribution(model, traces["corrupted"], up, k)
        want = float((_gradient(model, corrupted, down) * delta).sum().detach())
        assert abs(at[(up, down)] - want) <= 1e-4 * max(1.0, abs(want)), (up, down, at[(up, down)], want)


def test_faithfulness_of_every_edge_is_one_on_a_masked_token_metric():
    model = _load(False)
    clean, corrupted = _batches(6)
    metric = logit_difference(5, 7, position=3)  # a masked-LM metric at one token
    scores = edge_attribution(model, clean, corrupted, metric, method="eap")
    curve = faithfulness(model, clean, corrupted, metric, scores, sizes=(10, len(scores)), n_random=1, n_bootstrap=20)
    assert abs(curve["faithfulness"].iloc[-1] - 1) <= 1e-4 and abs(curve["complement"].iloc[-1]) <= 1e-4
    assert curve["faithfulness"].iloc[0] != curve["random"].iloc[0]


def test_a_post_norm_block_of_another_form_is_refused_in_one_line():
    import types

    hf = tiny_model("bert")
    for layer in hf.bert.encoder.layer:  # the residual doubled before the norm: N1 no longer reads x + attention
        out = layer.attention.output
        out.forward = types.MethodType(lambda self, h, x: self.LayerNorm(self.dense(h) + 2 * x), out)
    model = interp.load_model(hf)
    with pytest.raises(ValueError, match="block 0 of BertForMaskedLM does not have that form .*not supported") as err:
        graph_edges(model)
    assert "\n" not in str(err.value)
