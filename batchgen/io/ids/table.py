"""The hashed part of the committed-id index (batchgen.io.ids.index): ids that no row-number run holds.

An open-addressing hash table of two int64 arrays: each slot holds an id's hash() and its location
(the part's handle and the row's position in it, `handle << 32 | position`). A lookup confirms
every hash match against the real id in its part, so membership is exact: a hash collision costs a
comparison, never a wrong answer. Python's hash() is per process; the table is never written anywhere.

At most 2/3 of the slots are used (live or deleted): 16 bytes a slot, ~24-48 bytes an id.
"""

from __future__ import annotations

from array import array
from collections.abc import Generator, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from batchgen.io.ids.compact_lists import RowList

_EMPTY, _DELETED = 0, -1  # a location is stored plus one: 0 is a never-used slot
POSITION_BITS = 32
POSITION_MASK = (1 << POSITION_BITS) - 1
_MIN_SLOTS = 8
_UNSIGNED = (1 << 64) - 1


class Part(Protocol):
    name: str
    ids: RowList


class IdTable:
    """ids by hash, each with its location; `parts` (handle -> part, shared with the index) holds the ids."""

    def __init__(self, parts: dict[int, Part]) -> None:
        self._parts = parts
        self._len = 0
        self._used = 0  # slots live or deleted
        self._alloc(_MIN_SLOTS)

    def _alloc(self, num_slots: int) -> None:
        self._mask = num_slots - 1
        self._keys = array("q", [0]) * num_slots
        self._locs = array("q", [_EMPTY]) * num_slots

    def __len__(self) -> int:
        return self._len

    def nbytes(self) -> int:
        return self._keys.itemsize * (len(self._keys) + len(self._locs))

    def locations(self) -> Iterator[int]:
        """The location of every id held (in table order)."""
        for loc in self._locs:
            if loc > 0:
                yield loc - 1

    def find(self, row_id: Any) -> int:
        """The location of `row_id`, or -1."""
        if not self._len:
            return -1
        slot = self._find_slot(row_id)
        return -1 if slot < 0 else self._locs[slot] - 1

    def locate(self, ids: Sequence[Any]) -> np.ndarray:
        """The location of each of `ids` (-1: not held), all at once: the ids hashed in one pass, the
        probe sequence run for the whole batch in numpy, each id's first slot with its hash taken as
        its place, then every such match compared with the real id in bulk (a part at a time,
        RowList.matches). A match that is another id (equal hashes: rare, -1 and -2 say) is looked
        up again one at a time, past that slot."""
        n = len(ids)
        found = np.full(n, -1, np.int64)
        if not self._len or not n:
            return found
        hashes, hashable = _batch_hashes(ids)
        keys, slots = np.frombuffer(self._keys, np.int64), np.frombuffer(self._locs, np.int64)
        where = np.flatnonzero(hashable)
        hashes = hashes[where]
        probe = self._probe(hashes)
        for pending, i in probe:
            current = slots[i]
            same = (current > 0) & (keys[i] == hashes[pending])
            found[where[pending[same]]] = current[same] - 1
            left = ~same & (current != _EMPTY)  # a deleted slot or another hash's: on along the sequence
            probe.send((left, None))
        hit = np.flatnonzero(found >= 0)
        for k in hit[~self._confirm(ids, hit, found[hit])].tolist():
            found[k] = self.find(ids[k])  # the slow, exact path: compares every equal hash on the way
        return found

    def _confirm(self, ids: Sequence[Any], where: np.ndarray, locs: np.ndarray) -> np.ndarray:
        """Which of the hash matches (`ids[where[k]]` against the id at `locs[k]`) are the same id."""
        same = np.zeros(len(where), bool)
        for handle, at in by_part(locs):
            same[at] = self._parts[handle].ids.matches(locs[at] & POSITION_MASK, [ids[k] for k in where[at].tolist()])
        return same

    def reserve(self, num_ids: int) -> None:
        """Size the table for `num_ids` more ids at once (one rehash instead of many while loading)."""
        self._grow_for(self._used + num_ids)

    def add(self, hashes: np.ndarray, locs: np.ndarray) -> Any:
        """Insert the ids at `locs` (their hashes: `hashes`). Returns the first new id found held
        already (a duplicate), or None."""
        self._grow_for(self._used + len(locs))
        return self._place(hashes, locs)

    def remove(self, hashes: np.ndarray, locs: np.ndarray) -> None:
        """Remove the ids at `locs` (as given to add)."""
        slots = np.frombuffer(self._locs, np.int64)
        found = np.empty(len(hashes), np.int64)
        probe = self._probe(hashes)
        for pending, i in probe:
            current = slots[i]
            assert not (current == _EMPTY).any(), "an indexed id is missing from the table"
            hit = current == locs[pending] + 1
            found[pending[hit]] = i[hit]
            probe.send((~hit, None))
        slots[found] = _DELETED
        self._len -= len(found)

    def _probe(self, hashes: np.ndarray) -> Generator[tuple[np.ndarray, np.ndarray], Any, None]:
        """The probe sequence of `_find_slot`, one step a round for many hashes at once: yields
        (pending, slots), the indices into `hashes` still probing and the slot each is at; the
        caller sends back (keep, step): which of them go on probing, and which of those move to
        their next slot (None: all) rather than look at the same slot again."""
        mask = np.uint64(self._mask)
        pending = np.arange(len(hashes))
        perturb = hashes.view(np.uint64).copy()
        i = perturb & mask
        while pending.size:
            keep, step = yield pending, i
            yield  # the value of send(): the caller's loop goes on to the next round
            if step is None:
                perturb >>= np.uint64(5)
                i = (i * np.uint64(5) + perturb + np.uint64(1)) & mask
            else:
                perturb[step] >>= np.uint64(5)
                i[step] = (i[step] * np.uint64(5) + perturb[step] + np.uint64(1)) & mask
            pending, i, perturb = pending[keep], i[keep], perturb[keep]

    def _place(self, hashes: np.ndarray, locs: np.ndarray) -> Any:
        """Insert (hash, loc) pairs, all at once along `_probe`. Returns the first new id found
        held already, or None."""
        keys, slots = np.frombuffer(self._keys, np.int64), np.frombuffer(self._locs, np.int64)
        probe = self._probe(hashes)
        for pending, i in probe:
            current = slots[i]
            same = np.flatnonzero((current > 0) & (keys[i] == hashes[pending]))
            for k in same:  # an equal hash (a duplicate, or a collision): compare the real ids
                row_id = self._id_at(int(locs[pending[k]]))
                if self._id_at(int(current[k]) - 1) == row_id:
                    probe.close()
                    return row_id
            free = np.flatnonzero(current == _EMPTY)
            # the first pair per free slot takes it; the others stay, to compare with it next round
            _, first = np.unique(i[free], return_index=True)
            won = free[first]
            keys[i[won]], slots[i[won]] = hashes[pending[won]], locs[pending[won]] + 1
            self._used += len(won)
            self._len += len(won)
            left = np.ones(len(pending), bool)
            left[won] = False
            probe.send((left, current != _EMPTY))  # an occupied slot (live or deleted): on to the next
        return None

    def _id_at(self, loc: int) -> Any:
        return self._parts[loc >> POSITION_BITS].ids[loc & POSITION_MASK]

    def _find_slot(self, row_id: Any) -> int:
        """The slot holding `row_id`, or -1. Probes as CPython's dict does (perturbed by the
        hash's high bits), so ids whose hashes share their low bits do not pile up."""
        try:
            h = hash(row_id)
        except TypeError:  # an unhashable value is no committed id (as `x in set()` would raise: no)
            return -1
        keys, locs, mask, parts = self._keys, self._locs, self._mask, self._parts
        i = h & mask
        perturb = h & _UNSIGNED
        while True:
            loc = locs[i]
            if loc == _EMPTY:
                return -1
            if loc > 0 and keys[i] == h:
                loc -= 1
                if parts[loc >> POSITION_BITS].ids.at(loc & POSITION_MASK) == row_id:
                    return i
            perturb >>= 5
            i = (i * 5 + perturb + 1) & mask

    def _grow_for(self, num_used: int) -> None:
        if 3 * num_used < 2 * len(self._locs):
            return
        num_slots = _MIN_SLOTS
        while 2 * (self._len + num_used - self._used) >= num_slots:  # live ids after: at most half full
            num_slots *= 2
        keys, locs = np.frombuffer(self._keys, np.int64), np.frombuffer(self._locs, np.int64)
        live = locs > 0
        keys, locs = keys[live], locs[live] - 1  # copies: the old arrays go
        self._alloc(num_slots)
        self._used = self._len = 0
        self._place(keys, locs)  # from the stored hashes: no id is hashed again


