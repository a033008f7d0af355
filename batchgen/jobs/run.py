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

Rows reach the engine through the length planner (batchgen.jobs.plan): windows of rows become
shards with predicted output lengths, a run order and a mode each. Consecutive shards in one mode
stream through one `engine.generate` call, so no shard boundary drains the engine. The job holds
one engine at a time: a shard in the other mode drops it and builds one with the other policy over
the same model (see _EngineSlot). If the continuous engine fails with an engine error (not a
user's error), the rows it had not finished and the rest of that shard run again in static mode,
and the job goes on. Finished rows teach the output-length predictor, whose state is saved with
each commit (`_length_model.json`).
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import logging
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchgen.config import JobConfig, parse_bytes
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.loader import LoadedModel, load_model
from batchgen.engine.metrics import EngineMetrics
from batchgen.engine.request import Completion, Request, SamplingParams
from batchgen.engine.scheduler import Policy
from batchgen.errors import BatchgenError, EngineError, ErrorRateExceeded, JobInterrupted, OutputError
from batchgen.io.manifest import fingerprint_digest, write_success
from batchgen.io.writers import PartWriter, output_schema, write_json_atomic
from batchgen.jobs.length import LengthPredictor
from batchgen.jobs.plan import CONTINUOUS, STATIC, PlannedRow, Planner, ShardPlan, prepare_row
from batchgen.jobs.progress import Progress
from batchgen.jobs.prompts import PromptBuilder, RowError
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


def build_engine(config: JobConfig, loaded: LoadedModel, mode: str | None = None, *,
                 num_kv_blocks: int | None = None) -> LLMEngine:
    """An engine with `mode`'s policy (default: the config's; continuous for auto)."""
    if mode is None:
        mode = CONTINUOUS if config.mode == "auto" else config.mode
    engine_config = EngineConfig(
        policy=Policy(mode),
        max_num_seqs=config.batch_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=config.block_size,
        kv_cache_bytes=parse_bytes(config.kv_cache_memory) if config.kv_cache_memory else None,
        enable_prefix_caching=config.enable_prefix_caching,
        max_model_len=loaded.max_context_tokens,
        num_kv_blocks=num_kv_blocks,
        kv_cache_dtype=config.kv_cache_dtype,
    )
    return LLMEngine(loaded.model, loaded.tokenizer, engine_config, eos_token_ids=loaded.eos_token_ids)


def row_seed(base_seed: int, row_id: Any) -> int:
    """A per-row seed from the job seed and the row id: stable across runs, batches and resumes."""
    digest = hashlib.blake2b(f"{base_seed}\x00{row_id!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def length_model_key(loaded: LoadedModel, builder: PromptBuilder) -> dict[str, Any]:
    """What the learned output lengths depend on: another model or prompt starts from the prior."""
    template = builder.template
    return {"model": loaded.name, "model_revision": loaded.revision, "template": template.text,
            "prompt_column": template.prompt_column, "system": builder.system, "chat": builder.chat}


class _EngineSlot:
    """The job's engine: one at a time, built for the mode of the shards it runs.

    A shard in the other mode drops the engine and builds one with the other policy over the same
    model. So only one KV cache is ever allocated, sized exactly as a one-mode job's (two caches
    side by side would each get half the memory, or need a split of the budget); the price is one
    cache allocation per mode switch, which consecutive same-mode shards never pay. Every engine
    after the first gets the first one's block count, so each prompt built for the first one fits.
    """

    def __init__(self, config: JobConfig, loaded: LoadedModel):
        self.config = config
        self.loaded = loaded
        self.engine: LLMEngine | None = None
        self.num_kv_blocks: int | None = None
        self.metrics: list[EngineMetrics] = []

    def get(self, mode: str) -> LLMEngine:
        if self.engine is not None and self.engine.config.policy.value == mode:
            return self.engine
        self.drop()
        self.engine = build_engine(self.config, self.loaded, mode, num_kv_blocks=self.num_kv_blocks)
        self.num_kv_blocks = self.engine.kv_cache.num_blocks
        self.metrics.append(self.engine.metrics)
        return self.engine

    def drop(self, *, collect: bool = False) -> None:
        """Free the engine (and its KV cache) before another is built. An engine holds no reference
        cycle, so dropping the last reference frees it; `collect` runs the cycle collector too (about
        0.2 s with a model loaded) for one that failed, which exception frames may still reach."""
        if self.engine is None:
            return
        self.engine = None
        if collect:
            gc.collect()
        if self.loaded.device.type == "cuda":
            torch.cuda.empty_cache()

    def num_sampled_tokens(self) -> int:
        return sum(m.num_sampled_tokens for m in self.metrics)

    def summary(self) -> dict:
        if len(self.metrics) == 1:
            return self.metrics[0].summary()
        merged = EngineMetrics(steps=[step for m in self.metrics for step in m.steps])
        for m in self.metrics:
            merged.num_prefix_hit_tokens += m.num_prefix_hit_tokens
            merged.num_prompt_tokens += m.num_prompt_tokens
            merged.num_generated_tokens += m.num_generated_tokens
            merged.num_requests_finished += m.num_requests_finished
        return merged.summary()


class _Segment:
    """The requests of consecutive shards planned in one mode: what one engine.generate call pulls.

    It stops before the first shard planned in the other mode (`next_plan`, the next segment's
    first). `shard_rest` is the shard in progress' remaining requests, which a static fallback
    takes over. `failed` marks an exception raised on our side of the engine (reading, planning,
    committing error rows): that one is never blamed on the engine.
    """

    def __init__(self, job: _Job, first: ShardPlan, plans: Iterator[ShardPlan]):
        self.job = job
        self.mode = first.mode
        self.next_plan: ShardPlan | None = None
        self.shard_rest: Iterator[Request] = iter(())
        self.failed = False
        self.done = False  # every request of the segment has been handed out
        self._plans = plans
        self._requests = self._iter(first)

    def __iter__(self) -> _Segment:
        return self

    def __next__(self) -> Request:
        return next(self._requests)

    def _iter(self, plan: ShardPlan | None) -> Iterator[Request]:
        try:
            while plan is not None:
                self.shard_rest = self.job.shard_requests(plan)
                yield from self.shard_rest
                plan = next(self._plans, None)
                if plan is not None and plan.mode != self.mode:
                    self.next_plan = plan
                    break
            self.done = True
        except Exception:
            self.failed = True
            raise


class _Job:
    def __init__(self, config: JobConfig, source: RowSource, loaded: LoadedModel, session: OutputSession,
                 guard: SignalGuard):
        self.config = config
        self.source = source
        self.session = session
        self.guard = guard
        self.engines = _EngineSlot(config, loaded)
        first = self.engines.get(STATIC if config.mode == STATIC else CONTINUOUS)
        self.builder = PromptBuilder(
            loaded.tokenizer, source.template, system=config.system, chat=config.chat,
            max_context_tokens=first.max_tokens_per_seq, on_long_prompt=config.on_long_prompt,
            max_prompt_tokens=config.max_prompt_tokens)
        self.predictor = LengthPredictor.load(session.out_dir, length_model_key(loaded, self.builder),
                                              ignore_eos=config.ignore_eos)
        self.planner = Planner(config, self.predictor, kv_capacity_tokens=first.kv_cache.num_blocks * first.block_size,
                               block_size=first.block_size)
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
        self.pending: dict[str, tuple[PlannedRow, Request]] = {}  # request id -> (row, its request)
        self.keys = itertools.count()
        self.summary = RunSummary(output_dir=str(session.out_dir), model=loaded.name, mode=config.mode)
        self.progress: Progress | None = None

    def rows(self) -> Iterator[PlannedRow]:
        """The rows to generate, prompts built; committed rows skipped, error rows emitted here."""
        config = self.config
        state = self.session.state
        for row in self.source:
            if row.row_id in state.ok_ids or (not config.retry_errors and row.row_id in state.error_ids):
                self.summary.num_rows_skipped += 1
                continue
            self.summary.num_rows_retried += row.row_id in state.error_ids
            try:
                if row.error is not None:
                    raise RowError(row.error)
                planned = prepare_row(row, self.builder, config)
            except RowError as e:
                self.emit(row, self.output_row(row, error=str(e)))
                continue
            yield planned

    def shard_requests(self, plan: ShardPlan) -> Iterator[Request]:
        config = self.config
        if plan.mode == STATIC:
            self.summary.num_shards_static += 1
        else:
            self.summary.num_shards_continuous += 1
        log.info("shard %d (%s, %d rows from row %d): %s; %s", plan.index, plan.path, plan.num_rows,
                 plan.first_row_index, plan.mode, plan.reason)
        for planned in plan.rows:
            key = str(next(self.keys))
            request = Request(key, planned.prompt_token_ids, SamplingParams(
                max_new_tokens=planned.max_new_tokens, temperature=config.temperature, top_p=config.top_p,
                top_k=config.top_k, seed=row_seed(config.seed, planned.row.row_id), stop=tuple(config.stop),
                ignore_eos=config.ignore_eos), predicted_num_output_tokens=planned.prediction.p90)
            self.pending[key] = (planned, request)
            yield request

    def run_segment(self, segment: _Segment) -> None:
        """Run the segment's rows; a continuous engine's fault sends the shard in progress to static."""
        while True:
            completions = self.engines.get(segment.mode).generate(segment)
            failure = None
            while True:
                try:
                    completion = next(completions)
                except StopIteration:
                    return
                except Exception as e:
                    if not self._is_engine_fault(segment, e):
                        raise
                    failure = f"{type(e).__name__}: {e}"
                    break
                self.finish(completion)
            completions = None  # the failed engine's frames go, so drop() frees its memory
            self.fall_back(segment, failure)
            if segment.done:
                return

    def _is_engine_fault(self, segment: _Segment, e: Exception) -> bool:
        """A continuous engine's own failure: an EngineError or a non-batchgen exception raised by
        the engine, not by our request stream, and not a user's mistake."""
        if segment.mode != CONTINUOUS or segment.failed:
            return False
        return isinstance(e, EngineError) or not isinstance(e, BatchgenError)

    def fall_back(self, segment: _Segment, failure: str) -> None:
        unfinished = [request for _, request in self.pending.values()]
        log.warning("the continuous engine failed (%s); running its %d unfinished rows and the rest of the shard "
                    "in static mode", failure, len(unfinished))
        self.summary.num_static_fallbacks += 1
        self.engines.drop(collect=True)
        for completion in self.engines.get(STATIC).generate(itertools.chain(unfinished, segment.shard_rest)):
            self.finish(completion)

    def finish(self, completion: Completion) -> None:
        planned, _ = self.pending.pop(completion.request_id)
        prediction = planned.prediction
        self.summary.num_rows_truncated += int(planned.num_truncated_tokens > 0)
        self.summary.length_sources[prediction.source] = self.summary.length_sources.get(prediction.source, 0) + 1
        self.predictor.observe(planned.num_prompt_tokens, completion.num_generated_tokens, prediction)
        self.emit(planned.row, self.output_row(planned.row, completion=completion))

    def work(self) -> tuple[int, int | None]:
        """(tokens generated so far, in flight included; predicted total of the job, None before a
        row is planned): the rows not planned yet are counted at the planned rows' mean p50."""
        tokens = self.engines.num_sampled_tokens()
        planner, progress = self.planner, self.progress
        if not planner.num_planned_rows:
            return tokens, None
        unplanned = max(0, progress.total_rows - planner.num_planned_rows - self.summary.num_rows_error)
        mean = planner.num_predicted_tokens / planner.num_planned_rows
        return tokens, round(planner.num_predicted_tokens + unplanned * mean)

    def run(self, scan: InputScan) -> RunSummary:
        state = self.session.state
        done = len(state.ok_ids) + (0 if self.config.retry_errors else len(state.error_ids))
        self.progress = Progress(max(scan.num_rows - done, 0), quiet=self.config.quiet,
                                 log_every_s=self.config.log_every_s, work=self.work)
        started = time.monotonic()
        try:
            plans = self.planner.plans(self.rows())
            plan = next(plans, None)
            while plan is not None:
                segment = _Segment(self, plan, plans)
                self.run_segment(segment)
                plan = segment.next_plan
            assert not self.pending, f"{len(self.pending)} rows lost in the engine"
            self.commit()
        except Interrupt:
            with self.guard.critical():
                self.committer.commit()  # the rows that finished before the signal
                self._save_lengths()
            raise
        except Exception as e:
            if not isinstance(e, OutputError):  # an engine failure: keep the work that did finish
                try:
                    with self.guard.critical():
                        self.committer.commit()
                        self._save_lengths()
                except OutputError:
                    log.warning("could not commit the %d finished rows", len(self.committer))
            raise
        finally:
            self.progress.close()
            self._count_commits()
            self.summary.wall_seconds = time.monotonic() - started
            self.summary.engine = self.engines.summary()
            error = self.predictor.error()
            self.summary.num_length_predictions = error.num_rows
            self.summary.length_mae = None if error.mae is None else round(error.mae, 3)
            self.summary.length_spearman = None if error.spearman is None else round(error.spearman, 4)
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
            self._save_lengths()
        self.last_commit = time.monotonic()

    def _save_lengths(self) -> None:
        if self.predictor.num_observed_since_save:
            self.predictor.save(self.session.out_dir)

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
                                        trust_remote_code=config.trust_remote_code, quantize=config.quantize,
                                        quantize_backend=config.quantize_backend)
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
