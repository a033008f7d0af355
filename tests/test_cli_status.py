"""`batchgen status` and `batchgen compact`, and what `run` says about a locked or differently
configured output directory, through the Typer app on the tiny random Llama."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.io.manifest.manifest import SUCCESS_FILE
from batchgen.io.store import local_files


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.fixture
def inputs(tmp_path):
    a = tmp_path / "a.parquet"
    b = tmp_path / "b.jsonl"
    pq.write_table(pa.table({"text": [f"a{i} text" for i in range(7)]}), a)
    b.write_text("".join(json.dumps({"text": "" if i == 2 else f"b{i} text"}) + "\n" for i in range(5)))
    return [a, b]


def run(runner, model_dir, inputs, out, *args):
    argv = ["run", *[a for p in inputs for a in ("--input", str(p))], "--output", str(out), "--model",
            str(model_dir), "--device", "cpu", "--max-new-tokens", "3", "--kv-cache-memory", "16MiB", "--quiet",
            *map(str, args)]
    return runner.invoke(app, argv)


def stderr_lines(result):
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_status_json_per_file_then_complete(runner, tiny_model_dir, inputs, tmp_path):
    out = tmp_path / "out"
    result = run(runner, tiny_model_dir, inputs, out, "--max-rows", "9", "--commit-every", "4")
    assert result.exit_code == 0, result.output
    status = json.loads(runner.invoke(app, ["status", "--output", str(out), "--json"]).stdout)
    assert status["state"] == "complete" and status["max_rows"] == 9  # complete for the rows it was asked
    assert [(s["rows"], s["done"], s["errored"], s["remaining"]) for s in status["files"]] == [(7, 7, 0, 0),
                                                                                                (2, 2, 0, 0)]
    assert status["fingerprint"]["max_new_tokens"] == 3 and len(status["fingerprint"]["digest"]) == 16
    assert status["last_commit_time"] > 0 and status["running"] is None

    result = run(runner, tiny_model_dir, inputs, out, "--commit-every", "4")  # the rest
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["rows"] == 3
    status = json.loads(runner.invoke(app, ["status", "--output", str(out), "--json"]).stdout)
    assert [(s["path"], s["rows"], s["done"], s["errored"], s["remaining"]) for s in status["files"]] == [
        (str(inputs[0]), 7, 7, 0, 0), (str(inputs[1]), 5, 4, 1, 0)]
    assert (status["rows"], status["done"], status["errored"], status["remaining"]) == (12, 11, 1, 0)

    text = runner.invoke(app, ["status", "--output", str(out)])
    assert text.exit_code == 0
    assert "state: complete" in text.stdout and "12 in the input, 11 done, 1 errored, 0 remaining" in text.stdout
    assert f"{inputs[1]}: 5 rows, 4 done, 1 errored, 0 remaining" in text.stdout


def test_status_of_an_interrupted_job(runner, tiny_model_dir, inputs, tmp_path, monkeypatch):

    class Crash(BaseException):
        pass

    calls = []

    def crash(stage):
        if stage == "file_rename":
            calls.append(stage)
            if len(calls) == 4:  # begin, inputs, one commit, then die in the second
                raise Crash

    monkeypatch.setattr(local_files, "_fault_hook", crash)
    out = tmp_path / "out"
    with pytest.raises(Crash):
        runner.invoke(app, ["run", "--input", str(inputs[0]), "--output", str(out), "--model", str(tiny_model_dir),
                            "--device", "cpu", "--max-new-tokens", "3", "--commit-every", "3", "--quiet"],
                      catch_exceptions=False)
    monkeypatch.setattr(local_files, "_fault_hook", None)
    status = json.loads(runner.invoke(app, ["status", "--output", str(out), "--json"]).stdout)
    assert status["state"] == "incomplete" and not status["complete"]
    assert (status["rows"], status["done"], status["remaining"]) == (7, 3, 4)
    text = runner.invoke(app, ["status", "--output", str(out)]).stdout
    assert "incomplete: run the same `batchgen run` command again to resume" in text


def test_status_of_a_directory_that_is_no_job(runner, tmp_path):
    (tmp_path / "notes.txt").write_text("someone else's")
    result = runner.invoke(app, ["status", "--output", str(tmp_path)])
    assert result.exit_code == 2
    assert stderr_lines(result) == [f"error: {tmp_path} is not a batchgen output directory (it has no _manifest)"]


@pytest.mark.parametrize("made", [False, True])
def test_status_of_an_output_no_run_has_written_is_not_started_exit_0(runner, tmp_path, made):
    """An Airflow sensor polls the output before the first run: that is a state, not a failure."""
    out = tmp_path / "out"
    if made:
        out.mkdir()
    result = runner.invoke(app, ["status", "--output", str(out), "--json"])
    assert result.exit_code == 0, result.output
    status = json.loads(result.stdout)
    assert (status["state"], status["complete"], status["done"]) == ("not_started", False, 0)
    text = runner.invoke(app, ["status", "--output", str(out)])
    assert text.exit_code == 0 and "state: not started: no run has written there yet" in text.stdout
    assert out.exists() == made  # status writes nothing


def test_compact_rewrites_in_input_order(runner, tiny_model_dir, inputs, tmp_path):
    out = tmp_path / "out"
    assert run(runner, tiny_model_dir, inputs, out, "--commit-every", "2", "--batch-size", "3").exit_code == 0
    before = ds.dataset(str(out), format="parquet").to_table()
    assert len(list(out.glob("part-*.parquet"))) == 6
    result = runner.invoke(app, ["compact", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "output": str(out), "parts_before": 6, "parts_after": 2, "rows": 12}
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) == 2 and (out / SUCCESS_FILE).exists()
    assert pq.read_table(parts[0]).column("row_id").to_pylist() == [f"a.parquet:{i}" for i in range(7)]
    assert pq.read_table(parts[1]).column("row_id").to_pylist() == [f"b.jsonl:{i}" for i in range(5)]
    after = ds.dataset(str(out), format="parquet").to_table()
    key = "row_id"
    assert sorted(after.to_pylist(), key=lambda r: r[key]) == sorted(before.to_pylist(), key=lambda r: r[key])
    # idempotent, and a resumed run afterwards only retries the error row, which fails the same
    # way and so changes nothing
    assert json.loads(runner.invoke(app, ["compact", "--output", str(out)]).stdout)["parts_after"] == 2
    rerun = run(runner, tiny_model_dir, inputs, out)
    assert rerun.exit_code == 0 and json.loads(rerun.stdout.strip().splitlines()[-1])["rows"] == 1
    assert sorted(out.glob("part-*.parquet")) == parts and (out / SUCCESS_FILE).exists()
    rerun = run(runner, tiny_model_dir, inputs, out, "--no-retry-errors")
    assert json.loads(rerun.stdout.strip().splitlines()[-1])["rows"] == 0


def test_compact_refuses_an_unfinished_job(runner, tiny_model_dir, inputs, tmp_path):
    out = tmp_path / "out"
    assert run(runner, tiny_model_dir, inputs, out).exit_code == 0
    (out / SUCCESS_FILE).unlink()
    result = runner.invoke(app, ["compact", "--output", str(out)])
    assert result.exit_code == 2 and "is not complete (no _SUCCESS)" in result.stderr


def test_a_second_job_on_a_locked_directory_is_refused(runner, tiny_model_dir, inputs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    code = textwrap.dedent(f"""
        import time
        from batchgen.io.store.lock import OutputLock
        OutputLock({str(out)!r}).acquire()
        print("locked", flush=True)
        time.sleep(600)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        result = run(runner, tiny_model_dir, inputs, out)
        assert result.exit_code == 2, result.output
        (line,) = stderr_lines(result)
        assert line.startswith(f"error: {out} is in use by another batchgen job (pid {holder.pid} on ")
        assert "wait for it to finish, stop it, or choose another --output" in line
        status = json.loads(runner.invoke(app, ["status", "--output", str(out), "--json"]).stdout) \
            if (out / "_manifest").exists() else None
        assert status is None  # refused before writing anything
    finally:
        holder.kill()
        holder.wait()
    assert run(runner, tiny_model_dir, inputs, out).exit_code == 0  # the dead holder's lock is taken over


def test_a_changed_setting_is_refused_with_exit_2_and_overwrite_starts_over(runner, tiny_model_dir, inputs, tmp_path):
    out = tmp_path / "out"
    assert run(runner, tiny_model_dir, inputs, out).exit_code == 0
    result = run(runner, tiny_model_dir, inputs, out, "--temperature", "0.7", "--seed", "3")
    assert result.exit_code == 2
    (line,) = stderr_lines(result)
    assert "temperature 0.0 -> 0.7; seed 0 -> 3" in line and "--overwrite" in line
    result = run(runner, tiny_model_dir, inputs, out, "--temperature", "0.7", "--seed", "3", "--overwrite")
    assert result.exit_code == 0 and json.loads(result.stdout.strip().splitlines()[-1])["rows"] == 12


def test_run_help_lists_the_resume_flags(runner):
    result = runner.invoke(app, ["run", "--help"])
    for flag in ("--commit-every", "--commit-every-seconds", "--no-retry-errors", "--overwrite"):
        assert flag in result.output
