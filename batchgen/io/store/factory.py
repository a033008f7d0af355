"""The store for an --output value: a local directory, or an object store for an s3:// or gs:// URL.

Above both kinds of store, so that neither imports the other.
"""

from __future__ import annotations

from pathlib import Path

from batchgen.config.output_url import check_output_url, is_url, job_output_dir
from batchgen.io.store.object_store import open_object_store
from batchgen.io.store.store import LocalStore, OutputStore

__all__ = ["check_output_url", "is_url", "open_store"]  # the URL rules are the config's


def open_store(out: str | Path | OutputStore) -> OutputStore:
    """The store for an --output value: a store as is, a URL through pyarrow.fs
    (batchgen.io.store.object_store), else a local directory. A .jsonl file's store is its
    bookkeeping directory beside it (batchgen.config.output_url.job_output_dir)."""
    if isinstance(out, OutputStore):
        return out
    out = job_output_dir(out)
    if not is_url(out):
        return LocalStore(out)
    return open_object_store(str(out))
