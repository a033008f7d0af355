"""`-o results.jsonl --output-format openai-batch`: the file itself, where `vllm run-batch -o` writes it.

Every request's line in that one file (successes and error lines), its bookkeeping beside it in
`results.jsonl.batchgen/`; the file appears whole when the job completes and holds each custom_id
exactly once across failures (a run stopped mid-job, a write stopped before its rename, as a kill
stops them) and resumes; status, compact and finalize find the job from the file's name.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from batchgen.cli import app
from batchgen.config.job import build_config
from batchgen.errors import ConfigError, OutputError
from batchgen.io.manifest.manifest import SUCCESS_FILE
from batchgen.io.store import local_files
from batchgen.io.store.factory import open_store
from batchgen.jobs.commands.compact import compact_output
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.executors.local import LocalJob
from batchgen.jobs.sharding.finalize import finalize_output
from tests.jobs.helpers import tiny_job_config
from tests.jobs.openai.test_openai_batch_job import (
    ERROR_CODES,
    REQUESTS,
    BatchRequestOutput,
    chat,
    read_lines,
    write_requests,
)
from tests.jobs.openai.test_sharded_openai_batch import ALL_IDS, without_created
from tests.jobs.openai.test_sharded_openai_batch import inputs as inputs  # noqa: F401  (the sharded inputs fixture)

MAX_NEW = 6


def config(src, out, model_dir, **overrides):
    values = dict(input_format="openai-batch", output_format="openai-batch", max_new_tokens=MAX_NEW)
    return tiny_job_config(src, out, model_dir, **{**values, **overrides})


def file_lines(data: str) -> dict:
    """The file's lines as {custom_id: line}: each a valid Batch output line, no custom_id twice."""
    lines = [json.loads(line) for line in data.splitlines()]
    for line in lines:
        BatchRequestOutput.model_validate(line)
    ids = [line["custom_id"] for line in lines]
    assert len(ids) == len(set(ids)), "a custom_id appears twice"
    return {line["custom_id"]: line for line in lines}


def same_lines(got: dict, want: dict) -> bool:
    return {k: without_created(v) for k, v in got.items()} == {k: without_created(v) for k, v in want.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_dir, loaded, one_thread):
    """REQUESTS run to a directory: the API's pair, which the one file must hold together."""
    tmp = tmp_path_factory.mktemp("batchfile-ref")
    src = write_requests(tmp / "requests.jsonl", REQUESTS)
    run_job(config(src, tmp / "out", tiny_model_dir), loaded=loaded)
    ok, errors = read_lines(tmp / "out")
    return src, {**ok, **errors}


