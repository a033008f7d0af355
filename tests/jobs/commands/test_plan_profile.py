"""`batchgen plan` without a calibration run: its time from a machine profile (stored by `--calibrate`,
else the built-in CPU one), nothing generated; and its engine sized as the run sizes its own, so the
plan's KV cache and batch size are the run's."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.engine.engine import LLMEngine
from batchgen.jobs.commands.plan import plan_job, plan_lines
from batchgen.jobs.commands.run import run_job
from batchgen.jobs.pipeline import core
from batchgen.jobs.planning import profile
from tests.jobs.helpers import tiny_job_config


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " + "word " * (3 * i) for i in range(12)]}), path)
    return path


@pytest.fixture(autouse=True)
def profiles(tmp_path, monkeypatch):
    directory = tmp_path / "profiles"
    monkeypatch.setattr(profile, "profiles_dir", lambda: directory)
    return directory


def job(src, out, model_dir, **overrides):
    return tiny_job_config(src, out, model_dir, **{"chat": False, "max_new_tokens": 6, "kv_cache_memory": "64MiB",
                                                   **overrides})


def test_a_plan_generates_nothing_unless_asked_to_calibrate(src, tiny_model_dir, loaded, monkeypatch, profiles):
    steps = []
    real_step = LLMEngine.step

    def step(self):
        steps.append(1)
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    fast = plan_job(job(src, None, tiny_model_dir), loaded=loaded)
    assert steps == [] and fast["calibration"] is None
    assert fast["profile"]["source"] == "built-in" and fast["estimated_seconds"] > 0
    assert any("from the built-in CPU profile" in line for line in plan_lines(fast))

    measured = plan_job(job(src, None, tiny_model_dir), loaded=loaded, calibrate=True, calibration_rows=4)
    assert steps and measured["profile"]["source"] == "calibrated" and len(list(profiles.iterdir())) == 1
    steps.clear()
    again = plan_job(job(src, None, tiny_model_dir), loaded=loaded)  # the stored profile: no steps
    assert steps == [] and again["profile"]["source"] == "stored"
    assert again["profile"]["ms_per_token"] == measured["profile"]["ms_per_token"]
    assert again["estimated_seconds"] == measured["estimated_seconds"]
    assert any("this machine's stored profile, calibrated" in line for line in plan_lines(again))


def test_the_plans_kv_cache_and_batch_size_are_the_runs(src, tiny_model_dir, loaded, tmp_path, monkeypatch):
    engines = []
    real_build = core.build_engine

    def build(*args, **kwargs):
        engines.append(real_build(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr(core, "build_engine", build)
    report = plan_job(job(src, None, tiny_model_dir), loaded=loaded)
    planned = engines.pop()
    run_job(job(src, tmp_path / "out", tiny_model_dir), loaded=loaded)
    ran = engines[0]
    assert report["kv"]["cache_tokens"] == planned.kv_capacity_tokens == ran.kv_capacity_tokens
    assert [s["batch_size"] for s in report["windows"]] == [ran.limits.max_num_seqs]
