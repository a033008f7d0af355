"""LLMEngine: requests in, completions out, one scheduled forward step at a time.

    while engine.has_unfinished():
        out = scheduler.schedule()           # which sequences, how many tokens each
        token_ids = runner.run(out)          # one packed forward + sampling
        scheduler.update(out, token_ids)     # advance, then stop checks free finished ones

The static and the continuous policy share everything but the scheduler's admission rule.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from batchgen.config.choices import Policy
from batchgen.engine.admission import check_request
from batchgen.engine.attention import paged as attention
from batchgen.engine.attention.registry import make_backend
from batchgen.engine.engine_config import EngineConfig, resolve_attention
from batchgen.engine.kernels import fused
from batchgen.engine.kv.cache import KVCache, KVCacheSpec
from batchgen.engine.kv.hybrid import make_block_manager
from batchgen.engine.lora import load as lora
from batchgen.engine.memory import plan_kv_blocks
from batchgen.engine.metrics import EngineMetrics, StepStats
from batchgen.engine.model import experts, families, head_rows, prepack
from batchgen.engine.model.loader import find_eos_token_ids
from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.request import Completion, Continuation, FinishReason, Request
from batchgen.engine.sampling import jump_forward
from batchgen.engine.sampling.grammar import GrammarMasks, mask_threads
from batchgen.engine.sampling.stopping import StopChecker
from batchgen.engine.scheduler import samples, sizing
from batchgen.engine.scheduler.scheduler import Scheduler
from batchgen.engine.sequence import Sequence, SequenceStatus
from batchgen.errors import EngineError
from batchgen.runtime import omp
from batchgen.runtime.threads import ThreadGovernor

log = logging.getLogger(__name__)


# a step that runs out of device memory is retried after freeing some: the KV cache loses this
# share of its blocks and the batch limits halve, at most this many times in a row
OOM_CACHE_SHRINK = 0.9
MAX_OOM_RETRIES = 4


class LLMEngine:
    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None, *,
                 eos_token_ids: list[int] | None = None):
        self.config = config = config or EngineConfig()
        families.check_model(model)
        attention.register()
        model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        # before the KV cache is sized from what memory is left; not under torch.compile: inductor
        # cannot lower the reordered (mkldnn-layout) weights (measured: a LoweringException)
        if config.prepack_weights and not config.compile:
            prepack.pack_linear_layers(model)
            experts.group_experts(model)  # MoE experts: one grouped pass on weights reordered the same way
        if config.fuse_pointwise and not config.compile:  # inductor fuses these itself
            fused.fuse_pointwise(model)
        if not config.compile:  # a compiled forward would guard on the head's row count
            head_rows.install(model)
        # after prepack and fusing (wrapping each projection's forward as it is now), before KV sizing
        self.lora_adapters = lora.load(model, config)
        text_config = getattr(model.config, "text_config", None) or model.config
        self.max_model_len = config.max_model_len or text_config.max_position_embeddings
        if eos_token_ids is None:
            eos_token_ids = find_eos_token_ids(model, tokenizer)
        backend, block_size, cache_dtype, reason = resolve_attention(config, self.device, model.dtype,
                                                                     families.score_rules_used(model))
        log.debug("attention: %s, %d-token KV blocks (%s); model: %s", backend, block_size, reason,
                  families.describe(model.config))
        self.block_size = block_size
        self.backend = make_backend(backend)
        # blocks leave the pool's hold once out of the window: one block table where every layer has
        # the same window, one per layer group where full-attention and sliding layers mix (kv/groups.py)
        self.kv_window = families.kv_window(model)
        self.kv_groups = families.kv_groups(model)
        self.use_cuda_graphs = self._graphs_possible(config)
        spec = self.spec = KVCacheSpec.from_model_config(model.config, cache_dtype, block_size)
        if self.kv_window is not None:
            log.debug("KV: every layer attends a %d-token window; blocks that leave it return to the pool",
                      self.kv_window)
        if self.kv_groups is not None:
            log.debug("KV: %d layer groups of %d layers, windows %s, one block pool; a sliding group's blocks return "
                      "to it once out of its window", self.kv_groups.num_groups, self.kv_groups.num_tensors,
                      ["all" if w is None else w for w in self.kv_groups.group_windows])
            spec = self.spec = dataclasses.replace(spec, num_layers=self.kv_groups.num_tensors)
        num_blocks, self.max_tokens_per_seq = plan_kv_blocks(
            model, spec, self.device, config, max_model_len=self.max_model_len, use_cuda_graphs=self.use_cuda_graphs,
            kv_groups=self.kv_groups, adapter_bytes=sum(a.device_bytes for a in self.lora_adapters.values()))
        if num_blocks < 2:
            self.use_cuda_graphs = False  # no block to spare for the padding rows
        self.runner = ModelRunner(model, None, self.device, self.backend, compile=config.compile,
                                  eos_token_ids=eos_token_ids, kv_window=self.kv_window, kv_groups=self.kv_groups)
        self._allocate_cache(num_blocks)
        self.limits = sizing.resolve_limits(
            device_type=self.device.type, kv_capacity_tokens=self.kv_capacity_tokens,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            expected_seq_tokens=config.expected_seq_tokens, max_model_len=self.max_model_len)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=self.limits.max_num_seqs,
                                   max_num_batched_tokens=self.limits.max_num_batched_tokens,
                                   max_model_len=self.max_model_len, policy=config.policy)
        log.info("engine: %s policy, %s attention, %d KV blocks of %d tokens; %s%s", Policy(config.policy).value,
                 backend, num_blocks, block_size, self.limits.reason, "; compiled forward" if config.compile else "")
        self._capture_graphs()
        self.stop_checker = StopChecker(tokenizer, eos_token_ids, self.max_model_len)
        self.grammar = self.runner.sampler.grammar = GrammarMasks(
            tokenizer, vocab_size=model.get_output_embeddings().weight.shape[0], num_threads=mask_threads(self.device))
        self.grammar.jump_forward, self.grammar.max_model_len = config.jump_forward, self.max_model_len
        self.metrics = EngineMetrics()
        self.threads = ThreadGovernor.for_device(self.device) if config.adaptive_threads else None
        if self.device.type == "cpu" and omp.choice_reason is not None:
            log.debug("CPU: %d compute threads, OpenMP %s", torch.get_num_threads(), omp.choice_reason)
        self._seq_ids = itertools.count()
        self._finished_on_admission: list[Completion] = []  # continued rows whose tokens already end them
        self._prompt_leaders: dict[str, Sequence] = {}  # request id -> its first sequence still here
        self._max_num_seqs_cap: int | None = None  # set after an OOM: auto batch sizes stay below it

    # ---- device memory: the cache, the graphs, recovery from OOM ------------------------------------
    def _graphs_possible(self, config: EngineConfig) -> bool:
        if not config.cuda_graphs or self.device.type != "cuda" or self.lora_adapters:  # engine/lora/load.py: why
            return False
        if not getattr(self.backend, "supports_cuda_graphs", False):
            log.debug("CUDA graphs: off, the %s attention backend has no graph-safe decode (flash-attn has)",
                      self.backend.name)
            return False
        return True

    def _allocate_cache(self, num_blocks: int) -> None:
        """The KV cache and its block pool. With CUDA graphs the last block is kept out of the pool:
        the graphs' padding rows write their K/V there."""
        self.runner.allocate_cache(self.spec, num_blocks)
        usable = num_blocks - 1 if self.use_cuda_graphs else num_blocks
        self.block_manager = make_block_manager(usable, self.block_size, self.config.enable_prefix_caching,
                                                self.kv_window, self.kv_groups)

    @property
    def kv_cache(self) -> KVCache:
        return self.runner.kv_cache

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds, as a row's token count: with layer groups, a token takes a slot
        in each (exact for rows within the windows, a lower bound for longer ones)."""
        num_groups = 1 if self.kv_groups is None else self.kv_groups.num_groups
        return self.block_manager.num_blocks * self.block_size // num_groups

    def _capture_graphs(self) -> None:
        if self.use_cuda_graphs:
            self.runner.capture_graphs(max_num_seqs=self.limits.max_num_seqs,
                                       max_blocks_per_seq=-(-self.max_tokens_per_seq // self.block_size))

    def _recover_from_oom(self, error: BaseException) -> None:
        """Free device memory and let the step run again: every running row goes back to the queue
        (its tokens kept, its K/V recomputed), the KV cache shrinks and the batch limits halve."""
        num_running = self.scheduler.preempt_all()
        old_blocks = self.kv_cache.num_blocks
        new_blocks = max(2, int(old_blocks * OOM_CACHE_SHRINK))
        max_seqs = max(1, min(self.limits.max_num_seqs, max(1, num_running)) // 2)
        budget = max(max_seqs, self.limits.max_num_batched_tokens // 2)
        log.warning("out of device memory during a step (%s): %d running rows requeued; KV cache %d -> %d blocks, "
                    "batch size %d -> %d, step budget %d -> %d tokens; retrying", str(error).splitlines()[0][:200],
                    num_running, old_blocks, new_blocks, self.limits.max_num_seqs, max_seqs,
                    self.limits.max_num_batched_tokens, budget)
        self.limits = dataclasses.replace(self.limits, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                          reason=f"{self.limits.reason}; halved after a device OOM")
        self.scheduler.max_num_seqs, self.scheduler.max_num_batched_tokens = max_seqs, budget
        self._max_num_seqs_cap = max_seqs
        self._allocate_cache(new_blocks)
        self.scheduler.set_block_manager(self.block_manager)
        try:
            self._capture_graphs()
        except torch.cuda.OutOfMemoryError:  # the runner keeps no graphs of a capture that failed
            log.warning("CUDA graphs: off, capturing them again ran out of memory")
        self.metrics.num_oom_retries += 1

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.sampling.n > 1 and request.sample_index is None:
            # one sequence per sample: each is scheduled, preempted, continued and finished on its own,
            # and they share the prompt's K/V (scheduler/samples.py)
            for sample_index in range(request.sampling.n):
                self.add_request(dataclasses.replace(request, sample_index=sample_index))
            return
        check_request(request, self.max_tokens_per_seq, self.grammar, self.lora_adapters)
        seq = Sequence.from_request(next(self._seq_ids), request)
        self.metrics.num_prompt_tokens += len(request.prompt_token_ids)
        self.runner.add(seq)  # before the checks below: a continued row's grammar replays its tokens
        if seq.num_generated_tokens:
            # a continued row whose earlier tokens already end it (a stop was sampled in the very
            # step the earlier attempt was stopped after): finish it as that attempt would have
            reason = self._stop_reason(seq)
            if reason is not None:
                self._finished_on_admission.append(self._finish(seq, reason))
                return
        # the first sample of a request still here leads: the others take its prompt blocks; a first
        # sample takes its prefix leader's blocks of their common prefix (scheduler/samples.py)
        leader = self._prompt_leaders.get(request.request_id) if request.sampling.n > 1 else None
        if leader is None or leader.status is SequenceStatus.FINISHED:
            self._prompt_leaders[request.request_id] = seq
            if request.prefix_leader_id is not None and self.block_manager.forks_samples:
                samples.follow_prefix(seq, self._prompt_leaders.get(request.prefix_leader_id), self.block_size)
        else:
            seq.prompt_leader = leader
        self.scheduler.add(seq)

    def in_flight(self) -> list[tuple[Request, Continuation]]:
        """Every unfinished row that has generated tokens, with its generation so far: what a
        checkpoint keeps. Consistent only between steps (a step appends tokens and draws random
        numbers), which is where the job calls it."""
        seqs = [*self.scheduler.running, *self.scheduler.waiting]
        # tokens are all a row's state: its random stream is keyed by its output index
        # (engine/sampling/random_stream.py), and a failed step appended no token to any row; a row
        # with logprobs is left out (its logprobs so far are not kept), so it starts over
        return [(seq.request, Continuation(tuple(seq.confirmed_output_ids))) for seq in seqs
                if seq.confirmed_output_ids and seq.request.sampling.logprobs is None]

    def fit_batch_size(self, max_num_seqs: int) -> None:
        """Take the job planner's batch size for the rows to come, when the user left it to auto.

        Only while idle, so no running sequence is ever over the limit; a set --batch-size wins.
        """
        if self.config.max_num_seqs is not None or max_num_seqs < 1 or self.scheduler.has_unfinished():
            return
        if self._max_num_seqs_cap is not None:
            max_num_seqs = min(max_num_seqs, self._max_num_seqs_cap)
        budget = max(self.limits.max_num_batched_tokens, max_num_seqs)
        if (max_num_seqs, budget) != (self.limits.max_num_seqs, self.limits.max_num_batched_tokens):
            log.debug("engine: batch size %d for the rows to come (was %d)", max_num_seqs, self.limits.max_num_seqs)
        self.limits = dataclasses.replace(self.limits, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
        self.scheduler.max_num_seqs = max_num_seqs
        self.scheduler.max_num_batched_tokens = budget

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(self, requests: Iterable[Request], *,
                 between_steps: Callable[[], None] | None = None) -> Iterator[Completion]:
        """Run requests to completion, pulling them lazily; yields in finishing order.

        `between_steps` is called after each step, once its finished rows were handed out: the
        one point where every row's state is whole (a job stops or checkpoints there)."""
        source = iter(requests)
        lookahead = 2 * self.limits.max_num_seqs  # enough waiting rows to refill the batch
        exhausted = False
        while True:
            while not exhausted and self.scheduler.num_waiting < lookahead:
                request = next(source, None)
                if request is None:
                    exhausted = True
                else:
                    self.add_request(request)
            if self._finished_on_admission:
                done, self._finished_on_admission = self._finished_on_admission, []
                yield from done
            if not self.has_unfinished():
                return
            yield from self.step()
            if between_steps is not None:
                between_steps()

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[Completion]:
        if self.threads is not None:
            self.threads.tick()
        t0 = time.perf_counter()
        finished: list[Completion] = []
        for attempt in itertools.count():
            out = self.scheduler.schedule()
            for seq in out.out_of_memory:
                log.warning("request %s stopped early: the KV cache cannot hold it", seq.request.request_id)
                finished.append(self._finish(seq, FinishReason.LENGTH))
            if not out.scheduled:
                break
            try:
                token_ids = self.runner.run(out)
                break
            except torch.cuda.OutOfMemoryError as e:
                if attempt >= MAX_OOM_RETRIES:
                    raise EngineError(f"out of device memory {attempt + 1} times in a row, even after shrinking "
                                      "the KV cache and the batch; set a smaller --kv-cache-memory") from e
                self._recover_from_oom(e)
        samplers: list[Sequence] = []
        num_new_tokens = 0
        num_prompt_tokens = sum(max(0, min(s.seq.num_prompt_tokens, s.seq.num_computed_tokens + s.num_new_tokens)
                                    - s.seq.num_computed_tokens) for s in out.scheduled)  # before update moves them
        if out.scheduled:
            verdicts, drafts = self.runner.verdicts, self.runner.drafts
            samplers = self.scheduler.update(out, token_ids, verdicts, drafts)
            num_new_tokens = jump_forward.count_step(self.metrics, samplers, verdicts)
            for seq in samplers:
                reason = self._stop_reason(seq)
                if reason is not None:
                    finished.append(self._finish(seq, reason))
        elif not finished:
            raise EngineError("scheduler made no progress: nothing scheduled while requests wait")
        bm = self.block_manager
        num_prefix_hit_tokens = bm.num_prefix_hit_tokens - self.metrics.num_prefix_hit_tokens  # this step's
        self.metrics.num_prefix_hit_tokens = bm.num_prefix_hit_tokens
        self.metrics.record(StepStats(
            step_seconds=time.perf_counter() - t0, num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting, num_batched_tokens=out.num_batched_tokens,
            num_sampled_tokens=num_new_tokens, num_kv_blocks_used=bm.num_used_blocks,
            num_kv_blocks_free=bm.num_free_blocks, num_preempted=out.num_preempted,
            num_overruns=out.num_overruns, num_prefix_hit_tokens=num_prefix_hit_tokens,
            forward_seconds=self.runner.last_forward_s if out.scheduled else 0.0, num_prompt_tokens=num_prompt_tokens))
        return finished

    def _stop_reason(self, seq: Sequence) -> FinishReason | None:
        # a finished grammar is a stop even on the max_new_tokens-th token: its text is whole
        if self.grammar and self.grammar.stopped(seq):
            return FinishReason.STOP
        return self.stop_checker.check(seq)

    def _finish(self, seq: Sequence, reason: FinishReason) -> Completion:
        seq.drop_drafts()  # unconfirmed forced tokens are not the row's
        self.scheduler.finish(seq, reason)
        self.runner.release(seq)
        if self._prompt_leaders.get(seq.request.request_id) is seq:
            del self._prompt_leaders[seq.request.request_id]
        token_ids, text = self.stop_checker.finalize(seq)
        self.metrics.num_generated_tokens += len(token_ids)
        self.metrics.num_requests_finished += 1
        logprobs = seq.logprobs[:len(token_ids)] if seq.request.sampling.logprobs is not None else None
        return Completion(request_id=seq.request.request_id, token_ids=token_ids, text=text,
                          finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens,
                          num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
                          num_preemptions=seq.num_preemptions, logprobs=logprobs, sample_index=seq.sample_index)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

