"""A Batch-file writer stopped before its rename leaves its temps behind; the next writer deletes
them, and never a live writer's (batchgen.jobs.openai.temp_files)."""

from __future__ import annotations

import pytest

from batchgen.io.manifest.manifest import load_manifest
from batchgen.io.store import local_files
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.openai.output import write_batch_files
from batchgen.jobs.openai.temp_files import open_held, sweep_dead_temps
from tests.jobs.openai.test_openai_batch_job import chat, job, read_lines


def temps(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


def test_a_stopped_writers_temps_are_swept_by_the_next(tmp_path, tiny_model_dir, loaded, monkeypatch):
    requests = [chat(f"r{i}", f"text {i}", max_tokens=2) for i in range(3)]
    run_job(job(tmp_path, requests, model_dir=tiny_model_dir, output_format="both"), loaded=loaded)
    out = tmp_path / "out"
    batch_dir = out / "_openai_batch"  # no recovery lists this directory: only the writer can sweep it

    def stop(point):
        if point == "batch_file_rename":
            raise KeyboardInterrupt  # as a kill: the writer's own clean-up does not run

    monkeypatch.setattr(local_files, "_fault_hook", stop)
    with pytest.raises(KeyboardInterrupt):
        write_batch_files(out, load_manifest(out), "_openai_batch")
    monkeypatch.setattr(local_files, "_fault_hook", None)
    assert len(temps(batch_dir)) == 2
    write_batch_files(out, load_manifest(out), "_openai_batch")
    assert temps(batch_dir) == []  # before: both stayed, one more pair per stopped writer
    ok, errors = read_lines(out, "_openai_batch")
    assert set(ok) | set(errors) == {"r0", "r1", "r2"}


def test_a_live_writers_temp_is_left_alone(tmp_path):
    live = tmp_path / ".output.jsonl.aaaa1111.tmp"
    dead = tmp_path / ".errors.jsonl.bbbb2222.tmp"
    dead.write_bytes(b"{}\n")
    other = tmp_path / ".part-00001.parquet.tmp"  # not a Batch file's: someone else's to recover
    other.write_bytes(b"x")
    users = tmp_path / ".output.jsonl.mine.tmp"  # not a name a writer gives: the directory may be the user's
    users.write_bytes(b"x")
    with open_held(live) as held:
        held.write(b"{}\n")
        assert sweep_dead_temps(tmp_path, ("output.jsonl", "errors.jsonl")) == [dead.name]
        assert live.exists() and other.exists() and users.exists()
    assert sweep_dead_temps(tmp_path, ("output.jsonl", "errors.jsonl")) == [live.name]
