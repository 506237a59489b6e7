"""Our TransformerLens surface against TransformerLens 4.3 itself, on the same tiny GPT-2 and tiny Llama weights
(issue 37). TransformerLens is installed into an inner virtualenv that sees this interpreter's torch and
transformers (``test_transformers_compat.inner_venv``), so the project's own packages are never touched. Slow:
pip and a second interpreter. Skipped, with the reason, where pip cannot install it (no index reachable)."""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest
import torch

import interp
from interp.model.bundled import bundled_folder
from tests.conftest import tiny_hf
from tests.test_transformers_compat import inner_venv

NAMES = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_U", "b_U", "W_E")

TL_SIDE = textwrap.dedent('''
    import sys
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformer_lens.model_bridge import TransformerBridge

    folder, tokenizer, ids, out, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5].split(",")
    model = TransformerBridge.boot_transformers(folder, hf_model=AutoModelForCausalLM.from_pretrained(folder),
                                                tokenizer=AutoTokenizer.from_pretrained(tokenizer), device="cpu")
    model.enable_compatibility_mode(disable_warnings=True, fold_ln=True, center_writing_weights=False,
                                    center_unembed=False, fold_value_biases=False)
    logits, cache = model.run_with_cache(torch.load(ids))
    values = {k: getattr(model, k).detach().clone() for k in names}
    values["logits"], values["OV"], values["QK"] = logits, model.OV.AB, model.QK.AB
    values["accumulated"] = cache.accumulated_resid(incl_mid=True)
    values["accumulated_ln"] = cache.accumulated_resid(apply_ln=True, pos_slice=-1)
    values["decomposed"] = cache.decompose_resid()
    values["decomposed_ln"] = cache.decompose_resid(apply_ln=True, pos_slice=-1)
    values["heads_ln"] = cache.stack_head_results(pos_slice=-1, apply_ln=True)
    torch.save(values, out)
''')


def _ours(model, ids, names) -> dict:
    logits, cache = model.run_with_cache(ids, return_type="logits")
    values = {k: getattr(model, k) for k in (*names, "_W_K", "_W_V")}
    values.update(logits=logits, OV=model.OV.AB, QK=model.QK.AB, accumulated=cache.accumulated_resid(incl_mid=True),
                  accumulated_ln=cache.accumulated_resid(apply_ln=True, pos_slice=-1),
                  decomposed=cache.decompose_resid(), decomposed_ln=cache.decompose_resid(apply_ln=True, pos_slice=-1),
                  heads_ln=cache.stack_head_results(pos_slice=-1, apply_ln=True))
    return values


def _perturbed(family: str):
    """A tiny model whose norms and biases are not their identity initialisation, so that folding them matters."""
    hf = tiny_hf(family)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "ln" in name or "norm" in name or name.endswith("bias"):
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return hf


@pytest.fixture(scope="module")
def tl_python(tmp_path_factory):
    python = inner_venv(tmp_path_factory.mktemp("tl") / "venv")
    pip = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          "transformer-lens==4.3.0"], capture_output=True, text=True)
    if pip.returncode != 0:
        pytest.skip(f"pip could not install transformer-lens 4.3.0 here: {pip.stderr.strip()[-300:]}")
    return python


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_weights_and_decompositions_equal_transformerlens(family, tl_python, tmp_path):
    folder = tmp_path / family
    _perturbed(family).save_pretrained(folder)
    ids_file = tmp_path / "ids.pt"
    ids = torch.randint(1, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.save(ids, ids_file)
    # TransformerLens 4.3 refuses b_* of a bias-free model (Llama) where interp gives zeros, as TransformerLens 3 did
    names = NAMES + ("W_pos",) if family == "gpt2" else tuple(n for n in NAMES if not n.startswith("b_"))
    script = tmp_path / "tl_side.py"
    script.write_text(TL_SIDE)
    done = subprocess.run([tl_python, str(script), str(folder), str(bundled_folder("smollm2")), str(ids_file),
                           str(tmp_path / "tl.pt"), ",".join(names)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "tl.pt")
    ours = _ours(interp.load_model(folder, attn="eager"), ids, names)
    if family == "llama":  # grouped-query attention: TransformerLens 4.3's W_K/W_V are per key/value head, as our
        ours["W_K"], ours["W_V"] = ours.pop("_W_K"), ours.pop("_W_V")  # _W_K/_W_V (our W_K/W_V repeat them, as 3.x's)
    for key, value in theirs.items():
        assert ours[key].shape == value.shape, (key, ours[key].shape, value.shape)
        torch.testing.assert_close(ours[key], value, atol=2e-5, rtol=2e-5, msg=key)
