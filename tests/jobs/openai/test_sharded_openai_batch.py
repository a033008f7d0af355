"""A sharded job over OpenAI Batch request files: each shard writes its own Batch files, and
`batchgen finalize` writes the job's from every shard's rows (batchgen.jobs.sharding.finalize)."""

from __future__ import annotations

import json

import pyarrow.dataset as ds
import pytest

from batchgen.errors import ShardsMismatch
from batchgen.jobs.commands.compact import compact_output
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.sharding.finalize import finalize_output
from tests.jobs.helpers import tiny_job_config
from tests.jobs.openai.test_openai_batch_job import chat, completion, read_lines, write_requests

FILES = {
    "a.jsonl": [chat("a1", "Hello there", max_tokens=3), completion("a2", "Once upon a time")],
    "b.jsonl": [chat("b1", "Tell me more"), {"custom_id": "b-url", "method": "POST", "url": "/v1/moderations",
                                             "body": {"input": "x", "model": "m"}}],
    "c.jsonl": [completion("c1", "1 2 3", max_tokens=2)],
}
ALL_IDS = {r["custom_id"] for requests in FILES.values() for r in requests}


@pytest.fixture
def inputs(tmp_path):
    (tmp_path / "in").mkdir()
    return [write_requests(tmp_path / "in" / name, requests) for name, requests in FILES.items()]


def run_shards(inputs, out, model_dir, loaded, num_shards, output_format="openai-batch", indices=None):
    for index in range(num_shards) if indices is None else indices:
        config = tiny_job_config(inputs, out, model_dir, input_format="openai-batch", output_format=output_format,
                                 max_new_tokens=4, num_shards=num_shards, shard_index=index)
        run_job(config, loaded=loaded)


def without_created(line: dict) -> dict:
    body = line["response"]["body"]
    return {**line, "response": {**line["response"], "body": {k: v for k, v in body.items() if k != "created"}}}


def test_finalize_writes_the_jobs_batch_files_from_every_shard(tmp_path, inputs, tiny_model_dir, loaded):
    out = tmp_path / "out"
    run_shards(inputs, out, tiny_model_dir, loaded, 2)
    shard_lines = [read_lines(out / f"shard-{i}-of-2") for i in range(2)]
    per_shard_ids = [set(ok) | set(errors) for ok, errors in shard_lines]
    assert not per_shard_ids[0] & per_shard_ids[1] and all(per_shard_ids)  # files whole, to one shard each
    assert not (out / "output.jsonl").exists()  # the job's pair comes with finalize

    result = finalize_output(out)
    ok, errors = read_lines(out)  # each line validated, each custom_id once
    assert set(ok) | set(errors) == ALL_IDS and set(errors) == {"b-url"}
    for shard_ok, shard_errors in shard_lines:  # the shards' lines, under the job's created time
        for custom_id, line in {**shard_ok, **shard_errors}.items():
            assert without_created((ok | errors)[custom_id]) == without_created(line)
    success = json.loads((out / "_SUCCESS").read_text())
    assert success["openai_batch"]["files"] == {"output.jsonl": {"rows": 4}, "errors.jsonl": {"rows": 1}}
    assert result["rows"] == 5

    first = (out / "output.jsonl").read_bytes()
    finalize_output(out)  # again: the same bytes
    assert (out / "output.jsonl").read_bytes() == first
    run_shards(inputs, out, tiny_model_dir, loaded, 2, indices=[0])  # a shard rerun beside the job's files
    finalize_output(out)
    compact_output(out)  # every shard compacted, the job's pair written again, created kept
    assert (out / "_SUCCESS").is_file() and read_lines(out) == (ok, errors)


def test_both_writes_the_jobs_pair_in_openai_batch_dir(tmp_path, inputs, tiny_model_dir, loaded):
    out = tmp_path / "out"
    run_shards(inputs, out, tiny_model_dir, loaded, 2, output_format="both")
    finalize_output(out)
    ok, errors = read_lines(out, "_openai_batch")
    assert set(ok) | set(errors) == ALL_IDS and not (out / "output.jsonl").exists()
    ids = ds.dataset(str(out), format="parquet").to_table().column("custom_id").to_pylist()
    assert sorted(ids) == sorted(ALL_IDS)  # the job's directory is still one Parquet dataset


def test_shards_with_other_output_formats_are_refused(tmp_path, inputs, tiny_model_dir, loaded):
    out = tmp_path / "out"
    run_shards(inputs, out, tiny_model_dir, loaded, 2)
    run_shards(inputs, out, tiny_model_dir, loaded, 2, output_format="parquet", indices=[1])
    with pytest.raises(ShardsMismatch, match="shard 1 was run with another --output-format"):
        finalize_output(out)
    assert not (out / "_SUCCESS").exists()


def test_a_custom_id_in_two_shards_is_refused_by_finalize(tmp_path, tiny_model_dir, loaded):
    (tmp_path / "in").mkdir()
    inputs = [write_requests(tmp_path / "in" / name, [chat("same", text)]) for name, text in
              (("a.jsonl", "one"), ("b.jsonl", "two"))]
    run_shards(inputs, tmp_path / "out", tiny_model_dir, loaded, 2)
    with pytest.raises(ShardsMismatch, match="'same' is committed by shard 0 and shard 1"):
        finalize_output(tmp_path / "out")
