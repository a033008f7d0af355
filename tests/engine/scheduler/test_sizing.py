"""Auto batch limits: from the KV cache's capacity, the job's row sizes and the device's cap."""

from __future__ import annotations

from batchgen.engine.scheduler.sizing import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS_CAP, resolve_limits, upper_limits


def limits(**kw):
    base = dict(device_type="cpu", kv_capacity_tokens=100_000, max_num_seqs=None, max_num_batched_tokens=None,
                expected_seq_tokens=None, max_model_len=8192)
    return resolve_limits(**{**base, **kw})


def test_without_a_workload_estimate_the_device_cap():
    assert limits().max_num_seqs == MAX_NUM_SEQS_CAP["cpu"]
    assert limits(device_type="cuda").max_num_seqs == MAX_NUM_SEQS_CAP["cuda"]


def test_the_cache_bounds_the_batch():
    lim = limits(kv_capacity_tokens=10_000, expected_seq_tokens=1000)
    assert lim.max_num_seqs == 10
    assert "holds 10 sequences" in lim.reason


def test_at_least_one_sequence_and_at_most_the_cap():
    assert limits(kv_capacity_tokens=500, expected_seq_tokens=1000).max_num_seqs == 1
    assert limits(kv_capacity_tokens=10**9, expected_seq_tokens=10).max_num_seqs == MAX_NUM_SEQS_CAP["cpu"]


def test_user_values_win():
    lim = limits(max_num_seqs=7, max_num_batched_tokens=99, expected_seq_tokens=10)
    assert (lim.max_num_seqs, lim.max_num_batched_tokens) == (7, 99)
    assert "(set)" in lim.reason


def test_step_budget_holds_a_decode_step_of_every_sequence():
    lim = limits(max_num_seqs=4096)
    assert lim.max_num_batched_tokens >= 4096
    assert limits().max_num_batched_tokens == MAX_NUM_BATCHED_TOKENS["cpu"]
    assert limits(max_model_len=512).max_num_batched_tokens == 512  # no chunk beyond one sequence


def test_upper_limits_cover_every_auto_choice():
    max_seqs, max_tokens = upper_limits("cuda")
    lim = limits(device_type="cuda", kv_capacity_tokens=10**9)
    assert lim.max_num_seqs <= max_seqs and lim.max_num_batched_tokens <= max_tokens
