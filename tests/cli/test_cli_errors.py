"""Every mistake a user makes on the command line reads the same: one `error:` line, exit 2, and
the name a typo most likely meant (flags, commands, columns, template placeholders)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app


@pytest.fixture
def docs(tmp_path):
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"doc_id": ["a", "b"], "text": ["first text", "second text"], "title": ["A", "B"]}),
                   path)
    return path


def error_line(*args) -> str:
    """The one line `batchgen ARGS` printed on stderr, having exited 2."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize(("flags", "line"), [
    (["--temperature", "hot"], "error: --temperature must be a number; got 'hot'"),
    (["--temperature=hot"], "error: --temperature must be a number; got 'hot'"),
    (["--max-rows", "many"], "error: --max-rows must be a whole number; got 'many'"),
    (["--temprature", "1"], "error: no such option --temprature; did you mean --temperature?"),
])
def test_a_flags_type_or_name_is_one_error_line(docs, tmp_path, flags, line):
    assert error_line("run", "-i", docs, "-o", tmp_path / "out", *flags) == line


def test_a_missing_option_and_an_unknown_command_are_one_line_too(tmp_path):
    assert error_line("status") == "error: --output is required"
    assert error_line("rnu") == "error: no such command 'rnu'; did you mean 'run'?"


@pytest.mark.parametrize(("flags", "end"), [
    (["--id-column", "docid"], "; pass --id-column doc_id"),
    (["--keep-columns", "titel"], "; pass --keep-columns title"),
    (["--template", "Summarize {txt}"], "; did you mean {text}?"),
])
def test_a_typo_in_a_column_name_is_answered_with_the_likely_one(docs, tmp_path, flags, end):
    line = error_line("run", "-i", docs, "-o", tmp_path / "out", *flags)
    assert line.endswith(end), line
    assert not (tmp_path / "out").exists()
