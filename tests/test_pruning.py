"""Pruning: head importance as Michel et al. define it, pruning curves, and structurally pruned models that
compute exactly what zero ablation computes. Every study leaves the model as it found it.

Results checked here: on the toy model, zero-ablating the induction heads removes at least half of the
in-context gain and importance ranks them first; on MiniLM with the project's sentences, pruning by
importance keeps the embeddings closer than pruning at random.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from test_ablation import _inputs, _model, _out, _weights, assert_clean

import interp
from analyses import (ablate_heads, ablation_scan, curve_summary, embedding_similarity, head_importance, lm_loss,
                      prune_model, pruning_curve, second_copy_loss)
from analyses.causal import pruning as pruning_mod
from analyses.causal.ablation import all_heads
from analyses.data.metrics import first_copy_loss, next_token_loss
from analyses.data.toy import repeated_sequences
from interp.model.config import real_sites
from interp.structure.head_slicing import plan_layer

PRUNE_TOL = 1e-5
SENTENCES = Path(__file__).resolve().parents[1] / "analyses" / "data" / "sentences.txt"


def _params(model) -> int:
    return sum(p.numel() for p in model.hf.parameters())


# -- the GQA rule ----------------------------------------------------------------------------------------
def test_gqa_plan_keeps_groups_even():
    assert plan_layer(8, 2, range(8)).kv == (0, 1)
    assert plan_layer(8, 2, [0, 1, 2, 3]).kv == (0,)  # group 1 lost all its heads: its KV head goes
    assert plan_layer(8, 2, [0, 1, 4, 5]).kv == (0, 1)  # 2 + 2: no duplication
    plan = plan_layer(8, 2, [0, 1, 2, 3, 4, 5])  # 4 + 2: each KV head serves 2, group 0's is duplicated
    assert plan.kv == (0, 0, 1) and plan.group == 2
    assert plan_layer(8, 2, [0, 4, 5]).kv == (0, 1, 1)  # 1 + 2
    assert plan_layer(4, 4, [1, 3]).kv == (1, 3)  # no GQA: KV heads follow query heads
    assert plan_layer(4, 2, []).placeholder
    for kept in ([0, 1, 2, 3, 4, 5], [0, 4, 5], [2, 6, 7]):  # query head i reads KV copy i // group
        plan = plan_layer(8, 2, kept)
        assert [plan.kv[i // plan.group] for i in range(len(plan.q))] == [h // 4 for h in plan.q]


# -- prune_model -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "bert"])
def test_pruned_model_equals_zero_ablation_and_is_smaller(family, attn):
    model = _model(family, attn)
    inputs, weights = _inputs(model), _weights(model)
    heads = [(0, 0), (0, 1), (1, 2)]  # llama/qwen2: layer 0 loses a whole KV group, layer 1 goes uneven
    with ablate_heads(model, heads):
        expected = _out(model, inputs)
    pruned = prune_model(model, heads)
    valid = inputs["attention_mask"].bool()
    assert (_out(pruned, inputs) - expected)[valid].abs().max() <= PRUNE_TOL
    assert pruned.cfg.heads_per_layer == (2, 3)
    assert pruned.cfg.n_heads == 4  # the original config's value
    assert _params(pruned) < _params(model)
    if family in ("llama", "qwen2"):
        attn0 = pruned.hf.model.layers[0].self_attn
        assert attn0.k_proj.weight.shape[0] == 8 and attn0.q_proj.weight.shape[0] == 16  # 1 KV head, 2 q heads
        assert pruned.cfg.kv_heads_per_layer == (1, 3)  # layer 1: groups keep 2 and 1 -> 3 KV copies
    assert_clean(model, weights)  # the original is untouched: same tensors, same shapes


def test_pruned_model_hooks_and_cache_work_per_layer():
    model = _model("llama", "flash")
    pruned = prune_model(model, [(0, 0), (0, 1)])
    inputs = _inputs(model)
    _, cache = pruned.run_with_cache(inputs["input_ids"], inputs["attention_mask"],
                                     names=lambda n: n.endswith(("hook_q", "hook_k", "hook_z", "hook_result")))
    assert cache["z", 0].shape[2] == 2 and cache["z", 1].shape[2] == 4
    assert cache["k", 0].shape[2] == 1
    scan = ablation_scan(pruned, inputs, lm_loss)
    assert list(zip(scan["layer"], scan["head"])) == [(0, 0), (0, 1)] + [(1, h) for h in range(4)]
    eager = prune_model(model.set_attn("eager"), [(0, 0), (0, 1)])
    _, eager_cache = eager.run_with_cache(inputs["input_ids"], inputs["attention_mask"])
    assert torch.allclose(cache.pattern(0), eager_cache["pattern", 0], atol=1e-5)
    summed = cache["result", 0].sum(2)  # (b, p, m); llama's o_proj has no bias
    _, attn_out = pruned.run_with_cache(inputs["input_ids"], inputs["attention_mask"], names="blocks.0.hook_attn_out")
    assert torch.allclose(summed, attn_out["blocks.0.hook_attn_out"], atol=1e-5)
    model.set_attn("flash")


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_pruned_model_round_trips_through_save_pretrained(family, tmp_path):
    model = _model(family)
    inputs = _inputs(model)
    pruned = prune_model(model, [(0, 3), (1, 0), (1, 1)])
    pruned.hf.save_pretrained(tmp_path)
    loaded = interp.load_model(tmp_path, device="cpu")
    assert loaded.cfg.heads_per_layer == pruned.cfg.heads_per_layer
    assert loaded.cfg.kv_heads_per_layer == pruned.cfg.kv_heads_per_layer
    assert torch.equal(_out(loaded, inputs), _out(pruned, inputs))
    for (name, a), b in zip(pruned.hf.state_dict().items(), loaded.hf.state_dict().values()):
        assert torch.equal(a, b), name


def test_pruned_minilm_equals_zero_ablation_and_round_trips(minilm, tmp_path):
    inputs = minilm.to_batch(_sentences(8))
    heads = [(l, h) for l in range(6) for h in range(12) if (l * 5 + h) % 2]  # half the heads, scattered
    with ablate_heads(minilm, heads):
        expected = _out(minilm, inputs)
    pruned = prune_model(minilm, heads)
    valid = inputs["attention_mask"].bool()
    assert (_out(pruned, inputs) - expected)[valid].abs().max() <= PRUNE_TOL
    assert pruned.hf.encoder.layer[0].attention.self.query.weight.shape == (6 * 32, 384)
    pruned.hf.save_pretrained(tmp_path)
    pruned.tokenizer.save_pretrained(tmp_path)
    loaded = interp.load_model(tmp_path, device="cpu")
    assert loaded.tokenizer is not None and loaded.cfg.heads_per_layer == (6,) * 6
    assert torch.equal(_out(loaded, inputs), _out(pruned, inputs))


def test_pruning_a_pruned_model_composes():
    model = _model("llama")
    inputs = _inputs(model)
    once = prune_model(prune_model(model, [(1, 0)]), [(1, 0), (0, 3)])  # pruned head (1, 0) was original (1, 1)
    with ablate_heads(model, [(1, 0), (1, 1), (0, 3)]):
        expected = _out(model, inputs)
    assert once.hf.config.interp_pruned_heads == {0: [0, 1, 2], 1: [2, 3]}
    valid = inputs["attention_mask"].bool()
    assert (_out(once, inputs) - expected)[valid].abs().max() <= PRUNE_TOL


def test_emptying_a_layer_needs_saying_so():
    model = _model("gpt2")
    inputs = _inputs(model)
    layer0 = [(0, h) for h in range(4)]
    with pytest.raises(ValueError, match=r"every head of layer\(s\) \[0\].*allow_empty_layers=True"):
        prune_model(model, layer0)
    pruned = prune_model(model, layer0, allow_empty_layers=True)
    with ablate_heads(model, layer0):
        expected = _out(model, inputs)
    valid = inputs["attention_mask"].bool()
    assert (_out(pruned, inputs) - expected)[valid].abs().max() <= PRUNE_TOL
    assert pruned.hf.transformer.h[0].attn.c_proj.weight.abs().sum() == 0  # the zeroed placeholder head
    # the placeholder is not a head: real_sites (issue 36: the one filter the studies use) leaves its site out
    assert [s.name for s in real_sites(pruned)] == ["blocks.1.attn"] == [s.name for s in real_sites(model)][1:]
    assert pruned.cfg.empty_sites == ("blocks.0.attn",) and {l for l, _ in pruned.cfg.heads()} == {1}


def test_prune_failing_midway_leaves_the_original_clean(monkeypatch):
    model = _model("llama")
    weights = _weights(model)
    real = pruning_mod.slice_heads

    def slice_then_fail(hf, family, keep):
        real(hf, family, keep)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(pruning_mod, "slice_heads", slice_then_fail)
    with pytest.raises(RuntimeError, match="injected failure"):
        prune_model(model, [(0, 0), (1, 1)])
    assert_clean(model, weights)
    assert model.cfg.heads_per_layer == (4, 4) and not getattr(model.hf.config, "interp_pruned_heads", None)


def test_prune_model_refuses_bad_input():
    model = _model("gpt2")
    with pytest.raises(ValueError, match="head list is empty"):
        prune_model(model, [])
    with pytest.raises(ValueError, match="Head 7 is out of range"):
        prune_model(model, [(0, 7)])
    with model.hooks([("blocks.0.hook_resid_pre", lambda x, hook: None)]):
        with pytest.raises(ValueError, match="Remove the hooks"):
            prune_model(model, [(0, 1)])


# -- head_importance -------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_importance_is_the_mean_absolute_gate_gradient(attn):
    """Against central finite differences of each example's loss in each head's gate."""
    model = _model("llama", attn)
    inputs = _inputs(model)
    df = head_importance(model, inputs, lm_loss)
    eps, expected = 1e-2, {}
    for l, h in all_heads(model):
        losses = []
        for scale in (1 + eps, 1 - eps):
            def gate(z, hook, scale=scale, l=l, h=h):
                if hook.layer != l:
                    return None
                z = z.clone()
                z[:, :, h] *= scale
                return z
            with model.hooks([(lambda n: n.endswith("hook_z"), gate)]), torch.no_grad():
                out = model(inputs["input_ids"], inputs["attention_mask"])
            losses.append(lm_loss.per_example(out, inputs))
        expected[l, h] = ((losses[0] - losses[1]) / (2 * eps)).abs().mean().item()
    got = {(r.layer, r.head): r.importance_raw for r in df.itertuples()}
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=2e-2, abs=1e-6), key
    norms = df.groupby("layer")["importance"].apply(lambda s: (s**2).sum() ** 0.5)
    assert norms.to_numpy() == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_importance_in_row_chunks_equals_all_rows_at_once(attn):
    """batch_size splits the rows (each has its own gates): the same importances; a metric holding per-row targets
    gets each chunk's rows."""
    model = _model("llama", attn)
    inputs = _inputs(model)  # 3 rows, padded
    targets = torch.roll(inputs["input_ids"], 1, dims=0)  # per-row state: row i scores row i-1's tokens
    for loss in (lm_loss, next_token_loss(targets, start=1)):
        whole = head_importance(model, inputs, loss)
        for size in (1, 2, 3, 5):
            chunked = head_importance(model, inputs, loss, batch_size=size)
            pd.testing.assert_frame_equal(chunked, whole, check_exact=False, rtol=1e-5, atol=1e-7)
    curve = pruning_curve(model, inputs, lm_loss, step=0.25)
    pd.testing.assert_frame_equal(pruning_curve(model, inputs, lm_loss, step=0.25, batch_size=1), curve,
                                  check_exact=False, rtol=1e-5, atol=1e-7)  # the same heads pruned in the same order
    with pytest.raises(ValueError, match="batch_size is the number of rows per backward pass"):
        head_importance(model, inputs, lm_loss, batch_size=0)
    with pytest.raises(ValueError, match="mean of per-example values"):
        head_importance(model, inputs, lambda out, batch: out.logits.logsumexp(-1).mean(), batch_size=1)


