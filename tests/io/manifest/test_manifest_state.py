"""batchgen.io.manifest.state on its compact id index: duplicates of every kind are caught, and the
views (ok ids, prompt hashes, part of an id) answer as the dicts and sets they replace did."""

from __future__ import annotations

import pytest

from batchgen.errors import OutputError
from batchgen.io.manifest.state import ManifestState, PartRecord

FILE = "/in.parquet"


def record(name, ids, errors=(), hashes=None):
    return PartRecord(name, f".{name}.tmp", 1, len(ids), 0, "", list(ids), [i for i in ids if i in errors],
                      {FILE: [len(ids) - len(errors), len(errors)]}, hashes=hashes)


def entry(name, ids, errors=(), remove=()):
    return {"op": "commit", "seq": 9, "time": 0.0, "shards": [FILE], "remove": list(remove),
            "write": [{"name": name, "temp": "t", "num_rows": len(ids), "num_bytes": 0, "sha256": "", "ids": ids,
                       "errors": [n for n, i in enumerate(ids) if i in errors], "shard": [0] * len(ids),
                       "row": list(range(len(ids)))}]}


@pytest.mark.parametrize("ids", [["a:1", "a:2"], [1, 2]])
def test_every_kind_of_duplicate_is_refused_before_it_is_written_and_damage_on_load(ids):
    state = ManifestState()
    state.add(record("p0", ids, errors={ids[1]}))  # one ok id, one error id
    for bad in (entry("p1", [ids[0]]), entry("p1", [ids[1]]), entry("p1", ["z", "z"]),
                entry("p1", [ids[0]], errors={ids[0]})):
        with pytest.raises(AssertionError, match="committed twice"):
            state.validate(bad)
    state.validate(entry("p0", list(ids)))  # a rewrite of the part that holds them: no duplicate
    state.validate(entry("p1", [ids[0]], remove=["p0"]))
    for twice in (record("p1", [ids[0]]), record("p1", [ids[1]]), record("p1", ["z", "z"]),
                  record("p1", ["z", "z"], errors={"z"}), record("p1", ["y", "y"], errors=set())):
        fresh = ManifestState()
        fresh.add(record("p0", ids, errors={ids[1]}))
        with pytest.raises(OutputError, match="committed twice"):
            fresh.add(twice)
    # as an entry lists it: an error row and an ok row with the same id in one part
    part = entry("p1", ["z", "z"])["write"][0] | {"errors": [1]}
    with pytest.raises(OutputError, match="id 'z' is committed twice"):
        ManifestState().add(PartRecord.from_json(part, 1, [FILE], keep_rows=False))


def test_the_views_follow_adds_and_drops():
    state = ManifestState(keep_hashes=True)
    state.add(record("p0", ["a", "b", "c"], errors={"b"}, hashes=["00000000000000aa", None, None]))
    state.add(record("p1", ["d"], hashes=["00000000000000dd"]))
    assert state.ok_ids == {"a", "c", "d"} and state.error_ids == {"b": "p0"} and state.num_committed_rows == 4
    assert dict(state.prompt_hashes) == {"a": "00000000000000aa", "d": "00000000000000dd"}
    assert "c" not in state.prompt_hashes and state.prompt_hashes.get("b") is None and len(state.prompt_hashes) == 2
    assert state.part_of({"a", "d", "b", "zz"}) == {"a": "p0", "d": "p1"}
    state.check_integrity()
    state.drop("p0")
    state.add(record("p0", ["b", "c"], hashes=["00000000000000bb", None]))  # the error row retried
    assert state.ok_ids == {"b", "c", "d"} and not state.error_ids and "a" not in state.ok_ids
    assert dict(state.prompt_hashes) == {"b": "00000000000000bb", "d": "00000000000000dd"}
    state.check_integrity()


def test_without_keep_hashes_no_hash_is_held():
    state = ManifestState()
    state.add(record("p0", ["a"], hashes=["00000000000000aa"]))
    assert not state.prompt_hashes and state.parts["p0"].hashes is None