def hashes_of(values: Sequence[Any]) -> np.ndarray:
    """hash() of each of `values` (every id the table holds is hashed here or in IdTable: the
    tests replace this module's hash() to force collisions)."""
    return np.fromiter(map(hash, values), np.int64, len(values))


def _batch_hashes(ids: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """hash() of each id, and which are hashable (an unhashable value is no committed id)."""
    try:
        return np.fromiter(map(hash, ids), np.int64, len(ids)), np.ones(len(ids), bool)
    except TypeError:
        pass
    hashes, hashable = np.zeros(len(ids), np.int64), np.ones(len(ids), bool)
    for k, row_id in enumerate(ids):
        try:
            hashes[k] = hash(row_id)
        except TypeError:
            hashable[k] = False
    return hashes, hashable


def by_part(locs: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(part handle, the indices into `locs` of its rows) for the parts these locations are in."""
    handles = locs >> POSITION_BITS
    if handles.size and (handles == handles[0]).all():  # the usual case: a batch within one part
        yield int(handles[0]), np.arange(len(locs))
        return
    order = np.argsort(handles, kind="stable")
    bounds = np.flatnonzero(np.diff(handles[order])) + 1
    for at in np.split(order, bounds):
        if at.size:
            yield int(handles[at[0]]), at
