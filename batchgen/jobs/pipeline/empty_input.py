"""An input without rows: one answer for every format (run and plan alike).

A scheduled job's partition may be empty (a 0-byte file, JSON Lines without a record, a Parquet
file of 0 rows). That is a normal day, not a mistake: the run loads no model, writes its summary
and `_SUCCESS`, and exits 0. A job that must never find its input empty says so with
--no-allow-empty-input, and exits 2 instead. One shard of a sharded job may get an empty share of
a job that has rows; that is never an error, so the flag looks at the whole job's input.
"""

from __future__ import annotations

import logging

from batchgen.config.job import JobConfig
from batchgen.errors import InputError
from batchgen.io.inputs.readers import holds_no_rows
from batchgen.jobs.pipeline.prepare import JobInputs
from batchgen.jobs.pipeline.summary import plural

log = logging.getLogger("batchgen")


def input_is_empty(config: JobConfig, inputs: JobInputs) -> bool:
    """Whether this run has no row to read (logged once); raises InputError (exit 2) under
    --no-allow-empty-input when the job's whole input is empty."""
    if inputs.scan.num_rows:
        return False
    source = inputs.source
    job_files = [shard for shard, _ in source.job_files] if source.job_files is not None else source.shards
    files = plural(len(source.shards), "input file")
    if not config.allow_empty_input and all(holds_no_rows(shard) for shard in job_files):
        raise InputError(f"the input holds no rows ({files}, every one empty) and --no-allow-empty-input "
                         "is set; drop it to finish an empty input with exit 0 and _SUCCESS")
    share = " (this shard's share)" if source.job_files is not None else ""
    log.info("the input%s holds no rows (%s): nothing to generate, no model loaded", share, files)
    return True
