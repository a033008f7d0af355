"""`batchgen run --output s3://...` against a real S3 API server on localhost (moto's server mode).

A complete run, a resume after a partial run, SIGKILLs mid-job then a resume (every row exactly
once, equal to an uninterrupted local run), the lease (a live job's refuses a second job, an
expired one is taken over), and `status` / `compact` on the object-store output.
"""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.errors import OutputError, OutputLocked
from batchgen.io.manifest.manifest import PART_NAME_RE, SUCCESS_FILE, load_manifest
from batchgen.io.store.factory import open_store
from batchgen.io.store.lease import LEASE_FILE, Lease, read_lease
from batchgen.jobs.commands.compact import compact_output
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.commands.status import job_status
from tests.jobs.helpers import committed_rows, tiny_job_config
from tests.s3_server import committed_by_id, committed_table, kill_once_committed, tiny_run_args

NUM_ROWS = 48
COMMON = dict(id_column="id", max_new_tokens=6, batch_size=8, commit_every_rows=8)
pytestmark = [pytest.mark.soak, pytest.mark.usefixtures("quick_lease_settle")]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("s3in") / "in.parquet"
    pq.write_table(pa.table({"id": list(range(NUM_ROWS)), "text": [f"row {i} says {'ab' * (i % 7)}"
                                                                     for i in range(NUM_ROWS)]}), path)
    return path


@pytest.fixture(scope="module")
def reference(src, tiny_model_dir, loaded, tmp_path_factory):
    """The same job written to a local directory: what the object-store output must equal."""
    out = tmp_path_factory.mktemp("s3ref") / "out"
    run_job(tiny_job_config(src, out, tiny_model_dir, **COMMON), loaded=loaded)
    return committed_rows(out)


def config(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, **{**COMMON, **overrides})


def test_complete_run_to_s3(src, tiny_model_dir, loaded, reference, s3_out):
    summary = run_job(config(src, s3_out, tiny_model_dir), loaded=loaded)
    assert summary.complete and summary.num_rows == NUM_ROWS
    store = open_store(s3_out)
    assert store.exists(SUCCESS_FILE) and store.exists("_summary.json") and not store.exists(LEASE_FILE)
    assert committed_by_id(s3_out) == reference
    parts = {name for name in store.list() if PART_NAME_RE.fullmatch(name)}
    assert parts == set(load_manifest(store).parts)  # after _SUCCESS the listing is the committed parts
    assert not any(name.endswith(".tmp") for name in store.list())
    again = run_job(config(src, s3_out, tiny_model_dir), loaded=loaded)  # a rerun generates nothing
    assert again.num_rows == 0 and again.num_rows_skipped == NUM_ROWS and committed_by_id(s3_out) == reference


def test_resume_after_a_partial_run(src, tiny_model_dir, loaded, reference, s3_out):
    first = run_job(config(src, s3_out, tiny_model_dir, max_rows=20), loaded=loaded)
    assert first.num_rows == 20
    assert len(committed_by_id(s3_out)) == 20
    second = run_job(config(src, s3_out, tiny_model_dir), loaded=loaded)
    assert second.num_rows_skipped == 20 and second.num_rows == NUM_ROWS - 20
    assert committed_by_id(s3_out) == reference


def test_sigkill_mid_job_then_resume_writes_every_row_once(src, tiny_model_dir, loaded, reference, s3_out):
    args = tiny_run_args(src, s3_out, tiny_model_dir, "--id-column", "id", "--max-new-tokens", "6", "--batch-size", "2",
                         "--commit-every", "8", "--commit-every-seconds", "0.2")
    store = open_store(s3_out)
    committed: set = set()
    kills = mid_job = 0
    for at_least in (8, 24):  # kill once some rows are committed, twice (a fast machine may finish the second)
        killed = kill_once_committed(args, store, at_least)
        kills += killed
        state = load_manifest(store)
        state.check_integrity()
        for record in state.parts.values():  # every committed part whole and matching its entry
            assert store.digest(record.name) == (record.num_bytes, record.sha256)
        now = state.ok_ids | set(state.error_ids)
        assert committed <= now, "a row committed before the kill is gone"
        committed = now
        mid_job += killed and 0 < len(now) < NUM_ROWS
    assert kills >= 1 and mid_job >= 1, "no kill landed mid-job"
    # the killed job's lease stays until it expires (kill_once_committed waits it out), then the
    # resume takes it over (a second run that finished released its lease; a kill can also land just after that)
    if killed and len(committed) < NUM_ROWS:
        assert read_lease(store) is not None
    summary = run_job(config(src, s3_out, tiny_model_dir), loaded=loaded)
    assert summary.num_rows_skipped == len(committed)
    assert summary.num_rows + summary.num_rows_skipped == NUM_ROWS
    assert committed_by_id(s3_out) == reference  # every row exactly once, equal to an uninterrupted run
    names = {name for name in store.list() if PART_NAME_RE.fullmatch(name)}
    assert names == set(load_manifest(store).parts)  # parts staged by the killed runs are gone


