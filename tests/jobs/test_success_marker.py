"""`_SUCCESS` never outlives the output it vouches for (issue 34, item 8).

A rerun that will change rows takes the old `_SUCCESS` down before it changes anything (it used to
stay up until the first commit, and for good after a kill before it), and `batchgen finalize`
checks each shard's `_SUCCESS` against the shard's manifest instead of trusting it.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.engine.engine import LLMEngine
from batchgen.errors import ShardsIncomplete
from batchgen.io.manifest.manifest import SUCCESS_FILE, load_manifest
from batchgen.jobs.commands.finalize import finalize_output
from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import tiny_job_config

TEXTS = [f"row {i} " + "ab" * i for i in range(8)]


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
