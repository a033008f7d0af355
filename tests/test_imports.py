"""The dependency direction stays as the architecture says: engine knows nothing of files or jobs,
io nothing of models or jobs, monitor nothing of jobs, and the scheduler, block manager and sequence
run without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "batchgen"
FORBIDDEN = {  # package -> packages none of its modules may import (at module level or inside a function)
    "engine": ("batchgen.io", "batchgen.jobs"),
    "io": ("batchgen.engine", "batchgen.jobs"),
    "monitor": ("batchgen.jobs",),  # jobs feeds the monitor; status and report read its files without a job
}
TORCH_FREE = ("batchgen.engine.scheduler.scheduler", "batchgen.engine.kv.block_manager", "batchgen.engine.scheduler.sequence")
# what a command imports before its checks pass: a user's mistake must not wait seconds for torch
CHECKS_TORCH_FREE = ("batchgen.cli", "batchgen.config.job", "batchgen.jobs.commands.run", "batchgen.jobs.commands.plan",
                     "batchgen.jobs.commands.status")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports(package):
    bad = []
    for path in sorted((PACKAGE / package).rglob("*.py")):
        for name in sorted(imported_modules(path)):
            if name.startswith(FORBIDDEN[package]):
                bad.append(f"{path.relative_to(PACKAGE.parent)} imports {name}")
    assert not bad, bad


def test_scheduler_block_manager_and_sequence_import_no_torch():
    code = f"import sys; import {', '.join(TORCH_FREE)}; print(sorted(m for m in sys.modules if m == 'torch'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_the_cli_and_the_job_checks_import_neither_torch_nor_transformers():
    code = (f"import sys; import {', '.join(CHECKS_TORCH_FREE)}; "
            "print(sorted(m for m in sys.modules if m in ('torch', 'transformers', 'tqdm')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_the_checks_see_a_violation(tmp_path):
    """The AST walk finds imports inside functions too."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from batchgen.jobs.commands.run import run_job\n")
    assert "batchgen.jobs.commands.run" in imported_modules(path)
