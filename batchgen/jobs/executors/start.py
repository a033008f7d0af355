"""Which executor runs a `batchgen run` job (--executor), and its start once every check has passed:
the local one (this process, generation or an encode task) or Ray (ray/), each a job whose
`run(scan)` generates and commits the rows."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import pyarrow as pa

from batchgen.config.job import JobConfig
from batchgen.io.manifest.manifest import clear_success
from batchgen.jobs.durability.session import OutputSession
from batchgen.jobs.durability.signals import SignalGuard
from batchgen.jobs.encoding.task_setup import is_encode_task, load_encode_model_for
from batchgen.jobs.pipeline.prepare import JobInputs

if TYPE_CHECKING:
    from batchgen.engine.encode.load import EncodeModel
    from batchgen.engine.model.loader import LoadedModel

log = logging.getLogger("batchgen")

# what an interrupt stopped, by executor: while the job starts, then while it runs
STAGES = {"local": ("loading the model", "generating"), "ray": ("generating on Ray", "generating on Ray")}


def import_before_lock(config: JobConfig, *, needs_model: Callable[[], bool]) -> None:
    """The local executor's torch and transformers, imported before the output's lock where the run
    `needs_model`, so that holding the lock means "past the imports" (tests/jobs/kill_harness.py
    relies on it); Ray's actors import theirs."""
    if config.executor != "local" or not needs_model():
        return
    from batchgen.engine.model.hf_imports import keep_torchao_out

    keep_torchao_out(config)  # no torchao import (and its warnings) for a job that does not use it
    import batchgen.engine.model.loader  # noqa: F401
    import batchgen.jobs.executors.local  # noqa: F401
    if is_encode_task(config):
        import batchgen.jobs.executors.local_encode  # noqa: F401


def start_job(config: JobConfig, inputs: JobInputs, loaded: LoadedModel | EncodeModel | None,
              session: OutputSession, guard: SignalGuard, schema: pa.Schema, *, on_change: Callable[[], None]):
    """The executor's job, begun. `on_change`: a row about to change, which takes the _SUCCESS down."""
    if config.executor == "ray":
        # the actors load the model; the job begins once they report its fingerprint
        from batchgen.jobs.executors.ray.driver import RayJob

        return RayJob(config, inputs, session, guard, schema)
    return _local_job(config, inputs, loaded, session, guard, schema, on_change)


def _local_job(config: JobConfig, inputs: JobInputs, loaded: LoadedModel | EncodeModel | None,
               session: OutputSession, guard: SignalGuard, schema: pa.Schema, on_change: Callable[[], None]):
    """Load the model (unless given), build the local executor and begin the job."""
    # torch and transformers load here, once every check has passed (seconds on their own)
    from batchgen.engine.model.loader import load_model
    from batchgen.jobs.executors.local import LocalJob

    if is_encode_task(config):  # embed, score, classify: the encode engine (batchgen.engine.encode)
        from batchgen.jobs.executors.local_encode import EncodeJob

        job = EncodeJob(config, inputs, loaded if loaded is not None else load_encode_model_for(config), session,
                        guard, schema)
    else:
        if loaded is None:
            loaded = load_model(config.model, device=config.device, dtype=config.dtype,
                                trust_remote_code=config.trust_remote_code, quantize=config.quantize,
                                quantize_backend=config.quantize_backend,
                                quantize_embedding=config.quantize_embedding)
        job = LocalJob(config, inputs, loaded, session, guard, schema)
    # --id-column rows are settled by their prompt hash, known once the prompt is built: the first
    # row found changed (or an error row) takes the _SUCCESS down, before it is generated
    job.job.on_change = on_change
    with guard.critical():
        if config.num_shards is not None:  # this shard's rows may change: the set is not final
            clear_success(config.output)
        session.start(job.fingerprint, inputs.scan, config.max_rows)
    if session.state.num_committed_rows:
        log.info("resuming %s: %d rows committed earlier (%d errors)", session.out_dir,
                 session.state.num_committed_rows, len(session.state.error_ids))
    return job
