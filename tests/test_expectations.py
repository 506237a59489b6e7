"""Published head tables as checks (issue 38, ``analyses.atlas.expectations``), tested on a tiny GPT-2 of GPT-2 small's
shape (12 layers x 12 heads) whose weights are planted so that the heads of the ``gpt2-small`` table for
previous-token, duplicate-token and induction really are those heads by ``detect_heads``'s scores, on both attention
paths; the induction heads work by K-composition with a planted previous-token head, as in a trained model.

The planted model (``planted_gpt2``): every residual vector is ``f @ U.T`` with ``U`` an orthonormal basis of the
vectors orthogonal to all-ones, so LayerNorm's mean is 0 and its output is ``alpha * x``; a large constant feature
(``BULK``) on every position keeps ``alpha`` the same at every position. Features: one-hot tokens, three rotation
pairs of the position (a shift by one position is a rotation, so a query can look one position back), and the
previous token, written by the first previous-token head. Every other head has zero weights (uniform attention,
no output), every MLP is zero.
"""

from __future__ import annotations

import json
import math
import os

import pandas as pd
import pytest
import torch
import transformers

import interp
from analyses import detect_heads
from analyses.cli import main
from analyses.atlas.expectations import (Expectation, ExpectationSet, EXPECTATION_SETS, check_expectations,
                                   expectation_set, needs_scores, register_expectations)

V = 14  # tokens 0..13, 0 the BOS: one-hot token features
HD = 20  # head dim: V token dims + 6 position dims (the duplicate-token head's query reads both)
D = 12 * HD
THETAS = (2 * math.pi / 128, 2 * math.pi / 9, 2 * math.pi / 7)  # together, one position is distinct from the others
BULK = 100.0
F_BULK, F_TOK, F_POS, F_PREV = 0, 1, 1 + V, 1 + V + 6  # feature coordinates

TABLE = {"previous": ((2, 2), (4, 11)), "duplicate": ((0, 1), (0, 10), (3, 0)),
         "induction": ((5, 5), (5, 8), (5, 9), (6, 9))}
MOVED = {"previous": ((1, 5), (3, 3)), "duplicate": ((0, 4), (0, 7), (2, 8)),
         "induction": ((5, 1), (6, 3), (7, 7), (8, 0))}
CLASSES = {"previous": "previous token", "duplicate": "duplicate token", "induction": "induction"}
PATTERN_SCORES = ["previous_token", "duplicate_token", "induction"]


def _eye(n):
    return torch.eye(n, dtype=torch.float64)


def _rotation(t):  # (cos ti, sin ti) @ R = (cos t(i-1), sin t(i-1))
    return torch.tensor([[math.cos(t), -math.sin(t)], [math.sin(t), math.cos(t)]], dtype=torch.float64)


