"""The OpenMP wait-policy default the CLI sets before torch loads."""

from __future__ import annotations

import subprocess
import sys

from batchgen import omp


def test_sets_passive_unless_the_user_chose(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as the CLI starts: torch not loaded yet
    env: dict[str, str] = {}
    assert omp.apply_defaults(env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for user in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}, {"BATCHGEN_OMP_DEFAULTS": "0"}):
        env = dict(user)
        assert omp.apply_defaults(env) == {}
        assert env == user


def test_too_late_once_torch_is_loaded():
    import torch  # noqa: F401

    env: dict[str, str] = {}
    assert omp.apply_defaults(env) == {} and env == {}


def test_the_command_imports_no_torch_before_main_sets_it():
    code = "import sys, batchgen.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
