"""Two writers of a job's OpenAI Batch files never corrupt them: each writes temps of its own,
and finalize and compact hold the output's lock (batchgen.jobs.openai.output, batchgen.jobs.sharding.finalize)."""

from __future__ import annotations

import json

import pytest

from batchgen.errors import OutputLocked
from batchgen.io.manifest.manifest import load_manifest
from batchgen.io.store import local_files
from batchgen.jobs.openai.output import write_batch_files
from batchgen.jobs.sharding.finalize import finalize_output
from tests.jobs.openai.test_openai_batch_job import read_lines
from tests.jobs.openai.test_sharded_openai_batch import ALL_IDS, inputs, run_shards  # noqa: F401 (a fixture)


def during_first_rename(monkeypatch, action):
    """Run `action` once, when the first writer is about to rename its first file into place."""
    fired = []

    def hook(point: str) -> None:
        if point == "batch_file_rename" and not fired:
            fired.append(True)
            action()

    monkeypatch.setattr(local_files, "_fault_hook", hook)


def test_two_writers_of_the_batch_files_each_rename_a_whole_file(tmp_path, inputs, tiny_model_dir, loaded,  # noqa: F811
                                                                 monkeypatch):
    out = tmp_path / "out"
    run_shards(inputs, out, tiny_model_dir, loaded, 1)
    shard = out / "shard-0-of-1"
    state = load_manifest(shard)
    during_first_rename(monkeypatch, lambda: write_batch_files(shard, state, "."))
    write_batch_files(shard, state, ".")  # before: the other writer's rename took this one's temp
    monkeypatch.setattr(local_files, "_fault_hook", None)
    ok, errors = read_lines(shard)
    assert set(ok) | set(errors) == ALL_IDS
    assert not [p for p in shard.iterdir() if p.name.endswith(".tmp")]


def test_a_second_finalize_while_one_writes_is_refused(tmp_path, inputs, tiny_model_dir, loaded,  # noqa: F811
                                                      monkeypatch):
    out = tmp_path / "out"
    run_shards(inputs, out, tiny_model_dir, loaded, 2)
    refused = []

    def second_finalize() -> None:
        with pytest.raises(OutputLocked) as e:  # before: it wrote the same temps under the first
            finalize_output(out)
        refused.append(e.value)

    during_first_rename(monkeypatch, second_finalize)
    finalize_output(out)
    monkeypatch.setattr(local_files, "_fault_hook", None)
    assert refused
    ok, errors = read_lines(out)  # every line whole JSON, each custom_id once
    assert set(ok) | set(errors) == ALL_IDS
    assert json.loads((out / "_SUCCESS").read_text())["rows"] == len(ALL_IDS)
    assert not (out / "_batchgen.lock").exists()
