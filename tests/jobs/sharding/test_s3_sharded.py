"""Sharded jobs on an object store (moto's S3 server on localhost): the Airflow setup where every mapped
task writes `s3://bucket/prefix/shard-I-of-N/` and a last task finalizes.

Two shards + finalize equal a single-process run row for row, exactly once; status, report and
compact work on the set; a missing, running or unfinished shard makes finalize exit 4; a shard
killed with SIGKILL resumes on the store.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.io.manifest.manifest import PART_NAME_RE, SUCCESS_FILE, load_manifest
from batchgen.io.store.factory import open_store
from batchgen.io.store.lease import Lease
from batchgen.jobs.commands.compact import compact_output
from batchgen.jobs.commands.report import render_report
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.commands.status import job_status, status_lines
from batchgen.jobs.sharding.finalize import finalize_output
from tests.jobs.helpers import committed_rows, tiny_job_config
from tests.s3_server import committed_by_id, kill_once_committed, tiny_run_args

NUM_ROWS = 24
COMMON = dict(id_column="id", max_new_tokens=4, batch_size=4, commit_every_rows=4)
pytestmark = [pytest.mark.soak, pytest.mark.usefixtures("quick_lease_settle")]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("s3shin") / "in.parquet"
    pq.write_table(pa.table({"id": list(range(NUM_ROWS)), "text": [f"row {i} asks {'xy' * (i % 5)}"
                                                                     for i in range(NUM_ROWS)]}), path)
    return path


@pytest.fixture(scope="module")
def reference(src, tiny_model_dir, loaded, tmp_path_factory):
    """The job in one process, to a local directory: what the shards together must equal."""
    out = tmp_path_factory.mktemp("s3shref") / "out"
    run_job(tiny_job_config(src, out, tiny_model_dir, **COMMON), loaded=loaded)
    return committed_rows(out)


def config(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, **{**COMMON, **overrides})


def shard_url(out: str, index: int, num_shards: int = 2) -> str:
    return f"{out}/shard-{index}-of-{num_shards}"


def union_by_id(out: str, num_shards: int = 2) -> dict:
    """Every shard's committed rows (through its manifest); fails if any id is committed twice."""
    return committed_by_id(*(shard_url(out, i, num_shards) for i in range(num_shards)))


def finalize_cli(out: str):
    return CliRunner().invoke(app, ["finalize", "--output", out])


def test_two_shards_to_one_prefix_then_finalize_equal_one_process(src, tiny_model_dir, loaded, reference, s3_out,
                                                                   tmp_path):
    for index in range(2):
        summary = run_job(config(src, s3_out, tiny_model_dir, num_shards=2, shard_index=index), loaded=loaded)
        assert summary.complete and 0 < summary.num_rows < NUM_ROWS
    store = open_store(s3_out)
    assert not store.exists(SUCCESS_FILE)
    status = job_status(s3_out)
    assert status["state"] == "unfinalized" and status["num_shards"] == 2 and status["done"] == NUM_ROWS
    assert [s["state"] for s in status["job_shards"]] == ["complete", "complete"]
    assert any("shard 1: complete" in line for line in status_lines(status))

    done = finalize_cli(s3_out)
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout.splitlines()[-1])["rows"] == NUM_ROWS
    success = json.loads(store.read_bytes(SUCCESS_FILE))
    assert success["rows"] == NUM_ROWS and success["num_shards"] == 2
    assert json.loads(store.read_bytes("_summary.json"))["output"] == s3_out
    assert union_by_id(s3_out) == reference  # every row exactly once, equal to the single process's
    cli_status = CliRunner().invoke(app, ["status", "--output", s3_out, "--json"])
    assert cli_status.exit_code == 0 and json.loads(cli_status.stdout)["state"] == "complete"

    files = render_report(s3_out)  # one page over both shards, written into the store
    assert str(files.html_path) == f"{s3_out}/_report/report.html"
    page = store.read_bytes("_report/report.html").decode()
    assert "batchgen sharded job" in page and "shard 1" in page and f"{NUM_ROWS} of {NUM_ROWS}" in page
    assert "Rows per job shard" in page
    one = render_report(shard_url(s3_out, 0), dest=tmp_path / "one").html_path.read_text()  # one job on a store
    assert "batchgen job: shard-0-of-2" in one and "keeps no metrics files" in one

    result = compact_output(s3_out)  # every shard compacted, the job's _SUCCESS written again
    assert result.num_parts_after == 2 < result.num_parts_before and store.exists(SUCCESS_FILE)
    assert union_by_id(s3_out) == reference
    for index in range(2):
        shard = open_store(shard_url(s3_out, index))
        assert {n for n in shard.list() if PART_NAME_RE.fullmatch(n)} == set(load_manifest(shard).parts)


