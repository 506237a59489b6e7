"""Trust II, issue 22 items 9-12: each test names the defect it guards against and failed before its fix.

9 NaN/inf is reported, never drawn or labelled as data; 10 encoder-decoder inputs longer than the model and studies
that do not handle encoder-decoder models are clear errors; 11 the tokenizer's backend truncation and padding are
left as the user set them; 12 API misuse says what was expected, what was given and how to fix it.
"""

from __future__ import annotations

import warnings

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import tiny_hf  # noqa: E402
from test_seq2seq import _tiny as tiny_seq2seq  # noqa: E402
from test_trust import _text_causal_model  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

import interp  # noqa: E402
from analyses import (activation_patching, attention_heatmap, detect_heads, direct_logit_attribution,  # noqa: E402
                      head_view, ioi_task, logit_lens, ov_circuit, path_patching, pruning_curve, qk_circuit)
from hooks import ActivationCache  # noqa: E402


def _last_logit(out, batch=None):
    return out.logits[:, -1, 5].mean()


def _planted(attn: str, value: float = float("nan")):
    """A tiny Llama whose layer-1 head 2 (query rows 16..23) has non-finite query weights."""
    hf = tiny_hf("llama")
    with torch.no_grad():
        hf.model.layers[1].self_attn.q_proj.weight[16:24] = value
    return interp.load_model(hf, attn=attn)


# -- 9. NaN / inf -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_detect_heads_reports_heads_whose_attention_is_not_finite(attn):
    """detect_heads returned NaN scores for such heads, labelled every one "none", and said nothing."""
    model = _planted(attn)
    with pytest.warns(RuntimeWarning, match=r"layer 1: heads \[2\]"):
        df = detect_heads(model, n_prompts=4, seq_len=16, n_bootstrap=10)
    bad = (df["layer"] == 1) & (df["head"] == 2)
    assert df.loc[bad, "label"].tolist() == ["nan"] and df.loc[bad, "labels"].tolist() == ["nan"]
    assert df.loc[bad, ["previous_token", "induction", "sink", "positional_fraction"]].isna().all(axis=None)
    assert (df.loc[~bad, "label"] != "nan").all() and df.loc[~bad, "previous_token"].notna().all()


