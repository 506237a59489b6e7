"""benchmarks/bench_vs_wu.py's re-implementation of Wu et al.'s detector (HF eager attention, output_attentions
while decoding) gives our retrieval scores on the same prompts, trial by trial and head by head: the benchmark
asserts the same on SmolLM2, this keeps it true on the toy model in CI."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import interp
from analyses.long.retrieval import retrieval_heads, retrieval_step_hits, run_needle
from analyses.data.needles import needle_prompts
from interp.model.bundled import bundled_folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_vs_wu  # noqa: E402


@pytest.fixture(scope="module")
def models():
    hf = AutoModelForCausalLM.from_pretrained(bundled_folder("toy-induction"), attn_implementation="eager",
                                              dtype=torch.float32).eval()
    return interp.load_model("toy-induction"), hf


@pytest.mark.parametrize("split", [False, True], ids=["eager", "sdpa-prefill"])
def test_wu_trial_equals_ours_trial_by_trial(models, split):
    ours, hf = models
    for p in needle_prompts(ours, [40, 64], [0.1, 0.5, 0.9], seed=2):
        generated, top = run_needle(ours, p)
        hits = torch.stack([retrieval_step_hits(top[t], int(generated[t]), p.ids, p.needle)
                            for t in range(len(generated))]).sum(0)
        theirs, their_hits = bench_vs_wu.wu_trial(hf, p.ids, p.needle, len(p.answer), split=split)
        assert theirs.tolist() == generated.tolist()
        assert their_hits.tolist() == hits.long().tolist()


def test_wu_scores_equal_retrieval_heads(models):
    ours, hf = models
    prompts = needle_prompts(ours, [40, 64], [0.1, 0.5, 0.9])
    df = retrieval_heads(ours, context=64, lengths=[40, 64], depths=(0.1, 0.5, 0.9), n_bootstrap=10)
    scores, trials = bench_vs_wu.wu_scores(hf, prompts)
    assert [t["counted"] for t in trials] == [t["counted"] for t in df.attrs["trials"]]
    assert sum(t["counted"] for t in trials) >= 3
    assert torch.allclose(scores.flatten(), torch.tensor(df["retrieval"].values), rtol=0, atol=1e-12)
    assert scores.max() > 0.8  # the toy's induction heads copy the needle: a rule that never hits would fail here


def test_eager_prediction_stops_before_the_budget():
    """SmolLM2's 9 heads: eager's prefill fits 16 GiB at 8k (4.8 GiB) and not at 16k (19.3 GiB)."""
    assert bench_vs_wu.eager_bytes(9, 8192) < 16 * 2**30 < bench_vs_wu.eager_bytes(9, 16384)
    assert bench_vs_wu.eager_bytes(9, 8192) == 77 * 8192**2
