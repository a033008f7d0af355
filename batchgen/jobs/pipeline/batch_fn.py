"""The engine-side batch function: a pyarrow.Table of input rows in, a pyarrow.Table of output rows out.

    generate = BatchGenerator(config)        # loads the model once (or takes a LoadedModel)
    out = generate(table)                    # one output row per input row, in input order

What an executor that hands out batches calls (the Ray executor's actors, batchgen.jobs.executors.ray; a notebook).
It is the local executor's work minus the output directory: the same prompt builder, planner and
job core (batchgen.jobs.pipeline.prepare, planner, core), so a row's output is what `batchgen run` writes for
it. A row that cannot be generated (no prompt, a bad per-row limit or sampling cell, a prompt too
long under --on-long-prompt error) becomes an error row; an exception means the engine itself failed.

Input columns: the ones the job reads (template, --max-new-tokens-column, ...) and the passthrough
columns, plus optional bookkeeping columns an executor adds (jobs/pipeline/batch_columns.py, all named `__batchgen_*`):
ROW_ID (the row's id; else --id-column, else "<position in the table>"), SOURCE_PATH and
SOURCE_ROW (where the row came from: copied to the output, so the executor's committer can record
them), INVALID (a reader's message for a cell that is not valid text: the row becomes an error
row) and COMMITTED_HASH (--id-column resumes: a row whose prompt hash equals it is settled and left
out of the output, as the local executor skips it).
"""

from __future__ import annotations

import logging
from typing import Any

import pyarrow as pa

from batchgen.config.constraint import writes_json_valid
from batchgen.config.job import JobConfig
from batchgen.engine.model.loader import LoadedModel, load_model
from batchgen.engine.request import Completion
from batchgen.io.inputs.discovery import InputFile
from batchgen.io.store.schema import (
    ADAPTER,
    JSON_VALID,
    LOGPROBS,
    PROMPT_HASH,
    PROMPT_TRUNCATED,
    SAMPLE_INDEX,
    output_schema,
)
from batchgen.jobs.durability.fingerprint import model_fingerprint
from batchgen.jobs.pipeline.batch_columns import (
    BOOKKEEPING,
    COMMITTED_HASH,
    INVALID,
    PROVENANCE_FIELDS,
    REUSE_FIELDS,
    ROW_ID,
    SOURCE_PATH,
    SOURCE_ROW,
)
from batchgen.jobs.pipeline.core import JobCore
from batchgen.jobs.pipeline.logprob_column import LogprobColumn
from batchgen.jobs.pipeline.prepare import check_job_constraint, prompt_side
from batchgen.jobs.planning.duplicates import reuse_counts
from batchgen.jobs.planning.planner import prepare_row
from batchgen.jobs.prompting.prompts import RowError, Template
from batchgen.jobs.rows.planned_row import PlannedRow
from batchgen.jobs.rows.row_constraint import json_valid
from batchgen.jobs.rows.rows import DERIVED_ID_COLUMN, InputRow

log = logging.getLogger("batchgen")

_TABLE_SOURCE = "<batch>"  # the SOURCE_PATH of rows handed over without one


