"""A step's multi-token sequences in one padded SDPA call per kind give what one call each gives."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.attention.base import LayerKV, PackedSeq
from batchgen.engine.attention.padded_prefill import build_padded_batches, padded_forward
from batchgen.engine.attention.sdpa import SdpaBackend, build_prefills, prefill_forward

BLOCK = 4
KV_HEADS, HEADS, HEAD_DIM = 2, 8, 16


def _step(fresh: list[int], past: list[tuple[int, int]], decode_past: int = 0) -> list[PackedSeq]:
    """Fresh prompts of these lengths, then (past, new) sequences, each on its own blocks."""
    seqs, start, next_block = [], 0, 1  # block 0 stays free: the padded batch's filler page
    for past_len, n in [(0, n) for n in fresh] + past + ([(decode_past, 1)] if decode_past else []):
        num_blocks = -(-(past_len + n) // BLOCK)
        seqs.append(PackedSeq(start, n, past_len, list(range(next_block, next_block + num_blocks))))
        start += n
        next_block += num_blocks
    return seqs


def _inputs(seqs: list[PackedSeq]) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    num_tokens = sum(s.num_new_tokens for s in seqs)
    q = torch.randn(num_tokens, HEADS, HEAD_DIM)
    k, v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM), torch.randn(num_tokens, KV_HEADS, HEAD_DIM)
    layer = LayerKV(torch.randn(64 * BLOCK, KV_HEADS, HEAD_DIM), torch.randn(64 * BLOCK, KV_HEADS, HEAD_DIM), BLOCK)
    for s in seqs:  # this step's new K/V are in the pages, after their past, as the engine writes them
        for i in range(s.num_new_tokens):
            pos = s.num_past_tokens + i
            slot = s.block_table[pos // BLOCK] * BLOCK + pos % BLOCK
            layer.k_cache[slot], layer.v_cache[slot] = k[s.start + i], v[s.start + i]
    return q, k, v, layer


@pytest.mark.parametrize("kind", ["fresh", "with_past"])
def test_a_padded_call_equals_one_call_per_sequence(kind):
    seqs = _step([7, 19, 3, 12], []) if kind == "fresh" else _step([], [(5, 3), (30, 9), (1, 2), (16, 4)])
    q, k, v, layer = _inputs(seqs)
    expected = torch.zeros_like(q)
    prefill_forward(q, k, v, layer, build_prefills(seqs, BLOCK, q.device), 0.25, expected)
    fresh, with_past = build_padded_batches(seqs, BLOCK, q.device)
    batch = fresh if kind == "fresh" else with_past
    assert batch is not None and batch.num_seqs == 4 and (fresh if kind == "with_past" else with_past) is None
    got = torch.full_like(q, float("nan"))
    padded_forward(q, k, v, layer, batch, 0.25, got)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_backend_pads_each_kind_and_leaves_single_sequences_and_decode_alone():
    seqs = _step([5, 9], [(20, 5)], decode_past=20)
    q, k, v, layer = _inputs(seqs)
    metadata = SdpaBackend().build_metadata(seqs, BLOCK, torch.device("cpu"))
    assert metadata.fresh is not None and metadata.fresh.starts == {0, 5}
    assert metadata.with_past is None and [p.start for p in metadata.unpadded] == [14]  # one: its own call
    backend_out = SdpaBackend().forward(q, k, v, layer, metadata, 0.25)
    expected = SdpaBackend().forward(q, k, v, layer, _per_sequence(metadata), 0.25)
    torch.testing.assert_close(backend_out, expected, rtol=1e-5, atol=1e-5)


def _per_sequence(metadata):
    metadata.fresh = metadata.with_past = None
    metadata.fresh_unpadded = metadata.prefills
    return metadata
