"""OpenAI Batch API files on an object store (moto's S3 server on localhost): `--output-format
openai-batch` / `both` with `--output s3://...`.

The files equal a local run's, line for line; a failure while they are written leaves no _SUCCESS
and the next run writes them; a job killed with SIGKILL resumes and its files hold every custom_id
once; compact and a sharded job's finalize write them on the store too.
"""

from __future__ import annotations

import json
import sys

import pytest

from batchgen.errors import OutputError
from batchgen.io.manifest.manifest import SUCCESS_FILE, load_manifest
from batchgen.io.store import lease as lease_module
from batchgen.io.store import local_files
from batchgen.io.store.factory import open_store
from batchgen.jobs.commands.compact import compact_output
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.sharding.finalize import finalize_output
from tests.jobs.helpers import tiny_job_config
from tests.jobs.openai.test_openai_batch_job import (
    REQUESTS,
    BatchRequestOutput,
    chat,
    completion,
    read_lines,
    write_requests,
)
from tests.jobs.openai.test_sharded_openai_batch import FILES, without_created
from tests.s3_server import kill_once_committed

pytestmark = pytest.mark.soak  # kills, signals, fault injection or a local S3 server

FILE_NAMES = ("output.jsonl", "errors.jsonl")
KILL_REQUESTS = [chat(f"k{i}", f"request number {i} says {'ab' * (i % 5)}", max_tokens=6) if i % 3 else
                 completion(f"k{i}", f"prompt {i}", max_tokens=5) for i in range(40)]


@pytest.fixture(autouse=True)
def quick_settle(monkeypatch):
    monkeypatch.setattr(lease_module, "LEASE_SETTLE_S", 0.05)


def config(src, out, model_dir, **overrides):
    values = dict(input_format="openai-batch", output_format="openai-batch", max_new_tokens=6)
    return tiny_job_config(src, out, model_dir, **{**values, **overrides})


def store_lines(url: str, dir_name: str = ".") -> tuple[dict, dict]:
    """(output.jsonl, errors.jsonl) on the store as {custom_id: line}: each validated, no custom_id twice."""
    store = open_store(url)
    files = []
    for name in FILE_NAMES:
        data = store.read_bytes(name if dir_name == "." else f"{dir_name}/{name}").decode("utf-8")
        lines = [json.loads(line) for line in data.splitlines()]
        for line in lines:
            BatchRequestOutput.model_validate(line)
        ids = [line["custom_id"] for line in lines]
        assert len(ids) == len(set(ids)), f"a custom_id appears twice in {name}"
        files.append({line["custom_id"]: line for line in lines})
    assert not set(files[0]) & set(files[1]), "a custom_id is in both files"
    return files[0], files[1]


def same_lines(got: tuple[dict, dict], want: tuple[dict, dict]) -> bool:
    """Equal but for `created` (the time of each job's last commit)."""
    return all({k: without_created(v) for k, v in g.items()} == {k: without_created(v) for k, v in w.items()}
               for g, w in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory, tiny_model_dir, loaded):
    """REQUESTS run to a local directory: the lines the store's files must hold."""
    tmp = tmp_path_factory.mktemp("s3batchref")
    src = write_requests(tmp / "requests.jsonl", REQUESTS)
    run_job(config(src, tmp / "out", tiny_model_dir), loaded=loaded)
    return src, read_lines(tmp / "out")


def test_batch_files_on_s3_equal_a_local_run(local_reference, tiny_model_dir, loaded, s3_out):
    src, reference = local_reference
    summary = run_job(config(src, s3_out, tiny_model_dir), loaded=loaded)
    assert summary.complete
    assert same_lines(store_lines(s3_out), reference)
    store = open_store(s3_out)
    success = json.loads(store.read_bytes(SUCCESS_FILE))
    assert success["openai_batch"]["files"] == {"output.jsonl": {"rows": 5}, "errors.jsonl": {"rows": 3}}
    first = store.read_bytes("output.jsonl")
    again = run_job(config(src, s3_out, tiny_model_dir, retry_errors=False), loaded=loaded)  # complete and current
    assert again.num_rows == 0 and store.read_bytes("output.jsonl") == first


