"""Head ablation: ablate_heads edits exactly the chosen heads' z and nothing stays behind; the batched
ablation_scan equals one head at a time within 1e-5; metrics match their definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import no_torch_hooks, padded_batch, tiny_hf

import interp
from analyses import ablate_heads, ablation_scan, embedding_similarity, lm_loss, logit_difference, second_copy_loss
from analyses.causal import engine
from analyses.causal.ablation import all_heads
from analyses.data.metrics import first_copy_loss, mean_pool
from analyses.data.toy import copy_losses, repeated_sequences

SCAN_TOL = 1e-5


def _model(family, attn="flash"):
    return interp.load_model(tiny_hf(family), attn=attn)


def _inputs(model, seed=0):
    ids, mask = padded_batch(model.cfg.causal, seed=seed)
    return {"input_ids": ids, "attention_mask": mask}


def _out(model, inputs):
    with torch.no_grad():
        out = model(inputs["input_ids"], inputs["attention_mask"])
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _weights(model):
    return {k: v.clone() for k, v in model.hf.state_dict().items()}


def assert_clean(model, weights):
    """Weights bit-identical to ``weights``, no interp hook and no torch hook left anywhere."""
    assert model._registry.active() == []
    assert no_torch_hooks(model.hf)
    now = model.hf.state_dict()
    assert now.keys() == weights.keys()
    for k, v in weights.items():
        assert torch.equal(now[k], v), k


def _capture_z(model, inputs, layer):
    _, cache = model.run_with_cache(inputs["input_ids"], inputs["attention_mask"],
                                    names=[f"blocks.{layer}.attn.hook_z"])
    return cache["z", layer]


# -- ablate_heads ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_zero_ablation_equals_the_edit_by_hand_and_restores(family, attn):
    model = _model(family, attn)
    inputs = _inputs(model)
    before, weights = _out(model, inputs), _weights(model)

    def by_hand(z, hook):
        z = z.clone()
        if hook.layer == 1:
            z[:, :, [0, 3]] = 0
        return z

    with model.hooks([(lambda n: n.endswith("hook_z"), by_hand)]):
        expected = _out(model, inputs)
    with ablate_heads(model, [(1, 0), (1, 3)]):
        got = _out(model, inputs)
        z = _capture_z(model, inputs, 1)
    assert torch.equal(got, expected)
    assert not torch.equal(got, before)
    assert (z[:, :, [0, 3]] == 0).all() and (z[:, :, [1, 2]] != 0).any()
    assert torch.equal(_out(model, inputs), before)
    assert_clean(model, weights)


def test_ablate_heads_restores_after_an_exception():
    model = _model("llama")
    inputs = _inputs(model)
    before, weights = _out(model, inputs), _weights(model)
    with pytest.raises(RuntimeError, match="boom"):
        with ablate_heads(model, [(0, 1)], "mean", reference=inputs):
            _out(model, inputs)
            raise RuntimeError("boom")
    assert torch.equal(_out(model, inputs), before)
    assert_clean(model, weights)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_mean_ablation_uses_the_mean_over_real_tokens_of_the_reference(family):
    model = _model(family)
    inputs, reference = _inputs(model), _inputs(model, seed=1)
    z_ref = _capture_z(model, reference, 0)  # (b, p, h, d)
    mask = reference["attention_mask"].bool()
    expected = z_ref[mask][:, 2].mean(0)  # (d,): head 2 over the real tokens only
    with ablate_heads(model, [(0, 2)], "mean", reference=reference):
        z = _capture_z(model, inputs, 0)
    assert torch.allclose(z[:, :, 2], expected.expand_as(z[:, :, 2]), atol=1e-6)
    assert torch.equal(z[:, :, [0, 1, 3]], _capture_z(model, inputs, 0)[:, :, [0, 1, 3]])


def test_resample_ablation_takes_the_heads_output_on_the_reference():
    model = _model("gpt2")
    inputs, reference = _inputs(model), _inputs(model, seed=1)
    with ablate_heads(model, [(1, 1)], "resample", reference=reference):
        z = _capture_z(model, inputs, 1)
    assert torch.equal(z[:, :, 1], _capture_z(model, reference, 1)[:, :, 1])
    # Resampling every head from the inputs themselves changes nothing.
    before = _out(model, inputs)
    with ablate_heads(model, all_heads(model), "resample", reference=inputs):
        assert torch.equal(_out(model, inputs), before)


# -- ablation_scan ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["zero", "mean", "resample"])
@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_batched_scan_equals_one_head_at_a_time(family, attn, method):
    model = _model(family, attn)
    inputs = _inputs(model)
    reference = None if method == "zero" else _inputs(model, seed=1)
    metric = lm_loss if model.cfg.causal else embedding_similarity(model, inputs)
    weights = _weights(model)
    batched = ablation_scan(model, inputs, metric, method=method, reference=reference, heads_per_forward=3)
    assert list(batched.columns) == ["stack", "kind", "site", "layer", "head", "metric", "delta", "baseline"]
    assert list(zip(batched["layer"], batched["head"])) == all_heads(model)
    for row in batched.itertuples():
        with ablate_heads(model, [(row.layer, row.head)], method, reference), torch.no_grad():
            alone = metric(model(inputs["input_ids"], inputs["attention_mask"]), inputs)
        assert abs(row.metric - alone) <= SCAN_TOL, (row.layer, row.head)
    assert (batched.delta == batched.metric - batched.baseline).all()
    assert batched.delta.abs().max() > 1e-6  # the heads do something, so equality above means something
    assert_clean(model, weights)


def test_scan_groups_follow_the_memory_budget(monkeypatch):
    model = _model("gpt2")
    inputs = _inputs(model)
    sizes = []
    real_run = engine._run
    monkeypatch.setattr(engine, "_run", lambda m, b, copies=1: sizes.append(copies) or real_run(m, b, copies))
    big = ablation_scan(model, inputs, lm_loss, memory_budget=2**30)
    assert sizes == [1, 8]  # baseline, then all 8 heads in one forward
    sizes.clear()
    small = ablation_scan(model, inputs, lm_loss, memory_budget=1)
    assert sizes == [1] * 10  # baseline, 8 heads, and the full forward that checks the first replayed one (1, 0)
    sizes.clear()
    per_copy = 3 * 10 * (99 + 12 * 32) * 4  # (b, p) = (3, 10); logits + 12 x d_model per token, fp32
    ablation_scan(model, inputs, lm_loss, memory_budget=3 * per_copy + 1)
    assert sizes == [1, 3, 3, 2, 2]  # the last group (layer 1 only) replays layer 0: checked by a full forward
    assert (big.metric - small.metric).abs().max() <= SCAN_TOL


def test_scan_with_heads_already_ablated_matches_ablating_both():
    model = _model("llama")
    inputs = _inputs(model)
    scan = ablation_scan(model, inputs, lm_loss, heads=[(1, 0), (1, 2)], ablated=[(0, 1), (1, 3)])
    with ablate_heads(model, [(0, 1), (1, 3)]), torch.no_grad():
        base = lm_loss(model(inputs["input_ids"], inputs["attention_mask"]), inputs)
    assert scan.baseline.iloc[0] == pytest.approx(base, abs=SCAN_TOL)
    with ablate_heads(model, [(0, 1), (1, 3), (1, 2)]), torch.no_grad():
        both = lm_loss(model(inputs["input_ids"], inputs["attention_mask"]), inputs)
    assert scan.metric.iloc[1] == pytest.approx(both, abs=SCAN_TOL)


def test_scan_failing_midway_leaves_the_model_clean():
    model = _model("bert", "eager")
    inputs = _inputs(model)
    weights, calls = _weights(model), []

    def flaky(output, batch):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("injected failure")
        return float(output.last_hidden_state.mean())

    with pytest.raises(RuntimeError, match="injected failure"):
        ablation_scan(model, inputs, flaky, heads_per_forward=2)
    assert_clean(model, weights)


# -- metrics ---------------------------------------------------------------------------------------------
def test_lm_loss_matches_hf_labels_loss_and_skips_padding():
    model = _model("gpt2")
    ids = torch.randint(1, 99, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, labels=ids)
    assert lm_loss(out, {"input_ids": ids, "attention_mask": None}) == pytest.approx(out.loss.item(), abs=1e-6)
    # Left padding: the padded sequence's loss equals its loss run alone (RoPE: positions are relative).
    model = _model("llama")
    inputs = _inputs(model)
    with torch.no_grad():
        per = lm_loss.per_example(model(inputs["input_ids"], inputs["attention_mask"]), inputs)
        n = int(inputs["attention_mask"][2].sum())
        alone_ids = inputs["input_ids"][2:, -n:]
        alone = lm_loss.per_example(model(alone_ids), {"input_ids": alone_ids, "attention_mask": None})
    assert per[2].item() == pytest.approx(alone.item(), abs=1e-5)


def test_copy_losses_match_the_toy_definition():
    model = _model("gpt2")
    tokens = repeated_sequences(4, 6, 99, torch.Generator().manual_seed(0), bos_token_id=0)
    batch = {"input_ids": tokens, "attention_mask": None}
    with torch.no_grad():
        out = model(tokens)
        first, second = copy_losses(model.hf, tokens, 6)
    assert first_copy_loss(out, batch) == pytest.approx(first.item(), abs=1e-6)
    assert second_copy_loss(out, batch) == pytest.approx(second.item(), abs=1e-6)
    with pytest.raises(ValueError, match="repeated sequences"):
        second_copy_loss(out, {"input_ids": tokens.flip(1), "attention_mask": None})


def test_logit_difference_and_embedding_similarity():
    model = _model("gpt2")
    inputs = _inputs(model)
    with torch.no_grad():
        logits = model(inputs["input_ids"], inputs["attention_mask"]).logits
    out = type("Out", (), {"logits": logits})()
    expected = (logits[:, -1, 5] - logits[:, -1, 7]).mean().item()
    assert logit_difference(5, 7)(out, inputs) == pytest.approx(expected, abs=1e-6)

    bert = _model("bert")
    inputs = _inputs(bert)
    metric = embedding_similarity(bert, inputs)
    with torch.no_grad():
        out = bert(inputs["input_ids"], inputs["attention_mask"])
    assert metric(out, inputs) == pytest.approx(1.0, abs=1e-6)
    hidden, mask = out.last_hidden_state, inputs["attention_mask"]
    manual = hidden[1, : int(mask[1].sum())].mean(0)
    assert torch.allclose(mean_pool(hidden, mask)[1], manual, atol=1e-6)
    with ablate_heads(bert, [(0, 0), (1, 2)]), torch.no_grad():
        ablated = bert(inputs["input_ids"], inputs["attention_mask"])
    cos = F.cosine_similarity(mean_pool(ablated.last_hidden_state, mask), mean_pool(hidden, mask), dim=-1).mean()
    assert metric(ablated, inputs) == pytest.approx(cos.item(), abs=1e-6)
    assert metric(ablated, inputs) < 1 - 1e-6
    with pytest.raises(ValueError, match="inputs it was built with"):
        metric(out, _inputs(bert, seed=3))


# -- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads, match", [
    ([(2, 0)], r"Layer 2 is out of range .* layers run 0..1"),
    ([(0, 4)], r"Head 4 is out of range .* heads 0..3"),
    ([(-1, 0)], "Layer -1 is out of range"),
    ([], "head list is empty"),
    ([(0, 1, 2)], r"\(layer, head\) pairs"),
])
def test_bad_heads_are_refused(heads, match):
    model = _model("gpt2")
    with pytest.raises((ValueError, TypeError), match=match):
        with ablate_heads(model, heads):
            pass
    with pytest.raises((ValueError, TypeError), match=match):
        ablation_scan(model, _inputs(model), lm_loss, heads=heads)
    assert model._registry.active() == []


def test_bad_methods_and_references_are_refused():
    model = _model("gpt2")
    inputs = _inputs(model)
    with pytest.raises(ValueError, match="Unknown ablation method 'median'; use one of zero, mean, resample"):
        ablation_scan(model, inputs, lm_loss, method="median")
    with pytest.raises(ValueError, match="resample ablation needs reference inputs"):
        with ablate_heads(model, [(0, 0)], "resample"):
            pass
    short = {"input_ids": inputs["input_ids"][:, -5:], "attention_mask": inputs["attention_mask"][:, -5:]}
    with pytest.raises(ValueError, match="reference inputs must have the shape of the inputs"):
        with ablate_heads(model, [(0, 0)], "resample", reference=short):
            _out(model, inputs)
    assert model._registry.active() == [] and no_torch_hooks(model.hf)


def _nan_q_model():
    """A tiny Llama whose layer-1 q_proj holds one NaN: on the flash path (and HF's sdpa) PyTorch's fused CPU kernel
    turns the NaN query into a finite output, so the logits are finite though an activation is NaN."""
    hf = tiny_hf("llama")
    with torch.no_grad():
        hf.model.layers[1].self_attn.q_proj.weight[0, 0] = float("nan")
    return interp.load_model(hf, attn="flash")


@pytest.mark.parametrize("study", ["ablation_scan", "activation_patching", "path_patching", "head_importance"])
def test_a_nan_weight_is_an_error_naming_it_in_every_scan(study):
    from analyses import activation_patching, head_importance, path_patching
    model = _nan_q_model()
    ids = torch.randint(1, 99, (2, 10), generator=torch.Generator().manual_seed(0))
    other = torch.randint(1, 99, (2, 10), generator=torch.Generator().manual_seed(1))
    run = {"ablation_scan": lambda: ablation_scan(model, ids, lm_loss),
           "activation_patching": lambda: activation_patching(model, ids, other, lm_loss),
           "path_patching": lambda: path_patching(model, ids, other, [(1, 0)], lm_loss),
           "head_importance": lambda: head_importance(model, ids, lm_loss)}[study]
    with pytest.raises(ValueError, match=r"NaN, first in module 'model\.layers\.1\.self_attn\.q_proj'.*"
                                         r"model\.layers\.1\.self_attn\.q_proj\.weight"):
        run()


def test_an_item_whose_run_is_not_finite_gets_nan_and_a_warning():
    model = _model("gpt2")
    ids = torch.randint(1, 99, (2, 8), generator=torch.Generator().manual_seed(0))
    heads = all_heads(model)

    def hooks_for(group, copies):  # the copy of head (1, 2) gets an infinite z: its logits are NaN
        def hook(z, point):
            z = z.clone()
            for i, head in enumerate(group):
                if head == (1, 2) and point.layer == 1:
                    z[i * 2:(i + 1) * 2] = float("inf")
            return z
        return [("blocks.1.attn.hook_z", hook)]

    def hits(output, batch):  # finite on NaN logits (an argmax), as an accuracy is
        return float((output.logits.argmax(-1) == 3).float().mean())

    with pytest.warns(RuntimeWarning, match=r"1 item\(s\) gave a non-finite output.*\(1, 2\)"):
        baseline, values = engine.scan(model, {"input_ids": ids, "attention_mask": None}, heads, lambda h: h[0],
                                       hooks_for, hits, 3)
    broken = heads.index((1, 2))
    assert baseline == baseline and all(v == v for i, v in enumerate(values) if i != broken)
    assert values[broken] != values[broken]  # NaN, not the argmax of NaN logits


def test_watching_finds_nan_by_sums_and_lets_infinities_through():
    """``finite.watching`` sums each module's output first on CPU: a NaN entry makes the sum NaN and is named; +inf
    and -inf in one output (a NaN sum, no NaN entry) are checked entry by entry and pass."""
    from analyses.causal.finite import watching
    model = interp.load_model(tiny_hf("llama"))
    ids = torch.randint(1, 99, (2, 10), generator=torch.Generator().manual_seed(0))
    layer = model.hf.model.layers[1].mlp.down_proj

    def put(value):
        def hook(module, args, output):
            output = output.clone()
            output[0, 0, 0] = value
            output[1, 0, 0] = -float("inf") if value == float("inf") else output[1, 0, 0]
            return output
        return layer.register_forward_hook(hook)

    handle = put(float("inf"))  # +inf and -inf, no NaN: allowed inside a watched run
    try:
        with torch.no_grad(), watching(model, "the run"):
            model.hf.model.layers[1](model.hf.model.embed_tokens(ids),
                                     position_embeddings=model.hf.model.rotary_emb(torch.zeros(1), torch.arange(10)[None]))
    finally:
        handle.remove()
    handle = put(float("nan"))
    try:
        with pytest.raises(ValueError, match=r"the run computed NaN, first in module 'model\.layers\.1\.mlp\.down_proj'"):
            with torch.no_grad(), watching(model, "the run"):
                model(ids)
    finally:
        handle.remove()
