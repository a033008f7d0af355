"""The only place where scheduled sequences become tensors: pack, run the model, sample.

One step is one forward over all scheduled tokens packed into a single row:

    input_ids     [1, T]  the new tokens of every scheduled sequence, back to back
    position_ids  [1, T]  absolute positions within each sequence (RoPE needs them)
    slot_mapping  [T]     where each new token's K/V goes in the paged cache
    logits_to_keep [S]    the last token of each sequence that samples this step, so the LM head
                          runs on S rows instead of T

Decode-only steps replay a CUDA graph instead when the engine captured them (engine/model/cuda_graphs.py).
On CUDA the step's inputs go up from pinned host memory with non-blocking copies, and the sampled
tokens come back in one copy per step (the sampler's `.tolist()`), so the CPU packs the inputs
while the GPU may still run earlier work.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchgen.engine.attention.base import AttentionBackend, PackedSeq
from batchgen.engine.attention.paged import AttentionMetadata
from batchgen.engine.forward_context import forward_context
from batchgen.engine.kv.cache import KVCache, KVCacheSpec
from batchgen.engine.kv.groups import KVGroups
from batchgen.engine.lora.layers import adapter_order, lora_step, step_groups
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.scheduler.output import SchedulerOutput
from batchgen.runtime.cache_dir import cache_root

if TYPE_CHECKING:
    from batchgen.engine.model.cuda_graphs import DecodeGraphs

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DeviceTiming:
    """CUDA only: where a step's time went, for the overlap between host work and the GPU.

    idle_s: host time between one step's tokens coming back (the GPU then has nothing queued) and
    the next step starting: scheduling, stop checks, detokenization, the job's writes and commits.
    forward_s: the GPU timeline from the step's start to its logits (CUDA events), launch gaps
    included. Per step both cost nothing but two events and two clock reads.
    """

    num_steps: int = 0
    idle_s: float = 0.0
    forward_s: float = 0.0

    def summary(self) -> dict:
        n = max(1, self.num_steps)
        return {"num_steps": self.num_steps, "gpu_idle_ms_per_step": round(1000 * self.idle_s / n, 3),
                "forward_ms_per_step": round(1000 * self.forward_s / n, 3)}


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: KVCache | None, device: torch.device,
                 backend: AttentionBackend, compile: bool = False, eos_token_ids: list[int] | None = None, *,
                 kv_window: int | None = None, kv_groups: KVGroups | None = None):
        self.model = model
        self._forward = compile_forward(model) if compile else _forward
        self.kv_cache = kv_cache  # replaced by allocate_cache
        self.device = device
        self.backend = backend
        self.sampler = Sampler(eos_token_ids)  # EOS ids: what min_tokens masks
        self.graphs: DecodeGraphs | None = None  # once capture_graphs has run on this cache
        self.kv_window = kv_window  # where the engine's block manager drops blocks behind it
        self.kv_groups = kv_groups  # where layer groups have their own blocks
        self.timing = DeviceTiming()
        # jump-forward (engine/sampling/jump_forward.py), from the latest step: seq id -> (drafts
        # confirmed, token picked after them), and seq id -> the forced tokens that follow its new token
        self.verdicts: dict[int, tuple[int, int | None]] = {}
        self.drafts: dict[int, list[int]] = {}
        # the latest step's model call in seconds: the GPU timeline on CUDA (events), the host's
        # wall clock around the forward on the CPU (input packing and sampling excluded)
        self.last_forward_s = 0.0
        self._last_sync_s: float | None = None  # host time the previous step's tokens came back
        self._events = ((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                        if device.type == "cuda" else None)

    def allocate_cache(self, spec: KVCacheSpec, num_blocks: int) -> KVCache:
        """A KV cache of `num_blocks` in place of the old one, which is freed first with the graphs
        that hold its addresses."""
        self.graphs = None
        self.kv_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        groups = self.kv_groups
        self.kv_cache = KVCache(spec, num_blocks, self.device, None if groups is None else groups.layer_tensor)
        return self.kv_cache

    def capture_graphs(self, *, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        """CUDA graphs of decode-only steps of up to `max_num_seqs` rows over this cache; their padding
        rows write to its last block, which the engine keeps out of its block pool."""
        from batchgen.engine.model.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(
            self.model, self.forward_fn, self.kv_cache, self.backend, max_num_seqs=max_num_seqs,
            max_blocks_per_seq=max_blocks_per_seq, dummy_block=self.kv_cache.num_blocks - 1,
            vocab_size=self.model.get_output_embeddings().weight.shape[0], device=self.device, kv_groups=self.kv_groups)
        with torch.inference_mode():
            graphs.capture()
        self.graphs = graphs

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> list[int]:
        """Run one step; return the sampled token of each sampler, in `out.samplers` order."""
        if self._events is not None:
            if self._last_sync_s is not None:  # the GPU had nothing queued since the last sync
                self.timing.idle_s += time.perf_counter() - self._last_sync_s
            self._events[0].record()
        rows = _logits_rows(out)  # None unless a row has drafts (engine/sampling/jump_forward.py)
        logits = self.graphs.run(out) if self.graphs is not None and rows is None else None
        if logits is None:
            logits = self._run_eager(out, rows)
        if self._events is not None:
            self._events[1].record()
        self.verdicts = {}
        if rows is None:
            tokens = self.sampler.sample(logits, out.samplers)  # the step's one device-to-host copy
        else:
            tokens, self.verdicts = self.sampler.sample_with_drafts(logits, [(s.seq, m, s.samples) for s, m in rows])
        grammar = self.sampler.grammar
        self.drafts = {}
        if grammar is not None:  # taken: a step whose rows are all free leaves the grammar's accept unrun
            self.drafts, grammar.drafts = grammar.drafts, {}
        if self._events is not None:  # sampling synchronized: both events have completed
            self._last_sync_s = time.perf_counter()
            self.timing.num_steps += 1
            self.last_forward_s = self._events[0].elapsed_time(self._events[1]) / 1000
            self.timing.forward_s += self.last_forward_s
        return tokens

    def _run_eager(self, out: SchedulerOutput, rows: list | None = None) -> torch.Tensor:
        """The packed forward of any step; returns the samplers' logits [S, vocab_size], or with
        `rows` (_logits_rows) each row's logits rows in order."""
        bs = self.kv_cache.spec.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        packed: list[PackedSeq] = []
        adapter_spans: list[tuple[str | None, int, int]] = []  # each row's adapter and its tokens
        order = adapter_order(out.scheduled)  # None without adapters: the scheduler's order
        scheduled = out.scheduled if order is None else [out.scheduled[i] for i in order]
        t = 0
        row_logits: list[list[int]] = [[] for _ in out.scheduled]  # per scheduled row, its logits rows
        for k, s in zip(range(len(scheduled)) if order is None else order, scheduled, strict=True):
            seq, n = s.seq, s.num_new_tokens
            start = seq.num_computed_tokens
            context_len = start + n
            block_table = seq.block_table
            input_ids.extend(seq.token_ids[start:context_len])
            positions.extend(range(start, context_len))
            slot_mapping.extend(block_table[p // bs] * bs + p % bs for p in range(start, context_len))
            packed.append(PackedSeq(t, n, start, block_table))
            adapter_spans.append((seq.request.adapter, t, n))
            if s.seq.num_draft_tokens:  # from the position before its first draft (or the chunk's start)
                row_logits[k].extend(range(t + max(start, s.seq.first_logits_position) - start, t + n))
            elif s.samples:
                row_logits[k].append(t + n - 1)
            t += n
        # the logits in the scheduler's row order, wherever adapter grouping packed the rows
        logits_idx = [i for rows_of_seq in row_logits for i in rows_of_seq]

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=_to_device(slot_mapping, dev),
            kv_caches=self.kv_cache.layers,
            block_size=bs,
            backend=self.backend,
            step=self.backend.build_metadata(packed, bs, dev),
            kv_scales=self.kv_cache.scales,
            kv_window=self.kv_window,
        )
        if self.kv_groups is not None:
            self._add_group_metadata(meta, scheduled, packed)
        ids, pos, keep = _to_device(input_ids, dev), _to_device(positions, dev), _to_device(logits_idx, dev)
        # not with adapters (their row spans cover the whole step) nor compiled (it would guard on S)
        if len(logits_idx) < t and order is None and self._forward is _forward:
            meta.head_rows = keep
        t0 = time.perf_counter()
        with forward_context(meta), lora_step(step_groups(adapter_spans, dev)):
            logits = self._forward(self.model, ids[None], pos[None], keep)[0]  # [S, vocab_size]
        if self._events is None:  # on CUDA the call only queued work: the events time it
            self.last_forward_s = time.perf_counter() - t0
        return logits

    def _add_group_metadata(self, meta: AttentionMetadata, scheduled: list, packed: list[PackedSeq]) -> None:
        """Each further layer group's slot_mapping and step metadata (kv/hybrid.py): the same
        tokens, in that group's blocks; the first group's are the ones already built."""
        groups, bs = self.kv_groups, meta.block_size
        meta.layer_group, meta.group_windows = groups.layer_group, groups.group_windows
        meta.group_slot_mappings, meta.group_steps = [meta.slot_mapping], [meta.step]
        for k in range(groups.num_groups - 1):
            slot_mapping: list[int] = []
            group_packed = []
            for s, p in zip(scheduled, packed, strict=True):
                block_table = s.seq.kv_groups[k].block_table
                slot_mapping.extend(block_table[i // bs] * bs + i % bs for i in range(p.num_past_tokens, p.context_len))
                group_packed.append(PackedSeq(p.start, p.num_new_tokens, p.num_past_tokens, block_table))
            meta.group_slot_mappings.append(_to_device(slot_mapping, self.device))
            meta.group_steps.append(self.backend.build_metadata(group_packed, bs, self.device))

    @property
    def forward_fn(self):
        """The model call (compiled or not): model, input_ids, position_ids, logits_to_keep -> logits."""
        return self._forward

    def add(self, seq) -> None:
        self.sampler.add(seq)

    def release(self, seq) -> None:
        self.sampler.release(seq)


def _logits_rows(out: SchedulerOutput) -> list | None:
    """(scheduled seq, its logits rows) of the rows that have any, when some row has drafts: it needs one
    per position from the one before its first draft to its chunk's end; None in a step without drafts."""
    if not any(s.seq.num_draft_tokens for s in out.scheduled):
        return None
    rows = []
    for s in out.scheduled:
        end = s.seq.num_computed_tokens + s.num_new_tokens
        m = max(0, end - max(s.seq.num_computed_tokens, s.seq.first_logits_position)) if s.seq.num_draft_tokens \
            else int(s.samples)
        if m:
            rows.append((s, m))
    return rows


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 on `device`; on CUDA through pinned memory, so the copy does not block the host."""
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=torch.long, pin_memory=pinned).to(device, non_blocking=pinned)


def _forward(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
             logits_to_keep: torch.Tensor | int) -> torch.Tensor:
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                 logits_to_keep=logits_to_keep).logits


def inductor_cache_dir() -> str:
    """Point inductor's on-disk cache into batchgen's cache unless the user chose a directory.

    torch writes the directory it picks into TORCHINDUCTOR_CACHE_DIR the first time anything asks
    for it (an import can), so a plain setdefault would keep torch's /tmp default: a value equal to
    that default counts as torch's choice, not the user's."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
        torch_default = os.path.abspath(default_cache_dir())
    except ImportError:  # another torch layout: only an unset variable is ours to set
        torch_default = None
    if current is None or os.path.abspath(current) == torch_default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root() / "inductor")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compile_forward(model: torch.nn.Module):
    """The forward through torch.compile (inductor), dynamic in the number of packed tokens.

    Attention is the opaque `batchgen::paged_attention` op, so the whole model is one graph and
    the pointwise chains between the linear layers (RMSNorm, RoPE, SiLU * up, residual adds) fuse.
    Compiled kernels are cached on disk (TORCHINDUCTOR_CACHE_DIR, default: batchgen's cache), so
    only the first run on a machine pays the full compile; each later process still traces.
    """
    inductor_cache_dir()
    compiled = torch.compile(_forward, dynamic=True)
    first = True

    def forward(*args):
        nonlocal first
        if not first:
            return compiled(*args)
        t0 = time.perf_counter()
        out = compiled(*args)
        first = False
        log.info("compiled forward ready in %.1f s (traced, compiled or loaded from %s)", time.perf_counter() - t0,
                 os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return out

    return forward
