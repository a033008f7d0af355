"""The compact id index and per-row lists: exact answers, whatever the hashes do."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from batchgen.io.compact_lists import HashList, IntList, NumberedStrList, StrList, TupleList, hash_list, id_list
from batchgen.io.id_index import IdIndex


@dataclass
class Part:
    name: str
    ids: object


def index_of(*parts: list) -> IdIndex:
    index = IdIndex()
    for n, ids in enumerate(parts):
        assert index.add_part(Part(f"p{n}", id_list(ids)), list(range(len(ids)))) is None
    return index


@pytest.mark.parametrize("values, kind", [
    (["a", "", "é", "in.parquet:7", "\ud800"], StrList),  # a lone surrogate round-trips too
    (["in.parquet:0", "in.parquet:7", "in.parquet:12345678901"], NumberedStrList),  # derived ids
    (["a/x.parquet:3", "b/x.parquet:0", "a/x.parquet:4", "c:d:9", ":5"], NumberedStrList),  # a part spanning files
    (["in.parquet:07"], StrList), (["in.parquet:"], StrList), (["in.parquet:\u0663"], StrList),  # not canonical
    (["in.parquet:1", "doc-2"], StrList), (["p:" + "9" * 19], StrList),
    ([0, -1, 2**63 - 1, -(2**63)], IntList),
    ([2**63, 1], TupleList),  # beyond int64
    ([True, 1], TupleList),  # bool stays bool
    ([1.5, "a", None], TupleList),
    ([], StrList),
])
def test_id_lists_give_back_exactly_what_went_in(values, kind):
    ids = id_list(values)
    assert type(ids) is kind and ids == values and values == ids and list(ids) == values
    assert [type(v) for v in ids] == [type(v) for v in values]
    assert [ids[i] for i in range(len(values))] == values and ids[-1:] == values[-1:]
    if values:
        assert ids[-1] == values[-1]
        with pytest.raises(IndexError):
            ids[len(values)]


def test_hash_lists_hold_hex_digests_compactly_and_anything_else_as_is():
    digests = ["00000000000000ff", None, "ffffffffffffffff"]
    assert type(hash_list(digests)) is HashList and hash_list(digests) == digests
    odd = ["ABC", None]  # not what prompt_hash writes: kept exactly
    assert type(hash_list(odd)) is TupleList and hash_list(odd) == odd


def test_membership_is_exact_when_hashes_collide():
    # CPython: hash(-1) == hash(-2) and hash(0) == hash(2**61 - 1): same hash, different ids
    assert hash(-1) == hash(-2) and hash(0) == hash(2**61 - 1)
    index = index_of([-1, 0])
    assert -1 in index and 0 in index and -2 not in index and 2**61 - 1 not in index
    assert index.add_part(Part("p9", id_list([-2, 2**61 - 1])), [0, 1]) is None
    assert {-1, -2, 0, 2**61 - 1} == index and len(index) == 4
    index.drop_part("p0", [0, 1])
    assert -1 not in index and 0 not in index and -2 in index and 2**61 - 1 in index
    assert index.part_of(-2) == "p9" and index.part_of(-1) is None


def test_duplicates_are_reported_within_a_part_and_across_parts():
    index = IdIndex()
    assert index.add_part(Part("a", id_list(["x", "y", "x"])), [0, 1, 2]) == "x"
    index = index_of(["x", "y"])
    assert index.add_part(Part("b", id_list(["z", "y"])), [0, 1]) == "y"


def test_equal_values_of_other_types_match_as_in_a_set():
    index = index_of([1, 2])
    assert (1.0 in index, True in index, "1" in index, [1] in index) == (1.0 in {1, 2}, True in {1, 2}, False, False)


def test_the_index_agrees_with_a_set_through_adds_drops_and_growth():
    rng = random.Random(0)
    index, model, parts = IdIndex(), set(), {}
    for step in range(300):
        if parts and rng.random() < 0.3:  # drop a part (a rewrite or a compaction)
            name = rng.choice(sorted(parts))
            ids = parts.pop(name)
            index.drop_part(name, list(range(len(ids))))
            model.difference_update(ids)
        else:
            ids = [rng.choice([f"f:{rng.randrange(5000)}", rng.randrange(-5000, 5000)])
                   for _ in range(rng.randrange(1, 40))]
            ids = [i for i in dict.fromkeys(ids) if i not in model]
            parts[f"p{step}"] = ids
            assert index.add_part(Part(f"p{step}", id_list(ids)), list(range(len(ids)))) is None
            model.update(ids)
        assert len(index) == len(model)
    assert index == model and set(index) == model
    probes = [f"f:{i}" for i in range(5000)] + list(range(-5000, 5000))
    assert [p in index for p in probes] == [p in model for p in probes]
    assert all(index.part_of(i) in parts and i in parts[index.part_of(i)] for i in model)


def test_set_operators_give_plain_sets():
    index = index_of(["a", "b"])
    assert index | {"c"} == {"a", "b", "c"} and {"b", "z"} & index == {"b"} and type({"b"} & index) is set