def test_a_finite_model_gets_no_nonfinite_warning_with_padding():
    """Padded rows must not be taken for non-finite heads (prompts of different lengths are padded)."""
    model = interp.load_model(tiny_hf("gpt2"), attn="eager")
    prompts = [torch.arange(1, n) for n in (5, 9, 14)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        df = detect_heads(model, prompts=prompts, n_bootstrap=10)
    assert (df["label"] != "nan").all()


def test_seq2seq_heads_report_non_finite_cross_attention():
    hf = tiny_seq2seq("bart")
    with torch.no_grad():
        hf.model.decoder.layers[0].encoder_attn.q_proj.weight[8:16] = float("inf")  # cross head 1
    model = interp.load_model(hf)
    with pytest.warns(RuntimeWarning, match=r"decoder\.blocks\.0\.cross_attn: heads \[1\]"):
        df = detect_heads(model, n_prompts=4, n_bootstrap=10)
    bad = (df["site"] == "decoder.blocks.0.cross_attn") & (df["head"] == 1)
    assert df.loc[bad, "label"].tolist() == ["nan"]
    assert (df.loc[~bad, "label"] != "nan").all()


def test_views_refuse_non_finite_patterns_instead_of_drawing_them():
    """_quantise cast NaN to an integer: head_view drew NaN patterns as real-looking weights."""
    pattern = torch.softmax(torch.randn(1, 3, 4, 4), -1)
    pattern[0, 1, 2, 1] = float("nan")
    cache = ActivationCache({"blocks.0.attn.hook_pattern": pattern})
    with pytest.raises(ValueError, match=r"layer 0, head\(s\) \[1\], holds NaN or inf"):
        head_view(cache, list("abcd"))
    assert head_view(cache, list("abcd"), heads=[0, 2]).data["heads"] == [[0, 2]]  # the finite heads still show
    with pytest.raises(ValueError, match="NaN or inf"):
        attention_heatmap(pattern[0, 1], 0, 1)


def test_head_view_of_a_model_with_inf_weights_names_the_heads():
    model = _planted("flash", float("inf"))
    with pytest.raises(ValueError, match=r"layer 1, head\(s\) \[2\]"):
        head_view(model, torch.arange(1, 9), layers=1)


# -- 10. encoder-decoder inputs and studies ----------------------------------------------------------------
@pytest.mark.parametrize("side", ["input_ids", "decoder_input_ids"])
def test_seq2seq_inputs_longer_than_the_positions_are_a_clear_error(side):
    """A BART source or target longer than max_position_embeddings raised torch's IndexError."""
    model = interp.load_model(tiny_seq2seq("bart"))  # max_position_embeddings 64
    batch = {"input_ids": torch.randint(3, 100, (1, 9)), "decoder_input_ids": torch.randint(3, 100, (1, 6))}
    batch[side] = torch.randint(3, 100, (1, 65))
    with pytest.raises(ValueError, match=rf"{side} has 65 positions but this model takes at most 64"):
        model(batch)


def test_t5_has_no_position_limit():
    model = interp.load_model(tiny_seq2seq("t5"))
    assert model.cfg.max_positions is None
    out = model(torch.randint(3, 100, (1, 70)), decoder_input_ids=torch.randint(3, 100, (1, 70)))
    assert out.logits.shape == (1, 70, 100)


def test_encoder_inputs_longer_than_the_positions_are_a_clear_error():
    model = interp.load_model(tiny_hf("bert"))
    with pytest.raises(ValueError, match="input_ids has 65 positions but this model takes at most 64"):
        model(torch.randint(1, 99, (1, 65)))


def test_studies_that_do_not_handle_seq2seq_refuse_it_clearly():
    """composition_scores raised AttributeError: 'Seq2SeqConfig' object has no attribute 'n_layers';
    ov_circuit and qk_circuit raised KeyError: 0. They now read sites, and a layer number is refused by name."""
    model = interp.load_model(tiny_seq2seq("bart"))
    for study in (ov_circuit, qk_circuit):
        with pytest.raises(ValueError, match="give a site name such as 'decoder.blocks.1.cross_attn'; got 0"):
            study(model, 0)
    with pytest.raises(ValueError, match="is not an attention site"):
        ov_circuit(model, "decoder.blocks.9.attn")


def test_weight_circuits_check_the_layer():
    model = interp.load_model(tiny_hf("llama"))
    with pytest.raises(ValueError, match=r"layer must be an integer in \[0, 2\).*got 2"):
        ov_circuit(model, 2)


# -- 11. the tokenizer's backend -----------------------------------------------------------------------------
def _backend_state(tok):
    b = tok.backend_tokenizer
    return (b.truncation, b.padding, tok.padding_side, tok.truncation_side, tok.model_max_length)


@pytest.fixture(scope="module")
def text_model():
    return _text_causal_model()


def _user_settings(tok):
    tok.backend_tokenizer.enable_truncation(max_length=7, direction="left")
    tok.backend_tokenizer.enable_padding(length=12, pad_id=0, pad_token="[PAD]", direction="left")
    tok.padding_side = "left"
    return _backend_state(tok)


@pytest.mark.parametrize("use", ["to_tokens", "detect_heads", "ioi_task", "dla_strings", "call_text"])
def test_every_tokenizer_use_leaves_the_backend_as_the_user_set_it(text_model, use):
    """to_tokens cleared truncation and padding set on tok.backend_tokenizer; detect_heads left it truncating at
    max_length=32, direction left."""
    model, tok = text_model, text_model.tokenizer
    before = _user_settings(tok)
    if use == "to_tokens":
        ids = model.to_tokens(["one two three four five six seven eight nine", "one"])
        assert ids.shape[1] > 7  # the user's backend truncation did not apply to our tokenization either
    elif use == "detect_heads":
        detect_heads(model, scores=["previous_token"], n_prompts=3, seq_len=16, n_bootstrap=10)
    elif use == "ioi_task":
        try:
            ioi_task(model, n=2)
        except ValueError:  # this vocabulary may keep too few names whole: the tokenizer was called all the same
            pass
    elif use == "dla_strings":
        direct_logit_attribution(model, ["the cat sat", "a dog ran"], ["on", "away"])
    else:
        model("the cat sat on the mat")
    assert _backend_state(tok) == before


def test_the_tokenizer_is_restored_after_an_exception(text_model):
    from interp.tokens.inputs import tokenizer_left_alone

    tok = text_model.tokenizer
    before = _user_settings(tok)
    with pytest.raises(RuntimeError, match="boom"):
        with tokenizer_left_alone(tok):
            tok(["some text"], truncation=True, max_length=3)
            tok.padding_side = "right"
            raise RuntimeError("boom")
    assert _backend_state(tok) == before


# -- 12. misuse ----------------------------------------------------------------------------------------------
def test_a_hook_returning_another_dtype_is_named_with_the_fix():
    """A hook returning float64 failed deep inside linear.py with a dtype mismatch."""
    model = interp.load_model(tiny_hf("gpt2"))
    with pytest.raises(TypeError, match=r"blocks\.0\.attn\.hook_z .*torch\.float32.*returned torch\.float64.*"
                                        r"out\.to\(tensor\.dtype\)"):
        model.run_with_hooks(torch.arange(1, 6), fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: z.double())])


