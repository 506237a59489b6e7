"""Circuit studies of encoder-decoder models, per (site, head): ablation scans, activation and attribution patching,
head importance and pruning curves on tiny T5 and BART (padding on both sides, both attention paths) and on the
copy toy, whose copying heads are known: the cross-attention heads."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import spearmanr

import interp
from interp.model.config import real_sites
from analyses import (ablate_heads, ablation_scan, activation_patching, attribution_patching, composition_scores,
                      direct_logit_attribution, head_importance, logit_lens, ov_circuit, prune_model, pruning_curve,
                      qk_circuit)
from analyses.explain.composition import head_weights
from analyses.data.batches import batch_of
from analyses.data.metrics import target_accuracy, target_loss
from analyses.data.seq2seq import copy_accuracy, copy_task, train_copy_model
from test_seq2seq import _batch, _tiny

FRONT = ["stack", "kind", "site", "layer", "head"]


def _padded(seed: int = 1) -> dict:
    """Source and target padded (on the right, rows of different lengths), labels -100 on padded targets."""
    src, src_mask, tgt, tgt_mask = _batch()
    labels = torch.randint(3, 100, tgt.shape, generator=torch.Generator().manual_seed(seed)).masked_fill(tgt_mask == 0, -100)
    return {"input_ids": src, "attention_mask": src_mask, "decoder_input_ids": tgt, "decoder_attention_mask": tgt_mask,
            "labels": labels}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (on a busy 2-core machine the copy toy trains in 7 s on one, 85 s on
    two), and the toy's training is then reproducible: a different thread count sums in another order and trains
    another model (on two threads a decoder self-attention head ranks among the cross heads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["t5", "bart"])
def tiny(request):
    return request.param, _tiny(request.param)


@pytest.fixture(scope="module")
def copy_model():
    return train_copy_model(steps=400, n_heads=4, seed=0)


def _state(model) -> dict:
    return {"weights": {k: v.clone() for k, v in model.hf.state_dict().items()},
            "modes": [m.training for m in model.hf.modules()],
            "grad": [p.requires_grad for p in model.hf.parameters()],
            "hooks": {n: list(p.fns) for n, p in model._registry.points.items()}, "torch": set(model._torch_handles)}


def assert_unchanged(model, before: dict) -> None:
    after = _state(model)
    assert all(torch.equal(v, after["weights"][k]) for k, v in before["weights"].items())
    assert after["modes"] == before["modes"] and after["grad"] == before["grad"]
    assert after["hooks"] == before["hooks"] and after["torch"] == before["torch"]


def _studies(batch, corrupted):
    loss = target_loss()
    return {"ablation_zero": lambda m, metric=loss: ablation_scan(m, batch, metric),
            "ablation_mean": lambda m, metric=loss: ablation_scan(m, batch, metric, method="mean", reference=corrupted),
            "patching": lambda m, metric=loss: activation_patching(m, batch, corrupted, metric),
            "attribution": lambda m, metric=loss: attribution_patching(m, batch, corrupted, metric),
            "importance": lambda m, metric=loss: head_importance(m, batch, metric),
            "pruning": lambda m, metric=loss: pruning_curve(m, batch, metric, step=0.5, max_fraction=0.5)}


def _corrupted(batch: dict, seed: int = 2) -> dict:
    """The batch with other source tokens (same padding, same targets and labels)."""
    other = torch.randint(3, 100, batch["input_ids"].shape, generator=torch.Generator().manual_seed(seed))
    return {**batch, "input_ids": torch.where(batch["attention_mask"].bool(), other, batch["input_ids"])}


# -- every study on tiny T5 and BART -------------------------------------------------------------------------------
def test_every_study_runs_on_both_paths_agrees_and_leaves_the_model_as_it_was(tiny):
    family, hf = tiny
    batch = _padded()
    corrupted = _corrupted(batch)
    results = {}
    for attn in ("eager", "flash"):
        model = interp.load_model(copy.deepcopy(hf), attn=attn)
        model.hf.train()  # a user's state: train mode, a frozen parameter, an identity hook
        next(model.hf.parameters()).requires_grad_(False)
        with model.hooks([("decoder.blocks.1.cross_attn.hook_z", lambda z, hook: z)]):
            before = _state(model)
            for name, study in _studies(batch, corrupted).items():
                results[attn, name] = study(model)
                assert_unchanged(model, before)
    n_heads = 6 * 4
    for name in ("ablation_zero", "ablation_mean", "patching", "attribution", "importance"):
        eager, flash = results["eager", name], results["flash", name]
        assert list(eager.columns[:5]) == FRONT and len(eager) == n_heads, name
        assert set(eager["kind"]) == {"self", "cross"} and set(eager["stack"]) == {"encoder", "decoder"}
        assert eager[FRONT].equals(flash[FRONT])
        value = {"importance": "importance_raw", "attribution": "estimate"}.get(name, "metric")
        scale = max(1.0, float(eager[value].abs().max()))
        assert np.allclose(eager[value], flash[value], atol=1e-4 * scale, rtol=0), name
    assert list(results["eager", "ablation_zero"].columns) == FRONT + ["metric", "delta", "baseline"]
    assert list(results["eager", "patching"].columns) == FRONT + ["metric", "effect"]
    assert list(results["eager", "attribution"].columns) == FRONT + ["metric", "effect", "estimate"]
    assert list(results["eager", "importance"].columns) == FRONT + ["importance", "importance_raw"]
    # a corrupted source reaches the encoder and cross-attention, never the decoder's self-attention of block 0
    patching = results["eager", "patching"]
    assert (patching[patching.site == "decoder.blocks.0.attn"]["effect"].abs() < 1e-6).all()
    assert (patching[patching["stack"] == "encoder"]["effect"].abs() > 1e-6).any()
    pruning = results["eager", "pruning"]
    assert list(pruning["heads_pruned"]) == [0, 12] and pruning["metric"].iloc[0] == pytest.approx(
        results["eager", "ablation_zero"]["baseline"].iloc[0], abs=1e-5)


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_scan_rows_equal_ablating_that_head_alone_with_several_heads_per_forward(tiny, attn):
    """The engine replicates the padded batch (source and target) and ablates a different head in each copy; each
    row must equal the run with that head ablated by hand."""
    family, hf = tiny
    model = interp.load_model(copy.deepcopy(hf), attn=attn)
    batch, metric = _padded(), target_loss()
    reference = _corrupted(batch)
    for method in ("zero", "mean", "resample"):
        together = ablation_scan(model, batch, metric, method=method, reference=reference, heads_per_forward=24)
        alone = ablation_scan(model, batch, metric, method=method, reference=reference, heads_per_forward=1)
        assert np.allclose(together["metric"], alone["metric"], atol=1e-5, rtol=0), method
        for row in together.iloc[[0, 9, 15, 23]].itertuples():  # an encoder, a decoder and two cross heads
            with ablate_heads(model, [(row.site, row.head)], method=method, reference=reference), torch.no_grad():
                by_hand = metric(model(batch), batch)
            assert row.metric == pytest.approx(by_hand, abs=1e-5), (method, row.site, row.head)


def test_mean_ablation_averages_over_real_positions_only(tiny):
    """Encoder heads take the mean over real source positions, decoder and cross heads over real target positions
    (cross-attention z lives on the target): padding would pull the mean elsewhere."""
    family, hf = tiny
    model = interp.load_model(copy.deepcopy(hf), attn="flash")
    reference = _padded()
    sites = ["encoder.blocks.1.attn", "decoder.blocks.0.attn", "decoder.blocks.1.cross_attn"]
    with torch.no_grad():
        _, cache = model.run_with_cache(reference, names=[f"{s}.hook_z" for s in sites])
        seen = {}
        with ablate_heads(model, [(s, 2) for s in sites], method="mean", reference=reference), \
                model.hooks([([f"{s}.hook_z" for s in sites], lambda z, hook: seen.update({hook.name: z}))]):
            model(reference)
    for site in sites:
        z = cache[f"{site}.hook_z"][:, :, 2]  # (b, p, e)
        mask = reference["attention_mask" if site.startswith("encoder") else "decoder_attention_mask"].bool()
        want = z[mask].mean(0)
        assert torch.allclose(seen[f"{site}.hook_z"][:, :, 2], want.expand_as(z), atol=1e-6), site
        assert not torch.allclose(z.mean((0, 1)), want, atol=1e-4), site  # padding would have moved it
        if site != sites[-1]:  # other heads untouched where no ablated head feeds the site (the last one's do)
            assert torch.equal(seen[f"{site}.hook_z"][:, :, 1], cache[f"{site}.hook_z"][:, :, 1])


def test_studies_that_change_nothing_give_the_baseline(tiny):
    family, hf = tiny
    model = interp.load_model(copy.deepcopy(hf), attn="flash")
    batch, metric = _padded(), target_loss()
    same = ablation_scan(model, batch, metric, method="resample", reference=batch)  # each head replaced by itself
    assert same["delta"].abs().max() < 1e-5
    patched = activation_patching(model, batch, batch, metric)  # clean == corrupted
    assert (patched["metric"] - patched.attrs["corrupted"]).abs().max() < 1e-5
    assert patched.attrs["clean"] == pytest.approx(patched.attrs["corrupted"], abs=1e-6) and patched["effect"].isna().all()
    estimated = attribution_patching(model, batch, batch, metric)
    assert (estimated["estimate"] == 0).all()


def test_patching_by_head_and_position_and_other_activations(tiny):
    family, hf = tiny
    model = interp.load_model(copy.deepcopy(hf), attn="eager")
    batch = _padded()
    corrupted = _corrupted(batch)
    metric = target_loss()
    by_head = activation_patching(model, batch, corrupted, metric)
    assert list(by_head.columns) == FRONT + ["metric", "effect"] and len(by_head) == 24  # every head of every site
    by_pos = activation_patching(model, batch, corrupted, metric, by="head_pos", heads=[("encoder.blocks.1.attn", 0),
                                                                                       ("decoder.blocks.1.cross_attn", 3)])
    assert list(by_pos.columns) == FRONT + ["pos", "metric", "effect"]
    assert sorted(by_pos.groupby("site")["pos"].max().items()) == [("decoder.blocks.1.cross_attn", 5),
                                                                   ("encoder.blocks.1.attn", 8)]
    for what in ("k", "v", "pattern"):
        df = activation_patching(model, batch, corrupted, metric, what=what)
        assert len(df) == 24 and df.attrs["what"] == what
    k = activation_patching(model, batch, corrupted, metric, what="k", by="head_pos",
                            heads=[("decoder.blocks.0.cross_attn", 1)])
    assert len(k) == 9  # cross-attention keys live on the source
    estimate = attribution_patching(model, batch, corrupted, metric, by="head_pos", heads=[("decoder.blocks.1.cross_attn", 3)])
    total = attribution_patching(model, batch, corrupted, metric, heads=[("decoder.blocks.1.cross_attn", 3)])
    assert len(estimate) == 6 and estimate["estimate"].sum() == pytest.approx(total["estimate"].iloc[0], abs=1e-5)


# -- the copy toy: known answers ----------------------------------------------------------------------------------
def test_ablation_scan_finds_the_cross_heads_that_copy(copy_model):
    model = copy_model
    batch = copy_task(model, 64, 10, seed=5)
    assert copy_accuracy(model, batch) > 0.98
    df = ablation_scan(model, batch, target_loss())
    n_cross = int((df.kind == "cross").sum())
    top = df.nlargest(n_cross, "delta")
    assert (top["kind"] == "cross").all()  # the largest loss increases are the cross-attention heads'
    assert top["delta"].iloc[0] > 10 * df[df.kind == "self"]["delta"].abs().max()
    with ablate_heads(model, [(r.site, r.head) for r in top.itertuples()]):
        assert copy_accuracy(model, batch) < 0.2  # chance is 1/21
    bottom = df.nsmallest(n_cross, "delta")
    with ablate_heads(model, [(r.site, r.head) for r in bottom.itertuples()]):
        assert copy_accuracy(model, batch) > 0.9
    accuracy = ablation_scan(model, batch, target_accuracy(), method="mean", reference=copy_task(model, 64, 10, seed=7))
    assert accuracy.nsmallest(1, "delta")["kind"].item() == "cross" and accuracy["baseline"].iloc[0] > 0.98


def test_patching_a_corrupted_source_puts_the_effect_on_cross_heads_and_attribution_agrees(copy_model):
    """Half the source replaced (positions 0-4): the clean targets are unpredictable there. Patching each head's
    clean z restores the loss through the cross-attention heads; the decoder's self-attention sees the same target
    and cannot matter. Attribution patching (one backward) ranks heads as activation patching does."""
    model = copy_model
    batch = copy_task(model, 64, 10, seed=5)
    source = batch["input_ids"].clone()
    source[:, :5] = copy_task(model, 64, 10, seed=6)["input_ids"][:, :5]
    corrupted = {**batch, "input_ids": source}  # same decoder inputs and labels
    metric = target_loss()
    patched = activation_patching(model, batch, corrupted, metric)
    estimated = attribution_patching(model, batch, corrupted, metric)
    assert patched.attrs["corrupted"] > patched.attrs["clean"] + 3
    n_cross = int((patched.kind == "cross").sum())
    assert (patched.nlargest(2, "effect")["kind"] == "cross").all()
    assert patched["effect"].max() > 0.3
    assert (patched[patched["stack"] == "decoder"].query("kind == 'self'")["effect"] == 0).all()
    assert (estimated[estimated["stack"] == "decoder"].query("kind == 'self'")["estimate"] == 0).all()
    rho = spearmanr(patched["effect"], estimated["effect"])[0]
    assert rho > 0.8, rho
    cross = patched.kind == "cross"
    assert spearmanr(patched["effect"][cross], estimated["effect"][cross])[0] == pytest.approx(1.0)
    assert n_cross == 4


def test_importance_and_pruning_keep_the_cross_heads(copy_model):
    model = copy_model
    batch = copy_task(model, 64, 10, seed=5)
    importance = head_importance(model, batch, target_loss())
    assert list(importance.columns) == FRONT + ["importance", "importance_raw"]
    labels = target_loss(batch["labels"])  # per-row state: each chunk of rows gets its own labels
    for loss in (target_loss(), labels):  # rows in chunks (decoder ids, masks and labels split with them): the same
        pd.testing.assert_frame_equal(head_importance(model, batch, loss, batch_size=24), importance,
                                      check_exact=False, rtol=1e-5, atol=1e-7)
    top = importance.nlargest(2, "importance_raw")
    assert (top["kind"] == "cross").all()
    for _, site in importance.groupby("site"):  # L2-normalised within each site
        assert float(np.linalg.norm(site["importance"])) == pytest.approx(1.0, abs=1e-6)
    kept = pruning_curve(model, batch, target_accuracy(), loss=target_loss(), step=0.25, max_fraction=0.6)
    random = pruning_curve(model, batch, target_accuracy(), order="random", step=0.25, max_fraction=0.6, seeds=(0,))
    assert kept["metric"].iloc[0] > 0.98 and kept["fraction_pruned"].iloc[-1] >= 0.5
    assert kept["metric"].iloc[-1] > 0.9 > random["metric"].iloc[-1]
    ablation = pruning_curve(model, batch, target_accuracy(), order="ablation", step=0.25, max_fraction=0.6)
    assert ablation["metric"].iloc[-1] > 0.9


# -- hygiene and errors --------------------------------------------------------------------------------------------
def test_every_study_leaves_the_model_as_it_was_after_an_exception():
    model = interp.load_model(_tiny("bart"), attn="flash")
    batch = _padded()
    corrupted = _corrupted(batch)
    model.hf.train()
    next(model.hf.parameters()).requires_grad_(False)

    class Boom(type(target_loss())):  # fails on call number `at`: inside the scan, after the baseline
        calls, at = 0, 2

        def per_example(self, output, inputs):
            Boom.calls += 1
            if Boom.calls == Boom.at:
                raise RuntimeError("boom")
            return super().per_example(output, inputs)

    with model.hooks([("encoder.blocks.0.attn.hook_z", lambda z, hook: z)]):
        before = _state(model)
        for name, study in _studies(batch, corrupted).items():
            Boom.calls, Boom.at = 0, 1 if name == "importance" else 2  # importance: one forward and backward
            with pytest.raises(RuntimeError, match="boom"):
                study(model, Boom("loss", None))
            assert_unchanged(model, before)
    assert not model._registry.active() and model.hf.training


def test_clear_errors():
    model = interp.load_model(_tiny("t5"), attn="flash")
    batch = _padded()
    metric = target_loss()
    for heads, match in (([(0, 1)], r"\(site, head\) pairs"), ([("decoder.blocks.0.cross", 1)], "did you mean"),
                         ([("decoder.blocks.0.cross_attn", 4)], "heads 0..3"), ("encoder.blocks.0.attn", "pairs"),
                         ([], "empty")):
        with pytest.raises(ValueError, match=match):
            ablation_scan(model, batch, metric, heads=heads)
        with pytest.raises(ValueError, match=match):
            with ablate_heads(model, heads):
                pass
    with pytest.raises(ValueError, match="decoder_input_ids"):
        ablation_scan(model, {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}, metric)
    with pytest.raises(ValueError, match="decoder_input_ids"):
        activation_patching(model, batch["input_ids"], batch["input_ids"], metric)
    with pytest.raises(ValueError, match="decoder_input_ids"):
        head_importance(model, {"input_ids": batch["input_ids"]}, metric)
    with pytest.raises(ValueError, match="same shape"):
        activation_patching(model, batch, {**batch, "decoder_input_ids": batch["decoder_input_ids"][:, :4],
                                           "decoder_attention_mask": None}, metric)
    with pytest.raises(ValueError, match="same padding"):
        attribution_patching(model, batch, {**batch, "attention_mask": None}, metric)
    with pytest.raises(ValueError, match="reference"):
        ablation_scan(model, batch, metric, method="mean")
    with pytest.raises(ValueError, match="shape of the inputs"):
        ablation_scan(model, batch, metric, method="resample", reference={**batch, **{k: batch[k][:2] for k in batch}})
    with pytest.raises(ValueError, match="labels"):
        ablation_scan(model, {k: v for k, v in batch.items() if k != "labels"}, metric)
    with pytest.raises(TypeError, match="no gradient"):
        head_importance(model, batch, target_accuracy())
    with pytest.raises(NotImplementedError, match=r"t5 model: encoder.blocks.0.attn: .*relative_attention_bias.weight "
                       r"of shape \(8, 4\).*no site's heads can be removed alone"):
        prune_model(model, [("decoder.blocks.1.cross_attn", 0)])  # T5's position bias is shared by every block
    assert batch_of(model, batch)["decoder_input_ids"].shape == (3, 6)
    assert not model._registry.active()


@pytest.mark.parametrize("family", ["t5", "bart", "marian"])
def test_direct_logit_attribution_of_the_decoder_stack_sums_to_the_logit_difference(family):
    """The decoder stack's one residual stream splits exactly into the embedding, every self- and cross-attention
    head, every MLP and the biases: T5 pre-norm with its scaled tied unembedding, BART and Marian post-norm (each
    norm on the stream frozen at the run)."""
    model = interp.load_model(_tiny(family), attn="flash")
    batch = _padded()
    df = direct_logit_attribution(model, batch, answer=5, wrong=[7, 8, 9], position=3)
    with torch.no_grad():
        logits = model(batch).logits[:, 3]
    expected = float((logits[:, 5] - logits[torch.arange(3), torch.tensor([7, 8, 9])]).mean())
    assert df.attrs["logit"] == pytest.approx(expected, abs=1e-6)
    assert abs(df["attribution"].sum() - expected) <= 1e-5
    assert abs(df.attrs["remainder"]) <= 1e-5 * max(1.0, abs(expected)), df.attrs["remainder"]
    heads = df[df["component"] == "head"]
    assert list(df.columns[:6]) == ["component", *FRONT]
    assert sorted(map(tuple, heads[["site", "head"]].values.tolist())) == sorted(model.cfg.heads()[8:])  # decoder sites
    assert set(heads["kind"]) == {"self", "cross"} and (heads["stack"] == "decoder").all()
    assert (heads.groupby("kind")["attribution"].apply(lambda a: a.abs().max()) > 1e-5).all()  # both kinds count
    assert len(df[df["component"] == "mlp"]) == 2
    if family == "t5":
        assert df.attrs["logit_scale"] == pytest.approx(32 ** -0.5)


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_logit_lens_of_the_decoder_stack_ends_at_the_models_prediction(family):
    model = interp.load_model(_tiny(family), attn="flash")
    batch = _padded()
    lens = logit_lens(model, batch, answer=[5, 6, 7], position=2)
    assert list(lens["layer"]) == [-1, 0, 1]
    with torch.no_grad():
        probs = torch.softmax(model(batch).logits[:, 2].float(), -1)
    assert lens["answer_prob"].iloc[-1] == pytest.approx(float(probs[torch.arange(3), torch.tensor([5, 6, 7])].mean()),
                                                         abs=1e-6)
    assert lens["answer_prob"].iloc[0] != pytest.approx(lens["answer_prob"].iloc[-1], abs=1e-6)
    with pytest.raises(ValueError, match="positions"):
        logit_lens(model, batch, position=6)  # the decoder has 6 positions (the source 9)


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_composition_pairs_follow_what_each_side_reads(family):
    """Queries read their own stack's stream, a cross site's keys and values the encoder's: encoder heads K- and
    V-compose into cross sites and Q-compose into nothing of the decoder; decoder heads Q-compose into later
    decoder sites (a block's self-attention into its own cross-attention included) and K-compose only into
    decoder self-attention."""
    model = interp.load_model(_tiny(family), attn="flash")
    pairs = {kind: set(zip(df["source_site"], df["site"])) for kind in "qkv"
             for df in [composition_scores(model, kind)]}
    enc0, enc1 = "encoder.blocks.0.attn", "encoder.blocks.1.attn"
    dec0, cross0, dec1, cross1 = ("decoder.blocks.0.attn", "decoder.blocks.0.cross_attn", "decoder.blocks.1.attn",
                                  "decoder.blocks.1.cross_attn")
    within = {(enc0, enc1), (dec0, cross0), (dec0, dec1), (dec0, cross1), (cross0, dec1), (cross0, cross1),
              (dec1, cross1)}
    assert pairs["q"] == within
    into_cross = {(e, c) for e in (enc0, enc1) for c in (cross0, cross1)}
    decoder_self = {(dec0, dec1), (cross0, dec1)}
    assert pairs["k"] == pairs["v"] == {(enc0, enc1)} | into_cross | decoder_self
    df = composition_scores(model, "k", fold_norms=False)
    assert list(df.columns) == ["source_stack", "source_kind", "source_site", "source_layer", "source_head", *FRONT,
                                "score"]
    # an encoder head into a cross site's keys: the low-rank score equals the full d_model x d_model computation
    ov, qk = ov_circuit(model, enc1, fold_norms=False).full()[2], qk_circuit(model, cross1, fold_norms=False).full()[3]
    full = torch.linalg.norm(ov @ qk.T) / (torch.linalg.norm(ov) * torch.linalg.norm(qk))
    row = df[(df.source_site == enc1) & (df.source_head == 2) & (df.site == cross1) & (df["head"] == 3)]
    assert float(row["score"].iloc[0]) == pytest.approx(float(full), rel=1e-9)
    # the factors are the module's own weights: head 3 of the cross site is rows 24..31 of its k projection (the
    # keys read the encoder's output: no decoder norm folded in) and columns 24..31 of its output projection
    module, proj = model.projections_of(model.sites[cross1])
    weights = head_weights(model, cross1)
    assert torch.equal(weights["W_K"][3], module.get_submodule(proj.k).weight.detach().double()[24:32].T)
    assert torch.equal(weights["W_O"][3], model.o_proj_of(model.sites[cross1]).weight.detach().double()[:, 24:32].T)


@pytest.mark.parametrize("family", ["bart", "marian"])
def test_pruning_every_kind_of_site_equals_zero_ablation_and_survives_a_save(family, tmp_path):
    model = interp.load_model(_tiny(family), attn="eager")
    heads = [("encoder.blocks.0.attn", 1), ("encoder.blocks.1.attn", 0), ("encoder.blocks.1.attn", 3),
             ("decoder.blocks.0.attn", 2), ("decoder.blocks.1.cross_attn", 0), ("decoder.blocks.1.cross_attn", 1)]
    before = _state(model)
    pruned = prune_model(model, heads)
    assert_unchanged(model, before)
    assert [s.n_heads for s in pruned.cfg.sites] == [3, 2, 3, 4, 4, 2]
    assert pruned.hf.get_decoder().layers[1].encoder_attn.k_proj.weight.shape == (16, 32)  # physically smaller
    batch = _padded()
    with torch.no_grad():
        with ablate_heads(model, heads):
            expected = model(batch).logits
        got = pruned(batch).logits
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)
    assert pruned.hf.config.interp_pruned_heads["decoder.blocks.1.cross_attn"] == [2, 3]
    loaded = interp.load_model(pruned.save_pretrained(tmp_path / "pruned"), attn="eager")
    assert [s.n_heads for s in loaded.cfg.sites] == [3, 2, 3, 4, 4, 2] and loaded.cfg.pruned
    with torch.no_grad():
        assert torch.allclose(loaded(batch).logits, got, atol=1e-6, rtol=0)
    # pruning again names heads in the pruned model's numbering and records the original ones
    again = prune_model(loaded, [("decoder.blocks.1.cross_attn", 0), ("encoder.blocks.1.attn", 1)])
    assert again.hf.config.interp_pruned_heads["decoder.blocks.1.cross_attn"] == [3]
    assert again.hf.config.interp_pruned_heads["encoder.blocks.1.attn"] == [1]
    emptied = [("decoder.blocks.0.cross_attn", h) for h in range(4)]
    with pytest.raises(ValueError, match="every head"):
        prune_model(model, emptied)
    empty = prune_model(model, emptied, allow_empty_layers=True)  # one zeroed placeholder head is left
    with torch.no_grad():
        with ablate_heads(model, emptied):
            expected = model(batch).logits
        assert torch.allclose(empty(batch).logits, expected, atol=1e-6, rtol=0)
    assert empty.cfg.empty_sites == ("decoder.blocks.0.cross_attn",)
    assert [s.name for s in real_sites(empty)] == [s.name for s in model.cfg.sites if s.name != emptied[0][0]]
    assert not any(site == "decoder.blocks.0.cross_attn" for site, _ in empty.cfg.heads())
    with pytest.raises(ValueError, match="pruned empty"):
        ablation_scan(empty, batch, target_loss(), heads=[("decoder.blocks.0.cross_attn", 0)])
    dla = direct_logit_attribution(empty, batch, 5, position=2)
    assert "decoder.blocks.0.cross_attn" not in set(dla["site"]) and abs(dla.attrs["remainder"]) <= 1e-5
    assert "decoder.blocks.0.cross_attn" not in set(composition_scores(empty, "q")["site"])
