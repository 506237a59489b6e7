"""Retrieval heads (analyses.retrieval): the scoring rule on a planted attention pattern and planted generation,
the needle prompts, and the toy model whose copying (induction) heads are the heads that retrieve the needle."""

from __future__ import annotations

import pytest
import torch

import interp
from analyses import detect_heads
from analyses.retrieval import NeedlePrompt, needle_prompts, retrieval_heads, retrieval_step_hits, run_needle


@pytest.fixture(scope="module")
def toy():
    return interp.load_model("toy-induction")


def test_step_hits_on_a_planted_pattern():
    """Head (0, 0) looks at the needle token it copies, (0, 1) at the needle but the wrong token, (1, 0) at the
    same token outside the needle, (1, 1) nowhere useful."""
    ids = torch.tensor([0, 9, 9, 5, 6, 7, 9, 3])
    needle = (3, 6)  # tokens 5 6 7
    top = torch.tensor([[4, 5], [1, 0]])  # (l, h) top-1 positions at the step that generates 6
    hits = retrieval_step_hits(top, 6, ids, needle)
    assert hits.tolist() == [[True, False], [False, False]]
    hits = retrieval_step_hits(torch.tensor([[6, 3]]), 9, ids, needle)  # 9 sits at 6, just past the needle
    assert hits.tolist() == [[False, False]]


def test_needle_prompts_place_the_needle_at_each_depth(toy):
    prompts = needle_prompts(toy, [40, 64], [0.0, 0.5, 1.0], needle_len=6, seed=3)
    assert [(len(p.ids), p.depth) for p in prompts] == [(40, 0.0), (40, 0.5), (40, 1.0), (64, 0.0), (64, 0.5),
                                                          (64, 1.0)]
    for p in prompts:
        start, end = p.needle
        assert end - start == 6 and len(set(p.answer.tolist())) == 6
        assert p.ids[-2:].tolist() == p.ids[start - 2:start].tolist()  # the question is the needle's key
    starts = [p.needle[0] for p in prompts[3:]]
    assert starts[0] < starts[1] < starts[2]


def test_toy_copying_heads_are_its_retrieval_heads(toy):
    """The toy model copies a needle by induction: its three induction heads (1.0, 1.1, 1.3) score highest, layer 0
    scores 0, and each score lies in its interval."""
    df = retrieval_heads(toy, context=48, depths=(0.2, 0.5, 0.8), needle_len=6, n_bootstrap=200)
    assert sum(t["counted"] for t in df.attrs["trials"]) >= 4
    top3 = set(map(tuple, df.nlargest(3, "retrieval")[["layer", "head"]].values.tolist()))
    assert top3 == {(1, 0), (1, 1), (1, 3)}
    assert (df[df.layer == 0].retrieval == 0).all()
    assert ((df.retrieval_lo <= df.retrieval + 1e-12) & (df.retrieval <= df.retrieval_hi + 1e-12)).all()
    assert df[df.layer == 1].retrieval.max() > 0.9


def test_run_needle_reads_one_row_per_step(toy):
    p = needle_prompts(toy, [40], [0.5], needle_len=6, seed=1)[0]
    generated, top = run_needle(toy, p)
    assert torch.equal(generated, p.answer)  # the toy model copies the needle exactly
    assert top.shape == (6, 2, 4) and (top >= 0).all() and (top < len(p.ids) + 6).all()


def test_detect_heads_takes_scores_and_context(toy):
    df = detect_heads(toy, scores=["retrieval", "induction"], context=48, n_prompts=8, n_bootstrap=50)
    assert {"retrieval", "retrieval_lo", "retrieval_hi", "induction", "label"} <= set(df.columns)
    assert df.set_index(["layer", "head"]).loc[(1, 1), "label"] == "retrieval"
    only = detect_heads(toy, scores="retrieval", context=48, n_bootstrap=50)
    assert list(only.columns[:6]) == ["stack", "kind", "site", "layer", "head", "retrieval"] and "induction" not in only


