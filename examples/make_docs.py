"""Build the example inputs from Python's own documentation topics (no download needed).

    python examples/make_docs.py            # writes examples/docs.parquet and examples/docs_small.jsonl

`pydoc_data.topics.topics` ships with CPython: 79 real reference texts from ~200 to ~62,000
characters, so one file exercises short prompts, long ones, and truncation. The output is
deterministic: sorted keys, fixed schema and writer options, no timestamps. Re-running with the same
Python and pyarrow versions gives identical bytes; another Python version may ship other texts.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from pydoc_data.topics import topics

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
SMALL_NUM_DOCS = 8
SMALL_MAX_CHARS = 1500
LONG_DOC_CHARS = 2000  # about the median length: half the rows get each budget
SHORT_BUDGET, LONG_BUDGET = 48, 96  # max_new_tokens per row: summaries of long docs may run longer

SCHEMA = pa.schema([
    pa.field("doc_id", pa.string(), nullable=False),
    pa.field("title", pa.string(), nullable=False),
    pa.field("text", pa.string(), nullable=False),
    pa.field("num_chars", pa.int32(), nullable=False),
    pa.field("max_new_tokens", pa.int32(), nullable=False),
])
# Fixed writer options: pyarrow defaults may change between versions, and the bytes should not.
WRITE_OPTIONS = dict(compression="zstd", compression_level=9, use_dictionary=False,
                     write_statistics=True, version="2.6", data_page_version="1.0",
                     row_group_size=1 << 20)
# A topic starts with its heading, underlined with one repeated character (****, ====, ----).
HEADING = re.compile(r"\A([^\n]+)\n([*=\-~^])\2+\n")


def title_of(doc_id: str, text: str) -> str:
    match = HEADING.match(text)
    return match.group(1).strip() if match else doc_id.replace("-", " ").replace("_", " ")


def budget_of(num_chars: int) -> int:
    return LONG_BUDGET if num_chars >= LONG_DOC_CHARS else SHORT_BUDGET


def truncate(text: str, max_chars: int) -> str:
    """Cut at the last whitespace before max_chars, so no word is split."""
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    space = max(cut.rfind(" "), cut.rfind("\n"))
    return cut[:space].rstrip() if space > 0 else cut


def rows(max_chars: int | None = None, limit: int | None = None) -> list[dict]:
    out = []
    for doc_id in sorted(topics)[:limit]:
        text = topics[doc_id] if max_chars is None else truncate(topics[doc_id], max_chars)
        out.append({"doc_id": doc_id, "title": title_of(doc_id, text), "text": text,
                    "num_chars": len(text), "max_new_tokens": budget_of(len(text))})
    return out


def write_parquet(path: Path, records: list[dict]) -> None:
    source = f"pydoc_data.topics, Python {sys.version_info.major}.{sys.version_info.minor}"
    table = pa.Table.from_pylist(records, schema=SCHEMA).replace_schema_metadata({"source": source})
    pq.write_table(table, path, **WRITE_OPTIONS)


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=HERE)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    docs = rows()
    write_parquet(args.out_dir / "docs.parquet", docs)
    write_jsonl(args.out_dir / "docs_small.jsonl", rows(SMALL_MAX_CHARS, SMALL_NUM_DOCS))
    lengths = sorted(d["num_chars"] for d in docs)
    print(f"wrote {len(docs)} docs ({lengths[0]}..{lengths[-1]} chars) to {args.out_dir / 'docs.parquet'}"
          f" and {SMALL_NUM_DOCS} to {args.out_dir / 'docs_small.jsonl'}")


if __name__ == "__main__":
    main()
