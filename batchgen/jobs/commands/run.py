"""`batchgen run`: input rows -> prompts -> engine -> committed Parquet parts, resumable.

Order of work, so that a mistake costs nothing: check the config and the inputs (including one
pass over the id column: duplicate or null ids), then lock the output directory, finish or undo
what a crashed run left there, and compare the config fingerprint with the one it was begun with
(no model loaded yet); then load the model and stream.

Rows whose prompt cannot be built (null, empty or non-text prompt, a cell that is not valid
text, a bad per-row limit, too long with --on-long-prompt error) become error rows: the job
completes and commits exactly one output row per input row.

Finished rows are committed every --commit-every rows and every --commit-every-seconds
(batchgen.io.manifest.manifest describes a commit), so a crash loses at most that much work. Running the
same command again resumes: committed rows are skipped by id, error rows are generated again
(unless --no-retry-errors) and replace their old row. `_SUCCESS` is written last, once every
input row has a committed output row and the error rate is within --max-error-rate; a rerun
removes an earlier one before it changes anything (before the model loads where the ids show that
rows will change; under --id-column, else, once the first changed prompt is built).
SIGTERM / SIGINT commit the finished rows and exit 143 / 130 (batchgen.jobs.durability.signals).
One shard of a sharded job (--num-shards, batchgen.jobs.rows.split) is such a job over its share of
the input, in OUTPUT/shard-I-of-N/.

Rows reach the engine through the length planner (batchgen.jobs.planning.planner): windows of rows, each
planned with predicted output lengths, a run order and a mode, which the job core
(batchgen.jobs.pipeline.core) runs: one engine at a time, a static rerun where a continuous engine fails.
This module is the local executor around that core: the reader feeds it, and each finished row
goes to the committer, the progress line and the output-length predictor, whose state is saved
with each commit (`_length_model.json`).
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from batchgen.config.constraint import writes_json_valid
from batchgen.config.job import OPENAI_BATCH, JobConfig
from batchgen.engine.model.model_files import model_files_identity
from batchgen.errors import ErrorRateExceeded, JobInterrupted, OutputError
from batchgen.io.manifest.manifest import (
    check_parts_present,
    clear_success,
    fingerprint_digest,
    is_job_dir,
    load_manifest,
    write_success,
)
from batchgen.io.store.schema import output_schema
from batchgen.io.store.writers import json_bytes
from batchgen.jobs.commands.prompt_check import model_files_unchanged, nothing_to_do
from batchgen.jobs.durability.fingerprint import job_fingerprint
from batchgen.jobs.durability.resume import ResumeRule
from batchgen.jobs.durability.scan import InputScan
from batchgen.jobs.durability.session import SUMMARY_FILE, OutputSession
from batchgen.jobs.durability.signals import Interrupt, SignalGuard
from batchgen.jobs.encoding.task_setup import embed_model_for_schema, is_encode_task, task_schema_args
from batchgen.jobs.executors.start import STAGES, import_before_lock, start_job
from batchgen.jobs.openai.batch_file import check_batch_file_target, clear_batch_file
from batchgen.jobs.openai.batch_task import resolve_batch_task
from batchgen.jobs.pipeline.context_check import check_room_for_prompts
from batchgen.jobs.pipeline.empty_input import input_is_empty
from batchgen.jobs.pipeline.prepare import open_inputs
from batchgen.jobs.pipeline.summary import RunSummary, plural
from batchgen.jobs.sharding.sharded import check_job_output, shard_output_dir

if TYPE_CHECKING:
    from batchgen.engine.encode.load import EncodeModel
    from batchgen.engine.model.loader import LoadedModel

log = logging.getLogger("batchgen")

# after a signal, in-flight checkpoints are written only with this much of the grace budget left
# (a write is one JSON file and one manifest entry: milliseconds, unless the disk is stalling)
MIN_SECONDS_FOR_CHECKPOINT = 1.0

__all__ = ["SUMMARY_FILE", "RunSummary", "run_job"]


def writes_sample_index(config: JobConfig, session: OutputSession) -> bool:
    """One output row per sample (a sample_index column): with --n > 1, and in a job whose rows may
    ask for n themselves (a --sampling-column, OpenAI Batch requests) unless its directory was begun
    without the column. The Ray executor writes the same schema, one sample per row (rules.py refuses
    its --n, and a row asking for more is an error row there)."""
    per_row = config.sampling_column is not None or config.input_format == OPENAI_BATCH
    return config.n > 1 or (per_row and session.writes_sample_index())


def run_job(config: JobConfig, *, loaded: LoadedModel | EncodeModel | None = None) -> RunSummary:
    """Run (or resume) one job to completion; raises BatchgenError subclasses for user mistakes.
    `loaded`: the model already loaded (an EncodeModel for --task embed, score or classify)."""
    resolve_batch_task(config)  # a Batch file of /v1/embeddings requests runs as --task embed
    if not is_encode_task(config):  # embed, score and classify keep no room for output tokens
        check_room_for_prompts(config)  # from the model's files: no input read, no model loaded
    inputs = open_inputs(config)
    empty = input_is_empty(config, inputs)  # an empty partition: exit 0 without a model (or 2, if refused)
    source, scan = inputs.source, inputs.scan
    out: str | Path = config.output  # a local directory or an s3:// / gs:// prefix (batchgen.io.store.store)
    if config.num_shards is not None:  # one shard of a sharded job: OUTPUT/shard-I-of-N/ (a directory or prefix)
        check_job_output(config.output, config.num_shards)
        out = shard_output_dir(config.output, config.shard_index, config.num_shards)
    check_batch_file_target(config.output, overwrite=config.overwrite)  # a .jsonl --output: not someone's file
    session = OutputSession(out, overwrite=config.overwrite, keep_hashes=config.id_column is not None)
    session.model_files = model_files_identity(config.model, config.dtype)
    if not empty:  # yet after every check that needs no lock
        import_before_lock(config, needs_model=lambda: _needs_model(config, inputs, session))
    summary: RunSummary | None = None
    stage = "opening the output directory"  # what an interrupt stopped, for its message
    with SignalGuard(config.stop_grace_s or None) as guard:
        try:
            try:
                with guard.critical():
                    session.open()
                loaded = embed_model_for_schema(config, session, loaded)  # if the files cannot tell its size
                schema = output_schema(source.id_field, source.passthrough_fields,
                                       with_prompt_hash=session.writes_prompt_hash(),
                                       with_prompt_truncated=session.writes_prompt_truncated(),
                                       # generated tokens' columns: an embed Batch job (/v1/embeddings) has none
                                       with_logprobs=not is_encode_task(config) and (config.logprobs is not None or (
                                           config.input_format == OPENAI_BATCH and session.writes_logprobs())),
                                       with_json_valid=not is_encode_task(config) and writes_json_valid(config) and (
                                           config.input_format != OPENAI_BATCH or session.writes_json_valid()),
                                       with_sample_index=writes_sample_index(config, session),
                                       with_adapter=bool(config.lora), **task_schema_args(config, session, loaded))
                session.check_fingerprint(job_fingerprint(config, source, schema))  # before a model is loaded
                session.check_inputs(scan, id_column=config.id_column)
                if empty:
                    with guard.critical():
                        summary = _empty_input(config, session, scan, job_fingerprint(config, source, schema))
                    return summary
                resume = ResumeRule(session.state, config.retry_errors, check_prompts=config.id_column is not None)
                if not config.overwrite and nothing_to_do(config, inputs, resume, session.model_files):
                    with guard.critical():
                        summary = _nothing_to_do(config, session, scan)
                    return summary
                if config.overwrite or not ResumeRule(session.state, config.retry_errors,
                                                      check_prompts=False).nothing_to_do(inputs):
                    with guard.critical():  # rows will change: the old _SUCCESS no longer holds
                        _clear_success(config, session)
                stage, running = STAGES[config.executor]
                job = start_job(config, inputs, loaded, session, guard, schema,
                                on_change=lambda: _clear_success(config, session))
                stage = running
                try:
                    summary = job.run(scan)
                except BaseException:
                    with guard.critical():
                        _write_partial(session, job.summary)
                    raise
                with guard.critical():
                    _finish(config, session, summary)
            finally:
                with guard.critical():
                    session.close()
        except Interrupt as stop:
            if summary is not None and summary.complete:
                return summary  # the signal came after the job was done: nothing is left to stop
            state = session.state if session.manifest is not None else None
            committed = f"{plural(state.num_committed_rows, 'row')} committed so far" if state is not None else (
                "nothing was written")
            raise JobInterrupted(stop.signum, f"interrupted by {signal.Signals(stop.signum).name} while {stage}; "
                                 f"{committed}; run the same command again to resume") from None
    return summary


def _clear_success(config: JobConfig, session: OutputSession) -> None:
    """This run changes rows: no _SUCCESS may claim the output complete meanwhile, neither the
    directory's nor, for a shard, the sharded job's (a kill before the first commit would leave it)."""
    clear_success(session.store)
    if config.num_shards is not None:
        clear_success(config.output)
    clear_batch_file(config.output)  # a .jsonl --output's file says the job completed, as _SUCCESS does


def _needs_model(config: JobConfig, inputs, session: OutputSession) -> bool:
    """Read-only, before the lock: False when the run will end without a model (a directory that
    will be refused, a job with nothing left to do), read as `batchgen status` reads a live job."""
    store = session.store
    if session.foreign_names():
        return False
    if config.overwrite or not is_job_dir(store):
        return True
    check_prompts = config.id_column is not None
    state = load_manifest(store, keep_hashes=check_prompts)
    return not (model_files_unchanged(state, session.model_files)
                and ResumeRule(state, config.retry_errors, check_prompts).nothing_to_do(inputs))


def _nothing_to_do(config: JobConfig, session: OutputSession, scan: InputScan) -> RunSummary:
    """A rerun over a job whose every input row is committed: no model, no new commit; the
    summary and _SUCCESS are written as by any run (also after a crash between the last commit
    and _SUCCESS)."""
    summary = RunSummary(output_dir=str(session.out_dir), model=config.model or "default", mode=config.mode,
                         nothing_to_do=True, num_rows_skipped=session.state.num_committed_rows)
    if config.id_column is not None:  # its rows may have moved or gone since the last run: status says so
        session.record_inputs(scan, config.max_rows)
    _finish(config, session, summary)
    return summary


def _empty_input(config: JobConfig, session: OutputSession, scan: InputScan, fingerprint: dict) -> RunSummary:
    """An input without rows: the job begins (or resumes) as any job does, so that status and a rerun
    read it, and is complete at once; no model, no commit; the summary and _SUCCESS as by any run."""
    session.start(fingerprint, scan, config.max_rows)
    summary = RunSummary(output_dir=str(session.out_dir), model=config.model or "default", mode=config.mode,
                         empty_input=True, num_rows_skipped=session.state.num_committed_rows)
    _finish(config, session, summary)
    return summary


def _write_partial(session: OutputSession, summary: RunSummary) -> None:
    """_summary.json of a run that stopped early (a signal, an error), marked partial, so the logs
    and sensors of the task that ran it see how far it got. Best effort: the stop's own error wins."""
    state = session.state
    summary.partial, summary.complete = True, False
    summary.output_rows = state.num_committed_rows
    summary.output_rows_error = len(state.error_ids)
    try:
        session.store.write_bytes(SUMMARY_FILE, json_bytes(summary.to_dict()))
    except OutputError as e:
        log.warning("could not write the partial %s: %s", SUMMARY_FILE, e)


