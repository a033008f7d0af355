"""The committed ok row ids of a manifest state: an exact set that holds no Python object per id.

A Python set of a million id strings costs ~150 MiB (the strings and the table). Here the ids
live once, compactly, in their parts (batchgen.io.ids.compact_lists), and the index says where each
is (the part's handle and the row's position in it, `handle << 32 | position`), two ways:

- runs of derived ids (batchgen.io.ids.runs): a part's `<file>:<row>` ids at consecutive positions
  with consecutive row numbers, as a part's are when its rows finished in input order, cost three
  numbers a run;
- other `<head>:<number>` ids (derived ids of rows that finished in predicted-length order: every
  fourth row, say) by number, in pages per head (batchgen.io.ids.by_number): 8 bytes an id once dense;
- every other id (--id-column ids, numbered ids too sparse for pages) is hashed (batchgen.io.ids.table).

An id is held by one of the three only: adding one that any holds already is a duplicate, so a
lookup asks the runs and the pages (for a str shaped `<head>:<number>`) and then the table, and the
answer is exactly a set's. A million derived ids in a thousand parts cost some KiB as runs, ~8 MiB
as pages, not a ~32 MiB table (with a ~100 MiB peak while it grew).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence, Set
from typing import Any

import numpy as np

from batchgen.io.ids.by_number import NumberMap
from batchgen.io.ids.compact_lists import RowList
from batchgen.io.ids.numbered import NumberedStrList, NumberRuns
from batchgen.io.ids.runs import RunIndex, split_numbered, split_numbered_many
from batchgen.io.ids.table import POSITION_BITS, POSITION_MASK, IdTable, Part, by_part, hashes_of

__all__ = ["IdIndex", "Part"]

# shorter runs are hashed: a run costs 24 bytes, a hashed id 24-48, and many tiny runs (a shuffled
# --id-column of `<name>:<n>` strings) would only make the sorted run arrays long
MIN_RUN = 4


class IdIndex(Set):
    """The set of committed ok ids, each with the part that holds it."""

    def __init__(self) -> None:
        self._parts: dict[int, Part] = {}  # handle -> part
        self._handles: dict[str, int] = {}  # part name -> handle
        self._next_handle = 0
        self._table = IdTable(self._parts)
        self._runs = RunIndex()
        self._map = NumberMap()
        self._loose: dict[str, np.ndarray] = {}  # head -> the numbers of `<head>:<number>` ids hashed, sorted
        self._expected = 0  # ids announced by reserve() and not added yet

    @classmethod
    def _from_iterable(cls, values) -> set[Any]:  # Set operators (a | b, a & b) give a plain set
        return set(values)

    def __len__(self) -> int:
        return len(self._table) + len(self._runs) + len(self._map)

    def __contains__(self, row_id: object) -> bool:
        return self._find(row_id) >= 0

    def __iter__(self) -> Iterator[Any]:
        for loc in self._table.locations():
            yield self._parts[loc >> POSITION_BITS].ids[loc & POSITION_MASK]
        for head, first, count, _ in self._runs:
            for number in range(first, first + count):
                yield f"{head}:{number}"
        for head, number, _ in self._map:
            yield f"{head}:{number}"

    def nbytes(self) -> int:
        """Bytes of the index's own arrays (the parts' id lists are not the index's)."""
        return (self._table.nbytes() + self._runs.nbytes() + self._map.nbytes()
                + sum(a.nbytes for a in self._loose.values()))

    def part_of(self, row_id: Any) -> str | None:
        """The name of the part that holds committed ok id `row_id`; None when it is not one."""
        loc = self._find(row_id)
        return None if loc < 0 else self._parts[loc >> POSITION_BITS].name

    def position(self, row_id: Any) -> tuple[Part, int] | None:
        """(part, row position in it) of committed ok id `row_id`; None when it is not one."""
        loc = self._find(row_id)
        return None if loc < 0 else (self._parts[loc >> POSITION_BITS], loc & POSITION_MASK)

    def locate(self, ids: Sequence[Any]) -> np.ndarray:
        """Where each of `ids` is indexed (handle << 32 | row position; -1: not a committed ok id),
        exactly `[x in self for x in ids]`'s answer, all at once: the table's batch lookup, then
        for the ids it lacks that are shaped `<head>:<number>` a binary search of the runs and a
        look into the pages."""
        found = self._table.locate(ids)
        if len(self._runs) or len(self._map):
            lacking = np.flatnonzero(found < 0)
            rest = ids if len(lacking) == len(ids) else [ids[k] for k in lacking.tolist()]
            for head, (at, numbers) in split_numbered_many(rest).items():
                locs = self._runs.locate(head, numbers)
                missing = np.flatnonzero(locs < 0)
                if len(self._map) and missing.size:
                    locs[missing] = self._map.locate(head, numbers[missing])
                found[lacking[at]] = locs
        return found

    def gather(self, locs: np.ndarray, column: Callable[[Part], RowList | None]) -> list[Any]:
        """`column(part)[position]` for each location from `locate`, a part at a time; None for
        -1 and for a part whose `column` is None (a prompt hash column an old part lacks)."""
        out: list[Any] = [None] * len(locs)
        hit = np.flatnonzero(locs >= 0)
        for handle, at in by_part(locs[hit]):
            values = column(self._parts[handle])
            if values is not None:
                for k, value in zip(hit[at].tolist(), values.take(locs[hit[at]] & POSITION_MASK), strict=True):
                    out[k] = value
        return out

    def reserve(self, num_ids: int) -> None:
        """`num_ids` more ids are coming (a snapshot's): the table is sized for the share of them
        the first part added after this hashes (the rest of a derived job's ids are runs)."""
        self._expected += num_ids

    def add_part(self, part: Part, ok_positions: list[int], ids: Sequence[Any] | None = None) -> Any:
        """Index the ids at `ok_positions` of `part` (its ok rows, ascending); `ids`: the same as
        `part.ids`, as Python objects where the caller has them (spares decoding them again).
        Returns an id that is indexed already (a duplicate), or None; the caller treats a duplicate
        as damage."""
        assert part.name not in self._handles, f"part {part.name} is indexed twice"
        assert len(part.ids) < 1 << POSITION_BITS
        handle = self._next_handle
        self._next_handle += 1
        self._parts[handle] = part
        self._handles[part.name] = handle
        if not ok_positions:
            return None
        runs, rest = _split(part.ids, ok_positions)
        expected, self._expected = self._expected, max(0, self._expected - len(ok_positions))
        if runs is not None:
            twice = self._add_runs(handle, runs)
            if twice is not None:
                return twice
        if not rest:
            return None
        ids = part.ids if ids is None else ids
        at = ids.at if isinstance(ids, RowList) else ids.__getitem__
        values = list(ids) if len(rest) == len(ids) else [at(p) for p in rest]
        locs = np.asarray(rest, np.int64) | (handle << POSITION_BITS)
        paged, hashed = self._split_paged(values)
        if hashed.size and expected > len(ok_positions):
            self._table.reserve(hashed.size * expected // len(ok_positions))
        return self._add_unrun(values, locs, paged, hashed)

    def drop_part(self, name: str, ok_positions: list[int]) -> None:
        """Remove part `name`'s ids at `ok_positions` (as given to add_part) from the index."""
        handle = self._handles[name]
        if ok_positions:
            ids = self._parts[handle].ids
            self._runs.drop(handle)
            _, rest = _split(ids, ok_positions)
            if rest:
                values = [ids.at(p) for p in rest]
                locs = np.asarray(rest, np.int64) | (handle << POSITION_BITS)
                hashed = np.ones(len(values), bool)  # where add_part put each: the pages hold it at its loc, or not
                for head, (at, numbers) in split_numbered_many(values).items() if len(self._map) else ():
                    mine = self._map.locate(head, numbers) == locs[at]
                    if mine.any():
                        self._map.remove(head, numbers[mine])
                        hashed[at[mine]] = False
                if not hashed.all():
                    values, locs = [values[k] for k in np.flatnonzero(hashed).tolist()], locs[hashed]
                if not values:
                    del self._handles[name], self._parts[handle]
                    return
                self._table.remove(hashes_of(values), locs)
                for head, numbers in _numbered(values).items():
                    loose = self._loose[head]
                    loose = loose[~np.isin(loose, numbers)]  # a head's numbers in the table are distinct
                    if loose.size:
                        self._loose[head] = loose
                    else:
                        del self._loose[head]
        del self._handles[name], self._parts[handle]

    def _add_runs(self, handle: int, runs: NumberRuns) -> str | None:
        """Hold a part's runs, each head's checked against the runs held and the ids hashed first;
        returns a duplicate id (then nothing is added) or None."""
        checked = []
        for w, head in enumerate(runs.heads):
            mine = np.flatnonzero(runs.which == w)
            if not mine.size:
                continue
            mine = mine[np.argsort(runs.firsts[mine], kind="stable")]
            firsts, counts = runs.firsts[mine], runs.counts[mine]
            twice = self._runs.first_overlap(head, firsts, counts)
            if twice is None:  # a paged `<head>:<number>` inside a new run
                twice = self._map.first_in(head, firsts, counts)
            if twice is None and head in self._loose:  # a hashed `<head>:<number>` inside a new run
                loose = self._loose[head]
                lo, hi = np.searchsorted(loose, firsts), np.searchsorted(loose, firsts + counts)
                clash = np.flatnonzero(lo < hi)
                twice = int(loose[lo[clash[0]]]) if clash.size else None
            if twice is not None:
                return f"{head}:{twice}"
            checked.append((head, firsts, counts, runs.starts[mine]))
        for head, firsts, counts, starts in checked:
            self._runs.add(handle, head, firsts, counts, starts)
        return None

    def _split_paged(self, values: list[Any]) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """The ids the pages take (head -> (indices into `values`, numbers)), and the indices of the
        ids to hash: not numbered, or under a head whose pages would be too sparse for them."""
        paged = {}
        to_hash = np.ones(len(values), bool)
        for head, (at, numbers) in split_numbered_many(values).items():
            if self._map.accepts(head, numbers):
                paged[head] = (at, numbers)
                to_hash[at] = False
        return paged, np.flatnonzero(to_hash)

    def _add_unrun(self, values: list[Any], locs: np.ndarray, paged: dict[str, tuple[np.ndarray, np.ndarray]],
                   hashed: np.ndarray) -> Any:
        """Page or hash the ids not in runs (`values` at `locs`), each checked against the runs and
        the other store first; returns a duplicate id or None."""
        hashed_values = values if hashed.size == len(values) else [values[k] for k in hashed.tolist()]
        numbered = _numbered(hashed_values)
        for head, (_, numbers) in paged.items():  # a `<head>:<number>` id a run holds already
            held = self._runs.locate(head, numbers)
            if (held >= 0).any():
                return f"{head}:{numbers[np.flatnonzero(held >= 0)[0]]}"
        for head, numbers in numbered.items():  # the same, and one the pages hold
            held = np.flatnonzero((self._runs.locate(head, numbers) >= 0) | (self._map.locate(head, numbers) >= 0))
            if held.size:
                return f"{head}:{numbers[held[0]]}"
        if len(self._table):  # a paged id that was hashed before (its head's pages were too sparse then)
            for head, (at, numbers) in paged.items():
                held = np.flatnonzero(self._table.locate([values[k] for k in at.tolist()]) >= 0)
                if held.size:
                    return f"{head}:{numbers[held[0]]}"
        for head, (at, numbers) in paged.items():
            twice = self._map.add(head, numbers, locs[at])
            if twice is not None:
                return f"{head}:{twice}"
        if not hashed.size:
            return None
        for head, numbers in numbered.items():
            self._loose[head] = np.sort(np.concatenate((self._loose.get(head, numbers[:0]), numbers)))
        return self._table.add(hashes_of(hashed_values), locs[hashed])

    def _find(self, row_id: Any) -> int:
        if len(self._runs) or len(self._map):
            numbered = split_numbered(row_id)
            if numbered is not None:
                loc = self._runs.find(*numbered)
                if loc < 0:
                    loc = self._map.find(*numbered)
                if loc >= 0:
                    return loc
        return self._table.find(row_id)


def _split(ids: RowList, ok_positions: list[int]) -> tuple[NumberRuns | None, list[int]]:
    """A part's ok positions as runs (MIN_RUN or longer) and the positions to hash; a pure function
    of the part, so drop_part finds again what add_part put where."""
    if not isinstance(ids, NumberedStrList):
        return None, ok_positions
    runs, rest = ids.runs(np.asarray(ok_positions, np.int64), MIN_RUN)
    return (runs if runs.counts.size else None), rest.tolist()


def _numbered(values: list[Any]) -> dict[str, np.ndarray]:
    """head -> the numbers of the values shaped `<head>:<number>`."""
    out: dict[str, list[int]] = {}
    for value in values:
        numbered = split_numbered(value)
        if numbered is not None:
            out.setdefault(numbered[0], []).append(numbered[1])
    return {head: np.array(numbers, np.int64) for head, numbers in out.items()}
