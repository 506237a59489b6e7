"""Progress for studies that take more than a few seconds (issue 27 item 5): shown where someone watches, quiet
when asked, never in a pipe by default."""

from __future__ import annotations

import pytest
import torch

import interp
from analyses import ablation_scan, detect_heads, pruning_curve, second_copy_loss
from interp.runtime import progress as progress_module


@pytest.fixture
def toy():
    return interp.load_model("toy-induction")


@pytest.fixture
def restore():
    before = dict(progress_module._state)
    yield
    progress_module._state.clear()
    progress_module._state.update(before)


def _tokens():
    x = torch.randint(1, 64, (4, 10), generator=torch.Generator().manual_seed(0))
    return torch.cat([torch.zeros(4, 1, dtype=torch.long), x, x], 1)


def test_studies_show_progress_when_asked_and_are_quiet_otherwise(toy, restore, capsys):
    interp.set_progress(True)
    detect_heads(toy, n_prompts=8, n_bootstrap=10)
    ablation_scan(toy, _tokens(), second_copy_loss)
    pruning_curve(toy, _tokens(), second_copy_loss, order="random", step=0.5, seeds=(0,))
    err = capsys.readouterr().err
    assert "heads: 8 prompts" in err and "8 heads" in err and "forward" in err and "pruning curve (random)" in err
    interp.set_progress(False)
    detect_heads(toy, n_prompts=8, n_bootstrap=10)
    ablation_scan(toy, _tokens(), second_copy_loss)
    assert capsys.readouterr().err == ""


def test_by_default_progress_follows_where_stderr_goes(restore, monkeypatch):
    interp.set_progress(None)
    monkeypatch.delenv("INTERP_PROGRESS", raising=False)
    assert not progress_module.progress_enabled()  # pytest captures stderr: not a terminal
    monkeypatch.setenv("INTERP_PROGRESS", "1")
    assert progress_module.progress_enabled()
    monkeypatch.setenv("INTERP_PROGRESS", "0")
    assert not progress_module.progress_enabled()
    with pytest.raises(ValueError, match="True, False, 'lines' or None"):
        interp.set_progress("yes")
