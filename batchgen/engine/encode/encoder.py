"""The encode engine: token-id requests in, embeddings / scores / classes out.

No KV cache and no decode loop: each request is one forward pass of a known length. The Encoder
pulls requests in windows, sorts each window by length into token-budget batches (batching.py), runs
each batch packed (varlen.py: no padding through the linears) and applies the task's head: pooling
(pooling.py), the LM head's log-probabilities (score.py) or the classifier's (classify.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from batchgen.config.choices import Task
from batchgen.engine.encode import classify, score
from batchgen.engine.encode.batching import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU,
    DEFAULT_MAX_NUM_BATCHED_TOKENS_CUDA,
    WINDOW_BUDGETS,
    engine_prefill,
    plan_batches,
)
from batchgen.engine.encode.heads import decoder_of
from batchgen.engine.encode.load import EncodeModel
from batchgen.engine.encode.packing import PackedBatch, pack, position_rule
from batchgen.engine.encode.pooling import finish, pool
from batchgen.engine.encode.prefill import PrefillForward
from batchgen.engine.encode.varlen import packed_forward
from batchgen.errors import ConfigError, UnsupportedModelError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EncodeRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    score_from: int | None = None  # score: index of the first token whose logprob counts; None = 1
    dimensions: int | None = None  # embed: this row's own Matryoshka cut; None = the job's


@dataclass(slots=True)
class EncodeResult:
    request_id: str
    num_prompt_tokens: int
    embedding: np.ndarray | None = None  # embed: float32 [dim], pooled, cut and normalized as configured
    logprob: float | None = None  # score: sum of the scored tokens' log-probabilities (float64 accumulation)
    num_scored_tokens: int | None = None
    scores: np.ndarray | None = None  # classify: float32 [num_labels] (softmax, or raw for regression / one output)
    label: str | None = None  # classify: id2label of the argmax (None for a regression head)


class Encoder:
    """Token-id requests in, results out: length-sorted token-budget batches, packed (no padding) forwards."""

    def __init__(self, model: EncodeModel, *, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int | None = None):
        self.model = model
        if max_num_batched_tokens is None:
            max_num_batched_tokens = (DEFAULT_MAX_NUM_BATCHED_TOKENS_CUDA if model.device.type == "cuda"
                                      else DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # what a job reports: tokens through the linears (packed: the tokens needed) against the tokens
        # the rows have; the attention layout's tokens (rows x longest where SDPA runs it padded)
        self.num_forward_tokens = 0
        self.num_needed_tokens = 0
        self.num_attention_tokens = 0
        self.num_batches = 0
        self.num_rows = 0
        self.forward_seconds = 0.0
        self._module, self._causal = self._forward_module()
        self._rule = position_rule(self._module)
        # score on the CPU: the decoder on the engine's prefill kernels (prefill.py); None: varlen.py
        self._prefill = self._prefill_forward()

    @property
    def padding_waste(self) -> float:
        """Tokens run / tokens needed (1.0: no padding)."""
        return self.num_forward_tokens / self.num_needed_tokens if self.num_needed_tokens else 1.0

    def run(self, requests: Iterable[EncodeRequest]) -> Iterator[EncodeResult]:
        """Results of `requests`, pulled lazily a window at a time; within a window, in any order."""
        window_tokens = WINDOW_BUDGETS * self.max_num_batched_tokens
        iterator = iter(requests)
        while True:
            window: list[EncodeRequest] = []
            tokens = 0
            for request in iterator:
                window.append(request)
                tokens += len(request.prompt_token_ids)
                if tokens >= window_tokens:
                    break
            if not window:
                return
            yield from self._run_window(window)

    def _run_window(self, window: Sequence[EncodeRequest]) -> Iterator[EncodeResult]:
        limit = self.model.max_input_tokens
        for request in window:
            assert 1 <= len(request.prompt_token_ids) <= limit, (
                f"request {request.request_id}: {len(request.prompt_token_ids)} tokens; an encode request "
                f"has 1 to max_input_tokens ({limit}): the caller cuts or refuses longer ones")
        lengths = [len(r.prompt_token_ids) for r in window]
        for indices in plan_batches(lengths, max_num_batched_tokens=self.max_num_batched_tokens,
                                    max_num_seqs=self.max_num_seqs, padded_attention=self._prefill is None):
            yield from self._run_batch([window[i] for i in indices])

    @torch.no_grad()
    def _run_batch(self, requests: list[EncodeRequest]) -> list[EncodeResult]:
        started = time.perf_counter()
        rows = [r.prompt_token_ids for r in requests]
        batch = pack(rows, rule=self._rule, device=self.model.device)
        task = self.model.task
        if task is Task.EMBED:
            results = self._embed(requests, batch)
        elif task is Task.SCORE:
            results = self._score(requests, batch)
        else:
            assert task is Task.CLASSIFY, task
            results = self._classify(requests, batch)
        self.forward_seconds += time.perf_counter() - started
        self.num_batches += 1
        self.num_rows += len(requests)
        self.num_needed_tokens += batch.num_tokens
        padded = batch.num_rows * batch.max_len
        unpadded = self.model.device.type == "cuda" or self._prefill is not None
        self.num_attention_tokens += batch.num_tokens if unpadded else padded
        if task is Task.CLASSIFY and classify.head_kind(self.model.model) is classify.HeadKind.PADDED:
            self.num_forward_tokens += padded  # the model's own padded forward
        else:
            self.num_forward_tokens += batch.num_tokens
        return results

    def _forward_module(self) -> tuple[torch.nn.Module, bool]:
        """The module run packed and whether it attends causally."""
        model = self.model
        if model.task is Task.EMBED:
            return model.model, model.causal
        if model.task is Task.SCORE:
            return decoder_of(model.model), True
        return model.model.base_model, classify.is_causal(model.model)

    def _prefill_forward(self) -> PrefillForward | None:
        model = self.model
        if not engine_prefill(model.task, model.device.type):
            return None
        try:
            return PrefillForward(model.model, max_num_batched_tokens=self.max_num_batched_tokens)
        except (UnsupportedModelError, ConfigError) as e:
            log.debug("score: the packed SDPA forward, not the engine's prefill kernels (%s)", e)
            return None

    def _embed(self, requests: list[EncodeRequest], batch: PackedBatch) -> list[EncodeResult]:
        hidden = packed_forward(self._module, batch, causal=self._causal)
        vectors = finish(pool(hidden, batch, self.model.pooling), normalize=self.model.normalize,
                         dimensions=[r.dimensions or self.model.dimensions for r in requests])
        return [EncodeResult(r.request_id, length, embedding=v)
                for r, length, v in zip(requests, batch.lengths, vectors, strict=True)]

    def _score(self, requests: list[EncodeRequest], batch: PackedBatch) -> list[EncodeResult]:
        if self._prefill is not None:
            hidden = self._prefill.hidden(batch)
        else:
            hidden = packed_forward(self._module, batch, causal=True)
        sums = score.score_hidden(self.model.model.get_output_embeddings(), self.model.logit_rule, hidden,
                                  batch.input_ids, batch.cu_seqlens, [r.score_from for r in requests])
        return [EncodeResult(r.request_id, length, logprob=logprob, num_scored_tokens=count)
                for r, length, (logprob, count) in zip(requests, batch.lengths, sums, strict=True)]

    def _classify(self, requests: list[EncodeRequest], batch: PackedBatch) -> list[EncodeResult]:
        model = self.model.model
        if classify.head_kind(model) is classify.HeadKind.PADDED:
            logits = classify.padded_logits(model, [r.prompt_token_ids for r in requests])
        else:
            hidden = packed_forward(self._module, batch, causal=self._causal)
            logits = classify.classify_hidden(model, hidden, batch.input_ids, batch.cu_seqlens)
        pairs = classify.scores_and_labels(logits, self.model.problem_type, self.model.id2label or {})
        return [EncodeResult(r.request_id, length, scores=scores, label=label)
                for r, length, (scores, label) in zip(requests, batch.lengths, pairs, strict=True)]


def encode_all(encoder: Encoder, requests: Iterable[EncodeRequest]) -> list[EncodeResult]:
    """The results in the requests' order (for callers that want them so: tests, a benchmark)."""
    requests, ordered = itertools.tee(requests)
    by_id = {result.request_id: result for result in encoder.run(requests)}
    return [by_id[r.request_id] for r in ordered]
