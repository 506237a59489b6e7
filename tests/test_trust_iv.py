"""Issue 52 (Trust IV), "Silent wrong numbers": each test here failed before its fix."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import interp
from interp.model.bundled import bundled_folder

TEXTS = ["The cat sat on the mat and looked at the door", "Hi there"]


@pytest.fixture(scope="module")
def worded():
    """A tiny random Llama with SmolLM2's tokenizer (found as users find it), whose pad id is its EOS."""
    tok = AutoTokenizer.from_pretrained(bundled_folder("smollm2"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
    return interp.load_model(LlamaForCausalLM(cfg).eval(), tokenizer=tok, attn="eager")


def _alone(model, text, prepend_bos=None):
    ids = model.to_tokens(text, prepend_bos=prepend_bos)
    with torch.no_grad():
        return model(ids, return_type="logits")[0]


# -- 1: text padded by padding_side (or prepend_bos) runs with the mask of its padding ----------------------------
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("entry", ["forward", "run_with_cache", "run_with_hooks"])
def test_padded_text_rows_equal_each_row_alone(worded, side, entry):
    call = {"forward": worded, "run_with_cache": lambda *a, **k: worded.run_with_cache(*a, **k)[0],
            "run_with_hooks": lambda *a, **k: worded.run_with_hooks(*a, fwd_hooks=[], **k)}[entry]
    with torch.no_grad():
        logits = call(TEXTS, padding_side=side, return_type="logits")
    for row, text in enumerate(TEXTS):
        alone = _alone(worded, text)
        n = alone.shape[0]
        got = logits[row, -n:] if side == "left" else logits[row, :n]
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)  # before: the short row off by the padding


def test_text_with_prepend_bos_is_masked_too(worded):
    with torch.no_grad():
        logits = worded(TEXTS, prepend_bos=True, return_type="logits")  # right-padded by to_tokens's default
    alone = _alone(worded, TEXTS[1], prepend_bos=True)
    torch.testing.assert_close(logits[1, :alone.shape[0]], alone, atol=1e-5, rtol=1e-5)


def test_padded_text_loss_counts_real_tokens_only(worded):
    with torch.no_grad():
        loss = worded(TEXTS, padding_side="left", return_type="loss", loss_per_token=True)
        alone = worded(worded.to_tokens(TEXTS[1]), return_type="loss", loss_per_token=True)[0]
    torch.testing.assert_close(loss[1, -alone.shape[0]:], alone, atol=1e-5, rtol=1e-5)


def test_generate_on_a_batch_of_texts_equals_each_text_alone(worded):
    both = worded.generate(TEXTS, max_new_tokens=3, do_sample=False, return_type="tokens", prepend_bos=True)
    alone = worded.generate(TEXTS[1], max_new_tokens=3, do_sample=False, return_type="tokens", prepend_bos=True)
    assert both[1, -3:].tolist() == alone[0, -3:].tolist()


# -- 2: a user score named like a column of the head table is refused at registration ------------------------------
@pytest.mark.parametrize("name", ["positional_fraction", "positional_offset", "site", "layer", "head", "stack",
                                  "kind", "label", "labels", "evidence", "induction_lo", "sink_hi", "io_attention",
                                  "retrieval_lo", "cs_attends_predicted"])
def test_a_score_named_like_a_column_is_refused(name):
    from analyses import head_score
    from analyses.heads import registry

    before = list(registry.names())
    with pytest.raises(ValueError, match=f"column '{name}'"):
        head_score(name)(lambda ids: ids)
    assert list(registry.names()) == before


def test_a_score_whose_intervals_would_be_another_scores_column_is_refused():
    from analyses import head_score
    from analyses.heads import registry

    head_score("mine_lo")(lambda ids: ids)
    try:
        with pytest.raises(ValueError, match="column 'mine_lo'.*score 'mine_lo'"):
            head_score("mine")(lambda ids: ids)  # its interval column mine_lo is the other score's value
        head_score("mine_lo", threshold=0.5)(lambda ids: ids)  # the same notebook cell run again still replaces it
        assert registry.score("mine_lo").threshold == 0.5
    finally:
        registry.unregister("mine_lo")


# -- 3 and 4: a user's rule sees copies; target triples follow one rule ---------------------------------------------
@pytest.fixture(scope="module")
def llama_ids():
    from tests.tiny import tiny_model

    model = interp.load_model(tiny_model("llama"), attn="eager")
    return model, torch.randint(3, 90, (4, 12), generator=torch.Generator().manual_seed(3))


def _register(name, rule):
    from analyses import head_score

    head_score(name, threshold=None)(rule)


def _scores(model, ids, names):
    from analyses import detect_heads

    return detect_heads(model, scores=names, prompts=ids, n_bootstrap=20)


def _plain_previous(model, ids):
    """Each head's mean weight on the previous token (rows 1..), from the eager patterns."""
    _, cache = model.run_with_cache(ids)
    return torch.cat([cache.pattern(s.name).double().diagonal(-1, -2, -1).mean((0, 2)) for s in model.cfg.sites])


def test_a_rule_that_edits_ids_in_place_changes_no_other_score(llama_ids):
    from analyses.heads import registry

    model, ids = llama_ids

    def vandal(ids):
        ids.zero_()  # every token now repeats: a previous-token rule on these ids would still be fine, a copy is not
        return torch.full_like(ids, -1)

    def previous_by_ids(ids):  # the previous token's position where the token differs from the one before it
        out = torch.arange(ids.shape[1]).expand_as(ids) - 1
        return torch.where(ids != torch.roll(ids, 1, 1), out, torch.full_like(out, -1))

    _register("vandal_rule", vandal), _register("reader_rule", previous_by_ids)
    before = ids.clone()
    try:
        df = _scores(model, ids, ["vandal_rule", "reader_rule"])
        alone = _scores(model, ids, ["reader_rule"])
    finally:
        registry.unregister("vandal_rule"), registry.unregister("reader_rule")
    assert torch.equal(ids, before)  # the user's own prompts are untouched too
    assert df["reader_rule"].tolist() == pytest.approx(alone["reader_rule"].tolist(), abs=1e-9)
    assert df["reader_rule"].notna().all()


def test_a_pair_listed_twice_counts_once(llama_ids):
    from analyses.heads import registry

    model, ids = llama_ids

    def twice(ids):
        b, q = torch.meshgrid(torch.arange(ids.shape[0]), torch.arange(1, ids.shape[1]), indexing="ij")
        b, q = b.reshape(-1), q.reshape(-1)
        return torch.cat([b, b]), torch.cat([q, q]), torch.cat([q - 1, q - 1])

    _register("previous_twice", twice)
    try:
        df = _scores(model, ids, ["previous_twice"])
    finally:
        registry.unregister("previous_twice")
    assert df["previous_twice"].to_numpy() == pytest.approx(_plain_previous(model, ids).numpy(), abs=1e-6)
    assert df["previous_twice"].le(1).all()


@pytest.mark.parametrize("bad", ["float", "nan", "float_tensor", "bool"])
def test_float_nan_and_bool_targets_are_refused_in_both_forms(llama_ids, bad):
    from analyses.heads import registry

    model, ids = llama_ids

    def rule(ids):
        q = torch.arange(1, ids.shape[1]).repeat(ids.shape[0])
        b = torch.arange(ids.shape[0]).repeat_interleave(ids.shape[1] - 1)
        if bad == "float":
            return b, q, (q - 1).double() + 0.7
        if bad == "nan":
            return b, q, torch.full(q.shape, float("nan"))
        if bad == "bool":
            return b, q, (q - 1).bool()
        return torch.full(ids.shape, 1.0)

    _register("odd_targets", rule)
    try:
        with pytest.raises(ValueError, match="odd_targets.*(float|bool).*integers"):
            _scores(model, ids, ["odd_targets"])
    finally:
        registry.unregister("odd_targets")


# -- 5: positions past the end are refused, never wrapped around ---------------------------------------------------
@pytest.mark.parametrize("queries", [[100], [12], [-13], [2.0], [True], []])
def test_qk_attribution_refuses_query_rows_outside_the_prompt(llama_ids, queries):
    from analyses import qk_attribution

    model, ids = llama_ids
    with pytest.raises(ValueError, match="queries"):
        qk_attribution(model, ids[:1], [(1, 0)], pairs="top1", queries=queries, causal=False)


def test_qk_attribution_negative_queries_count_from_the_end(llama_ids):
    from analyses import qk_attribution

    model, ids = llama_ids
    last = qk_attribution(model, ids[:1], [(1, 0)], pairs="top1", queries=[-1], causal=False)
    eleven = qk_attribution(model, ids[:1], [(1, 0)], pairs="top1", queries=[11], causal=False)
    assert [p["query"] for p in last.attrs["pairs"]] == [11]
    assert last["total"].tolist() == pytest.approx(eleven["total"].tolist())


@pytest.mark.parametrize("position", [12, -13, 2.5])
def test_logit_difference_refuses_a_position_outside_the_logits(llama_ids, position):
    from analyses import logit_difference

    model, ids = llama_ids
    with pytest.raises(ValueError, match="position"):
        metric = logit_difference(3, 4, position=position)
        metric(model(ids), {"input_ids": ids})


def test_cache_pos_slice_lists_refuse_positions_outside_and_take_negative_ones(llama_ids):
    model, ids = llama_ids
    _, cache = model.run_with_cache(ids[:1])
    resid = cache.accumulated_resid()  # (c, b, p, m)
    torch.testing.assert_close(cache.accumulated_resid(pos_slice=[-1]), resid[:, :, [11]])
    with pytest.raises(ValueError, match="pos_slice"):
        cache.accumulated_resid(pos_slice=[12])


# -- 6: a masked-LM encoder refuses W_U; OV indexes like TransformerLens; apply_ln_to_stack never broadcasts --------
def test_a_masked_lm_encoder_refuses_the_unembedding():
    from transformers import BertForMaskedLM

    from tests.tiny import tiny_model

    bert = interp.load_model(tiny_model("bert", cls=BertForMaskedLM), attn="eager")
    ids = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(0))
    logits, cache = bert.run_with_cache(ids, return_type="logits")
    final = cache["blocks.1.hook_resid_post"]
    plain = bert.hf.cls(final)  # what HF computes from the stream: the head's dense, activation, norm, decoder
    torch.testing.assert_close(plain, logits)
    for name in ("W_U", "b_U"):
        with pytest.raises(NotImplementedError, match="encoder"):
            getattr(bert, name)
    with pytest.raises(NotImplementedError, match="encoder"):
        bert.tokens_to_residual_directions(torch.tensor([5]))