def test_finalize_on_s3_exits_4_until_every_shard_is_done(src, tiny_model_dir, loaded, s3_out):
    run_job(config(src, s3_out, tiny_model_dir, num_shards=2, shard_index=1), loaded=loaded)
    missing = finalize_cli(s3_out)
    assert missing.exit_code == 4 and "--shard-index 0" in missing.output
    assert job_status(s3_out)["job_shards"][0]["state"] == "not started"
    run_job(config(src, s3_out, tiny_model_dir, num_shards=2, shard_index=0), loaded=loaded)
    shard0 = open_store(shard_url(s3_out, 0))
    with Lease(shard0, ttl_s=30):  # the shard's task still running, as far as the store can tell
        running = finalize_cli(s3_out)
    assert running.exit_code == 4 and "still running" in running.output
    shard0.delete(SUCCESS_FILE)  # as a shard killed after its last commit leaves it
    unfinished = finalize_cli(s3_out)
    assert unfinished.exit_code == 4 and "shard 0 of 2" in unfinished.output and "did not complete" in unfinished.output
    assert not open_store(s3_out).exists(SUCCESS_FILE)
    run_job(config(src, s3_out, tiny_model_dir, num_shards=2, shard_index=0), loaded=loaded)  # the retry
    assert finalize_cli(s3_out).exit_code == 0 and open_store(s3_out).exists(SUCCESS_FILE)
    # a shard rerun under other settings is refused by finalize (exit 2), and the job is no longer done
    run_job(config(src, s3_out, tiny_model_dir, num_shards=2, shard_index=1, max_new_tokens=5, overwrite=True),
            loaded=loaded)
    assert not open_store(s3_out).exists(SUCCESS_FILE)
    odd = finalize_cli(s3_out)
    assert odd.exit_code == 2 and "shard-1-of-2 was run with other settings" in odd.output


def test_a_shard_killed_on_s3_resumes_exactly_once(src, tiny_model_dir, loaded, reference, s3_out):
    args = tiny_run_args(src, s3_out, tiny_model_dir, "--id-column", "id", "--max-new-tokens", "4", "--batch-size", "2",
                         "--commit-every", "2", "--commit-every-seconds", "0.2", "--num-shards", "2",
                         "--shard-index", "0")
    shard0 = open_store(shard_url(s3_out, 0))
    killed = kill_once_committed(args, shard0, 2)
    committed = load_manifest(shard0).num_committed_rows
    assert committed >= 2
    run_job(config(src, s3_out, tiny_model_dir, num_shards=2, shard_index=1), loaded=loaded)
    if killed and not shard0.exists(SUCCESS_FILE):
        assert finalize_cli(s3_out).exit_code == 4
    summary = run_job(config(src, s3_out, tiny_model_dir, num_shards=2, shard_index=0), loaded=loaded)  # the retry
    assert summary.num_rows_skipped == committed and summary.complete
    assert finalize_output(s3_out)["rows"] == NUM_ROWS
    assert union_by_id(s3_out) == reference
    names = {n for n in shard0.list() if PART_NAME_RE.fullmatch(n)}
    assert names == set(load_manifest(shard0).parts)  # parts the killed run staged but never committed: gone


def test_plan_of_a_shard_on_s3_counts_its_committed_rows(src, tiny_model_dir, loaded, s3_out):
    from batchgen.jobs.commands.plan import plan_job

    shard1 = run_job(config(src, s3_out, tiny_model_dir, num_shards=2, shard_index=1), loaded=loaded)
    report = plan_job(config(src, s3_out, tiny_model_dir, num_shards=2, shard_index=1), loaded=loaded,
                      calibration_rows=0)
    # --id-column: every committed row is counted, none planned (their prompts are unchanged)
    assert (report["num_rows_done"], report["num_rows"]) == (shard1.num_rows, 0)
    other = plan_job(config(src, s3_out, tiny_model_dir, num_shards=2, shard_index=0), loaded=loaded,
                     calibration_rows=0)
    assert (other["num_rows_done"], other["num_rows"]) == (0, NUM_ROWS - shard1.num_rows)  # its own prefix
