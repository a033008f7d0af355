"""What many job tests need: a job config on the tiny model, an input of short random texts, and
the committed rows by id."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

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


def write_random_texts(path: Path, num_rows: int, *, seed: int, max_chars: int, alphabet: str = "abcdefgh ijk",
                       **write_options) -> Path:
    """A Parquet input of `num_rows` rows: an int id 0..num_rows-1 and a text of 3 to max_chars
    characters drawn from `alphabet`, the same for the same seed."""
    rng = random.Random(seed)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(3, max_chars))) for _ in range(num_rows)]
    pq.write_table(pa.table({"id": list(range(num_rows)), "text": texts}), path, **write_options)
    return path
