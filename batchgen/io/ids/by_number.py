"""Numbered ids that form no run, by number: a paged array per head (batchgen.io.ids.index).

A committed part's derived ids (`<file key>:<row index>`) run consecutively only when rows finish in
input order. The planner sorts each window's rows by predicted length, so rows finish in length
order and a part holds, say, every fourth row of a few windows: no runs. Hashing those
(batchgen.io.ids.table) cost ~32-48 bytes an id, plus a sorted copy of their numbers rebuilt at every
commit and a table rehash whose peak grows with the ids (benchmarks/scale/id_index_memory.py;
benchmarks/results/2026-12-02-scale-rows.md). But a file's row numbers are dense: once a job has
committed a stretch of rows, it has committed nearly all of them. So here each head keeps pages of
PAGE_NUMBERS locations, indexed by number (a location + 1; 0: absent), allocated as numbers arrive:
8 bytes an id once the pages fill, no rehash, no copy, a lookup by indexing.

Ids that are numbered but sparse (an --id-column of `<name>:<n>` strings with large, scattered
numbers, or a few rows of each of many small files) would make mostly empty pages, so a head
takes new pages only while its pages stay within MAX_BYTES_PER_ID per id it holds; the index
hashes what the pages refuse.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

PAGE_BITS = 8
PAGE_NUMBERS = 1 << PAGE_BITS  # 2 KiB of int64 locations a page: a part of 1000 rows spread over a few windows fits
PAGE_BYTES = PAGE_NUMBERS * 8
# a head's pages may take this much per id it holds (the hash table takes 24-48, and 8 more for
# the sorted copy of hashed numbers that checks new runs): a page needs 32 of its 256 numbers held
MAX_BYTES_PER_ID = 64


class _Head:
    __slots__ = ("pages", "count")

    def __init__(self) -> None:
        self.pages: dict[int, np.ndarray] = {}  # page index -> locations + 1 (0: absent)
        self.count = 0


class NumberMap:
    """head -> number -> location, for numbers accepted by `accepts`."""

    def __init__(self) -> None:
        self._heads: dict[str, _Head] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def nbytes(self) -> int:
        return sum(len(h.pages) for h in self._heads.values()) * PAGE_BYTES

    def __iter__(self) -> Iterator[tuple[str, int, int]]:
        """(head, number, location) of every id held."""
        for name, head in self._heads.items():
            for page, slots in head.pages.items():
                for k in np.flatnonzero(slots).tolist():
                    yield name, (page << PAGE_BITS) + k, int(slots[k]) - 1

    def accepts(self, head: str, numbers: np.ndarray) -> bool:
        """Whether the map may hold `numbers` (distinct, >= 0) under `head`: the pages they need
        keep the head within MAX_BYTES_PER_ID an id (all or none: a part's ids stay together)."""
        h = self._heads.get(head)
        held_pages = h.pages if h is not None else {}
        pages = np.unique(numbers >> PAGE_BITS)
        new = sum(1 for p in pages.tolist() if p not in held_pages)
        if not new:
            return True
        num_ids = (h.count if h is not None else 0) + len(numbers)
        return (len(held_pages) + new) * PAGE_BYTES <= MAX_BYTES_PER_ID * num_ids

    def find(self, head: str, number: int) -> int:
        h = self._heads.get(head)
        if h is None or number < 0:
            return -1
        slots = h.pages.get(number >> PAGE_BITS)
        return -1 if slots is None else int(slots[number & (PAGE_NUMBERS - 1)]) - 1

    def locate(self, head: str, numbers: np.ndarray) -> np.ndarray:
        """The location of `<head>:<n>` for each of `numbers` (-1: not held)."""
        found = np.full(len(numbers), -1, np.int64)
        h = self._heads.get(head)
        if h is None or not len(numbers):
            return found
        pages = numbers >> PAGE_BITS
        for page in np.unique(pages).tolist():
            slots = h.pages.get(page)
            if slots is None:
                continue
            at = np.flatnonzero(pages == page)
            found[at] = slots[numbers[at] & (PAGE_NUMBERS - 1)] - 1
        return found

    def first_in(self, head: str, firsts: np.ndarray, counts: np.ndarray) -> int | None:
        """A number held inside one of the ranges [first, first + count); None when none is."""
        h = self._heads.get(head)
        if h is None:
            return None
        for first, count in zip(firsts.tolist(), counts.tolist(), strict=True):
            for page in range(first >> PAGE_BITS, ((first + count - 1) >> PAGE_BITS) + 1):
                slots = h.pages.get(page)
                if slots is None:
                    continue
                lo = max(first, page << PAGE_BITS) - (page << PAGE_BITS)
                hi = min(first + count, (page + 1) << PAGE_BITS) - (page << PAGE_BITS)
                held = np.flatnonzero(slots[lo:hi])
                if held.size:
                    return (page << PAGE_BITS) + lo + int(held[0])
        return None

    def add(self, head: str, numbers: np.ndarray, locs: np.ndarray) -> int | None:
        """Hold `<head>:<n>` at each loc. Returns a number held already or given twice (then
        nothing is added), or None."""
        order = np.sort(numbers)
        twice = np.flatnonzero(order[1:] == order[:-1])
        if twice.size:
            return int(order[twice[0]])
        held = np.flatnonzero(self.locate(head, numbers) >= 0)
        if held.size:
            return int(numbers[held[0]])
        h = self._heads.get(head)
        if h is None:
            h = self._heads[head] = _Head()
        pages = numbers >> PAGE_BITS
        for page in np.unique(pages).tolist():
            slots = h.pages.get(page)
            if slots is None:
                slots = h.pages[page] = np.zeros(PAGE_NUMBERS, np.int64)
            at = np.flatnonzero(pages == page)
            slots[numbers[at] & (PAGE_NUMBERS - 1)] = locs[at] + 1
        h.count += len(numbers)
        self._len += len(numbers)
        return None

    def remove(self, head: str, numbers: np.ndarray) -> None:
        """Forget `<head>:<n>` for each of `numbers` (all held); a page left empty is freed."""
        h = self._heads[head]
        pages = numbers >> PAGE_BITS
        for page in np.unique(pages).tolist():
            slots = h.pages[page]
            at = np.flatnonzero(pages == page)
            assert (slots[numbers[at] & (PAGE_NUMBERS - 1)] > 0).all(), "an indexed id is missing from the map"
            slots[numbers[at] & (PAGE_NUMBERS - 1)] = 0
            if not slots.any():
                del h.pages[page]
        h.count -= len(numbers)
        self._len -= len(numbers)
        if not h.count:
            del self._heads[head]
