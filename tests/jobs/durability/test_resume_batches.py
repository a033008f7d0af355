"""The resume rule a batch at a time (ResumeRule.settle, unsettled_rows): the same decisions as
one row at a time (skips, needs_prompt, the committed prompt hash), settled rows never built."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.config.job import build_config
from batchgen.io.ids import index as id_index
from batchgen.io.manifest.state import ManifestState, PartRecord
from batchgen.jobs.durability import resume as resume_module
from batchgen.jobs.durability.resume import ResumeRule
from batchgen.jobs.rows import rows as rows_module
from batchgen.jobs.rows.rows import RowSource


def state_with(parts: list[tuple[list, list, list | None]], keep_hashes: bool = True) -> ManifestState:
    """A manifest state of parts given as (ids, error ids, prompt hashes or None)."""
    state = ManifestState(keep_hashes=keep_hashes)
    for n, (ids, errors, hashes) in enumerate(parts):
        counts = {"in": [len(ids) - len(errors), len(errors)]}
        state.add(PartRecord(f"p{n}", "", 1, len(ids), 0, "", ids, errors, counts, hashes=hashes))
    return state


def one_at_a_time(rule: ResumeRule, ids: list) -> tuple[list[bool], list]:
    skip = [rule.skips(i) for i in ids]
    return skip, [rule.state.prompt_hashes[i] if rule.needs_prompt(i) else None for i in ids]


@pytest.mark.parametrize("check_prompts", [False, True])
@pytest.mark.parametrize("retry_errors", [False, True])
@pytest.mark.parametrize("collide", [False, True])
def test_settle_decides_as_skips_and_needs_prompt(check_prompts, retry_errors, collide, monkeypatch):
    if collide:  # every hash match must be confirmed against the real id
        monkeypatch.setattr(id_index, "hash", lambda x: len(str(x)) % 3, raising=False)
    digest = "{:016x}".format
    state = state_with([
        ([1, 2, 3, 4], [3], [digest(1), digest(2), None, digest(4)]),
        ([5, 6], [], None),  # a part written before prompt hashes
        (["a", "b"], ["b"], [digest(7), None]),
    ])
    rule = ResumeRule(state, retry_errors=retry_errors, check_prompts=check_prompts)
    ids = [1, 2, 3, 4, 5, 6, 7, "a", "b", "c", 2.0, True]
    skip, hashes = rule.settle(ids)
    expected_skip, expected_hashes = one_at_a_time(rule, ids)
    assert skip.tolist() == expected_skip
    assert (hashes or [None] * len(ids)) == expected_hashes
    assert any(expected_hashes) == check_prompts
    empty_skip, empty_hashes = rule.settle([])
    assert empty_skip.shape == (0,) and not empty_hashes


def test_without_held_hashes_committed_rows_are_settled_by_id():
    state = state_with([([1, 2], [], ["00000000000000aa", "00000000000000bb"])], keep_hashes=False)
    skip, hashes = ResumeRule(state, retry_errors=True, check_prompts=True).settle([1, 2, 3])
    assert skip.tolist() == [True, True, False] and hashes is None


@pytest.mark.parametrize("id_column", [None, "key"])
def test_unsettled_rows_skip_committed_ones_across_lookup_groups(tmp_path, monkeypatch, id_column):
    monkeypatch.setattr(resume_module, "LOOKUP_ROWS", 5)  # several groups, several read batches in each
    path = tmp_path / "in.parquet"
    keys = [f"k{n}" for n in range(23)]
    pq.write_table(pa.table({"text": [f"t{n}" for n in range(23)], "key": keys}), path)
    config = build_config(None, inputs=[str(path)], output=str(tmp_path / "out"), read_batch_size=3,
                          id_column=id_column, max_rows=21)
    source = RowSource.open(config)
    ids = [r.row_id for r in source]
    assert len(ids) == 21
    committed = ids[0:7] + ids[9:10] + ids[15:]  # ok rows; ids[7] an error row
    hashes = [f"{n:016x}" for n in range(len(committed))]
    state = state_with([(committed[:4], [], hashes[:4]), ([*committed[4:], ids[7]], [ids[7]], [*hashes[4:], None])])
    rule = ResumeRule(state, retry_errors=False, check_prompts=id_column is not None)
    built = []
    real_rows = rows_module.RowChunk.rows

    def counting(self, positions=None):
        built.extend(self.ids[k] for k in (range(len(self.ids)) if positions is None else positions))
        return real_rows(self, positions)

    monkeypatch.setattr(rows_module.RowChunk, "rows", counting)
    settled = []
    got = list(rule.unsettled_rows(RowSource.open(config), settled.append))
    if id_column is None:  # derived ids: a committed row is settled
        expected = [i for i in ids if i not in committed and i != ids[7]]
        assert [(r.row_id, h) for r, h in got] == [(i, None) for i in expected]
    else:  # --id-column: a committed row comes back with its prompt hash, to be compared
        expected = [i for i in ids if i != ids[7]]
        by_id = dict(zip(committed, hashes, strict=True))
        assert [(r.row_id, h) for r, h in got] == [(i, by_id.get(i)) for i in expected]
    assert built == expected  # settled rows were never built
    assert sum(settled) == 21 - len(expected)
    assert [r.row_index for r, _ in got] == [ids.index(r.row_id) for r, _ in got]
    assert [r.values["text"] for r, _ in got] == [f"t{ids.index(r.row_id)}" for r, _ in got]
