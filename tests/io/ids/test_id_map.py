"""Numbered ids that form no run, held by number in pages (batchgen/io/ids/by_number.py), inside the index."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from batchgen.io.ids.by_number import MAX_BYTES_PER_ID, PAGE_BYTES, NumberMap
from batchgen.io.ids.index import IdIndex
from batchgen.io.ids.lists import id_list


@dataclass
class Part:
    name: str
    ids: object


def derived(head: str, numbers) -> list[str]:
    return [f"{head}:{n}" for n in numbers]


def length_sorted_parts(num_rows: int, rows_per_part: int = 1000, window: int = 1024) -> list[list[str]]:
    """Derived ids as a job commits them when rows finish in predicted-length order: each window's
    rows with 4, then 3, 2, 1 new tokens (n = 1 + i % 4, as benchmarks/scale/scale_rows.py's rows)."""
    order = []
    for start in range(0, num_rows, window):
        rows = range(start, min(start + window, num_rows))
        order += sorted(rows, key=lambda i: -(1 + i % 4))
    return [derived("in.parquet", order[k:k + rows_per_part]) for k in range(0, num_rows, rows_per_part)]


def test_length_sorted_derived_ids_cost_about_8_bytes_an_id_and_nothing_is_hashed():
    index, every = IdIndex(), []
    for n, ids in enumerate(length_sorted_parts(100_000)):
        assert index.add_part(Part(f"p{n}", id_list(ids)), list(range(len(ids)))) is None
        every += ids
    assert len(index) == 100_000 and len(index._table) == 0 and not index._loose
    assert index.nbytes() <= 100_000 * 8 * 1.05  # pages full: 8 bytes an id (the table took 32-48)
    assert all(x in index for x in every[::997]) and "in.parquet:100000" not in index
    found = index.locate([*every[:5000], "in.parquet:-1", "in.parquet:100001", "other:3"])
    assert (found[:5000] >= 0).all() and (found[5000:] == -1).all()
    assert index.position(every[1234]) == (index._parts[1], 234)
    assert index.add_part(Part("again", id_list(every[10:12])), [0, 1]) == every[10]


def test_sparse_numbered_ids_are_hashed_not_paged():
    # an --id-column of "doc:<n>" strings with scattered numbers: a page for each would cost ~2 KiB an id
    rng = random.Random(0)
    ids = derived("doc", rng.sample(range(10**12), 3000))
    index = IdIndex()
    for k in range(0, 3000, 1000):
        assert index.add_part(Part(f"p{k}", id_list(ids[k:k + 1000])), list(range(1000))) is None
    assert len(index._map) == 0 and len(index._table) == 3000
    assert index.nbytes() < 3000 * 64 and all(x in index for x in ids)


def test_pages_stay_within_their_bytes_per_id():
    m = NumberMap()
    assert not m.accepts("h", np.array([5]))  # one id: a 2 KiB page would be 2 KiB an id
    numbers = np.arange(0, 4000, 4)  # every fourth row: a quarter of each page held
    assert m.accepts("h", numbers) and m.add("h", numbers, numbers * 10) is None
    assert m.nbytes() <= MAX_BYTES_PER_ID * len(numbers) and m.nbytes() == 16 * PAGE_BYTES
    assert m.add("h", np.array([1, 1]), np.array([0, 0])) == 1  # twice in one batch: nothing added
    assert m.add("h", np.array([3, 8]), np.array([0, 0])) == 8  # held already
    assert len(m) == 1000 and m.find("h", 8) == 80 and m.find("h", 9) == -1 and m.find("x", 8) == -1
    assert m.first_in("h", np.array([1, 9]), np.array([3, 4])) == 12  # [1, 4) holds none, [9, 13) holds 12
    assert m.first_in("h", np.array([1]), np.array([3])) is None
    m.remove("h", numbers[:64])  # the first page's 64 ids: the page is freed
    assert len(m) == 936 and m.nbytes() == 15 * PAGE_BYTES
    assert sorted(n for _, n, _ in m) == numbers[64:].tolist()


def test_dropping_and_rewriting_parts_through_pages_runs_and_the_table():
    # a part rewritten without some rows (a retried row moved): its ids leave the pages, the rest
    # come back under the rewrite, and a run added later is checked against the pages
    parts = length_sorted_parts(8000)
    index = IdIndex()
    for n, ids in enumerate(parts):
        assert index.add_part(Part(f"p{n}", id_list(ids)), list(range(len(ids)))) is None
    moved = parts[3][:10]
    index.drop_part("p3", list(range(len(parts[3]))))
    assert not any(x in index for x in parts[3])
    kept = parts[3][10:]
    assert index.add_part(Part("p3.rewrite", id_list(kept)), list(range(len(kept)))) is None
    assert index.part_of(kept[0]) == "p3.rewrite" and moved[0] not in index
    numbers = sorted(int(x.rsplit(":", 1)[1]) for x in moved)
    clash = derived("in.parquet", range(numbers[0], numbers[0] + 8))  # a run over a moved row and paged ones
    assert index.add_part(Part("run", id_list(clash)), list(range(8))) is not None
    assert index.add_part(Part("moved", id_list(moved)), list(range(10))) is None
    assert index == {x for ids in parts for x in ids}
