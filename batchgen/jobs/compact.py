"""`batchgen compact`: rewrite a finished output directory as one part per input shard, in input order.

A job writes parts in commit order and rows within a part in finishing order; downstream tools
that want input order, or fewer files, run this once the job is complete (`_SUCCESS`). Each
committed row's input shard and row index are in the manifest (hidden bookkeeping, not output
columns), so no input file is read.

It is a commit like any other (batchgen.io.manifest): the new parts are staged, one "compact"
entry adds them and removes every old part, then they are published. A crash before the entry
leaves the old output; after it, the next `batchgen run` or `compact` finishes publishing.
`_SUCCESS` is removed before the entry and written again at the end; a job that wrote the OpenAI
Batch API files (batchgen.jobs.openai_output) gets them written again, in input order, before it.
Needs free disk space for one more copy of the output while it runs; memory is bounded by
CHUNK_ROWS rows and a few parts.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from batchgen.errors import OutputError
from batchgen.io.manifest import (
    SUCCESS_FILE,
    Manifest,
    PartRecord,
    fingerprint_digest,
    is_job_dir,
    load_manifest,
    write_success,
)
from batchgen.io.store import LocalStore, OutputStore, open_store
from batchgen.io.writers import PartWriter
from batchgen.jobs.openai_output import SUCCESS_KEY, recorded_batch_files, write_batch_files

log = logging.getLogger("batchgen")

CHUNK_ROWS = 8192  # rows gathered per row group of a compacted part
PART_CACHE = 4  # source parts held open at once


@dataclass(slots=True)
class CompactSummary:
    output_dir: str
    num_parts_before: int
    num_parts_after: int
    num_rows: int


def compact_output(out_dir: str | Path | OutputStore) -> CompactSummary:
    store = open_store(out_dir)
    out_dir = store.path() if isinstance(store, LocalStore) else store
    if not is_job_dir(store):
        from batchgen.jobs.sharded import compact_sharded, is_sharded_output

        if is_sharded_output(store):  # each shard compacted; the job's _SUCCESS written again
            return compact_sharded(store)
        raise OutputError(f"{out_dir} is not a batchgen output directory (it has no _manifest)")
    with store.lock() as lock:
        manifest = Manifest(store, load_manifest(store, keep_rows=True, keep_hashes=True), guard=lock)
        if manifest.recover():
            raise OutputError(f"{out_dir} has missing or damaged parts; run the job again to regenerate them")
        state = manifest.state
        if not store.exists(SUCCESS_FILE):
            raise OutputError(f"{out_dir} is not complete (no {SUCCESS_FILE}); finish the job first "
                              "(`batchgen status` shows what remains)")
        before = len(state.parts)
        batch_files = recorded_batch_files(store)  # --output-format openai-batch / both
        if state.last_op == "compact" or not state.parts:
            return CompactSummary(str(out_dir), before, before, state.num_committed_rows)
        rows_by_shard: dict[str, list[tuple[int, str, int]]] = {}  # shard -> [(row, part, position)]
        for record in state.parts.values():
            assert record.shards is not None and record.rows is not None
            for position, (shard, row) in enumerate(zip(record.shards, record.rows, strict=True)):
                rows_by_shard.setdefault(shard, []).append((row, record.name, position))
        listed = [s["path"] for s in state.inputs["inputs"]] if state.inputs else []
        order = [p for p in listed if p in rows_by_shard] + sorted(set(rows_by_shard) - set(listed))
        first = next(iter(state.parts))
        writer = PartWriter(store, store.read_schema(first))
        reader = _PartReader(store)
        tag = f".{state.last_seq + 1:08d}"
        errors = state.error_ids
        staged = []
        try:
            for shard in order:
                items = sorted(rows_by_shard[shard])
                part = writer.stage_tables(reader.gather(items), tag=tag)
                ids = [state.parts[name].ids[pos] for _, name, pos in items]
                hashes = [state.prompt_hashes.get(i) for i in ids] if state.prompt_hashes else None
                staged.append((part, PartRecord.staged(part, ids, [i in errors for i in ids], [shard] * len(items),
                                                       [row for row, _, _ in items], hashes)))
        except BaseException:
            for part, _ in staged:
                part.discard()
            raise
        manifest.commit(staged, list(state.parts), op="compact")  # removes _SUCCESS first
        success = {"rows": state.num_committed_rows, "rows_error": len(state.error_ids),
                   "fingerprint": fingerprint_digest(state.fingerprint), "compacted": True}
        manifest.sweep()  # _SUCCESS vouches for the listing (Manifest.sweep)
        if batch_files is not None:  # written again, now in input order, before _SUCCESS
            success[SUCCESS_KEY] = write_batch_files(store, manifest.state, batch_files["dir"],
                                                     created=batch_files.get("created"))
        write_success(store, success)
        log.info("compacted %d parts into %d", before, len(staged))
        return CompactSummary(str(out_dir), before, len(staged), state.num_committed_rows)


class _PartReader:
    """Rows of committed parts by position, in chunks, with a few parts cached."""

    def __init__(self, store: OutputStore):
        self.store = store
        self.cache: OrderedDict[str, pa.Table] = OrderedDict()

    def gather(self, items: list[tuple[int, str, int]]) -> Iterator[pa.Table]:
        for start in range(0, len(items), CHUNK_ROWS):
            chunk = items[start:start + CHUNK_ROWS]
            pieces = []
            run_name, run_positions = None, []
            for _, name, position in chunk:  # consecutive rows from one part are taken together
                if name != run_name and run_positions:
                    pieces.append(self._part(run_name).take(run_positions))
                    run_positions = []
                run_name = name
                run_positions.append(position)
            if run_positions:
                pieces.append(self._part(run_name).take(run_positions))
            yield pa.concat_tables(pieces)

    def _part(self, name: str) -> pa.Table:
        if name in self.cache:
            self.cache.move_to_end(name)
            return self.cache[name]
        table = self.store.read_table(name)
        self.cache[name] = table
        if len(self.cache) > PART_CACHE:
            self.cache.popitem(last=False)
        return table
