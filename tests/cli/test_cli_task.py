"""`--task` and its flags on `run` and `plan`: parsed into the config, and a generation flag given with
another task refused with exit 2 and one line naming it, before any input is read or model loaded."""

from __future__ import annotations

from typer.testing import CliRunner

from batchgen.cli.app import app


def test_the_cli_refuses_before_any_load(tmp_path):
    """Exit 2 and one line naming the flag; the input does not even exist, so nothing was read or loaded."""
    result = CliRunner().invoke(app, ["run", "--input", str(tmp_path / "missing.parquet"), "--output",
                                      str(tmp_path / "out"), "--task", "embed", "--temperature", "0.5"])
    assert result.exit_code == 2, result.output
    assert "--temperature" in result.output and "--task embed" in result.output
    assert not (tmp_path / "out").exists()


def test_the_task_flags_reach_the_config_through_run_and_plan(tmp_path):
    """--task/--pooling/--no-normalize/--dimensions parse on both commands: a bad --dimensions is the
    config's refusal (exit 2 naming it), not a click usage error."""
    for command in ("run", "plan"):
        result = CliRunner().invoke(app, [command, "--input", str(tmp_path / "in.parquet"), "--output",
                                          str(tmp_path / "out"), "--task", "embed", "--pooling", "last",
                                          "--no-normalize", "--dimensions", "0"])
        assert result.exit_code == 2, result.output
        assert "--dimensions" in result.output and "integer >= 1" in result.output
