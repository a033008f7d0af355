"""What goes into the engine and what comes out: plain data, no torch.

The engine contract, shared by the static and the continuous policy:

    engine.generate(requests: Iterable[Request]) -> Iterator[Completion]

`generate` pulls requests lazily (only as many as it can admit soon), so a caller may pass a
generator over millions of rows with bounded memory. Completions come out in finishing order, not
input order: the caller joins them back by `request_id`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from batchgen.config.choices import MAX_LOGPROBS
from batchgen.config.constraint import Constraint


class FinishReason(str, Enum):
    STOP = "stop"  # an EOS token, a stop token id, a stop string or a finished constraint grammar
    LENGTH = "length"  # max_new_tokens reached (or the context length)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1.0 = off
    top_k: int | None = None  # None = off
    seed: int | None = None  # per-request seed (None: one from the request id); a row's text never depends on its batch
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before the match
    ignore_eos: bool = False  # keep generating through EOS (benchmarks)
    # vLLM's SamplingParams controls; the definitions are in engine/sampling/sampler.py. Defaults are off.
    repetition_penalty: float = 1.0  # tokens in the prompt or output: logit / x if > 0, else logit * x
    presence_penalty: float = 0.0  # minus x for every token the output already holds
    frequency_penalty: float = 0.0  # minus x times the count of every token the output already holds
    min_tokens: int = 0  # EOS is masked and stop strings ignored until this many tokens are generated
    min_p: float = 0.0  # sampled rows: drop tokens less likely than min_p x the likeliest one's probability
    stop_token_ids: tuple[int, ...] = ()  # ids that end a row like EOS (masked before min_tokens too)
    include_stop_str_in_output: bool = False  # keep the matched stop string (or stop token's text) in the text
    skip_special_tokens: bool = True  # the text leaves special tokens out (stop strings match that text)
    # None = off; K: each generated token's logprob and the K likeliest alternatives (engine/sampling/logprobs.py)
    logprobs: int | None = None
    # vLLM's token controls (batchgen/config/token_controls.py): ((token id, bias), ...) added to the
    # logits; allowed ids, every other token masked (empty = no limit)
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    # structured output: the text must match this (engine/sampling/grammar.py masks the logits); None = free
    constraint: Constraint | None = None
    # samples per request (vLLM's `n`): n sequences share the prompt's K/V and draw from n streams
    # (sample i's seed: engine/sampling/sampler.py, sample_seed); greedy ones are n equal texts, as vLLM's
    n: int = 1

    def __post_init__(self):
        assert self.n >= 1, self.n
        assert self.max_new_tokens >= 1, self.max_new_tokens
        assert self.temperature >= 0.0, self.temperature
        assert 0.0 < self.top_p <= 1.0, self.top_p
        assert self.top_k is None or self.top_k >= 1, self.top_k
        assert self.repetition_penalty > 0.0, self.repetition_penalty
        assert 0 <= self.min_tokens, self.min_tokens
        assert 0.0 <= self.min_p <= 1.0, self.min_p
        assert self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, self.logprobs

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_logits_controls(self) -> bool:
        """Any control that changes the logits before sampling (the sampler tracks these rows)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.min_tokens > 0  # min_tokens masks EOS and stop_token_ids (engine/sampling/penalties.py)
                or bool(self.logit_bias) or bool(self.allowed_token_ids))


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability under the distribution it was drawn from (the logits
    after penalties, temperature and truncation), and the likeliest tokens of that distribution."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), likeliest first; only tokens that could be drawn


@dataclass(frozen=True, slots=True)
class Continuation:
    """A row's generation so far, from an earlier attempt that was stopped: the engine continues it
    (prefill of prompt + these tokens, then sampling from where it left off) instead of starting over."""

    token_ids: tuple[int, ...]  # generated so far (at least one)
    # unused: the random stream is keyed by the row's seed and output index, so the tokens are the
    # whole state (engine/sampling/random_stream.py); kept so partials written by earlier versions,
    # which stored a torch.Generator state here, still load
    rng_state: bytes | None = None

    def __post_init__(self):
        assert self.token_ids, "a continuation holds at least one generated token"


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # a length planner's guess at the output length: the static policy reserves KV memory for
    # prompt + this instead of prompt + max_new_tokens; a row that runs past it is parked and
    # finished in a later batch, never cut short. None = reserve for max_new_tokens.
    predicted_num_output_tokens: int | None = None
    # what an earlier, stopped attempt generated: counted in max_new_tokens, stop checks and the
    # completion, exactly as if this attempt had generated it
    continuation: Continuation | None = None
    # with sampling.n > 1: None = every sample 0..n-1 (the engine makes one sequence each); k = sample
    # k alone (a continued sample, or one a resumed job still lacks), whose draws are those it has
    # within the whole request
    sample_index: int | None = None
    # an earlier request (still in the engine) whose prompt starts as this one's does: this one starts
    # from its blocks of the shared prefix, waiting while it computes them (scheduler/samples.py)
    prefix_leader_id: str | None = None
    # the name of a LoRA adapter the engine loaded (EngineConfig.lora_adapters); None = the base model
    adapter: str | None = None

    def __post_init__(self):
        assert self.sample_index is None or 0 <= self.sample_index < self.sampling.n, self.sample_index
        assert self.continuation is None or self.sample_index is not None or self.sampling.n == 1, (
            "a continuation is one sample's: give its sample_index")


@dataclass(slots=True)
class Completion:
    request_id: str
    # every sampled token, a final EOS included (it cost a step), so len() counts real work;
    # with a stop string the tokens after the match are dropped
    token_ids: list[int]
    text: str  # decoded (without special tokens unless asked), cut before a stop string unless asked
    finish_reason: FinishReason
    num_prompt_tokens: int
    # how many prompt tokens came from the prefix cache instead of being computed
    num_cached_prompt_tokens: int = 0
    # how many times the request was preempted and recomputed
    num_preemptions: int = 0
    # one per token of token_ids when the request asked for logprobs, else None
    logprobs: list[TokenLogprob] | None = None
    # which of the request's sampling.n samples this is (0 when n == 1)
    sample_index: int = 0

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)
