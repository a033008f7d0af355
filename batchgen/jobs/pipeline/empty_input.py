"""An input without rows: one answer for every format (run and plan alike).

A scheduled job's partition may be empty (a 0-byte file, JSON Lines without a record, a Parquet
file of 0 rows). That is a normal day, not a mistake: the run loads no model, writes its summary
and `_SUCCESS`, and exits 0. A job that must never find its input empty says so with
--no-allow-empty-input, and exits 2 instead. A shard of a sharded job whose share is empty while
the job has rows is not an empty input: it runs as any shard does, so that its fingerprint names the
model as its sibling shards' do (finalize compares them).
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
    """Whether the job's input holds no rows (logged once): the run then loads no model. Raises
    InputError (exit 2) under --no-allow-empty-input."""
    if inputs.scan.num_rows:
        return False
    source = inputs.source
    job_files = source.files
    if source.job_files is not None:  # a shard of a sharded job: is the whole job's input empty?
        job_files = [file for file, _ in source.job_files]
        if not all(holds_no_rows(file) for file in job_files):
            return False
    files = plural(len(job_files), "input file")
    if not config.allow_empty_input:
        raise InputError(f"the input holds no rows ({files}, every one empty) and --no-allow-empty-input "
                         "is set; drop it to finish an empty input with exit 0 and _SUCCESS")
    log.info("the input holds no rows (%s): nothing to generate, no model loaded", files)
    return True
