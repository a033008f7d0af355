"""Derived ids (`<file>:<row>`, batchgen.jobs.sharding.shard_ids) as a compact list: runs of row numbers.

A committed part's derived ids are nearly always one file's consecutive rows, so a part's list is
held as runs (first position, first number, prefix of each; a part of a thousand rows of one file:
one run), not a number per row: a million ids cost some KiB, not 8 MiB. A list whose numbers do
not run (an --id-column of `<name>:<n>` strings in any order) keeps one number per row, which is
then cheaper than a run per row. Only canonical numbers qualify (ASCII digits, no leading zero, at
most 18 digits), so every value comes back exactly as it went in.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from batchgen.io.ids.compact_lists import RowList

MAX_DIGITS = 18  # every number fits an int64, with room to add a count


@dataclass(frozen=True, slots=True)
class NumberRuns:
    """Runs of a NumberedStrList: run k is `heads[which[k]]:<firsts[k] + j>` for j < counts[k], at
    positions `starts[k] + j`."""

    heads: tuple[str, ...]
    which: np.ndarray
    firsts: np.ndarray
    counts: np.ndarray
    starts: np.ndarray


class NumberedStrList(RowList):
    """Strs that are a few shared prefixes each followed by a row number, as derived ids are."""

    __slots__ = ("_prefixes", "_len", "_starts", "_firsts", "_which")

    @classmethod
    def build(cls, values: list[str]) -> NumberedStrList | None:
        """The list, or None when a value is no prefix + canonical number, or prefixes are many."""
        if not values:
            return None
        index: dict[str, int] = {}
        which, numbers = array("H"), array("q")
        for v in values:
            head, sep, digits = v.rpartition(":")
            if not sep or not digits.isascii() or not digits.isdigit() or (digits[0] == "0" and len(digits) > 1) \
                    or len(digits) > MAX_DIGITS:
                return None
            k = index.setdefault(head, len(index))
            if k > 0xFFFF:
                return None
            which.append(k)
            numbers.append(int(digits))
        out = cls.__new__(cls)
        out._prefixes = tuple(f"{head}:" for head in index)
        out._len = len(values)
        n, w = np.frombuffer(numbers, np.int64), np.frombuffer(which, np.uint16)
        starts = np.concatenate(([0], np.flatnonzero((np.diff(n) != 1) | (np.diff(w) != 0)) + 1))
        if 2 * len(starts) <= len(values):  # runs: three numbers a run instead of one a row
            out._starts, out._firsts = _int64s(starts), _int64s(n[starts])
            which = array("H", w[starts].tobytes())
        else:  # every row its own "run" (starts[k] == k): a number a row
            out._starts, out._firsts = None, numbers
        out._which = which if len(index) > 1 else None  # one prefix: no index per run
        return out

    def __len__(self) -> int:
        return self._len

    def _run_of(self, i: int) -> int:
        return i if self._starts is None else bisect_right(self._starts, i) - 1

    def at(self, i: int) -> str:
        if not 0 <= i < self._len:
            raise IndexError("list index out of range")
        k = self._run_of(i)
        number = self._firsts[k] + (0 if self._starts is None else i - self._starts[k])
        return f"{self._prefixes[0 if self._which is None else self._which[k]]}{number}"

    def _numbers_at(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(number, prefix index) of the values at `positions`."""
        firsts = np.frombuffer(self._firsts, np.int64)
        if self._starts is None:
            k, numbers = positions, firsts[positions]
        else:
            starts = np.frombuffer(self._starts, np.int64)
            k = np.searchsorted(starts, positions, "right") - 1
            numbers = firsts[k] + (positions - starts[k])
        which = np.zeros(len(positions), np.int64) if self._which is None else \
            np.frombuffer(self._which, np.uint16)[k].astype(np.int64)
        return numbers, which

    def take(self, positions: np.ndarray) -> list[str]:
        numbers, which = self._numbers_at(positions)
        if self._which is None:
            prefix = self._prefixes[0]
            return [f"{prefix}{n}" for n in numbers.tolist()]
        return [f"{self._prefixes[k]}{n}" for k, n in zip(which.tolist(), numbers.tolist(), strict=True)]

    def __iter__(self) -> Iterator[str]:
        if self._starts is None:
            for i in range(self._len):
                yield self.at(i)
            return
        bounds = [*self._starts, self._len]
        for k, first in enumerate(self._firsts):
            prefix = self._prefixes[0 if self._which is None else self._which[k]]
            for number in range(first, first + bounds[k + 1] - bounds[k]):
                yield f"{prefix}{number}"

    def runs(self, positions: np.ndarray, min_count: int) -> tuple[NumberRuns, np.ndarray]:
        """The runs among the values at `positions` (ascending): stretches of consecutive positions
        holding one prefix and consecutive numbers, at least `min_count` long; and the positions in
        no such run (batchgen.io.ids.index holds the two apart)."""
        numbers, which = self._numbers_at(positions)
        breaks = (np.diff(positions) != 1) | (np.diff(numbers) != 1) | (np.diff(which) != 0)
        starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
        counts = np.diff(np.append(starts, len(positions)))
        long = counts >= min_count
        in_run = np.repeat(long, counts)
        starts = starts[long]
        heads = tuple(prefix[:-1] for prefix in self._prefixes)  # "<head>:" -> "<head>"
        return NumberRuns(heads, which[starts], numbers[starts], counts[long], positions[starts]), positions[~in_run]


def _int64s(values: np.ndarray) -> array:
    out = array("q")
    out.frombytes(np.ascontiguousarray(values, np.int64).tobytes())
    return out
