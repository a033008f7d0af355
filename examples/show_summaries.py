"""Print a few of a finished job's completions and how they ended: what `make demo` shows last.

    python examples/show_summaries.py out/demo [--num 3]
"""

from __future__ import annotations

import argparse
import collections
import textwrap

import pyarrow.dataset as ds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="a batchgen output directory")
    parser.add_argument("--num", type=int, default=3, help="completions to print")
    args = parser.parse_args()
    rows = ds.dataset(args.output, format="parquet").to_table().to_pylist()
    rows.sort(key=lambda r: str(r.get("doc_id", r.get("row_id"))))  # a stable pick, not commit order
    reasons = collections.Counter(r["finish_reason"] for r in rows)
    print(f"{len(rows)} completions in {args.output}: {reasons['stop']} ended by the model (stop), "
          f"{reasons['length']} cut at max_new_tokens (length), {reasons['error']} errors")
    step = max(1, len(rows) // max(1, args.num))
    for row in rows[::step][:args.num]:
        title = row.get("title") or row.get("doc_id") or row.get("row_id")
        print(f"\n[{title}] ({row['finish_reason']}, {row['num_generated_tokens']} tokens)")
        print(textwrap.fill(row["generated_text"] or f"error: {row['error']}", width=100, initial_indent="  ",
                            subsequent_indent="  "))


if __name__ == "__main__":
    main()
