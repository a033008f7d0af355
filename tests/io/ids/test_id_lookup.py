"""The batch id lookup (IdIndex.locate, gather): exactly the answers of one lookup at a time.

Collisions are forced by replacing the index's hash() with one that maps many ids to one value,
so every hash match has to be confirmed against the real id (and the wrong ones looked up again)."""

from __future__ import annotations

import builtins
import random
from dataclasses import dataclass

import numpy as np
import pytest

from batchgen.io.ids import runs as id_runs
from batchgen.io.ids import table as id_table
from batchgen.io.ids.index import IdIndex
from batchgen.io.ids.lists import hash_list, id_list
from batchgen.io.ids.runs import split_numbered, split_numbered_many


@dataclass
class Part:
    name: str
    ids: object
    hashes: object = None


def lookups_agree(index: IdIndex, probes: list) -> None:
    locs = index.locate(probes)
    assert locs.dtype == np.int64 and locs.shape == (len(probes),)
    assert (locs >= 0).tolist() == [p in index for p in probes]
    for probe, loc in zip(probes, locs.tolist(), strict=True):
        if loc >= 0:
            part, position = index.position(probe)
            assert loc == ((loc >> 32) << 32 | position) and part.ids[position] == probe


@pytest.fixture(params=["python", "mod 7", "constant"])
def colliding(request, monkeypatch):
    """The index's hash(): Python's, or one under which most ids (or all) share their hash."""
    if request.param == "mod 7":
        monkeypatch.setattr(id_table, "hash", lambda x: builtins.hash(x) % 7, raising=False)
    elif request.param == "constant":
        monkeypatch.setattr(id_table, "hash", lambda x: (builtins.hash(x), 3)[1], raising=False)
    return request.param


@pytest.mark.parametrize("kind", ["str", "int"])
def test_a_batch_lookup_answers_as_one_at_a_time_through_adds_and_drops(colliding, kind):
    rng = random.Random(1)
    make = (lambda n: f"in.parquet:{n}") if kind == "str" else (lambda n: n * 3 - 500)
    index, model, parts = IdIndex(), set(), {}
    universe = [make(n) for n in range(400)]
    for step in range(60):
        if parts and rng.random() < 0.3:  # dropped parts leave deleted slots along probe sequences
            name = rng.choice(sorted(parts))
            ids = parts.pop(name)
            index.drop_part(name, list(range(len(ids))))
            model.difference_update(ids)
        else:
            ids = [i for i in dict.fromkeys(rng.sample(universe, rng.randrange(1, 60))) if i not in model]
            parts[f"p{step}"] = ids
            assert index.add_part(Part(f"p{step}", id_list(ids)), list(range(len(ids)))) is None
            model.update(ids)
        probes = [type(p)(p) if kind == "int" else "".join(p) for p in rng.sample(universe, 100)]  # fresh objects
        assert (index.locate(probes) >= 0).tolist() == [p in model for p in probes]
    lookups_agree(index, universe)
    assert (index.locate(universe) >= 0).sum() == len(model)


def test_equal_hashes_of_different_ids_are_told_apart():
    # CPython's own collisions: hash(-1) == hash(-2), hash(0) == hash(2**61 - 1)
    index = IdIndex()
    index.add_part(Part("a", id_list([-1, 0])), [0, 1])
    assert index.locate([-2, 2**61 - 1, -1, 0]).tolist()[:2] == [-1, -1]
    index.add_part(Part("b", id_list([-2])), [0])  # behind -1 in the same probe sequence
    lookups_agree(index, [-2, -1, 0, 2**61 - 1])
    assert index.locate([-2]).tolist() == [1 << 32]


def test_empty_batches_and_empty_indexes():
    assert IdIndex().locate([]).shape == (0,) and IdIndex().locate(["a", 1]).tolist() == [-1, -1]
    index = IdIndex()
    index.add_part(Part("a", id_list(["x"])), [0])
    assert index.locate([]).shape == (0,)
    index.drop_part("a", [0])
    assert index.locate(["x"]).tolist() == [-1]


def test_values_of_other_types_match_as_in_a_set_and_unhashable_ones_never():
    ints = IdIndex()
    ints.add_part(Part("a", id_list([1, 2, 2**62])), [0, 1, 2])
    probes = [1.0, True, "1", 2, 2.5, 2**62, 2**62 + 0.0, 2**64, [1], None, (1, 2), (1,)]
    lookups_agree(ints, probes)
    assert (ints.locate(probes) >= 0).tolist() == [p in {1, 2, 2**62} if p != [1] else False for p in probes]
    strs = IdIndex()
    values = [f"r{n}" for n in range(100)] + ["\ud800", "é", ""]  # a lone surrogate: no Arrow string
    strs.add_part(Part("s", id_list(values)), list(range(len(values))))
    many = [*values, "r100", b"r1", 1, "\udc00"]  # more than StrList compares in Python: the Arrow path
    lookups_agree(strs, many)
    lookups_agree(strs, ["r5", "\ud800"])
    lookups_agree(strs, [v for v in values if v != "\ud800"])


