"""Correctness and trust (issue 10): each test names the defect it guards against and failed before its fix.

1 padded rows equal rows run alone, in every study; 2 gradients through the flash path's logsumexp;
3 torch.compile; 4 copies and pickles; 5 training mode; 6 head specs; 7 the tokenizer is left alone;
8 one wrapper's hooks never fire in another's runs; 9 loading never invents weights; 10 an emptied layer has
no heads; 11 one prompt-file reader; 12 empty prompts; 13 error messages.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import subprocess
import sys

import pandas as pd
import pytest
import torch
from conftest import TINY_FAMILIES, main_output, no_torch_hooks, padded_batch, tiny_hf
from transformers import (AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,
                          LlamaForSequenceClassification, LlamaModel)

import interp
from analyses import ablate_heads, ablation_scan, detect_heads, head_importance, lm_loss, prune_model
from analyses.cli import main
from analyses.data.metrics import embedding_similarity

TOL = 1e-5


def _alone(ids, mask, row, causal):
    """Row ``row`` of a padded batch without its padding: (1, n)."""
    keep = mask[row].bool()
    return ids[row:row + 1, keep]


def _valid(mask, row):
    return mask[row].bool()


# -- 1. padding --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_padded_rows_equal_rows_run_alone(family, attn):
    """GPT-2's learned positions made a left-padded row differ from the row alone by 0.34 in logits."""
    model = interp.load_model(tiny_hf(family), attn=attn)
    ids, mask = padded_batch(model.cfg.causal)
    with torch.no_grad():
        batch = main_output(model(ids, mask))
        _, cache = model.run_with_cache(ids, mask)
        for row in range(ids.shape[0]):
            alone_ids = _alone(ids, mask, row, model.cfg.causal)
            alone = main_output(model(alone_ids))
            assert (batch[row, _valid(mask, row)] - alone[0]).abs().max() <= TOL, (family, row)
            _, alone_cache = model.run_with_cache(alone_ids)
            for name in ("blocks.1.attn.hook_z", "blocks.1.attn.hook_q", "blocks.1.hook_resid_post"):
                assert (cache[name][row, _valid(mask, row)] - alone_cache[name][0]).abs().max() <= TOL, name


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_studies_on_a_padded_batch_equal_the_rows_run_alone(family):
    """ablation_scan and head_importance average per-example values: on a padded batch they must equal the
    mean of the same study on each row alone (lm_loss and the embedding probe are per-example means)."""
    model = interp.load_model(tiny_hf(family))
    ids, mask = padded_batch(model.cfg.causal)
    batch = {"input_ids": ids, "attention_mask": mask}
    rows = [{"input_ids": _alone(ids, mask, r, model.cfg.causal), "attention_mask": None} for r in range(3)]
    if model.cfg.causal:
        metrics = [lm_loss] * 4
    else:  # the similarity metric is tied to its inputs; its loss is a fixed random probe per example
        metrics = [embedding_similarity(model, batch)] + [embedding_similarity(model, r) for r in rows]
    scan = ablation_scan(model, batch, metrics[0], heads_per_forward=4)
    alone = [ablation_scan(model, r, m) for r, m in zip(rows, metrics[1:])]
    expected = sum(a.metric.to_numpy() for a in alone) / 3
    assert abs(scan.metric.to_numpy() - expected).max() <= TOL
    if model.cfg.causal:
        imp = head_importance(model, batch, loss=lm_loss).importance_raw.to_numpy()
        parts = sum(head_importance(model, r, loss=lm_loss).importance_raw.to_numpy() for r in rows) / 3
        assert abs(imp - parts).max() <= TOL


