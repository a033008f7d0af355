"""Per-row lists of a committed part (its row ids, its prompt hashes) held without a Python object per row.

A manifest state holds every committed row's id for the whole job (batchgen.io.manifest.state):
at a million rows a list of str objects costs ~80 bytes a row, these ~30. Each list gives its
values back exactly (the same type and value as went in): derived ids (`<file>:<row>`) are runs of
row numbers (batchgen.io.ids.numbered), other ids that are all str one UTF-8 blob plus offsets, ids
that are all int (in int64 range) one array; anything else stays a tuple.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

_TEXT = ("utf-8", "surrogatepass")  # any str round-trips, a lone surrogate too
_FEW = 32  # StrList.matches: fewer comparisons than this are made in Python


class RowList(Sequence):
    """A read-only sequence that compares equal to a list or tuple of the same values."""

    __slots__ = ()

    def at(self, i: int) -> Any:
        """Element `i`, 0 <= i < len: the fast path of a lookup."""
        raise NotImplementedError

    def __getitem__(self, i):  # type: ignore[override]  # through at(); IntList/TupleList/HashList index directly
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        return self.at(i)

    def take(self, positions: np.ndarray) -> list[Any]:
        """The elements at `positions` (int64, each in range), as a list."""
        return [self.at(i) for i in positions.tolist()]

    def matches(self, positions: np.ndarray, values: list[Any]) -> np.ndarray:
        """`[self[p] == v for p, v in zip(positions, values)]` as a bool array: how a batch id
        lookup confirms its hash matches (batchgen.io.ids.index)."""
        return np.fromiter(map(operator.eq, self.take(positions), values), bool, len(values))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, tuple, RowList)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # unhashable, as the list it stands for

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


class StrList(RowList):
    __slots__ = ("_blob", "_offsets")

    def __init__(self, values: list[str]):
        encoded = [v.encode(*_TEXT) for v in values]
        self._blob = b"".join(encoded)
        self._offsets = array("q", accumulate(map(len, encoded), initial=0))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def at(self, i: int) -> str:
        """Element `i` (0 <= i): the id index's lookup, without __getitem__'s checks."""
        offsets = self._offsets
        return self._blob[offsets[i]:offsets[i + 1]].decode("utf-8", "surrogatepass")  # IndexError past the end

    def take(self, positions: np.ndarray) -> list[str]:
        offsets, blob = np.frombuffer(self._offsets, np.int64), self._blob
        return [blob[a:b].decode(*_TEXT) for a, b in zip(offsets[positions].tolist(), offsets[positions + 1].tolist(),
                                                         strict=True)]

    def matches(self, positions: np.ndarray, values: list[Any]) -> np.ndarray:
        """Compared as UTF-8 bytes in Arrow, nothing decoded; values Arrow cannot take as text (a
        lone surrogate, a value that is no str) are compared one by one."""
        if len(values) < _FEW:  # Arrow's fixed cost per call outweighs a few comparisons
            return super().matches(positions, values)
        try:
            wanted = pa.array(values, pa.large_string()).cast(pa.large_binary())  # zero-copy cast
        except (pa.ArrowException, UnicodeError):
            return super().matches(positions, values)
        stored = pa.Array.from_buffers(pa.large_binary(), len(self), [None, pa.py_buffer(self._offsets),
                                                                       pa.py_buffer(self._blob)])
        same = pc.equal(stored.take(pa.array(positions)), wanted)  # no nulls: both sides hold values
        return same.to_numpy(zero_copy_only=False)

    def __iter__(self) -> Iterator[str]:
        blob, offsets = self._blob, self._offsets
        for start, end in zip(offsets, offsets[1:]):  # noqa: B905  (offsets[1:] is one shorter by design)
            yield blob[start:end].decode(*_TEXT)


class IntList(RowList):
    __slots__ = ("_values",)

    def __init__(self, values: Iterable[int]):
        self._values = array("q", values)

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, i):  # type: ignore[override]
        return list(self._values[i]) if isinstance(i, slice) else self._values[i]

    def at(self, i: int) -> int:
        return self._values[i]

    def take(self, positions: np.ndarray) -> list[int]:
        return np.frombuffer(self._values, np.int64)[positions].tolist()

    def matches(self, positions: np.ndarray, values: list[Any]) -> np.ndarray:
        """In numpy when the values are ints in int64 range (bools among them compare as Python's
        do: True == 1); anything else (a float, a str, a larger int) one by one."""
        try:
            wanted = np.array(values)
        except (ValueError, TypeError):  # tuples of unequal lengths, and the like
            return super().matches(positions, values)
        if wanted.dtype.kind not in "bi" or wanted.shape != (len(values),):
            return super().matches(positions, values)
        return np.frombuffer(self._values, np.int64)[positions] == wanted

    def __iter__(self) -> Iterator[int]:
        return iter(self._values)


class TupleList(RowList):
    """Values of any other kind (mixed types, floats, None): as they came."""

    __slots__ = ("_values",)

    def __init__(self, values: Iterable[Any]):
        self._values = tuple(values)

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, i):  # type: ignore[override]
        return list(self._values[i]) if isinstance(i, slice) else self._values[i]

    def at(self, i: int) -> Any:
        return self._values[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)


class HashList(RowList):
    """Prompt hashes (16 hex digits, or None for an error row) as one uint64 array plus presence flags."""

    __slots__ = ("_values", "_present")

    def __init__(self, values: list[str | None]):
        self._values = array("Q", (0 if v is None else int(v, 16) for v in values))
        self._present = bytes(v is not None for v in values)

    def __len__(self) -> int:
        return len(self._values)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return f"{self._values[i]:016x}" if self._present[i] else None

    at = __getitem__

    def take(self, positions: np.ndarray) -> list[str | None]:
        values = np.frombuffer(self._values, np.uint64)[positions].tolist()
        present = np.frombuffer(self._present, np.uint8)[positions].tolist()
        return [f"{v:016x}" if p else None for v, p in zip(values, present, strict=True)]

    def __iter__(self) -> Iterator[str | None]:
        for value, present in zip(self._values, self._present, strict=True):
            yield f"{value:016x}" if present else None
