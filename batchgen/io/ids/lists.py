"""The compact list for a part's values: the representation that holds them in the least memory.

The list classes live in compact_lists.py and numbered.py; choosing among them needs both, so the
choice sits here, above them (numbered.py's lists are RowLists too).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from batchgen.io.ids.compact_lists import HashList, IntList, RowList, StrList, TupleList
from batchgen.io.ids.numbered import NumberedStrList

_INT64 = (-(1 << 63), (1 << 63) - 1)
_HEX16 = re.compile(r"[0-9a-f]{16}")  # what batchgen.jobs.rows.prompt_hash.prompt_hash writes


def id_list(values: Iterable[Any]) -> RowList:
    """The compact list of `values` (row ids): equal to `list(values)`, element for element."""
    if isinstance(values, RowList):
        return values
    values = list(values)
    if all(type(v) is str for v in values):
        return NumberedStrList.build(values) or StrList(values)
    if all(type(v) is int and _INT64[0] <= v <= _INT64[1] for v in values):  # not bool: True is no 1 here
        return IntList(values)
    return TupleList(values)


def hash_list(values: Iterable[str | None]) -> RowList:
    """The compact list of prompt hashes; any other value kept as it is."""
    if isinstance(values, RowList):
        return values
    values = list(values)
    if all(v is None or (type(v) is str and _HEX16.fullmatch(v)) for v in values):
        return HashList(values)
    return TupleList(values)
