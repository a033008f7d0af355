"""Committing finished rows: buffer them, then stage, commit and publish parts through the manifest.

At most rows_per_part rows per part. A retried error row that now succeeds, or fails
differently, replaces its old row in the same commit: the part that held it is rewritten without
it (or removed when nothing is left). One that fails again with the same message keeps its
committed row and costs no write (today's error rows are all of that kind: a prompt that cannot
be built fails the same way every time). A committed row generated again because its prompt
changed (--id-column, batchgen.jobs.durability.resume) replaces its old row the same way. Either way each id
is in exactly one part.

A job with a sample_index column (several samples per row, batchgen.io.store.schema) writes a
row's samples together: one buffered entry, one part, next to each other. The manifest lists the
row once, so a row id is committed with all of its samples or not at all.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.io.manifest.manifest import Manifest, PartRecord
from batchgen.io.manifest.state import part_row_lists
from batchgen.io.store.schema import PROMPT_HASH, SAMPLE_INDEX
from batchgen.io.store.writers import PartWriter


@dataclass(slots=True)
class CommitCounts:
    num_commits: int = 0
    num_parts_written: int = 0
    num_rows_committed: int = 0
    num_rows_replaced: int = 0  # retried or changed rows whose old row was replaced
    num_rows_unchanged: int = 0  # retried rows that failed again the same way (nothing written)


@dataclass(slots=True)
class _Pending:
    outs: list[dict[str, Any]]  # the row's output rows: one, or one per sample
    path: str  # the input file the row came from
    row: int

    @property
    def out(self) -> dict[str, Any]:
        return self.outs[0]


class Committer:
    """Buffers finished output rows and commits them through the manifest."""

    def __init__(self, manifest: Manifest, writer: PartWriter, id_name: str, *, rows_per_part: int):
        self.manifest = manifest
        self.writer = writer
        self.id_name = id_name
        self.rows_per_part = rows_per_part
        self.with_hashes = PROMPT_HASH in writer.schema.names
        self.with_samples = SAMPLE_INDEX in writer.schema.names
        self.buffer: list[_Pending] = []
        self.counts = CommitCounts()
        self._old_errors: dict[str, dict[Any, str]] = {}  # part -> {id: message of an error row}, lazily

    def __len__(self) -> int:
        return len(self.buffer)

    def add(self, out: dict[str, Any] | list[dict[str, Any]], path: str, row: int) -> None:
        """Buffer one input row's output: a row, or its samples' rows (committed together)."""
        outs = out if isinstance(out, list) else [out]
        assert len(outs) == 1 or self.with_samples, "several output rows for one id need the sample_index column"
        self.buffer.append(_Pending(outs, path, row))

    def commit(self) -> None:
        """Stage, commit and publish the buffer (one manifest entry); a no-op when empty."""
        if not self.buffer:
            return
        state = self.manifest.state
        seq_tag = f".{state.last_seq + 1:08d}"
        superseded: dict[str, set[Any]] = defaultdict(set)
        rows = []
        changed = {item.out[self.id_name] for item in self.buffer} & state.ok_ids  # prompts that changed
        old_parts = state.part_of(changed) if changed else {}
        for item in self.buffer:
            row_id = item.out[self.id_name]
            old_part = state.error_ids.get(row_id)
            if old_part is not None:
                if item.out["error"] is not None and item.out["error"] == self._old_message(old_part, row_id):
                    self.counts.num_rows_unchanged += 1  # the committed row already says this
                    continue
                superseded[old_part].add(row_id)
            elif row_id in old_parts:
                superseded[old_parts[row_id]].add(row_id)
            rows.append(item)
        staged: list = []
        remove: list[str] = []
        try:
            for chunk in self._chunks(rows):
                part = self.writer.stage_part([out for p in chunk for out in p.outs], tag=seq_tag)
                staged.append((part, PartRecord.staged(
                    part, [p.out[self.id_name] for p in chunk], [p.out["error"] is not None for p in chunk],
                    [p.path for p in chunk], [p.row for p in chunk],
                    [p.out[PROMPT_HASH] for p in chunk] if self.with_hashes else None, with_samples=self.with_samples)))
            for name, ids in superseded.items():
                rewrite = self._rewrite_without(name, ids, seq_tag)
                if rewrite is not None:
                    staged.append(rewrite)
                if rewrite is None or rewrite[0].name != name:  # an object store rewrites under a new name
                    remove.append(name)
        except BaseException:
            for part, _ in staged:  # nothing is committed yet: these temps are garbage
                part.discard()
            raise
        self.manifest.commit(staged, remove)  # a no-op when every row was an unchanged retry
        for name in superseded:
            self._old_errors.pop(name, None)
        self.counts.num_commits += bool(staged or remove)
        self.counts.num_parts_written += len(staged)
        self.counts.num_rows_committed += len(rows)
        self.counts.num_rows_replaced += sum(len(ids) for ids in superseded.values())
        self.buffer = []

    def _chunks(self, rows: list[_Pending]) -> list[list[_Pending]]:
        """At most rows_per_part output rows per part, a row's samples never split (a row with more
        samples than that has a part of its own)."""
        chunks: list[list[_Pending]] = []
        size = self.rows_per_part
        for item in rows:
            if not chunks or size + len(item.outs) > self.rows_per_part:
                chunks.append([])
                size = 0
            chunks[-1].append(item)
            size += len(item.outs)
        return chunks

    def _old_message(self, part_name: str, row_id: Any) -> str | None:
        if part_name not in self._old_errors:
            table = self.manifest.store.read_table(part_name, columns=[self.id_name, "error"])
            self._old_errors[part_name] = {
                i: m for i, m in zip(table.column(0).to_pylist(), table.column(1).to_pylist(), strict=True)
                if m is not None}
        return self._old_errors[part_name].get(row_id)

    def _rewrite_without(self, name: str, ids: set[Any], seq_tag: str):
        """Stage part `name` minus `ids` under its own name (a new one in an object store); None when
        nothing would be left."""
        record = self.manifest.state.parts[name]
        if len(ids) == record.num_rows:
            return None
        table = self.manifest.store.read_table(name)
        id_type = table.schema.field(self.id_name).type
        kept = table.filter(pc.invert(pc.is_in(table.column(self.id_name), value_set=pa.array(list(ids), id_type))))
        kept_ids = list(dict.fromkeys(kept.column(self.id_name).to_pylist()))  # a row's samples: its id once
        paths, rows, hashes = part_row_lists(self.manifest.store, record)
        position = {row_id: i for i, row_id in enumerate(record.ids)}
        part = self.writer.stage_part(kept, name=name, tag=seq_tag)
        errors = set(record.error_ids)
        return part, PartRecord.staged(part, kept_ids, [i in errors for i in kept_ids],
                                       [paths[position[i]] for i in kept_ids],
                                       [rows[position[i]] for i in kept_ids],
                                       None if hashes is None else [hashes[position[i]] for i in kept_ids],
                                       with_samples=SAMPLE_INDEX in table.schema.names)