_MISUSE = [  # (name, call(model, ids), error type, message pattern)
    ("bool ids", lambda m, ids: m(ids > 50), ValueError, r"integer token ids .*got torch\.bool.*\.long\(\)"),
    ("ragged rows", lambda m, ids: m([[1, 2, 3], [4, 5]]), ValueError, r"different lengths \(\[3, 2\]\).*pad_ids"),
    ("mapping without input_ids", lambda m, ids: m({"ids": ids}), ValueError, r"must hold input_ids.*\['ids'\]"),
    ("None", lambda m, ids: m(None), TypeError, "input_ids is None; give text"),
    ("to_tokens(None)", lambda m, ids: m.to_tokens(None), TypeError, r"string or a non-empty list.*got None"),
    ("to_tokens([])", lambda m, ids: m.to_tokens([]), ValueError, "empty list"),
    ("logit_lens k=0", lambda m, ids: logit_lens(m, ids, k=0), ValueError, r"from 1 to the vocabulary size \d+; got 0"),
    ("logit_lens k>vocab", lambda m, ids: logit_lens(m, ids, k=10**6), ValueError, "got 1000000"),
    ("logit_lens position", lambda m, ids: logit_lens(m, ids, position=8), ValueError, r"\[-8, 8\).*got 8"),
    ("dla position", lambda m, ids: direct_logit_attribution(m, ids, 5, position=-9), ValueError,
     r"\[-8, 8\).*got -9"),
    ("dla multi-token answer", lambda m, ids: direct_logit_attribution(m, ["a b", "c d"], ["on", "unbelievably"]),
     ValueError, "'unbelievably' is .* tokens; give one token"),
    ("dla float answer", lambda m, ids: direct_logit_attribution(m, ids, 5.5), TypeError, "token id"),
    ("pruning_curve max_fraction", lambda m, ids: pruning_curve(m, ids, _last_logit, max_fraction=float("nan")),
     ValueError, r"max_fraction .*\(0, 1\].*got nan"),
    ("path_patching heads_per_forward", lambda m, ids: path_patching(m, ids, ids, [(1, 0)], _last_logit,
                                                                      heads_per_forward=-1),
     ValueError, "heads_per_forward .*positive integer.*got -1"),
    ("activation_patching heads_per_forward", lambda m, ids: activation_patching(m, ids, ids, _last_logit,
                                                                              heads_per_forward=0),
     ValueError, "heads_per_forward .*positive integer.*got 0"),
]


@pytest.mark.parametrize("name,call,error,message", _MISUSE, ids=[m[0] for m in _MISUSE])
def test_misuse_says_what_was_expected_and_how_to_fix_it(text_model, name, call, error, message):
    ids = torch.randint(1, 99, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(error, match=message):
        call(text_model, ids)


def test_dla_takes_one_answer_string_per_sequence(text_model):
    """A list of answer strings failed inside torch.as_tensor; one token each is now tokenized per sequence."""
    tok = text_model.tokenizer
    on, away = (tok.convert_tokens_to_ids(t) for t in ("on", "away"))
    by_text = direct_logit_attribution(text_model, ["the cat sat", "a dog ran"], ["on", "away"])
    by_id = direct_logit_attribution(text_model, ["the cat sat", "a dog ran"], [on, away])
    assert by_text["attribution"].tolist() == by_id["attribution"].tolist()


@pytest.mark.parametrize("how", ["built on meta", "device='meta'"])
def test_a_model_on_the_meta_device_is_a_clear_error(how):
    """Loading a model whose weights are on the meta device failed with 'Tensor.item() cannot be called on meta
    tensors' deep inside transformers' masking code."""
    config = GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=99, eos_token_id=0,
                        bos_token_id=0)
    if how == "built on meta":
        with torch.device("meta"):
            hf = GPT2LMHeadModel(config)
        call = lambda: interp.load_model(hf)  # noqa: E731
    else:
        hf = GPT2LMHeadModel(config)
        call = lambda: interp.load_model(hf, device="meta")  # noqa: E731
    with pytest.raises(ValueError, match=r"weight\(s\) on the meta device.*transformer\.wte\.weight.*to_empty"):
        call()


