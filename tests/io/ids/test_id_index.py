"""The compact id index and per-row lists: exact answers, whatever the hashes do."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from batchgen.io.ids.compact_lists import HashList, IntList, StrList, TupleList
from batchgen.io.ids.index import IdIndex
from batchgen.io.ids.lists import hash_list, id_list
from batchgen.io.ids.numbered import NumberedStrList


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


def derived(head: str, numbers) -> list[str]:
    return [f"{head}:{n}" for n in numbers]


def test_a_run_of_derived_ids_costs_no_table_slot_per_id():
    index = index_of(derived("in.parquet", range(100_000)), derived("in.parquet", range(100_000, 200_000)))
    assert len(index) == 200_000 and index.nbytes() < 1024
    assert "in.parquet:0" in index and "in.parquet:199999" in index and "in.parquet:200000" not in index
    assert index.part_of("in.parquet:100000") == "p1" and index.position("in.parquet:150001")[1] == 50_001
    assert not any(p in index for p in ["in.parquet:-1", "in.parquet:05", "in.parquet:5 ", " in.parquet:5",
                                        "in.parquet::5", "in.parquet:٥", "in:5", 5, ["in.parquet:5"]])
    assert type("x", (str,), {})("in.parquet:5") in index  # a str subclass equal to a held id, as in a set
    index.drop_part("p0", list(range(100_000)))
    assert len(index) == 100_000 and "in.parquet:5" not in index and "in.parquet:100005" in index


def test_runs_with_gaps_error_rows_and_several_files_answer_as_a_set():
    ids = [*derived("a.parquet", range(10)), *derived("a.parquet", range(20, 30)), *derived("b.parquet", range(10)),
           "a.parquet:30", *derived("a.parquet", range(40, 43))]  # a lone id and a short run: hashed
    errors = {3, 25}  # error rows: not in the index, so they split their runs
    ok = [i for i in range(len(ids)) if i not in errors]
    index = IdIndex()
    assert index.add_part(Part("p", id_list(ids)), ok) is None
    model = {ids[i] for i in ok}
    probes = [*derived("a.parquet", range(-1, 50)), *derived("b.parquet", range(-1, 12)), *derived("c.parquet", [1])]
    assert [p in index for p in probes] == [p in model for p in probes] and index == model
    assert all(index.position(ids[i])[1] == i for i in ok)
    index.drop_part("p", ok)
    assert len(index) == 0 and not any(p in index for p in probes)


@pytest.mark.parametrize("first, second, twice", [
    (derived("f", range(10)), derived("f", range(5, 15)), "f:5"),  # runs overlapping
    (derived("f", range(10, 20)), derived("f", range(0, 11)), "f:10"),
    (derived("f", range(10)), derived("f", range(3, 7)), "f:3"),  # inside another
    (derived("f", range(10)), ["f:7"], "f:7"),  # a lone id inside a run
    (derived("f", range(10)), ["doc-1", "f:9"], "f:9"),  # a mixed part (StrList) inside a run
    (["f:7"], derived("f", range(10)), "f:7"),  # a run over a hashed id
    (["doc-1", "f:7", "f:8"], derived("f", range(5, 12)), "f:7"),
    (derived("f", range(3)), derived("f", range(2, 6)), "f:2"),  # a short (hashed) run under a run
])
def test_an_id_held_already_is_a_duplicate_however_either_is_held(first, second, twice):
    index = index_of(first)
    assert index.add_part(Part("b", id_list(second)), list(range(len(second)))) == twice


def test_a_duplicate_within_a_part_of_runs_is_reported():
    ids = [*derived("f", range(10)), *derived("f", range(8, 20))]
    assert IdIndex().add_part(Part("a", id_list(ids)), list(range(len(ids)))) == "f:8"
    ids = [*derived("f", range(10)), "doc", "f:4"]
    assert IdIndex().add_part(Part("a", id_list(ids)), list(range(len(ids)))) == "f:4"
    ids = [*derived("f", range(10)), *derived("g", range(10)), *derived("f", range(10, 20))]  # two files: no clash
    assert IdIndex().add_part(Part("a", id_list(ids)), list(range(len(ids)))) is None


def test_a_rewritten_part_holds_its_rows_again_under_new_positions():
    # a commit that replaces rows (a changed prompt, a retried error) rewrites their old part without them;
    # the new rows come in their own part
    old = derived("in.parquet", range(100))
    index = index_of(old)
    kept = [i for i in old if i not in {"in.parquet:10", "in.parquet:50", "in.parquet:51"}]
    index.drop_part("p0", list(range(100)))
    assert index.add_part(Part("p0.rewrite", id_list(kept)), list(range(len(kept)))) is None
    assert index.add_part(Part("new", id_list(["in.parquet:51", "in.parquet:10", "in.parquet:50"])), [0, 1, 2]) is None
    assert index == set(old) and index.position("in.parquet:52") == (index.position("in.parquet:0")[0], 49)
    assert index.part_of("in.parquet:10") == "new" and index.position("in.parquet:50")[1] == 2
    assert index.add_part(Part("again", id_list(["in.parquet:50"])), [0]) == "in.parquet:50"


def test_user_ids_shaped_like_derived_ids_are_strings_like_any_other():
    # an --id-column of "a.parquet:<n>" strings: runs where they run, hashed where not, one set either way
    users = ["a.parquet:12", "a.parquet:13", "a.parquet:14", "a.parquet:15", "a.parquet:3"]  # a run and a lone id
    others = ["a.parquet:007", "x:1", "a.parquet:16", "a.parquet:16.0"]  # not all canonical: a StrList, all hashed
    index = index_of(users, others)
    assert index == {*users, *others} and index.nbytes() < 1024
    assert "a.parquet:7" not in index and "a.parquet:007" in index and "a.parquet:17" not in index
    assert index.add_part(Part("c", id_list(derived("a.parquet", range(16, 20)))), [0, 1, 2, 3]) == "a.parquet:16"
    assert index.add_part(Part("d", id_list(derived("a.parquet", range(17, 21)))), [0, 1, 2, 3]) is None
    assert index.add_part(Part("e", id_list(["a.parquet:20", 20])), [0, 1]) == "a.parquet:20"
    assert index.add_part(Part("f", id_list([20, "a.parquet:21"])), [0, 1]) is None  # 20 is no "a.parquet:20"
    assert index.part_of("a.parquet:14") == "p0" and index.part_of("a.parquet:16") == "p1"


def test_the_index_agrees_with_a_set_through_runs_drops_and_rewrites():
    rng = random.Random(2)
    index, model, parts = IdIndex(), set(), {}
    universe = [*derived("a", range(3000)), *derived("b", range(3000)), *derived("c:d", range(100)), *range(500)]
    for step in range(400):
        if parts and rng.random() < 0.3:  # a part dropped (a compaction, or a rewrite without some rows)
            name = rng.choice(sorted(parts))
            ids, ok = parts.pop(name)
            index.drop_part(name, ok)
            model.difference_update(ids[i] for i in ok)
            if rng.random() < 0.5:  # rewritten without some of its rows
                keep = [ids[i] for i in ok if rng.random() < 0.8]
                parts[f"{name}.r"] = (keep, list(range(len(keep))))
                assert index.add_part(Part(f"{name}.r", id_list(keep)), list(range(len(keep)))) is None
                model.update(keep)
        else:
            start, head = rng.randrange(3000), rng.choice(["a", "b", "c:d"])
            ids = derived(head, range(start, start + rng.randrange(1, 80)))  # a run, then odd ids mixed in
            ids += [rng.choice(universe) for _ in range(rng.choice([0, 0, 3]))]
            rng.shuffle(ids) if rng.random() < 0.1 else None
            ids = [i for i in dict.fromkeys(ids) if i not in model]
            ok = [i for i in range(len(ids)) if rng.random() < 0.95]  # the others: error rows
            parts[f"p{step}"] = (ids, ok)
            assert index.add_part(Part(f"p{step}", id_list(ids)), ok) is None
            model.update(ids[i] for i in ok)
        assert len(index) == len(model)
        if step % 50 == 0 or step == 399:
            assert index == model and sorted(map(str, index)) == sorted(map(str, model))
            assert [p in index for p in universe] == [p in model for p in universe]
    for name, (ids, ok) in parts.items():
        assert all(index.position(ids[i])[1] == i and index.part_of(ids[i]) == name for i in ok)


def test_numbered_lists_hold_runs_and_give_every_value_back():
    values = [*derived("a", range(100)), *derived("b/x.parquet", range(50)), *derived("a", range(200, 300)), "a:5",
              *derived("a", range(7, 12))]
    ids = id_list(values)
    assert type(ids) is NumberedStrList and ids == values and list(ids) == values
    assert [ids[i] for i in range(len(values))] == values and ids[-1] == values[-1] and ids[-3:] == values[-3:]
    with pytest.raises(IndexError):
        ids[len(values)]
    positions = np.array(sorted(random.Random(4).sample(range(len(values)), 60)), np.int64)
    assert ids.take(positions) == [values[p] for p in positions.tolist()]
    runs, rest = ids.runs(np.arange(len(values), dtype=np.int64), 4)
    assert rest.tolist() == [250]  # "a:5" alone
    assert [(runs.heads[w], f, c, s) for w, f, c, s in zip(runs.which.tolist(), runs.firsts.tolist(),
                                                        runs.counts.tolist(), runs.starts.tolist(), strict=True)] == [
        ("a", 0, 100, 0), ("b/x.parquet", 0, 50, 100), ("a", 200, 100, 150), ("a", 7, 5, 251)]
    runs, rest = ids.runs(np.array([0, 1, 2, 4, 5, 6, 7, 99, 100], np.int64), 3)  # ok rows with gaps
    assert (runs.firsts.tolist(), runs.counts.tolist(), rest.tolist()) == ([0, 4], [3, 4], [99, 100])
    shuffled = derived("u", random.Random(5).sample(range(1000), 200))  # user ids that do not run
    assert id_list(shuffled) == shuffled and list(id_list(shuffled)) == shuffled


def test_reserve_sizes_the_table_for_the_ids_it_will_hash_only():
    derived_index, ints = IdIndex(), IdIndex()
    derived_index.reserve(10_000)
    ints.reserve(10_000)
    sizes = []
    for k in range(10):
        assert derived_index.add_part(Part(f"d{k}", id_list(derived("in", range(k * 1000, k * 1000 + 1000)))),
                                      list(range(1000))) is None
        assert ints.add_part(Part(f"i{k}", id_list(range(k * 1000, k * 1000 + 1000))), list(range(1000))) is None
        sizes.append(ints.nbytes())
    assert derived_index.nbytes() < 1024 and len(derived_index) == len(ints) == 10_000
    assert sizes == sizes[:1] * 10 and sizes[0] < 16 * 4 * 10_000  # one size from the first part on: no rehash
