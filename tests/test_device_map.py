"""Models split across devices (issue 16): ``load_model(..., device_map=..., max_memory=..., offload_folder=...)``
through accelerate. On this CPU-only machine the split is CPU and disk: part of the model is offloaded to disk, its
weights sit on the meta device and accelerate's hooks load them for each forward. Parity with the plain model on
both paths, hooks and the cache, every study equal, and the model left as it was found (weights with the
offloaded ones loaded, accelerate's own hooks, requires_grad, no hook of ours), also when a study raises.
"""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate.utils.modeling import get_state_dict_offloaded_model
from conftest import no_torch_hooks, padded_batch

import interp
from analyses import (ablation_scan, activation_patching, attribution_patching, composition_scores, detect_heads,
                      direct_logit_attribution, head_importance, induction_task, lm_loss, logit_lens, path_patching,
                      prune_model, pruning_curve)
from analyses.data.metrics import Metric
from interp.runtime import distributed
from tests.tiny import tiny_model

# layer 1, the final norm and the unembedding on disk; the rest on the CPU
DEVICE_MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
              "model.norm": "disk", "lm_head": "disk"}
TOL = 1e-6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    return path


def _pair(folder, tmp_path, attn):
    plain = interp.load_model(folder, attn=attn)
    split = interp.load_model(folder, attn=attn, device_map=DEVICE_MAP, offload_folder=tmp_path / "offload")
    return plain, split


def _state(model) -> dict[str, torch.Tensor]:
    """Every weight, the offloaded ones loaded from disk."""
    return {k: v.clone() for k, v in get_state_dict_offloaded_model(model.hf).items()}


def _accelerate_forwards(model) -> list[str]:
    """The modules on which accelerate's hooks replaced ``forward`` (a study must not remove them)."""
    return [name for name, m in model.hf.named_modules() if hasattr(m, "_hf_hook") and "forward" in m.__dict__]


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_an_offloaded_model_computes_what_the_plain_model_computes(folder, tmp_path, attn):
    plain, split = _pair(folder, tmp_path, attn)
    assert distributed.offloaded(split.hf) and not distributed.offloaded(plain.hf)
    assert split.hf.hf_device_map["model.layers.1"] == "disk" and split.device == torch.device("cpu")
    ids, mask = padded_batch(True)
    with torch.no_grad():
        assert (split(ids, mask).logits - plain(ids, mask).logits).abs().max() <= TOL
        names = plain.default_cache_names() + ["blocks.1.attn.hook_result"]
        _, got = split.run_with_cache(ids, mask, names=names)
        _, expected = plain.run_with_cache(ids, mask, names=names)
        assert list(got) == list(expected) and len(got) > 20
        for name in expected:
            assert got[name].device.type == "cpu" and (got[name] - expected[name]).abs().max() <= TOL, name
        assert (got.pattern(1) - expected.pattern(1)).abs().max() <= TOL  # rebuilt (flash) or captured (eager)

        seen = []

        def edit(z, hook):  # fires inside the offloaded layer with real tensors, and its edit reaches the output
            seen.append(z.device.type)
            return z * torch.tensor([1.0, 0.0, 1.0, 0.5])[None, None, :, None]

        hooks = [("blocks.1.attn.hook_z", edit)]
        assert (split.run_with_hooks(ids, mask, fwd_hooks=hooks).logits
                - plain.run_with_hooks(ids, mask, fwd_hooks=hooks).logits).abs().max() <= TOL
        assert seen == ["cpu", "cpu"]
        _, moved = split.run_with_cache(ids, mask, names=["blocks.1.attn.hook_z"], device="meta")  # gathered
        assert moved["z", 1].device.type == "meta" and moved.meta.attention_mask.device.type == "meta"
    assert not split._registry.active() and no_torch_hooks(split.hf)


def _studies(model):
    ids = torch.randint(1, 99, (4, 10), generator=torch.Generator().manual_seed(0))
    clean, corrupted, metric = induction_task(model, n=4, length=6, seed=0)
    return {
        "heads": lambda: detect_heads(model, n_prompts=8, seq_len=16, n_bootstrap=20),
        "ablation": lambda: ablation_scan(model, ids, lm_loss, heads_per_forward=1),  # replays layer 0
        "importance": lambda: head_importance(model, ids, loss=lm_loss),
        "pruning": lambda: pruning_curve(model, ids, lm_loss, step=0.5),
        "patching": lambda: activation_patching(model, clean, corrupted, metric),
        "attribution": lambda: attribution_patching(model, clean, corrupted, metric),
        "path": lambda: path_patching(model, clean, corrupted, receivers=[(1, 0)], metric=metric),
        "dla": lambda: direct_logit_attribution(model, ids, answer=5, wrong=7),  # reads the offloaded unembedding
        "lens": lambda: logit_lens(model, ids),
        "composition": lambda: composition_scores(model, "k"),  # reads the offloaded layer's weights
    }


@pytest.mark.parametrize("attn", ["eager", "flash"])
def test_studies_on_an_offloaded_model_equal_the_plain_model_and_leave_it_as_it_was(folder, tmp_path, attn):
    plain, split = _pair(folder, tmp_path, attn)
    weights, forwards = _state(split), _accelerate_forwards(split)
    assert len(forwards) > 10
    expected, got = _studies(plain), _studies(split)
    for name in expected:
        a, b = expected[name](), got[name]()
        numbers = a.select_dtypes("number").columns
        assert list(a.columns) == list(b.columns) and len(a) == len(b), name
        assert (a[numbers] - b[numbers]).abs().max().max() <= TOL, name
    after = _state(split)
    assert after.keys() == weights.keys() and all(torch.equal(after[k], weights[k]) for k in weights)
    assert _accelerate_forwards(split) == forwards  # the replay of early blocks put accelerate's forwards back
    assert all(p.requires_grad for p in split.hf.parameters())  # head_importance turned them off for its backward
    assert not split._registry.active() and no_torch_hooks(split.hf)


