"""The local executor: one run in this process, from the reader through the job core into commits.

Each finished row goes to the committer, the progress line and the output-length predictor,
whose state is saved with each commit (`_length_model.json`). batchgen.jobs.commands.run builds it once
the job's checks have passed and the model is loaded; this module imports torch.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pyarrow as pa

from batchgen.config.choices import Policy
from batchgen.config.constraint import job_constraint
from batchgen.config.job import JobConfig
from batchgen.engine.model.loader import LoadedModel
from batchgen.engine.request import Completion, Continuation
from batchgen.errors import OutputError
from batchgen.io.manifest.manifest import fingerprint_digest
from batchgen.io.manifest.partials import PartialRow
from batchgen.io.store.schema import ADAPTER, JSON_VALID, LOGPROBS, PROMPT_HASH, PROMPT_TRUNCATED, SAMPLE_INDEX
from batchgen.io.store.writers import PartWriter
from batchgen.jobs.durability.commit import Committer
from batchgen.jobs.durability.commit_schedule import CommitSchedule
from batchgen.jobs.durability.fingerprint import job_fingerprint, model_fingerprint
from batchgen.jobs.durability.inflight import InFlightCheckpoints
from batchgen.jobs.durability.resume import ResumeRule
from batchgen.jobs.durability.scan import InputScan
from batchgen.jobs.durability.session import OutputSession
from batchgen.jobs.durability.signals import Interrupt, SignalGuard
from batchgen.jobs.executors.watch import watch_run
from batchgen.jobs.pipeline.batch_fn import output_row
from batchgen.jobs.pipeline.core import JobCore
from batchgen.jobs.pipeline.logprob_column import LogprobColumn
from batchgen.jobs.pipeline.prepare import JobInputs, prepare_job, seq_token_needs
from batchgen.jobs.pipeline.progress import Progress
from batchgen.jobs.pipeline.summary import RunSummary
from batchgen.jobs.planning.duplicates import reuse_counts
from batchgen.jobs.rows.planned_row import PlannedRow
from batchgen.jobs.rows.row_constraint import json_valid
from batchgen.jobs.rows.rows import InputRow
from batchgen.monitor.eta import PredictedWork, WorkMeter
from batchgen.monitor.job import JobMonitor

log = logging.getLogger("batchgen")

# after a signal, in-flight checkpoints are written only with this much of the grace budget left
# (a write is one JSON file and one manifest entry: milliseconds, unless the disk is stalling)
MIN_SECONDS_FOR_CHECKPOINT = 1.0


class LocalJob:
    """One run in this process: rows from the reader through the job core into committed parts."""

    def __init__(self, config: JobConfig, inputs: JobInputs, loaded: LoadedModel, session: OutputSession,
                 guard: SignalGuard, schema: pa.Schema):
        self.config = config
        self.session = session
        self.guard = guard
        self.with_sample_index = SAMPLE_INDEX in schema.names
        self.core = JobCore(config, loaded, continuations_for=self.continuations_for, between_steps=self.between_steps,
                            refuse_samples=None if self.with_sample_index else self.refuse_samples)
        self.checkpoints: InFlightCheckpoints | None = None  # once the job began (session.start)
        self.checkpoint_every_s = config.checkpoint_in_flight_every_s or None
        self.last_checkpoint = time.monotonic()
        self.core.engines.seq_token_needs = seq_token_needs(config, inputs, loaded,
                                                            ResumeRule(session.state, config.retry_errors,
                                                                       config.id_column is not None))
        # prompts and plans are sized for the first engine; only the slot keeps it, so that a mode
        # switch frees its KV cache
        first = self.core.engines.get(config.engine_policy())
        self.job = prepare_job(config, inputs, loaded, first, out_dir=session.store, state=session.state)
        source = inputs.source
        self.with_prompt_hash = PROMPT_HASH in schema.names
        self.with_prompt_truncated = PROMPT_TRUNCATED in schema.names
        self.logprobs = LogprobColumn(loaded.tokenizer) if LOGPROBS in schema.names else None
        self.with_json_valid = JSON_VALID in schema.names
        self.with_adapter = ADAPTER in schema.names
        self.constraint = job_constraint(config)  # a row's own (PlannedRow.constraint) wins
        self.fingerprint = job_fingerprint(config, source, schema, model=model_fingerprint(loaded, self.job.builder))
        self.commits = CommitSchedule(Committer(session.manifest, PartWriter(session.store, schema),
                                                source.id_field.name, rows_per_part=config.rows_per_part),
                                      guard, config, save_with_commit=self.save_lengths)
        self.id_name = source.id_field.name
        self.passthrough = [f.name for f in source.passthrough_fields]
        self.summary = RunSummary(output_dir=str(session.out_dir), model=loaded.name, mode=config.mode)
        self.progress: Progress | None = None
        self.num_rows_to_do = 0  # this run's input rows: all of them less those a previous run settled
        self.meter = WorkMeter(self.predicted_work)  # prompt and output tokens done and left: the ETA
        self.finished_output_tokens = [0, 0]  # finished rows' (predicted, generated) output tokens
        self.monitor: JobMonitor | None = None  # the metrics (batchgen.monitor), from run() on

    def run(self, scan: InputScan) -> RunSummary:
        self.core.engines.add_listener(self.meter.on_step)
        self.monitor, self.progress, self.num_rows_to_do = watch_run(
            self.config, self.session, scan, num_rows_done=self.job.resume.num_rows_done, context=self.core.context,
            meter=self.meter, add_listener=self.core.engines.add_listener)
        self.commits.monitor = self.monitor
        started = time.monotonic()
        self.checkpoints = InFlightCheckpoints(self.session.manifest, fingerprint_digest(self.fingerprint))
        try:
            plans = self.job.planner.plans(self.job.rows(on_error=self.failed))
            with self.guard.deferred():  # a signal stops the job between engine steps (between_steps)
                for planned, completions in self.core.generate(plans):
                    self.finished(planned, completions)
            with self.guard.critical():
                self.commits.commit()
                self.checkpoints.write([])  # drops the partials of rows that finished
        except Interrupt:
            with self.guard.critical():
                self.commits.commit()  # the rows that finished before the signal, first
                self.checkpoint_in_flight(stopping=True)
            raise
        except Exception as e:
            if not isinstance(e, OutputError):  # an engine failure: keep the work that did finish
                try:
                    self.commits.commit()
                    self.checkpoint_in_flight(stopping=True)
                except OutputError:
                    log.warning("could not commit the %d finished rows", len(self.commits))
            raise
        finally:
            self.progress.close()
            self._fill_summary(time.monotonic() - started)
            if self.monitor is not None:
                with self.guard.critical():  # the last seconds' records: a signal now must not cut them
                    self.monitor.close()
        return self.summary

    def continuations_for(self, planned: PlannedRow) -> dict[int, Continuation]:
        checkpoints = self.checkpoints
        if checkpoints is None or not checkpoints.saved:
            return {}
        return checkpoints.continuations_for(planned.row.row_id, planned.prompt_hash)

    def between_steps(self) -> None:
        """Between two engine steps: stop here on a signal, and checkpoint rows in flight when due."""
        self.guard.raise_if_interrupted()
        if self.summary.first_token_time is None and self.core.engines.num_sampled_tokens():
            self.summary.first_token_time = time.time()
        if self.checkpoint_every_s is not None and time.monotonic() - self.last_checkpoint >= self.checkpoint_every_s:
            with self.guard.critical():
                self.checkpoint_in_flight(stopping=False)

    def checkpoint_in_flight(self, *, stopping: bool) -> None:
        """Commit every in-flight row's tokens so far (batchgen.jobs.durability.inflight). Between steps only:
        a row's tokens and its random state are whole there."""
        if self.checkpoints is None:
            return
        left = self.guard.seconds_left()
        if stopping and left < MIN_SECONDS_FOR_CHECKPOINT:
            log.warning("no time left to checkpoint rows in flight (%.1f s of the grace budget): they start over "
                        "on resume", max(left, 0.0))
            return
        rows = [PartialRow(planned.row.row_id, planned.prompt_hash, c.token_ids, c.rng_state, sample_index)
                for planned, sample_index, c in self.core.in_flight()]
        self.checkpoints.write(rows)
        self.last_checkpoint = time.monotonic()
        if stopping and rows:
            log.warning("checkpointed %d rows in flight (%d tokens): a resume continues them", len(rows),
                        sum(len(r.token_ids) for r in rows))

    def finished(self, planned: PlannedRow, completions: list[Completion]) -> None:
        """A row finished: every one of its samples (one unless it asked for n), written together."""
        if self.checkpoints is not None:
            self.checkpoints.finished(planned.row.row_id)
        prediction = planned.prediction
        self.summary.num_rows_truncated += int(planned.num_truncated_tokens > 0)
        self.summary.length_sources[prediction.source] = self.summary.length_sources.get(prediction.source, 0) + 1
        constraint = planned.constraint if planned.constraint is not None else self.constraint
        outs = []
        self.finished_output_tokens[0] += prediction.p50 * len(completions)
        self.finished_output_tokens[1] += sum(c.num_generated_tokens for c in completions)
        shared, hits = reuse_counts(planned, completions[0])  # the row's, with its first sample
        for completion in completions:
            self.job.predictor.observe(planned.num_prompt_tokens, completion.num_generated_tokens, prediction)
            if self.monitor is not None:
                policy = self.core.engines.policy
                self.monitor.recorder.on_row(window=planned.window_index, mode=None if policy is None else policy.value,
                                             num_prompt_tokens=completion.num_prompt_tokens,
                                             num_generated_tokens=completion.num_generated_tokens,
                                             predicted_tokens=prediction.p50, error=False,
                                             num_shareable_prefix_tokens=shared, num_prefix_hit_prompt_tokens=hits,
                                             from_duplicate=planned.served_from_duplicate)
                shared = hits = 0
            outs.append(self.output_row(planned.row, completion=completion, digest=planned.prompt_hash,
                                        truncated=planned.num_truncated_tokens > 0,
                                        json_valid=json_valid(constraint, completion), adapter=planned.adapter))
        self.emit(planned.row, outs)

    def refuse_samples(self, planned: PlannedRow) -> None:
        """A row that asks for n > 1 in a directory begun without the sample_index column."""
        self.failed(planned.row, f"n = {planned.num_samples} samples need one output row each, and "
                                 f"{self.session.out_dir} was begun without the sample_index column: write this job "
                                 "to a new --output (or --overwrite)")

    def failed(self, row: InputRow, message: str) -> None:
        if self.monitor is not None:
            self.monitor.recorder.on_row(window=None, mode=None, num_prompt_tokens=0, num_generated_tokens=0,
                                         predicted_tokens=None, error=True)
        self.emit(row, self.output_row(row, error=message))

    def output_row(self, row: InputRow, *, completion: Completion | None = None, error: str | None = None,
                   digest: str | None = None, truncated: bool | None = None,
                   json_valid: bool | None = None, adapter: str | None = None) -> dict[str, Any]:
        return output_row(self.id_name, self.passthrough, self.with_prompt_hash, row, completion=completion,
                          error=error, digest=digest, truncated=truncated,
                          with_prompt_truncated=self.with_prompt_truncated, logprobs=self.logprobs,
                          with_json_valid=self.with_json_valid, json_valid=json_valid,
                          with_sample_index=self.with_sample_index, with_adapter=self.with_adapter, adapter=adapter)

    def emit(self, row: InputRow, out: dict[str, Any] | list[dict[str, Any]]) -> None:
        """One input row's output: a row, or one per sample (committed together)."""
        outs = out if isinstance(out, list) else [out]
        is_error = self.summary.count_row(outs[0])  # rows count input rows; the prompt counts once
        self.summary.num_generated_tokens += sum(o["num_generated_tokens"] or 0 for o in outs[1:])
        self.progress.update(num_generated_tokens=sum(o["num_generated_tokens"] or 0 for o in outs), error=is_error)
        self.commits.add(outs if len(outs) > 1 else outs[0], row.file.path, row.row_index)

    def save_lengths(self) -> None:
        """Save the learned output lengths with each commit (inside its critical section)."""
        predictor = self.job.predictor
        if predictor.num_observed_since_save:
            predictor.save(self.session.store)

    def predicted_work(self) -> PredictedWork | None:
        """This run's predicted prompt and output tokens (None before a row is planned): the rows not
        planned yet count as the planned rows' mean, a finished row as the tokens it generated."""
        planner = self.job.planner
        if not planner.num_planned_rows:
            return None
        if self.progress is not None and self.progress.done:
            return PredictedWork(0, 0)  # every row is in: nothing is left, whatever was predicted
        unplanned = max(0, self.num_rows_to_do - planner.num_planned_rows - self.summary.num_rows_error)
        scale = 1 + unplanned / planner.num_planned_rows
        predicted, generated = self.finished_output_tokens
        return PredictedWork(round(planner.num_planned_prompt_tokens * scale),
                             round(planner.num_predicted_tokens * scale) - predicted + generated)

    def _fill_summary(self, wall_seconds: float) -> None:
        s, counts, job, core = self.summary, self.commits.committer.counts, self.job, self.core
        s.num_commits = counts.num_commits
        s.num_sampled_tokens = core.engines.num_sampled_tokens()
        if self.checkpoints is not None:
            s.num_rows_continued = self.checkpoints.num_rows_continued
            s.num_tokens_continued = self.checkpoints.num_tokens_continued
            s.num_inflight_checkpoints = self.checkpoints.num_writes
            s.inflight_checkpoint_seconds = round(self.checkpoints.seconds_writing, 4)
        s.num_parts_written = counts.num_parts_written
        s.num_rows_replaced = counts.num_rows_replaced
        s.num_rows_skipped = job.num_rows_skipped
        s.num_rows_retried = job.num_rows_retried
        s.num_rows_changed = job.num_rows_changed
        s.num_windows_static = core.num_windows[Policy.STATIC]
        s.num_windows_continuous = core.num_windows[Policy.CONTINUOUS]
        s.num_static_fallbacks = core.num_static_fallbacks
        s.wall_seconds = wall_seconds
        s.engine = core.engines.summary()
        error = job.predictor.error()
        s.num_length_predictions = error.num_rows
        s.length_mae = None if error.mae is None else round(error.mae, 3)
        s.num_rows_from_duplicates = core.duplicates.num_rows_served if core.duplicates is not None else 0
        s.num_shareable_prefix_tokens = core.num_shareable_prefix_tokens
        s.num_prefix_hit_prompt_tokens = core.num_prefix_hit_prompt_tokens
        s.length_spearman = None if error.spearman is None else round(error.spearman, 4)
