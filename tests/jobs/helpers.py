"""What many job tests need: a job config on the tiny model, and the committed rows by id."""

from __future__ import annotations

import pyarrow.dataset as ds

from batchgen.config.job import JobConfig, build_config


def tiny_job_config(inputs, out, model_dir, **overrides) -> JobConfig:
    """A job over `inputs` (a path or a list) on the tiny CPU model in float32, a 16 MiB KV cache,
    no progress bar; each test file adds its own settings in `overrides`."""
    paths = inputs if isinstance(inputs, list) else [inputs]
    values = dict(inputs=[str(p) for p in paths], output=str(out), model=str(model_dir), device="cpu",
                  dtype="float32", kv_cache_memory="16MiB", quiet=True)
    values.update(overrides)
    return build_config(None, **values)


def committed_rows(out, id_column: str = "id") -> dict:
    """Every committed output row by id; fails if an id appears twice (exactly-once)."""
    table = ds.dataset(str(out), format="parquet").to_table()
    ids = table.column(id_column).to_pylist()
    assert len(ids) == len(set(ids)), "an id appears twice"
    return {row[id_column]: row for row in table.to_pylist()}
