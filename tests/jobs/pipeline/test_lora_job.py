"""A job of rows on several LoRA adapters (--lora NAME=DIR, --lora-column): each row runs its own
adapter in one engine, says which in the `adapter` column, and an adapter's content is part of the
job's fingerprint and of its rows' prompt hashes. In-process, tiny random Llama, float32."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.errors import ConfigError, FingerprintMismatch, JobInterrupted
from batchgen.io.manifest.manifest import load_manifest
from batchgen.jobs.commands.run import run_job
from tests.jobs.helpers import committed_rows, tiny_job_config
from tests.lora_adapters import make_adapter, make_adapters
from tests.tiny import make_tiny_model

TEXTS = ["the cat sat", "a b c d e", "hello there", "lorem ipsum dolor", "xyz", "one two three four"]
ADAPTERS = ["attn4", None, "all16", "mlp8", "", "attn4"]  # "": the base model too


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_adapters(make_tiny_model("llama"), tmp_path_factory.mktemp("lora"))  # tiny_model_dir's weights


def write(path, adapters, column: str | None = "adapter"):
    ids = list(range(len(adapters)))
    columns = {"id": ids, "text": [TEXTS[i % len(TEXTS)] for i in ids]}
    if column is not None:
        columns[column] = adapters
    pq.write_table(pa.table(columns), path)
    return path


def config(src, out, model_dir, lora, **overrides):
    return tiny_job_config(src, out, model_dir, **{**dict(id_column="id", max_new_tokens=6, ignore_eos=True,
                                                          lora=lora), **overrides})


def test_rows_run_their_own_adapter(tiny_model_dir, loaded, dirs, tmp_path):
    src = write(tmp_path / "in.parquet", [*ADAPTERS, "nope"])
    mixed = tmp_path / "mixed"
    run_job(config(src, mixed, tiny_model_dir, dirs, lora_column="adapter", max_error_rate=None), loaded=loaded)
    rows = committed_rows(mixed)
    assert [rows[i]["adapter"] for i in range(len(ADAPTERS))] == [a or None for a in ADAPTERS]
    error = rows[len(ADAPTERS)]
    assert error["finish_reason"] == "error" and error["adapter"] is None
    assert error["error"] == (f"{src}, row {len(ADAPTERS)}, column 'adapter': unknown LoRA adapter 'nope' "
                              "(loaded: attn4, all16, mlp8)")
    # each row as a job of its adapter alone (one --lora, no column: every row), and of the base model
    plain = write(tmp_path / "plain.parquet", ADAPTERS, column=None)
    alone = {None: committed_rows(_run(plain, tmp_path / "base", tiny_model_dir, loaded, {}))}
    for name in ("attn4", "all16", "mlp8"):
        alone[name] = committed_rows(_run(plain, tmp_path / name, tiny_model_dir, loaded, {name: dirs[name]}))
    for i, adapter in enumerate(ADAPTERS):
        expected = alone[adapter or None][i]
        assert rows[i]["generated_text"] == expected["generated_text"], (i, adapter)
        assert rows[i]["prompt_hash"] == expected["prompt_hash"], (i, adapter)
    for i, adapter in enumerate(ADAPTERS):
        if adapter:  # the adapter changes the text, and the hash records it
            assert rows[i]["generated_text"] != alone[None][i]["generated_text"], i
            assert rows[i]["prompt_hash"] != alone[None][i]["prompt_hash"], i


def _run(src, out, model_dir, loaded, lora):
    run_job(config(src, out, model_dir, lora), loaded=loaded)
    return out


def test_an_adapter_changed_on_disk_is_refused(tiny_model_dir, loaded, dirs, tmp_path):
    adapter = tmp_path / "ad"
    shutil.copytree(dirs["attn4"], adapter)
    src = write(tmp_path / "in.parquet", ADAPTERS[:2], column=None)
    out = tmp_path / "out"
    run_job(config(src, out, tiny_model_dir, {"ad": str(adapter)}, max_rows=1), loaded=loaded)
    make_adapter(make_tiny_model("llama"), adapter, seed=9, r=4, target_modules=["q_proj"])  # retrained
    with pytest.raises(FingerprintMismatch, match="lora") as info:
        run_job(config(src, out, tiny_model_dir, {"ad": str(adapter)}), loaded=loaded)
    assert info.value.exit_code == 2


def test_refusals_before_the_model_loads(tiny_model_dir, dirs, tmp_path):
    src = write(tmp_path / "in.parquet", ADAPTERS)
    with pytest.raises(ConfigError, match="3 adapters loaded .* no --lora-column"):
        config(src, tmp_path / "a", tiny_model_dir, dirs)
    with pytest.raises(ConfigError, match="--lora-column .* load them with --lora NAME=DIR"):
        config(src, tmp_path / "b", tiny_model_dir, {}, lora_column="adapter")
    with pytest.raises(ConfigError, match="expected NAME=DIR, got 'nameonly'"):
        config(src, tmp_path / "c", tiny_model_dir, ["nameonly"])
    parsed = config(src, tmp_path / "d", tiny_model_dir, [f"x={dirs['mlp8']}"])  # the flag's spelling
    assert parsed.lora == {"x": dirs["mlp8"]}
    dora = make_adapter(make_tiny_model("llama"), tmp_path / "dora", seed=1, r=4, target_modules=["q_proj"],
                        use_dora=True)
    with pytest.raises(ConfigError, match=r"--lora d: DoRA \(use_dora\)=True is not supported"):
        run_job(config(write(tmp_path / "plain.parquet", ADAPTERS, column=None), tmp_path / "e", tiny_model_dir,
                       {"d": str(dora)}))  # no model given: none loaded


def test_an_openai_batch_model_names_its_adapter(tiny_model_dir, loaded, dirs, tmp_path):
    src = tmp_path / "requests.jsonl"
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": "the cat sat", "max_tokens": 5}}
             for i, model in enumerate(["mlp8", "some-model", "all16"])]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    run_job(tiny_job_config(src, out, tiny_model_dir, input_format="openai-batch", lora=dirs, ignore_eos=True),
            loaded=loaded)
    rows = committed_rows(out, id_column="custom_id")
    assert [rows[f"r{i}"]["adapter"] for i in range(3)] == ["mlp8", None, "all16"]
    assert len({rows[f"r{i}"]["generated_text"] for i in range(3)}) == 3


def test_plan_counts_the_adapters_memory(tiny_model_dir, loaded, dirs, tmp_path):
    from batchgen.jobs.commands.plan import plan_job

    src = write(tmp_path / "in.parquet", ADAPTERS)
    result = plan_job(config(src, None, tiny_model_dir, dirs, lora_column="adapter"), loaded=loaded)
    # float32: (r x in + out x r) x 4 bytes per wrapped projection (tests/tiny.py: hidden 64, MLP 128, 2 layers)
    assert result["lora"]["attn4"] == {"rank": 4, "layers": 4, "bytes": 2 * (4 * 64 + 64 * 4 + 4 * 64 + 32 * 4) * 4}
    assert result["lora"]["all16"]["layers"] == 14 and result["lora"]["mlp8"]["layers"] == 8


@pytest.fixture
def harmless_late_signal():
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_rows_stopped_mid_generation_continue_on_their_adapter(tiny_model_dir, loaded, dirs, tmp_path, one_thread,
                                                               harmless_late_signal):
    from batchgen.engine.engine import LLMEngine

    src = write(tmp_path / "in.parquet", ADAPTERS)
    cfg = dict(lora_column="adapter", max_new_tokens=30, commit_every_rows=1000, stop_grace_s=0, batch_size=3)
    whole = tmp_path / "whole"
    run_job(config(src, whole, tiny_model_dir, dirs, **cfg), loaded=loaded)
    out = tmp_path / "out"
    real_step, steps = LLMEngine.step, []

    def step(self):
        steps.append(1)
        if len(steps) == 12:  # rows of several adapters are in flight
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self)

    LLMEngine.step = step
    try:
        with pytest.raises(JobInterrupted):
            run_job(config(src, out, tiny_model_dir, dirs, **cfg), loaded=loaded)
    finally:
        LLMEngine.step = real_step
    assert load_manifest(out).partials["num_rows"] >= 2
    summary = run_job(config(src, out, tiny_model_dir, dirs, **cfg), loaded=loaded)
    assert summary.num_rows_continued >= 2
    assert committed_rows(out) == committed_rows(whole)


@pytest.mark.soak
def test_kill_9_after_a_commit_then_resume_is_exactly_once(tiny_model_dir, loaded, dirs, tmp_path):
    from tests.jobs.kill_harness import JOB_ENV, reaped, sigkill, wait_until_a_part

    adapters = [ADAPTERS[i % len(ADAPTERS)] for i in range(24)]
    src = write(tmp_path / "in.parquet", adapters)
    cfg = dict(lora_column="adapter", max_new_tokens=24, commit_every_rows=4, batch_size=4)
    whole = tmp_path / "whole"
    run_job(config(src, whole, tiny_model_dir, dirs, **cfg), loaded=loaded)
    out = tmp_path / "out"
    lora = [arg for name, path in dirs.items() for arg in ("--lora", f"{name}={path}")]
    argv = [sys.executable, "-m", "batchgen", "run", "--input", str(src), "--output", str(out), "--model",
            str(tiny_model_dir), "--id-column", "id", "--device", "cpu", "--dtype", "float32", "--kv-cache-memory",
            "16MiB", "--max-new-tokens", "24", "--ignore-eos", "--batch-size", "4", "--commit-every", "4", "--quiet",
            *lora, "--lora-column", "adapter"]
    with reaped(subprocess.Popen(argv, env={**os.environ, **JOB_ENV}, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE)) as proc:
        assert wait_until_a_part(proc, out), proc.stderr.read().decode()[-2000:]
        assert sigkill(proc)
    committed = load_manifest(out).num_committed_rows
    assert 0 < committed < len(adapters)
    summary = run_job(config(src, out, tiny_model_dir, dirs, **cfg), loaded=loaded)
    assert summary.num_rows_skipped == committed
    assert committed_rows(out) == committed_rows(whole)  # every id once, each on its own adapter


def test_sharded_runs_give_each_row_once_on_its_adapter(tiny_model_dir, loaded, dirs, tmp_path):
    from batchgen.jobs.sharding.finalize import finalize_output

    adapters = [ADAPTERS[i % len(ADAPTERS)] for i in range(14)]
    src = write(tmp_path / "in.parquet", adapters)
    whole = tmp_path / "whole"
    run_job(config(src, whole, tiny_model_dir, dirs, lora_column="adapter"), loaded=loaded)
    out = tmp_path / "out"
    for index in range(3):
        run_job(config(src, out, tiny_model_dir, dirs, lora_column="adapter", num_shards=3, shard_index=index),
                loaded=loaded)
    finalize_output(out)
    rows = {}
    for index in range(3):
        shard = committed_rows(out / f"shard-{index}-of-3")
        assert shard and not set(shard) & set(rows), "a row in two shards"
        rows |= shard
    expected = committed_rows(whole)
    assert sorted(rows) == list(range(len(adapters)))
    for i, adapter in enumerate(adapters):
        assert rows[i]["adapter"] == (adapter or None)
        for column in ("generated_text", "prompt_hash"):
            assert rows[i][column] == expected[i][column], (i, adapter, column)
