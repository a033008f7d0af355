"""CUDA graphs for decode-only steps: captured once per padded batch size, replayed per step.

A decode step of a small model on a GPU is mostly kernel-launch overhead: hundreds of small
kernels whose launches the CPU issues one by one. A CUDA graph replays the whole forward with
one launch, but only for fixed shapes and fixed tensor addresses. So, as vLLM does:

- a ladder of batch sizes (`capture_sizes`: 1, 2, 4, 8, then steps of 16 and 64 up to
  max_num_seqs), each captured at engine start;
- a decode-only step of n sequences runs the smallest captured size >= n; the padding rows read
  token 0 at position 0, write their K/V into one reserved dummy block, attend to that one slot,
  and their logits are never sampled;
- every input lives in static buffers sized for the largest graph (`DecodeBuffers`), filled on
  the host in pinned memory and copied in with one non-blocking copy each;
- prefill and mixed steps (and decode steps larger than the ladder) run eagerly.

Graphs need attention whose launch shapes do not depend on the step: the flash backend's decode
path (`flash_attn_with_kvcache` over cache_seqlens + block_table) is one; torch SDPA's gathered,
length-grouped decode is not, so graphs are used with flash-attn only.

On the CPU (tests) the "graph" of a size is a plain callable that runs the same padded forward
eagerly over the same static buffers, so padding and buffer filling are checked without CUDA.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.engine.attention.paged import AttentionMetadata
from batchgen.engine.forward_context import forward_context
from batchgen.engine.kv.cache import KVCache
from batchgen.engine.kv.groups import KVGroups
from batchgen.engine.packed_seq import cdiv
from batchgen.engine.scheduler.output import SchedulerOutput

log = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8)
MID_STEP, MID_END = 16, 256  # multiples of 16 up to 256: little padding where steps are cheapest
LARGE_STEP = 64  # then multiples of 64: at that size a step is bound by its rows, padding costs < 20%

Forward = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor | int], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes to capture, ascending, the largest being max_num_seqs."""
    assert max_num_seqs >= 1
    sizes = set(SMALL_SIZES) | set(range(MID_STEP, MID_END + 1, MID_STEP))
    sizes |= set(range(MID_END + LARGE_STEP, max_num_seqs + 1, LARGE_STEP))
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs rows; None when none does (run eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def is_decode_only(out: SchedulerOutput) -> bool:
    """Every scheduled sequence computes exactly one token and samples from it."""
    return bool(out.scheduled) and all(s.num_new_tokens == 1 and s.samples for s in out.scheduled)


class DecodeBuffers:
    """The graphs' inputs at fixed addresses, sized for the largest graph; host twins in pinned memory.
    A model with KV layer groups (kv/groups.py) has a slot_mapping and a block table per group."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device, num_kv_groups: int = 1):
        pin = device.type == "cuda"

        def pair(*shape: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, pin_memory=pin))

        self.input_ids, self._input_ids = pair(max_num_seqs, dtype=torch.long)  # [max_num_seqs]
        self.positions, self._positions = pair(max_num_seqs, dtype=torch.long)
        self.context_lens, self._context_lens = pair(max_num_seqs, dtype=torch.int32)
        # per KV group: slot_mapping [max_num_seqs] and block table [max_num_seqs, max_blocks_per_seq]
        # (columns past a row's context are never read); group 0's under the plain names
        self.group_slot_mappings = [pair(max_num_seqs, dtype=torch.long) for _ in range(num_kv_groups)]
        self.group_block_tables = [pair(max_num_seqs, max_blocks_per_seq, dtype=torch.int32)
                                   for _ in range(num_kv_groups)]
        self.slot_mapping, self._slot_mapping = self.group_slot_mappings[0]
        self.block_table, self._block_table = self.group_block_tables[0]
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq

    def fill(self, out: SchedulerOutput, padded: int, block_size: int, dummy_block: int) -> None:
        """Write a decode-only step's rows, then padding rows up to `padded`, into the buffers.

        The pinned host twins are reused every step: safe, since the previous step's sampling
        synchronized with the device, so its non-blocking copies out of them have completed."""
        rows = [s.seq for s in out.scheduled]
        n = len(rows)
        assert n <= padded <= self.max_num_seqs
        positions = [seq.num_computed_tokens for seq in rows]
        width = max(cdiv(p + 1, block_size) for p in positions)
        assert width <= self.max_blocks_per_seq
        self._input_ids[:n] = torch.tensor([seq.token_ids[p] for seq, p in zip(rows, positions, strict=True)])
        self._positions[:n] = torch.tensor(positions)
        self._context_lens[:n] = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
        # padding rows: token 0 at position 0, K/V into the dummy block's first slot, attending to it alone
        self._input_ids[n:padded] = 0
        self._positions[n:padded] = 0
        self._context_lens[n:padded] = 1
        for group, ((slot_mapping, host_slots), (block_table, host_table)) in enumerate(
                zip(self.group_slot_mappings, self.group_block_tables, strict=True)):
            tables = [seq.block_table if group == 0 else seq.kv_groups[group - 1].block_table for seq in rows]
            host_slots[:n] = torch.tensor([table[p // block_size] * block_size + p % block_size
                                           for table, p in zip(tables, positions, strict=True)])
            padded_tables = [t[:width] + [dummy_block] * (width - len(t[:width])) for t in tables]
            host_table[:n, :width] = torch.tensor(padded_tables, dtype=torch.int32)
            host_slots[n:padded] = dummy_block * block_size
            host_table[n:padded, 0] = dummy_block
            slot_mapping[:padded].copy_(host_slots[:padded], non_blocking=True)
            block_table[:padded, :width].copy_(host_table[:padded, :width], non_blocking=True)
        for dev, host in ((self.input_ids, self._input_ids), (self.positions, self._positions),
                          (self.context_lens, self._context_lens)):
            dev[:padded].copy_(host[:padded], non_blocking=True)


@dataclass(slots=True)
class GraphStats:
    num_graph_steps: int = 0
    num_padding_rows: int = 0  # rows computed only to fill a graph
    capture_seconds: float = 0.0


class DecodeGraphs:
    """One graph (or, off CUDA, one eager callable) per padded batch size, over shared static buffers."""

    def __init__(self, model: torch.nn.Module, forward: Forward, kv_cache: KVCache, backend, *,
                 max_num_seqs: int, max_blocks_per_seq: int, dummy_block: int, vocab_size: int,
                 device: torch.device, kv_groups: KVGroups | None = None):
        assert getattr(backend, "supports_cuda_graphs", False), f"{backend.name} has no graph-safe decode"
        self.model = model
        self.forward = forward
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = kv_cache.spec.block_size
        self.dummy_block = dummy_block
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.kv_groups = kv_groups
        self.buffers = DecodeBuffers(max_num_seqs, max_blocks_per_seq, device,
                                     1 if kv_groups is None else kv_groups.num_groups)
        # one logits buffer for all sizes: each graph copies its logits into the head of it, so
        # the graphs' own logits die inside the shared pool instead of each keeping [size, vocab].
        # Allocated by the first (warm-up) forward, in the dtype the model's logits have.
        self.vocab_size = vocab_size
        self.logits: torch.Tensor | None = None  # [max_num_seqs, vocab_size]
        self.runners: dict[int, Callable[[], None]] = {}
        self.stats = GraphStats()

    def capture(self) -> None:
        """Capture every size on CUDA (largest first, one memory pool); elsewhere keep eager callables."""
        t0 = time.perf_counter()
        if self.device.type != "cuda":
            self.runners = {size: (lambda size=size: self._padded_forward(size)) for size in self.sizes}
            return
        pool = torch.cuda.graph_pool_handle()
        b = self.buffers  # capture-time inputs: every row is a padding row
        b.context_lens.fill_(1)
        for (slot_mapping, _), (block_table, _) in zip(b.group_slot_mappings, b.group_block_tables, strict=True):
            slot_mapping.fill_(self.dummy_block * self.block_size)
            block_table[:, 0] = self.dummy_block
        for size in reversed(self.sizes):
            self._padded_forward(size)  # warm-up: lazy inits and autotuning must not happen inside capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._padded_forward(size)
            self.runners[size] = graph.replay
        torch.cuda.synchronize(self.device)
        self.stats.capture_seconds = time.perf_counter() - t0
        log.debug("CUDA graphs: %d decode batch sizes (%s) captured in %.1f s", len(self.sizes),
                  ",".join(map(str, self.sizes)), self.stats.capture_seconds)

    def _padded_forward(self, size: int) -> None:
        b = self.buffers
        meta = AttentionMetadata(
            slot_mapping=b.slot_mapping[:size], kv_caches=self.kv_cache.layers, block_size=self.block_size,
            backend=self.backend, step=self.backend.graph_decode_metadata(b.block_table[:size], b.context_lens[:size]),
            kv_scales=self.kv_cache.scales)
        if self.kv_groups is not None:  # each layer group's slots and block table (paged.py picks its layer's)
            meta.layer_group, meta.group_windows = self.kv_groups.layer_group, self.kv_groups.group_windows
            meta.group_slot_mappings = [slots[:size] for slots, _ in b.group_slot_mappings]
            meta.group_steps = [self.backend.graph_decode_metadata(table[:size], b.context_lens[:size])
                                for table, _ in b.group_block_tables]
        with forward_context(meta):
            # logits_to_keep=0 keeps every row: each is a decode row (or padding)
            logits = self.forward(self.model, b.input_ids[None, :size], b.positions[None, :size], 0)[0]
        if self.logits is None:
            self.logits = logits.new_empty((b.max_num_seqs, self.vocab_size))
        self.logits[:size].copy_(logits)

    def run(self, out: SchedulerOutput) -> torch.Tensor | None:
        """The step's logits [num_seqs, vocab_size] from a graph, or None when it must run eagerly."""
        if not is_decode_only(out):
            return None
        n = len(out.scheduled)
        size = padded_size(n, self.sizes)
        if size is None:
            return None
        self.buffers.fill(out, size, self.block_size, self.dummy_block)
        self.runners[size]()
        self.stats.num_graph_steps += 1
        self.stats.num_padding_rows += size - n
        return self.logits[:n]
