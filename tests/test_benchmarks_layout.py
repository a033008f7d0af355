"""benchmarks/ sorted by kind: the top level holds only what every kind shares, each script has its row
in benchmarks/README.md under its own folder, and every benchmark the repository names exists, so a
command copied from a page, a docstring or the Makefile runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
SHARED = {"__init__.py", "common.py", "sharegpt.py", "sysload.py"}
KINDS = sorted(p.parent for p in BENCHMARKS.glob("*/__init__.py"))
# the dated records keep the commands of their day; everything else must name what exists
NAMING = [ROOT / "README.md", ROOT / "Makefile", ROOT / ".ci" / "run", BENCHMARKS / "README.md",
          *(ROOT / "docs").glob("*.md"), *(ROOT / "batchgen").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
          *BENCHMARKS.rglob("*.py"), *BENCHMARKS.rglob("*.sh")]
MODULE = re.compile(r"python -m (benchmarks(?:\.[a-z0-9_]+)+)\b")  # KIND.NAME: a placeholder
PATH = re.compile(r"\bbenchmarks/((?:\w+/)*\w+\.(?:py|sh))\b")


def test_the_top_level_holds_only_the_shared_modules():
    loose = {p.name for p in BENCHMARKS.iterdir() if p.is_file() and p.suffix in (".py", ".sh")} - SHARED
    assert not loose, f"benchmarks/ scripts outside a kind's folder: {sorted(loose)}"
    assert {k.name for k in KINDS} >= {"end_to_end", "peers", "kernels", "soaks", "tools", "gpu"}


def test_every_script_has_its_row_under_its_folder():
    readme = (BENCHMARKS / "README.md").read_text(encoding="utf-8")
    sections = dict(re.findall(r"^### (\w+)/\n(.*?)(?=^##|\Z)", readme, flags=re.M | re.S))
    for kind in KINDS:
        # the vllm_* scripts run inside vLLM's own venv, started by the peer benchmarks that list them
        scripts = [p for p in kind.glob("*.py") if p.name != "__init__.py" and not p.name.startswith("vllm_")]
        for script in scripts:
            assert f"`{kind.name}/{script.name}`" in sections.get(kind.name, ""), (kind.name, script.name)


def test_every_named_benchmark_exists():
    missing = []
    for page in NAMING:
        text = page.read_text(encoding="utf-8")
        missing += [(str(page.relative_to(ROOT)), module) for module in MODULE.findall(text)
                    if not (ROOT / module.replace(".", "/")).with_suffix(".py").is_file()]
        missing += [(str(page.relative_to(ROOT)), f"benchmarks/{path}") for path in PATH.findall(text)
                    if not (BENCHMARKS / path).is_file()]
    assert not missing
