"""Issue 52 (Trust IV), "One line, not a traceback": each test here failed before its fix (a traceback, a wrong
exception, or a silent wrong answer)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import interp
from interp.model.bundled import bundled_folder


@pytest.fixture(scope="module")
def worded():
    """A tiny random Llama with SmolLM2's tokenizer (found as users find it)."""
    tok = AutoTokenizer.from_pretrained(bundled_folder("smollm2"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok) + 8, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
    return interp.load_model(LlamaForCausalLM(cfg).eval(), tokenizer=tok, attn="eager")


# -- the TransformerLens surface -----------------------------------------------------------------------------------
@pytest.mark.parametrize("call, error, words", [
    (lambda m: m.to_str_tokens(["a", 1]), TypeError, "mixing strings"),  # before: "too many dimensions 'str'"
    (lambda m: m.get_token_position("a", ["a b", "c"]), ValueError, "once per text"),  # before: the same
    (lambda m: m.to_string(torch.tensor([-1])), ValueError, "[0, "),  # before: OverflowError
    (lambda m: m.to_string([1.5]), TypeError, "integer token ids"),
    (lambda m: m.tokens_to_residual_directions(torch.tensor([-1])), ValueError, "[0, "),  # before: the last column
    (lambda m: m.to_single_token(5), TypeError, "string of one token"),  # before: the tokenizer's 300-char message
    (lambda m: m.generate("hi", max_new_tokens=2.5), ValueError, "max_new_tokens"),  # before: TypeError from range
    (lambda m: m.generate("hi", max_new_tokens=-3), ValueError, "max_new_tokens"),  # before: returned the prompt
    # hook_point.add_hook(fn) now adds through the model, as TransformerLens's does (tests/test_transformerlens.py)
])
def test_the_transformerlens_surface_refuses_in_one_line(worded, call, error, words):
    with pytest.raises(error) as caught:
        call(worded)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_ids_past_the_tokenizer_are_refused_not_decoded_to_nothing(worded):
    past = len(worded.tokenizer) + 3  # in the model's vocabulary (embeddings padded), past the tokenizer's
    with pytest.raises(ValueError, match="past the tokenizer"):  # before: ''
        worded.to_string(torch.tensor([past]))
    with pytest.raises(ValueError, match=r"\[0, "):
        worded.to_string(torch.tensor([worded.cfg.d_vocab + 1]))
    assert worded.to_string(torch.tensor([81])) == worded.tokenizer.decode([81])  # a real id still decodes
    assert worded.get_token_position(81, [5, 81, 6]) == 1 and worded.get_token_position("a", ["a b"]) >= 0


# -- user scores ---------------------------------------------------------------------------------------------------
def _module(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text("import torch\nfrom analyses import head_score\n\n" + body)
    return path


@pytest.mark.parametrize("body, words", [
    ("@head_score('broken_rule', threshold=None)\ndef broken_rule(ids):\n    return 1 / 0\n",
     "ZeroDivisionError raised by the target rule of score 'broken_rule'"),
    ("@head_score('meta_rule', threshold=None)\ndef meta_rule(ids):\n    return torch.zeros(ids.shape, dtype=torch.long,"
     " device='meta')\n", "meta device"),
])
def test_a_user_rule_that_fails_is_one_line_naming_the_score_and_its_file(tmp_path, capsys, body, words):
    from analyses.cli import main
    from analyses.heads import registry

    path = _module(tmp_path, "mine", body)
    name = body.split("'")[1]
    try:
        code = main(["heads", "--model", "toy-induction", "--score-module", str(path), "--scores", name,
                     "--n-prompts", "4"])
    finally:
        registry.unregister(name)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # the lines above are the progress bar's
    assert code == 2 and "Traceback" not in err and last.startswith("interp heads: error: ")  # before: a traceback
    assert words in last
    if "ZeroDivision" in words:
        assert str(path) in err


def test_a_rule_with_no_target_anywhere_warns():
    from analyses import detect_heads, head_score
    from analyses.heads import registry

    model = interp.load_model("toy-induction")
    head_score("never_any", threshold=None)(lambda ids: torch.full_like(ids, -1))
    try:
        with pytest.warns(UserWarning, match="gave no target on any"):  # before: silent all-NaN column
            df = detect_heads(model, scores=["never_any"], n_prompts=4, n_bootstrap=10)
    finally:
        registry.unregister("never_any")
    assert df["never_any"].isna().all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rule with targets says nothing
        detect_heads(model, scores=["previous_token"], n_prompts=4, n_bootstrap=10)


def test_score_module_a_folder_or_a_module_registering_nothing_says_so(tmp_path, capsys):
    from analyses.cli import main

    assert main(["heads", "--model", "toy-induction", "--score-module", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err  # before: "no such file"
    empty = _module(tmp_path, "empty", "x = 1\n")
    assert main(["heads", "--model", "toy-induction", "--score-module", str(empty)]) == 2
    assert "registers no score" in capsys.readouterr().err  # before: ran without it, silently


def test_attribute_pairs_takes_what_its_help_says(tmp_path, capsys):
    from analyses.cli import main
    from analyses.heads import registry

    assert main(["attribute", "--qk", "0.0", "--pairs", "positional"]) == 2  # an argmax score, not a target rule
    err = capsys.readouterr().err
    assert "--pairs is top1 or a target-rule score" in err and "previous_token" in err
    path = _module(tmp_path, "prev", "@head_score('prev_again', threshold=None)\ndef prev_again(ids):\n"
                                     "    return torch.arange(ids.shape[1]).expand_as(ids) - 1\n")
    try:  # the help's "yours with --score-module": before, attribute had no --score-module
        code = main(["attribute", "--qk", "0.0", "--pairs", "prev_again", "--score-module", str(path), "--draws", "0",
                     "--n-prompts", "2", "--format", "csv"])
    finally:
        registry.unregister("prev_again")
    assert code == 0, capsys.readouterr().err


# -- the atlas and expectation files -------------------------------------------------------------------------------
def _good_atlas():
    from analyses.atlas.atlas import SCHEMA

    return {"schema": SCHEMA, "scores": {"sink": {}}, "heads": [
        {"site": "blocks.0.attn", "layer": 0, "head": 0, "label": "sink", "labels": "sink",
         "values": {"sink": {"value": 0.9, "lo": 0.8, "hi": 1.0}}}]}


def _tampered():
    yield "schema true", lambda a: a.update(schema=True)  # before: accepted (True == 1)
    yield "heads a dict", lambda a: a.update(heads={"0": 1})
    yield "a head without values", lambda a: a["heads"][0].pop("values")  # before: KeyError later
    yield "a value that is text", lambda a: a["heads"][0]["values"]["sink"].update(value="0.9")
    yield "head as text", lambda a: a["heads"][0].update(head="0")
    yield "scores a list", lambda a: a.update(scores=["sink"])


@pytest.mark.parametrize("what, edit", list(_tampered()), ids=[w for w, _ in _tampered()])
def test_load_atlas_refuses_a_tampered_file_in_one_line(tmp_path, capsys, what, edit):
    from analyses.atlas.atlas import load_atlas
    from analyses.cli import main

    atlas = _good_atlas()
    path = tmp_path / "a.json"
    path.write_text(json.dumps(atlas))
    assert load_atlas(path)["heads"][0]["head"] == 0
    edit(atlas)
    path.write_text(json.dumps(atlas))
    with pytest.raises(ValueError, match="a.json"):
        load_atlas(path)
    assert main(["atlas", "diff", str(path), str(path)]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("content", [bytes(range(256)) * 4, b'{"schema": 1, "heads": [{"site": "blocks.0.at'])
def test_load_atlas_refuses_a_binary_or_truncated_file(tmp_path, capsys, content):
    from analyses.atlas.atlas import load_atlas
    from analyses.cli import main

    path = tmp_path / "a.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="not a text|not JSON"):  # before: UnicodeDecodeError ("error: utf-8")
        load_atlas(path)
    assert main(["atlas", "diff", str(path), str(path)]) == 2
    err = capsys.readouterr().err
    assert "utf-8" not in err and "a.json" in err


@pytest.mark.parametrize("heads", [["4"], ["0.1.2"], "4.3", [4.3], ["a.b"]])
def test_expectation_heads_written_wrong_are_refused(tmp_path, heads):
    from analyses.atlas.expectations import load_expectations

    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "layers": 6, "heads": 8, "entries": [
        {"class": "induction", "heads": heads, "score": "induction", "test": "top", "k": 5}]}))
    with pytest.raises(ValueError, match="layer.head|list of heads"):  # before: a raw ValueError, or '4.3' as 4, 3
        load_expectations(path)


def test_a_label_test_on_a_score_without_threshold_is_refused(tmp_path):
    from analyses.atlas.expectations import load_expectations
    from analyses.heads import registry

    assert registry.score("copy_suppression_behaviour").threshold is None
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "layers": 6, "heads": 8, "entries": [
        {"class": "cs", "heads": ["4.3"], "score": "copy_suppression_behaviour", "test": "label"}]}))
    with pytest.raises(ValueError, match="needs a score with a threshold"):  # before: TypeError when checked
        load_expectations(path)


def test_each_taxonomy_score_not_run_on_an_encoder_gives_its_own_reason():
    """A default atlas of MiniLM gave copy_suppression the reason of the whole group ("The score(s) ['successor',
    'copy_suppression', ...]"); each now names itself alone."""
    from analyses import build_atlas

    atlas = build_atlas(interp.load_model("minilm"), n_prompts=4, seq_len=16, context=64, draws=1, n_bootstrap=10)
    for name in ("successor", "copy_suppression", "copy_suppression_behaviour"):
        why = atlas["not_run"][name]
        assert why.startswith(f"The score '{name}' reads next-token logits") and "encoder" in why, why
