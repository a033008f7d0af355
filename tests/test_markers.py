"""The `soak` marker picks the kill, signal, fault and S3-server tests out of a file, and `make test` (what
CI runs) leaves none of them out: it passes no -m."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _collected(*args: str) -> set[str]:
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    return {line.split("::")[-1] for line in result.stdout.splitlines() if "::" in line}


def test_soak_selects_the_sigterm_test_and_not_its_neighbours():
    path = "tests/jobs/durability/test_signals.py"
    soaks, others = _collected("-m", "soak", path), _collected("-m", "not soak", path)
    assert soaks == {"test_sigterm_to_a_running_process"}
    assert others and not soaks & others


def test_make_test_runs_every_marker():
    recipe = re.search(r"^test: .*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert recipe.strip() == "$(PY) -m pytest -q"
    assert "make test" in (ROOT / ".ci" / "run").read_text()