@pytest.mark.parametrize("attn", ["eager", "flash"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_head_scores_do_not_depend_on_batch_size(family, attn):
    """detect_heads on tiny GPT-2 gave scores that moved by 6.7e-4 between batch_size 1 and 8."""
    model = interp.load_model(tiny_hf(family), attn=attn)
    common = dict(n_prompts=8, seq_len=20, n_bootstrap=10, scores=["previous_token", "induction", "sink"])
    prompts = [torch.randint(1, 99, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 9, 14, 20)]
    for kwargs in (common, {**common, "prompts": prompts}):
        one = detect_heads(model, batch_size=1, **kwargs)
        eight = detect_heads(model, batch_size=8, **kwargs)
        for score in ("previous_token", "induction", "sink"):
            assert (one[score] - eight[score]).abs().max() <= TOL, score


def _text_causal_model():
    """A tiny random GPT-2 that uses MiniLM's tokenizer, to run text through a causal model."""
    folder = interp.model.loading.resolve_source("minilm")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=len(tokenizer))).eval()
    model = interp.load_model(hf)
    model.tokenizer = tokenizer
    return model


def test_text_batches_are_positioned_like_texts_run_alone():
    """Through to_tokens the left-padded text row differed from the text alone by 0.74."""
    model = _text_causal_model()
    texts = ["A much longer sentence than the other one here.", "Short one."]
    tokens = model.to_batch(texts)
    with torch.no_grad():
        batch = model(tokens).logits
        for row, text in enumerate(texts):
            alone = model(model.to_batch(text)).logits
            assert (batch[row, tokens["attention_mask"][row].bool()] - alone[0]).abs().max() <= TOL


# -- 2. gradients through the logsumexp ----------------------------------------------------------------------
def _prev_token_score(model, ids, mask):
    """sum over rows of exp(scale * q_i . k_{i-1} - lse_i) in layer 1, built from captured q, k and lse."""
    names = ["blocks.1.attn.hook_q", "blocks.1.attn.hook_k", "blocks.1.attn.hook_lse"]
    _, cache = model.run_with_cache(ids, mask, names=names, detach=False)
    q, k, lse = cache["q", 1], cache["k", 1], cache["lse", 1]  # (b, p, h, d), (b, p, g, d), (b, h, q)
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    dots = (q[:, 1:] * k[:, :-1]).sum(-1) * model.attn_scales[1]  # (b, p-1, h)
    valid = (mask[:, 1:] * mask[:, :-1]).bool()
    rows = mask.bool()[:, None, :].expand_as(lse)
    return torch.exp((dots - lse[:, :, 1:].transpose(1, 2))[valid]).sum() + (lse[rows] * 0.1).sum()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gradients_through_the_flash_logsumexp_equal_eager(family):
    """The CPU kernel returned lse without a gradient: the gradient of a score built from q, k and lse was wrong
    by more than its own size."""
    hf = tiny_hf(family)
    with torch.no_grad():  # scale up so that attention is far from uniform
        for name, p in hf.named_parameters():
            if "attn" in name and p.ndim == 2:
                p.mul_(6.0)
    ids, mask = padded_batch(True)
    grads = {}
    for attn in ("eager", "flash"):
        model = interp.load_model(copy.deepcopy(hf), attn=attn)
        model.hf.zero_grad()
        _prev_token_score(model, ids, mask).backward()
        grads[attn] = {n: p.grad.clone() for n, p in model.hf.named_parameters() if p.grad is not None}
    largest = max(g.abs().max() for g in grads["eager"].values())
    assert largest > 1e-3
    for name, g in grads["eager"].items():
        assert (g - grads["flash"][name]).abs().max() <= TOL * max(1.0, float(largest)), name


