"""What `batchgen run` and `batchgen plan` both set up, written once.

Two steps, because a run must check its output directory between them, before a model is loaded:

    inputs = open_inputs(config)        # the config, the input files, one scan of the ids: no model
    job = prepare_job(config, inputs, loaded, engine, out_dir=..., state=...)
    for planned in job.planner.plans(job.rows(on_error)):   # committed rows skipped, prompts built

`prepare_job` builds the prompt builder (sized for the engine's context), the output-length
predictor (learned state from the output directory), the planner (sized for the engine's KV
cache) and the resume rule (batchgen.jobs.durability.resume): rows an earlier run settled are skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgen.config.constraint import Constraint, InvalidConstraint, job_constraint
from batchgen.config.job import JobConfig
from batchgen.config.rules import label
from batchgen.errors import ConfigError
from batchgen.io.manifest.manifest import ManifestState
from batchgen.io.store.store import OutputStore
from batchgen.jobs.durability.resume import ResumeRule
from batchgen.jobs.durability.scan import InputScan, scan_inputs
from batchgen.jobs.planning.length import LengthPredictor
from batchgen.jobs.planning.planner import Planner, prepare_row
from batchgen.jobs.prompting.prompts import PromptBuilder, RowError, Template
from batchgen.jobs.rows.planned_row import PlannedRow
from batchgen.jobs.rows.rows import InputRow, RowSource

if TYPE_CHECKING:  # open_inputs and the resume rule run before torch is imported
    from batchgen.engine.engine import LLMEngine
    from batchgen.engine.model.loader import LoadedModel


@dataclass(slots=True)
class JobInputs:
    source: RowSource
    scan: InputScan


def open_inputs(config: JobConfig, *, need_output: bool = True) -> JobInputs:
    """Validate the config and check every input (files, columns, ids) before anything is loaded."""
    config.validate(need_output=need_output)
    source = RowSource.open(config)  # every input problem surfaces here or in the scan, before any output
    return JobInputs(source, scan_inputs(source))


def length_model_key(loaded: LoadedModel, builder: PromptBuilder) -> dict[str, Any]:
    """What the learned output lengths depend on: another model or prompt starts from the prior."""
    template = builder.template
    return {"model": loaded.name, "model_revision": loaded.revision, "template": template.text,
            "prompt_column": template.prompt_column, "system": builder.system, "chat": builder.chat}


@dataclass(slots=True)
class PreparedJob:
    config: JobConfig
    source: RowSource
    builder: PromptBuilder
    predictor: LengthPredictor | None  # None for embed / score / classify: no output to predict or plan
    planner: Planner | None
    resume: ResumeRule
    num_rows_skipped: int = 0  # committed by an earlier run (or an error row kept: --no-retry-errors)
    num_rows_retried: int = 0  # error rows of an earlier run read to be generated again
    num_error_rows: int = 0  # rows whose prompt could not be built
    num_rows_changed: int = 0  # committed rows (--id-column) whose prompt changed: generated again
    # called once, before the first row that will change the output (generated, or an error row)
    on_change: Callable[[], None] | None = None
    # the engine's grammar cache (GrammarMasks.compiled): a row's own constraint compiles when prepared
    compile_constraint: Callable[[Constraint], Any] | None = None
    # a row -> its PlannedRow (RowError for an error row); None: a generation row (planner.prepare_row)
    prepare: Callable[[InputRow], PlannedRow] | None = None

    def rows(self, on_error: Callable[[InputRow, str], None]) -> Iterator[PlannedRow]:
        """The rows to generate, prompts built; settled rows skipped, error rows handed to on_error."""
        resume = self.resume
        for row, committed_hash in resume.unsettled_rows(self.source, self._count_skipped):
            check = committed_hash is not None
            self.num_rows_retried += row.row_id in resume.state.error_ids
            try:
                if row.error is not None:
                    raise RowError(row.error)
                planned = self.prepare(row) if self.prepare is not None else prepare_row(
                    row, self.builder, self.config, compile_constraint=self.compile_constraint)
            except RowError as e:
                self.num_rows_changed += check  # its prompt no longer builds: an error row replaces it
                self.num_error_rows += 1
                self._changing()
                on_error(row, str(e))
                continue
            if check:
                if planned.prompt_hash == committed_hash:
                    self.num_rows_skipped += 1
                    continue
                self.num_rows_changed += 1
            self._changing()
            yield planned

    def _changing(self) -> None:
        if self.on_change is not None:
            on_change, self.on_change = self.on_change, None
            on_change()

    def _count_skipped(self, num_rows: int) -> None:
        self.num_rows_skipped += num_rows


def seq_token_needs(config: JobConfig, inputs: JobInputs, loaded: LoadedModel, resume: ResumeRule
                    ) -> tuple[int, ...] | None:
    """Prompt + max output tokens of every row a small job will run (at most one planning window),
    so that its KV cache holds just those (engine.EngineConfig.seq_token_needs); None for a larger one.

    Prompts are built against the model's context, which is at least the engine's (an engine
    with a smaller budget cuts them shorter): the need is never under-counted."""
    if inputs.scan.num_rows - resume.num_rows_done > config.window_rows:
        return None
    builder = PromptBuilder.for_job(config, loaded.tokenizer, inputs.source.template, loaded.max_context_tokens)
    needs = []
    for row, _ in resume.unsettled_rows(inputs.source):
        if row.error is not None:
            continue
        try:
            planned = prepare_row(row, builder, config)
        except RowError:
            continue
        # each sample is a sequence (they share the prompt's blocks: counting it n times over-counts, never under)
        needs += [planned.num_prompt_tokens + planned.max_new_tokens] * planned.num_samples
        if len(needs) > config.window_rows:
            return None
    return tuple(needs) or None


def prompt_side(config: JobConfig, template: Template, loaded: LoadedModel, engine: LLMEngine, *,
                out_dir: Path | OutputStore | None) -> tuple[PromptBuilder, LengthPredictor, Planner]:
    """The prompt builder (sized for `engine`'s context), the output-length predictor (learned state
    from `out_dir`, if any) and the planner (sized for its KV cache): what turns rows into planned windows.
    Shared by prepare_job and the engine-side batch function (batchgen.jobs.pipeline.batch_fn)."""
    builder = PromptBuilder.for_job(config, loaded.tokenizer, template, engine.max_tokens_per_seq)
    predictor = LengthPredictor.load(out_dir, length_model_key(loaded, builder), ignore_eos=config.ignore_eos)
    planner = Planner(config, predictor, kv_capacity_tokens=engine.kv_capacity_tokens,
                      block_size=engine.block_size, device_type=engine.device.type,
                      max_model_len=engine.max_model_len)
    return builder, predictor, planner


def prepare_job(config: JobConfig, inputs: JobInputs, loaded: LoadedModel, engine: LLMEngine, *,
                out_dir: Path | OutputStore | None, state: ManifestState | None) -> PreparedJob:
    """The shared setup once a model is loaded: `engine` is the first engine the job builds."""
    builder, predictor, planner = prompt_side(config, inputs.source.template, loaded, engine, out_dir=out_dir)
    resume = ResumeRule(state if state is not None else ManifestState(), config.retry_errors,
                        check_prompts=config.id_column is not None)
    check_job_constraint(config, engine)
    return PreparedJob(config, inputs.source, builder, predictor, planner, resume,
                       compile_constraint=engine.grammar.compiled)


def check_job_constraint(config: JobConfig, engine: LLMEngine) -> None:
    """The job's constraint compiled against the model's tokenizer once the model is loaded: one that
    passed the tokenizer-free check before the load but does not compile exits 2 naming its flag
    (every row would fail alike), rather than the engine refusing each row."""
    constraint = job_constraint(config)
    if constraint is None:
        return
    try:
        engine.grammar.compiled(constraint)
    except InvalidConstraint as e:
        flag = next(name for name in ("json_schema", "regex", "choices") if getattr(config, name) is not None)
        raise ConfigError(f"{label(flag)} does not compile for this model's tokenizer: {e}") from None
