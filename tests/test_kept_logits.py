"""Scans that compute the logits only where the metric reads them (issue 40: ``Metric.trailing`` and
``engine.kept_logits`` pass ``logits_to_keep`` to the HF forward) give the numbers of the whole forward: activation
patching, path patching, attribution patching and the ablation scan, with and without left padding; the metrics read
the same value off the last positions as off all of them. And the cheaper forms of two per-token computations give
the same answers: the token losses on contiguous vocabulary rows, the finite check by row sums."""

from __future__ import annotations

import pytest
import torch

import interp
from analyses import (ablation_scan, activation_patching, attribution_patching, logit_difference, next_token_loss,
                      path_patching)
from analyses.causal import engine
from analyses.causal.engine import kept_logits
from analyses.causal.finite import _finite_rows
from analyses.data.metrics import _token_nll
from tests.tiny import tiny_model

TOL = 1e-5


def _pair(seed=0, shape=(3, 10)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 99, shape, generator=g), torch.randint(4, 99, shape, generator=g)


def _padded(ids: torch.Tensor) -> dict:
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # row 0 left-padded
    return {"input_ids": ids, "attention_mask": mask}


def _both(monkeypatch, study):
    """The study with kept logits, then with the whole output (the HF forward said not to take logits_to_keep)."""
    kept = study()
    with monkeypatch.context() as m:
        m.setattr(engine, "_takes_logits_to_keep", lambda hf: False)
        whole = study()
    return kept, whole


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("padded", [False, True])
def test_scans_with_kept_logits_equal_the_whole_forward(family, padded, monkeypatch):
    model = interp.load_model(tiny_model(family))
    clean, corrupted = _pair()
    if padded:
        clean, corrupted = _padded(clean), _padded(corrupted)
    ids = corrupted["input_ids"] if padded else corrupted
    metrics = [logit_difference(5, 7), next_token_loss(ids, 4, 9)]
    assert kept_logits(model, metrics[0], {"input_ids": ids}) == {"logits_to_keep": 1}
    assert kept_logits(model, metrics[1], {"input_ids": ids}) == {"logits_to_keep": 6}
    for metric in metrics:
        studies = {
            "activation": lambda: activation_patching(model, clean, corrupted, metric, heads_per_forward=3),
            "path": lambda: path_patching(model, clean, corrupted, [(1, 0), (1, 3)], metric),
            "attribution": lambda: attribution_patching(model, clean, corrupted, metric),
            "ablation": lambda: ablation_scan(model, corrupted, metric),
        }
        for name, study in studies.items():
            kept, whole = _both(monkeypatch, study)
            assert len(kept) == len(whole) > 0
            assert (kept["metric"] - whole["metric"]).abs().max() <= TOL, (name, metric.name)
            assert kept["metric"].std() > 0, (name, metric.name)  # heads differ: the comparison means something
            for key in ("clean", "corrupted"):
                if key in whole.attrs:
                    assert abs(kept.attrs[key] - whole.attrs[key]) <= TOL, (name, key)


def test_metrics_read_the_same_value_off_the_kept_positions():
    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(2, 8, 11, generator=g), torch.randint(0, 11, (2, 8), generator=g)
    batch = {"input_ids": ids, "attention_mask": None}
    out = lambda x: type("Output", (), {"logits": x})()  # noqa: E731
    for metric in (logit_difference([1, 2], [3, 4]), logit_difference(1, 2, position=-3), next_token_loss(ids, 2),
                   next_token_loss(ids, 3, 6), next_token_loss(ids, -5, -1)):
        k = metric.trailing(batch)
        assert 0 < k < 8, metric
        assert metric(out(logits[:, -k:]), batch) == pytest.approx(metric(out(logits), batch), abs=1e-6), metric
        if metric.name == "next_token_loss":  # fixed targets: a shorter input is not mistaken for kept logits
            with pytest.raises(ValueError, match="was built for inputs of shape"):
                metric(out(logits[:, -k:]), {"input_ids": ids[:, -k:], "attention_mask": None})
    assert logit_difference(1, 2, position=3).trailing(batch) is None  # counted from the start: the whole output