def test_bad_arguments_are_refused(toy):
    with pytest.raises(ValueError, match="context must be"):
        retrieval_heads(toy, context=1000)
    with pytest.raises(ValueError, match="depths are fractions"):
        needle_prompts(toy, [40], [1.5])
    assert isinstance(NeedlePrompt(torch.arange(5), (1, 3), 5, 0.5).answer, torch.Tensor)


@pytest.mark.slow  # about 4 minutes on a 2-core CPU: two fresh processes, each an 8k-token SmolLM2 run
@pytest.mark.parametrize("task", ["scores", "retrieval"])
def test_smollm2_at_8k_in_linear_memory(task):
    """detect_heads' O(n) scores and one retrieval trial at 8192 tokens grow the process by far less than one
    layer's eager pattern (9 x 8192^2 fp32 = 2.25 GiB), measured in a fresh process as the benchmark does."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_long_context.py"), "--child", "smollm2",
                           "8192", task], capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["grew_mib"] < 1024
    if task == "retrieval":
        assert row["trial"]["counted"] and row["top"][0][2] > 0.1


@pytest.mark.parametrize("kw, message", [
    (dict(depths=()), "depths are fractions"), (dict(depths=(0.5, 1.5)), "depths are fractions"),
    (dict(lengths=()), "lengths are prompt lengths"), (dict(lengths=[40, 2.5]), "lengths are prompt lengths"),
    (dict(min_recall=2), "min_recall is the share"), (dict(min_recall=-0.1), "min_recall is the share"),
    (dict(needle_len=0), "needle_len must be a positive integer"),
    (dict(needle_len=-2), "needle_len must be a positive integer"),
    (dict(needle_len=2.5), "needle_len must be a positive integer"),
    (dict(needle_len=200), r"needle_len 200: .* need 202 ordinary tokens.* has 63; use needle_len <= 61"),
    (dict(n_bootstrap=0), "n_bootstrap must be a positive integer"),
])
def test_degenerate_arguments_are_refused_before_any_trial(toy, kw, message):
    """depths=() and min_recall=2 returned an all-NaN table; needle_len=200 was cut to 61 tokens while the table
    said 200; needle_len 0, -2 and 2.5 and n_bootstrap=0 raised raw torch errors."""
    with pytest.raises(ValueError, match=message):
        retrieval_heads(toy, **{"context": 72, **kw})


def test_context_error_states_the_real_minimum_and_that_minimum_works(toy):
    """context=16, the minimum the error stated, failed with "length 8 leaves no room"."""
    import re

    with pytest.raises(ValueError, match=r"context must be an integer in \[30, 72\].*at least 15 tokens; got 16") as e:
        retrieval_heads(toy, context=16)
    low = int(re.search(r"\[(\d+),", str(e.value)).group(1))
    df = retrieval_heads(toy, context=low, depths=[0.5], n_bootstrap=10)
    assert [t["length"] for t in df.attrs["trials"]] == [low // 2, low]
    with pytest.raises(ValueError, match="length 14 leaves no room.*take 14 tokens, so a length needs at least 15"):
        needle_prompts(toy, [14], [0.5])


def test_the_table_states_the_needle_length_used(toy):
    from test_taxonomy import _tiny_with_tokenizer

    df = retrieval_heads(toy, context=48, depths=[0.5], needle_len=5, n_bootstrap=10)
    assert df.attrs["needle_tokens"] == 5 and "needles of 5 random tokens" in df.attrs["inputs"]
    assert {t["needle_tokens"] for t in df.attrs["trials"]} == {5}
    text = _tiny_with_tokenizer()  # SmolLM2's tokenizer: a digit and its space are two tokens
    prompts = needle_prompts(text, [120], [0.5], needle_len=4)
    with pytest.warns(RuntimeWarning, match="no trial counted"):  # a random model copies nothing
        df = retrieval_heads(text, context=120, lengths=[120], depths=[0.5], needle_len=4, n_bootstrap=10)
    assert df.attrs["needle_tokens"] == len(prompts[0].answer) == 8
    assert "needles of 4 random digits (8 tokens)" in df.attrs["inputs"]
    assert set(df["retrieval"].isna()) == {True}
