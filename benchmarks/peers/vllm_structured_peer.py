"""Run vLLM-CPU's structured outputs on prompt token ids and write its texts. Runs inside vLLM's own venv.

    $PEER/venv/bin/python benchmarks/peers/vllm_structured_peer.py --model DIR --rows rows.parquet \
        --max-model-len 1024 --json-schema schema.json --texts-out texts.json
    ... --choices choices.json --texts-out texts.json

Imports nothing of batchgen (vLLM's venv does not have it). Each row of --rows holds its prompt as
token ids (`prompt_token_ids`, the chat prompt batchgen builds for it) and its `max_new_tokens`;
greedy, EOS kept (the grammar ends a row), vLLM's own defaults for everything else, its grammar
backend included. Start-up (import, engine construction, compile, warm-up) and `generate` are timed
apart; the texts and finish reasons go to --texts-out, so that the caller judges every system's
rows with the same check. Prints one JSON line of timings.
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
    ap.add_argument("--dtype", default="auto", help="vLLM's dtype (auto: its default)")
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--json-schema", help="a JSON schema file")
    ap.add_argument("--choices", help="a JSON file of the labels")
    ap.add_argument("--texts-out", required=True)
    args = ap.parse_args()
    assert (args.json_schema is None) != (args.choices is None), "one of --json-schema, --choices"

    import pyarrow.parquet as pq
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    table = pq.read_table(args.rows).to_pydict()
    with open(args.json_schema or args.choices) as f:
        spec = json.load(f)
    structured = StructuredOutputsParams(json=spec) if args.json_schema else StructuredOutputsParams(choice=spec)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in table["prompt_token_ids"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, structured_outputs=structured)
              for n in table["max_new_tokens"]]
    startup_s = time.perf_counter() - T0
    t = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - t
    with open(args.texts_out, "w") as f:
        json.dump([{"text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason} for o in outputs], f)
    print(json.dumps({"startup_s": startup_s, "generate_s": generate_s,
                      "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                      "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs)}), flush=True)
    from vllm_peer import exit_ending_children  # this script's directory is on sys.path: run by path

    exit_ending_children(0)


if __name__ == "__main__":
    main()