# -- 3. torch.compile ----------------------------------------------------------------------------------------
def test_the_fused_kernel_reads_keys_strided_along_the_head_dimension():
    """Inkling hands its attention keys and values of stride 14 along the head dimension; the CPU flash op read
    them as if the stride were 1 (output off by 9 on a tiny model; found by the family sweep)."""
    from interp.attention.kernels import fused_attention, tiled_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 14, 16, generator=g)
    k, v = (torch.randn(2, 16, 2, 14, generator=g).permute(0, 2, 3, 1) for _ in range(2))  # (b, g, k, d), d-stride 14
    mask = torch.randn(2, 8, 14, 14, generator=g)
    assert k.stride(-1) != 1
    for m in (None, mask, mask.transpose(-1, -2).contiguous().transpose(-1, -2)):
        out, lse = fused_attention(q, k, v, m, 0.25)
        want, want_lse = tiled_attention(q, k.contiguous(), v.contiguous(), m, 0.25)
        assert (out - want).abs().max() < 1e-5 and (lse - want_lse).abs().max() < 1e-5


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_model_runs_equals_and_honours_later_hooks(backend):
    """Dynamo guarded a global weak table of hooks and crashed once another HookedModel was freed."""
    torch._dynamo.reset()
    others = [interp.load_model(tiny_hf("llama", seed=s)) for s in (1, 2)]
    model = interp.load_model(tiny_hf("llama"))
    compiled = torch.compile(model.hf, backend=backend)
    ids = torch.randint(1, 99, (2, 9), generator=torch.Generator().manual_seed(0))

    def run(m):
        with torch.no_grad():
            return m(input_ids=ids, use_cache=False).logits

    plain = run(model.hf)
    assert (run(compiled) - plain).abs().max() <= TOL
    del others
    gc.collect()
    assert (run(compiled) - plain).abs().max() <= TOL
    seen = []

    def zero_head(z, hook):
        seen.append(hook.name)
        z = z.clone()
        z[:, :, 1] = 0
        return z

    with model.hooks([("blocks.0.attn.hook_z", zero_head)]):
        edited = run(compiled)
        expected = run(model.hf)
    assert seen and not torch.allclose(edited, plain, atol=1e-4)
    assert (edited - expected).abs().max() <= TOL
    assert (run(compiled) - plain).abs().max() <= TOL  # hook gone: back to the plain output


# -- 4. copies -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_run_and_own_their_hooks(how):
    """A deepcopy or unpickled HookedModel refused to run ("wrapped again by a newer HookedModel")."""
    model = interp.load_model(tiny_hf("llama"), attn="eager")
    ids = torch.arange(1, 9)[None]
    model._registry.add("blocks.0.attn.hook_z", _double)  # a picklable hook, carried by the copy
    copied = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    assert copied.hf is not model.hf and copied.attn == "eager"
    with torch.no_grad():
        assert torch.equal(copied(ids).logits, model(ids).logits)
        model.reset_hooks()
        assert not torch.equal(copied(ids).logits, model(ids).logits)  # the copy keeps its own hook
        copied.reset_hooks()
        assert torch.equal(copied(ids).logits, model(ids).logits)
        seen = []
        with copied.hooks([("blocks.1.attn.hook_q", lambda t, h: seen.append("copy"))]):
            model(ids)
            assert seen == []
            copied(ids)
        assert seen == ["copy"]
    assert no_torch_hooks(model.hf) and no_torch_hooks(copied.hf)


def _double(z, hook):
    return z * 2


def test_copies_of_the_hf_model_carry_no_hooks():
    model = interp.load_model(tiny_hf("llama"))
    ids = torch.arange(1, 9)[None]
    with model.hooks([("blocks.0.attn.hook_z", lambda z, h: z * 0)]):
        hf_copy = copy.deepcopy(model.hf)
        with torch.no_grad():
            assert not torch.equal(hf_copy(input_ids=ids).logits, model(ids).logits)


# -- 5. training mode -------------------------------------------------------------------------------------------
def test_studies_run_in_eval_mode_and_restore_the_users_mode_and_rng():
    """With dropout on, two identical ablation_scans differed by 0.0134 and detect_heads on flash raised."""
    hf = tiny_hf("llama", attention_dropout=0.5)
    hf.train()
    model = interp.load_model(hf)
    assert model.hf.training  # loading an instance keeps its mode
    ids, mask = padded_batch(True)
    inputs = {"input_ids": ids, "attention_mask": mask}
    rng = torch.get_rng_state()
    first, second = ablation_scan(model, inputs, lm_loss), ablation_scan(model, inputs, lm_loss)
    assert first.metric.equals(second.metric)
    heads = detect_heads(model, n_prompts=4, n_bootstrap=10)
    assert len(heads) == 8
    head_importance(model, inputs, loss=lm_loss)
    with ablate_heads(model, [(0, 1)], "mean", reference=inputs):
        pass
    assert all(m.training for m in model.hf.modules())
    assert torch.equal(torch.get_rng_state(), rng)