def test_a_failure_while_writing_leaves_no_success_and_the_rerun_writes_them(local_reference, tiny_model_dir,
                                                                               loaded, s3_out, monkeypatch):
    src, reference = local_reference
    calls = []

    def fail_second_close(stage):  # errors.jsonl is published, then output.jsonl's upload fails
        if stage == "stream_close":
            calls.append(stage)
            if len(calls) == 2:
                raise OSError(5, "connection reset")

    monkeypatch.setattr(local_files, "_fault_hook", fail_second_close)
    with pytest.raises(OutputError, match="Batch API output files"):
        run_job(config(src, s3_out, tiny_model_dir), loaded=loaded)
    store = open_store(s3_out)
    assert not store.exists(SUCCESS_FILE) and not store.exists("output.jsonl")  # the partial upload is deleted
    monkeypatch.setattr(local_files, "_fault_hook", None)
    summary = run_job(config(src, s3_out, tiny_model_dir, retry_errors=False), loaded=loaded)
    assert summary.num_rows == 0 and store.exists(SUCCESS_FILE)  # only the files were left to write
    assert same_lines(store_lines(s3_out), reference)


def test_both_on_s3_then_compact_writes_them_in_input_order(tmp_path, tiny_model_dir, loaded, s3_out):
    requests = [chat(f"r{i}", f"text {i}", max_tokens=1 + i % 3) for i in range(6)]
    src = write_requests(tmp_path / "requests.jsonl", requests)
    run_job(config(src, s3_out, tiny_model_dir, output_format="both", rows_per_part=2), loaded=loaded)
    store = open_store(s3_out)
    assert not store.exists("output.jsonl")  # both: the prefix stays one Parquet dataset
    before, _ = store_lines(s3_out, "_openai_batch")
    assert set(before) == {f"r{i}" for i in range(6)}
    compact_output(s3_out)
    lines = store.read_bytes("_openai_batch/output.jsonl").decode().splitlines()
    assert [json.loads(line)["custom_id"] for line in lines] == [f"r{i}" for i in range(6)]
    assert store_lines(s3_out, "_openai_batch")[0] == before  # the same lines, created kept
    assert json.loads(store.read_bytes(SUCCESS_FILE))["openai_batch"]["dir"] == "_openai_batch"


def test_sigkill_mid_job_then_resume_writes_each_custom_id_once(tmp_path, tiny_model_dir, loaded, s3_out):
    src = write_requests(tmp_path / "requests.jsonl", KILL_REQUESTS)
    reference_out = tmp_path / "reference"
    run_job(config(src, reference_out, tiny_model_dir), loaded=loaded)
    reference = read_lines(reference_out)
    args = [sys.executable, "-m", "batchgen", "run", "--input", src, "--input-format", "openai-batch",
            "--output", s3_out, "--output-format", "openai-batch", "--model", str(tiny_model_dir),
            "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "6", "--kv-cache-memory", "16MiB",
            "--batch-size", "4", "--commit-every", "4", "--commit-every-seconds", "0.2", "--quiet"]
    store = open_store(s3_out)
    assert kill_once_committed(args, store, at_least=4)
    state = load_manifest(store)
    assert 0 < state.num_committed_rows < len(KILL_REQUESTS)
    assert not store.exists(SUCCESS_FILE) and not store.exists("output.jsonl")
    summary = run_job(config(src, s3_out, tiny_model_dir), loaded=loaded)
    assert summary.num_rows_skipped == state.num_committed_rows
    assert summary.num_rows + summary.num_rows_skipped == len(KILL_REQUESTS)
    ok, errors = store_lines(s3_out)
    assert set(ok) | set(errors) == {r["custom_id"] for r in KILL_REQUESTS}
    assert same_lines((ok, errors), reference)


def test_sharded_job_on_s3_finalize_writes_the_jobs_files(tmp_path, tiny_model_dir, loaded, s3_out):
    (tmp_path / "in").mkdir()
    inputs = [write_requests(tmp_path / "in" / name, requests) for name, requests in FILES.items()]
    for index in range(2):
        run_job(config(inputs, s3_out, tiny_model_dir, max_new_tokens=4, num_shards=2, shard_index=index),
                loaded=loaded)
    shard_lines = [store_lines(f"{s3_out}/shard-{i}-of-2") for i in range(2)]
    store = open_store(s3_out)
    assert not store.exists("output.jsonl")  # the job's pair comes with finalize
    result = finalize_output(s3_out)
    ok, errors = store_lines(s3_out)
    assert set(ok) | set(errors) == {r["custom_id"] for requests in FILES.values() for r in requests}
    for shard_ok, shard_errors in shard_lines:
        for custom_id, line in {**shard_ok, **shard_errors}.items():
            assert without_created((ok | errors)[custom_id]) == without_created(line)
    assert result["openai_batch"]["files"] == {"output.jsonl": {"rows": 4}, "errors.jsonl": {"rows": 1}}
    assert json.loads(store.read_bytes(SUCCESS_FILE))["num_shards"] == 2
    compact_output(s3_out)  # every shard compacted, the job's pair written again
    assert store.exists(SUCCESS_FILE) and store_lines(s3_out) == (ok, errors)
