"""score's decoder forward on the engine's own prefill path.

A score row is a prefill whose every position is read: the causal LM's decoder runs over the packed
rows as a generation step's prefill runs it. Its attention is the engine's paged attention
(engine/attention/paged.py) through the backend the engine would choose for the model (on the CPU the C
prefill kernel, which attends causally within each row, window, softcap and sinks included), and the
rotary embedding takes its fused kernel (engine/kernels/fused.py fuses it inside an engine forward
only). So no token is padded: the linears, the rotary embedding and the attention all run on exactly
the rows' tokens, where a padded [rows, longest] SDPA layout (varlen.py) wastes the gaps.

The K/V go to a scratch cache that the next batch overwrites: nothing reads a score row's K/V once its
forward is done. Each row starts on a block of its own, so no page holds two rows. A row longer than the
token budget runs in chunks of the budget, each attending the chunks before it through the cache (as
the engine's chunked prefill), so one forward's activations stay within the budget; the cache holds
the whole row.

Used on the CPU, where the C kernels are the gain; on CUDA varlen.py's flash-attn varlen path already
runs the rows without padding.
"""

from __future__ import annotations

import torch

from batchgen.engine.attention import paged as attention
from batchgen.engine.attention.registry import make_backend
from batchgen.engine.encode.heads import decoder_of
from batchgen.engine.encode.packing import PackedBatch
from batchgen.engine.engine_config import EngineConfig, resolve_attention
from batchgen.engine.forward_context import forward_context
from batchgen.engine.kv.cache import KVCacheSpec
from batchgen.engine.model import families
from batchgen.engine.packed_seq import PackedSeq, cdiv

# the scratch cache grows at least this much at a time, so a window of batches a little longer each
# does not reallocate it at every batch
_GROWTH = 1.25


class PrefillForward:
    """The decoder hidden states of a causal LM over packed rows, on the engine's prefill kernels. The
    model's attention is switched to the engine's (as LLMEngine does): its own forward then runs only
    inside an engine or this class. Raises UnsupportedModelError / ConfigError where the engine could
    not run the model."""

    def __init__(self, model: torch.nn.Module, *, max_num_batched_tokens: int):
        families.check_model(model)
        device = next(model.parameters()).device
        backend, block_size, cache_dtype, _ = resolve_attention(EngineConfig(), device, model.dtype,
                                                                families.score_rules_used(model))
        self.decoder = decoder_of(model)
        attention.register()
        model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
        self.device = device
        self.backend = make_backend(backend)
        self.backend_name = backend
        # one K/V pair per layer, whatever groups the engine would share them in: every layer keeps
        # its whole row, and its own window (if any) is applied by the backend's score rules
        assert cache_dtype == model.dtype, cache_dtype  # the default KV dtype: pages of the model's dtype, no scales
        self.spec = KVCacheSpec.from_model_config(model.config, cache_dtype, block_size)
        self.chunk_tokens = max_num_batched_tokens
        # per layer K and V [slots, kv_heads, head_dim]; never cleared: a forward reads only the
        # slots it wrote (the kernels stop at each row's length)
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cache_blocks = 0  # blocks the scratch cache holds now

    @torch.no_grad()
    def hidden(self, batch: PackedBatch) -> torch.Tensor:
        """The decoder's last hidden states [T, hidden] over the batch. A batch of several rows holds at
        most `chunk_tokens` tokens; a single row may be longer (it runs in chunks)."""
        assert batch.num_rows == 1 or batch.num_tokens <= self.chunk_tokens, (batch.num_rows, batch.num_tokens)
        block_size = self.spec.block_size
        first_blocks, num_blocks = [], 0
        for length in batch.lengths:
            first_blocks.append(num_blocks)
            num_blocks += cdiv(length, block_size)
        self._reserve(num_blocks)
        tables = [list(range(first, first + cdiv(length, block_size)))
                  for first, length in zip(first_blocks, batch.lengths, strict=True)]
        # a token's slot: its row's first slot plus its position in the row (the row's blocks are consecutive)
        row_first_slot = torch.tensor(first_blocks, device=self.device) * block_size
        offsets = torch.arange(batch.num_tokens, device=self.device) - torch.repeat_interleave(
            torch.tensor(batch.cu_seqlens[:-1], device=self.device), torch.tensor(batch.lengths, device=self.device))
        slots = torch.repeat_interleave(row_first_slot, torch.tensor(batch.lengths, device=self.device)) + offsets
        if batch.num_rows > 1 or batch.num_tokens <= self.chunk_tokens:
            seqs = [PackedSeq(start, length, 0, table)
                    for start, length, table in zip(batch.cu_seqlens, batch.lengths, tables, strict=False)]
            return self._step(batch.input_ids, offsets, slots, seqs)
        chunks = []
        for start in range(0, batch.num_tokens, self.chunk_tokens):
            end = min(start + self.chunk_tokens, batch.num_tokens)
            seqs = [PackedSeq(0, end - start, start, tables[0])]
            chunks.append(self._step(batch.input_ids[start:end], offsets[start:end], slots[start:end], seqs))
        return torch.cat(chunks)

    def _step(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              seqs: list[PackedSeq]) -> torch.Tensor:
        meta = attention.AttentionMetadata(
            slot_mapping=slots, kv_caches=self._layers, block_size=self.spec.block_size, backend=self.backend,
            step=self.backend.build_metadata(seqs, self.spec.block_size, self.device))
        with forward_context(meta):
            out = self.decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    def _reserve(self, num_blocks: int) -> None:
        if self.cache_blocks >= num_blocks:
            return
        grown = max(num_blocks, int(self.cache_blocks * _GROWTH))
        self._layers = []  # the old pages go before the new ones are allocated
        shape = (grown * self.spec.block_size, self.spec.num_kv_heads, self.spec.head_dim)
        self._layers = [(torch.empty(shape, dtype=self.spec.dtype, device=self.device),
                         torch.empty(shape, dtype=self.spec.dtype, device=self.device))
                        for _ in range(self.spec.num_layers)]
        self.cache_blocks = grown
