"""The local executor of embed, score and classify jobs: the reader through the encode core into commits.

The same job as a generation run (batchgen.jobs.executors.local) around another core: rows an
earlier run settled are skipped (by id, and by prompt hash under --id-column), rows whose text
cannot be read or that are too long under --on-long-prompt error become error rows, finished rows
are committed every --commit-every rows / seconds, and a signal stops the job between two of the
encoder's batches after committing what finished. No output-length prediction, no KV cache, no
in-flight checkpoints: a row is one forward pass, so a stopped row simply runs again on resume.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pyarrow as pa

from batchgen.config.job import JobConfig
from batchgen.engine.encode.encoder import EncodeResult
from batchgen.engine.encode.load import EncodeModel
from batchgen.errors import OutputError
from batchgen.io.store.writers import PartWriter
from batchgen.jobs.durability.commit import Committer
from batchgen.jobs.durability.commit_schedule import CommitSchedule
from batchgen.jobs.durability.fingerprint import encode_model_fingerprint, job_fingerprint
from batchgen.jobs.durability.resume import ResumeRule
from batchgen.jobs.durability.scan import InputScan
from batchgen.jobs.durability.session import OutputSession
from batchgen.jobs.durability.signals import SignalGuard
from batchgen.jobs.encoding.encode_core import EncodeCore
from batchgen.jobs.encoding.encode_rows import encode_output_row, encode_prompt_builder, prepare_encode_row
from batchgen.jobs.executors.watch import watch_run
from batchgen.jobs.pipeline.prepare import JobInputs, PreparedJob
from batchgen.jobs.pipeline.progress import Progress
from batchgen.jobs.pipeline.summary import RunSummary
from batchgen.jobs.planning.planner import windows
from batchgen.jobs.rows.planned_row import PlannedRow
from batchgen.jobs.rows.rows import InputRow
from batchgen.monitor.eta import PredictedWork, WorkMeter
from batchgen.monitor.job import JobMonitor

log = logging.getLogger("batchgen")


class EncodeJob:
    """One embed / score / classify run in this process."""

    def __init__(self, config: JobConfig, inputs: JobInputs, model: EncodeModel, session: OutputSession,
                 guard: SignalGuard, schema: pa.Schema):
        self.config = config
        self.task = str(config.task)
        self.session = session
        self.guard = guard
        self.model = model
        self.core = EncodeCore(config, model, between_batches=guard.raise_if_interrupted)
        builder = encode_prompt_builder(config, model.tokenizer, inputs.source.template, model.max_input_tokens)
        resume = ResumeRule(session.state, config.retry_errors, check_prompts=config.id_column is not None)
        self.job = PreparedJob(config, inputs.source, builder, None, None, resume,
                               prepare=lambda row: prepare_encode_row(row, builder, config))
        source = inputs.source
        self.names = frozenset(schema.names)
        self.fingerprint = job_fingerprint(config, source, schema, model=encode_model_fingerprint(model, builder))
        self.commits = CommitSchedule(Committer(session.manifest, PartWriter(session.store, schema),
                                                source.id_field.name, rows_per_part=config.rows_per_part),
                                      guard, config)
        self.id_name = source.id_field.name
        self.passthrough = [f.name for f in source.passthrough_fields]
        self.summary = RunSummary(output_dir=str(session.out_dir), model=model.name, mode=self.task, task=self.task)
        self.progress: Progress | None = None
        self.monitor: JobMonitor | None = None
        self.num_rows_to_do = 0
        self.meter = WorkMeter(self.predicted_work)  # prompt tokens done and left: the ETA
        self.core.listeners.append(self.meter.on_step)

    def run(self, scan: InputScan) -> RunSummary:
        self.monitor, self.progress, self.num_rows_to_do = watch_run(
            self.config, self.session, scan, num_rows_done=self.job.resume.num_rows_done,
            context=lambda: (self.task, self.core.num_windows), meter=self.meter,
            add_listener=self.core.listeners.append)
        self.commits.monitor = self.monitor
        started = time.monotonic()
        try:
            rows = windows(self.job.rows(on_error=self.failed), self.config.window_rows)
            with self.guard.deferred():  # a signal stops the job between two batches (between_batches)
                for planned, results in self.core.generate(rows):
                    self.finished(planned, results)
            with self.guard.critical():
                self.commits.commit()
        except BaseException as e:
            if not isinstance(e, OutputError):  # a signal or an engine failure: keep the rows that finished
                try:
                    with self.guard.critical():
                        self.commits.commit()
                except OutputError:
                    log.warning("could not commit the %d finished rows", len(self.commits))
            raise
        finally:
            self.progress.close()
            self._fill_summary(time.monotonic() - started)
            if self.monitor is not None:
                with self.guard.critical():
                    self.monitor.close()
        return self.summary

    def finished(self, planned: PlannedRow, results: list[EncodeResult]) -> None:
        """A row finished: one output row per input (one unless an embeddings line sent several)."""
        truncated = planned.num_truncated_tokens > 0
        self.summary.num_rows_truncated += int(truncated)
        if self.monitor is not None:
            self.monitor.recorder.on_row(window=planned.window_index, mode=self.task,
                                         num_prompt_tokens=sum(r.num_prompt_tokens for r in results),
                                         num_generated_tokens=0, predicted_tokens=None, error=False)
        outs = [encode_output_row(self.task, self.id_name, self.passthrough, self.names, planned.row, result=r,
                                  sample_index=i, digest=planned.prompt_hash, truncated=truncated)
                for i, r in enumerate(results)]
        self.emit(planned.row, outs)

    def failed(self, row: InputRow, message: str) -> None:
        if self.monitor is not None:
            self.monitor.recorder.on_row(window=None, mode=None, num_prompt_tokens=0, num_generated_tokens=0,
                                         predicted_tokens=None, error=True)
        self.emit(row, [encode_output_row(self.task, self.id_name, self.passthrough, self.names, row,
                                          error=message)])

    def emit(self, row: InputRow, outs: list[dict[str, Any]]) -> None:
        is_error = self.summary.count_row(outs[0])  # rows count input rows
        self.summary.num_prompt_tokens += sum(o["num_prompt_tokens"] or 0 for o in outs[1:])
        self.progress.update(error=is_error)
        self.commits.add(outs if len(outs) > 1 else outs[0], row.file.path, row.row_index)

    def predicted_work(self) -> PredictedWork | None:
        """This run's prompt tokens (None before a row is planned): the rows not planned yet count as the
        planned rows' mean; there is no output to predict."""
        core = self.core
        if not core.num_planned_rows:
            return None
        if self.progress is not None and self.progress.done:
            return PredictedWork(0, 0)
        unplanned = max(0, self.num_rows_to_do - core.num_planned_rows - self.summary.num_rows_error)
        return PredictedWork(round(core.num_planned_prompt_tokens * (1 + unplanned / core.num_planned_rows)), 0)

    def _fill_summary(self, wall_seconds: float) -> None:
        s, counts, job = self.summary, self.commits.committer.counts, self.job
        s.num_commits = counts.num_commits
        s.num_parts_written = counts.num_parts_written
        s.num_rows_replaced = counts.num_rows_replaced
        s.num_rows_skipped = job.num_rows_skipped
        s.num_rows_retried = job.num_rows_retried
        s.num_rows_changed = job.num_rows_changed
        s.wall_seconds = wall_seconds
        s.engine = self.core.summary()
        duplicates = self.core.duplicates
        s.num_rows_from_duplicates = duplicates.num_inputs_served if duplicates is not None else 0
