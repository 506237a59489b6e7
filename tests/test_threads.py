"""interp.set_threads and the "auto" choice that load_model makes once, unless the user chose a count."""

from __future__ import annotations

import pytest
import torch

import interp
from interp.runtime import threads


@pytest.fixture
def fresh(monkeypatch):
    """Thread state as in a new process on 4 CPUs with a load average of 1, restored afterwards."""
    before, state = torch.get_num_threads(), dict(threads._state)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "_cpus", lambda: 4)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.2, 0.0, 0.0))
    threads._state.update(ours=None, explicit=False)
    torch.set_num_threads(4)  # torch's own default on such a machine
    yield
    torch.set_num_threads(before)
    threads._state.clear()
    threads._state.update(state)


def test_load_model_takes_the_idle_cores_once(fresh):
    interp.load_model("toy-induction")
    assert torch.get_num_threads() == 3  # 4 CPUs minus a load of 1
    torch.set_num_threads(2)  # the user's choice after the first load: later loads leave it
    interp.load_model("toy-induction")
    assert torch.get_num_threads() == 2


def test_a_count_the_user_set_is_left_alone(fresh, monkeypatch):
    torch.set_num_threads(1)  # before interp decided anything: not torch's default, so the user's
    interp.load_model("toy-induction")
    assert torch.get_num_threads() == 1
    torch.set_num_threads(4)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    interp.load_model("toy-induction")
    assert torch.get_num_threads() == 4


def test_set_threads_is_the_users_choice(fresh):
    assert interp.set_threads(2) == 2 and torch.get_num_threads() == 2
    interp.load_model("toy-induction")
    assert torch.get_num_threads() == 2
    assert interp.set_threads("auto") == 3


@pytest.mark.parametrize("bad", [0, -1, "two", 1.5, True, None])
def test_set_threads_refuses_what_is_not_a_count(fresh, bad):
    with pytest.raises(ValueError, match="positive integer or 'auto'"):
        interp.set_threads(bad)
