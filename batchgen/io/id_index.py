"""The committed ok row ids of a manifest state: an exact set that holds no Python object per id.

A Python set of a million id strings costs ~150 MiB (the strings and the table). Here the ids
live once, compactly, in their parts (batchgen.io.compact_lists); the index is an open-addressing
hash table of two int64 arrays: each slot holds an id's hash() and its location (the part's
handle and the row's position in it). A lookup confirms every hash match against the real id in
its part, so membership is exact: a hash collision costs a comparison, never a wrong answer.
Python's hash() is per process; the table is never written anywhere.

At most 2/3 of the slots are used (live or deleted): 16 bytes a slot, ~24-48 bytes an id.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence, Set
from typing import Any, Protocol

import numpy as np

from batchgen.io.compact_lists import RowList

_EMPTY, _DELETED = 0, -1  # a location is stored plus one: 0 is a never-used slot
_POSITION_BITS = 32
_POSITION_MASK = (1 << _POSITION_BITS) - 1
_MIN_SLOTS = 8
_UNSIGNED = (1 << 64) - 1


class Part(Protocol):
    name: str
    ids: RowList


class IdIndex(Set):
    """The set of committed ok ids, each with the part that holds it."""

    def __init__(self) -> None:
        self._parts: dict[int, Part] = {}  # handle -> part
        self._handles: dict[str, int] = {}  # part name -> handle
        self._next_handle = 0
        self._len = 0
        self._used = 0  # slots live or deleted
        self._alloc(_MIN_SLOTS)

    @classmethod
    def _from_iterable(cls, values) -> set[Any]:  # Set operators (a | b, a & b) give a plain set
        return set(values)

    def _alloc(self, num_slots: int) -> None:
        self._mask = num_slots - 1
        self._keys = array("q", [0]) * num_slots
        self._locs = array("q", [_EMPTY]) * num_slots

    def __len__(self) -> int:
        return self._len

    def __contains__(self, row_id: object) -> bool:
        return self._find(row_id) >= 0

    def __iter__(self) -> Iterator[Any]:
        for loc in self._locs:
            if loc > 0:
                yield self._id_at(loc - 1)

    def part_of(self, row_id: Any) -> str | None:
        """The name of the part that holds committed ok id `row_id`; None when it is not one."""
        slot = self._find(row_id)
        return None if slot < 0 else self._parts[(self._locs[slot] - 1) >> _POSITION_BITS].name

    def position(self, row_id: Any) -> tuple[Part, int] | None:
        """(part, row position in it) of committed ok id `row_id`; None when it is not one."""
        slot = self._find(row_id)
        if slot < 0:
            return None
        loc = self._locs[slot] - 1
        return self._parts[loc >> _POSITION_BITS], loc & (_POSITION_MASK)

    def locate(self, ids: Sequence[Any]) -> np.ndarray:
        """Where each of `ids` is indexed (handle << 32 | row position; -1: not a committed ok id),
        exactly `[x in self for x in ids]`'s answer, all at once: the ids hashed in one pass, the
        probe sequence of `_find` run for the whole batch in numpy, each id's first slot with its
        hash taken as its place, then every such match compared with the real id in bulk (a part
        at a time, RowList.matches). A match that is another id (equal hashes: rare, -1 and -2
        say) is looked up again one at a time, past that slot."""
        n = len(ids)
        found = np.full(n, -1, np.int64)
        hashes, hashable = _batch_hashes(ids)
        if not self._len or not n:
            return found
        keys, slots = np.frombuffer(self._keys, np.int64), np.frombuffer(self._locs, np.int64)
        mask = np.uint64(self._mask)
        pending = np.flatnonzero(hashable)
        hashes = hashes[pending]
        i = hashes.view(np.uint64) & mask
        perturb = hashes.view(np.uint64).copy()
        while pending.size:
            current = slots[i]
            same = (current > 0) & (keys[i] == hashes)
            found[pending[same]] = current[same] - 1
            left = ~same & (current != _EMPTY)  # a deleted slot or another hash's: on along the sequence
            pending, hashes, i, perturb = pending[left], hashes[left], i[left], perturb[left] >> np.uint64(5)
            i = (i * np.uint64(5) + perturb + np.uint64(1)) & mask
        hit = np.flatnonzero(found >= 0)
        for k in hit[~self._confirm(ids, hit, found[hit])].tolist():
            slot = self._find(ids[k])  # the slow, exact path: compares every equal hash on the way
            found[k] = -1 if slot < 0 else self._locs[slot] - 1
        return found

    def gather(self, locs: np.ndarray, column: Callable[[Part], RowList | None]) -> list[Any]:
        """`column(part)[position]` for each location from `locate`, a part at a time; None for
        -1 and for a part whose `column` is None (a prompt hash column an old part lacks)."""
        out: list[Any] = [None] * len(locs)
        hit = np.flatnonzero(locs >= 0)
        for handle, at in _by_part(locs[hit]):
            values = column(self._parts[handle])
            if values is not None:
                for k, value in zip(hit[at].tolist(), values.take(locs[hit[at]] & _POSITION_MASK), strict=True):
                    out[k] = value
        return out

    def _confirm(self, ids: Sequence[Any], where: np.ndarray, locs: np.ndarray) -> np.ndarray:
        """Which of the hash matches (`ids[where[k]]` against the id at `locs[k]`) are the same id."""
        same = np.zeros(len(where), bool)
        for handle, at in _by_part(locs):
            same[at] = self._parts[handle].ids.matches(locs[at] & _POSITION_MASK, [ids[k] for k in where[at].tolist()])
        return same

    def reserve(self, num_ids: int) -> None:
        """Size the table for `num_ids` more ids at once (one rehash instead of many while loading)."""
        self._grow_for(self._used + num_ids)

    def add_part(self, part: Part, ok_positions: list[int], ids: Sequence[Any] | None = None) -> Any:
        """Index the ids at `ok_positions` of `part` (its ok rows); `ids`: the same as `part.ids`, as
        Python objects where the caller has them (spares decoding them again). Returns an id that
        is indexed already (a duplicate), or None; the caller treats a duplicate as damage."""
        assert part.name not in self._handles, f"part {part.name} is indexed twice"
        assert len(part.ids) < 1 << _POSITION_BITS
        handle = self._next_handle
        self._next_handle += 1
        self._parts[handle] = part
        self._handles[part.name] = handle
        if not ok_positions:
            return None
        self._grow_for(self._used + len(ok_positions))
        hashes = _hashes(part.ids if ids is None else ids, ok_positions)
        locs = np.asarray(ok_positions, np.int64) | (handle << _POSITION_BITS)
        return self._place(hashes, locs)

    def drop_part(self, name: str, ok_positions: list[int]) -> None:
        """Remove part `name`'s ids at `ok_positions` (as given to add_part) from the index."""
        handle = self._handles[name]
        if ok_positions:
            hashes = _hashes(self._parts[handle].ids, ok_positions)
            slots = self._slots_of(hashes, np.asarray(ok_positions, np.int64) | (handle << _POSITION_BITS))
            np.frombuffer(self._locs, np.int64)[slots] = _DELETED
            self._len -= len(slots)
        del self._handles[name], self._parts[handle]

    def _place(self, hashes: np.ndarray, locs: np.ndarray) -> Any:
        """Insert (hash, loc) pairs, all at once: the probe sequence of `_find`, one step a round for
        every pair not yet placed. Returns the first new id found indexed already, or None."""
        keys, slots = np.frombuffer(self._keys, np.int64), np.frombuffer(self._locs, np.int64)
        mask = np.uint64(self._mask)
        pending = np.arange(len(hashes))
        i = hashes.view(np.uint64) & mask
        perturb = hashes.view(np.uint64).copy()
        while pending.size:
            current = slots[i]
            same = np.flatnonzero((current > 0) & (keys[i] == hashes[pending]))
            for k in same:  # an equal hash (a duplicate, or a collision): compare the real ids
                row_id = self._id_at(int(locs[pending[k]]))
                if self._id_at(int(current[k]) - 1) == row_id:
                    return row_id
            free = np.flatnonzero(current == _EMPTY)
            # the first pair per free slot takes it; the others stay, to compare with it next round
            _, first = np.unique(i[free], return_index=True)
            won = free[first]
            keys[i[won]], slots[i[won]] = hashes[pending[won]], locs[pending[won]] + 1
            self._used += len(won)
            self._len += len(won)
            step = current != _EMPTY  # an occupied slot (live or deleted): on to the next in the sequence
            perturb[step] >>= np.uint64(5)
            i[step] = (i[step] * np.uint64(5) + perturb[step] + np.uint64(1)) & mask
            left = np.ones(len(pending), bool)
            left[won] = False
            pending, i, perturb = pending[left], i[left], perturb[left]
        return None

    def _slots_of(self, hashes: np.ndarray, locs: np.ndarray) -> np.ndarray:
        """The slots holding exactly these (hash, loc) pairs (each is there: it was placed)."""
        slots = np.frombuffer(self._locs, np.int64)
        mask = np.uint64(self._mask)
        found = np.empty(len(hashes), np.int64)
        pending = np.arange(len(hashes))
        i = hashes.view(np.uint64) & mask
        perturb = hashes.view(np.uint64).copy()
        while pending.size:
            current = slots[i]
            assert not (current == _EMPTY).any(), "an indexed id is missing from the table"
            hit = current == locs[pending] + 1
            found[pending[hit]] = i[hit]
            miss = ~hit
            pending, i, perturb = pending[miss], i[miss], perturb[miss] >> np.uint64(5)
            i = (i * np.uint64(5) + perturb + np.uint64(1)) & mask
        return found

    def _id_at(self, loc: int) -> Any:
        return self._parts[loc >> _POSITION_BITS].ids[loc & (_POSITION_MASK)]

    def _find(self, row_id: Any) -> int:
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
                if parts[loc >> _POSITION_BITS].ids.at(loc & _POSITION_MASK) == row_id:
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


def _hashes(ids: Sequence[Any], positions: list[int]) -> np.ndarray:
    at = ids.at if isinstance(ids, RowList) else ids.__getitem__
    if len(positions) == len(ids):
        return np.fromiter(map(hash, ids), np.int64, len(ids))
    return np.fromiter((hash(at(p)) for p in positions), np.int64, len(positions))


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


def _by_part(locs: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """(part handle, the indices into `locs` of its rows) for the parts these locations are in."""
    handles = locs >> _POSITION_BITS
    if handles.size and (handles == handles[0]).all():  # the usual case: a batch within one part
        yield int(handles[0]), np.arange(len(locs))
        return
    order = np.argsort(handles, kind="stable")
    bounds = np.flatnonzero(np.diff(handles[order])) + 1
    for at in np.split(order, bounds):
        if at.size:
            yield int(handles[at[0]]), at
