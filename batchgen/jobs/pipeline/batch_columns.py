"""The bookkeeping columns an executor adds to the tables it hands the batch function
(batchgen.jobs.pipeline.batch_fn, which documents them), kept apart so a driver reads them without torch."""

from __future__ import annotations

import pyarrow as pa

ROW_ID = "__batchgen_row_id"  # the row's id
SOURCE_PATH = "__batchgen_path"  # the file the row came from (copied to the output)
SOURCE_ROW = "__batchgen_row"  # the row's index in that file (copied to the output)
INVALID = "__batchgen_invalid"  # a reader's message for a cell that is not valid text
COMMITTED_HASH = "__batchgen_committed_hash"  # --id-column resumes: the committed row's prompt hash
PROVENANCE_FIELDS = (pa.field(SOURCE_PATH, pa.string()), pa.field(SOURCE_ROW, pa.int64()))
BOOKKEEPING = frozenset({ROW_ID, SOURCE_PATH, SOURCE_ROW, INVALID, COMMITTED_HASH})
# what each generated output row took from other rows (batchgen.jobs.planning.duplicates.reuse_counts),
# appended with the provenance columns so that the driver's summary and metrics count them as the
# local executor's do: shareable prefix tokens, prefix-hit prompt tokens, served from a duplicate
SHAREABLE_PREFIX = "__batchgen_shareable_prefix_tokens"
PREFIX_HIT = "__batchgen_prefix_hit_prompt_tokens"
FROM_DUPLICATE = "__batchgen_from_duplicate"
REUSE_FIELDS = (pa.field(SHAREABLE_PREFIX, pa.int64()), pa.field(PREFIX_HIT, pa.int64()),
                pa.field(FROM_DUPLICATE, pa.bool_()))
