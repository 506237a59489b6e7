"""Circuit analyses (issue 13): activation patching equals patching by hand with HF module hooks on every family and
both paths, the batched scan equals one head at a time; attribution patching equals activation patching where the
metric is linear in the patched activation; direct logit attribution sums to the logit difference; composition
scores find the toy's previous-token -> induction K-composition; path patching equals the two runs done by hand;
the model is left as it was, also after an exception; bad input gets clear errors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_ablation import _weights, assert_clean

import interp
from analyses import (activation_patching, attribution_patching, composition_scores, direct_logit_attribution,
                      induction_task, logit_difference, logit_lens, ov_circuit, path_patching, qk_circuit)
from analyses.causal.attribution import frozen_norm
from tests.tiny import FAMILIES, tiny_model

TOL = 1e-5


def _pair(seed=0, shape=(2, 10)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 99, shape, generator=g), torch.randint(4, 99, shape, generator=g)


def _o_proj_input(model, layer, ids):
    """The output projection's input (z flattened over heads) in a run on ``ids``, caught with a torch hook."""
    caught = {}
    o_proj = model._blocks[layer].get_submodule(model.structure.o_proj[layer])
    handle = o_proj.register_forward_pre_hook(lambda m, args: caught.setdefault("x", args[0].detach().clone()))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    return caught["x"]


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_activation_patching_equals_patching_by_hand(family, attn):
    model = interp.load_model(tiny_model(family), attn=attn)
    clean, corrupted = _pair()
    metric = logit_difference(5, 7)
    heads = [(0, 1), (1, 2), (1, 3)]
    batched = activation_patching(model, clean, corrupted, metric, heads=heads, heads_per_forward=3)
    alone = activation_patching(model, clean, corrupted, metric, heads=heads, heads_per_forward=1)
    assert (batched["metric"] - alone["metric"]).abs().max() <= TOL
    e = model.cfg.d_head_v
    for row in batched.itertuples():
        source = _o_proj_input(model, row.layer, clean)[..., row.head * e:(row.head + 1) * e]
        o_proj = model._blocks[row.layer].get_submodule(model.structure.o_proj[row.layer])

        def by_hand(module, args, head=row.head, source=source):
            x = args[0].clone()
            x[..., head * e:(head + 1) * e] = source
            return (x, *args[1:])

        handle = o_proj.register_forward_pre_hook(by_hand)
        try:
            with torch.no_grad():
                expected = metric(model(corrupted), {"input_ids": corrupted, "attention_mask": None})
        finally:
            handle.remove()
        assert abs(row.metric - expected) <= TOL, (family, row.layer, row.head)
    a = batched.attrs
    assert np.allclose(batched["effect"], (batched["metric"] - a["corrupted"]) / (a["clean"] - a["corrupted"]))


@pytest.mark.parametrize("what", ["q", "k", "v", "pattern"])
def test_patching_q_k_v_and_patterns_equals_the_edit_by_hand(what):
    model = interp.load_model(tiny_model("llama"), attn="eager")  # 4 heads on 2 key/value heads
    clean, corrupted = _pair(1)
    metric = logit_difference(3, 9)
    df = activation_patching(model, clean, corrupted, metric, what=what, by="head_pos", heads=[(1, 1)])
    assert list(df["pos"]) == list(range(10)) and set(df["layer"]) == {1}
    _, cache = model.run_with_cache(clean, names=[f"blocks.1.attn.hook_{what}"])
    source = cache[what, 1]
    for row in df.itertuples():
        def edit(act, hook, pos=row.pos):
            act = act.clone()
            if what == "pattern":
                act[:, 1, pos] = source[:, 1, pos]
            else:
                act[:, pos, 1] = source[:, pos, 1]
            return act

        with torch.no_grad():
            expected = metric(model.run_with_hooks(corrupted, fwd_hooks=[(f"blocks.1.attn.hook_{what}", edit)]),
                              {"input_ids": corrupted, "attention_mask": None})
        assert abs(row.metric - expected) <= TOL, (what, row.pos)


def test_attribution_equals_activation_patching_where_the_metric_is_linear():
    """A model whose logits are linear in the last layer's head outputs: no final norm, no MLP after them."""
    hf = tiny_model("llama", num_hidden_layers=2)
    hf.model.norm = torch.nn.Identity()
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight.zero_()
    model = interp.load_model(hf)
    assert model.structure.final_norm is None
    clean, corrupted = _pair(2)
    metric = logit_difference(5, 7)
    heads = [(1, h) for h in range(4)]
    exact = activation_patching(model, clean, corrupted, metric, heads=heads)
    estimate = attribution_patching(model, clean, corrupted, metric, heads=heads)
    assert (exact["metric"] - estimate["metric"]).abs().max() <= 1e-4
    assert (exact["effect"] - estimate["effect"]).abs().max() <= 1e-4
    per_pos = attribution_patching(model, clean, corrupted, metric, heads=heads, by="head_pos")
    totals = per_pos.groupby(["layer", "head"])["estimate"].sum().to_numpy()
    assert np.allclose(totals, estimate["estimate"].to_numpy(), atol=1e-5)


