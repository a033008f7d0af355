"""Sharded jobs end to end on the tiny model: N shard runs + finalize = the unsharded job, row for row;
finalize, status and compact over the set; a changed split or odd shard is refused by name."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import ConfigError, InputsChanged, OutputError, ShardsIncomplete, ShardsMismatch
from batchgen.jobs.commands.compact import compact_output
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.commands.status import job_status, status_lines
from batchgen.jobs.sharding.finalize import finalize_output
from tests.jobs.helpers import committed_rows, tiny_job_config

MAX_NEW = 4


@pytest.fixture
def inputs(tmp_path):
    """Two Parquet files (one large, several row groups) and a JSON Lines file: 40 rows."""
    big = tmp_path / "in" / "big.parquet"
    big.parent.mkdir()
    pq.write_table(pa.table({"text": [f"row {i} of big" for i in range(25)]}), big, row_group_size=4)
    small = tmp_path / "in" / "small.parquet"
    pq.write_table(pa.table({"text": [f"small {i}" for i in range(6)]}), small)
    lines = tmp_path / "in" / "more.jsonl"
    lines.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(9)))
    return [big, small, lines]


def config(inputs, out, model_dir, **overrides):
    return tiny_job_config(inputs, out, model_dir, **{"chat": False, "max_new_tokens": MAX_NEW, **overrides})


def run_shards(inputs, out, model_dir, loaded, num_shards, **overrides):
    for index in range(num_shards):
        run_job(config(inputs, out, model_dir, num_shards=num_shards, shard_index=index, **overrides), loaded=loaded)


@pytest.mark.parametrize("files", [slice(0, 2), slice(0, 3)], ids=["parquet", "mixed"])
def test_sharded_job_equals_the_unsharded_one_row_for_row(tmp_path, inputs, tiny_model_dir, loaded, files):
    run_job(config(inputs[files], tmp_path / "one", tiny_model_dir), loaded=loaded)
    run_shards(inputs[files], tmp_path / "sharded", tiny_model_dir, loaded, 3)
    assert not (tmp_path / "sharded" / "_SUCCESS").exists()
    result = finalize_output(tmp_path / "sharded")
    assert (tmp_path / "sharded" / "_SUCCESS").is_file() and result["num_shards"] == 3
    one = committed_rows(tmp_path / "one", "row_id")
    sharded = committed_rows(tmp_path / "sharded", "row_id")  # every shard's parts, read as one dataset
    assert result["rows"] == len(sharded) == len(one)
    assert {k: v["generated_text"] for k, v in sharded.items()} == {k: v["generated_text"] for k, v in one.items()}
    if files == slice(0, 2):  # by rows: the big file is cut, and the shards are even
        counts = [s["rows"] for s in result["shards"]]
        assert max(counts) - min(counts) <= 1
        assert len({s["fingerprint"] for s in job_status(tmp_path / "sharded")["job_shards"]}) == 1


def test_finalize_names_the_missing_the_incomplete_and_the_odd_shard(tmp_path, inputs, tiny_model_dir, loaded):
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="no shard directories"):
        finalize_output(tmp_path)
    run_job(config(inputs[:2], out, tiny_model_dir, num_shards=3, shard_index=0), loaded=loaded)
    with pytest.raises(ShardsIncomplete, match=r"2 of 3 shards never started.*--shard-index 1, 2") as e:
        finalize_output(out)
    assert e.value.exit_code == 4
    status = job_status(out)
    assert status["state"] == "incomplete" and status["shards_complete"] == 1
    assert [s["state"] for s in status["job_shards"]] == ["complete", "not started", "not started"]
    assert any("shard 1: not started" in line for line in status_lines(status))

    # shard 1 under other settings: refused by finalize, naming the shard and the setting
    run_job(config(inputs[:2], out, tiny_model_dir, num_shards=3, shard_index=1, max_new_tokens=MAX_NEW + 1),
            loaded=loaded)
    run_job(config(inputs[:2], out, tiny_model_dir, num_shards=3, shard_index=2), loaded=loaded)
    with pytest.raises(ShardsMismatch, match=r"shard-1-of-3 was run with other settings.*max_new_tokens 4 -> 5"):
        finalize_output(out)
    assert job_status(out)["fingerprints_differ"]
    run_job(config(inputs[:2], out, tiny_model_dir, num_shards=3, shard_index=1, overwrite=True), loaded=loaded)
    finalize_output(out)
    assert job_status(out)["state"] == "complete"


def test_a_shard_stopped_early_is_named_until_it_is_resumed(tmp_path, inputs, tiny_model_dir, loaded):
    out = tmp_path / "out"
    run_shards(inputs[:2], out, tiny_model_dir, loaded, 2)
    (out / "shard-1-of-2" / "_SUCCESS").unlink()  # as a shard killed after its last commit leaves it
    with pytest.raises(ShardsIncomplete, match=r"shard 1 of 2 .* did not complete"):
        finalize_output(out)
    assert job_status(out)["state"] == "incomplete"
    run_job(config(inputs[:2], out, tiny_model_dir, num_shards=2, shard_index=1), loaded=loaded)  # the retry
    assert finalize_output(out)["rows"] == 31


def test_a_changed_split_is_refused_by_the_shard_and_by_finalize(tmp_path, inputs, tiny_model_dir, loaded):
    out = tmp_path / "out"
    run_shards(inputs[:1], out, tiny_model_dir, loaded, 2)
    # a file added before shard 1 is retried moves the split: its committed rows' ids would move too
    with pytest.raises(InputsChanged, match=r"the split changed"):
        run_job(config(inputs[:2], out, tiny_model_dir, num_shards=2, shard_index=1), loaded=loaded)
    run_job(config(inputs[:2], out, tiny_model_dir, num_shards=2, shard_index=1, overwrite=True), loaded=loaded)
    with pytest.raises(ShardsMismatch, match="read other input files"):
        finalize_output(out)


def test_a_sharded_id_column_retry_over_changed_inputs_is_refused(tmp_path, tiny_model_dir, loaded):
    """--id-column lets inputs change between runs, but a shard's share follows the inputs: its
    retry would run over the moved split, generating ids another shard holds and missing others."""
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": [f"a {i}" for i in range(6)], "id": list(range(6))}), a)
    pq.write_table(pa.table({"text": [f"b {i}" for i in range(6)], "id": list(range(100, 106))}), b)
    out = tmp_path / "out"
    run_shards([a, b], out, tiny_model_dir, loaded, 2, id_column="id")  # shard 0 reads a, shard 1 b
    pq.write_table(pa.table({"text": [f"b {i}!" for i in range(6)], "id": list(range(100, 106))}), b)
    with pytest.raises(InputsChanged, match=rf"shard 1 of 2.*{b}: .*modified since") as e:  # its own file
        run_job(config([a, b], out, tiny_model_dir, num_shards=2, shard_index=1, id_column="id"), loaded=loaded)
    assert e.value.exit_code == 2 and "--overwrite" in str(e.value)
    with pytest.raises(InputsChanged, match="shard 0 of 2.*files of other shards changed"):
        run_job(config([a, b], out, tiny_model_dir, num_shards=2, shard_index=0, id_column="id"), loaded=loaded)
    more = tmp_path / "more.parquet"
    pq.write_table(pa.table({"text": ["c"], "id": [200]}), more)
    with pytest.raises(InputsChanged, match=rf"{more}: a new input|the split changed"):
        run_job(config([a, b, more], out, tiny_model_dir, num_shards=2, shard_index=1, id_column="id"),
                loaded=loaded)


def test_ids_in_two_shards_are_refused(tmp_path, tiny_model_dir, loaded):
    src = tmp_path / "dup.parquet"
    pq.write_table(pa.table({"text": ["a", "b", "c", "d"], "id": [1, 2, 3, 1]}), src)
    out = tmp_path / "out"
    run_shards([src], out, tiny_model_dir, loaded, 2, id_column="id")  # each shard's own ids are unique
    with pytest.raises(ShardsMismatch, match=r"row 1 is committed by shard 0 and shard 1"):
        finalize_output(out)


def test_compact_rewrites_every_shard_and_keeps_the_job_done(tmp_path, inputs, tiny_model_dir, loaded):
    out = tmp_path / "out"
    run_shards(inputs[:2], out, tiny_model_dir, loaded, 2, rows_per_part=3)
    with pytest.raises(OutputError, match="not finalized"):
        compact_output(out)
    finalize_output(out)
    before = committed_rows(out, "row_id")
    result = compact_output(out)
    assert result.num_parts_after == 3 < result.num_parts_before  # big cut in two, small whole
    assert (out / "_SUCCESS").is_file() and committed_rows(out, "row_id") == before


def test_output_directories_of_other_jobs_are_refused(tmp_path, inputs, tiny_model_dir, loaded):
    run_job(config(inputs[:1], tmp_path / "plain", tiny_model_dir), loaded=loaded)
    with pytest.raises(OutputError, match="unsharded job"):
        run_job(config(inputs[:1], tmp_path / "plain", tiny_model_dir, num_shards=2, shard_index=0), loaded=loaded)
    with pytest.raises(OutputError, match="unsharded job"):
        finalize_output(tmp_path / "plain")
    run_job(config(inputs[:1], tmp_path / "two", tiny_model_dir, num_shards=2, shard_index=0), loaded=loaded)
    with pytest.raises(OutputError, match="2-shard split"):
        run_job(config(inputs[:1], tmp_path / "two", tiny_model_dir, num_shards=3, shard_index=0), loaded=loaded)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="notes.txt"):
        run_job(config(inputs[:1], tmp_path / "other", tiny_model_dir, num_shards=2, shard_index=0), loaded=loaded)
    with pytest.raises(ConfigError, match="needs --num-shards"):
        config(inputs[:1], tmp_path / "x", tiny_model_dir, shard_index=0)


def test_plan_plans_one_shards_share(tmp_path, inputs, tiny_model_dir, loaded):
    from batchgen.jobs.commands.plan import plan_job

    shares = [plan_job(config(inputs[:2], tmp_path / "out", tiny_model_dir, num_shards=2, shard_index=i),
                       loaded=loaded, calibration_rows=0)["num_rows"] for i in range(2)]
    assert shares == [15, 16]


@pytest.mark.soak
def test_a_shard_stopped_by_sigterm_commits_exits_143_and_its_retry_resumes(tmp_path, inputs, tiny_model_dir, loaded,
                                                                           monkeypatch):
    """What an Airflow task timeout or a cleared task does to a shard, then the task's retry."""
    import os
    import signal

    from batchgen.engine.engine import LLMEngine
    from batchgen.errors import JobInterrupted
    from batchgen.io.manifest.manifest import load_manifest

    out = tmp_path / "out"
    real_step, steps = LLMEngine.step, []

    def step(self):
        steps.append(1)
        if len(steps) == 6:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    shard0 = config(inputs[:2], out, tiny_model_dir, num_shards=2, shard_index=0, batch_size=2, commit_every_rows=2)
    with pytest.raises(JobInterrupted) as info:
        run_job(shard0, loaded=loaded)
    assert info.value.exit_code == 143
    committed = load_manifest(out / "shard-0-of-2").num_committed_rows
    assert 0 < committed < 15
    monkeypatch.setattr(LLMEngine, "step", real_step)
    run_job(config(inputs[:2], out, tiny_model_dir, num_shards=2, shard_index=1), loaded=loaded)
    with pytest.raises(ShardsIncomplete, match=rf"shard 0 of 2 .* stopped after committing {committed} rows"):
        finalize_output(out)
    summary = run_job(shard0, loaded=loaded)  # the retry: the same command
    assert summary.num_rows_skipped == committed
    assert finalize_output(out)["rows"] == 31 == len(committed_rows(out, "row_id"))