def _finish(config: JobConfig, session: OutputSession, summary: RunSummary) -> None:
    """Write _summary.json, then _SUCCESS (last) unless the error rate fails the job."""
    state = session.state
    session.manifest.sweep()  # _SUCCESS vouches for the listing: no part there that no entry commits
    summary.output_rows = state.num_committed_rows
    summary.output_rows_error = len(state.error_ids)
    rate = config.max_error_rate
    failed = (rate is not None and summary.output_rows
              and summary.output_rows_error / summary.output_rows > rate)
    summary.complete = not failed
    session.store.write_bytes(SUMMARY_FILE, json_bytes(summary.to_dict()))
    success: dict = {"rows": summary.output_rows, "rows_error": summary.output_rows_error,
                     "fingerprint": fingerprint_digest(state.fingerprint), "finished": time.time()}
    if config.output_format != "parquet":  # a local directory or an object-store prefix
        from batchgen.jobs.openai.output import SUCCESS_KEY, ensure_batch_files

        success[SUCCESS_KEY] = ensure_batch_files(session.store, state, config.output_format, failed=failed)
    if failed:
        clear_success(session.store)  # an earlier run's, written under a laxer --max-error-rate
        raise ErrorRateExceeded(f"{summary.output_rows_error} of {summary.output_rows} rows failed, more than "
                                f"--max-error-rate {rate} (1 accepts any share); the output is in "
                                f"{session.out_dir} (no _SUCCESS)")
    check_parts_present(session.store, state)  # and every part that _SUCCESS vouches for is there
    write_success(session.store, success)
