"""An embed job under kill -9 and SIGTERM: every id exactly once after the resume, equal to an uninterrupted run.

Two `python -m batchgen run --task embed` jobs (tests/jobs/kill_harness.py's command, a tiny
sentence-transformers BERT from tests/jobs/encode_fixtures.py, --commit-every 8) run side by side,
so that the test pays one subprocess start: once each holds a committed part, one is SIGKILLed
and the other SIGTERMed. Both are then resumed in this process.
"""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest

from batchgen.config.job import build_config
from batchgen.jobs.commands.run import run_job
from tests.jobs.encode_fixtures import save_tiny_encoder_dir
from tests.jobs.helpers import write_random_texts
from tests.jobs.kill_harness import (
    COMMIT_EVERY,
    Fixture,
    check_committed,
    read_output,
    reaped,
    start_job,
    visible_ids,
    wait_until_a_part,
)

pytestmark = pytest.mark.soak  # kills, signals, fault injection or a local S3 server

NUM_ROWS = 1200


def embed_config(fixture: Fixture, out: Path):
    """The same job as kill_harness.job_args, run in this process."""
    return build_config(None, inputs=[str(fixture.src)], output=str(out), model=str(fixture.model_dir),
                        id_column="id", device="cpu", dtype="float32", task="embed", batch_size=16,
                        commit_every_rows=COMMIT_EVERY, quiet=True)


def assert_equal_to_reference(out: Path, reference: dict) -> None:
    ids = visible_ids(out)
    assert len(ids) == len(set(ids)) == NUM_ROWS and set(ids) == set(reference)
    final = read_output(out)
    for i, want in reference.items():
        got = final[i]
        assert got["prompt_hash"] == want["prompt_hash"]
        a, b = np.asarray(got["embedding"]), np.asarray(want["embedding"])
        assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) >= 0.9999, i


def test_embed_job_kill_9_and_sigterm_then_resume_give_every_id_once(tmp_path, one_thread):
    fixture = Fixture(Path(save_tiny_encoder_dir(tmp_path / "tiny-st")),
                      write_random_texts(tmp_path / "in.parquet", NUM_ROWS, seed=0, max_chars=90, row_group_size=64),
                      NUM_ROWS, task="embed")
    killed, stopped = tmp_path / "killed", tmp_path / "stopped"
    with reaped(start_job(fixture, killed)) as kill_proc, reaped(start_job(fixture, stopped)) as term_proc:
        assert wait_until_a_part(kill_proc, killed) and wait_until_a_part(term_proc, stopped)
        kill_proc.send_signal(signal.SIGKILL)
        term_proc.send_signal(signal.SIGTERM)
        kill_proc.wait(timeout=60)
        term_proc.wait(timeout=60)
    kill_err, term_err = (p.stderr.read().decode(errors="replace") for p in (kill_proc, term_proc))
    assert kill_proc.returncode == -signal.SIGKILL, kill_err
    assert term_proc.returncode == 143 and "interrupted by SIGTERM" in term_err, term_err

    reference_out = tmp_path / "reference"
    run_job(embed_config(fixture, reference_out))
    reference = read_output(reference_out)
    for out in (killed, stopped):
        committed = check_committed(out)  # every listed part readable, matching its checksum
        ids = visible_ids(out)
        assert len(ids) == len(set(ids)) and set(ids) <= committed and 0 < len(committed) < NUM_ROWS
        summary = run_job(embed_config(fixture, out))
        assert summary.num_rows_skipped == len(committed) and summary.num_rows == NUM_ROWS - len(committed)
        assert_equal_to_reference(out, reference)
