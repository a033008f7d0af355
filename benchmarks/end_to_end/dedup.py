"""Duplicate prompts: a job in which half the rows are copies against the distinct half alone.

    python -m benchmarks.end_to_end.dedup                       # 24 distinct documents, each twice, 2 rounds
    python -m benchmarks.end_to_end.dedup --docs 40 --rounds 3

Three whole `batchgen run` processes per round, interleaved (the default model, default flags but
--max-new-tokens): the distinct rows alone, the rows with copies (--dedup, the default), and the
rows with copies under --no-dedup. Real documents (Python's own pydoc topics, cut to
--doc-chars) under a summarization template; the copies are shuffled among the originals, so they
do not arrive next to them. Prints each process's wall time, the medians, and the ratios to the
distinct job (the goal: copies cost <= 1.2x the distinct half alone).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def documents(num_docs: int, doc_chars: int) -> list[str]:
    from pydoc_data.topics import topics

    texts = [text[:doc_chars] for _, text in sorted(topics.items()) if len(text) >= doc_chars // 2]
    return texts[:num_docs]


def write_input(path: Path, texts: list[str]) -> Path:
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path)
    return path


def run(src: Path, out: Path, extra: list[str], max_new_tokens: int) -> tuple[float, dict]:
    argv = [sys.executable, "-m", "batchgen", "run", "--input", str(src), "--output", str(out), "--id-column", "id",
            "--template", "Summarize in one sentence:\n\n{text}", "--max-new-tokens", str(max_new_tokens),
            "--quiet", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "_summary.json").read_text())
    return wall_s, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--doc-chars", type=int, default=1500)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    distinct = documents(args.docs, args.doc_chars)
    copies = distinct * 2
    random.Random(0).shuffle(copies)
    work = Path(tempfile.mkdtemp(prefix="batchgen-dedup-"))
    inputs = {"distinct": write_input(work / "distinct.parquet", distinct),
              "copies": write_input(work / "copies.parquet", copies)}
    jobs = {"distinct": ("distinct", []), "copies (dedup)": ("copies", []),
            "copies (--no-dedup)": ("copies", ["--no-dedup"])}
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for r in range(args.rounds):
        for name, (input_name, extra) in jobs.items():
            out = work / f"out-{r}-{input_name}-{len(extra)}"
            wall_s, summary = run(inputs[input_name], out, extra, args.max_new_tokens)
            times[name].append(wall_s)
            print(f"round {r} {name:20s} {wall_s:7.1f} s  rows {summary['num_rows']}, served from a duplicate "
                  f"{summary.get('num_rows_from_duplicates', 0)}, generated tokens {summary['num_generated_tokens']}, "
                  f"engine-sampled {summary.get('num_sampled_tokens')}", flush=True)
    base = statistics.median(times["distinct"])
    print(f"\n{args.docs} distinct documents (<= {args.doc_chars} chars), each twice in the copies job; "
          f"--max-new-tokens {args.max_new_tokens}; medians of {args.rounds} rounds, whole process")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:20s} median {median:7.1f} s (min {min(values):.1f})  {median / base:.2f}x distinct")


if __name__ == "__main__":
    main()
