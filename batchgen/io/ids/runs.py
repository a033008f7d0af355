"""The ranged part of the committed-id index (batchgen.io.ids.index): runs of derived ids.

A committed part's derived ids (`<file key>:<row index>`, batchgen.jobs.sharding.shard_ids) are almost
always one run of consecutive row numbers of one input file, at consecutive positions in the part.
Such a run is held as three numbers (first row number, count, location of its first row) in
sorted arrays per file key, so a million committed rows in a thousand parts cost a few KiB here,
not the ~32 MiB of a hash table slot pair per id; a lookup is a binary search (numpy
searchsorted for a batch). Runs never overlap: the index refuses a duplicate before it adds one.

An id is in a run only as the exact string `<head>:<number>` with a canonical number (ASCII
digits, no leading zero, at most 18 digits), as batchgen.io.ids.numbered.NumberedStrList holds
them; `split_numbered` tells whether a value is one, so any str looks itself up here exactly.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterator, Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any

import numpy as np

from batchgen.io.ids.numbered import MAX_DIGITS
from batchgen.io.ids.table import POSITION_BITS

_POWERS_OF_10 = np.array([10 ** k for k in range(1, MAX_DIGITS + 1)], np.int64)  # n has 1 + (those <= n) digits


def split_numbered(value: Any) -> tuple[str, int] | None:
    """(head, number) of a str `<head>:<canonical number>`; None for any other value."""
    if not isinstance(value, str):
        return None
    head, sep, digits = value.rpartition(":")
    if not sep or not digits.isdigit() or not digits.isascii() or len(digits) > MAX_DIGITS \
            or (digits[0] == "0" and len(digits) > 1):
        return None
    return head, int(digits)


def split_numbered_many(values: Sequence[Any]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """head -> (the indices into `values` of those shaped `<head>:<number>`, their numbers): what
    split_numbered says of each, with the usual batch (strs of one input file's rows, all numbered)
    checked in bulk: a few C-level passes instead of a Python call per value."""
    try:
        parts = list(map(str.rpartition, values, repeat(":")))  # TypeError: a value that is no str
        digits = list(map(itemgetter(2), parts))
        joined = "".join(digits)
        if joined.isdigit() and joined.isascii() and list(map(itemgetter(1), parts)).count(":") == len(parts):
            numbers = np.fromiter(map(int, digits), np.int64, len(digits))  # ValueError: "", OverflowError
            lengths = np.fromiter(map(len, digits), np.int64, len(digits))
            # canonical: as many digits as the number has (no leading zero), at most MAX_DIGITS
            num_digits = np.searchsorted(_POWERS_OF_10, numbers, "right") + 1
            if (lengths <= MAX_DIGITS).all() and (num_digits == lengths).all():
                return _by_head(list(map(itemgetter(0), parts)), numbers)
    except (TypeError, ValueError, OverflowError):
        pass
    found = [(k, numbered) for k, numbered in enumerate(map(split_numbered, values)) if numbered is not None]
    return _by_head([n[0] for _, n in found], np.array([n[1] for _, n in found], np.int64),
                    np.array([k for k, _ in found], np.int64))


def _by_head(heads: list[str], numbers: np.ndarray, where: np.ndarray | None = None
             ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    where = np.arange(len(heads)) if where is None else where
    if not heads:
        return {}
    if heads.count(heads[0]) == len(heads):  # one input file's rows: the usual batch
        return {heads[0]: (where, numbers)}
    groups: dict[str, list[int]] = {}
    for k, head in enumerate(heads):
        groups.setdefault(head, []).append(k)
    return {head: (where[at], numbers[at]) for head, at in groups.items()}


class _Runs:
    """One head's runs, sorted by first number, never overlapping."""

    __slots__ = ("firsts", "counts", "locs")

    def __init__(self, firsts: np.ndarray, counts: np.ndarray, locs: np.ndarray) -> None:
        # array('q'): a scalar lookup bisects it without numpy's per-call cost
        self.firsts, self.counts, self.locs = _array(firsts), _array(counts), _array(locs)

    def views(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.frombuffer(self.firsts, np.int64), np.frombuffer(self.counts, np.int64),
                np.frombuffer(self.locs, np.int64))


class RunIndex:
    """Runs of numbered ids per head: (first number, count, location of the first)."""

    def __init__(self) -> None:
        self._runs: dict[str, _Runs] = {}
        self._heads_of: dict[int, set[str]] = {}  # part handle -> the heads it has runs under
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def nbytes(self) -> int:
        return sum(3 * 8 * len(r.firsts) for r in self._runs.values())

    def __iter__(self) -> Iterator[tuple[str, int, int, int]]:
        """(head, first number, count, location of the first) of every run."""
        for head, runs in self._runs.items():
            yield from ((head, *run) for run in zip(runs.firsts, runs.counts, runs.locs, strict=True))

    def find(self, head: str, number: int) -> int:
        """The location of `<head>:<number>`, or -1."""
        runs = self._runs.get(head)
        if runs is None:
            return -1
        k = bisect_right(runs.firsts, number) - 1
        if k < 0 or number - runs.firsts[k] >= runs.counts[k]:
            return -1
        return runs.locs[k] + number - runs.firsts[k]

    def locate(self, head: str, numbers: np.ndarray) -> np.ndarray:
        """The location of `<head>:<n>` for each of `numbers` (-1: not held)."""
        found = np.full(len(numbers), -1, np.int64)
        runs = self._runs.get(head)
        if runs is None:
            return found
        firsts, counts, locs = runs.views()
        k = np.searchsorted(firsts, numbers, "right") - 1
        inside = k >= 0
        k = np.maximum(k, 0)
        offset = numbers - firsts[k]
        inside &= offset < counts[k]
        found[inside] = locs[k[inside]] + offset[inside]
        return found

    def first_overlap(self, head: str, firsts: np.ndarray, counts: np.ndarray) -> int | None:
        """A number that is both in one of the given runs (sorted by first) and in another of them
        or one held already; None when there is none."""
        ends = firsts + counts
        clash = np.flatnonzero(firsts[1:] < ends[:-1])  # the given runs among themselves
        if clash.size:
            return int(firsts[clash[0] + 1])
        runs = self._runs.get(head)
        if runs is None:
            return None
        held_firsts, held_counts, _ = runs.views()
        k = np.searchsorted(held_firsts, ends, "left") - 1  # the last held run starting before each end
        k_safe = np.maximum(k, 0)
        clash = np.flatnonzero((k >= 0) & (held_firsts[k_safe] + held_counts[k_safe] > firsts))
        if not clash.size:
            return None
        return int(max(firsts[clash[0]], held_firsts[k_safe[clash[0]]]))

    def add(self, handle: int, head: str, firsts: np.ndarray, counts: np.ndarray, positions: np.ndarray) -> None:
        """Hold runs of part `handle` under `head` (sorted by first, checked by first_overlap)."""
        locs = positions | (handle << POSITION_BITS)
        runs = self._runs.get(head)
        if runs is None:
            self._runs[head] = _Runs(firsts, counts, locs)
        else:
            held = runs.views()
            at = np.searchsorted(held[0], firsts)
            self._runs[head] = _Runs(*(np.insert(old, at, new) for old, new in zip(held, (firsts, counts, locs),
                                                                                   strict=True)))
        self._heads_of.setdefault(handle, set()).add(head)
        self._len += int(counts.sum())

    def drop(self, handle: int) -> None:
        """Forget every run of part `handle`."""
        for head in self._heads_of.pop(handle, ()):
            firsts, counts, locs = self._runs[head].views()
            keep = (locs >> POSITION_BITS) != handle
            self._len -= int(counts[~keep].sum())
            if keep.any():
                self._runs[head] = _Runs(firsts[keep], counts[keep], locs[keep])
            else:
                del self._runs[head]


def _array(values: np.ndarray) -> array:
    out = array("q")
    out.frombytes(np.ascontiguousarray(values, np.int64).tobytes())
    return out
