"""The Ray executor's driver: a Ray Data pipeline feeds batchgen's own committer on this process.

    ray.data.from_items(files) -> map_batches(read_file)            # settled rows dropped here
                               -> map_batches(GenerateActor, concurrency=N actors)
                               -> iter_batches on the driver -> Committer -> manifest

With --ray-keep-warm SECONDS the generating stage is instead kept-warm engine actors that outlive
the job (batchgen.jobs.executors.ray.engines), which a Ray Data actor pool cannot have (its actors end with the
dataset's execution):

    ray.data.from_items(files) -> map_batches(read_file)            # the same read
                               -> iter_internal_ref_bundles          # block references, not rows
    EnginePool: each bundle's references to an engine, which fetches the rows itself
                               -> the outputs on the driver -> Committer -> manifest

Everything that makes the output exactly once stays where `batchgen run` has it: the driver holds
the output's lock (an object store's lease), writes every part and manifest entry, and commits every
--commit-every rows / --commit-every-seconds, so a killed driver (or a lost actor, which Ray
retries) leaves only committed rows, and a rerun skips them. batchgen.jobs.commands.run checks the config,
inputs and output directory exactly as for the local executor before this starts. The job begins
("begin" manifest entry) when the first output batch arrives, because the model's part of the
fingerprint (resolved dtype, tokenizer, EOS ids) is known only to the actors; a batch from an actor
whose model fingerprint differs from the first one's fails the job (exit 2) before it is committed.

Not carried over from the local executor: in-flight checkpoints (a killed job regenerates the rows
that were in the actors) and the learned output lengths (each actor learns its own; none are saved).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.config.job import JobConfig
from batchgen.errors import FingerprintMismatch, OutputError
from batchgen.io.manifest.manifest import clear_success
from batchgen.io.store.schema import PROMPT_HASH
from batchgen.io.store.store import LocalStore
from batchgen.io.store.writers import PartWriter
from batchgen.jobs.durability.commit import Committer
from batchgen.jobs.durability.commit_schedule import CommitSchedule
from batchgen.jobs.durability.fingerprint import job_fingerprint
from batchgen.jobs.durability.resume import ResumeRule
from batchgen.jobs.durability.scan import InputScan
from batchgen.jobs.durability.session import OutputSession
from batchgen.jobs.durability.signals import Interrupt, SignalGuard
from batchgen.jobs.executors.ray.block_refs import iter_block_slices, references_available
from batchgen.jobs.executors.ray.cluster import connect, plan_actors
from batchgen.jobs.executors.ray.dispatch import EnginePool
from batchgen.jobs.executors.ray.engines import JobSpec
from batchgen.jobs.executors.ray.stages import MODEL_FINGERPRINT, GenerateActor, ReadSpec, read_file
from batchgen.jobs.pipeline.batch_columns import REUSE_FIELDS, SOURCE_PATH, SOURCE_ROW
from batchgen.jobs.pipeline.prepare import JobInputs
from batchgen.jobs.pipeline.progress import Progress
from batchgen.jobs.pipeline.summary import RunSummary
from batchgen.jobs.rows.rows import unify_schemas
from batchgen.monitor.job import JobMonitor

log = logging.getLogger("batchgen")

BATCHES_PER_ACTOR = 4  # each actor gets at least this many batches: a slow batch cannot idle the others


class RayJob:
    """One run of a job through Ray Data; the driver side. See the module docstring."""

    def __init__(self, config: JobConfig, inputs: JobInputs, session: OutputSession, guard: SignalGuard,
                 schema: pa.Schema):
        self.config = config
        self.inputs = inputs
        self.session = session
        self.guard = guard
        self.schema = schema
        source = inputs.source
        self.id_name = source.id_field.name
        self.commits = CommitSchedule(Committer(session.manifest, PartWriter(session.out_dir, schema), self.id_name,
                                                rows_per_part=config.rows_per_part), guard, config)
        self.summary = RunSummary(output_dir=str(session.out_dir), model=config.model or "default", mode=config.mode,
                                  task=str(config.task))
        self.summary.executor = "ray"
        self.fingerprint: dict[str, Any] | None = None  # the full one, from the first output batch
        self.model_json: str | None = None
        self.progress: Progress | None = None
        self.monitor: JobMonitor | None = None
        self.completed = False  # every output batch was taken
        state = session.state
        # what an earlier run settled, as of now (the overwrite "begin" comes later and drops it all)
        fresh = config.overwrite
        self.resume = ResumeRule(state, config.retry_errors, check_prompts=config.id_column is not None)
        self.ok_before = set() if fresh else set(state.ok_ids)
        self.errors_before = set() if fresh else set(state.error_ids)
        committed = [] if fresh else [*state.ok_ids, *state.error_ids]
        skip, hashes = self.resume.settle(committed)  # every committed id looked up at once
        self.skip = {i for i, settled in zip(committed, skip.tolist(), strict=True) if settled}
        # under --id-column: the committed rows whose prompt must be compared, with their hashes
        self.hashes = None if fresh or config.id_column is None else {
            i: h for i, h in zip(committed, hashes or [], strict=False) if h is not None}

    def run(self, scan: InputScan) -> RunSummary:
        import ray

        config = self.config
        started_ray = connect(config.quiet)
        started = time.monotonic()
        pool = None
        try:
            actors = plan_actors(config.ray_actors)
            self.summary.num_actors = actors.num_actors
            todo = max(scan.num_rows - len(self.skip), 0)
            batch_rows = max(1, min(config.window_rows, math.ceil(todo / (actors.num_actors * BATCHES_PER_ACTOR))))
            log.info("ray: %s; %d rows to generate in batches of %d", actors.reason, todo, batch_rows)
            if config.ray_keep_warm_s:
                # the engines first: they start (imports, model load) while this process imports Ray Data
                pool = EnginePool(ray, config, actors.resources, actors.num_actors)
            rows = self._rows(ray, batch_rows)
            state = self.session.state
            metrics_config, metrics_at = config, self.session.out_dir
            if not isinstance(self.session.store, LocalStore):
                # the _metrics/ files are appended second by second: local directories only (as for
                # the local executor); the Prometheus textfile and port work the same
                metrics_config, metrics_at = dataclasses.replace(config, metrics=False, overwrite=False), Path(".")
            self.monitor = JobMonitor.open(
                metrics_config, metrics_at, context=lambda: (None, None), meter=None,
                input_rows=scan.num_rows, output_rows=state.num_committed_rows,
                output_rows_error=len(state.error_ids), last_commit_s=state.last_commit_time)
            self.commits.monitor = self.monitor
            self.progress = Progress(todo, quiet=config.quiet, log_every_s=config.log_every_s)
            if pool is None:
                outputs = self._generate(rows, actors, batch_rows).iter_batches(batch_size=None, batch_format="pyarrow")
            else:
                outputs = pool.generate(ray.put(JobSpec(uuid.uuid4().hex, config, self.schema)),
                                        _warm_batches(rows, batch_rows), self.guard.raise_if_interrupted)
            self._stream(outputs)
        finally:
            if pool is not None:
                pool.close()
            if self.progress is not None:
                self.progress.close()
            self._fill_summary(time.monotonic() - started)
            if self.monitor is not None:
                with self.guard.critical():
                    self.monitor.close()
            if started_ray:
                ray.shutdown()
        return self.summary

    def _rows(self, ray, batch_rows: int):
        """The unsettled input rows, read by Ray Data's tasks, in blocks of at most batch_rows rows."""
        source, scan, config = self.inputs.source, self.inputs.scan, self.config
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = not config.quiet
        columns = source.read_columns
        read_schema = unify_schemas(source.files, [pa.schema([f for f in s if f.name in columns])
                                                   for s in source.file_schemas])
        read_schema = pa.schema([read_schema.field(c) for c in columns])
        spec = ReadSpec(files=source.files, labels=source._file_labels,
                        num_rows=[n for _, n in scan.file_rows], columns=columns, schema=read_schema,
                        id_column=config.id_column, id_type=source.id_field.type,
                        read_batch_size=config.read_batch_size, skip=ray.put(self.skip),
                        hashes=None if self.hashes is None else ray.put(self.hashes))
        files = ray.data.from_items([{"file": i} for i in range(len(source.files))],
                                    override_num_blocks=max(1, len(source.files)))
        rows = files.map_batches(read_file, fn_kwargs={"spec": spec}, batch_size=1, batch_format="pyarrow",
                                 num_cpus=0)
        return _split_blocks(rows, batch_rows)

    def _generate(self, rows, actors, batch_rows: int):
        """The default generating stage: a Ray Data actor pool of GenerateActor, one model each."""
        import ray

        # two in flight per actor: one generating, the next one queued, so no actor takes the backlog
        pool = ray.data.ActorPoolStrategy(size=actors.num_actors, max_tasks_in_flight_per_actor=2)
        return rows.map_batches(GenerateActor, fn_constructor_kwargs={"config": self.config, "schema": self.schema},
                                batch_size=batch_rows, batch_format="pyarrow", compute=pool, **actors.resources)

    def _stream(self, outputs) -> None:
        guard = self.guard
        try:
            with guard.deferred(), warnings.catch_warnings():  # a signal stops the job between two output batches
                # Ray Data counts the read's input blocks (one per file) and warns that the pool
                # cannot use every actor: _split_blocks gives it one block per batch, so it can
                warnings.filterwarnings("ignore", message="The minimum number of concurrent actors")
                for batch in outputs:
                    guard.raise_if_interrupted()
                    self._take(batch)
            with guard.critical():
                self.commits.commit()
            self.completed = True
        except Interrupt:
            with guard.critical():
                self.commits.commit()  # the rows that finished before the signal
            raise
        except Exception as e:
            if not isinstance(e, OutputError):  # an actor or Ray failed: keep the work that did finish
                try:
                    self.commits.commit()
                except OutputError:
                    log.warning("could not commit the %d finished rows", len(self.commits))
            raise

    def _take(self, batch: pa.Table) -> None:
        """One output batch from an actor: begin the job on the first, then buffer and commit its rows."""
        if batch.num_rows == 0:
            return
        models = set(batch.column(MODEL_FINGERPRINT).to_pylist())
        for model_json in models:
            self._check_model(model_json)
        paths = batch.column(SOURCE_PATH).to_pylist()
        indexes = batch.column(SOURCE_ROW).to_pylist()
        rows = batch.select(self.schema.names).to_pylist()
        # what each row took from other rows (a generating task's batches carry it; an encoding task's do not)
        names = [f.name for f in REUSE_FIELDS]
        reuse = (zip(*(batch.column(n).to_pylist() for n in names), strict=True)
                 if set(names) <= set(batch.column_names) else [(0, 0, False)] * batch.num_rows)
        for out, path, index, counts in zip(rows, paths, indexes, reuse, strict=True):
            self._emit(out, path, index, counts)

    def _check_model(self, model_json: str) -> None:
        if self.model_json is None:
            model = json.loads(model_json)
            self.fingerprint = job_fingerprint(self.config, self.inputs.source, self.schema, model=model)
            with self.guard.critical():
                if self.config.num_shards is not None:  # this shard's rows may change: the set is not final
                    clear_success(self.config.output)
                self.session.start(self.fingerprint, self.inputs.scan, self.config.max_rows)
            self.model_json = model_json
            if self.session.state.num_committed_rows:
                log.info("resuming %s: %d rows committed earlier", self.session.out_dir,
                         self.session.state.num_committed_rows)
        elif model_json != self.model_json:
            first, other = json.loads(self.model_json), json.loads(model_json)
            differ = sorted(k for k in first if first[k] != other.get(k))
            raise FingerprintMismatch(f"the Ray actors loaded the model differently ({', '.join(differ)} differ: "
                                      f"{[first[k] for k in differ]} against {[other.get(k) for k in differ]}), "
                                      "so rows would depend on the node that ran them; pin --dtype and --device")

    def _emit(self, out: dict[str, Any], path: str, index: int, reuse: tuple[int, int, bool]) -> None:
        s = self.summary
        is_error = s.count_row(out)
        row_id = out[self.id_name]
        s.num_rows_retried += row_id in self.errors_before
        s.num_rows_changed += row_id in self.ok_before
        shared, hits, from_duplicate = reuse
        s.num_shareable_prefix_tokens += shared
        s.num_prefix_hit_prompt_tokens += hits
        s.num_rows_from_duplicates += from_duplicate
        if self.monitor is not None:
            self.monitor.recorder.on_row(window=None, mode=None, num_prompt_tokens=out["num_prompt_tokens"] or 0,
                                         num_generated_tokens=out.get("num_generated_tokens") or 0,
                                         predicted_tokens=None, error=is_error, num_shareable_prefix_tokens=shared,
                                         num_prefix_hit_prompt_tokens=hits, from_duplicate=from_duplicate)
        # embed / score / classify rows generate no tokens (and have no such column)
        self.progress.update(num_generated_tokens=out.get("num_generated_tokens") or 0, error=is_error)
        if PROMPT_HASH not in self.schema.names:
            out.pop(PROMPT_HASH, None)
        self.commits.add(out, path, index)

    def _fill_summary(self, wall_seconds: float) -> None:
        s, counts = self.summary, self.commits.committer.counts
        s.num_commits = counts.num_commits
        s.num_parts_written = counts.num_parts_written
        s.num_rows_replaced = counts.num_rows_replaced
        # settled rows never reach the driver: a complete run skipped whatever it did not generate
        s.num_rows_skipped = self.inputs.scan.num_rows - s.num_rows if self.completed else len(self.skip)
        s.wall_seconds = wall_seconds