def test_a_view_with_lone_surrogate_tokens_saves_as_valid_utf8(tmp_path):
    """view.save raised UnicodeEncodeError on a token string holding a lone surrogate."""
    cache = ActivationCache({"blocks.0.attn.hook_pattern": torch.softmax(torch.randn(1, 2, 3, 3), -1)})
    view = head_view(cache, ["a", "\ud800b", "\ud83d\ude00"], title="t\udcff")
    path = view.save(tmp_path / "view.html")
    text = path.read_bytes().decode("utf-8")  # strict: fails on anything that is not valid UTF-8
    assert "\ufffdb" in text and "\U0001F600" in text and "<title>t\ufffd</title>" in text


def test_score_grids_mark_heads_with_non_finite_attention():
    """A NaN head was labelled "none" and its cell left blank, like a head that does not exist."""
    from analyses import head_score_grid
    from matplotlib.patches import Rectangle

    with pytest.warns(RuntimeWarning):
        df = detect_heads(_planted("eager"), scores=["previous_token"], n_prompts=3, seq_len=12, n_bootstrap=10)
    ax = head_score_grid(df, "previous_token")
    marked = [(p.get_x(), p.get_y()) for p in ax.patches if isinstance(p, Rectangle) and p.get_gid() == "nan-head"]
    assert marked == [(2, 1)]  # head 2 of layer 1
    assert [t.get_position() for t in ax.texts if t.get_text() == "NaN"] == [(2.5, 1.5)]


# -- issue 27 item 6: metrics take a tensor or a batch, and the model or its output -------------------------------
def test_metrics_take_token_ids_a_batch_or_the_model_and_name_a_wrong_argument():
    import interp
    from analyses import lm_loss, second_copy_loss

    model = interp.load_model("toy-induction")
    x = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    tokens = torch.cat([torch.zeros(2, 1, dtype=torch.long), x, x], 1)
    with torch.no_grad():
        out = model(tokens)
    want = second_copy_loss(out, {"input_ids": tokens, "attention_mask": None})
    assert second_copy_loss(out, tokens) == want  # a tensor of ids (was: IndexError "too many indices")
    assert second_copy_loss(model, tokens) == want  # the model, run on the ids (was: TypeError)
    assert second_copy_loss.per_example(out, tokens).shape == (2,)
    assert lm_loss(model, tokens[0]) == pytest.approx(lm_loss(model(tokens[:1]), tokens[:1]))
    with pytest.raises(TypeError, match="looks like the model's output; the output goes first"):
        second_copy_loss(tokens, out)
    with pytest.raises(TypeError, match="looks like token ids"):
        second_copy_loss(tokens, tokens)
    with pytest.raises(TypeError, match="Tokenize text with model.to_tokens"):
        second_copy_loss(out, "some text")
    with pytest.raises(TypeError, match=r"has keys \['ids'\]"):
        second_copy_loss(out, {"ids": tokens})


def test_attention_heatmap_takes_the_model_first_order_and_names_a_wrong_argument():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import interp
    from analyses.views.plots import attention_heatmap

    model = interp.load_model("toy-induction")
    tokens = torch.arange(1, 12)
    old = attention_heatmap(model, 1, 3, tokens).collections[0].get_array()
    new = attention_heatmap(model, tokens, 1, 3).collections[0].get_array()  # as head_view(model, text, ...)
    assert torch.equal(torch.as_tensor(old), torch.as_tensor(new))
    with pytest.raises(TypeError, match="head must be an integer; got str 'x'"):
        attention_heatmap(model, tokens, 1, "x")
    plt.close("all")