def output_row(id_name: str, passthrough: list[str], with_prompt_hash: bool, row: InputRow, *,
               completion: Completion | None = None, error: str | None = None,
               digest: str | None = None, truncated: bool | None = None,
               with_prompt_truncated: bool = True, logprobs: LogprobColumn | None = None,
               with_json_valid: bool = False, json_valid: bool | None = None,
               with_sample_index: bool = False, with_adapter: bool = False,
               adapter: str | None = None) -> dict[str, Any]:
    """One output row (batchgen.io.store.schema's columns) of a finished row or an error row: the one
    definition both executors write. Without prompt_hash / prompt_truncated for a directory begun
    before those columns (the writer refuses keys its schema lacks)."""
    out: dict[str, Any] = {id_name: row.row_id}
    if with_sample_index:  # the job's rows may have several samples: (id, sample_index) is the key
        out[SAMPLE_INDEX] = None if completion is None else completion.sample_index
    if with_prompt_hash:
        out[PROMPT_HASH] = digest
    if completion is not None:
        out.update(generated_text=completion.text, finish_reason=completion.finish_reason.value,
                   num_prompt_tokens=completion.num_prompt_tokens,
                   num_generated_tokens=completion.num_generated_tokens, error=None)
    else:
        out.update(generated_text=None, finish_reason="error", num_prompt_tokens=None,
                   num_generated_tokens=0, error=error)
    if with_prompt_truncated:
        out[PROMPT_TRUNCATED] = None if completion is None else bool(truncated)
    if logprobs is not None:  # --logprobs: the schema has the column
        out[LOGPROBS] = None if completion is None else logprobs.cell(completion)
    if with_json_valid:  # a JSON-constrained job: the schema has the column
        out[JSON_VALID] = json_valid
    if with_adapter:  # a --lora job: which adapter produced the row (null: the base model, an error row)
        out[ADAPTER] = adapter if completion is not None else None
    for name in passthrough:
        out[name] = row.values.get(name)
    return out


