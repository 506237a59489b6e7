"""Degenerate inputs to the literature's head taxonomy (issue 35): prompts a tokenizer cannot read, a NaN score, an
encoder, a vocabulary smaller than k, n_bootstrap <= 0 and default receivers that cannot receive are refused or
reported, never turned into labels."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_hf
from test_taxonomy import _planted, _tiny_with_tokenizer
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import interp
from analyses import detect_heads
from analyses.taxonomy.function_vectors import function_vector_scores
from analyses.heads.labels import head_labels, label_heads
from analyses.heads.scores import pattern_scores
from analyses.taxonomy.weights import copy_suppression_scores, successor_scores
from analyses.data.bootstrap import mean_interval
from analyses.taxonomy.behaviour import copy_suppression_behaviour_scores, corpus_windows
from analyses.taxonomy.ioi import _ioi, name_mover_scores, s_inhibition_scores
from analyses.data.tasks import ioi_task

WORDS = ["[UNK]", "[PAD]", "the", "a", "cat", "sat", "on"]


def _seven_words(words=WORDS):
    """A tiny random GPT-2 whose tokenizer knows 7 words: every prompt of the bundled tasks is mostly [UNK]."""
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]")
    return interp.load_model(tiny_hf("gpt2"), tokenizer=tok)


def test_tasks_a_tokenizer_cannot_read_are_refused_not_scored():
    """A 7-word tokenizer labelled function-vector heads from all-[UNK] prompts, and its IOI 'names' were all the
    same [UNK] id (a logit difference of exactly 0)."""
    model = _seven_words()
    with pytest.raises(ValueError, match=r"unknown token '\[UNK\]'.*tasks="):
        function_vector_scores(model, tasks=["antonyms"], n_prompts=4, n_shots=2, n_bootstrap=10)
    with pytest.raises(ValueError, match="unknown token"):
        detect_heads(model, scores=["function_vector"], n_bootstrap=10)
    with pytest.raises(ValueError, match=r"ioi_task needs at least 4 names.*unknown token"):
        ioi_task(model, n=4)
    with pytest.raises(ValueError, match="unknown token"):
        corpus_windows(model, 2, 16)
    words = [("the", "a"), ("a", "the"), ("cat", "sat"), ("sat", "on"), ("on", "cat")]
    with pytest.raises(ValueError, match="unknown token"):  # its words, but 'Q', 'A' and ':' of the prompts are not
        function_vector_scores(model, tasks={"own": words}, n_prompts=2, n_shots=2, n_bootstrap=10)
    # a task the tokenizer reads entirely is scored
    model = _seven_words(WORDS + ["Q", "A", ":"])
    df = function_vector_scores(model, tasks={"own": words}, n_prompts=2, n_shots=2, n_bootstrap=10)
    assert len(df) == 8 and df["function_vector"].notna().all()


def test_a_name_mover_score_that_is_not_measured_warns_and_is_not_labelled_none():
    """A model whose logits are all 0 has no logit difference to share: NaN scores, with a warning saying why, and
    the label 'nan' (not measured), never a confident 'none'."""
    model = _tiny_with_tokenizer()
    with torch.no_grad():
        model.hf.model.norm.weight.zero_()  # every logit 0: logit(IO) - logit(S) = 0 on every prompt
    task = _ioi(model, 4, 0)[:3]
    with pytest.warns(RuntimeWarning, match=r"logit difference.*is 0.*NaN"):
        df = name_mover_scores(model, task=task, n_bootstrap=10)
    assert df["name_mover"].isna().all()
    assert set(label_heads(df)) == {"nan"} and set(head_labels(df)) == {"nan"}
    with pytest.warns(RuntimeWarning, match="logit difference"):
        heads = detect_heads(model, scores=["name_mover"], n_bootstrap=10)
    assert set(heads["label"]) == {"nan"}


def test_a_head_with_one_measured_score_keeps_its_label():
    import pandas as pd

    df = pd.DataFrame({"layer": [0, 0, 1], "head": [0, 1, 0], "induction": [float("nan"), 0.9, float("nan")],
                       "sink": [0.5, 0.1, float("nan")]})
    assert label_heads(df).tolist() == ["sink", "induction", "nan"]
    assert head_labels(df).tolist() == ["sink", "induction", "nan"]


@pytest.mark.parametrize("hf", ["bert", "bert_mlm"])
def test_encoders_are_refused_by_the_scores_that_read_next_token_logits(hf):
    """successor and copy_suppression raised "'NoneType' object has no attribute 'split'" on BERT/MiniLM,
    function_vector a shape error."""
    if hf == "bert":
        model = interp.load_model(tiny_hf("bert"))
    else:
        torch.manual_seed(0)
        cfg = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                         max_position_embeddings=64, vocab_size=99, pad_token_id=0)
        model = interp.load_model(BertForMaskedLM(cfg).eval())
    calls = [lambda: successor_scores(model, lists={"a": [5, 6, 7]}),
             lambda: copy_suppression_scores(model),
             lambda: copy_suppression_behaviour_scores(model, tokens=torch.randint(1, 99, (2, 8))),
             lambda: name_mover_scores(model),
             lambda: s_inhibition_scores(model),
             lambda: function_vector_scores(model),
             lambda: detect_heads(model, scores=["successor"])]
    for call in calls:
        with pytest.raises(TypeError, match=r"next-token logits.*(encoder|bidirectional).*causal"):
            call()


def test_k_at_least_the_vocabulary_is_refused():
    """With k >= the vocabulary every token is among the k most negative logits: every head scored 1.0 and was
    labelled a copy suppressor; the behavioural score failed inside topk."""
    model = interp.load_model(_planted())  # vocabulary 99
    with pytest.raises(ValueError, match=r"k must be less than the vocabulary's 99 tokens.*got 99"):
        copy_suppression_scores(model, k=99)
    with pytest.raises(ValueError, match=r"k must be less than the vocabulary's 99 tokens.*got 200"):
        copy_suppression_behaviour_scores(model, tokens=torch.randint(1, 99, (2, 8)), k=200)
    assert len(copy_suppression_scores(model, k=98, n_bootstrap=10)) == 8


@pytest.mark.parametrize("n", [0, -1, 2.5, True])
def test_n_bootstrap_must_be_a_positive_integer_everywhere(n):
    model = interp.load_model(_planted())
    ids = torch.randint(1, 99, (2, 8))
    calls = [lambda: mean_interval(torch.ones(4, 2), n, 0),
             lambda: successor_scores(model, lists={"a": [5, 6, 7]}, n_bootstrap=n),
             lambda: copy_suppression_scores(model, n_bootstrap=n),
             lambda: copy_suppression_behaviour_scores(model, tokens=ids, n_bootstrap=n),
             lambda: name_mover_scores(model, n_bootstrap=n),
             lambda: s_inhibition_scores(model, n_bootstrap=n),
             lambda: function_vector_scores(model, n_bootstrap=n),
             lambda: detect_heads(model, scores=["successor"], n_bootstrap=n),
             lambda: pattern_scores(torch.full((1, 1, 4, 4), 0.25), torch.arange(4)[None], n_bootstrap=n)]
    for call in calls:
        with pytest.raises(ValueError, match=rf"n_bootstrap must be a positive integer .*; got {n!r}"):
            call()


def test_s_inhibition_default_receivers_skip_layer_zero_and_say_so():
    """The name movers of a 2-layer model sat in layer 0, so the default receivers had no sender and the error
    asked to 'choose receivers in a later layer', which the user never gave."""
    model = _tiny_with_tokenizer()
    task = _ioi(model, 4, 0)[:3]
    movers = name_mover_scores(model, task=task, n_bootstrap=10)
    movers["name_mover"] = [0.5, 0.4, 0.3, 0.2, 0.05, 0.04, 0.03, 0.02]  # only layer 0's heads are name movers
    movers["io_attention"] = 1.0
    df = s_inhibition_scores(model, task=task, name_movers=movers, n_bootstrap=10)
    assert df.attrs["receivers"] == [(1, 0), (1, 1), (1, 2)]
    assert "layer 0" in df.attrs["receivers_chosen"]
    with pytest.raises(ValueError, match="choose receivers in a later layer"):  # the user's own receivers
        s_inhibition_scores(model, receivers=[(0, 1)], task=task, n_bootstrap=10)


def test_s_inhibition_on_one_layer_names_the_default_receivers_and_the_fix():
    from transformers import AutoTokenizer

    from interp.model.bundled import bundled_folder  # found (and converted) as a user's load_model finds it

    tok = AutoTokenizer.from_pretrained(bundled_folder("smollm2"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2)
    model = interp.load_model(LlamaForCausalLM(cfg).eval(), tokenizer=tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"no receivers were given.*name movers.*after layer 0.*1 layer.*"
                                             r"receivers=\[\(layer, head\)"):
            s_inhibition_scores(model, n_prompts=4, n_bootstrap=10)