def planted_gpt2(previous, duplicate, induction, n_positions: int = 64):
    """A GPT2LMHeadModel of 12 layers x 12 heads (d_model 240) with these heads planted: previous-token heads (the
    first writes the previous token into the residual), duplicate-token heads and induction heads (query: the
    current token; key: the previous token the first previous-token head wrote), each at least 0.99 by its score."""
    config = transformers.GPT2Config(vocab_size=V, n_positions=n_positions, n_embd=D, n_layer=12, n_head=12,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    g = torch.Generator().manual_seed(0)
    basis = torch.randn(D, D, generator=g, dtype=torch.float64)
    basis[:, 0] = 1.0
    U = torch.linalg.qr(basis)[0][:, 1:]  # (d, f): orthonormal, orthogonal to all-ones
    F = U.shape[1]
    alpha = math.sqrt(D) / math.sqrt(BULK ** 2 + 1 + 3 + 1)  # LayerNorm's output / its input: token, 3 pairs, prev
    sd = {k: (torch.ones_like(v) if k.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else torch.zeros_like(v))
          for k, v in model.state_dict().items()}
    tok = torch.zeros(V, F, dtype=torch.float64)
    tok[:, F_BULK] = BULK
    tok[:, F_TOK:F_TOK + V] = _eye(V)
    pos = torch.zeros(n_positions, F, dtype=torch.float64)
    for p in range(n_positions):
        pos[p, F_POS:F_POS + 6] = torch.tensor([f(t * p) for t in THETAS for f in (math.cos, math.sin)])
    sd["transformer.wte.weight"] = sd["lm_head.weight"] = (tok @ U.T).float()
    sd["transformer.wpe.weight"] = (pos @ U.T).float()

    def put(layer, head, mq, mk, mv=None, mo=None):  # m*: (f, d_head) on the features; GPT-2 divides by sqrt(d_head)
        w, cols = sd[f"transformer.h.{layer}.attn.c_attn.weight"], slice(head * HD, (head + 1) * HD)  # (d, 3d)
        w[:, cols] = (U @ mq / alpha * HD ** 0.25).float()
        w[:, D + head * HD:D + (head + 1) * HD] = (U @ mk / alpha * HD ** 0.25).float()
        if mv is not None:
            w[:, 2 * D + head * HD:2 * D + (head + 1) * HD] = (U @ mv / alpha).float()
            sd[f"transformer.h.{layer}.attn.c_proj.weight"][cols] = (mo @ U.T).float()

    def zeros():
        return torch.zeros(F, HD, dtype=torch.float64)

    for n, (layer, head) in enumerate(previous):  # logit 40 * sum over pairs of cos(theta (i - 1 - j))
        mq, mk = zeros(), zeros()
        for i, t in enumerate(THETAS):
            mq[F_POS + 2 * i:F_POS + 2 * i + 2, 2 * i:2 * i + 2] = 40.0 * _rotation(t)
            mk[F_POS + 2 * i:F_POS + 2 * i + 2, 2 * i:2 * i + 2] = _eye(2)
        mv = mo = None
        if n == 0:  # the token it attends to, written into the previous-token features
            mv, mo = zeros(), torch.zeros(HD, F, dtype=torch.float64)
            mv[F_TOK:F_TOK + V, :V] = _eye(V)
            mo[:V, F_PREV:F_PREV + V] = _eye(V)
        put(layer, head, mq, mk, mv, mo)
    for layer, head in duplicate:  # 80 on the same token, minus 10 * sum of cos(theta (i - j)): not itself
        mq, mk = zeros(), zeros()
        mq[F_TOK:F_TOK + V, :V], mk[F_TOK:F_TOK + V, :V] = 80.0 * _eye(V), _eye(V)
        mq[F_POS:F_POS + 6, V:V + 6], mk[F_POS:F_POS + 6, V:V + 6] = -10.0 * _eye(6), _eye(6)
        put(layer, head, mq, mk)
    for layer, head in induction:  # 80 where the key's previous token is the query's token (K-composition)
        mq, mk = zeros(), zeros()
        mq[F_TOK:F_TOK + V, :V], mk[F_PREV:F_PREV + V, :V] = 80.0 * _eye(V), _eye(V)
        put(layer, head, mq, mk)
    model.load_state_dict(sd)
    return model


@pytest.fixture(scope="module")
def table_model():
    return planted_gpt2(**TABLE)


@pytest.fixture(scope="module")
def moved_model():
    return planted_gpt2(**MOVED)


def _scores(hf, attn="flash", scores=PATTERN_SCORES):
    return detect_heads(interp.load_model(hf, attn=attn), scores=scores, n_prompts=16, n_bootstrap=50)


def _rows(checked, cls):
    return checked[checked["class"] == CLASSES.get(cls, cls)]


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_planted_heads_pass_their_classes_and_unrun_scores_are_not_measured(table_model, attn):
    model = interp.load_model(table_model, attn=attn)
    df = detect_heads(model, scores=PATTERN_SCORES, n_prompts=16, n_bootstrap=50)
    for cls, heads in TABLE.items():  # the planting itself: these heads and no others score high
        column = {"previous": "previous_token", "duplicate": "duplicate_token", "induction": "induction"}[cls]
        high = df[df[column] > 0.5]
        assert sorted(zip(high["layer"], high["head"])) == sorted(heads), (cls, high[["layer", "head", column]])
        assert high[column].min() > 0.99
    checked = check_expectations(df, "gpt2-small", model)
    assert len(checked) == sum(len(e.heads) for e in EXPECTATION_SETS["gpt2-small"].entries) == 19
    for cls in TABLE:
        rows = _rows(checked, cls)
        assert (rows["status"] == "pass").all(), rows
        assert (rows["rank"] <= len(TABLE[cls])).all() and (rows["value"] > 0.99).all()
        assert (rows["lo"] <= rows["value"]).all() and (rows["value"] <= rows["hi"]).all()
    unrun = checked[checked["score"].isin(["name_mover", "s_inhibition", "copy_suppression"])]
    assert len(unrun) == 10 and (unrun["status"] == "not measured").all()
    assert unrun["why"].str.endswith("was not computed").all()
    assert checked.attrs["summary"].startswith("gpt2-small: INCOMPLETE: 9 of 19 expected heads pass, 0 fail")
    assert "not measured (scores: name_mover, s_inhibition, copy_suppression)" in checked.attrs["summary"]


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_the_same_planting_on_other_heads_fails(moved_model, attn):
    df = _scores(moved_model, attn)
    for cls, heads in MOVED.items():  # the planting works where it was moved to ...
        column = {"previous": "previous_token", "duplicate": "duplicate_token", "induction": "induction"}[cls]
        top = df.nlargest(len(heads), column)
        assert sorted(zip(top["layer"], top["head"])) == sorted(heads) and top[column].min() > 0.99
    checked = check_expectations(df, "gpt2-small")
    for cls in TABLE:  # ... so the table's heads fail: tied with the other unplanted heads, far outside the top 10
        rows = _rows(checked, cls)
        assert (rows["status"] == "fail").all(), rows
        assert (rows["rank"] > 100).all() and rows["why"].str.contains("outside the 10 needed").all()
    assert checked.attrs["summary"].startswith("gpt2-small: FAIL: 0 of 19 expected heads pass, 9 fail (induction "
                                               "5.5 5.8 5.9 6.9; duplicate token 0.1 0.10 3.0; previous token "
                                               "2.2 4.11), 10 not measured")


def test_induction_needs_the_previous_token_head(table_model):
    """The induction heads read the previous token that 2.2 writes: with 2.2's output zeroed they stop attending
    (K-composition, not a positional shortcut), and the check fails them."""
    hf = planted_gpt2(**TABLE)
    with torch.no_grad():
        hf.transformer.h[2].attn.c_proj.weight[2 * HD:3 * HD] = 0
    checked = check_expectations(_scores(hf, scores=["induction"]), "gpt2-small")
    rows = _rows(checked, "induction")
    assert (rows["value"] < 0.2).all() and (rows["status"] == "fail").all(), rows


def _table(values: dict, column="name_mover") -> pd.DataFrame:
    heads = [(l, h) for l in range(12) for h in range(12)]
    return pd.DataFrame({"layer": [l for l, _ in heads], "head": [h for _, h in heads],
                         column: [values.get(x, 0.0) for x in heads]})


def test_negative_name_movers_need_a_negative_score_among_the_lowest():
    df = _table({(9, 6): 0.3, (9, 9): 0.4, (10, 0): 0.2, (10, 7): -0.3, (11, 10): -0.1, (3, 3): -0.2})
    checked = check_expectations(df, "gpt2-small")
    assert (_rows(checked, "name mover")["status"] == "pass").all()
    negative = _rows(checked, "negative name mover").set_index("head")
    assert negative.loc[7, "status"] == "pass" and negative.loc[7, "rank"] == 1
    assert negative.loc[10, "status"] == "pass" and negative.loc[10, "rank"] == 3
    df.loc[(df["layer"] == 10) & (df["head"] == 7), "name_mover"] = 0.5  # a positive direct effect: no negative mover
    row = _rows(check_expectations(df, "gpt2-small"), "negative name mover").iloc[0]
    assert row["status"] == "fail" and "is not negative" in row["why"]


def test_ties_never_lift_a_head_into_the_top_and_nan_is_not_measured():
    df = _table({(2, 2): 0.5}, "previous_token")  # 4.11 ties with 142 other heads at 0, under 2.2
    df["duplicate_token"] = 1.0 + 1e-9 * (df["layer"] == 3)  # 3.0 ties with 0.10 and the others, within 1e-6
    df.loc[(df["layer"] == 0) & (df["head"] == 1), "duplicate_token"] = float("nan")
    checked = check_expectations(df, "gpt2-small")
    prev = _rows(checked, "previous").set_index("layer")
    assert prev.loc[2, "status"] == "pass" and prev.loc[2, "rank"] == 1
    assert prev.loc[4, "status"] == "fail" and prev.loc[4, "rank"] == 144
    dup = _rows(checked, "duplicate").set_index(["layer", "head"])
    assert dup.loc[(0, 1), "status"] == "not measured" and "is not finite" in dup.loc[(0, 1), "why"]
    assert dup.loc[(0, 10), "status"] == dup.loc[(3, 0), "status"] == "fail"
    assert dup.loc[(0, 10), "rank"] == dup.loc[(3, 0), "rank"] == 143 and dup.loc[(3, 0), "of"] == 143
    missing = check_expectations(df[~((df["layer"] == 9) & (df["head"] == 9))], "gpt2-small")
    assert _rows(missing, "name mover").set_index("head").loc[9, "status"] == "not measured"


def test_a_model_of_another_shape_is_refused():
    from tests.tiny import tiny_model

    model = interp.load_model(tiny_model("gpt2"))
    df = detect_heads(model, scores=["previous_token"], n_prompts=4, n_bootstrap=10)
    for call in (lambda: check_expectations(df, "gpt2-small", model), lambda: check_expectations(df, "gpt2-small")):
        with pytest.raises(ValueError, match=r"12 layers x 12 heads; this model has 2 layers x 4 heads"):
            call()
    with pytest.raises(ValueError, match="Did you mean 'gpt2-small'"):
        expectation_set("gpt2-smal")
    with pytest.raises(TypeError, match="head table with layer and head columns"):
        check_expectations([1, 2], "gpt2-small")


def test_needs_scores_and_a_users_own_set(tmp_path, table_model, moved_model):
    assert needs_scores("gpt2-small") == ("name_mover", "s_inhibition", "induction", "duplicate_token",
                                          "previous_token", "copy_suppression")
    with pytest.raises(ValueError, match="is interp's own"):
        register_expectations(ExpectationSet("gpt2-small", "x", 12, 12), replace=True)
    with pytest.raises(ValueError, match=r"heads of 'x' are \(layer, head\) in 12 x 12; got 12.0"):
        ExpectationSet("mine", "m", 12, 12, (Expectation("x", ((12, 0),), "induction", "top", 3),))
    with pytest.raises(ValueError, match="Unknown score 'inductoin'"):
        ExpectationSet("mine", "m", 12, 12, (Expectation("x", ((1, 0),), "inductoin", "top", 3),))
    mine = register_expectations(ExpectationSet("planted", "the planted tiny GPT-2", 12, 12, (
        Expectation("induction", ((5, 5), (6, 9)), "induction", "label", citation="tests"),
        Expectation("previous token", ((2, 2),), "previous_token", "top", 2))), replace=True)
    try:
        assert needs_scores("planted") == ("induction", "previous_token")
        assert (check_expectations(_scores(table_model), "planted")["status"] == "pass").all()
        failed = check_expectations(_scores(moved_model), mine)
        assert (failed["status"] == "fail").all() and "< the induction threshold 0.4" in failed["why"].iloc[0]
    finally:
        del EXPECTATION_SETS["planted"]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "layers": 12, "heads": 12, "entries": [
        {"class": "duplicate token", "heads": ["0.1", "3.0"], "score": "duplicate_token", "test": "top", "k": 3}]}))
    assert expectation_set(str(path)).entries[0].heads == ((0, 1), (3, 0))
    (tmp_path / "bad.json").write_text(json.dumps({"name": "bad", "entries": []}))
    with pytest.raises(ValueError, match="is not an expectation set"):
        expectation_set(str(tmp_path / "bad.json"))


