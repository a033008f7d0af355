"""The resume rule: which input rows an earlier run already settled, by id and prompt hash.

With derived ids ("<file>:<row>") the inputs are the same files as when the rows were committed
(batchgen.jobs.durability.identity refuses any change), so a committed id is settled. With --id-column rows
and files may change between runs, so a committed id is settled only while its prompt is: the
row's prompt is built again and its hash compared with the committed one; a changed prompt is
generated again and its new row replaces the old one (batchgen.jobs.durability.commit), as a retried error
row does. Error rows are generated again unless --no-retry-errors.

A resume looks committed ids up a batch at a time (`settle`, `unsettled_rows`), which costs a
fraction of looking them up one by one (benchmarks/scale/id_lookup.py), and settled rows are never built
into InputRows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from batchgen.io.manifest.manifest import ManifestState

if TYPE_CHECKING:
    from batchgen.jobs.pipeline.prepare import JobInputs
    from batchgen.jobs.rows.rows import InputRow, RowChunk, RowSource

# ids looked up at once on a resume: numpy's and Arrow's cost per call spread over many rows (a
# read batch is 256 by default), the rows held meanwhile still few
LOOKUP_ROWS = 4096


@dataclass(slots=True)
class ResumeRule:
    """Which rows an earlier run already settled. `state` is the live manifest state."""

    state: ManifestState
    retry_errors: bool
    check_prompts: bool  # --id-column: a committed row counts only while its prompt hash is unchanged

    def skips(self, row_id: Any) -> bool:
        """Settled without looking at the row's prompt."""
        if row_id in self.state.ok_ids:
            return not self.needs_prompt(row_id)
        return not self.retry_errors and row_id in self.state.error_ids

    def needs_prompt(self, row_id: Any) -> bool:
        """A committed ok row whose prompt must be built to tell whether it changed."""
        return self.check_prompts and row_id in self.state.prompt_hashes

    def settle(self, ids: list[Any]) -> tuple[np.ndarray, list[str | None] | None]:
        """`skips` for a batch of ids at once (batchgen.io.ids.index.IdIndex.locate), and under
        --id-column the committed prompt hash of each row whose prompt must be compared (None for
        the others; the list is None when no row needs it)."""
        locs = self.state.ok_ids.locate(ids)
        committed = locs >= 0
        hashes = None
        if self.check_prompts and self.state.num_prompt_hashes and committed.any():
            hashes = self.state.ok_ids.gather(locs, lambda part: part.hashes)
            skip = committed & np.fromiter((h is None for h in hashes), bool, len(hashes))
        else:
            skip = committed
        if not self.retry_errors and self.state.error_ids:
            errors = self.state.error_ids
            skip |= np.fromiter((row_id in errors for row_id in ids), bool, len(ids))
        return skip, hashes

    def unsettled_rows(self, source: RowSource, on_settled: Callable[[int], None] = lambda n: None
                       ) -> Iterator[tuple[InputRow, str | None]]:
        """The rows of `source` not settled, in order, each with the committed prompt hash its new
        prompt must be compared with (None: no comparison); `on_settled(n)` counts the rows skipped.
        Ids are looked up LOOKUP_ROWS at a time and settled rows are never built."""
        pending: list[RowChunk] = []
        num_pending = 0
        for chunk in source.chunks():
            pending.append(chunk)
            num_pending += len(chunk.ids)
            if num_pending >= LOOKUP_ROWS:
                yield from self._unsettled(pending, on_settled)
                pending, num_pending = [], 0
        yield from self._unsettled(pending, on_settled)

    def _unsettled(self, chunks: list[RowChunk], on_settled: Callable[[int], None]
                   ) -> Iterator[tuple[InputRow, str | None]]:
        if not chunks:
            return
        skip, hashes = self.settle([row_id for chunk in chunks for row_id in chunk.ids])
        on_settled(int(skip.sum()))
        start = 0
        for chunk in chunks:
            n = len(chunk.ids)
            keep = np.flatnonzero(~skip[start:start + n]).tolist()
            if keep:
                for k, row in zip(keep, chunk.rows(None if len(keep) == n else keep), strict=True):
                    yield row, None if hashes is None else hashes[start + k]
            start += n

    @property
    def num_rows_done(self) -> int:
        return len(self.state.ok_ids) + (0 if self.retry_errors else len(self.state.error_ids))

    def nothing_to_do(self, inputs: JobInputs) -> bool:
        """Every input row is settled, so a run would generate nothing (and need no model).

        Ids are unique, so fewer settled rows than input rows means work without reading a row;
        otherwise one pass over the ids (the id column alone, or none for derived ids) decides. Under
        --id-column a committed row is settled only once its prompt hash is compared, which needs the
        tokenizer, so such a rerun is never "nothing to do" here."""
        if not self.state.num_committed_rows or self.num_rows_done < inputs.scan.num_rows:
            return False
        batches = _in_groups(inputs.source.iter_id_batches(inputs.scan.file_rows), LOOKUP_ROWS)
        return all(self.settle(ids)[0].all() for ids in batches)


def _in_groups(batches: Iterator[list[Any]], num_rows: int) -> Iterator[list[Any]]:
    """The lists of `batches` joined into lists of at least `num_rows` (the last one: what is left)."""
    group: list[Any] = []
    for batch in batches:
        group.extend(batch)
        if len(group) >= num_rows:
            yield group
            group = []
    if group:
        yield group
