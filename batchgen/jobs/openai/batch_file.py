"""One OpenAI Batch output file at a `.jsonl` --output, where `vllm run-batch -o results.jsonl` writes it.

`-o results.jsonl --output-format openai-batch` writes `results.jsonl` itself: every request's
line (successes and error lines, the latter with status_code 400, as batchgen.jobs.openai.output
words them), one file as vLLM writes it, rather than the API's output/error pair. The job's
bookkeeping (manifest, parts, lock or lease, `_SUCCESS`) lives beside it in `results.jsonl.batchgen/`
(batchgen.config.output_url), which stays the commit point: the file is derived from the
committed rows, whole, when the job completes.

Exactly once. The file is written under a hidden temporary name beside it, fsynced and renamed
over the old one (on an object store: streamed to its name, an object only once whole), so a
reader sees no file, or a whole one, never a line twice. It exists only while it holds what the
committed rows say: a run that is about to change rows removes it first (clear_batch_file), a job
that fails --max-error-rate writes none, and a kill before the rename leaves the rows committed
and the next run writes it. So `results.jsonl` present means the job completed, as `_SUCCESS` does.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from batchgen.config.output_url import BOOKKEEPING_SUFFIX, batch_file_of
from batchgen.errors import OutputError
from batchgen.io.store.factory import open_store
from batchgen.io.store.local_files import TEMP_SUFFIX, fault_point, fsync_dir
from batchgen.io.store.object_store import ObjectStore
from batchgen.io.store.store import LocalStore, OutputStore
from batchgen.jobs.openai.temp_files import open_held, sweep_dead_temps

ROWS, ERRORS = "rows", "errors"  # what _SUCCESS records of the file: its lines, and how many are error lines


def batch_file_target(out: str | Path | OutputStore) -> tuple[OutputStore, str] | None:
    """(the store of the directory that holds the .jsonl file, the file's name) when `out` is a
    .jsonl --output's bookkeeping directory; None for any other output."""
    target = batch_file_of(out.url if isinstance(out, OutputStore) else out)
    if target is None:  # known from the name alone: no store opened
        return None
    store = open_store(out)
    if isinstance(store, LocalStore):
        path = store.path()
        return LocalStore(path.parent), path.name[:-len(BOOKKEEPING_SUFFIX)]
    assert isinstance(store, ObjectStore), type(store)
    parent_url, name = target.rsplit("/", 1)
    return ObjectStore(store.fs, store.base.rsplit("/", 1)[0], parent_url, store.conditional), name


def check_batch_file_target(out: str | Path | OutputStore, *, overwrite: bool) -> None:
    """Before a job opens its bookkeeping: refuse (exit 2) a .jsonl --output that is a directory
    (one an earlier batchgen wrote there, say) or a file no batchgen job here wrote (no bookkeeping
    beside it), as a directory holding someone else's files is refused, unless --overwrite."""
    target = batch_file_target(out)
    if target is None:
        return
    parent, name = target
    if parent.is_dir(name):
        raise OutputError(f"--output {parent / name} is a directory, and a .jsonl --output names one file; pass "
                          f"--output {parent / name}/ (with the slash) to use the directory")
    if parent.exists(name) and not overwrite and not open_store(out).list():
        raise OutputError(f"--output {parent / name} exists, and no batchgen job wrote it (there is no "
                          f"{parent / name}{BOOKKEEPING_SUFFIX} beside it); remove it, pass --overwrite, or "
                          "choose another --output")


def write_batch_file(target: tuple[OutputStore, str], lines: Iterator[tuple[bool, bytes]]) -> dict[str, int]:
    """Every line into the file, whole or not at all (the module docstring); its counts."""
    parent, name = target
    counts = {ROWS: 0, ERRORS: 0}

    def write(file) -> None:
        for is_error, line in lines:
            file.write(line)
            counts[ROWS] += 1
            counts[ERRORS] += is_error

    if not isinstance(parent, LocalStore):
        try:
            with parent.open_stream(name) as stream:
                write(stream)
        except (OSError, OutputError) as e:
            raise OutputError(f"cannot write the Batch API output file {parent / name}: {e}") from e
        return counts
    directory = parent.path()
    sweep_dead_temps(directory, (name,))  # a killed writer's (batchgen.jobs.openai.temp_files)
    temp = directory / f".{name}.{uuid.uuid4().hex[:8]}{TEMP_SUFFIX}"
    try:
        with open_held(temp) as file:  # held until renamed in: no other writer sweeps it meanwhile
            write(file)
            file.flush()
            os.fsync(file.fileno())
            fault_point("batch_file_rename")
            os.replace(temp, directory / name)
        fsync_dir(directory)
    except OSError as e:
        temp.unlink(missing_ok=True)
        raise OutputError(f"cannot write the Batch API output file {directory / name}: {e.strerror or e}") from e
    return counts


def batch_file_present(target: tuple[OutputStore, str]) -> bool:
    parent, name = target
    return parent.exists(name)


def clear_batch_file(out: str | Path | OutputStore) -> None:
    """Remove a .jsonl --output's file before its job changes rows: no file claims the rows meanwhile."""
    target = batch_file_target(out)
    if target is not None and target[0].exists(target[1]) and not target[0].is_dir(target[1]):
        parent, name = target
        parent.delete(name)
        parent.sync()
