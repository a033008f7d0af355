"""`batchgen plan`: the dry run's JSON shape and text, through the Typer app on the tiny random Llama.

The tokenizer is byte-level (one token per UTF-8 byte), so prompt token counts are byte counts.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.jobs.planning import profile
from batchgen.jobs.planning.length import LENGTH_MODEL_FILE

WINDOW_KEYS = {"mode", "reason", "num_rows", "predicted_output_tokens", "estimated_seconds"}


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Two files: 7 rows whose budgets are alike, 3 rows whose budgets are not (one a null prompt)."""
    tmp = tmp_path_factory.mktemp("plan-inputs")
    pq.write_table(pa.table({"text": [f"row {i} " + "x" * i for i in range(7)], "n": [5] * 7}), tmp / "a.parquet")
    pq.write_table(pa.table({"text": ["short", None, "a longer prompt " * 3], "n": [1, 1, 20]}), tmp / "b.parquet")
    return tmp


@pytest.fixture(autouse=True)
def profiles(tmp_path, monkeypatch):
    """A calibrating plan stores its machine profile here, not in the user's cache."""
    monkeypatch.setattr(profile, "profiles_dir", lambda: tmp_path / "profiles")


def plan(runner, model_dir, inputs, *args):
    argv = ["plan", "--input", str(inputs / "a.parquet"), "--input", str(inputs / "b.parquet"),
            "--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--no-chat",
            "--kv-cache-memory", "16MiB", "--batch-size", "4", "--calibration-rows", "4", *map(str, args)]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return result


def test_plan_json_shape(runner, tiny_model_dir, inputs, tmp_path):
    out = tmp_path / "never-created"
    result = plan(runner, tiny_model_dir, inputs, "--json", "--ignore-eos", "--max-new-tokens-column", "n",
                  "--window-rows", "4", "--output", out)
    report = json.loads(result.stdout)
    assert not out.exists()  # a dry run writes nothing
    windows = report["windows"]
    assert [(s["path"].rsplit("/", 1)[1], s["first_row"], s["num_rows"]) for s in windows] == [
        ("a.parquet", 0, 4), ("a.parquet", 4, 3), ("b.parquet", 0, 2)]
    for s in windows:
        assert WINDOW_KEYS <= set(s), s
        assert s["mode"] in ("static", "continuous") and s["reason"]
        assert isinstance(s["predicted_output_tokens"], int)
        assert isinstance(s["estimated_seconds"], float) and s["estimated_seconds"] > 0
        assert set(s["estimates"]) == {"static", "continuous"}
        assert s["kv_bytes"]["needed"] > 0
    # ignore-EOS: every length is exact. File a is uniform; in b one batch holds 1 and 20 tokens
    assert [s["mode"] for s in windows] == ["static", "static", "continuous"]
    assert [s["predicted_output_tokens"] for s in windows] == [20, 15, 21]
    assert report["num_rows"] == 9 and report["num_error_rows"] == 1  # the null prompt
    assert report["predicted_output_tokens"] == 56
    assert report["prompt_tokens"]["count"] == 9 and report["prompt_tokens"]["max"] == len("a longer prompt " * 3)
    assert report["kv"]["bytes_per_token"] > 0 and report["calibration"]["num_steps"] > 0
    # the whole job's time: the model's load (timed as the plan loaded it) and every window's
    assert report["model_load_seconds"] > 0
    assert report["estimated_seconds"] == pytest.approx(
        report["model_load_seconds"] + sum(s["estimated_seconds"] for s in windows), abs=0.01)


def test_plan_text_and_forced_mode(runner, tiny_model_dir, inputs):
    result = plan(runner, tiny_model_dir, inputs, "--mode", "continuous", "--max-new-tokens", "8")
    lines = result.stdout.splitlines()
    assert lines[0].startswith("plan: 9 rows (1 error row) in 2 windows")
    assert any(line.startswith("calibration: ") for line in lines)
    window_lines = [line for line in lines if "--mode continuous" in line]
    assert len(window_lines) == 2 and all(" continuous " in line for line in window_lines)


def test_plan_uses_the_learned_lengths_of_the_output_dir(runner, tiny_model_dir, inputs, tmp_path):
    fresh = json.loads(plan(runner, tiny_model_dir, inputs, "--json", "--calibration-rows", "0").stdout)
    assert fresh["calibration"] is None and fresh["learned_rows"] == 0
    assert {s["reason"].split(":")[0] for s in fresh["windows"]} == {"mixed"}  # the prior alone
    out = tmp_path / "out"
    run = runner.invoke(app, ["run", "--input", str(inputs / "a.parquet"), "--input", str(inputs / "b.parquet"),
                              "--output", str(out), "--model", str(tiny_model_dir), "--device", "cpu", "--dtype",
                              "float32", "--no-chat", "--kv-cache-memory", "16MiB", "--max-new-tokens", "3",
                              "--max-rows", "8", "--quiet"])
    assert run.exit_code == 0, run.output
    assert (out / LENGTH_MODEL_FILE).exists()
    report = json.loads(plan(runner, tiny_model_dir, inputs, "--json", "--calibration-rows", "0",
                             "--output", out).stdout)
    # what a resume would run: the row not yet committed (and the null prompt's error row)
    assert (report["num_rows_done"], report["num_rows"], report["num_error_rows"]) == (8, 1, 1)
    assert report["learned_rows"] == 8  # every row that generated: 3 tokens each
    assert all(s["mode"] == "static" and s["predicted_output_tokens"] == 3 * s["num_rows"] for s in report["windows"])
    assert fresh["num_rows_done"] == 0 and fresh["num_rows"] == 9


def test_plan_user_errors_exit_2(runner, tiny_model_dir, inputs):
    result = runner.invoke(app, ["plan", "--input", str(inputs / "a.parquet"), "--model", str(tiny_model_dir),
                                 "--length-column", "nope"])
    assert result.exit_code == 2 and "--length-column 'nope' not found" in result.output
    result = runner.invoke(app, ["plan", "--input", str(inputs / "a.parquet"), "--mode", "fastest"])
    assert result.exit_code == 2 and "--mode (YAML mode) must be one of auto, continuous, static" in result.output


def _flags(command: str) -> set[str]:
    import typer.main

    params = typer.main.get_command(app).commands[command].params
    return {flag for p in params for flag in (*p.opts, *p.secondary_opts)}


def test_plan_takes_every_run_flag():
    assert _flags("run") - _flags("plan") == set()


def test_a_pasted_run_command_plans(runner, tiny_model_dir, inputs, tmp_path):
    """A `run` command with its sampling, commit and metrics flags, `run` replaced by `plan`."""
    result = plan(runner, tiny_model_dir, inputs, "--output", tmp_path / "out", "--temperature", "0.7",
                  "--top-p", "0.9", "--top-k", "20", "--seed", "3", "--stop", "\\n", "--min-tokens", "1",
                  "--commit-every", "10", "--commit-every-seconds", "5", "--rows-per-part", "100", "--quiet",
                  "--no-metrics", "--max-error-rate", "0.5", "--stop-grace-seconds", "10", "--overwrite")
    lines = result.stdout.splitlines()
    assert lines[0].startswith("plan: 9 rows (1 error row)")
    assert any("(model load " in line for line in lines if line.startswith("calibration: "))
    assert not (tmp_path / "out").exists()
