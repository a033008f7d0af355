"""`batchgen run --workers N` (batchgen/jobs/executors/workers.py): the job as N shard processes, finalized,
row for row what one process writes; refusals, failures and signals reach the user."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import ConfigError
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.executors import workers
from tests.jobs.helpers import committed_rows, tiny_job_config

MAX_NEW = 4


@pytest.fixture
def rows_file(tmp_path):
    path = tmp_path / "in" / "rows.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"text": [f"row {i} of the input" for i in range(23)]}), path, row_group_size=5)
    return path


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchgen", *args], capture_output=True, text=True, timeout=timeout)


def flags(rows_file, out, model_dir, *extra: str) -> list[str]:
    return ["run", "--input", str(rows_file), "--output", str(out), "--model", str(model_dir), "--device", "cpu",
            "--dtype", "float32", "--no-chat", "--max-new-tokens", str(MAX_NEW), "--kv-cache-memory", "16MiB",
            "--quiet", *extra]


def test_two_workers_write_what_one_process_writes(tmp_path, rows_file, tiny_model_dir, loaded):
    run_job(tiny_job_config(rows_file, tmp_path / "one", tiny_model_dir, chat=False, max_new_tokens=MAX_NEW),
            loaded=loaded)
    done = cli(*flags(rows_file, tmp_path / "two", tiny_model_dir, "--workers", "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["rows"] == 23 and line["errors"] == 0 and line["workers"] == 2
    assert (tmp_path / "two" / "_SUCCESS").is_file()
    assert sorted(p.name for p in (tmp_path / "two").glob("shard-*")) == ["shard-0-of-2", "shard-1-of-2"]
    one, two = committed_rows(tmp_path / "one", "row_id"), committed_rows(tmp_path / "two", "row_id")
    assert {k: v["generated_text"] for k, v in two.items()} == {k: v["generated_text"] for k, v in one.items()}

    again = cli(*flags(rows_file, tmp_path / "two", tiny_model_dir, "--workers", "2"))  # a rerun resumes: no row twice
    assert again.returncode == 0, again.stderr[-3000:]
    assert committed_rows(tmp_path / "two", "row_id").keys() == one.keys()
    line = json.loads(again.stdout.strip().splitlines()[-1])  # rows: this run's, as a one-process run says
    assert (line["rows"], line["errors"], line["output_rows"], line["output_errors"]) == (0, 0, 23, 0)


def test_settings_workers_cannot_run_are_refused_before_anything_starts(tmp_path, rows_file, tiny_model_dir):
    config = tiny_job_config(rows_file, tmp_path / "out", tiny_model_dir)
    with pytest.raises(ConfigError, match="--num-shards"):
        workers.worker_config(config.replace(num_shards=2, shard_index=0), 2, 0)
    with pytest.raises(ConfigError, match="GPU"):
        workers.worker_config(config.replace(device="cuda"), 2, 0)
    done = cli(*flags(rows_file, tmp_path / "out", tiny_model_dir, "--workers", "2", "--num-shards", "2",
                      "--shard-index", "0"))
    assert done.returncode == 2 and "--workers runs the job as shards itself" in done.stderr
    assert not (tmp_path / "out").exists()
    assert cli(*flags(rows_file, tmp_path / "out", tiny_model_dir, "--workers", "0")).returncode == 2


def test_worker_threads_split_the_cores_unless_the_user_pinned_them(monkeypatch):
    monkeypatch.setattr(workers, "num_cpu_cores", lambda: 8)
    assert workers.worker_env(2, {})["OMP_NUM_THREADS"] == "4"
    assert workers.worker_env(16, {})["OMP_NUM_THREADS"] == "1"
    assert workers.worker_env(2, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"


def test_kv_cache_budget_is_split_between_the_workers(tmp_path, rows_file, tiny_model_dir):
    config = tiny_job_config(rows_file, tmp_path / "out", tiny_model_dir, kv_cache_memory="64MiB")
    assert workers.kv_cache_share(config, 4) == 16 * 2**20


def test_a_failing_worker_fails_the_job_with_its_code_and_nothing_is_finalized(tmp_path, rows_file, tiny_model_dir):
    bad = tmp_path / "in" / "bad.parquet"
    pq.write_table(pa.table({"other": ["no text column"] * 3}), bad)
    done = cli(*flags(bad, tmp_path / "out", tiny_model_dir, "--workers", "2"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert not (tmp_path / "out" / "_SUCCESS").exists()


@pytest.mark.soak
def test_sigterm_reaches_the_workers_and_the_rerun_finishes_exactly_once(tmp_path, tiny_model_dir):
    path = tmp_path / "in" / "many.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"text": [f"a longer row {i}" for i in range(400)]}), path)
    args = flags(path, tmp_path / "out", tiny_model_dir, "--workers", "2", "--batch-size", "2", "--commit-every", "8")
    args[args.index("--max-new-tokens") + 1] = "24"
    proc = subprocess.Popen([sys.executable, "-m", "batchgen", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 240
    while not list((tmp_path / "out").glob("shard-*/*.parquet")) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 143, err[-3000:]
    assert not (tmp_path / "out" / "_SUCCESS").exists()
    rerun = cli(*args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert len(committed_rows(tmp_path / "out", "row_id")) == 400


def test_more_workers_than_rows_still_finishes(tmp_path, tiny_model_dir):
    path = tmp_path / "in" / "one.parquet"
    path.parent.mkdir()
    pq.write_table(pa.table({"text": ["the only row"]}), path)
    done = cli(*flags(path, tmp_path / "out", tiny_model_dir, "--workers", "3"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "_SUCCESS").is_file() and len(committed_rows(tmp_path / "out", "row_id")) == 1