def test_importance_leaves_no_gradient_and_restores_modes():
    model = _model("gpt2")
    inputs, weights = _inputs(model), _weights(model)
    model.hf.train()
    model.hf.transformer.h[0].requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.hf.named_parameters()}
    head_importance(model, inputs, lm_loss, ablated=[(0, 1)])
    assert model.hf.training and all(m.training for m in model.hf.modules())
    assert {n: p.requires_grad for n, p in model.hf.named_parameters()} == flags
    assert all(p.grad is None for p in model.hf.parameters())
    assert_clean(model, weights)

    def failing(output, batch):
        raise RuntimeError("injected failure")

    model.hf.eval()
    with pytest.raises(RuntimeError, match="injected failure"):
        head_importance(model, inputs, failing)
    assert not model.hf.training and {n: p.requires_grad for n, p in model.hf.named_parameters()} == flags
    assert all(p.grad is None for p in model.hf.parameters())
    assert_clean(model, weights)


def test_importance_needs_a_differentiable_loss():
    model = _model("gpt2")
    with pytest.raises(TypeError, match="differentiable loss"):
        head_importance(model, _inputs(model), lambda out, batch: 1.0)
    with pytest.raises(ValueError, match=r"scalar or \(3,\) per-example"):
        head_importance(model, _inputs(model), lambda out, batch: out.logits.sum((1, 2))[:2])


