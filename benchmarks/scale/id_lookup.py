"""Committed-id lookup on a resume: one id at a time against a batch at once.

    OMP_NUM_THREADS=1 python -m benchmarks.scale.id_lookup --ids 1000000

A manifest state (batchgen.io.manifest.state) of N committed ok rows in parts of 1000 rows
(`--commit-every 1000`), with derived ids ("<file>:<row>", runs of row numbers) and with integer ids
(IntList parts, as under --id-column, each row with its prompt hash). Then every committed id
(hits: what a resume skips) and as many ids that are not committed (misses: new rows) are looked
up, in input order, three ways:

- `in_index`: `row_id in state.ok_ids`, one id at a time (IdIndex.__contains__);
- `skips`: ResumeRule.skips, one id at a time (what the resume path ran per row before; under
  --id-column it also asks whether the row has a prompt hash: a second lookup);
- `settle_<B>`: ResumeRule.settle on lists of B ids (the batch lookup; a resume uses
  batchgen.jobs.durability.resume.LOOKUP_ROWS), committed prompt hashes fetched under --id-column.

And end to end (`--resume-pass`): a resume's pass over a Parquet input of N rows (a short text
column and an int id column) of which all but the last 1% are committed, as PreparedJob.rows
makes it: before, every row built (RowSource.__iter__) and checked with `skips`; now
`ResumeRule.unsettled_rows` (committed rows never built). Derived ids and --id-column (whose
committed rows are then all yielded, with their hashes, since their prompts must be compared).

Figures: microseconds of process CPU time per looked-up id (CPU, not wall: other load on the
machine inflates it less), best of --repeat; the 1-minute load average before and after. One
JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable

from batchgen.io.manifest.state import ManifestState, PartRecord
from batchgen.jobs.durability.resume import LOOKUP_ROWS, ResumeRule

PART_ROWS = 1000


def state_of(ids: list, with_hashes: bool) -> ManifestState:
    state = ManifestState(keep_hashes=with_hashes)
    state.ok_ids.reserve(len(ids))
    for start in range(0, len(ids), PART_ROWS):
        chunk = ids[start:start + PART_ROWS]
        hashes = [f"{hash(i) & 0xFFFF_FFFF_FFFF_FFFF:016x}" for i in chunk] if with_hashes else None
        record = PartRecord(f"part-{start}", "", 1, len(chunk), 0, "", chunk, [], {"in": [len(chunk), 0]},
                            hashes=hashes)
        state.add(record, chunk)
    return state


def cpu_us_per_id(fn: Callable[[], object], num_ids: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return round(best / num_ids * 1e6, 4)


def in_batches(fn: Callable[[list], object], ids: list, rows: int) -> Callable[[], None]:
    def run() -> None:
        for start in range(0, len(ids), rows):
            fn(ids[start:start + rows])
    return run


def measure(kind: str, num_ids: int, batch_rows: list[int], repeat: int) -> dict:
    if kind == "derived":
        committed = [f"part-{i // 100_000:03d}.parquet:{i % 100_000}" for i in range(num_ids)]
        missing = [f"part-{i // 100_000:03d}.parquet:{i % 100_000}" for i in range(num_ids, 2 * num_ids)]
    else:
        committed = list(range(0, 2 * num_ids, 2))
        missing = list(range(1, 2 * num_ids, 2))
    with_hashes = kind == "id_column"
    state = state_of(committed, with_hashes)
    rule = ResumeRule(state, retry_errors=True, check_prompts=with_hashes)
    out: dict = {"kind": kind, "committed_ids": num_ids}
    # fresh objects, as an input batch's ids are (a str caches its hash)
    hits = [int(str(i)) for i in committed] if kind != "derived" else ["".join(i) for i in committed]
    for name, probes in (("hits", hits), ("misses", missing)):
        skip, hashes = rule.settle(probes[:10_000])
        assert skip.all() == (name == "hits" and not with_hashes) and skip.any() == skip.all()
        assert (hashes is not None and all(hashes)) == (name == "hits" and with_hashes)
        out[f"{name}_in_index_us"] = cpu_us_per_id(lambda p=probes: [i in state.ok_ids for i in p], len(probes),
                                                   repeat)
        out[f"{name}_skips_us"] = cpu_us_per_id(lambda p=probes: [rule.skips(i) for i in p], len(probes), repeat)
        for rows in batch_rows:
            out[f"{name}_settle_{rows}_us"] = cpu_us_per_id(in_batches(rule.settle, probes, rows), len(probes), repeat)
    return out


def row_by_row(config, rule: ResumeRule) -> None:
    """What PreparedJob.rows did: every row built, then skips; a row to compare: its hash fetched."""
    from batchgen.jobs.rows.rows import RowSource

    for row in RowSource.open(config):
        if not rule.skips(row.row_id) and rule.needs_prompt(row.row_id):
            rule.state.prompt_hashes.get(row.row_id)


def batched(config, rule: ResumeRule) -> None:
    from batchgen.jobs.rows.rows import RowSource

    for _ in rule.unsettled_rows(RowSource.open(config)):
        pass


def resume_pass(num_rows: int, directory: str, repeat: int) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchgen.config.job import build_config
    from batchgen.jobs.rows.rows import RowSource

    path = os.path.join(directory, "in.parquet")
    pq.write_table(pa.table({"text": [f"prompt number {i} of the benchmark input" for i in range(num_rows)],
                             "key": list(range(num_rows))}), path)
    out = []
    for id_column in (None, "key"):
        config = build_config(None, inputs=[path], output=os.path.join(directory, "out"), id_column=id_column)
        ids = list(RowSource.open(config).iter_ids([(path, num_rows)]))
        committed = ids[: num_rows - num_rows // 100]
        state = state_of(committed, with_hashes=id_column is not None)
        rule = ResumeRule(state, retry_errors=True, check_prompts=id_column is not None)

        before = cpu_us_per_id(lambda c=config, r=rule: row_by_row(c, r), num_rows, repeat)
        after = cpu_us_per_id(lambda c=config, r=rule: batched(c, r), num_rows, repeat)
        out.append({"ids": "derived" if id_column is None else "id_column", "input_rows": num_rows,
                    "committed": len(committed), "before_us_per_row": before, "after_us_per_row": after})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=1_000_000, help="committed ids")
    parser.add_argument("--batch-rows", type=int, nargs="+", default=[256, LOOKUP_ROWS],
                        help="ids per batch lookup (256: the default --read-batch-size)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--resume-pass", action="store_true", help="also a resume's whole pass over a Parquet input")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    results = [measure(kind, args.ids, args.batch_rows, args.repeat) for kind in ("derived", "id_column")]
    if args.resume_pass:
        with tempfile.TemporaryDirectory() as directory:
            results += resume_pass(args.ids, directory, args.repeat)
    print(json.dumps({"results": results, "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
                     indent=1))


if __name__ == "__main__":
    main()
