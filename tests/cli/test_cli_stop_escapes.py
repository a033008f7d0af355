"""`--stop "\\n"` means a newline, as vLLM's stop=["\\n"] does; malformed escapes exit 2."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import batchgen.jobs.commands.run as job_run
from batchgen.cli import app
from batchgen.cli.escapes import unescape
from batchgen.errors import ConfigError


@pytest.mark.parametrize(("typed", "meant"), [
    ("\\n", "\n"), ("\\t", "\t"), ("a\\\\nb", "a\\nb"), ("\\u00e9", "é"), ("\\U0001F600", "😀"),
    ("\\ud83d\\ude00", "😀"), ("\\x41", "A"), ('\\"', '"'), ("\\d+", "\\d+"), ("plain", "plain"), ("é", "é"),
])
def test_unescape(typed, meant):
    assert unescape(typed, "--stop") == meant


@pytest.mark.parametrize("typed", ["\\u12", "\\x4", "\\ud83d", "\\U00110000"])
def test_malformed_escape(typed):
    with pytest.raises(ConfigError, match="--stop"):
        unescape(typed, "--stop")


def test_cli_stop_and_template_reach_the_config_decoded(tmp_path, monkeypatch):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["x"]}), src)
    seen = {}

    def fake_run_job(config):
        seen["config"] = config
        raise ConfigError("stopped here")

    monkeypatch.setattr(job_run, "run_job", fake_run_job)
    result = CliRunner().invoke(app, ["run", "-i", str(src), "-o", str(tmp_path / "out"), "--stop", "\\n",
                                      "--stop", "\\u00e9", "--template", "Q:\\t{text}\\n"])
    assert result.exit_code == 2, result.output
    assert seen["config"].stop == ["\n", "é"]
    assert seen["config"].template == "Q:\t{text}\n"


def test_cli_malformed_stop_escape_is_one_error_line(tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["x"]}), src)
    result = CliRunner().invoke(app, ["run", "-i", str(src), "-o", str(tmp_path / "out"), "--stop", "\\u12"])
    assert result.exit_code == 2 and result.exception is None or isinstance(result.exception, SystemExit)
    assert "error: --stop: \\u needs 4 hex digits" in result.output
