"""What checkpointing costs: generated tokens/s with --commit-every 64 against one commit at the end.

    OMP_NUM_THREADS=1 python -m benchmarks.end_to_end.checkpoint_cost --rows 256 --max-new-tokens 16
    OMP_NUM_THREADS=1 python -m benchmarks.end_to_end.checkpoint_cost --model tiny --rows 2048 --max-new-tokens 16

The first uses the embedded SmolLM2-135M; the second a tiny random Llama, so fast that commits
weigh the most they can. Both configurations run in this one process on one loaded model,
round-robin for --repeats rounds after an unrecorded warm-up round (the order alternating), each
into a fresh output directory; time-based commits are off in both. tokens/s = generated tokens /
the job's wall seconds (streaming and every commit; model loading excluded). Also reported:
commits, seconds spent inside commits, and the CPU seconds other processes took meanwhile
(benchmarks/sysload.py): on a shared 2-core machine one OpenMP thread keeps a busy neighbour
from slowing each step several-fold. Prompts: paragraphs of the Python docs (pydoc_data), cut to
--max-prompt-tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.config.job import build_config
from batchgen.engine.model.loader import load_model
from batchgen.jobs.durability import commit
from benchmarks.sysload import measure

CONFIGS = {"commit-every-64": dict(commit_every_rows=64, commit_every_s=0),
           "one-commit-at-end": dict(commit_every_rows=10**9, commit_every_s=0, rows_per_part=10**9)}


def prompts(num_rows: int) -> list[str]:
    from pydoc_data.topics import topics

    paragraphs = [p.strip() for text in topics.values() for p in text.split("\n\n") if len(p.strip()) > 80]
    return [paragraphs[i % len(paragraphs)] for i in range(num_rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="'default' (embedded SmolLM2), 'tiny', or a path")
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="batchgen-ckpt-") as tmp:
        tmp = Path(tmp)
        if args.model == "tiny":
            from tests.tiny import save_tiny_model_dir

            model_path = save_tiny_model_dir(tmp / "tiny")
        else:
            model_path = None if args.model == "default" else args.model
        loaded = load_model(model_path, device="cpu", dtype=args.dtype)
        src = tmp / "in.parquet"
        pq.write_table(pa.table({"text": prompts(args.rows)}), src)

        commit_seconds = [0.0]
        real_commit = commit.Committer.commit

        def timed_commit(self):
            t0 = time.perf_counter()
            try:
                real_commit(self)
            finally:
                commit_seconds[0] += time.perf_counter() - t0

        commit.Committer.commit = timed_commit  # a benchmark may instrument; the job code is unchanged
        from batchgen.jobs.commands.run import run_job

        results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
        for round_index in range(-1, args.repeats):  # round -1 warms up (kernels, caches) and is not kept
            names = list(CONFIGS) if round_index % 2 == 0 else list(reversed(CONFIGS))
            for name in names:
                out = tmp / f"{name}-{round_index}"
                config = build_config(None, inputs=[str(src)], output=str(out), model=model_path, device="cpu",
                                      dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                                      max_prompt_tokens=args.max_prompt_tokens, batch_size=args.batch_size,
                                      quiet=True, **CONFIGS[name])
                commit_seconds[0] = 0.0
                with measure() as load:
                    summary = run_job(config, loaded=loaded)
                record = {"tokens_per_s": round(summary.generated_tokens_per_s, 1),
                          "wall_s": round(summary.wall_seconds, 2), "commits": summary.num_commits,
                          "parts": summary.num_parts_written, "commit_s": round(commit_seconds[0], 3),
                          "generated_tokens": summary.num_generated_tokens,
                          "other_cpu_s": load.to_dict()["other_cpu_s"]}
                if round_index >= 0:
                    results[name].append(record)
                print(f"round {round_index} {name}: {json.dumps(record)}", flush=True)
        commit.Committer.commit = real_commit

    table = {}
    for name, records in results.items():
        rates = [r["tokens_per_s"] for r in records]
        table[name] = {"min": min(rates), "median": statistics.median(rates), "max": max(rates),
                       "commits": records[0]["commits"],
                       "commit_s_median": statistics.median(r["commit_s"] for r in records)}
    base, ckpt = table["one-commit-at-end"]["median"], table["commit-every-64"]["median"]
    summary = {"model": loaded.name, "dtype": str(loaded.dtype), "rows": args.rows,
               "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "tokens_per_s": table,
               "commit_every_64_vs_one_commit": round(ckpt / base, 4) if base else None}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
