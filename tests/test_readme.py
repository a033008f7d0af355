"""The README as a new user reads it: literally, top to bottom, on a fresh clone."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batchgen.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def code_commands(text: str) -> list[list[str]]:
    """The `batchgen ...` commands of the bash blocks in `text`, continuation lines joined."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].split("|")[0].strip()
            words = shlex.split(line) if line else []
            if words[:1] == ["python"] and words[1:3] == ["-m", "batchgen"]:
                words = ["batchgen", *words[3:]]
            if words[:1] == ["batchgen"]:
                commands.append(words)
    return commands


def test_setup_says_how_to_reach_batchgen():
    setup = section("Set up")
    assert "source .venv/bin/activate" in setup and ".venv/bin/batchgen" in setup
    # the activation comes before the first `batchgen` command a reader meets
    assert setup.index("source .venv/bin/activate") < README.index("batchgen run")


def test_setup_installs_from_the_repository():
    """`pip install batchgen` from the public index is another, unrelated package."""
    setup = section("Set up")
    assert "make install" in setup and "pip install -e ." in setup
    assert not re.search(r"^\s*pip install batchgen\b", README, flags=re.M)
    assert "`pip install batchgen`" not in README.replace("Do not `pip install batchgen`", "")


def test_five_minutes_comes_early_and_covers_a_job():
    job = section("Your own job in five minutes")
    assert README.index("## Your own job in five minutes") < README.index("## Main options")
    for needed in ("--id-column", "_SUCCESS", "join", "same command", "batchgen plan"):
        assert needed in job, needed


def test_first_usage_example_reads_a_file_that_exists_into_its_own_directory():
    first = code_commands(section("Your own job in five minutes"))[0]
    assert first[:2] == ["batchgen", "run"]
    inputs = [first[i + 1] for i, w in enumerate(first) if w in ("--input", "-i")]
    assert inputs and all((ROOT / p).is_file() for p in inputs), inputs
    output = first[first.index("--output") + 1]
    assert output.rstrip("/") not in ("out", "out/demo"), "make demo writes out/demo: a job needs its own directory"
    assert "--keep-columns" in first, "the first example shows how not to copy every document again"


@pytest.mark.parametrize("command", ["run", "plan", "status", "compact", "finalize", "bench"])
def test_every_flag_in_the_readme_exists(command):
    help_text = CliRunner().invoke(app, [command, "--help"]).output
    known = set(re.findall(r"(--[a-z][a-z0-9-]*|-[a-z]\b)", help_text))
    for words in code_commands(README):
        if words[1:2] != [command]:
            continue
        flags = {w.split("=")[0] for w in words[2:] if w.startswith("-")}
        assert flags <= known, (words, sorted(flags - known))
