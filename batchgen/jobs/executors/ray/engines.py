"""The kept-warm engines (`--ray-keep-warm`): actors that each hold one loaded model and generate any job's batches.

`--executor ray` generates in a Ray Data actor pool (batchgen.jobs.executors.ray.stages.GenerateActor), whose actors
live and die with one dataset execution: every job on a running cluster pays the actors' imports
(torch, transformers) and model loads again. With `ray_keep_warm_s` the driver uses these instead:
named, detached actors (namespace "batchgen", named by `engine_key` and their index) that outlive
the job, so the next job with the same model on the same cluster finds them with their model loaded
and its imports done. An engine idle for `ray_keep_warm_s` seconds ends itself, giving its CPUs or
GPU back.

An EngineActor loads the model once (`__init__`) and then generates batches of every job whose
model load settings match, building the job's BatchGenerator (batchgen.jobs.pipeline.batch_fn: prompt side,
engine, KV cache) on its first batch. A batch arrives as references to the blocks Ray Data read
(batchgen.jobs.executors.ray.block_refs), which the engine fetches itself: the driver does not carry input rows.

The key covers what the loaded model depends on: the load settings (model, device, dtype,
quantization, trust_remote_code), the actor's resources, the model files' sizes and modification
times, and batchgen's own source files (an engine never serves a job with code or weights older than
the driver's). Anything else in the config is per job: it reaches the engine with each batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.config.job import JobConfig
from batchgen.jobs.executors.ray.block_refs import BlockSlices, fetch
from batchgen.jobs.executors.ray.stages import (
    MODEL_FINGERPRINT,  # the actor pool's column, so the driver reads both alike
)

NAMESPACE = "batchgen"
# the task and an embed model's pooling / normalization / cut are load settings too: an embed engine
# holds an EncodeModel built with them (batchgen.engine.encode.load), not a generation engine's model
LOAD_SETTINGS = ("model", "device", "dtype", "trust_remote_code", "quantize", "quantize_backend",
                 "quantize_embedding", "task", "pooling", "normalize", "dimensions")
JOBS_KEPT = 4  # BatchGenerators an engine keeps: jobs sharing it at once do not rebuild theirs per batch


@dataclass(slots=True)
class JobSpec:
    """What an engine needs to generate one job's batches: put in the object store once per job."""

    token: str  # unique per run of a job: its BatchGenerator is built once
    config: JobConfig
    schema: pa.Schema


def load_settings(config: JobConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in LOAD_SETTINGS}


def engine_key(config: JobConfig, resources: dict[str, Any]) -> str:
    """Which warm engines may serve `config`'s job: see the module docstring."""
    parts = {"load": load_settings(config), "resources": resources, "model_files": _model_files(config.model),
             "code": _code_files()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def engine_name(key: str, index: int) -> str:
    return f"engine-{key}-{index}"


def _stats(paths: list[Path]) -> list[list]:
    out = []
    for p in sorted(paths):
        st = p.stat()
        out.append([str(p), st.st_size, st.st_mtime_ns])
    return out


def _model_files(model: str | None) -> list[list]:
    """Sizes and mtimes of a local model's files (a hub id or the default model: none; those change
    only with a new revision, which load_model resolves the same way on every load)."""
    if model is None:
        return []
    path = Path(os.path.expanduser(model))
    try:
        if path.is_file():
            return _stats([path])
        if path.is_dir():
            return _stats([p for p in path.iterdir() if p.is_file()])
    except OSError:
        pass
    return []


def _code_files() -> list[list]:
    import batchgen

    root = Path(batchgen.__file__).parent
    return _stats(list(root.rglob("*.py")))


class EngineActor:
    """One model on a Ray worker; `generate` takes any job's batch. Wrapped by ray.remote on the driver."""

    def __init__(self, config: JobConfig, keep_warm_s: float | None):
        logging.getLogger("batchgen").setLevel(logging.WARNING)  # the driver logs the job
        from batchgen.jobs.encoding.task_setup import load_for_task

        self.loaded = load_for_task(config)  # a generation model, or an EncodeModel for embed / score / classify
        self.jobs: dict[str, tuple[Any, str]] = {}  # token -> (BatchGenerator, its model fingerprint JSON)
        self.lock = threading.Lock()
        self.last_used = time.monotonic()
        self.busy = False
        if keep_warm_s:
            threading.Thread(target=self._end_when_idle, args=(keep_warm_s,), daemon=True).start()

    def ready(self) -> int:
        """Answers once the model is loaded: the driver sends batches to ready engines first."""
        return os.getpid()

    def generate(self, job: JobSpec, rows: BlockSlices | pa.Table) -> pa.Table:
        with self.lock:
            self.busy = True
        try:
            generator, fingerprint = self._job(job)
            out = generator(fetch(rows))
            return out.append_column(pa.field(MODEL_FINGERPRINT, pa.string()),
                                     pa.array([fingerprint] * out.num_rows, pa.string()))
        finally:
            with self.lock:
                self.busy = False
                self.last_used = time.monotonic()

    def _job(self, job: JobSpec) -> tuple[Any, str]:
        if job.token not in self.jobs:
            from batchgen.jobs.encoding.task_setup import batch_generator_for

            while len(self.jobs) >= JOBS_KEPT:  # the oldest job's (dicts keep insertion order)
                self.jobs.pop(next(iter(self.jobs)))
            generator = batch_generator_for(job.config, schema=job.schema, loaded=self.loaded)
            self.jobs[job.token] = (generator, json.dumps(generator.model_fingerprint, sort_keys=True))
        return self.jobs[job.token]

    def _end_when_idle(self, keep_warm_s: float) -> None:
        import ray

        while True:
            time.sleep(min(keep_warm_s, 5.0))
            with self.lock:
                if self.busy or time.monotonic() - self.last_used < keep_warm_s:
                    continue
            # a batch sent just now fails with the actor's death: the driver makes the engine again
            try:
                ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
                time.sleep(30.0)
            finally:
                os._exit(0)  # ray.kill did not end this process (it is not restarted either way)
