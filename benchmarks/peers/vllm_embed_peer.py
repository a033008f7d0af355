"""Run vLLM-CPU's `LLM.embed` on a rows file and print one JSON line of timings. Runs inside vLLM's own venv.

    $PEER/venv/bin/python benchmarks/peers/vllm_embed_peer.py --model DIR --rows rows.parquet

Imports nothing of batchgen (vLLM's venv does not have it). Start-up (import, engine construction,
warm-up) and `embed` are timed separately; the texts go in as given (vLLM tokenizes them, truncating
at the model's limit as sentence-transformers does).
"""

from __future__ import annotations

import argparse
import json
import time

T0 = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", required=True)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    import pyarrow.parquet as pq
    from vllm import LLM

    texts = pq.read_table(args.rows, columns=["text"]).column("text").to_pylist()
    try:
        llm = LLM(model=args.model, runner="pooling", dtype=args.dtype, enforce_eager=True)
    except TypeError:  # vLLM before `runner`: the task names the pooling runner
        llm = LLM(model=args.model, task="embed", dtype=args.dtype, enforce_eager=True)
    t1 = time.perf_counter()
    # cut at the model's limit, as sentence-transformers and batchgen do (vLLM refuses longer prompts otherwise)
    outputs = llm.embed(texts, use_tqdm=False, tokenization_kwargs={"truncation": True})
    t2 = time.perf_counter()
    print(json.dumps({"start_s": t1 - T0, "embed_s": t2 - t1, "num_rows": len(outputs),
                      "dim": len(outputs[0].outputs.embedding)}))


if __name__ == "__main__":
    main()
