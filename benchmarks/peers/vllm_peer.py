"""Run vLLM-CPU on a rows file and print one JSON line of timings. Runs inside vLLM's own venv.

    $PEER/venv/bin/python benchmarks/peers/vllm_peer.py --model DIR --rows rows.parquet --dtype float32

Imports nothing of batchgen (vLLM's venv does not have it). Every row gets its text prompt and
exactly its `max_new_tokens` (min_tokens = max_tokens, ignore_eos), greedy, so it generates the
same number of tokens as batchgen with --ignore-eos and a per-row budget column; greedy unless
--temperature is given (with --top-p; --seeded gives request i the seed i, vLLM's per-request
generator, which it samples apart from the unseeded rows). Start-up (import,
engine construction, compile, warm-up) and `generate` are timed separately.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

T0 = time.perf_counter()


def load() -> tuple:
    """(the LLM, the rows' prompts, their SamplingParams) from the command line's arguments; also
    what benchmarks/peers/vllm_profile.py runs."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seeded", action="store_true")
    ap.add_argument("--json-schema", default=None, help="a JSON schema file: greedy structured output, EOS kept")
    args = ap.parse_args()

    import pyarrow.parquet as pq
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    table = pq.read_table(args.rows).to_pydict()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0)
    if args.json_schema:  # the grammar ends each row: no forced length
        with open(args.json_schema) as f:
            schema = json.load(f)
        params = [SamplingParams(max_tokens=n, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
                  for n in table["max_new_tokens"]]
        return llm, table["text"], params
    params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=args.temperature,
                             top_p=args.top_p, seed=i if args.seeded else None)
              for i, n in enumerate(table["max_new_tokens"])]
    return llm, table["text"], params


def parses_as_json(text: str) -> bool:
    """Whether a row's text parses as JSON (generate.py counts batchgen's rows with it too)."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main() -> None:
    llm, prompts, params = load()
    startup_s = time.perf_counter() - T0
    t = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - t
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"json_parsed": sum(parses_as_json(o.outputs[0].text) for o in outputs),
                      "startup_s": startup_s, "generate_s": generate_s, "generated_tokens": generated,
                      "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
                      "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}), flush=True)
    exit_ending_children(0)


def exit_ending_children(code: int) -> None:
    """Leave with `code` once stdout is out. vLLM's engine core runs in child processes, which can
    hang interpreter shutdown: end them first (they would outlive an os._exit), then leave without
    running atexit hooks. The other peer scripts call this too."""
    sys.stdout.flush()
    import psutil  # a vLLM dependency

    children = psutil.Process().children(recursive=True)
    for child in children:
        child.terminate()
    psutil.wait_procs(children, timeout=10)
    os._exit(code)


if __name__ == "__main__":
    main()
