"""Retrieval heads (analyses.long.retrieval): the scoring rule on a planted attention pattern and planted generation,
the needle prompts, and the toy model whose copying (induction) heads are the heads that retrieve the needle."""

from __future__ import annotations

import pytest
import torch

import interp
from analyses import detect_heads
from analyses.data.needles import NeedlePrompt, _newline_stop, needle_prompts, rouge1_recall, wu_grid, wu_needle_prompts
from analyses.long.retrieval import retrieval_heads, retrieval_step_hits, run_needle


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


# -- Wu et al.'s protocol (issue 38) --------------------------------------------------------------------------------
@pytest.mark.parametrize("reference, response, recall", [
    ("take a walk in Chaoyang Park", "Take a walk, in the park!", 5 / 6),  # "chaoyang" missing; case and commas ignored
    ("the the cat", "the", 1 / 3),  # counts are clipped: one "the" of two, no cat
    ("the the cat", "The cat and the the the dog", 1.0),
    ("48213795", "The special magic number is 48213795.", 1.0),
    ("48213795", "4821379", 0.0),  # a number is one unigram: a digit short is no match
    ("state-of-the-art", "state of the art", 1.0),  # anything outside [a-z0-9] splits words
    ("", "anything", 0.0),  # rouge_score: matches / max(reference unigrams, 1)
    ("Records were broken", "", 0.0),
])
def test_rouge1_recall_by_hand(reference, response, recall):
    assert rouge1_recall(reference, response) == pytest.approx(recall, abs=1e-12)


def test_wu_grid_is_their_layout():
    """Their defaults: 20 lengths from 1000 to 50000 rounded, depths 0..100% in 10 steps rounded to whole percents."""
    lengths, depths = wu_grid(1000, 50000)
    assert len(lengths) == 20 and lengths[:3] == (1000, 3579, 6158) and lengths[-1] == 50000
    assert depths == (0.0, 0.11, 0.22, 0.33, 0.44, 0.56, 0.67, 0.78, 0.89, 1.0)
    with pytest.raises(ValueError, match="low .* must not exceed high"):
        wu_grid(2048, 512)


def test_decoding_stops_after_the_stop_token_or_at_max_steps(toy):
    """run_needle keeps and scores the stopping token, then stops; without a stop it runs its step limit."""
    p = needle_prompts(toy, [40], [0.5], needle_len=6, seed=1)[0]
    third = int(p.answer[2])
    generated, top = run_needle(toy, p, n_steps=50, stop=lambda t: t == third)
    assert generated.tolist() == p.answer[:3].tolist() and top.shape == (3, 2, 4)
    generated, top = run_needle(toy, p, n_steps=4)
    assert len(generated) == 4 and top.shape[0] == 4 and (top >= 0).all()


def test_newline_stop_reads_the_tokens_text():
    from test_taxonomy import _tiny_with_tokenizer

    tok = _tiny_with_tokenizer().tokenizer
    stop = _newline_stop(tok)
    newline, two, dot = (tok(t, add_special_tokens=False)["input_ids"] for t in ("\n", "\n\n", " 7."))
    assert stop(newline[0]) and stop(two[0]) and not any(stop(t) for t in dot)
    assert _newline_stop(None) is None


def test_wu_prompts_put_the_sentence_after_a_full_stop():
    from test_taxonomy import _tiny_with_tokenizer

    model = _tiny_with_tokenizer()
    tok = model.tokenizer
    for p in wu_needle_prompts(model, [160, 200], [0.0, 0.5, 1.0], needle_len=6, seed=2):
        start, end = p.planted  # where the digits went (p.needle: the span Wu et al.'s search finds)
        assert len(p.ids) == p.length and tok.decode(p.reference).strip() == p.text and len(p.text) == 6
        before = tok.decode(p.ids[:start])
        assert before.endswith("is ") and " The special magic number for " in before  # the lone space is no answer
        head = before.rsplit(" The special magic number", 1)[0]
        if p.depth == 0:
            assert head.endswith("<|im_start|>user\n<book>")  # SmolLM2's chat template, as Wu et al. prompt chat models
        elif p.depth < 1:
            assert head.endswith(".")  # moved back to a sentence's full stop, as theirs
        else:  # at 100% theirs goes at the very end of the haystack, cut mid-sentence or not: then the question
            assert tok.decode(p.ids[end:]).startswith(".</book>\nBased on the content of the book, Question:")
        assert tok.decode(p.ids).endswith("?\nAnswer:<|im_end|>\n<|im_start|>assistant\n")