def test_studying_restores_everything_after_an_exception():
    model = interp.load_model(tiny_hf("gpt2"))
    model.hf.train()
    model.hf.lm_head.weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match="boom"):
        with model.studying():
            model.hf.lm_head.weight.requires_grad_(True)
            model._registry.add("blocks.0.attn.hook_z", lambda z, h: z)
            assert not model.hf.training
            raise RuntimeError("boom")
    assert model.hf.training and not model.hf.lm_head.weight.requires_grad
    assert model._registry.active() == [] and no_torch_hooks(model.hf)


# -- 6. head specs ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", [[(0, 1.9)], [(True, 1)], [("1", "2")], [(0, None)], "0.1", [(0,)]])
def test_only_integers_are_heads(heads):
    """(0, 1.9) ablated head 1; (True, 1) and ("1", "2") were accepted."""
    model = interp.load_model(tiny_hf("gpt2"))
    with pytest.raises(ValueError, match=r"\(layer, head\) pairs of integers"):
        with ablate_heads(model, heads):
            pass
    with pytest.raises(ValueError, match=r"\(layer, head\) pairs of integers"):
        ablation_scan(model, torch.arange(1, 6), lm_loss, heads=heads)


def test_numpy_integers_are_heads():
    model = interp.load_model(tiny_hf("gpt2"))
    df = pd.DataFrame({"layer": [1], "head": [2]})
    scan = ablation_scan(model, torch.arange(1, 6), lm_loss, heads=list(zip(df["layer"], df["head"])))
    assert list(zip(scan["layer"], scan["head"])) == [(1, 2)]


# -- 7. the tokenizer --------------------------------------------------------------------------------------------
def test_to_tokens_leaves_the_tokenizer_as_it_was():
    """to_tokens set tokenizer.padding_side (and pad_token) for good."""
    model = _text_causal_model()
    tok = model.tokenizer
    tok.padding_side = "right"
    before = (tok.padding_side, tok.pad_token, tok.truncation_side)
    tokens = model.to_batch(["one two three four", "one"])
    assert (tok.padding_side, tok.pad_token, tok.truncation_side) == before
    assert tokens["attention_mask"].tolist()[1][0] == 0  # causal: padded on the left all the same


# -- 8. two wrappers -----------------------------------------------------------------------------------------------
def test_an_earlier_wrappers_hooks_never_fire_in_a_newer_ones_runs():
    hf = tiny_hf("gpt2")
    first = interp.load_model(hf)
    fired = []
    names = ["blocks.0.hook_resid_pre", "blocks.1.hook_attn_out", "hook_embed", "blocks.0.attn.hook_z"]
    with first.hooks([(names, lambda t, h: fired.append(h.name))]):
        second = interp.load_model(hf)  # its load probe runs a forward
        assert fired == []
        with torch.no_grad():
            second(torch.arange(1, 6))
        assert fired == []
        with pytest.raises(RuntimeError, match="wrapped again"):
            first(torch.arange(1, 6))
    assert no_torch_hooks(hf)


# -- 9. loading never invents weights -----------------------------------------------------------------------------
def _llama_config():
    return LlamaConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=99, pad_token_id=0)


@pytest.mark.parametrize("cls", [LlamaModel, LlamaForSequenceClassification])
def test_a_folder_loads_as_the_class_it_was_saved_from(cls, tmp_path):
    """A headless LlamaModel folder loaded as LlamaForCausalLM with a random lm_head (two loads differed by 0.55)."""
    torch.manual_seed(0)
    cls(_llama_config()).save_pretrained(tmp_path)
    a, b = interp.load_model(tmp_path), interp.load_model(tmp_path)
    assert type(a.hf) is cls
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        assert torch.equal(main_output(a(ids)) if cls is LlamaModel else a(ids).logits,
                           main_output(b(ids)) if cls is LlamaModel else b(ids).logits)


def test_a_folder_without_some_weights_is_refused(tmp_path):
    torch.manual_seed(0)
    LlamaModel(_llama_config()).save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text().replace('"LlamaModel"', '"LlamaForCausalLM"')
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=r"no weights for lm_head.weight .*at random"):
        interp.load_model(tmp_path)


