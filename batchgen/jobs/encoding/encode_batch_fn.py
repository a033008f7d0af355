"""The engine-side batch function of embed, score and classify jobs (the Ray executor's actors).

    generate = batch_generator_for(config, schema=schema)   # the task's (task_setup): this or BatchGenerator
    out = generate(table)                                    # one output row per input row, in input order

The same contract as BatchGenerator (batchgen.jobs.pipeline.batch_fn) around the encode core: rows
are prepared as the local executor prepares them (batchgen.jobs.encoding.encode_rows), a row whose
text cannot be read becomes an error row, a row whose COMMITTED_HASH equals its prompt hash is
settled and left out, and each row's output is what `batchgen run` writes for it locally.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from batchgen.config.job import JobConfig
from batchgen.engine.encode.load import EncodeModel
from batchgen.io.store.schema import PROMPT_HASH, PROMPT_TRUNCATED, SAMPLE_INDEX
from batchgen.jobs.durability.fingerprint import encode_model_fingerprint
from batchgen.jobs.encoding.encode_core import EncodeCore
from batchgen.jobs.encoding.encode_rows import encode_output_row, encode_prompt_builder, prepare_encode_row
from batchgen.jobs.pipeline.batch_columns import COMMITTED_HASH
from batchgen.jobs.pipeline.batch_fn import BatchGenerator, output_table
from batchgen.jobs.prompting.prompts import RowError, Template
from batchgen.jobs.rows.planned_row import PlannedRow

# every output column that is not a passthrough one, of any task
_FIXED = {PROMPT_HASH, PROMPT_TRUNCATED, SAMPLE_INDEX, "embedding", "logprob", "num_scored_tokens", "perplexity",
          "label", "scores", "num_prompt_tokens", "error"}


class EncodeBatchGenerator(BatchGenerator):
    """Input rows -> output rows of an embed / score / classify job through one loaded EncodeModel.
    `schema` is required: an encode job's columns depend on the model (the embedding's size)."""

    def __init__(self, config: JobConfig, *, schema: pa.Schema | None, loaded: EncodeModel):
        assert schema is not None, "an encode job's executor passes the schema its writer uses"
        self.config = config
        self.task = str(config.task)
        self.loaded = loaded
        self.core = EncodeCore(config, self.loaded)
        self.template = Template(config.template, config.prompt_column)
        self.builder = encode_prompt_builder(config, self.loaded.tokenizer, self.template,
                                             self.loaded.max_input_tokens)
        self.schema = schema
        self.model_fingerprint = encode_model_fingerprint(self.loaded, self.builder)
        self.num_rows_skipped = 0

    def __call__(self, table: pa.Table) -> pa.Table:
        schema = self.schema
        id_name = schema.field(0).name
        names = frozenset(schema.names)
        passthrough = [n for n in schema.names if n not in _FIXED and n != id_name]
        rows = self._input_rows(table)
        committed = table.column(COMMITTED_HASH).to_pylist() if COMMITTED_HASH in table.column_names else None
        outputs: list[dict[str, Any] | None] = [None] * len(rows)
        planned_rows: list[PlannedRow] = []
        position: dict[int, int] = {}
        for i, row in enumerate(rows):
            try:
                if row.error is not None:
                    raise RowError(row.error)
                planned = prepare_encode_row(row, self.builder, self.config)
                if planned.encode_inputs is not None and len(planned.encode_inputs) > 1:
                    raise RowError(f"{len(planned.encode_inputs)} inputs need one output row each, which the "
                                   "local executor writes: the Ray executor writes one output row per input row")
            except RowError as e:
                outputs[i] = encode_output_row(self.task, id_name, passthrough, names, row, error=str(e))
                continue
            if committed is not None and committed[i] is not None and committed[i] == planned.prompt_hash:
                self.num_rows_skipped += 1
                continue
            position[id(planned)] = i
            planned_rows.append(planned)
        if planned_rows:
            for planned, results in self.core.generate([planned_rows]):
                outputs[position[id(planned)]] = encode_output_row(
                    self.task, id_name, passthrough, names, planned.row, result=results[0], sample_index=0,
                    digest=planned.prompt_hash, truncated=planned.num_truncated_tokens > 0)
        return output_table(table, rows, outputs, schema)
