"""Weight memory of the embedded model per quantization scheme: tensor bytes and process RSS.

Each label loads in its own subprocess (RSS is per process), in bf16; no generation. A label is
`scheme[/backend][+embedding][@after]`: `+none` / `+int8` sets --quantize-embedding (default auto),
`@after` loads the whole bf16 model first and quantizes it afterwards (the path before
quantize-while-loading; `malloc_trim` is then called and the RSS read again), otherwise
`load_model(quantize=...)` quantizes while it loads (engine/model/stream_load.py).

Reports `engine.quantize.weight_bytes` (quantized inner tensors counted once), the bytes of the
embedding/LM head, and the process's RSS after loading and its peak (VmHWM, read as load_model
returns, and at the end of the child, after weight_bytes & co.), each also minus an
interpreter that imported the same libraries but loaded nothing (`baseline`): "RSS of the
weights" = RSS - baseline, "peak of the weights" = peak - baseline. Ratios are against bf16.

    nice -n 19 python -m benchmarks.quant.weight_memory [--schemes none,int4/torchao,int4/torchao@after]
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
from batchgen.engine.model.loader import load_model
from batchgen.engine.quant.quantize import quantize_model, weight_bytes
from batchgen.engine.model.stream_load import release_freed_memory

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
    spec, _, mode = label.partition("@")
    spec, _, embedding = spec.partition("+")
    scheme, _, backend = spec.partition("/")
    embedding, backend = embedding or "auto", backend or "auto"
    if mode == "after":
        loaded = load_model(None, dtype="bfloat16", device="cpu")
        record["label_applied"] = quantize_model(loaded.model, scheme, backend, embedding).label
    else:
        loaded = load_model(None, dtype="bfloat16", device="cpu", quantize=scheme, quantize_backend=backend,
                            quantize_embedding=embedding)
        record["label_applied"] = loaded.quantization
    record["peak_rss_load"] = peak_rss_bytes()  # before anything below touches the weights
    model = loaded.model
    gc.collect()
    record["rss_untrimmed"] = rss_bytes()
    release_freed_memory()
    embedding = model.get_input_embeddings()
    embedding_bytes = sum(t.untyped_storage().nbytes() for t in [*embedding.parameters(), *embedding.buffers()])
    head = model.get_output_embeddings()
    head_shared = head.weight.data_ptr() == embedding.weight.data_ptr()
    if not head_shared:
        embedding_bytes += sum(t.untyped_storage().nbytes() for t in [*head.parameters(), *head.buffers()])
    record.update(weight_bytes=weight_bytes(model), embedding_bytes=embedding_bytes, head_tied=head_shared,
                  rss=rss_bytes(), peak_rss=peak_rss_bytes())
print(json.dumps(record))
"""


def measure(label: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, label], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schemes", default="none,int8-weight/quanto,int4/torchao+none,int4/torchao,int4/quanto,"
                                         "int4/torchao@after")
    args = ap.parse_args()
    baseline = measure("baseline")
    records = [measure(label) for label in args.schemes.split(",")]
    ref = next((r for r in records if r["label"] == "none"), records[0])
    mb = 1e6
    print(f"baseline RSS (libraries imported, no model): {baseline['rss'] / mb:.1f} MB, peak "
          f"{baseline['peak_rss'] / mb:.1f} MB")
    print("| label | applied | weight bytes (ratio) | of which embedding/head | RSS of the weights (ratio) "
          "| before malloc_trim | peak of the weights while loading (ratio) | process peak RSS (at the end) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in records:
        rss_w, ref_rss_w = r["rss"] - baseline["rss"], ref["rss"] - baseline["rss"]
        peak_w, ref_peak_w = r["peak_rss_load"] - baseline["rss"], ref["peak_rss_load"] - baseline["rss"]
        print(f"| {r['label']} | {r['label_applied']} | {r['weight_bytes'] / mb:.1f} MB "
              f"({r['weight_bytes'] / ref['weight_bytes']:.2f}) | "
              f"{r['embedding_bytes'] / mb:.1f} MB ({r['embedding_bytes'] / r['weight_bytes']:.0%}"
              f"{', tied' if r['head_tied'] else ''}) | {rss_w / mb:.1f} MB ({rss_w / ref_rss_w:.2f}) | "
              f"{(r['rss_untrimmed'] - baseline['rss']) / mb:.1f} MB | {peak_w / mb:.1f} MB "
              f"({peak_w / ref_peak_w:.2f}) | {r['peak_rss'] / mb:.1f} MB |", flush=True)
    print(json.dumps({"baseline": baseline, "records": records}))


if __name__ == "__main__":
    main()