def test_a_live_lease_refuses_a_second_job(src, tiny_model_dir, loaded, s3_out):
    store = open_store(s3_out)
    with Lease(store, ttl_s=30):  # another live job, as far as the store can tell
        with pytest.raises(OutputLocked, match="in use by another batchgen job"):
            run_job(config(src, s3_out, tiny_model_dir), loaded=loaded)
    assert not store.is_dir("_manifest")  # refused before it wrote anything


def test_an_expired_lease_is_taken_over(src, tiny_model_dir, loaded, reference, s3_out):
    store = open_store(s3_out)
    stale = {"holder": "crashed-elsewhere", "pid": 1, "host": "another-host", "started": 0, "renewed": 0,
             "expires": time.time() - 5, "ttl_s": 60}
    store.write_bytes(LEASE_FILE, json.dumps(stale).encode())
    summary = run_job(config(src, s3_out, tiny_model_dir), loaded=loaded)
    assert summary.complete and committed_by_id(s3_out) == reference
    assert read_lease(store) is None


def test_status_and_compact_on_s3(src, tiny_model_dir, loaded, reference, s3_out):
    run_job(config(src, s3_out, tiny_model_dir, max_rows=16), loaded=loaded)
    status = job_status(s3_out)
    assert status["done"] + status["errored"] == 16 and status["running"] is None
    assert status["output"] == s3_out and status["live"] is None
    store = open_store(s3_out)
    stray = "part-99999-deadbeef.parquet"  # staged by a killed job, never committed
    store.write_bytes(stray, b"PAR1 not committed")
    assert job_status(s3_out)["num_parts"] == len(load_manifest(store).parts)  # status ignores it
    store.delete(SUCCESS_FILE)
    with pytest.raises(OutputError, match="not complete"):
        compact_output(s3_out)
    with Lease(store, ttl_s=30):  # status while a job holds the lease
        assert job_status(s3_out)["state"] == "running"
    run_job(config(src, s3_out, tiny_model_dir), loaded=loaded)
    assert not store.exists(stray)  # the run's recovery deleted it
    status = job_status(s3_out)
    assert status["state"] == "complete" and status["remaining"] == 0 and status["running"] is None
    before = status["num_parts"]
    assert before > 1
    runner = CliRunner()
    cli_status = runner.invoke(app, ["status", "--output", s3_out, "--json"])
    assert cli_status.exit_code == 0 and json.loads(cli_status.stdout)["state"] == "complete"
    store.write_bytes(stray, b"PAR1 not committed")
    compacted = runner.invoke(app, ["compact", "--output", s3_out])
    assert compacted.exit_code == 0, compacted.output
    summary = json.loads(compacted.stdout.strip().splitlines()[-1])
    assert summary["parts_before"] == before and summary["parts_after"] == 1
    state = load_manifest(store)
    assert len(state.parts) == 1 and store.exists(SUCCESS_FILE)
    table = committed_table(s3_out)
    assert table.column("id").to_pylist() == list(range(NUM_ROWS))  # input order
    assert committed_by_id(s3_out) == reference
    names = {name for name in store.list() if PART_NAME_RE.fullmatch(name)}
    assert names == set(state.parts)  # compact removed the old parts and the stray one


def test_plan_reads_the_committed_rows_and_lengths_on_s3(src, tiny_model_dir, loaded, s3_out):
    from batchgen.jobs.commands.plan import plan_job

    run_job(config(src, s3_out, tiny_model_dir, max_rows=20), loaded=loaded)
    assert open_store(s3_out).exists("_length_model.json")
    report = plan_job(config(src, s3_out, tiny_model_dir), loaded=loaded, calibration_rows=0)
    # what a resume would run: the rows not yet committed, planned with the lengths the job learned
    assert (report["num_rows_done"], report["num_rows"]) == (20, NUM_ROWS - 20)
    assert report["learned_rows"] == 20
    run_job(config(src, s3_out, tiny_model_dir), loaded=loaded)
    done = plan_job(config(src, s3_out, tiny_model_dir), loaded=loaded, calibration_rows=0)
    assert (done["num_rows_done"], done["num_rows"]) == (NUM_ROWS, 0)  # --id-column: prompts compared, unchanged
