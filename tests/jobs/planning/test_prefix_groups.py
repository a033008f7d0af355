"""Prefix groups in the planner (no model): rows that share a document are brought together across
planning windows within a bounded look-ahead, each group led by its first row to run, groups ordered
longest first; rows that share nothing keep their order; the shareable tokens are counted with or
without the reordering."""

from __future__ import annotations

import random

from batchgen.config.job import build_config
from batchgen.io.inputs.discovery import InputFile
from batchgen.jobs.planning.length import LengthPredictor
from batchgen.jobs.planning.planner import Planner
from batchgen.jobs.planning.prefix_groups import PrefixGrouper
from batchgen.jobs.rows.planned_row import PlannedRow
from batchgen.jobs.rows.rows import InputRow

FILE = InputFile("/data/a.parquet", "parquet", None)
BS = 16


def doc(d: int, num_tokens: int = 40) -> list[int]:
    return [1000 + d] + [(d * 31 + i * 7) % 900 for i in range(num_tokens - 1)]


def make_rows(prompts: list[list[int]], known: list[int] | None = None) -> list[PlannedRow]:
    known = known or [None] * len(prompts)
    return [PlannedRow(InputRow(i, FILE, i, {}), list(p), 64, 0, k)
            for i, (p, k) in enumerate(zip(prompts, known, strict=True))]