def test_wu_counts_a_trial_only_above_the_recall_criterion(toy):
    """Wu et al. count a trial when recall > 0.5: a trial whose recall equals min_recall is not counted (ours
    counts it); the table says how many of how many trials counted."""
    df = retrieval_heads(toy, context=64, lengths=[40, 64], depths=[0.0, 0.5, 1.0], needle_len=6, n_bootstrap=20,
                         protocol="wu2024", max_new_tokens=12)
    trials = df.attrs["trials"]
    assert all(t["counted"] == (t["recall"] > 0.5) for t in trials) and all(t["steps"] <= 12 for t in trials)
    assert df.attrs["trials_run"] == 6 and df.attrs["trials_counted"] == sum(t["counted"] for t in trials)
    middle = sorted(t["recall"] for t in trials if 0 < t["recall"] < 1)
    assert middle, "the toy model should half-copy some needle at 64 tokens"
    at = retrieval_heads(toy, context=64, lengths=[40, 64], depths=[0.0, 0.5, 1.0], needle_len=6, n_bootstrap=20,
                         protocol="wu2024", max_new_tokens=12, min_recall=middle[0])
    assert [t["recall"] for t in at.attrs["trials"]] == [t["recall"] for t in trials]
    assert not any(t["counted"] for t in at.attrs["trials"] if t["recall"] == middle[0])
    assert at.attrs["trials_counted"] == sum(t["recall"] > middle[0] for t in trials)


@pytest.mark.parametrize("protocol", ["interp", "wu2024"])
def test_stability_from_two_halves_of_the_counted_trials(toy, protocol):
    """The toy's copying heads lead in both halves: a stable ranking; one counted trial cannot be split: NaN."""
    df = retrieval_heads(toy, context=48, depths=(0.2, 0.4, 0.6, 0.8), needle_len=6, n_bootstrap=20,
                         protocol=protocol, max_new_tokens=8)
    s = df.attrs["stability"]["retrieval"]
    assert set(s) == {"spearman", "top_k_overlap", "k", "unstable", "trials"}
    assert sum(s["trials"]) == df.attrs["trials_counted"] >= 4 and s["k"] == 8
    assert s["spearman"] > 0.8 and s["top_k_overlap"] == 1.0 and not s["unstable"]
    assert df.attrs["protocol"] == protocol
    one = retrieval_heads(toy, context=48, lengths=[40], depths=[0.5], needle_len=6, n_bootstrap=10,
                          protocol=protocol)
    s = one.attrs["stability"]["retrieval"]
    assert one.attrs["trials_counted"] == 1 and s["unstable"] and s["trials"] == [1, 0] and s["k"] == 0


def test_detect_heads_passes_the_protocol_and_refuses_it_where_unread(toy):
    df = detect_heads(toy, scores=["retrieval"], context=64, n_bootstrap=20, protocol="wu2024")
    assert df.attrs["protocol"] == "wu2024" and "stability" in df.attrs
    assert sum(df.attrs["stability"]["retrieval"]["trials"]) == df.attrs["trials_counted"]
    assert {"steps", "recall", "counted"} <= set(df.attrs["retrieval_trials"][0])
    assert detect_heads(toy, scores=["retrieval"], context=48, n_bootstrap=20).attrs["protocol"] == "interp"
    with pytest.raises(ValueError, match=r"no score asked for reads it \(\['induction'\]\).*add \"retrieval\""):
        detect_heads(toy, scores=["induction"], n_prompts=4, protocol="wu2024")
    with pytest.raises(ValueError, match=r"protocol must be one of \['interp', 'wu2024'\].*got 'wu'"):
        detect_heads(toy, scores=["retrieval"], context=48, protocol="wu")
    with pytest.raises(ValueError, match=r"protocol must be one of .*got 'Wu2024'"):
        retrieval_heads(toy, context=48, protocol="Wu2024")