def test_attribution_patching_runs_on_both_paths_alike():
    model = interp.load_model(tiny_model("gpt2"), attn="flash")
    clean, corrupted, metric = induction_task(model, n=4, length=6)
    flash = attribution_patching(model, clean, corrupted, metric)
    model.set_attn("eager")
    eager = attribution_patching(model, clean, corrupted, metric)
    assert (flash["estimate"] - eager["estimate"]).abs().max() <= 1e-4


EXACT_DLA = ["gpt2", "llama", "qwen2", "gpt_neox", "phi", "opt", "olmo", "mixtral", "cohere", "stablelm"]


@pytest.mark.parametrize("family", EXACT_DLA)
def test_direct_logit_attribution_sums_to_the_logit_difference(family):
    model = interp.load_model(tiny_model(family))
    ids = torch.randint(4, 99, (3, 9), generator=torch.Generator().manual_seed(0))
    df = direct_logit_attribution(model, ids, answer=5, wrong=[7, 8, 9])
    with torch.no_grad():
        logits = model(ids).logits[:, -1]
    expected = float((logits[:, 5] - logits[torch.arange(3), torch.tensor([7, 8, 9])]).mean())
    assert df.attrs["logit"] == pytest.approx(expected, abs=1e-5)
    assert abs(df["attribution"].sum() - expected) <= 1e-4
    assert abs(df.attrs["remainder"]) <= 1e-4, df.attrs["remainder"]
    heads = df[df["component"] == "head"]
    assert len(heads) == len(model.cfg.heads()) and heads["attribution"].abs().max() > 1e-3


