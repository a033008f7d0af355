"""`batchgen run`: input rows -> prompts -> engine -> committed Parquet parts, resumable.

Order of work, so that a mistake costs nothing: check the config and the inputs (including one
pass over the id column: duplicate or null ids), then lock the output directory, finish or undo
what a crashed run left there, and compare the config fingerprint with the one it was begun with
(no model loaded yet); then load the model and stream.

Rows whose prompt cannot be built (null, empty or non-text prompt, a cell that is not valid
text, a bad per-row limit, too long with --on-long-prompt error) become error rows: the job
completes and commits exactly one output row per input row.

Finished rows are committed every --commit-every rows and every --commit-every-seconds
(batchgen.io.manifest describes a commit), so a crash loses at most that much work. Running the
same command again resumes: committed rows are skipped by id, error rows are generated again
(unless --no-retry-errors) and replace their old row. `_SUCCESS` is written last, once every
input row has a committed output row and the error rate is within --max-error-rate.
SIGTERM / SIGINT commit the finished rows and exit 143 / 130 (batchgen.jobs.signals).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.config import JobConfig, parse_bytes
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.loader import LoadedModel, load_model
from batchgen.engine.request import Completion, Request, SamplingParams
from batchgen.engine.scheduler import Policy
from batchgen.errors import ErrorRateExceeded, JobInterrupted, OutputError
from batchgen.io.manifest import fingerprint_digest, write_success
from batchgen.io.writers import PartWriter, output_schema, write_json_atomic
from batchgen.jobs.progress import Progress
from batchgen.jobs.prompts import PromptBuilder, RowError, row_max_new_tokens
from batchgen.jobs.report import JobSummary
from batchgen.jobs.resume import (
    SUMMARY_FILE,
    Committer,
    InputScan,
    OutputSession,
    job_fingerprint,
    scan_inputs,
)
from batchgen.jobs.rows import InputRow, RowSource
from batchgen.jobs.signals import Interrupt, SignalGuard

log = logging.getLogger("batchgen")

__all__ = ["SUMMARY_FILE", "RunSummary", "build_engine", "row_seed", "run_job"]


@dataclass(slots=True)
class RunSummary(JobSummary):
    """JobSummary plus what this run found already committed and what it committed."""

    num_rows_skipped: int = 0  # committed by an earlier run (or an error row kept: --no-retry-errors)
    num_rows_retried: int = 0  # error rows of an earlier run generated again
    num_rows_replaced: int = 0  # ... whose new row replaced the old one (the rest failed the same way)
    num_commits: int = 0
    output_rows: int = 0  # committed rows in the output directory after this run
    output_rows_error: int = 0
    complete: bool = False  # every input row has a committed output row (_SUCCESS written)

    def lines(self) -> list[str]:
        out = JobSummary.lines(self)
        out.insert(-1, f"resume: {self.num_rows_skipped} rows already committed, {self.num_rows_retried} error "
                       f"rows retried ({self.num_rows_replaced} replaced); {self.num_commits} commits; output "
                       f"holds {self.output_rows} rows ({self.output_rows_error} errors)"
                       f"{'' if self.complete else ', incomplete'}")
        return out


def build_engine(config: JobConfig, loaded: LoadedModel) -> LLMEngine:
    engine_config = EngineConfig(
        policy=Policy(config.mode),
        max_num_seqs=config.batch_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=config.block_size,
        kv_cache_bytes=parse_bytes(config.kv_cache_memory) if config.kv_cache_memory else None,
        enable_prefix_caching=config.enable_prefix_caching,
        max_model_len=loaded.max_context_tokens,
    )
    return LLMEngine(loaded.model, loaded.tokenizer, engine_config, eos_token_ids=loaded.eos_token_ids)


def row_seed(base_seed: int, row_id: Any) -> int:
    """A per-row seed from the job seed and the row id: stable across runs, batches and resumes."""
    digest = hashlib.blake2b(f"{base_seed}\x00{row_id!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _Job:
    def __init__(self, config: JobConfig, source: RowSource, loaded: LoadedModel, session: OutputSession,
                 guard: SignalGuard):
        self.config = config
        self.source = source
        self.session = session
        self.guard = guard
        self.engine = build_engine(config, loaded)
        self.builder = PromptBuilder(
            loaded.tokenizer, source.template, system=config.system, chat=config.chat,
            max_context_tokens=self.engine.max_tokens_per_seq, on_long_prompt=config.on_long_prompt,
            max_prompt_tokens=config.max_prompt_tokens)
        schema = output_schema(source.id_field, source.passthrough_fields)
        self.fingerprint = job_fingerprint(config, source, schema, model={
            "model": loaded.name, "model_revision": loaded.revision, "dtype": str(loaded.dtype).removeprefix("torch."),
            "chat": self.builder.chat, "max_context_tokens": self.builder.max_context_tokens})
        self.committer = Committer(session.manifest, PartWriter(session.out_dir, schema), source.id_field.name,
                                   rows_per_part=config.rows_per_part)
        self.commit_every_rows = config.commit_every_rows or config.rows_per_part
        self.commit_every_s = config.commit_every_s or None
        self.last_commit = time.monotonic()
        self.id_name = source.id_field.name
        self.passthrough = [f.name for f in source.passthrough_fields]
        self.pending: dict[str, tuple[InputRow, int]] = {}  # request id -> (row, truncated tokens)
        self.summary = RunSummary(output_dir=str(session.out_dir), model=loaded.name, mode=config.mode)
        self.progress: Progress | None = None

    def requests(self) -> Iterator[Request]:
        config = self.config
        state = self.session.state
        keys = itertools.count()
        for row in self.source:
            if row.row_id in state.ok_ids or (not config.retry_errors and row.row_id in state.error_ids):
                self.summary.num_rows_skipped += 1
                continue
            self.summary.num_rows_retried += row.row_id in state.error_ids
            try:
                if row.error is not None:
                    raise RowError(row.error)
                max_new = row_max_new_tokens(row.values, config.max_new_tokens_column, config.max_new_tokens)
                prompt = self.builder.build(row.values, max_new)
            except RowError as e:
                self.emit(row, self.output_row(row, error=str(e)))
                continue
            key = str(next(keys))
            self.pending[key] = (row, prompt.num_truncated_tokens)
            yield Request(key, prompt.token_ids, SamplingParams(
                max_new_tokens=max_new, temperature=config.temperature, top_p=config.top_p,
                top_k=config.top_k, seed=row_seed(config.seed, row.row_id), stop=tuple(config.stop),
                ignore_eos=config.ignore_eos))

    def run(self, scan: InputScan) -> RunSummary:
        state = self.session.state
        done = len(state.ok_ids) + (0 if self.config.retry_errors else len(state.error_ids))
        self.progress = Progress(max(scan.num_rows - done, 0), quiet=self.config.quiet,
                                 log_every_s=self.config.log_every_s)
        started = time.monotonic()
        try:
            for completion in self.engine.generate(self.requests()):
                row, num_truncated = self.pending.pop(completion.request_id)
                self.summary.num_rows_truncated += int(num_truncated > 0)
                self.emit(row, self.output_row(row, completion=completion))
            assert not self.pending, f"{len(self.pending)} rows lost in the engine"
            self.commit()
        except Interrupt:
            with self.guard.critical():
                self.committer.commit()  # the rows that finished before the signal
            raise
        except Exception as e:
            if not isinstance(e, OutputError):  # an engine failure: keep the work that did finish
                try:
                    with self.guard.critical():
                        self.committer.commit()
                except OutputError:
                    log.warning("could not commit the %d finished rows", len(self.committer))
            raise
        finally:
            self.progress.close()
            self._count_commits()
            self.summary.wall_seconds = time.monotonic() - started
            self.summary.engine = self.engine.metrics.summary()
        return self.summary

    def output_row(self, row: InputRow, *, completion: Completion | None = None,
                   error: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {self.id_name: row.row_id}
        if completion is not None:
            out.update(generated_text=completion.text, finish_reason=completion.finish_reason.value,
                       num_prompt_tokens=completion.num_prompt_tokens,
                       num_generated_tokens=completion.num_generated_tokens, error=None)
        else:
            out.update(generated_text=None, finish_reason="error", num_prompt_tokens=None,
                       num_generated_tokens=0, error=error)
        for name in self.passthrough:
            out[name] = row.values.get(name)
        return out

    def emit(self, row: InputRow, out: dict[str, Any]) -> None:
        s = self.summary
        s.num_rows += 1
        is_error = out["finish_reason"] == "error"
        s.num_rows_error += int(is_error)
        s.num_rows_ok += int(not is_error)
        s.num_prompt_tokens += out["num_prompt_tokens"] or 0
        s.num_generated_tokens += out["num_generated_tokens"] or 0
        self.progress.update(num_generated_tokens=out["num_generated_tokens"] or 0, error=is_error)
        self.committer.add(out, row.shard.path, row.row_index)
        if len(self.committer) >= self.commit_every_rows or (
                self.commit_every_s is not None and time.monotonic() - self.last_commit >= self.commit_every_s):
            self.commit()

    def commit(self) -> None:
        with self.guard.critical():
            self.committer.commit()
        self.last_commit = time.monotonic()

    def _count_commits(self) -> None:
        counts, s = self.committer.counts, self.summary
        s.num_commits = counts.num_commits
        s.num_parts_written = counts.num_parts_written
        s.num_rows_replaced = counts.num_rows_replaced


def run_job(config: JobConfig, *, loaded: LoadedModel | None = None) -> RunSummary:
    """Run (or resume) one job to completion; raises BatchgenError subclasses for user mistakes."""
    config.validate()
    source = RowSource.open(config)  # every input problem surfaces here or in the scan, before any output
    scan = scan_inputs(source)
    session = OutputSession(Path(config.output), overwrite=config.overwrite)
    summary: RunSummary | None = None
    with SignalGuard() as guard:
        try:
            try:
                with guard.critical():
                    session.open()
                schema = output_schema(source.id_field, source.passthrough_fields)
                session.check_fingerprint(job_fingerprint(config, source, schema))  # before a model is loaded
                if loaded is None:
                    loaded = load_model(config.model, device=config.device, dtype=config.dtype,
                                        trust_remote_code=config.trust_remote_code)
                job = _Job(config, source, loaded, session, guard)
                with guard.critical():
                    session.start(job.fingerprint, scan, config.max_rows)
                if session.state.num_committed_rows:
                    log.info("resuming %s: %d rows committed earlier (%d errors)", session.out_dir,
                             session.state.num_committed_rows, len(session.state.error_ids))
                summary = job.run(scan)
                with guard.critical():
                    _finish(config, session, summary)
            finally:
                with guard.critical():
                    session.close()
        except Interrupt as stop:
            if summary is not None and summary.complete:
                return summary  # the signal came after the job was done: nothing is left to stop
            state = session.state if session.manifest is not None else None
            committed = f"; {state.num_committed_rows} rows are committed" if state is not None else ""
            raise JobInterrupted(stop.signum, f"interrupted by {signal.Signals(stop.signum).name}{committed}; "
                                 "run the same command again to resume") from None
    return summary


def _finish(config: JobConfig, session: OutputSession, summary: RunSummary) -> None:
    """Write _summary.json, then _SUCCESS (last) unless the error rate fails the job."""
    state = session.state
    summary.output_rows = state.num_committed_rows
    summary.output_rows_error = len(state.error_ids)
    rate = config.max_error_rate
    failed = (rate is not None and summary.output_rows
              and summary.output_rows_error / summary.output_rows > rate)
    summary.complete = not failed
    write_json_atomic(session.out_dir / SUMMARY_FILE, summary.to_dict())
    if failed:
        raise ErrorRateExceeded(f"{summary.output_rows_error} of {summary.output_rows} rows failed, more than "
                                f"--max-error-rate {rate}; the output is in {session.out_dir} (no _SUCCESS)")
    write_success(session.out_dir, {
        "rows": summary.output_rows, "rows_error": summary.output_rows_error,
        "fingerprint": fingerprint_digest(state.fingerprint), "finished": time.time()})
