"""Weight memory of the embedded model per quantization scheme: tensor bytes and process RSS.

Each scheme loads in its own subprocess (RSS is per process and never shrinks back), in bf16, then
quantizes; no generation. Reports `engine.quantize.weight_bytes` (quantized inner tensors counted
once), the bytes of the embedding/LM head (tied; kept in full precision by design), and the
process's RSS after loading against an interpreter that imported the same libraries but loaded
nothing (`rss_baseline`): `rss_weights = rss - rss_baseline`. Ratios are against bf16.

    nice -n 19 python -m benchmarks.weight_memory [--schemes none,int4/torchao,int4/quanto]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import gc, json, sys
import torch
import torchao, optimum.quanto  # noqa: F401  (imported in every child, baseline included)
from batchgen.engine.loader import load_model
from batchgen.engine.quantize import quantize_model, weight_bytes

def rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

def peak_rss_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

label = sys.argv[1]
record = {"label": label}
if label == "baseline":
    record.update(rss=rss_bytes(), peak_rss=peak_rss_bytes())
else:
    scheme, _, backend = label.partition("/")
    loaded = load_model(None, dtype="bfloat16", device="cpu")
    model = loaded.model
    if scheme != "none":
        quantize_model(model, scheme, backend)
    gc.collect()
    embedding = model.get_input_embeddings().weight
    record.update(weight_bytes=weight_bytes(model),
                  embedding_bytes=embedding.untyped_storage().nbytes(),
                  head_tied=model.get_output_embeddings().weight.data_ptr() == embedding.data_ptr(),
                  rss=rss_bytes(), peak_rss=peak_rss_bytes())
print(json.dumps(record))
"""


def measure(label: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, label], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="none,int8-weight/quanto,int4/torchao,int4/quanto")
    args = ap.parse_args()
    baseline = measure("baseline")
    records = [measure(label) for label in args.schemes.split(",")]
    ref = next((r for r in records if r["label"] == "none"), records[0])
    mb = 1e6
    print(f"baseline RSS (libraries imported, no model): {baseline['rss'] / mb:.1f} MB")
    print("| weights | weight bytes (ratio) | of which embedding/head | RSS - baseline (ratio) | peak RSS |")
    print("|---|---|---|---|---|")
    for r in records:
        rss_w = r["rss"] - baseline["rss"]
        ref_rss_w = ref["rss"] - baseline["rss"]
        label = "bf16" if r["label"] == "none" else r["label"]
        print(f"| {label} | {r['weight_bytes'] / mb:.1f} MB ({r['weight_bytes'] / ref['weight_bytes']:.2f}) | "
              f"{r['embedding_bytes'] / mb:.1f} MB ({r['embedding_bytes'] / r['weight_bytes']:.0%}"
              f"{', tied' if r['head_tied'] else ''}) | {rss_w / mb:.1f} MB ({rss_w / ref_rss_w:.2f}) | "
              f"{r['peak_rss'] / mb:.1f} MB |")
    print(json.dumps({"baseline": baseline, "records": records}))


if __name__ == "__main__":
    main()
