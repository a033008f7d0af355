"""Batch limits a user does not have to choose: the running-sequence cap and the step token budget.

vLLM asks for `max_num_seqs` and `max_num_batched_tokens` and ships fixed defaults; an offline job
knows more. Once the KV cache is sized, the number of sequences that can run without preemption
is the cache's tokens over what one sequence holds (its prompt plus its output), and the job's
planner knows that from the rows it is about to run (`expected_seq_tokens`). The cap above it is
per device (benchmarks/peers/generate.py's `batchgen-bsN` systems sweep it; benchmarks/results/2026-12-02-peers.md):

- CPU: a decode step's cost grows about linearly in its rows once the weights are read (the
  linear layers are compute-bound at a few dozen rows), so tokens per CPU-second keep rising,
  slowly, up to a few hundred rows; past that, bigger batches only hold more KV and delay the
  first commits.
- CUDA: a decode step costs about the same at 8 or 256 rows (weight reads dominate), so the cap
  is vLLM's own offline default on large GPUs, bounded by the cache like everything else.

The step token budget bounds a prefill chunk: on the CPU, chunks past a few thousand tokens no
longer speed up the linear layers while each chunk's attention grows with it.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_NUM_SEQS_CAP = {"cpu": 256, "cuda": 1024}
MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}
MIN_NUM_SEQS = 1


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    reason: str  # one line for the log and `batchgen plan`: why these values


def device_kind(device_type: str) -> str:
    return "cuda" if device_type == "cuda" else "cpu"


def upper_limits(device_type: str) -> tuple[int, int]:
    """The largest values auto can choose on this device (what a profiling step must allow for)."""
    kind = device_kind(device_type)
    return MAX_NUM_SEQS_CAP[kind], max(MAX_NUM_BATCHED_TOKENS[kind], MAX_NUM_SEQS_CAP[kind])


def resolve_limits(*, device_type: str, kv_capacity_tokens: int, max_num_seqs: int | None,
                   max_num_batched_tokens: int | None, expected_seq_tokens: int | None,
                   max_model_len: int) -> BatchLimits:
    """Fill in whichever of the two limits the user left unset (None)."""
    kind = device_kind(device_type)
    reasons = []
    if max_num_seqs is None:
        cap = MAX_NUM_SEQS_CAP[kind]
        if expected_seq_tokens:
            # a row holds, over its life, its prompt and on average half its output; sizing for the
            # whole output keeps a margin for the longest rows, which run first (LPT order)
            fit = max(MIN_NUM_SEQS, kv_capacity_tokens // max(1, expected_seq_tokens))
            max_num_seqs = min(cap, fit)
            reasons.append(f"batch size {max_num_seqs}: the KV cache holds {fit} sequences of "
                           f"~{expected_seq_tokens} tokens, {kind} cap {cap}")
        else:
            max_num_seqs = cap
            reasons.append(f"batch size {max_num_seqs}: the {kind} cap (no workload estimate)")
    else:
        reasons.append(f"batch size {max_num_seqs} (set)")
    if max_num_batched_tokens is None:
        # a decode step of every running sequence must fit one step
        max_num_batched_tokens = max(MAX_NUM_BATCHED_TOKENS[kind], max_num_seqs)
        max_num_batched_tokens = min(max_num_batched_tokens, max(max_num_seqs, max_model_len))
        reasons.append(f"step budget {max_num_batched_tokens} tokens ({kind} default)")
    else:
        reasons.append(f"step budget {max_num_batched_tokens} tokens (set)")
    return BatchLimits(max_num_seqs, max_num_batched_tokens, "; ".join(reasons))