def test_token_losses_and_finite_checks_equal_the_plain_forms():
    g = torch.Generator().manual_seed(1)
    logits, targets = 5 * torch.randn(3, 7, 50, generator=g), torch.randint(0, 50, (3, 7), generator=g)
    plain = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    assert torch.allclose(_token_nll(logits[:, :], targets), plain, atol=1e-6)
    assert torch.allclose(_token_nll(logits[:, 2:5], targets[:, 2:5]), plain[:, 2:5], atol=1e-6)  # a strided view
    x = torch.randn(4, 1000, generator=g)
    x[1, 3], x[2, 7], x[3, 0], x[3, 1] = float("nan"), float("inf"), float("inf"), -float("inf")
    assert _finite_rows(x) == [True, False, False, False] == torch.isfinite(x).all(1).tolist()
    big = torch.full((2, 10), 3e38)  # finite entries whose sum overflows: still finite
    assert _finite_rows(big) == [True, True]


def test_copy_losses_read_the_kept_positions():
    from analyses.data.metrics import first_copy_loss, second_copy_loss
    from analyses.data.toy import repeated_sequences

    g = torch.Generator().manual_seed(2)
    for bos in (None, 0):
        ids = repeated_sequences(2, 5, 11, g, bos)
        batch = {"input_ids": ids, "attention_mask": None}
        logits = torch.randn(*ids.shape, 11, generator=g)
        out = lambda x: type("Output", (), {"logits": x})()  # noqa: E731
        k = second_copy_loss.trailing(batch)
        assert k == 5 and first_copy_loss.trailing(batch) is None
        assert second_copy_loss(out(logits[:, -k:]), batch) == pytest.approx(second_copy_loss(out(logits), batch),
                                                                              abs=1e-6)
        with pytest.raises(ValueError, match="logits_to_keep >= 5"):
            second_copy_loss(out(logits[:, -k + 1:]), batch)


def test_the_class_ablation_gives_the_numbers_of_whole_forwards():
    """The report's class ablation (second-copy loss on the kept logits, the first-copy loss from one clean forward)
    against the way it was computed before: every set through the scan engine with a plain function reading both
    losses off whole outputs."""
    from analyses import detect_heads
    from analyses.causal.ablation import _ablation_hooks, _Replacement, _site_masks
    from analyses.causal.engine import scan
    from analyses.data.metrics import first_copy_loss, second_copy_loss
    from analyses.atlas import class_ablation as study

    def old(model, batch, sets):
        zero, clean = _Replacement(model, "zero"), []

        def metric(output, inputs):
            if not clean:
                clean.append(float(first_copy_loss(output, inputs)))
            return float(second_copy_loss(output, inputs))

        baseline, values = scan(model, batch, sets, lambda heads: min((l for l, _ in heads), default=0),
                                lambda group, copies: _ablation_hooks(_site_masks(model, group), zero, copies),
                                metric, 1)
        return (clean[0], baseline), values

    model = interp.load_model("toy-induction")
    heads = detect_heads(model)
    new = study.class_ablation(model, heads)
    assert new is not None and new["rows"]
    original = study._second_copy_losses
    try:
        study._second_copy_losses = old
        before = study.class_ablation(model, heads)
    finally:
        study._second_copy_losses = original
    for key in ("first_copy_loss", "second_copy_loss"):
        assert new[key] == pytest.approx(before[key], abs=TOL)
    assert new["first_copy_loss"] - new["second_copy_loss"] > 0.1  # the toy learns in context: the shares mean something
    for a, b in zip(new["rows"], before["rows"], strict=True):
        assert a["heads"] == b["heads"]
        assert a["ablated"] == pytest.approx(b["ablated"], abs=TOL)
        assert a["random"] == pytest.approx(b["random"], abs=TOL)
        assert a["share"] == pytest.approx(b["share"], abs=TOL)