def test_interp_expect_on_the_planted_model(tmp_path, capsys, table_model, moved_model):
    table_model.save_pretrained(tmp_path / "table")
    moved_model.save_pretrained(tmp_path / "moved")
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"name": "mine", "layers": 12, "heads": 12, "entries": [
        {"class": "duplicate token", "heads": ["0.1", "0.10", "3.0"], "score": "duplicate_token", "k": 3}]}))
    base = ["--n-prompts", "8", "--threads", "1"]
    assert main(["expect", "--model", str(tmp_path / "table"), "--expect", str(mine), "--out", str(tmp_path / "a"),
                 *base]) == 0
    out = capsys.readouterr().out
    assert "mine: PASS: 3 of 3 expected heads pass, 0 fail, 0 not measured" in out
    written = pd.read_csv(tmp_path / "a" / "expectations.csv")
    assert list(written["status"]) == ["pass"] * 3 and list(written["rank"]) == [3, 3, 3]  # the three tie at 1.0
    assert main(["expect", "--model", str(tmp_path / "moved"), "--expect", str(mine), *base]) == 1
    assert "mine: FAIL: 0 of 3 expected heads pass, 3 fail (duplicate token 0.1 0.10 3.0)" in capsys.readouterr().out
    # the published table on a model without a tokenizer: the IOI and weight scores cannot run, and say so
    assert main(["expect", "--model", str(tmp_path / "table"), "--expect", "gpt2-small", *base]) == 1
    out = capsys.readouterr().out
    assert out.count("needs a tokenizer; this model has none") == 10
    assert "gpt2-small: INCOMPLETE: 9 of 19 expected heads pass, 0 fail, 10 not measured" in out
    assert main(["expect", "--model", str(tmp_path / "table"), "--expect", "gpt2-smal", *base]) == 2
    assert "Unknown expectation set 'gpt2-smal'. Did you mean 'gpt2-small'?" in capsys.readouterr().err
    code = main(["expect", "--model", "toy-induction", "--expect", "gpt2-small", *base])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "12 layers x 12 heads; this model has 2 layers x 4 heads" in err


