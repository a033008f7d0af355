"""`_SUCCESS`: the marker that an output is complete, and what it must be true of before it is written.

A reader that sees `_SUCCESS` reads the output as a plain listing (`**/*.parquet`, a dataset
reader) or through the manifest, and both must then find every committed row once. So before it
is written the writer sweeps away every part no entry commits (batchgen.io.manifest.manifest's
`sweep`), and checks here that every part the manifest commits is there at the size its entry
recorded: a part can vanish under a job that did not delete it (on an object store, a writer
that lost the lease while paused and woke; a person or a lifecycle rule on a bucket), and
`_SUCCESS` over a missing part is a silent loss to a dataset reader and a crash to a manifest
reader. The next run's recovery finds such a part missing and generates its rows again.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchgen.errors import OutputError
from batchgen.io.store.factory import open_store
from batchgen.io.store.store import LocalStore, OutputStore
from batchgen.io.store.writers import write_json_atomic

if TYPE_CHECKING:
    from batchgen.io.manifest.state import ManifestState, PartRecord

SUCCESS_FILE = "_SUCCESS"


def missing_parts(out_dir: str | Path | OutputStore, state: ManifestState) -> list[PartRecord]:
    """The committed parts that are not in the store's listing at the size their entry recorded."""
    sizes = open_store(out_dir).list()
    return [record for record in state.parts.values() if sizes.get(record.name) != record.num_bytes]


def check_parts_present(out_dir: str | Path | OutputStore, state: ManifestState) -> None:
    """Raise OutputError unless every committed part is there (the module docstring): run just
    before `_SUCCESS` is written, and by `finalize` for each shard."""
    missing = missing_parts(out_dir, state)
    if missing:
        raise OutputError(f"{open_store(out_dir)}: {describe_missing(missing)}; something other than this job "
                          "removed them (a job that lost this output while paused, a bucket lifecycle rule, a "
                          "person), so no _SUCCESS was written. Run the same command again: it generates those "
                          "rows again")


def describe_missing(missing: list[PartRecord]) -> str:
    shown = ", ".join(record.name for record in missing[:3]) + (", ..." if len(missing) > 3 else "")
    rows = sum(record.num_rows for record in missing)
    return (f"{len(missing)} committed part(s) holding {rows} rows are missing or not the size their manifest entry "
            f"recorded ({shown})")


def clear_success(out_dir: str | Path | OutputStore) -> None:
    store = open_store(out_dir)
    if store.exists(SUCCESS_FILE):
        store.delete(SUCCESS_FILE)
        store.sync()


def write_success(out_dir: str | Path | OutputStore, payload: dict[str, Any]) -> None:
    store = open_store(out_dir)
    write_json_atomic(store.path(SUCCESS_FILE) if isinstance(store, LocalStore) else (store, SUCCESS_FILE), payload)
