"""interp.set_threads and the "auto" choice that load_model makes once, unless the user chose a count."""

from __future__ import annotations

import pytest
import torch

import interp
from interp.runtime import threads


def _fake_proc_stat(busy: list[float]):
    """A /proc/stat reader whose second sample shows CPU i busy for the fraction busy[i] of 100 ticks."""
    samples = iter([{i: (1000, 5000) for i in range(len(busy))},
                    {i: (1000 + round(100 * (1 - b)), 5100) for i, b in enumerate(busy)}])
    return lambda: next(samples)


@pytest.fixture
def fresh(monkeypatch):
    """Thread state as in a new process on 4 CPUs, one of them busy now, restored afterwards."""
    before, state = torch.get_num_threads(), dict(threads._state)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "_cpus", lambda: 4)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (1.2, 0.0, 0.0))
    monkeypatch.setattr(threads, "_cpu_times", _fake_proc_stat([1.0, 0.0, 0.1, 0.0]))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
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


def test_auto_decides_on_what_is_busy_now_not_the_load_average(fresh, monkeypatch):
    # the user's previous run still counts in the 1-minute load average (3.9 of 4), but every core is idle now
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (3.9, 3.0, 2.0))
    monkeypatch.setattr(threads, "_cpu_times", _fake_proc_stat([0.0, 0.05, 0.0, 0.0]))
    assert threads.auto_threads() == 4
    # and the other way round: an idle minute behind, three cores busy now
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(threads, "_cpu_times", _fake_proc_stat([1.0, 1.0, 0.9, 0.0]))
    assert threads.auto_threads() == 1


def test_auto_counts_only_the_cpus_this_process_may_use(fresh, monkeypatch):
    monkeypatch.setattr(threads, "_cpus", lambda: 2)
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {2, 3}, raising=False)
    monkeypatch.setattr(threads, "_cpu_times", _fake_proc_stat([1.0, 1.0, 0.0, 0.0]))  # busy: CPUs 0, 1
    assert threads.auto_threads() == 2


def test_auto_falls_back_to_the_load_average_without_proc_stat(fresh, monkeypatch):
    monkeypatch.setattr(threads, "_cpu_times", lambda: None)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (2.2, 0.0, 0.0))
    assert threads.auto_threads() == 2


def test_the_real_proc_stat_reads_as_a_count_of_busy_cpus():
    busy = threads._busy_now(0.05)
    if busy is not None:  # Linux
        assert 0.0 <= busy <= threads._cpus() + 1e-9
