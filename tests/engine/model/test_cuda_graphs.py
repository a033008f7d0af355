"""CUDA graphs for decode steps, checked on the CPU: the size ladder, the static buffers, padding.

Off CUDA a "graph" is a plain callable that runs the same padded forward over the same static
buffers (engine/model/cuda_graphs.py), and flash-attn is replaced by pure-torch stand-ins with its
semantics, so a padded decode step must give exactly model.generate's greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchgen.engine.attention import flash
from batchgen.engine.engine import EngineConfig, LLMEngine
from batchgen.engine.model.cuda_graphs import DecodeBuffers, capture_sizes, is_decode_only, padded_size
from batchgen.engine.request import Request, SamplingParams
from batchgen.engine.scheduler.output import ScheduledSeq, SchedulerOutput
from batchgen.engine.sequence import Sequence, SequenceStatus
from tests.engine.attention.test_registry import fake_flash_attn_varlen_func
from tests.engine.test_engine_equivalence import build_case, check_completions

pytestmark = pytest.mark.usefixtures("one_thread")


def fake_flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None,
                                 causal=False):
    # q: [B, 1, H, D]; k/v_cache: [num_blocks, block_size, KVH, D]; attends to the first cache_seqlens slots
    assert causal and q.shape[1] == 1 and cache_seqlens.dtype == torch.int32 and block_table.dtype == torch.int32
    out = torch.empty_like(q)
    group = q.shape[2] // k_cache.shape[2]
    for i in range(q.shape[0]):
        n = int(cache_seqlens[i])
        blocks = block_table[i, :-(-n // k_cache.shape[1])].long()
        k = k_cache[blocks].flatten(0, 1)[:n].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
        v = v_cache[blocks].flatten(0, 1)[:n].repeat_interleave(group, dim=1).transpose(0, 1)
        out[i, 0] = F.scaled_dot_product_attention(q[i, 0][:, None], k, v, scale=softmax_scale)[:, 0]
    return out


def test_capture_sizes_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(300) == [1, 2, 4, 8, *range(16, 257, 16), 300]
    big = capture_sizes(1024)
    assert big[:6] == [1, 2, 4, 8, 16, 32] and big[-3:] == [896, 960, 1024]
    assert big == sorted(set(big))


def test_padded_size_picks_the_smallest_graph_that_fits():
    sizes = capture_sizes(40)
    assert [padded_size(n, sizes) for n in (1, 3, 8, 9, 17, 33, 40)] == [1, 4, 8, 16, 32, 40, 40]
    assert padded_size(41, sizes) is None  # larger than every graph: eager


def _running(seq_id: int, tokens: list[int], num_computed: int, block_table: list[int]) -> Sequence:
    seq = Sequence.from_request(seq_id, Request(str(seq_id), tokens, SamplingParams(max_new_tokens=4)))
    seq.status, seq.num_computed_tokens, seq.block_table = SequenceStatus.RUNNING, num_computed, block_table
    return seq


def test_decode_only_and_buffer_filling():
    a = _running(0, list(range(10, 15)), 4, [7])  # its 5th token (position 4) in block 7
    b = _running(1, list(range(20, 29)), 8, [3, 5])  # position 8: second block, offset 0 (block size 8)
    out = SchedulerOutput([ScheduledSeq(a, 1, True), ScheduledSeq(b, 1, True)])
    assert is_decode_only(out)
    assert not is_decode_only(SchedulerOutput([ScheduledSeq(a, 1, True), ScheduledSeq(b, 2, True)]))
    assert not is_decode_only(SchedulerOutput([ScheduledSeq(a, 1, False)]))  # a chunk that does not sample
    buf = DecodeBuffers(max_num_seqs=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    buf.fill(out, padded=4, block_size=8, dummy_block=9)
    assert buf.input_ids[:4].tolist() == [14, 28, 0, 0]
    assert buf.positions[:4].tolist() == [4, 8, 0, 0]
    assert buf.slot_mapping[:4].tolist() == [7 * 8 + 4, 5 * 8 + 0, 9 * 8, 9 * 8]  # padding: the dummy block
    assert buf.context_lens[:4].tolist() == [5, 9, 1, 1]
    assert buf.block_table[:2, :2].tolist() == [[7, 9], [3, 5]]
    assert buf.block_table[2:4, 0].tolist() == [9, 9]


def _graph_engine(case, tokenizer, monkeypatch, **config) -> LLMEngine:
    """An engine whose decode steps go through DecodeGraphs (eager callables on the CPU) over the
    flash backend's graph path, with flash-attn's functions replaced by the stand-ins."""
    monkeypatch.setattr(flash, "flash_attn_varlen_func", lambda: fake_flash_attn_varlen_func)
    monkeypatch.setattr(flash, "flash_attn_with_kvcache", lambda: fake_flash_attn_with_kvcache)
    engine = case.engine(tokenizer, EngineConfig(attention_backend="sdpa", block_size=8, **config))
    engine.backend = engine.runner.backend = flash.FlashBackend()
    engine.use_cuda_graphs = True  # what the engine does on CUDA: reserve a dummy block, build the graphs
    engine._allocate_cache(engine.kv_cache.num_blocks)
    engine.scheduler.set_block_manager(engine.block_manager)
    engine._capture_graphs()
    return engine


@pytest.mark.parametrize("max_num_seqs", [5, 28])
def test_padded_graph_decode_gives_generate_equal_tokens(tokenizer, monkeypatch, max_num_seqs):
    case = build_case("llama")
    engine = _graph_engine(case, tokenizer, monkeypatch, num_kv_blocks=129, max_num_seqs=max_num_seqs)
    graphs = engine.runner.graphs
    assert graphs.sizes[-1] == max_num_seqs and graphs.dummy_block == 128
    assert engine.block_manager.num_blocks == 128, "the dummy block is not in the pool"
    check_completions(case, list(engine.generate(case.requests())), tokenizer)
    assert graphs.stats.num_graph_steps > 10 and graphs.stats.num_padding_rows > 0
    engine.check_integrity()


def test_static_policy_decodes_through_the_graphs(tokenizer, monkeypatch):
    from batchgen.config.choices import Policy

    case = build_case("llama")
    engine = _graph_engine(case, tokenizer, monkeypatch, num_kv_blocks=129, max_num_seqs=8, policy=Policy.STATIC)
    steps = []
    engine.metrics.listeners.append(steps.append)  # the metrics keep sums only; listeners see each step
    check_completions(case, list(engine.generate(case.requests())), tokenizer)
    decode_steps = sum(1 for s in steps if s.num_batched_tokens == s.num_running)
    assert engine.runner.graphs.stats.num_graph_steps >= decode_steps - 1


def test_oom_during_a_step_shrinks_the_cache_and_loses_no_row(tokenizer, monkeypatch):
    case = build_case("llama")
    engine = case.engine(tokenizer, EngineConfig(attention_backend="sdpa", block_size=8, num_kv_blocks=100,
                                                 max_num_seqs=16))
    real_forward, calls = engine.runner._forward, []

    def forward(*args):
        calls.append(1)
        if len(calls) in (3, 9):  # a stand-in for the allocator failing mid-run, twice
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_forward(*args)

    monkeypatch.setattr(engine.runner, "_forward", forward)
    check_completions(case, list(engine.generate(case.requests())), tokenizer)
    assert engine.metrics.num_oom_retries == 2 and engine.metrics.summary()["num_oom_retries"] == 2
    assert engine.kv_cache.num_blocks == int(int(100 * 0.9) * 0.9)
    assert engine.limits.max_num_seqs <= 4 and engine.scheduler.max_num_seqs == engine.limits.max_num_seqs
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks == engine.kv_cache.num_blocks
    engine.check_integrity()


def test_oom_that_persists_is_an_engine_error(tokenizer, monkeypatch):
    from batchgen.errors import EngineError

    case = build_case("llama")
    engine = case.engine(tokenizer, EngineConfig(attention_backend="sdpa", block_size=8, num_kv_blocks=64))

    def forward(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(engine.runner, "_forward", forward)
    with pytest.raises(EngineError, match="out of device memory 5 times"):
        list(engine.generate(case.requests()))


def _windowed_flash_fakes():
    """flash-attn stand-ins that honour `window_size=(left, 0)` (what flash.py passes for a window)."""
    def keys_seen(q_pos: torch.Tensor, len_k: int, window_size) -> torch.Tensor:
        k_pos = torch.arange(len_k)[None, :]
        seen = k_pos <= q_pos[:, None]
        if window_size is not None:
            seen &= k_pos >= q_pos[:, None] - window_size[0]
        return seen  # [len_q, len_k]

    def attend(q, k_cache, v_cache, blocks, len_k, q_pos, scale, window_size):
        k = k_cache[blocks].flatten(0, 1)[:len_k]  # [len_k, KVH, D]
        v = v_cache[blocks].flatten(0, 1)[:len_k]
        group = q.shape[1] // k.shape[1]
        k, v = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))
        mask = keys_seen(q_pos, len_k, window_size)
        return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale).transpose(0, 1)

    def with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None, causal=False,
                     window_size=None):
        assert causal
        out = torch.empty_like(q)
        for i in range(q.shape[0]):
            n = int(cache_seqlens[i])
            blocks = block_table[i, :-(-n // k_cache.shape[1])].long()
            out[i] = attend(q[i], k_cache, v_cache, blocks, n, torch.tensor([n - 1]), softmax_scale, window_size)
        return out

    def varlen(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
               causal=False, block_table=None, window_size=None):
        assert causal
        out = torch.empty_like(q)
        for i in range(block_table.shape[0]):
            q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
            len_k = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
            q_pos = torch.arange(len_k - (q1 - q0), len_k)
            out[q0:q1] = attend(q[q0:q1], k_cache, v_cache, block_table[i].long(), len_k, q_pos, softmax_scale,
                                window_size)
        return out

    return with_kvcache, varlen


@pytest.mark.parametrize("family", ["qwen2", "cohere2"])
def test_graph_decode_of_a_local_global_model_reads_each_groups_block_table(family, tokenizer, monkeypatch):
    import copy

    from tests.engine import test_families_generate as fams

    model = fams.build(family)
    prompts = fams.workload()
    with_kvcache, varlen = _windowed_flash_fakes()
    monkeypatch.setattr(flash, "flash_attn_varlen_func", lambda: varlen)
    monkeypatch.setattr(flash, "flash_attn_with_kvcache", lambda: with_kvcache)
    config = EngineConfig(attention_backend="sdpa", block_size=4, num_kv_blocks=97, max_num_seqs=5,
                          max_num_batched_tokens=32)
    engine = LLMEngine(copy.deepcopy(model), tokenizer, config, eos_token_ids=[])
    assert engine.kv_groups is not None
    engine.backend = engine.runner.backend = flash.FlashBackend()
    engine.use_cuda_graphs = True  # what the engine does on CUDA: reserve a dummy block, build the graphs
    engine._allocate_cache(engine.kv_cache.num_blocks)
    engine.scheduler.set_block_manager(engine.block_manager)
    engine._capture_graphs()
    requests = [Request(str(i), p, SamplingParams(max_new_tokens=fams.MAX_NEW_TOKENS, ignore_eos=True))
                for i, p in enumerate(prompts)]
    got = {c.request_id: c.token_ids for c in engine.generate(requests, between_steps=engine.check_integrity)}
    assert [got[str(i)] for i in range(len(prompts))] == [fams.greedy(model, p) for p in prompts]
    assert engine.runner.graphs.stats.num_graph_steps > 10
    assert len(engine.runner.graphs.buffers.group_block_tables) == engine.kv_groups.num_groups == 2
