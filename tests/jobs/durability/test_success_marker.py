"""`_SUCCESS` never outlives the output it vouches for.

A rerun that will change rows takes the old `_SUCCESS` down before it changes anything (not at
its first commit, which a kill may never let come), and `batchgen finalize`
checks each shard's `_SUCCESS` against the shard's manifest instead of trusting it.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.engine.engine import LLMEngine
from batchgen.errors import OutputError, ShardsIncomplete
from batchgen.io.manifest.manifest import SUCCESS_FILE, Manifest, load_manifest, write_success
from batchgen.io.store.store import LocalStore
from batchgen.io.store.writers import PartWriter
from batchgen.jobs.commands.compact import compact_output
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.durability.commit import Committer
from batchgen.jobs.sharding.finalize import finalize_output
from tests.jobs.helpers import committed_rows, tiny_job_config

TEXTS = [f"row {i} " + "ab" * i for i in range(8)]
ROWS_SCHEMA = pa.schema([("id", pa.int64()), ("error", pa.string()), ("text", pa.string())])


class HardKill(BaseException):
    """kill -9 at an engine step: nothing of the job catches it."""


@pytest.fixture
def kill_at_step(monkeypatch):
    def arm(n: int) -> None:
        real_step, steps = LLMEngine.step, []

        def step(self):
            steps.append(1)
            if len(steps) == n:
                raise HardKill
            return real_step(self)

        monkeypatch.setattr(LLMEngine, "step", step)
    return arm


def write(path, texts):
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path)
    return path


def config(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, **{**dict(max_new_tokens=3, batch_size=2, commit_every_rows=2),
                                                   **overrides})


def test_a_rerun_that_adds_rows_takes_success_down_before_it_generates(tiny_model_dir, loaded, tmp_path,
                                                                       kill_at_step):
    src = write(tmp_path / "in.parquet", TEXTS)
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, max_rows=4), loaded=loaded)
    assert (out / SUCCESS_FILE).exists()
    kill_at_step(1)  # the rest of the rows: killed at its first step, before any commit
    with pytest.raises(HardKill):
        run_job(config(src, out, tiny_model_dir), loaded=loaded)
    assert load_manifest(out).num_committed_rows == 4
    assert not (out / SUCCESS_FILE).exists()  # 4 rows of 8: the output is not complete


def test_a_changed_prompt_under_id_column_takes_success_down(tiny_model_dir, loaded, tmp_path, kill_at_step):
    src = write(tmp_path / "in.parquet", TEXTS)
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, id_column="id"), loaded=loaded)
    run_job(config(src, out, tiny_model_dir, id_column="id"), loaded=loaded)  # nothing changed: it stays
    assert (out / SUCCESS_FILE).exists()
    write(src, [*TEXTS[:-1], "an edited last row"])
    kill_at_step(1)
    with pytest.raises(HardKill):
        run_job(config(src, out, tiny_model_dir, id_column="id"), loaded=loaded)
    assert not (out / SUCCESS_FILE).exists()  # row 7's committed output is not the current input's


def test_finalize_checks_a_shards_success_against_its_manifest(tiny_model_dir, loaded, tmp_path, kill_at_step):
    src = write(tmp_path / "in.parquet", TEXTS)
    out = tmp_path / "out"
    for index in range(2):
        run_job(config(src, out, tiny_model_dir, num_shards=2, shard_index=index), loaded=loaded)
    shard = out / "shard-0-of-2"
    old_success = (shard / SUCCESS_FILE).read_bytes()
    kill_at_step(5)  # an --overwrite rerun of shard 0, killed after its first commit
    with pytest.raises(HardKill):
        run_job(config(src, out, tiny_model_dir, num_shards=2, shard_index=0, overwrite=True,
                       commit_every_rows=1), loaded=loaded)
    assert 0 < load_manifest(shard).num_committed_rows < 4
    (shard / SUCCESS_FILE).write_bytes(old_success)  # a _SUCCESS a run of an older batchgen left up
    with pytest.raises(ShardsIncomplete, match=r"shard 0 of 2 .* does not match its manifest: rows 4") as e:
        finalize_output(out)
    assert e.value.exit_code == 4 and not (out / SUCCESS_FILE).exists()
    (shard / SUCCESS_FILE).write_bytes(b"")  # one without figures (another writer's): re-derived
    with pytest.raises(ShardsIncomplete, match=r"rows committed of the 4 its last run read"):
        finalize_output(out)
    run_job(config(src, out, tiny_model_dir, num_shards=2, shard_index=0), loaded=loaded)  # resumed
    assert finalize_output(out)["rows"] == len(TEXTS)


def lose_a_part_before_success(monkeypatch) -> None:
    """A committed part vanishes after the job's last commit and sweep (deleted by a writer that lost
    the output while paused): the job did not delete it and its manifest still commits it."""
    real_sweep = Manifest.sweep

    def sweep(self):
        swept = real_sweep(self)
        self.store.delete(sorted(self.state.parts)[0])
        return swept

    monkeypatch.setattr(Manifest, "sweep", sweep)


def test_no_success_over_a_committed_part_that_is_gone(tiny_model_dir, loaded, tmp_path, monkeypatch):
    src = write(tmp_path / "in.parquet", TEXTS)
    out = tmp_path / "out"
    real_sweep = Manifest.sweep
    lose_a_part_before_success(monkeypatch)
    with pytest.raises(OutputError, match=r"1 committed part\(s\) holding 2 rows are missing") as e:
        run_job(config(src, out, tiny_model_dir), loaded=loaded)  # before: _SUCCESS over 6 of 8 rows
    assert e.value.exit_code == 2 and not (out / SUCCESS_FILE).exists()
    monkeypatch.setattr(Manifest, "sweep", real_sweep)
    run_job(config(src, out, tiny_model_dir), loaded=loaded)  # the rerun generates the lost rows again
    assert (out / SUCCESS_FILE).exists() and sorted(committed_rows(out)) == list(range(len(TEXTS)))


def test_finalize_refuses_a_shard_whose_committed_part_is_gone(tiny_model_dir, loaded, tmp_path):
    src = write(tmp_path / "in.parquet", TEXTS)
    out = tmp_path / "out"
    for index in range(2):
        run_job(config(src, out, tiny_model_dir, num_shards=2, shard_index=index), loaded=loaded)
    shard = out / "shard-1-of-2"
    (shard / sorted(load_manifest(shard).parts)[0]).unlink()  # after the shard's _SUCCESS
    with pytest.raises(ShardsIncomplete, match=r"shard 1 of 2 .* committed part\(s\) holding 2 rows are missing"):
        finalize_output(out)  # before: _SUCCESS over 6 of 8 rows
    assert not (out / SUCCESS_FILE).exists()
    run_job(config(src, out, tiny_model_dir, num_shards=2, shard_index=1), loaded=loaded)  # regenerated
    assert finalize_output(out)["rows"] == len(TEXTS)


def test_compact_writes_no_success_over_a_committed_part_that_is_gone(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "out")
    store.root.mkdir()
    with store.lock() as lock:
        manifest = Manifest(store, guard=lock)
        manifest.begin({"k": 1})
        committer = Committer(manifest, PartWriter(store, ROWS_SCHEMA), "id", rows_per_part=2)
        for i in range(4):
            committer.add({"id": i, "error": None, "text": f"row {i}"}, "in.parquet", i)
        committer.commit()
        write_success(store, {"rows": 4})
    lose_a_part_before_success(monkeypatch)
    with pytest.raises(OutputError, match=r"1 committed part\(s\) holding 4 rows are missing"):
        compact_output(store)  # before: _SUCCESS over no part at all
    assert not store.exists(SUCCESS_FILE)