# -- 10. emptied layers ------------------------------------------------------------------------------------------
def test_an_emptied_layers_placeholder_is_no_head():
    model = interp.load_model(tiny_hf("llama"))
    pruned = prune_model(model, [(0, h) for h in range(4)] + [(1, 0)], allow_empty_layers=True)
    assert pruned.cfg.empty_layers == (0,) and pruned.cfg.heads_per_layer == (1, 3)
    assert pruned.cfg.heads() == [(1, 0), (1, 1), (1, 2)]
    heads = detect_heads(pruned, n_prompts=4, n_bootstrap=10)
    assert list(zip(heads["layer"], heads["head"])) == [(1, 0), (1, 1), (1, 2)]
    scan = ablation_scan(pruned, torch.arange(1, 9), lm_loss)
    assert set(scan.layer) == {1}
    assert set(head_importance(pruned, torch.arange(1, 9), loss=lm_loss).layer) == {1}
    with pytest.raises(ValueError, match="Layer 0 has no heads left"):
        ablation_scan(pruned, torch.arange(1, 9), lm_loss, heads=[(0, 0)])


# -- 11. prompt files ----------------------------------------------------------------------------------------------
def test_every_command_reads_token_id_prompt_files(tmp_path, capsys):
    """`interp heads --prompts FILE` with token ids failed on the default model; `interp ablate` accepted it."""
    prompts = tmp_path / "ids.txt"
    prompts.write_text("0 5 17 5 17 9\n0 3 9 3\n\n0 8 8 8 1 2 1 2\n")
    for argv in (["heads", "--format", "csv", "--n-prompts", "3"], ["ablate", "--format", "csv", "--heads", "1.1"],
                 ["prune", "--format", "csv", "--step", "0.5"]):
        assert main([*argv, "--prompts", str(prompts)]) == 0, argv
        out = capsys.readouterr().out
        assert len(pd.read_csv(io.StringIO(out))) > 0
    assert main(["plot", "--prompts", str(prompts), "--layer", "1", "--head", "0", "--out", str(tmp_path / "m.png")]) == 0
    prompts.write_text("0 5 x\n")
    assert main(["heads", "--prompts", str(prompts)]) == 2
    assert "line 1: this model has no tokenizer" in capsys.readouterr().err


# -- 12. empty prompts ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompts", ["", "   ", ["fine", " \n"], []])
def test_empty_prompts_are_refused(minilm, prompts):
    """detect_heads(model, prompts="") labelled 67 of 72 MiniLM heads sink."""
    with pytest.raises(ValueError, match="empty"):
        detect_heads(minilm, prompts=prompts)


# -- 13. error messages --------------------------------------------------------------------------------------------
def test_cache_pattern_says_the_layer_is_out_of_range(minilm):
    _, cache = minilm.run_with_cache("A short text.")
    with pytest.raises(IndexError, match=r"Layer 7 is out of range: this model's layers run 0\.\.5"):
        cache.pattern(7)


def test_a_hook_with_the_wrong_signature_is_refused_when_added():
    model = interp.load_model(tiny_hf("gpt2"))
    with pytest.raises(TypeError, match=r"fn\(tensor, hook\).*<lambda>\(z\)"):
        model.run_with_hooks(torch.arange(1, 4), fwd_hooks=[("blocks.0.attn.hook_z", lambda z: z)])
    assert model._registry.active() == [] and no_torch_hooks(model.hf)


