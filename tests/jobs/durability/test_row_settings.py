"""A row's own settings (--max-new-tokens-column, --sampling-column) are part of its key.

Under --id-column a committed row is kept while its prompt hash is; a hash of the prompt's
tokens alone would keep the old row under a changed per-row budget or sampling cell, and continue
a partial generation under the new settings. In-process, tiny random Llama.
"""

from __future__ import annotations

import json
import os
import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import JobInterrupted
from batchgen.io.manifest.manifest import load_manifest
from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import committed_rows, tiny_job_config

NUM_ROWS = 6
TEXTS = [f"row {i} " + "ab" * i for i in range(NUM_ROWS)]


def write(path, **columns):
    pq.write_table(pa.table({"id": list(range(NUM_ROWS)), "text": TEXTS, **columns}), path)
    return path


def config(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, **{**dict(id_column="id", max_new_tokens=4, ignore_eos=True,
                                                          batch_size=3, commit_every_rows=2), **overrides})


def test_a_changed_row_budget_is_generated_again(tiny_model_dir, loaded, tmp_path):
    src = write(tmp_path / "in.parquet", budget=[2] * NUM_ROWS)
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, max_new_tokens_column="budget"), loaded=loaded)
    before = committed_rows(out)
    assert {r["num_generated_tokens"] for r in before.values()} == {2}
    write(src, budget=[2, 2, 5, 2, None, 2])  # row 4: null, the job's 4
    summary = run_job(config(src, out, tiny_model_dir, max_new_tokens_column="budget"), loaded=loaded)
    assert (summary.num_rows, summary.num_rows_changed, summary.num_rows_skipped) == (2, 2, NUM_ROWS - 2)
    after = committed_rows(out)
    assert [after[i]["num_generated_tokens"] for i in range(NUM_ROWS)] == [2, 2, 5, 2, 4, 2]
    assert {i: r for i, r in after.items() if i not in (2, 4)} == {i: r for i, r in before.items() if i not in (2, 4)}
    again = run_job(config(src, out, tiny_model_dir, max_new_tokens_column="budget"), loaded=loaded)
    assert (again.num_rows, again.num_rows_changed) == (0, 0)


def test_a_changed_sampling_cell_is_generated_again(tiny_model_dir, loaded, tmp_path):
    cells = [json.dumps({"temperature": 1.0, "top_k": 5})] * NUM_ROWS
    src = write(tmp_path / "in.parquet", sampling=cells)
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, sampling_column="sampling", seed=3), loaded=loaded)
    before = committed_rows(out)
    cells[1] = json.dumps({"temperature": 1.0, "top_k": 6})
    cells[3] = None  # back to the job's greedy settings
    write(src, sampling=cells)
    summary = run_job(config(src, out, tiny_model_dir, sampling_column="sampling", seed=3), loaded=loaded)
    assert (summary.num_rows, summary.num_rows_changed) == (2, 2)
    after = committed_rows(out)
    assert after[1]["prompt_hash"] != before[1]["prompt_hash"] and after[3]["prompt_hash"] != before[3]["prompt_hash"]
    assert {i: after[i] for i in (0, 2, 4, 5)} == {i: before[i] for i in (0, 2, 4, 5)}


def test_a_row_on_the_job_settings_keeps_the_hash_of_its_tokens(tiny_model_dir, loaded, tmp_path):
    """A budget equal to the job's is no setting of the row's own: its hash is the one a job
    without the column writes, so rows committed before their settings were hashed still count."""
    src = write(tmp_path / "in.parquet", budget=[4] * NUM_ROWS)
    with_column = tmp_path / "with"
    run_job(config(src, with_column, tiny_model_dir, max_new_tokens_column="budget"), loaded=loaded)
    without = tmp_path / "without"
    run_job(config(src, without, tiny_model_dir), loaded=loaded)
    assert ({i: r["prompt_hash"] for i, r in committed_rows(with_column).items()}
            == {i: r["prompt_hash"] for i, r in committed_rows(without).items()})


@pytest.fixture
def harmless_late_signal():
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_partial_made_under_other_row_settings_is_not_continued(tiny_model_dir, loaded, tmp_path, one_thread,
                                                                  harmless_late_signal):
    src = write(tmp_path / "in.parquet", budget=[40] * NUM_ROWS)
    out = tmp_path / "out"
    # nothing committed before the signal: the rows in flight are left as partials
    cfg = dict(max_new_tokens_column="budget", max_new_tokens=40, commit_every_rows=1000, stop_grace_s=0)
    from batchgen.engine.engine import LLMEngine

    real_step, steps = LLMEngine.step, []

    def step(self):
        steps.append(1)
        if len(steps) == 20:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self)

    LLMEngine.step = step
    try:
        with pytest.raises(JobInterrupted):
            run_job(config(src, out, tiny_model_dir, **cfg), loaded=loaded)
    finally:
        LLMEngine.step = real_step
    state = load_manifest(out)
    assert state.num_committed_rows == 0 and state.partials["num_rows"] == 3
    write(src, budget=[30] * NUM_ROWS)  # the same job, every row's own budget changed
    summary = run_job(config(src, out, tiny_model_dir, **cfg), loaded=loaded)
    assert summary.num_rows_continued == 0
    assert summary.num_sampled_tokens == NUM_ROWS * 30
    assert {r["num_generated_tokens"] for r in committed_rows(out).values()} == {30}