def test_ov_takes_negative_row_indices_and_refuses_rows_past_the_end(llama_ids):
    model, _ = llama_ids
    attn = model.hf.model.layers[1].self_attn
    d, group = model.cfg.d_head, model.cfg.n_heads // model.cfg.n_kv_heads
    w_v = attn.v_proj.weight[(2 // group) * d:(2 // group + 1) * d].T  # head 2's values, (m, d), from HF's weights
    w_o = attn.o_proj.weight[:, 2 * d:3 * d].T  # (d, m)
    norm = model.hf.model.layers[1].input_layernorm.weight[:, None]  # fold_ln: the norm's weight on the rows
    full = (norm * w_v) @ w_o
    torch.testing.assert_close(model.OV[1, 2, -1].AB, full[-1:], atol=1e-5, rtol=1e-5)  # before: empty
    torch.testing.assert_close(model.OV[1, 2, -2:].AB, full[-2:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.OV[1, 2, :, -1].AB, full[:, -1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.OV[-1, -1].AB, model.OV[1, model.cfg.n_heads - 1].AB)
    with pytest.raises(IndexError, match="out of range"):
        model.OV[1, 2, model.cfg.d_model]


def test_apply_ln_to_stack_of_one_position_needs_its_pos_slice(llama_ids):
    model, ids = llama_ids
    logits, cache = model.run_with_cache(ids[:1], return_type="logits")
    resid = cache.accumulated_resid()  # (c, 1, p, m)
    last = resid[:, :, -1]  # (c, 1, m): one position, taken by the user
    with pytest.raises(ValueError, match="pos_slice"):
        cache.apply_ln_to_stack(last)  # before: broadcast to (c, p, m)
    scaled = cache.apply_ln_to_stack(last, pos_slice=-1)
    torch.testing.assert_close(scaled, cache.apply_ln_to_stack(resid)[:, :, -1])
    torch.testing.assert_close(scaled[-1] @ model.W_U + model.b_U, logits[:, -1], atol=1e-4, rtol=1e-4)


# -- 7: diff_atlas reports a value B dropped and heads only one side has -------------------------------------------
def _atlas(heads):
    from analyses.atlas.atlas import SCHEMA

    return {"schema": SCHEMA, "scores": {"sink": {}, "induction": {}},
            "heads": [{"site": "blocks.0.attn", "layer": 0.0, "head": h, "label": "none", "labels": "",
                       "values": {k: {"value": v, "lo": v - 0.1, "hi": v + 0.1} for k, v in values.items()}}
                      for h, values in heads]}


def test_diff_atlas_reports_a_dropped_value_and_heads_only_one_side_has(tmp_path, capsys):
    from analyses.atlas.atlas import diff_atlas, save_atlas
    from analyses.cli import main

    a = _atlas([(0, {"sink": 0.9, "induction": 0.1}), (1, {"sink": 0.1, "induction": 0.2})])
    b = _atlas([(0, {"sink": 0.9}), (1, {"sink": 0.1, "induction": 0.2}), (2, {"sink": 0.5, "induction": 0.3})])
    found = diff_atlas(a, b)
    assert found["missing"] == ["head 0.0 value induction"]  # before: silent
    assert found["added"] == ["head 0.2"]  # before: silent
    assert found["changed"] == []
    back = diff_atlas(b, a)
    assert back["missing"] == ["head 0.2"] and back["added"] == ["head 0.0 value induction"]
    save_atlas(a, tmp_path / "a.json"), save_atlas(b, tmp_path / "b.json")
    assert main(["atlas", "diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 1  # before: 0
    out = capsys.readouterr()
    assert "head 0.0 value induction" in out.out and "only in" in out.out and "head 0.2" in out.out
    assert main(["atlas", "diff", str(tmp_path / "a.json"), str(tmp_path / "a.json")]) == 0


# -- 8: one user score raising in a default atlas leaves ours (and other users' scores) running --------------------
def test_a_failing_user_score_is_the_only_score_not_run(tmp_path):
    from analyses import build_atlas
    from analyses.heads import registry

    model = interp.load_model("toy-induction")

    def explodes(ids):
        raise RuntimeError("my rule is broken today. More text")

    def previous_again(ids):
        out = torch.arange(ids.shape[1]).expand_as(ids) - 1
        return out.clone()

    _register("explodes", explodes), _register("previous_again", previous_again)
    try:
        atlas = build_atlas(model, n_prompts=4, seq_len=16, context=64, draws=2, n_bootstrap=20)
    finally:
        registry.unregister("explodes"), registry.unregister("previous_again")
    assert atlas["not_run"]["explodes"] == "my rule is broken today"  # its own reason
    assert {"previous_token", "induction", "sink", "previous_again"} <= set(atlas["scores"])  # before: not_run
    assert not {"previous_token", "induction", "sink", "previous_again"} & set(atlas["not_run"])
    for h in atlas["heads"]:  # the same rule under two names: the same values
        assert h["values"]["previous_again"]["value"] == pytest.approx(h["values"]["previous_token"]["value"])


# -- 10: wu2024's needle span is found as Wu et al.'s find_needle_idx finds it ---------------------------------------
def _their_find_needle_idx(prompt_ids, needle_ids):
    """nightdessert/Retrieval_Head, retrieval_head_detection.py, ``find_needle_idx``, as it reads (tokenizing the
    answer alone done by the caller)."""
    span_len = len(needle_ids)
    for i in range(len(prompt_ids)):
        span_ids = set(prompt_ids[i:i + span_len])
        overlap = float(len(span_ids.intersection(set(needle_ids)))) / len(set(needle_ids))
        if overlap > 0.9:
            return i, i + span_len
    return -1, -1


def test_wu_needle_span_is_their_find_needle_idx_where_it_differs_from_the_planted_digits(worded):
    from analyses.data.needles import wu_needle_prompts, wu_needle_span

    assert wu_needle_span([9, 5, 1, 2, 1, 7], [1, 2, 1]) == (1, 4)  # the last token repeats: one early, as theirs
    prompts = wu_needle_prompts(worded, [200], [0.0, 0.25, 0.5, 0.75, 1.0], needle_len=8, seed=0) + \
        wu_needle_prompts(worded, [240], [0.0, 0.5, 1.0], needle_len=8, seed=1)
    differ = 0
    for p in prompts:
        answer = worded.tokenizer(p.text, add_special_tokens=False)["input_ids"]
        assert p.needle == _their_find_needle_idx(p.ids.tolist(), answer)
        assert worded.tokenizer.decode(p.reference) == p.text  # the planted digits, ROUGE's reference
        differ += p.needle != p.planted
    assert differ >= 1  # before: the planted span on every prompt


def test_wu_trials_record_the_span_their_code_finds_and_the_planted_digits(worded):
    from analyses import retrieval_heads
    from analyses.data.needles import wu_needle_prompts

    df = retrieval_heads(worded, context=256, lengths=[200, 240], depths=[0.0, 0.5], needle_len=8, n_bootstrap=20,
                         protocol="wu2024", max_new_tokens=3)
    prompts = wu_needle_prompts(worded, [200, 240], [0.0, 0.5], needle_len=8, seed=0)
    assert [(t["span"], t["planted"]) for t in df.attrs["trials"]] == [(list(p.needle), list(p.planted))
                                                                       for p in prompts]
    assert all(t["needle_tokens"] == 8 for t in df.attrs["trials"])


# -- 9: each class is checked on the behaviour it is named for ---------------------------------------------------------
def test_each_class_is_checked_on_its_own_behaviour_and_says_when_that_does_not_confirm_it(worded):
    import pandas as pd

    from analyses import ablate_heads
    from analyses.atlas.class_ablation import class_ablation
    from analyses.data.toy import repeated_sequences

    kinds = ["previous_token", "successor", "copy_suppression", "retrieval", "induction"]
    heads = pd.DataFrame({"layer": [0, 0, 1, 1, 1], "head": [0, 1, 0, 1, 2], "label": kinds,
                          **{k: [0.5 if i == j else 0.0 for j in range(5)] for i, k in enumerate(kinds)}})
    found = class_ablation(worded, heads, draws=3)
    rows = {r["class"]: r for r in found["rows"]}
    assert "self-repair" in rows["copy_suppression"]["own_test"]["task"]  # before: the induction copy task for all
    assert "ordinal" in rows["successor"]["own_test"]["task"] and "needle" in rows["retrieval"]["own_test"]["task"]
    assert rows["previous_token"]["own_test"] is None and rows["previous_token"]["confirmed"] is None
    for r in rows.values():
        test = r["own_test"]
        if test is not None and test["clean"] is not None:
            beaten = test["effect"] > 0 and all(test["effect"] > v for v in test["random_effect"])
            assert r["confirmed"] == beaten and r["verdict"].startswith("confirmed" if beaten else "not confirmed")
    # the self-repair measure recomputed by hand: the repeated token's logit in the second copy, with 1.0 ablated
    ids = repeated_sequences(8, 16, worded.cfg.vocab_size, torch.Generator().manual_seed(0),
                             worded.hf.config.bos_token_id)
    with torch.no_grad():
        clean = worded(ids).logits[:, -16:-1].gather(-1, ids[:, -15:, None]).mean()
        with ablate_heads(worded, [(1, 0)]):
            ablated = worded(ids).logits[:, -16:-1].gather(-1, ids[:, -15:, None]).mean()
    test = rows["copy_suppression"]["own_test"]
    assert test["clean"] == pytest.approx(float(clean), abs=1e-5)
    assert test["ablated"] == pytest.approx(float(ablated), abs=1e-5)
    assert test["effect"] == pytest.approx(float(ablated - clean), abs=1e-5)  # ablating suppressors should raise it


def test_the_atlas_page_shows_each_classs_own_verdict(worded):
    from analyses.views.atlas import _causal_html

    causal = {"draws": 2, "task": "t", "first_copy_loss": 1.0, "second_copy_loss": 0.5, "rows": [
        {"class": "copy_suppression", "heads": ["1.0"], "share": 0.1, "random_share": [0.2, 0.0], "confirmed": False,
         "verdict": "not confirmed on <the self-repair test>", "own_test": {
             "task": "x", "measure": "logit", "clean": 1.0, "ablated": 1.1, "random": [1.0, 1.2], "effect": 0.1,
             "random_effect": [0.0, 0.2]}}]}
    page = _causal_html(causal)
    assert 'data-confirmed="no"' in page and "not confirmed on &lt;the self-repair test&gt;" in page


def test_our_own_scores_fill_no_column_another_fills():
    """``register`` checks a user's score against every column (our records are checked here instead, so that
    registering them at import reads no ``interp`` module and ``interp --help`` imports no torch)."""
    from analyses.heads import registry

    for record in registry.scores():
        if record.builtin:
            taken = registry.reserved_columns(but=record.name)
            assert not set(registry.table_columns(record)) & set(taken), record.name
