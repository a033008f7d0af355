"""A row's prompt hash: what a resume under --id-column compares to tell a changed prompt.

Beside the planned row that computes it, below every floor that compares it: the resume rule
(batchgen.jobs.durability.resume), in-flight checkpoints and the output writers.
"""

from __future__ import annotations

import hashlib
import sys
from array import array


def prompt_hash(token_ids: list[int], settings: str | None = None) -> str:
    """The documented `prompt_hash` output column: blake2b-64 (16 hex digits) of the prompt's
    token ids as little-endian uint32, then of the row's own generation `settings` where it has
    them (an OpenAI Batch request's max_tokens, sampling, seed, stop: its "prompt" is the request;
    a row's --max-new-tokens-column and --sampling-column values that differ from the job's)."""
    packed = array("I", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    h = hashlib.blake2b(packed.tobytes(), digest_size=8)
    if settings is not None:
        h.update(b"\x00" + settings.encode())
    return h.hexdigest()