def test_an_atlas_is_checked_like_a_head_table(table_model):
    """``interp atlas --expect``: the atlas's dict (h-atlas's schema: heads as rows of ``values``, each value with
    ``lo`` and ``hi``, None for NaN; ``scores`` with thresholds; ``not_run`` with reasons) checks as its table does."""
    df = _scores(table_model)
    columns = ["previous_token", "duplicate_token", "induction"]
    atlas = {"scores": {c: {"threshold": 0.4} for c in columns},
             "not_run": {"name_mover": "a task-prompted score: ask for it with --scores"},
             "heads": [{"site": f"blocks.{r.layer}.attn", "layer": int(r.layer), "head": int(r.head), "labels": "",
                        "values": {c: {"value": None if (r.layer, r.head) == (5, 9) else float(getattr(r, c)),
                                       "lo": float(getattr(r, f"{c}_lo")), "hi": float(getattr(r, f"{c}_hi"))}
                                   for c in columns}} for r in df.itertuples()]}
    checked = check_expectations(atlas, "gpt2-small")
    by_head = checked.set_index(["class", "layer", "head"])
    assert by_head.loc[("induction", 5, 9), "status"] == "not measured"  # None in the atlas: NaN, never a pass
    assert (checked["status"] == "pass").sum() == 8
    assert by_head.loc[("name mover", 9, 6), "why"] == ("name_mover did not run: a task-prompted score: ask for it "
                                                         "with --scores")


