"""Memory of the committed-id index and the parts' id lists at scale.

    python -m benchmarks.scale.id_index_memory --ids 1000000 --parts 250

N committed ok ids in P parts (the parts spread over 10 input files, each part one run of a file's
rows, as a job's commits are), for derived ids (`part-00k.parquet:<row>`) and for integer ids
(--id-column), and derived ids as a length-sorted job commits them ("length_sorted": one file's
rows, each window of 1024 run longest first with n = 1 + row % 4 new tokens, as
benchmarks/scale/scale_rows.py's rows, so a part holds every fourth row of its windows and forms no
run). Python's tracemalloc (numpy and array buffers included) while the parts' id lists
are built (batchgen.io.ids.compact_lists.id_list) and while they are added to an IdIndex: bytes held
after, and the peak on the way (a table's growth holds the old and new arrays at once). One JSON
object on stdout.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from dataclasses import dataclass

from batchgen.io.ids.index import IdIndex
from batchgen.io.ids.lists import id_list

NUM_FILES = 10
WINDOW_ROWS = 1024


@dataclass
class Part:
    name: str
    ids: object


def mib(num_bytes: int) -> float:
    return round(num_bytes / 2**20, 2)


def measure(kind: str, num_ids: int, num_parts: int) -> dict:
    per_part = num_ids // num_parts
    parts_per_file = max(1, num_parts // NUM_FILES)
    order = [i for w in range(0, num_ids, WINDOW_ROWS)
             for i in sorted(range(w, min(w + WINDOW_ROWS, num_ids)), key=lambda i: -(1 + i % 4))] \
        if kind == "length_sorted" else []  # built before tracing: the job never holds it
    tracemalloc.start()
    parts = []
    for k in range(num_parts):
        if kind == "length_sorted":
            parts.append(Part(f"p{k}", id_list([f"in.parquet:{n}" for n in order[k * per_part:(k + 1) * per_part]])))
            continue
        start = (k % parts_per_file) * per_part
        rows = range(start, start + per_part)
        values = [f"part-{k // parts_per_file:03d}.parquet:{n}" for n in rows] if kind == "derived" else \
            [k * per_part + n for n in range(per_part)]
        parts.append(Part(f"p{k}", id_list(values)))
        del values
    lists_bytes, lists_peak = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    index = IdIndex()
    cpu = time.process_time()
    for part in parts:
        assert index.add_part(part, list(range(len(part.ids)))) is None
    cpu = time.process_time() - cpu
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"kind": kind, "ids": len(index), "parts": num_parts, "id_lists_mib": mib(lists_bytes),
            "index_mib": mib(held - lists_bytes), "index_peak_mib": mib(peak - lists_bytes),
            "index_nbytes": index.nbytes() if hasattr(index, "nbytes") else None,  # None: before IdIndex.nbytes
            "add_cpu_s": round(cpu, 2)}  # under tracemalloc: slower than a job's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ids", type=int, default=1_000_000)
    parser.add_argument("--parts", type=int, default=250)
    parser.add_argument("--kinds", default="derived,id_column,length_sorted")
    args = parser.parse_args()
    print(json.dumps({"results": [measure(kind, args.ids, args.parts) for kind in args.kinds.split(",")]},
                     indent=1))


if __name__ == "__main__":
    main()
