"""Input rows by reference: the kept-warm engines fetch the blocks Ray Data read, the driver never holds them.

With `--ray-keep-warm` the engines are plain Ray actors outside the dataset (batchgen.jobs.executors.ray.engines),
so the driver takes the read's output and hands it to them (batchgen.jobs.executors.ray.dispatch). It takes it as
Ray Data's RefBundles (`Dataset.iter_internal_ref_bundles`): object references to the blocks the read
tasks put in the object store, each with its row count. An engine call gets those references (and
the rows of each block that the bundle covers: Ray Data's repartition may cut one block into
several bundles) and resolves them on the engine's node, so on a multi-node cluster the input
goes from the reading worker's object store to the engine's, as in the Ray Data actor pool, and
the driver carries only the outputs back. The driver's memory holds references, not rows.

`iter_internal_ref_bundles` is a Ray Data developer API whose bundle shape has changed across
releases (BlockEntry objects with block slices in 2.5x-2.6x; (ref, metadata) pairs before):
`iter_block_slices` reads both, and `references_available` says whether the API is there at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa


@dataclass(slots=True)
class BlockSlices:
    """One engine call's input rows: blocks in the object store, and which of each block's rows."""

    refs: list[Any]  # ObjectRefs of Arrow blocks
    ranges: list[tuple[int, int] | None]  # per block: rows [start, stop) of it, None = all of it
    num_rows: int | None  # None when Ray Data did not count a block's rows (never for batchgen's reads)


def references_available(dataset: Any) -> bool:
    return callable(getattr(dataset, "iter_internal_ref_bundles", None))


def iter_block_slices(dataset: Any) -> Iterator[BlockSlices]:
    """The dataset's output, a bundle at a time, as references (empty blocks left out)."""
    for bundle in dataset.iter_internal_ref_bundles():
        pieces = getattr(bundle, "slices", None) or [None] * len(bundle.blocks)
        refs, ranges, num_rows = [], [], 0
        for entry, piece in zip(bundle.blocks, pieces, strict=True):
            ref, metadata = (entry.ref, entry.metadata) if hasattr(entry, "ref") else entry
            if piece is not None:
                span, rows = (piece.start_offset, piece.end_offset), piece.end_offset - piece.start_offset
            else:
                span, rows = None, metadata.num_rows
            if rows == 0:
                continue
            refs.append(ref)
            ranges.append(span)
            num_rows = None if num_rows is None or rows is None else num_rows + rows
        if refs:
            yield BlockSlices(refs, ranges, num_rows)


def fetch(rows: BlockSlices | pa.Table) -> pa.Table:
    """On the engine: the rows themselves (a table passes through: the fallback, and tests' batches)."""
    if isinstance(rows, pa.Table):
        return rows
    import ray  # inside a Ray worker: installed and connected

    tables = []
    for block, span in zip(ray.get(rows.refs), rows.ranges, strict=True):
        if not isinstance(block, pa.Table):  # Ray Data stores batchgen's reads as Arrow; anything else is converted
            from ray.data.block import BlockAccessor

            block = BlockAccessor.for_block(block).to_arrow()
        tables.append(block if span is None else block.slice(span[0], span[1] - span[0]))
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)
