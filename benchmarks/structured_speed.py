"""Structured output's speed, with and without --jump-forward: valid rows per second, the forward's
share of the wall time and decode steps per generated token.

    python -m benchmarks.structured_speed                  # 32 documents, 2 rounds
    python -m benchmarks.structured_speed --docs 48 --rounds 3

Two jobs over the same real documents (Python's own pydoc topics, cut to --doc-chars): a 3-field
extraction under a JSON schema, and a 5-way --choices labelling. Each runs as a whole `batchgen run`
process with default flags (the default model) and --jump-forward (the default) or
--no-jump-forward; the four processes of a round run one after another, rounds interleaved. Per
process: valid rows (json_valid for the schema job, a listed label for the choices job) per second
of the whole process, the summary's forward share (the model's forward over the job's wall time),
decode steps per generated token (the engine's num_row_steps: each step's rows that gained tokens,
over the generated tokens; below 1 where forced tokens ran as drafts) and the forced tokens.
Prints each process, then medians per job and flag.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["topic", "keywords", "beginner_friendly"],
          "properties": {"topic": {"type": "string", "maxLength": 40},
                         "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                         "beginner_friendly": {"type": "boolean"}}}
CHOICES = ["syntax", "data model", "standard library", "execution model", "other"]
JOBS = {
    "json-schema": ["--json-schema", json.dumps(SCHEMA), "--template",
                    "Describe this Python documentation as JSON with its topic, up to three keywords and whether "
                    "it is beginner friendly.\n\n{text}"],
    "choices": ["--choices", ",".join(CHOICES), "--template",
                "Which part of Python does this documentation describe: " + ", ".join(CHOICES) + "?\n\n{text}"],
}


def documents(num_docs: int, doc_chars: int) -> list[str]:
    from pydoc_data.topics import topics

    texts = [text[:doc_chars] for _, text in sorted(topics.items()) if len(text) >= doc_chars]
    assert len(texts) >= num_docs, f"only {len(texts)} topics of {doc_chars} chars"
    return texts[:num_docs]


def run(src: Path, out: Path, job: str, extra: list[str]) -> dict:
    argv = [sys.executable, "-m", "batchgen", "run", "--input", str(src), "--output", str(out), "--id-column", "id",
            "--quiet", *JOBS[job], *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{job} {extra} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "_summary.json").read_text())
    rows = _rows(out)
    if job == "json-schema":
        valid = sum(1 for r in rows if r.get("json_valid"))
    else:
        valid = sum(1 for r in rows if r["generated_text"] in CHOICES)
    engine = summary["engine"]
    generated = summary["num_generated_tokens"]
    return {"wall_s": wall_s, "rows": len(rows), "valid": valid, "valid_rows_per_s": valid / wall_s,
            "forward_share": summary.get("forward_share"), "generated": generated,
            "steps_per_token": engine["num_row_steps"] / generated if generated else None,
            "forced": engine.get("num_forced_tokens", 0), "engine_steps": engine["num_steps"]}


def _rows(out: Path) -> list[dict]:
    parts = sorted(p for p in out.rglob("part-*.parquet"))
    return [row for p in parts for row in pq.read_table(p).to_pylist()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=32)
    parser.add_argument("--doc-chars", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="batchgen-structured-speed-"))
    texts = documents(args.docs, args.doc_chars)
    src = work / "docs.parquet"
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), src)
    variants = {"jump-forward": [], "no-jump-forward": ["--no-jump-forward"]}
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for job in JOBS:
            for name, extra in variants.items():
                m = run(src, work / f"out-{r}-{job}-{name}", job, extra)
                results.setdefault((job, name), []).append(m)
                print(f"round {r} {job:12s} {name:16s} {m['wall_s']:6.1f} s  valid {m['valid']}/{m['rows']}  "
                      f"{m['valid_rows_per_s']:.3f} valid rows/s  forward {100 * (m['forward_share'] or 0):.1f}%  "
                      f"steps/token {m['steps_per_token']:.3f}  generated {m['generated']}  forced {m['forced']}  "
                      f"engine steps {m['engine_steps']}", flush=True)
    print(f"\n{args.docs} documents (pydoc topics, {args.doc_chars} chars), default flags, whole process; "
          f"medians of {args.rounds} rounds")
    for (job, name), ms in results.items():
        med = {key: statistics.median(m[key] for m in ms)
               for key in ("wall_s", "valid_rows_per_s", "forward_share", "steps_per_token", "engine_steps")}
        print(f"  {job:12s} {name:16s} {med['wall_s']:6.1f} s  {med['valid_rows_per_s']:.3f} valid rows/s  "
              f"valid {min(m['valid'] for m in ms)}/{ms[0]['rows']}  forward {100 * med['forward_share']:.1f}%  "
              f"steps/token {med['steps_per_token']:.3f}  engine steps {med['engine_steps']:.0f}")


if __name__ == "__main__":
    main()