def test_a_study_that_raises_leaves_an_offloaded_model_as_it_was(folder, tmp_path):
    _, split = _pair(folder, tmp_path, "flash")
    weights, forwards = _state(split), _accelerate_forwards(split)

    class Breaks(Metric):  # fails on the third forward, while early blocks are replayed
        calls = 0

        def per_example(self, output, inputs):
            Breaks.calls += 1
            if Breaks.calls == 3:
                raise RuntimeError("metric broke")
            return lm_loss.per_example(output, inputs)

    ids = torch.randint(1, 99, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="metric broke"):
        ablation_scan(split, ids, Breaks(), heads_per_forward=1)
    Breaks.calls = 0
    with pytest.raises(RuntimeError, match="metric broke"):
        pruning_curve(split, ids, Breaks(), step=0.5)
    after = _state(split)
    assert all(torch.equal(after[k], weights[k]) for k in weights)
    assert _accelerate_forwards(split) == forwards and all(p.requires_grad for p in split.hf.parameters())
    assert not split._registry.active() and no_torch_hooks(split.hf)


def test_prune_model_refuses_a_dispatched_model_with_a_reason(folder, tmp_path):
    _, split = _pair(folder, tmp_path, "flash")
    with pytest.raises(NotImplementedError, match="device map.*offloaded to disk"):
        prune_model(split, [(1, 0)])


def test_auto_device_map_and_instances(folder, tmp_path):
    """device_map="auto" with max_memory smaller than the model offloads the rest to disk (folder and instance);
    an instance takes a dict too, and a pruned model's folder loads with a device map."""
    plain = interp.load_model(folder)
    size = sum(p.numel() * p.element_size() for p in plain.hf.parameters())
    ids, mask = padded_batch(True)
    instance = tiny_model("llama")
    models = [interp.load_model(folder, device_map="auto", max_memory={"cpu": size // 2},
                                offload_folder=tmp_path / "a"),
              interp.load_model(copy.deepcopy(instance), device_map="auto", max_memory={"cpu": size // 2},
                                offload_folder=tmp_path / "b"),
              interp.load_model(copy.deepcopy(instance), device_map=DEVICE_MAP, offload_folder=tmp_path / "c")]
    with torch.no_grad():
        for model in models:
            assert "disk" in model.hf.hf_device_map.values() and distributed.offloaded(model.hf)
            assert (model(ids, mask).logits - plain(ids, mask).logits).abs().max() <= TOL
        pruned = prune_model(plain, [(0, 1), (1, 2), (1, 3)])
        pruned.save_pretrained(tmp_path / "pruned")
        again = interp.load_model(tmp_path / "pruned", device_map=DEVICE_MAP, offload_folder=tmp_path / "d")
        assert again.cfg.heads_per_layer == pruned.cfg.heads_per_layer and distributed.offloaded(again.hf)
        assert (again(ids, mask).logits - pruned(ids, mask).logits).abs().max() <= TOL


def test_minilm_split_by_max_memory_scores_its_heads_as_before(minilm, tmp_path):
    size = sum(p.numel() * p.element_size() for p in minilm.hf.parameters())
    split = interp.load_model("minilm", device_map="auto", max_memory={"cpu": size // 2}, offload_folder=tmp_path)
    assert "disk" in split.hf.hf_device_map.values()
    tokens = split.to_batch(["The cat sat on the mat.", "Heads can be read and edited."])
    with torch.no_grad():
        assert (split(tokens).last_hidden_state - minilm(tokens).last_hidden_state).abs().max() <= TOL
    kwargs = dict(n_prompts=6, seq_len=24, n_bootstrap=20)
    a, b = detect_heads(split, **kwargs), detect_heads(minilm, **kwargs)
    numbers = a.select_dtypes("number").columns
    assert (a[numbers] - b[numbers]).abs().max().max() <= TOL and (a["labels"] == b["labels"]).all()


def test_placement_arguments_are_checked(folder):
    with pytest.raises(ValueError, match="device or device_map, not both"):
        interp.load_model(folder, device="cpu", device_map="auto")
    with pytest.raises(ValueError, match="go with device_map"):
        interp.load_model(folder, offload_folder="somewhere")
    with pytest.raises(ValueError, match="offload_folder"):
        interp.load_model(tiny_model("llama"), device_map=DEVICE_MAP)


@pytest.mark.gpu
def test_a_model_split_between_gpu_and_cpu_offload(folder, tmp_path):
    """On CUDA: layer 0 on the GPU, layer 1 offloaded to CPU memory (accelerate's CPU offload), the unembedding on
    disk; inputs go to the embedding's GPU, outputs come back there, studies equal the plain model's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    plain = interp.load_model(folder, device="cuda")
    split = interp.load_model(folder, device_map={**DEVICE_MAP, "model.embed_tokens": 0, "model.rotary_emb": 0,
                                                  "model.layers.0": 0, "model.layers.1": "cpu"},
                              offload_folder=tmp_path)
    assert split.device.type == "cuda"
    ids, mask = padded_batch(True)
    with torch.no_grad():
        assert (split(ids, mask).logits - plain(ids, mask).logits).abs().max() <= 1e-5
    for name, study in _studies(plain).items():
        a, b = study(), _studies(split)[name]()
        numbers = a.select_dtypes("number").columns
        assert (a[numbers] - b[numbers]).abs().max().max() <= 1e-5, name
