"""The compiled grammars kept for reuse stay within their byte budget, least recently used dropped
first, and the estimate of a matcher's size follows what llguidance really holds."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import pytest

from batchgen.config.constraint import Constraint
from batchgen.engine.sampling.grammar import GrammarMasks, estimated_matcher_bytes


def schema(i: int, num_properties: int = 3) -> Constraint:
    names = [f"field_{i}_{k}" for k in range(num_properties)]
    return Constraint.json_schema({"type": "object", "properties": {n: {"type": "string"} for n in names},
                                   "required": names})


def test_least_recently_used_grammars_are_dropped_past_the_budget(tokenizer):
    sizes = {c: estimated_matcher_bytes(c.grammar()) for c in map(Constraint.regex, ["a+", "b+", "c+", "d+"])}
    a, b, c, d = sizes
    budget = sizes[a] + sizes[b] + sizes[c]  # room for three
    masks = GrammarMasks(tokenizer, len(tokenizer), max_compiled_bytes=budget)
    for constraint in (a, b, c, a, d):  # a used again before d comes: b is the least recently used
        masks.compiled(constraint)
    assert masks.num_compiled == 4 and masks.compiled_bytes == sizes[a] + sizes[c] + sizes[d] <= budget
    masks.compiled(a)
    assert masks.num_compiled == 4  # still kept
    masks.compiled(b)
    assert masks.num_compiled == 5  # dropped, so compiled again
    assert masks.compiled_bytes <= budget
    alone = GrammarMasks(tokenizer, len(tokenizer), max_compiled_bytes=1)
    assert alone.compiled(a) is alone.compiled(a) and alone.num_compiled == 1  # the newest one always stays


def _heap_bytes():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc's mallinfo2 measures the heap")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc.mallinfo2.restype = MallInfo2

    def used() -> int:
        gc.collect()
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd
    return used


def test_many_schemas_hold_no_more_than_the_budget(tokenizer):
    heap = _heap_bytes()
    budget = 2 << 20
    masks = GrammarMasks(tokenizer, len(tokenizer), max_compiled_bytes=budget)
    masks.compiled(schema(-1))  # the tokenizer's tables, built once
    before = heap()
    for i in range(120):  # some 16 MiB of matchers if all were kept
        masks.compiled(schema(i))
    assert heap() - before < 2 * budget
    assert masks.compiled_bytes <= budget and masks.num_compiled == 121


@pytest.mark.parametrize("num_properties", [1, 40])
def test_the_estimate_follows_the_measured_size(tokenizer, num_properties):
    heap = _heap_bytes()
    masks = GrammarMasks(tokenizer, len(tokenizer), max_compiled_bytes=1 << 40)
    masks.compiled(schema(-1))
    constraints = [schema(i, num_properties) for i in range(20)]
    estimated = sum(estimated_matcher_bytes(c.grammar()) for c in constraints)
    before = heap()
    for constraint in constraints:
        masks.compiled(constraint)
    assert 0.5 < (heap() - before) / estimated < 2