def test_run_expectations_adds_only_the_missing_scores_to_a_table(table_model, capsys, monkeypatch):
    import analyses.heads.detect
    from analyses.cli.expect import run_expectations

    model = interp.load_model(table_model)
    have = detect_heads(model, scores=["previous_token"], n_prompts=8, n_bootstrap=20)
    asked = []

    def spy(model, scores, **kwargs):
        asked.append(list(scores))
        return detect_heads(model, scores, **kwargs)

    monkeypatch.setattr(analyses.heads.detect, "detect_heads", spy)
    assert run_expectations(model, have, "gpt2-small", n_prompts=8) == 1  # IOI and weights scores need a tokenizer
    assert asked == [["induction", "duplicate_token"]]  # what the table lacks and this model can take
    assert "INCOMPLETE: 9 of 19 expected heads pass" in capsys.readouterr().out


@pytest.mark.slow
def test_every_row_is_measured_on_a_random_model_of_gpt2_smalls_shape(tmp_path, capsys):
    """The whole published table, the IOI and weights scores included, on a random 12 x 12 GPT-2 (d_model 48) with a
    real tokenizer (SmolLM2's): every row measured, and an untrained model fails the table (a near-uniform score
    can still put a head in a top k by chance: at most 2 of 19 here)."""
    from interp.model.bundled import bundled_folder
    from analyses.cli.expect import run_expectations

    tok = transformers.AutoTokenizer.from_pretrained(bundled_folder("smollm2"), local_files_only=True)
    config = transformers.GPT2Config(vocab_size=len(tok), n_positions=128, n_embd=48, n_layer=12, n_head=12,
                                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = interp.load_model(transformers.GPT2LMHeadModel(config).eval(), tokenizer=tok)
    assert run_expectations(model, None, "gpt2-small", tmp_path, n_prompts=16) == 1
    checked = pd.read_csv(tmp_path / "expectations.csv")
    assert len(checked) == 19 and (checked["status"] != "not measured").all()
    assert (checked["status"] == "pass").sum() <= 2
    assert "gpt2-small: FAIL: " in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("INTERP_GPT2_SMALL"), reason="INTERP_GPT2_SMALL is not set: give it a local "
                    "folder of GPT-2 small (the `gpt2` checkpoint's model and tokenizer, save_pretrained into one "
                    "folder) to check the published table on real weights; this machine has no hub access")
def test_gpt2_small_published_table_on_real_weights(tmp_path, capsys):
    """GPT-2 small's published heads (Wang et al. 2022; McDougall et al. 2023), every class measured, on real
    weights: `interp expect --model $INTERP_GPT2_SMALL --expect gpt2-small`."""
    code = main(["expect", "--model", os.environ["INTERP_GPT2_SMALL"], "--expect", "gpt2-small",
                 "--out", str(tmp_path)])
    out = capsys.readouterr().out
    checked = pd.read_csv(tmp_path / "expectations.csv")
    assert (checked["status"] != "not measured").all(), out
    assert code == 0 and (checked["status"] == "pass").all(), out


def test_the_atlas_hooks_do_nothing_without_a_set_and_refuse_another_shape_early(capsys):
    from analyses.cli.expect import check_expect_model, run_expectations

    toy = interp.load_model("toy-induction")
    assert check_expect_model(toy, None) is None and run_expectations(toy, None, None) == 0
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="this model has 2 layers x 4 heads"):
        check_expect_model(toy, "gpt2-small")