def test_plot_refuses_an_output_folder_that_does_not_exist(tmp_path, capsys):
    out = tmp_path / "missing" / "x.png"
    assert main(["plot", "--layer", "1", "--head", "0", "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err and not out.parent.exists()


def test_a_too_long_text_gives_one_line_and_no_transformers_warning():
    text = " ".join(["word"] * 600)
    done = subprocess.run([sys.executable, "-m", "analyses.cli", "plot", "--model", "minilm", "--layer", "0",
                           "--head", "0", "--text", text, "--out", "/tmp/never-written.png", "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "at most 512" in lines[0], done.stderr


def test_a_model_given_as_a_positional_argument_hints_at_model(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["heads", "minilm"])
    assert exit_info.value.code == 2
    assert "`interp heads --model minilm`" in capsys.readouterr().err


def test_an_unknown_bundled_name_suggests_the_close_one():
    with pytest.raises(FileNotFoundError, match="did you mean 'minilm'"):
        interp.load_model("minilmm")
    with pytest.raises(FileNotFoundError, match="did you mean 'toy-induction'"):
        interp.load_model("toy_induction")


# -- promises ------------------------------------------------------------------------------------------------------
def _readme_commands() -> list[str]:
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    two = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [line for block in re.findall(r"```bash\n(.*?)```", two, re.S) for line in block.splitlines()
            if line.strip() and not line.startswith("#")]


def test_ci_runs_exactly_the_readmes_test_command():
    """The README's test command failed on a fresh machine (no Chromium); .ci/run must run that same command."""
    from pathlib import Path

    setup, tests = _readme_commands()
    assert "chromium" in tests and tests.rstrip().endswith("python -m pytest")
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text().splitlines()
    assert tests in ci, "the test command in .ci/run differs from the README's"


def _trained_heads(folder):
    model = interp.load_model(folder)
    return detect_heads(model, scores=["previous_token", "induction"], n_prompts=50, n_bootstrap=10)


@pytest.mark.slow  # a full training run (~70 s quiet); test_cli.py::test_train_toy_small covers the verb
def test_train_toy_forms_the_circuit_again(tmp_path, capsys):
    """'train-toy rebuilds the bundled model byte for byte' did not hold on another machine. What must hold
    anywhere: the recipe forms previous-token heads in layer 0 and induction heads in layer 1 (1,000 steps
    here; the bundled model took 3,000)."""
    assert main(["train-toy", "--out", str(tmp_path), "--steps", "1000", "--threads", "1"]) == 0
    assert oct((tmp_path / "model.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    heads = _trained_heads(tmp_path)
    induction = heads[heads["induction"] > 0.5]
    previous = heads[heads["previous_token"] > 0.4]
    assert len(induction) >= 2 and set(induction["layer"]) == {1}
    assert len(previous) >= 1 and set(previous["layer"]) == {0}


@pytest.mark.slow
def test_the_documented_training_command_forms_the_bundled_circuit(tmp_path):
    """The exact command in TRAINING.md (146 s): the same kinds of heads in the same layers as the bundled model."""
    assert main(["train-toy", "--out", str(tmp_path), "--seed", "0", "--steps", "3000", "--threads", "1"]) == 0
    ours, bundled = _trained_heads(tmp_path), _trained_heads(interp.model.loading.resolve_source("toy-induction"))
    for heads in (ours, bundled):
        assert set(heads.loc[heads["induction"] > 0.5, "layer"]) == {1}
        assert set(heads.loc[heads["previous_token"] > 0.4, "layer"]) == {0}
    assert (ours["induction"] > 0.5).sum() >= 2


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_saved_models_get_the_usual_file_modes(tmp_path):
    """Saved weights had mode 0600 (transformers writes them through a temporary file)."""
    model = interp.load_model("minilm")
    pruned = prune_model(model, [(0, 1)])
    pruned.save_pretrained(tmp_path)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert "model.safetensors" in modes and "tokenizer.json" in modes
    assert set(modes.values()) == {0o666 & ~_umask()}
    assert interp.load_model(tmp_path).cfg.heads_per_layer[0] == 11


@pytest.mark.parametrize("busy, expected", [(0.0, 2), (1.2, 1), (7.0, 1)])
def test_threads_auto_takes_the_idle_cores(monkeypatch, busy, expected):
    """Torch's default threads collapsed on a shared 2-core machine (MiniLM report 15.7 s quiet, 207 s beside
    one busy process); --threads auto takes the cores that are idle now (busy: CPUs busy over the sample)."""
    import os

    from analyses.cli import common as cli  # _set_threads and UserError live there
    from interp.runtime import threads

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "_busy_now", lambda: busy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    assert cli._set_threads("auto") == expected and set_to == [expected]
    assert cli._set_threads("3") == 3
    with pytest.raises(cli.UserError, match="positive integer or 'auto'"):
        cli._set_threads("0")
    monkeypatch.undo()
    assert torch.get_num_threads() == before