def test_gather_gives_each_found_row_its_value_and_none_elsewhere():
    index = IdIndex()
    index.add_part(Part("a", id_list(["x", "y"]), hash_list(["00000000000000aa", None])), [0, 1])
    index.add_part(Part("b", id_list(["z"]), None), [0])  # a part written before prompt hashes
    index.add_part(Part("c", id_list(["w"]), hash_list(["00000000000000ff"])), [0])
    locs = index.locate(["w", "x", "y", "z", "v"])
    assert index.gather(locs, lambda p: p.hashes) == ["00000000000000ff", "00000000000000aa", None, None, None]
    assert index.gather(locs, lambda p: p.ids) == ["w", "x", "y", "z", None]
    assert index.gather(index.locate([]), lambda p: p.ids) == []


def test_a_batch_lookup_over_runs_and_hashed_ids_answers_as_one_at_a_time(colliding):
    rng = random.Random(3)
    index, model, parts = IdIndex(), set(), {}
    universe = [*(f"a.parquet:{n}" for n in range(660)), *(f"b/x.parquet:{n}" for n in range(100)), *range(100),
                "a.parquet:05", "doc-7"]
    for step in range(60):
        if parts and rng.random() < 0.25:
            name = rng.choice(sorted(parts))
            ids, ok = parts.pop(name)
            index.drop_part(name, ok)
            model.difference_update(ids[i] for i in ok)
        else:
            start = rng.randrange(600)
            ids = [f"a.parquet:{n}" for n in range(start, start + rng.randrange(1, 60))]
            ids += rng.sample(universe, rng.choice([0, 0, 2, 6]))  # rows of another file, user ids, stray rows
            ids = [i for i in dict.fromkeys(ids) if i not in model]
            ok = [i for i in range(len(ids)) if rng.random() < 0.97]
            parts[f"p{step}"] = (ids, ok)
            assert index.add_part(Part(f"p{step}", id_list(ids)), ok) is None
            model.update(ids[i] for i in ok)
        probes = [p if isinstance(p, int) else "".join(p) for p in rng.sample(universe, 150)]  # fresh objects
        assert (index.locate(probes) >= 0).tolist() == [p in model for p in probes]
    lookups_agree(index, universe + [[1], None, "a.parquet:", ":3"])
    assert (index.locate(universe) >= 0).sum() == len(model)


def test_gather_reads_rows_found_in_runs():
    index = IdIndex()
    ids = [f"in.parquet:{n}" for n in range(10)]
    index.add_part(Part("a", id_list(ids), hash_list([f"{n:016x}" for n in range(10)])), list(range(10)))
    index.add_part(Part("b", id_list(["in.parquet:10", "k"]), hash_list(["00000000000000aa", None])), [0, 1])
    locs = index.locate(["in.parquet:3", "in.parquet:10", "k", "in.parquet:11", "in.parquet:9"])
    assert index.gather(locs, lambda p: p.hashes) == [f"{3:016x}", "00000000000000aa", None, None, f"{9:016x}"]
    assert index.gather(locs, lambda p: p.ids) == ["in.parquet:3", "in.parquet:10", "k", None, "in.parquet:9"]


@pytest.mark.parametrize("values", [
    [f"in.parquet:{n}" for n in range(100, 140)],  # the usual batch: checked in bulk
    [f"{h}:{n}" for n in range(20) for h in ("a.parquet", "b/a.parquet", "c:d", "")],  # several heads
    ["a:1", "a:05", "a:0", "a:", ":", "a", "a:-1", "a:+1", "a: 1", "a:1 ", "a:\u0661", "a:1:2", "a:" + "9" * 18,
     "a:" + "9" * 19, "a:" + "1" * 30, "\ud800:3", "a\n:4"],  # edge cases, each one as split_numbered says
    ["a:1", "a:2", 3, None, b"a:4", ("a", 5), "a:6"],  # other types: never numbered
    ["a:1", "a:2", "a:" + "9" * 19],  # a number past int64: the careful path
    ["a:1", "a:2", "a:1" + "0" * 18],  # 19 digits within int64: no canonical number either
])
def test_a_batch_is_split_as_each_value_alone(values):
    split = split_numbered_many(values)
    alone: dict = {}
    for k, value in enumerate(values):
        numbered = split_numbered(value)
        if numbered is not None:
            alone.setdefault(numbered[0], []).append((k, numbered[1]))
    assert {head: list(zip(at.tolist(), numbers.tolist(), strict=True)) for head, (at, numbers) in split.items()} \
        == alone
    assert split_numbered("a:7") == ("a", 7) and split_numbered("a:07") is None and split_numbered(7) is None


def test_the_usual_batch_is_split_in_bulk(monkeypatch):
    values = [f"in.parquet:{n}" for n in range(95, 1005)]  # numbers of 2, 3 and 4 digits
    monkeypatch.setattr(id_runs, "split_numbered", None)  # the value-by-value path would fail
    assert {h: (at.tolist(), n.tolist()) for h, (at, n) in id_runs.split_numbered_many(values).items()} == {
        "in.parquet": (list(range(910)), list(range(95, 1005)))}