def test_a_jsonl_output_is_the_file_with_every_line_and_its_bookkeeping_beside_it(reference, tmp_path,
                                                                                   tiny_model_dir, loaded):
    src, want = reference
    summary = run_job(config(src, str(tmp_path / "results.jsonl"), tiny_model_dir), loaded=loaded)
    assert summary.complete
    target = tmp_path / "results.jsonl"
    assert target.is_file()
    lines = file_lines(target.read_text(encoding="utf-8"))
    assert same_lines(lines, want)  # the successes and the error lines of the API's pair, in one file
    assert {k for k, v in lines.items() if v["response"]["status_code"] == 400} == set(ERROR_CODES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl", "results.jsonl.batchgen"]
    books = tmp_path / "results.jsonl.batchgen"
    recorded = json.loads((books / SUCCESS_FILE).read_text())["openai_batch"]
    assert recorded["file"] == "results.jsonl" and recorded["files"] == {"results.jsonl": {"rows": 8, "errors": 3}}
    assert not (books / "output.jsonl").exists()
    status = CliRunner().invoke(app, ["status", "--output", str(target)])  # found from the file's name
    assert status.exit_code == 0 and "complete" in status.stdout, status.output


def test_a_jsonl_output_on_an_object_store_is_the_object_itself(reference, tiny_model_dir, loaded, s3_out,
                                                                 quick_lease_settle):
    src, want = reference
    url = f"{s3_out}/results.jsonl"
    assert run_job(config(src, url, tiny_model_dir), loaded=loaded).complete
    prefix = open_store(s3_out)
    assert same_lines(file_lines(prefix.read_bytes("results.jsonl").decode("utf-8")), want)
    assert prefix.exists(f"results.jsonl.batchgen/{SUCCESS_FILE}")
    first = prefix.read_bytes("results.jsonl")
    assert run_job(config(src, url, tiny_model_dir, retry_errors=False), loaded=loaded).num_rows == 0
    assert prefix.read_bytes("results.jsonl") == first


def test_failures_and_reruns_write_each_request_once_and_the_file_only_when_complete(tmp_path, tiny_model_dir,
                                                                                      loaded, monkeypatch):
    requests = [chat(f"r{i}", f"prompt number {i}", max_tokens=3) for i in range(8)] + REQUESTS[5:]
    src = write_requests(tmp_path / "requests.jsonl", requests)
    target = tmp_path / "results.jsonl"
    job = config(src, str(target), tiny_model_dir, commit_every_rows=2)
    finished_rows = LocalJob.finished

    def failing(self, planned, completion):
        if self.summary.num_rows >= 5:
            raise RuntimeError("injected failure")
        finished_rows(self, planned, completion)

    monkeypatch.setattr(LocalJob, "finished", failing)
    with pytest.raises(RuntimeError, match="injected"):
        run_job(job, loaded=loaded)
    assert not target.exists()  # rows committed, the job not complete: no file
    monkeypatch.setattr(LocalJob, "finished", finished_rows)

    def fail_rename(stage):
        if stage == "batch_file_rename":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(local_files, "_fault_hook", fail_rename)
    with pytest.raises(OutputError, match="Batch API output file"):
        run_job(job, loaded=loaded)
    assert not target.exists() and not (tmp_path / "results.jsonl.batchgen" / SUCCESS_FILE).exists()
    monkeypatch.setattr(local_files, "_fault_hook", None)
    (tmp_path / ".results.jsonl.0badc0de.tmp").write_bytes(b'{"custom_id": "r0"}\n')  # a killed writer's

    summary = run_job(job.replace(retry_errors=False), loaded=loaded)
    assert summary.num_rows == 0  # every row was committed: only the file was left to write
    assert set(file_lines(target.read_text())) == {r["custom_id"] for r in requests}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["requests.jsonl", "results.jsonl", "results.jsonl.batchgen"]
    before = target.stat().st_mtime_ns
    run_job(job.replace(retry_errors=False), loaded=loaded)  # complete and current: not written again
    assert target.stat().st_mtime_ns == before

    write_requests(tmp_path / "requests.jsonl", [*requests, chat("new", "one more", max_tokens=2)])
    monkeypatch.setattr(LocalJob, "finished", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        run_job(job.replace(retry_errors=False), loaded=loaded)
    assert not target.exists()  # rows were about to change: the old file no longer says the job completed
    monkeypatch.setattr(LocalJob, "finished", finished_rows)
    run_job(job.replace(retry_errors=False), loaded=loaded)
    assert set(file_lines(target.read_text())) == {r["custom_id"] for r in requests} | {"new"}


def test_a_job_over_max_error_rate_writes_no_file(reference, tmp_path, tiny_model_dir, loaded):
    src, _ = reference
    with pytest.raises(Exception, match="max-error-rate"):
        run_job(config(src, str(tmp_path / "results.jsonl"), tiny_model_dir, max_error_rate=0.1), loaded=loaded)
    assert not (tmp_path / "results.jsonl").exists()


def test_compact_and_finalize_find_the_job_from_the_files_name(inputs, tmp_path, tiny_model_dir, loaded):  # noqa: F811
    target = tmp_path / "results.jsonl"
    for index in range(2):
        run_job(config(inputs, str(target), tiny_model_dir, max_new_tokens=4, num_shards=2, shard_index=index),
                loaded=loaded)
    assert not target.exists()  # the shards are not the job: finalize writes its file
    finalize_output(str(target))
    lines = file_lines(target.read_text())
    assert set(lines) == ALL_IDS
    compact_output(str(target))
    assert file_lines(target.read_text()) == lines


def test_a_jsonl_output_needs_openai_batch_and_takes_no_one_elses_file(tmp_path, tiny_model_dir, loaded):
    src = write_requests(tmp_path / "requests.jsonl", REQUESTS[:1])
    with pytest.raises(ConfigError, match="names one JSON Lines file, but --output-format parquet"):
        build_config(None, inputs=[src], output=str(tmp_path / "results.jsonl"))
    theirs = tmp_path / "theirs.jsonl"
    theirs.write_text("keep me\n")
    with pytest.raises(OutputError, match="no batchgen job wrote it"):
        run_job(config(src, str(theirs), tiny_model_dir), loaded=loaded)
    assert theirs.read_text() == "keep me\n"
    (tmp_path / "old.jsonl").mkdir()  # a directory an earlier batchgen wrote at a .jsonl --output
    with pytest.raises(OutputError, match="with the slash"):
        run_job(config(src, str(tmp_path / "old.jsonl"), tiny_model_dir), loaded=loaded)
    run_job(config(src, str(tmp_path / "old.jsonl") + "/", tiny_model_dir), loaded=loaded)  # the directory, as asked
    assert (tmp_path / "old.jsonl" / "output.jsonl").is_file()