def shuffled_questions(num_docs: int, num_questions: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """Each document with num_questions questions, shuffled; and each row's document."""
    pairs = [(d, q) for d in range(num_docs) for q in range(num_questions)]
    random.Random(seed).shuffle(pairs)
    return [doc(d) + [950 + q, 960 + d] for d, q in pairs], [d for d, _ in pairs]


def planner(**overrides) -> Planner:
    values = dict(inputs=["x"], output="o", batch_size=16, window_rows=4)
    values.update(overrides)
    return Planner(build_config(None, **values), LengthPredictor({}), block_size=BS)


def test_a_documents_rows_run_together_across_windows_and_follow_their_first():
    prompts, docs = shuffled_questions(num_docs=5, num_questions=3)
    p = planner()
    plans = list(p.plans(make_rows(prompts)))
    order = [r.row.row_id for plan in plans for r in plan.rows]
    assert sorted(order) == list(range(15))
    # each window holds whole documents (3 rows each, windows of at most 4 rows: one document each)
    for plan in plans:
        assert len({docs[r.row.row_id] for r in plan.rows}) == 1 and plan.num_rows == 3
        leader, *followers = plan.rows
        assert leader.prefix_leader is None
        assert all(f.prefix_leader is leader for f in followers)
    # documents in the order of their first row in the input
    firsts = [min(i for i in range(15) if docs[i] == d) for d in (docs[plan.rows[0].row.row_id] for plan in plans)]
    assert firsts == sorted(firsts)
    # 40-token documents: 2 full blocks each row shares, beyond each document's first row
    assert p.num_shareable_prefix_tokens == 5 * 2 * 2 * BS
    assert sorted(r.num_shared_prefix_tokens for plan in plans for r in plan.rows) == [0] * 5 + [2 * BS] * 10


def test_without_prefix_order_rows_keep_their_order_and_the_shareable_tokens_are_still_counted():
    prompts, _ = shuffled_questions(num_docs=5, num_questions=3)
    p = planner(prefix_order=False, sort_by_length=False)
    plans = list(p.plans(make_rows(prompts)))
    assert [r.row.row_id for plan in plans for r in plan.rows] == list(range(15))
    assert all(r.prefix_leader is None for plan in plans for r in plan.rows)
    assert p.num_shareable_prefix_tokens == 5 * 2 * 2 * BS


def test_groups_run_longest_first_and_keep_together_inside_a_window():
    # two documents of two rows and two rows of their own, one window; known output lengths
    prompts = [doc(0) + [1], [5] * 20, doc(1) + [2], doc(0) + [3], [6] * 20, doc(1) + [4]]
    known = [10, 50, 30, 90, 20, 5]
    p = planner(window_rows=16, length_column="n")
    [plan] = list(p.plans(make_rows(prompts, known)))
    # document 0 goes by its longest row (90), document 1 by 30; within a group longest first
    assert [r.row.row_id for r in plan.rows] == [3, 0, 1, 2, 5, 4]
    assert plan.rows[1].prefix_leader is plan.rows[0] and plan.rows[4].prefix_leader is plan.rows[3]
    assert plan.rows[2].prefix_leader is None and plan.rows[5].prefix_leader is None


def test_a_prefix_every_row_shares_is_no_group_but_its_first_row_leads_it():
    system = [900 + i for i in range(2 * BS)]  # two blocks ahead of every row
    prompts, docs = shuffled_questions(num_docs=3, num_questions=2, seed=1)
    p = planner(window_rows=2)
    plans = list(p.plans(make_rows([system + q for q in prompts])))
    assert all(len({docs[r.row.row_id] for r in plan.rows}) == 1 for plan in plans)  # grouped by document
    first = plans[0].rows[0]
    assert first.prefix_leader is None
    for plan in plans[1:]:  # a document's first row starts from the very first row's system blocks
        assert plan.rows[0].prefix_leader is first and plan.rows[1].prefix_leader is plan.rows[0]
    # the system's 2 blocks are shareable for 5 rows, each document's 2 blocks more for its second row
    assert p.num_shareable_prefix_tokens == 5 * 2 * BS + 3 * 2 * BS


def test_the_look_ahead_is_bounded():
    rows_ = make_rows([doc(0) + [1]] + [[7 + i] * 5 for i in range(9)] + [doc(0) + [2]])
    grouper = PrefixGrouper(window_rows=2, block_size=BS, reorder=True, lookahead_rows=10)
    windows = list(grouper.windows(rows_))
    # the document's second row is the 11th: past the first look-ahead, so it is not moved up
    assert [r.row.row_id for w in windows for r in w] == list(range(11))
    assert grouper.num_shareable_tokens == 0 and grouper.num_lookaheads == 2
    by_tokens = PrefixGrouper(window_rows=2, block_size=BS, reorder=True, max_lookahead_tokens=60)
    list(by_tokens.windows(make_rows([doc(0) + [1], doc(0) + [2], doc(0) + [3]])))
    assert by_tokens.num_lookaheads == 3  # 42-token prompts: one per look-ahead of 60 tokens


def test_a_groups_followers_reserve_only_their_own_blocks():
    """A follower holds its leader's blocks of the document: the planner's static batches and batch
    size count them once (42-token prompts, 64 new tokens at most: 7 blocks each, a follower's own 5)."""
    prompts, _ = shuffled_questions(num_docs=2, num_questions=4)

    def static_batches(**overrides) -> list[int]:
        p = Planner(build_config(None, inputs=["x"], output="o", window_rows=16, **overrides), LengthPredictor({}),
                    kv_capacity_tokens=25 * BS, block_size=BS)
        [plan] = list(p.plans(make_rows(prompts)))
        return plan.static_batches

    assert static_batches() == [4, 4]  # 7 + 3 x 5 = 22 blocks of 25: a document's rows in one batch
    assert static_batches(prefix_order=False) == [3, 3, 2]  # 3 x 7 = 21 blocks


def test_every_follower_reserves_only_its_own_blocks_whichever_row_holds_the_shareable_count():
    """The shareable tokens sit on each sorted row after the first, and a document's row sorted first
    need not run first (the longest prompt leads): that row, a follower, still starts from the
    leader's blocks. 40-token document, 64 new tokens at most: the short-question row 7 blocks, the
    others 8; the followers hold 2 of them in the leader's, so the four need 8 + 5 + 6 + 6 = 25."""
    document = doc(0)
    prompts = [document + [950]] + [document + [951 + q] * 10 for q in range(3)]
    p = Planner(build_config(None, inputs=["x"], output="o", window_rows=16), LengthPredictor({}),
                kv_capacity_tokens=25 * BS, block_size=BS)
    [plan] = list(p.plans(make_rows(prompts)))
    leader, *followers = plan.rows
    assert leader.row.row_id != 0 and leader.prefix_leader is None
    assert any(f.row.row_id == 0 and f.num_shared_prefix_tokens == 0 for f in followers)  # sorted first
    assert all(f.prefix_leader is leader and f.num_leader_prefix_tokens == 2 * BS for f in followers)
    assert plan.static_batches == [4]
