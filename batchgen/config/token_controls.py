"""vLLM's token-level logits controls, read from a flag, a YAML key, a sampling cell or a Batch API body.

    logit_bias         {token id: bias}: the bias is added to that token's logit at every step,
                       before the penalties and temperature (OpenAI's range, [-100, 100]; -100
                       bans the token in practice, +100 all but forces it)
    allowed_token_ids  [token id, ...]: every other token's logit is -inf (empty = no limit)

A JSON object's keys are strings, so token ids are accepted as integers or as strings of digits,
as OpenAI's logit_bias is written. Ids beyond the model's vocabulary change nothing (the sampler
leaves them out), as a bias on a token that cannot be drawn would.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's limit; vLLM takes any float, but beyond this a bias cannot matter more


def _token_id(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def read_logit_bias(value: Any, error: Callable[[str], Exception], name: str = "logit_bias") -> dict[int, float]:
    """{token id: bias} from an object with id keys; `error` names the first bad entry."""
    if value is None:
        return {}
    if isinstance(value, list) and all(isinstance(kv, (tuple, list)) and len(kv) == 2 for kv in value):
        value = dict((k, v) for k, v in value)  # an Arrow map reads as (key, value) pairs
    if not isinstance(value, dict):
        raise error(f"{name} must be an object of token id -> bias, got {value!r}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = _token_id(key)
        if token is None:
            raise error(f"{name}: {key!r} is not a token id (an integer >= 0)")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or abs(bias) > MAX_ABS_LOGIT_BIAS:
            raise error(f"{name}: the bias of token {token} must be a number in [-100, 100], got {bias!r}")
        out[token] = float(bias)
    return dict(sorted(out.items()))


def read_token_ids(value: Any, error: Callable[[str], Exception], name: str = "allowed_token_ids") -> list[int]:
    """Sorted, de-duplicated token ids from a list of integers."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise error(f"{name} must be a list of token ids, got {value!r}")
    ids = [_token_id(v) if not isinstance(v, str) else None for v in value]
    if any(t is None for t in ids):
        raise error(f"{name} must be token ids (integers >= 0), got {list(value)!r}")
    return sorted(set(ids))


def as_params(logit_bias: dict[int, float], allowed_token_ids: list[int]) -> dict[str, tuple]:
    """The SamplingParams keywords (hashable tuples) for read values."""
    return {"logit_bias": tuple(sorted(logit_bias.items())), "allowed_token_ids": tuple(sorted(allowed_token_ids))}
