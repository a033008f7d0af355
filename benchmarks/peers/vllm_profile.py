"""Profile vLLM-CPU's `LLM.generate` on a rows file; print one JSON line of ops by self CPU time.

    $PEER/venv/bin/python benchmarks/peers/vllm_profile.py --model DIR --rows R.parquet --dtype bfloat16 \\
        --max-model-len N

Runs inside vLLM's own venv and imports nothing of batchgen (`benchmarks/peers/step_profile.py` starts it
and sorts the ops into the same categories as batchgen's). The engine core runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the caller) so that one `torch.profiler` sees the
forward; start-up (import, compile, warm-up) is outside the profiled region. Rows get exactly their
`max_new_tokens` (min_tokens = max_tokens, ignore_eos), greedy, as in `vllm_peer.py`.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    import torch
    from vllm_peer import load  # this script's directory is on sys.path: run by path, like vllm_peer.py

    llm, prompts, params = load()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - t
    ops = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()]
    print(json.dumps({"wall_s": wall_s, "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                      "num_threads": torch.get_num_threads(), "ops": ops}), flush=True)
    sys.stdout.flush()
    os._exit(0)  # vLLM's shutdown can hang; nothing is left to flush


if __name__ == "__main__":
    main()
