"""The OpenMP wait policy the CLI chooses before torch loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from batchgen.runtime import omp


@pytest.fixture
def no_torch(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as the CLI starts: torch not loaded yet
    monkeypatch.setattr(omp, "choice_reason", None)


def _apply(env, other_cores, cgroup_cores=None):
    return omp.apply_defaults(env, measure=lambda: other_cores, cgroup=lambda: cgroup_cores)


def test_spin_on_a_quiet_machine_passive_beside_busy_processes(no_torch, monkeypatch):
    monkeypatch.setattr(omp.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    env: dict[str, str] = {}
    assert _apply(env, other_cores=0.1) == {} and env == {}  # libgomp's spin-wait stays
    assert omp.choice_reason.startswith("spin-wait")
    assert _apply(env, other_cores=0.7) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"} and "0.7 cores busy" in omp.choice_reason


def test_a_cgroup_cpu_limit_below_the_cores_means_passive(no_torch, monkeypatch):
    monkeypatch.setattr(omp.os, "sched_getaffinity", lambda pid: set(range(8)))
    env: dict[str, str] = {}
    assert _apply(env, other_cores=0.0, cgroup_cores=2.0) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert "cgroup allows 2 of 8" in omp.choice_reason
    env = {}
    assert _apply(env, other_cores=0.0, cgroup_cores=8.0) == {}  # a limit of every core: no quota to burn


def test_unreadable_load_means_passive(no_torch, monkeypatch):
    monkeypatch.setattr(omp.os, "sched_getaffinity", lambda pid: {0, 1})
    env: dict[str, str] = {}
    assert _apply(env, other_cores=None) == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_one_thread_is_not_measured(no_torch, monkeypatch):
    monkeypatch.setattr(omp.os, "sched_getaffinity", lambda pid: {0, 1})

    def measure():
        raise AssertionError("one thread has no barrier: the machine is not sampled")

    for env in ({"OMP_NUM_THREADS": "1"},):
        assert omp.apply_defaults(env, measure=measure, cgroup=lambda: None) == {}
    monkeypatch.setattr(omp.os, "sched_getaffinity", lambda pid: {0})
    assert omp.apply_defaults({}, measure=measure, cgroup=lambda: None) == {}


def test_commands_that_generate_nothing_are_not_sampled(no_torch, monkeypatch):
    monkeypatch.setattr(omp.os, "sched_getaffinity", lambda pid: {0, 1})

    def measure():
        raise AssertionError("status or --help does not pay for the look at the machine")

    env: dict[str, str] = {}
    assert omp.apply_defaults(env, sample=False, measure=measure, cgroup=lambda: None) == omp.PASSIVE


def test_the_users_choice_wins(no_torch):
    def measure():
        raise AssertionError("not sampled when the user chose")

    for user in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}, {"BATCHGEN_OMP_DEFAULTS": "0"}):
        env = dict(user)
        assert omp.apply_defaults(env, measure=measure, cgroup=lambda: None) == {}
        assert env == user


def test_too_late_once_torch_is_loaded():
    import torch  # noqa: F401

    env: dict[str, str] = {}
    assert omp.apply_defaults(env, measure=lambda: 5.0, cgroup=lambda: None) == {} and env == {}


def test_the_command_imports_no_torch_before_main_sets_it():
    code = "import sys, batchgen.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_threads_spin_unless_passive():
    assert omp.threads_spin({})
    assert omp.threads_spin({"OMP_WAIT_POLICY": "active"})
    assert not omp.threads_spin({"OMP_WAIT_POLICY": "passive"})
    assert not omp.threads_spin({"GOMP_SPINCOUNT": "0"})