def test_cli_heads_protocol(toy, capsys):
    from analyses.cli import main

    assert main(["heads", "--model", "toy-induction", "--scores", "induction", "--protocol", "wu2024"]) == 2
    assert "no score asked for reads it" in capsys.readouterr().err
    assert main(["heads", "--model", "toy-induction", "--scores", "retrieval", "--context", "64", "--protocol",
                 "wu2024", "--format", "csv", "--top", "3"]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[0].startswith("stack,kind,site,layer,head") and len(rows) == 4
    assert {r.split(",")[3] + "." + r.split(",")[4] for r in rows[1:]} <= {"1.0", "1.1", "1.2", "1.3"}


@pytest.mark.parametrize("protocol", ["interp", "wu2024"])
def test_both_protocols_read_alike_on_both_attention_paths(protocol):
    """A tiny random Llama (tests/tiny.py, no tokenizer; min_recall 0 so that trials count): the same tokens, the
    same top-1 key of every head at every step and the same table on eager and flash."""
    from tests.tiny import tiny_model

    hf = tiny_model("llama")
    runs, frames = [], []
    for attn in ("eager", "flash"):
        model = interp.load_model(hf, attn=attn)
        make = wu_needle_prompts if protocol == "wu2024" else needle_prompts
        p = make(model, [96], [0.5], needle_len=6, seed=4)[0]
        runs.append(run_needle(model, p, 20 if protocol == "wu2024" else None))
        frames.append(retrieval_heads(model, context=96, lengths=[64, 96], depths=[0.0, 0.5, 1.0], needle_len=6,
                                      min_recall=0.0, n_bootstrap=50, protocol=protocol, max_new_tokens=20))
    (gen_e, top_e), (gen_f, top_f) = runs
    assert torch.equal(gen_e, gen_f) and torch.equal(top_e, top_f) and (top_e >= 0).all()
    assert len(gen_e) == (20 if protocol == "wu2024" else 6)
    eager, flash = frames
    assert eager.attrs["trials"] == flash.attrs["trials"] and eager.attrs["trials_counted"] >= 2
    assert eager.equals(flash)


@pytest.mark.parametrize("protocol", ["interp", "wu2024"])
def test_both_protocols_score_alike_on_both_attention_paths(protocol):
    """The toy model copies, so its heads score above 0: equal scores and intervals on eager and flash."""
    frames = [retrieval_heads(interp.load_model("toy-induction", attn=attn), context=64, lengths=[40, 64],
                              depths=[0.0, 0.5, 1.0], needle_len=6, n_bootstrap=50, protocol=protocol,
                              max_new_tokens=12) for attn in ("eager", "flash")]
    eager, flash = frames
    assert eager.attrs["trials"] == flash.attrs["trials"] and eager.attrs["trials_counted"] >= 2
    assert eager.retrieval.max() > 0.5
    for column in ("retrieval", "retrieval_lo", "retrieval_hi"):
        torch.testing.assert_close(torch.tensor(eager[column].to_numpy()), torch.tensor(flash[column].to_numpy()),
                                   rtol=0, atol=1e-12)


def test_bench_retrieval_protocols_quick(tmp_path):
    """benchmarks/bench_retrieval_protocols.py runs both protocols on the toy model and compares them."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "q.json"
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_retrieval_protocols.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.read_text())
    assert "interp vs wu2024: Spearman" in done.stdout and row["compare"]["k"] == 8
    for protocol in ("interp", "wu2024"):
        assert 0 < row[protocol]["trials_counted"] <= row[protocol]["trials_run"] == 10
        assert row[protocol]["top10"][0][0] in {"1.0", "1.1", "1.3"} and len(row[protocol]["scores"]) == 8


def test_wu_prompts_without_a_chat_template_put_the_question_after_the_text():
    """A tokenizer without a chat template: Wu et al.'s base-model prompt, the question right after the haystack."""
    import copy

    from test_taxonomy import _tiny_with_tokenizer

    model = _tiny_with_tokenizer()
    model.tokenizer = copy.deepcopy(model.tokenizer)
    model.tokenizer.chat_template = None
    tok = model.tokenizer
    for p in wu_needle_prompts(model, [120], [0.0, 0.5], needle_len=5, seed=1):
        text = tok.decode(p.ids)
        assert len(p.ids) == 120 and "<|im_start|>user" not in text and "<book>" not in text
        city = text.split("magic number for ")[1].split(" is")[0]
        assert text.endswith(f" Based on the content of the book, Question: What is the special magic number for "
                             f"{city}?\nAnswer:") and text.startswith("<|im_start|> ")  # start token, the haystack
        assert tok.decode(p.reference) == p.text  # the planted digits (p.answer: the span Wu et al. find)
