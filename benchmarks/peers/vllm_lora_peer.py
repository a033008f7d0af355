"""Run vLLM-CPU's `LLM.chat` with per-row LoRA adapters on a rows file and print one JSON line of
timings. Runs inside vLLM's own venv (benchmarks/peers/lora_mix.py calls it).

    $PEER/venv/bin/python benchmarks/peers/vllm_lora_peer.py --model DIR --rows rows.parquet \
        --lora a0=DIR0 --lora a1=DIR1 --max-new-tokens 48 --max-model-len 1024

Imports nothing of batchgen (vLLM's venv does not have it). Each row's `text` is its user message,
rendered by the model's chat template as batchgen's default chat mode renders it; its `adapter`
names one of the --lora adapters (a `LoRARequest`) or is null for the base model. Every row
generates exactly --max-new-tokens tokens (min_tokens = max_tokens, ignore_eos), greedy. Start-up
(import, engine construction with `enable_lora`, compile, warm-up) and `chat` are timed apart. When
vLLM refuses LoRA, the JSON line carries its error instead of timings.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

T0 = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--max-new-tokens", type=int, required=True)
    ap.add_argument("--lora", action="append", default=[], metavar="NAME=DIR")
    args = ap.parse_args()

    import pyarrow.parquet as pq
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    table = pq.read_table(args.rows).to_pydict()
    adapters = dict(item.split("=", 1) for item in args.lora)
    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}
    max_rank = max(json.load(open(os.path.join(p, "adapter_config.json")))["r"] for p in adapters.values())
    try:
        llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=0, enable_lora=True,
                  max_loras=len(adapters), max_lora_rank=max_rank)
        startup_s = time.perf_counter() - T0
        n = args.max_new_tokens
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)
        conversations = [[{"role": "user", "content": text}] for text in table["text"]]
        t = time.perf_counter()
        outputs = llm.chat(conversations, params, use_tqdm=False,
                           lora_request=[requests.get(a) if a else None for a in table["adapter"]])
        generate_s = time.perf_counter() - t
    except Exception as e:  # noqa: BLE001 (the point is to report what vLLM says)
        print(json.dumps({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}),
              flush=True)
        _exit(1)
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(json.dumps({"startup_s": startup_s, "generate_s": generate_s, "generated_tokens": generated,
                      "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
                      "texts": [o.outputs[0].text for o in outputs]}), flush=True)
    _exit(0)


def _exit(code: int) -> None:
    from vllm_peer import exit_ending_children  # this script's directory is on sys.path: run by path

    exit_ending_children(code)


if __name__ == "__main__":
    main()