# -- pruning_curve ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["importance", "ablation", "random"])
def test_curve_steps_and_never_empties_a_layer(order):
    model = _model("llama")
    inputs, weights = _inputs(model), _weights(model)
    df = pruning_curve(model, inputs, lm_loss, order=order, step=0.25, seeds=(0, 1))
    assert list(df.columns) == ["fraction_pruned", "heads_pruned", "metric", "order", "seed"]
    for _, curve in df.groupby("seed", dropna=False):
        # 8 heads, 25% of the remaining at each step, stopping at one head per layer
        assert curve.heads_pruned.tolist() == [0, 2, 4, 5, 6]
        with torch.no_grad():
            base = lm_loss(model(inputs["input_ids"], inputs["attention_mask"]), inputs)
        assert curve.metric.iloc[0] == pytest.approx(base, abs=1e-6)
    assert df.seed.nunique() == (2 if order == "random" else 0)
    assert_clean(model, weights)
    full = pruning_curve(model, inputs, lm_loss, order=order, step=0.5, seeds=(0,), allow_empty_layers=True)
    assert full.heads_pruned.iloc[-1] == 8


def test_random_curves_differ_by_seed_and_importance_follows_its_ranking():
    model = _model("gpt2")
    inputs = _inputs(model)
    df = pruning_curve(model, inputs, lm_loss, order="random", step=0.25, seeds=(0, 1, 2))
    assert df.groupby("seed").metric.apply(tuple).nunique() > 1
    imp = head_importance(model, inputs, lm_loss)
    first = imp.sort_values(["importance", "layer", "head"]).iloc[:2]
    curve = pruning_curve(model, inputs, lm_loss, order="importance", step=0.25, max_fraction=0.25)
    with ablate_heads(model, list(zip(first["layer"], first["head"]))), torch.no_grad():
        expected = lm_loss(model(inputs["input_ids"], inputs["attention_mask"]), inputs)
    assert curve.heads_pruned.tolist() == [0, 2]
    assert curve.metric.iloc[1] == pytest.approx(expected, abs=1e-6)
    # normalize=False ranks by the raw E|dL/dxi| instead of Michel's per-layer normalised value (on a model
    # where the two rankings differ).
    model = _model("qwen2")
    inputs = _inputs(model)
    imp = head_importance(model, inputs, lm_loss)
    first = imp.sort_values(["importance", "layer", "head"]).iloc[:2]
    first_raw = imp.sort_values(["importance_raw", "layer", "head"]).iloc[:2]
    assert set(zip(first_raw["layer"], first_raw["head"])) != set(zip(first["layer"], first["head"]))
    raw = pruning_curve(model, inputs, lm_loss, order="importance", step=0.25, max_fraction=0.25, normalize=False)
    with ablate_heads(model, list(zip(first_raw["layer"], first_raw["head"]))), torch.no_grad():
        expected_raw = lm_loss(model(inputs["input_ids"], inputs["attention_mask"]), inputs)
    assert raw.metric.iloc[1] == pytest.approx(expected_raw, abs=1e-6)


