"""The job's pipeline without its engine at N rows: which side grows with the job, input or output?

    OMP_NUM_THREADS=1 python -m benchmarks.scale.pipeline_memory --rows 10000 1000000 --stages commit [--trace DIR]

scale_rows' job with the model taken out, in a fresh process per size, over the same rows (derived
ids, "row <i> says hello", n = 1-4 new tokens):

    commit  N output rows shaped as the job writes them handed to the job's own CommitSchedule
            (Committer, PartWriter, Manifest with its snapshots), 1000 rows a commit
    input   the job's RowSource, PromptBuilder (the tiny byte-level tokenizer, its chat template),
            LengthPredictor and Planner over an N-row Parquet file: every row planned, then dropped
    all     input, then each planned row's output row (no model: " ab" per new token) committed

Prints each size's peak RSS (ru_maxrss) and its growth over the smallest size's; `--trace DIR`
writes each run's memory trace (benchmarks/scale/rss_trace.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, os, resource, sys, time
from pathlib import Path
num_rows, stages, tmp, trace = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4]
out = tmp / "out"
if trace:
    from benchmarks.scale.rss_trace import start
    start(trace, str(out))
import pyarrow as pa
import pyarrow.parquet as pq
from batchgen.config.job import JobConfig, build_config
from batchgen.io.manifest.manifest import Manifest, load_manifest
from batchgen.io.store.schema import output_schema
from batchgen.io.store.writers import PartWriter
from batchgen.jobs.durability.commit import Committer
from batchgen.jobs.durability.commit_schedule import CommitSchedule
from batchgen.jobs.durability.signals import SignalGuard

def planned_rows(src):
    from batchgen.jobs.planning.length import LengthPredictor
    from batchgen.jobs.planning.planner import Planner, prepare_row
    from batchgen.jobs.prompting.prompts import PromptBuilder
    from batchgen.jobs.rows.rows import RowSource
    from tests.tiny import make_tokenizer

    config = build_config(None, inputs=[str(src)], output=str(out), max_new_tokens=4, max_new_tokens_column="n",
                          ignore_eos=True)
    source = RowSource.open(config)
    builder = PromptBuilder(make_tokenizer(), source.template, system=None, chat=None, max_context_tokens=512,
                            on_long_prompt=config.on_long_prompt, max_prompt_tokens=None)
    planner = Planner(config, LengthPredictor(ignore_eos=True), kv_capacity_tokens=131072, block_size=16)
    for plan in planner.plans(prepare_row(row, builder, config) for row in source):
        yield from plan.rows

def committed(rows):
    schema = output_schema(pa.field("row_id", pa.string()), [pa.field("text", pa.string()), pa.field("n", pa.int64())])
    out.mkdir()
    manifest = Manifest(out, load_manifest(out))
    manifest.begin({"test": 1})
    config = JobConfig(commit_every_rows=1000, rows_per_part=1000, commit_every_s=0)
    with SignalGuard(None) as guard:
        commits = CommitSchedule(Committer(manifest, PartWriter(out, schema), "row_id", rows_per_part=1000), guard,
                                 config)
        for row_id, digest, text, n, num_prompt, path, index in rows:
            commits.add({"row_id": row_id, "prompt_hash": digest, "generated_text": " ab" * n,
                         "finish_reason": "length", "num_prompt_tokens": num_prompt, "num_generated_tokens": n,
                         "error": None, "text": text, "n": n}, path, index)
        commits.commit()
    return len(manifest.state.parts)

src = tmp / "in.parquet"
if stages != "commit":  # written a row group at a time: a whole 1M-row table would be the run's peak
    with pq.ParquetWriter(src, pa.schema([("text", pa.string()), ("n", pa.int64())])) as writer:
        for start in range(0, num_rows, 65536):
            rows = range(start, min(start + 65536, num_rows))
            writer.write_table(pa.table({"text": [f"row {i} says hello" for i in rows],
                                         "n": [1 + i % 4 for i in rows]}))
    pa.default_memory_pool().release_unused()
t0 = time.monotonic()
parts = None
if stages == "commit":
    parts = committed((f"in.parquet:{i}", f"{i * 2654435761 % (1 << 64):016x}", f"row {i} says hello", 1 + i % 4, 30,
                       str(src), i) for i in range(num_rows))
elif stages == "input":
    for planned in planned_rows(src):
        pass
else:
    parts = committed((p.row.row_id, p.prompt_hash, p.row.values["text"], p.max_new_tokens, p.num_prompt_tokens,
                       p.row.file.path, p.row.row_index) for p in planned_rows(src))
wall = time.monotonic() - t0
print(json.dumps({"rows": num_rows, "stages": stages,
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                  "rows_per_s": round(num_rows / wall), "parts": parts,
                  "arrow_mib": round(pa.total_allocated_bytes() / 2**20, 2)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument("--stages", choices=["commit", "input", "all"], default="all")
    parser.add_argument("--trace", type=Path, help="write STAGES-ROWS.trace.jsonl per run into this directory")
    args = parser.parse_args()
    results = []
    for num_rows in sorted(args.rows):
        with tempfile.TemporaryDirectory(prefix="batchgen-pipeline-memory-") as tmp:
            trace = ""
            if args.trace:
                args.trace.mkdir(parents=True, exist_ok=True)
                trace = str(args.trace.absolute() / f"{args.stages}-{num_rows}.trace.jsonl")
            proc = subprocess.run([sys.executable, "-c", CHILD, str(num_rows), args.stages, tmp, trace],
                                  capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout.splitlines()[-1]))
        results[-1]["growth"] = f"{results[-1]['peak_rss_mib'] / results[0]['peak_rss_mib'] - 1:+.1%}"
        print(json.dumps(results[-1]), flush=True)


if __name__ == "__main__":
    main()