def test_direct_logit_attribution_says_what_it_cannot_split():
    """Gemma 2 normalises each branch before the residual add and soft-caps its logits: the split is not exact,
    and the remainder row says by how much; the rows still sum to the logit."""
    model = interp.load_model(tiny_model("gemma2", final_logit_softcapping=30.0))
    ids = torch.randint(4, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    df = direct_logit_attribution(model, ids, answer=5)
    assert abs(df.attrs["remainder"]) > 1e-3
    assert df["attribution"].sum() == pytest.approx(df.attrs["logit"], abs=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma", "olmo", "gpt_neox"])
def test_the_frozen_final_norm_is_the_norm_at_the_run(family):
    model = interp.load_model(tiny_model(family))
    norm = model.hf.get_submodule(model.structure.final_norm)
    x = torch.randn(4, model.cfg.d_model) * 3
    apply, bias = frozen_norm(norm, x)
    with torch.no_grad():
        assert torch.allclose(apply(x) + bias, norm(x).float(), atol=1e-5)
        parts = torch.randn(5, 4, model.cfg.d_model)
        assert torch.allclose(apply(parts).sum(0), apply(parts.sum(0)), atol=1e-4)  # linear in the parts


def test_logit_lens_ends_at_the_models_prediction():
    model = interp.load_model("toy-induction")
    clean, _, _ = induction_task(model, n=8, length=12)
    lens = logit_lens(model, clean[:, :-1], answer=clean[:, -1])
    assert list(lens["layer"]) == [-1, 0, 1]
    with torch.no_grad():
        probs = torch.softmax(model(clean[:, :-1]).logits[:, -1].float(), -1)
    assert lens["answer_prob"].iloc[-1] == pytest.approx(float(probs[torch.arange(8), clean[:, -1]].mean()), abs=1e-5)
    assert lens["answer_prob"].iloc[-1] > 0.9 > lens["answer_prob"].iloc[0]


def test_composition_scores_find_the_toy_induction_circuit():
    model = interp.load_model("toy-induction")
    k = composition_scores(model, "k")
    top = k.sort_values("score", ascending=False).head(6)
    assert set(zip(top["source_layer"], top["source_head"])) <= {(0, 3), (0, 0)}  # the previous-token heads
    assert set(zip(top["layer"], top["head"])) <= {(1, 0), (1, 1), (1, 3)}  # the induction heads
    assert top["score"].min() > k["score"].median() * 1.2
    # the low-rank norms equal the full d_model x d_model computation
    ov, qk = ov_circuit(model, 0).full()[3], qk_circuit(model, 1).full()[1]
    full = torch.linalg.norm(ov @ qk.T) / (torch.linalg.norm(ov) * torch.linalg.norm(qk))
    row = k[(k.source_layer == 0) & (k.source_head == 3) & (k.layer == 1) & (k["head"] == 1)]
    assert float(row["score"].iloc[0]) == pytest.approx(float(full), rel=1e-9)
    for kind in ("q", "v"):
        assert len(composition_scores(model, kind)) == 16


def test_path_patching_equals_the_two_runs_by_hand():
    model = interp.load_model(tiny_model("llama", num_hidden_layers=3))
    clean, corrupted = _pair(3)
    metric = logit_difference(5, 7)
    receivers, via = [(2, 0), (2, 3)], "k"
    df = path_patching(model, clean, corrupted, receivers, metric, via=via, heads_per_forward=3)
    assert list(zip(df["layer"], df["head"])) == [(l, h) for l in (0, 1) for h in range(4)]
    alone = path_patching(model, clean, corrupted, receivers, metric, via=via, heads_per_forward=1)
    assert (df["metric"] - alone["metric"]).abs().max() <= TOL
    z = [f"blocks.{l}.attn.hook_z" for l in range(3)]
    _, c = model.run_with_cache(clean, names=z)
    _, x = model.run_with_cache(corrupted, names=z)
    for sender in [(0, 2), (1, 1)]:
        def freeze(act, hook):
            out = x["z", hook.layer].clone()
            if hook.layer == sender[0]:
                out[:, :, sender[1]] = c["z", hook.layer][:, :, sender[1]]
            return out

        _, mixed = model.run_with_cache(corrupted, names=["blocks.2.attn.hook_k"], fwd_hooks=[(z, freeze)])
        kv = sorted({h // 2 for _, h in receivers})

        def put(act, hook):
            act = act.clone()
            act[:, :, kv] = mixed["k", 2][:, :, kv]
            return act

        with torch.no_grad():
            expected = metric(model.run_with_hooks(corrupted, fwd_hooks=[("blocks.2.attn.hook_k", put)]),
                              {"input_ids": corrupted, "attention_mask": None})
        got = df.set_index(["layer", "head"]).loc[sender, "metric"]
        assert abs(got - expected) <= TOL, sender


def test_every_analysis_leaves_the_model_as_it_was_even_after_an_exception():
    model = interp.load_model(tiny_model("llama"))
    model.hf.train()
    weights = _weights(model)
    clean, corrupted = _pair()
    calls = []

    def flaky(output, inputs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return output.logits[:, -1, 5].mean()

    for run in (lambda m: activation_patching(model, clean, corrupted, m, heads_per_forward=2),
                lambda m: path_patching(model, clean, corrupted, [(1, 0)], m),
                lambda m: attribution_patching(model, clean, corrupted, m)):
        calls.clear()
        try:
            run(flaky)
        except RuntimeError as err:
            assert "injected failure" in str(err)
        assert model.hf.training and all(p.requires_grad for p in model.hf.parameters())
        assert_clean(model, weights)
    for run in (lambda: direct_logit_attribution(model, clean, 5, 7), lambda: logit_lens(model, clean),
                lambda: composition_scores(model, "q")):
        run()
        assert_clean(model, weights)


def test_bad_input_gets_clear_errors():
    model = interp.load_model(tiny_model("llama"))
    clean, corrupted = _pair()
    metric = logit_difference(5, 7)
    with pytest.raises(ValueError, match=r"same shape \(batch, pos\).*\(2, 10\) and \(2, 9\)"):
        activation_patching(model, clean, corrupted[:, :9], metric)
    with pytest.raises(ValueError, match="must return one number"):
        activation_patching(model, clean, corrupted, lambda out, inputs: out.logits[:, -1, 5])
    with pytest.raises(ValueError, match=r"Head 9 is out of range"):
        activation_patching(model, clean, corrupted, metric, heads=[(0, 9)])
    with pytest.raises(ValueError, match="needs the eager path"):
        activation_patching(model, clean, corrupted, metric, what="pattern")
    with pytest.raises(ValueError, match="what must be one of"):
        activation_patching(model, clean, corrupted, metric, what="mlp")
    with pytest.raises(ValueError, match="Senders must sit before"):
        path_patching(model, clean, corrupted, [(0, 1)], metric, senders=[(1, 0)])
    with pytest.raises(ValueError, match="one token"):
        direct_logit_attribution(model, clean, answer=[1, 2, 3])
    with pytest.raises(NotImplementedError, match="causal LM"):
        direct_logit_attribution(interp.load_model(tiny_model("bert")), clean, answer=5)
    with pytest.raises(ValueError, match="kind must be"):
        composition_scores(model, "x")
    assert model._registry.active() == []


def test_cli_patch_and_attribute(capsys):
    from analyses.cli import main

    assert main(["patch", "--n-prompts", "4", "--format", "csv"]) == 0
    assert "effect" in capsys.readouterr().out
    assert main(["patch", "--method", "path", "--receivers", "1.1", "--via", "k", "--n-prompts", "4"]) == 0
    assert main(["attribute", "--n-prompts", "4"]) == 0
    out = capsys.readouterr().out
    assert "remainder" in out and "mlp" in out
    assert main(["patch", "--clean", "1 2 3"]) == 2
    assert "give --clean, --corrupted, --answer and --wrong together" in capsys.readouterr().err