def _warm_batches(rows, batch_rows: int):
    """The kept-warm engines' batches: references to the read's blocks (batchgen.jobs.executors.ray.block_refs), so
    the rows go from the object store to the engines; the rows themselves where this Ray Data cannot
    hand out references."""
    if references_available(rows):
        return iter_block_slices(rows)
    log.warning("ray: this Ray Data gives no block references: the input rows pass through the driver")
    return iter(rows.iter_batches(batch_size=batch_rows, batch_format="pyarrow"))


def _split_blocks(rows, batch_rows: int):
    """`rows` in blocks of at most batch_rows rows, one actor batch each.

    A Ray Data map task merges what it yields into blocks of up to 128 MiB, and the actor pool hands
    out whole blocks: unsplit, a file's rows would be one block, generated by one actor while the
    others idle, and would reach the driver (and its commits) only when all of it is done. The split
    asks for no CPU, like the read tasks it then fuses into: a task of its own asking for one would
    wait for a CPU the actors hold. repartition() takes no resources argument, so they are set on
    its logical operator; a Ray without either falls back to unsplit blocks (slower, still correct).
    """
    try:
        split = rows.repartition(target_num_rows_per_block=batch_rows)
        remote_args = split._logical_plan.dag.ray_remote_args
    except (TypeError, AttributeError):
        log.warning("ray: this Ray Data cannot split the input into batches: each file goes to one actor")
        return rows
    remote_args["num_cpus"] = 0
    return split
