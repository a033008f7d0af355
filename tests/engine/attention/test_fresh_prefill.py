"""Fresh prompts in one padded SDPA call give what one call per prompt gives."""

from __future__ import annotations

import torch

from batchgen.engine.attention.base import LayerKV, PackedSeq
from batchgen.engine.attention.fresh_prefill import build_fresh_batch, fresh_forward
from batchgen.engine.attention.sdpa import SdpaBackend, build_prefills, prefill_forward


def _step(lengths: list[int], decode_past: int = 0) -> list[PackedSeq]:
    seqs, start = [], 0
    for n in lengths:
        seqs.append(PackedSeq(start, n, 0, list(range(100))))
        start += n
    if decode_past:  # a decode sequence and a chunk with a cached past, which keep their own path
        seqs.append(PackedSeq(start, 1, decode_past, list(range(100))))
        seqs.append(PackedSeq(start + 1, 5, decode_past, list(range(100))))
    return seqs


def test_padded_fresh_prompts_equal_one_call_each():
    torch.manual_seed(0)
    seqs = _step([7, 19, 3, 12])
    num_tokens = sum(s.num_new_tokens for s in seqs)
    q = torch.randn(num_tokens, 8, 16)
    k, v = torch.randn(num_tokens, 2, 16), torch.randn(num_tokens, 2, 16)
    layer = LayerKV(torch.zeros(64, 2, 16), torch.zeros(64, 2, 16), 16)
    expected = torch.zeros_like(q)
    prefill_forward(q, k, v, layer, build_prefills(seqs, 16, q.device), 0.25, expected)
    got = torch.full_like(q, float("nan"))
    batch = build_fresh_batch(seqs, q.device)
    assert batch is not None and batch.num_prompts == 4 and batch.max_len == 19
    fresh_forward(q, k, v, batch, 0.25, got)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_the_backend_sends_only_fresh_prompts_of_plain_layers_to_the_padded_call():
    seqs = _step([5, 9], decode_past=20)
    metadata = SdpaBackend().build_metadata(seqs, 16, torch.device("cpu"))
    assert metadata.fresh is not None and metadata.fresh.starts == {0, 5}
    assert [p.start for p in metadata.prefills_with_past] == [15]
    single = SdpaBackend().build_metadata(_step([5], decode_past=20), 16, torch.device("cpu"))
    assert single.fresh is None  # one prompt: its own call is as cheap