class BatchGenerator:
    """Input rows -> output rows through one loaded model; see the module docstring.

    `schema`: the job's output schema (batchgen.io.store.schema.output_schema; an executor passes the one its
    writer uses). Without it, it is derived from the first table: the id column (--id-column's
    type, or the derived string `row_id`), then the passthrough columns (--keep-columns, else every
    input column but the id and bookkeeping ones).
    """

    def __init__(self, config: JobConfig, *, schema: pa.Schema | None = None, loaded: LoadedModel | None = None):
        self.config = config
        if loaded is None:
            loaded = load_model(config.model, device=config.device, dtype=config.dtype,
                                trust_remote_code=config.trust_remote_code, quantize=config.quantize,
                                quantize_backend=config.quantize_backend, quantize_embedding=config.quantize_embedding)
        self.loaded = loaded
        self.core = JobCore(config, loaded)
        engine = self.core.engines.get(config.engine_policy())
        self.template = Template(config.template, config.prompt_column)
        self.builder, self.predictor, self.planner = prompt_side(config, self.template, loaded, engine, out_dir=None)
        check_job_constraint(config, engine)
        self.compile_constraint = engine.grammar.compiled  # a row's own constraint compiles when prepared
        self.schema = schema
        self.model_fingerprint = model_fingerprint(loaded, self.builder)  # what the driver's fingerprint needs
        self.num_rows_skipped = 0  # COMMITTED_HASH rows whose prompt was unchanged

    def __call__(self, table: pa.Table) -> pa.Table:
        schema = self.schema if self.schema is not None else self._derive_schema(table)
        id_name = schema.field(0).name
        with_hash = PROMPT_HASH in schema.names
        marks = {"with_prompt_truncated": PROMPT_TRUNCATED in schema.names,
                 "with_sample_index": SAMPLE_INDEX in schema.names}  # one sample per row here: index 0
        marks["with_json_valid"] = JSON_VALID in schema.names  # a JSON-constrained job
        marks["with_adapter"] = ADAPTER in schema.names  # a --lora job
        fixed = {id_name, PROMPT_HASH, PROMPT_TRUNCATED, SAMPLE_INDEX, JSON_VALID, ADAPTER, "generated_text",
                 "finish_reason",
                 "num_prompt_tokens", "num_generated_tokens", "error"}
        passthrough = [n for n in schema.names if n not in fixed]
        rows = self._input_rows(table)
        committed = table.column(COMMITTED_HASH).to_pylist() if COMMITTED_HASH in table.column_names else None
        outputs: list[dict[str, Any] | None] = [None] * len(rows)
        reuse: list[tuple[int, int, bool]] = [(0, 0, False)] * len(rows)  # per row: reuse_counts, a copy
        planned_rows: list[PlannedRow] = []
        position: dict[int, int] = {}  # id(PlannedRow) -> its row's position in the table
        for i, row in enumerate(rows):
            try:
                if row.error is not None:
                    raise RowError(row.error)
                planned = prepare_row(row, self.builder, self.config, compile_constraint=self.compile_constraint)
                if planned.num_samples > 1:  # rules.py refuses --n; a row's own n lands here
                    raise RowError(f"n = {planned.num_samples} samples need the local executor: "
                                   "the Ray executor writes one output row per input row")
            except RowError as e:
                outputs[i] = output_row(id_name, passthrough, with_hash, row, error=str(e), **marks)
                continue
            if committed is not None and committed[i] is not None and committed[i] == planned.prompt_hash:
                self.num_rows_skipped += 1  # settled by an earlier run: no output row
                continue
            position[id(planned)] = i
            planned_rows.append(planned)
        if planned_rows:
            for planned, [completion] in self.core.generate(self.planner.plans(iter(planned_rows))):
                self.predictor.observe(planned.num_prompt_tokens, completion.num_generated_tokens, planned.prediction)
                constraint = planned.constraint if planned.constraint is not None else self.core.constraint
                at = position[id(planned)]
                outputs[at] = output_row(id_name, passthrough, with_hash, planned.row, completion=completion,
                                         digest=planned.prompt_hash, truncated=planned.num_truncated_tokens > 0,
                                         json_valid=json_valid(constraint, completion), adapter=planned.adapter,
                                         **marks)
                reuse[at] = (*reuse_counts(planned, completion), planned.served_from_duplicate)
        return output_table(table, rows, outputs, schema, reuse)

    def _input_rows(self, table: pa.Table) -> list[InputRow]:
        names = table.column_names
        values = table.select([n for n in names if n not in BOOKKEEPING]).to_pylist()
        n = table.num_rows

        def column(name: str, default: list) -> list:
            return table.column(name).to_pylist() if name in names else default

        if ROW_ID in names:
            ids = column(ROW_ID, [])
        elif self.config.id_column:
            ids = column(self.config.id_column, [])
        else:
            ids = [str(i) for i in range(n)]
        paths = column(SOURCE_PATH, [_TABLE_SOURCE] * n)
        indexes = column(SOURCE_ROW, list(range(n)))
        invalid = column(INVALID, [None] * n)
        files: dict[str, InputFile] = {}
        rows = []
        for i in range(n):
            path = paths[i] if paths[i] is not None else _TABLE_SOURCE
            file = files.setdefault(path, InputFile(path, "parquet", None))
            rows.append(InputRow(ids[i], file, indexes[i], values[i], invalid[i]))
        return rows

    def _derive_schema(self, table: pa.Table) -> pa.Schema:
        config = self.config
        if config.id_column:
            id_field = table.schema.field(config.id_column)
        else:
            id_field = pa.field(DERIVED_ID_COLUMN, pa.string())
        names = config.keep_columns if config.keep_columns is not None else table.column_names
        passthrough = [table.schema.field(n) for n in names
                       if n not in BOOKKEEPING and n != config.id_column and n != id_field.name]
        self.schema = output_schema(id_field, passthrough, with_json_valid=writes_json_valid(config),
                                    with_adapter=bool(config.lora))
        return self.schema


def output_table(table: pa.Table, rows: list[InputRow], outputs: list[dict[str, Any] | None],
                 schema: pa.Schema, reuse: list[tuple[int, int, bool]] | None = None) -> pa.Table:
    """The output rows of a batch (None: a row with no output here), with the executor's provenance
    columns where its table carried them, for its committer, and then each row's `reuse` (a
    generating task's REUSE_FIELDS), for its summary and metrics."""
    assert len(outputs) == len(rows) and (reuse is None or len(reuse) == len(rows))
    kept = [i for i, out in enumerate(outputs) if out is not None]
    result = pa.Table.from_pylist([outputs[i] for i in kept], schema=schema)
    if SOURCE_PATH in table.column_names:
        result = result.append_column(PROVENANCE_FIELDS[0], pa.array([rows[i].file.path for i in kept], pa.string()))
        result = result.append_column(PROVENANCE_FIELDS[1], pa.array([rows[i].row_index for i in kept], pa.int64()))
        for k, f in enumerate(REUSE_FIELDS if reuse is not None else ()):
            result = result.append_column(f, pa.array([reuse[i][k] for i in kept], f.type))
    return result
