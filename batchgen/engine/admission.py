"""What a request must be for the engine to take it: checked before it becomes a sequence, so a
request that can never run is refused with the reason, and the rows beside it go on."""

from __future__ import annotations

from collections.abc import Collection

from batchgen.config.constraint import InvalidConstraint
from batchgen.engine.request import Request
from batchgen.engine.sampling.grammar import GrammarMasks
from batchgen.errors import UsageError


class RequestRejected(UsageError, ValueError):
    """This one request cannot run (too long for the context or the KV cache); others can. A user's
    input, not an engine fault: the job loop must not rerun it in static mode."""


def check_request(request: Request, max_tokens_per_seq: int, grammar: GrammarMasks,
                  adapters: Collection[str] = ()) -> None:
    """Raises RequestRejected for a request the engine cannot run; compiles its constraint (cached,
    so rows sharing one compile it once)."""
    if request.adapter is not None and request.adapter not in adapters:
        loaded = ", ".join(sorted(adapters)) or "none"
        raise RequestRejected(f"unknown LoRA adapter {request.adapter!r} (loaded: {loaded})")
    num_prompt = len(request.prompt_token_ids)
    if num_prompt == 0:
        raise RequestRejected("empty prompt")
    if num_prompt >= max_tokens_per_seq:
        raise RequestRejected(
            f"prompt of {num_prompt} tokens leaves no room to generate (limit {max_tokens_per_seq} "
            "tokens: the model's context or the KV cache)")
    if request.continuation is not None and request.sampling.logprobs is not None:
        # the earlier attempt's logprobs are not part of a continuation (in_flight leaves such rows out)
        raise RequestRejected("a continued request cannot return logprobs; start it over")
    if request.sampling.constraint is not None:
        try:
            grammar.compiled(request.sampling.constraint)
        except InvalidConstraint as e:
            raise RequestRejected(f"invalid {request.sampling.constraint.kind.value} constraint: {e}") from None