def test_curve_failing_midway_leaves_the_model_clean():
    model = _model("bert")
    inputs, weights, calls = _inputs(model), _weights(model), []
    metric = embedding_similarity(model, inputs)

    def flaky(output, batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return metric(output, batch)

    for order in ("importance", "ablation", "random"):
        calls.clear()
        with pytest.raises(RuntimeError, match="injected failure"):
            pruning_curve(model, inputs, flaky, order=order, loss=metric, higher_is_better=True)
        assert_clean(model, weights)


def test_curve_refuses_bad_input():
    model = _model("gpt2")
    inputs = _inputs(model)
    with pytest.raises(ValueError, match="Unknown pruning order 'magnitude'"):
        pruning_curve(model, inputs, lm_loss, order="magnitude")
    with pytest.raises(ValueError, match="step is the fraction"):
        pruning_curve(model, inputs, lm_loss, step=0)
    with pytest.raises(ValueError, match="pass higher_is_better"):
        pruning_curve(model, inputs, lambda out, batch: 0.0, order="ablation")


def test_curve_summary_areas_and_threshold():
    df = pd.DataFrame({"fraction_pruned": [0, 0.5, 1.0] * 3, "heads_pruned": [0, 1, 2] * 3,
                       "metric": [1, 0.96, 0.5, 1, 0.9, 0.2, 1, 0.7, 0.4],
                       "order": ["importance"] * 3 + ["random"] * 6, "seed": [None] * 3 + [0] * 3 + [1] * 3})
    summary = curve_summary(df, threshold=0.95).set_index("order")
    assert summary.loc["importance", "area"] == pytest.approx(0.25 * (1 + 0.96) + 0.25 * (0.96 + 0.5))
    assert summary.loc["random", "area"] == pytest.approx(0.25 * (1 + 0.8) + 0.25 * (0.8 + 0.3))
    assert summary.loc["importance", "fraction_at_0.95"] == 0.5
    assert summary.loc["random", "fraction_at_0.95"] == 0.0


# -- results on real models ------------------------------------------------------------------------------
def _sentences(n: int | None = None) -> list[str]:
    lines = [line.strip() for line in SENTENCES.read_text().splitlines() if line.strip()]
    return lines[:n]


@pytest.fixture(scope="module")
def toy():
    return interp.load_model("toy-induction", device="cpu")


def _toy_batch(toy, n=64, length=20):
    tokens = repeated_sequences(n, length, toy.cfg.vocab_size, torch.Generator().manual_seed(1234), bos_token_id=0)
    return {"input_ids": tokens, "attention_mask": None}


def _induction_heads(toy) -> list[tuple[int, int]]:
    from analyses.heads.detect import detect_heads

    df = detect_heads(toy, scores=["induction"], seq_len=61)  # [BOS, x, x] with |x| = 30, as in training
    labelled = df[df.label == "induction"]
    return list(zip(labelled["layer"].astype(int), labelled["head"].astype(int)))


def test_toy_induction_heads_carry_the_in_context_gain(toy):
    batch = _toy_batch(toy)
    heads = _induction_heads(toy)
    assert heads and all(l == 1 for l, _ in heads), heads
    with torch.no_grad():
        out = toy(batch["input_ids"])
        first, second = first_copy_loss(out, batch), second_copy_loss(out, batch)
        with ablate_heads(toy, heads):
            ablated = second_copy_loss(toy(batch["input_ids"]), batch)
    gain = first - second
    assert gain > 1.0
    assert ablated - second >= 0.5 * gain, (first, second, ablated)
    # Importance (Michel: normalised within each layer) ranks an induction head first overall, and the
    # induction heads above every other head of their layer. Layer 0's previous-token heads, which the
    # induction heads read, come next: they matter to the same loss.
    imp = head_importance(toy, batch, second_copy_loss).sort_values("importance", ascending=False)
    ranked = list(zip(imp["layer"], imp["head"]))
    assert ranked[0] in heads, imp
    layer1 = [head for head in ranked if head[0] == 1]
    assert set(layer1[: len(heads)]) == set(heads), imp


def test_minilm_importance_order_beats_random(minilm):
    """32 of the project's sentences, 20% steps up to half the heads: the fast version of the slow test below."""
    inputs = minilm.to_batch(_sentences(32))
    metric = embedding_similarity(minilm, inputs)
    weights = _weights(minilm)
    curves = pd.concat([pruning_curve(minilm, inputs, metric, order="importance", step=0.2, max_fraction=0.5),
                        pruning_curve(minilm, inputs, metric, order="random", step=0.2, seeds=(0, 1),
                                      max_fraction=0.5)])
    summary = curve_summary(curves).set_index("order")
    assert summary.loc["importance", "area"] > summary.loc["random", "area"], summary
    assert_clean(minilm, weights)


@pytest.mark.slow
def test_minilm_pruning_results(minilm):
    """The numbers reported in the README: all sentences, 10% steps, five random seeds."""
    inputs = minilm.to_batch(_sentences())
    metric = embedding_similarity(minilm, inputs)
    raw = pruning_curve(minilm, inputs, metric, order="importance", normalize=False).assign(order="importance_raw")
    curves = pd.concat([pruning_curve(minilm, inputs, metric, order="importance"), raw,
                        pruning_curve(minilm, inputs, metric, order="random", seeds=range(5))])
    summary = curve_summary(curves, threshold=0.95).set_index("order")
    print(summary.to_string())
    for order in ("importance", "importance_raw"):
        assert summary.loc[order, "area"] > summary.loc["random", "area"]
        assert summary.loc[order, "fraction_at_0.95"] > summary.loc["random", "fraction_at_0.95"]
