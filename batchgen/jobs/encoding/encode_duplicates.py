"""Duplicate inputs of an embed, score or classify job run once (--dedup).

An encoder input's result is decided by its token ids and its own settings (where a score row's
scored text begins, an embeddings request's dimensions): the model and every other setting are the
job's. So an input equal to one already handed to the encoder is not run again: while its leader
runs it waits on it, and once the leader finished it takes the result from a bounded cache (by the
token ids its keys stand for), so copies spread over many windows still run once. Each copy is
written under its own row id in the same commit path as any row (exactly-once stays a matter of
ids); a resume after a kill runs whichever copies were not committed, the first as a new leader.
As generation's --dedup (jobs/planning/duplicates.py), whose rules for sampled rows have no
counterpart here: an encoder input has no sampling.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import OrderedDict

from batchgen.engine.encode.encoder import EncodeRequest, EncodeResult

# results kept for copies that arrive after their leader finished, counted in the token ids of their inputs
MAX_CACHED_TOKENS = 1 << 22


def input_key(request: EncodeRequest) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((request.score_from, request.dimensions)).encode())
    h.update(b"\x00" + ",".join(map(str, request.prompt_token_ids)).encode())
    return h.digest()


class EncodeDuplicates:
    """Which running input each copy waits on, and the finished leaders' results."""

    def __init__(self, max_cached_tokens: int = MAX_CACHED_TOKENS):
        self.max_cached_tokens = max_cached_tokens
        self.leaders: dict[bytes, str] = {}  # key -> the running leader's request id
        self.keys: dict[str, bytes] = {}  # the running leader's request id -> its key
        self.copies: dict[str, list[str]] = {}  # leader request id -> the request ids of its copies
        self.finished: OrderedDict[bytes, tuple[EncodeResult, int]] = OrderedDict()  # (result, tokens), LRU first
        self.num_cached_tokens = 0
        self.num_inputs_served = 0

    def admit(self, request: EncodeRequest) -> EncodeResult | bool:
        """True when `request` runs (a leader); False when it is a copy of a running input (its result
        comes from `served`); the copy's result when its leader already finished."""
        key = input_key(request)
        cached = self.finished.get(key)
        if cached is not None:
            self.finished.move_to_end(key)
            self.num_inputs_served += 1
            return dataclasses.replace(cached[0], request_id=request.request_id)
        leader = self.leaders.get(key)
        if leader is not None:
            self.copies[leader].append(request.request_id)
            self.num_inputs_served += 1
            return False
        self.leaders[key] = request.request_id
        self.keys[request.request_id] = key
        self.copies[request.request_id] = []
        return True

    def served(self, result: EncodeResult) -> list[EncodeResult]:
        """The results of the copies waiting on the leader `result` finished; caches it for later copies."""
        key = self.keys.pop(result.request_id, None)
        if key is None:
            return []
        del self.leaders[key]
        copies = [dataclasses.replace(result, request_id=r) for r in self.copies.pop(result.request_id)]
        if result.num_prompt_tokens <= self.max_cached_tokens:
            self.finished[key] = (result, result.num_prompt_tokens)
            self.num_cached_tokens += result.num_prompt_tokens
            while self.num_cached_tokens > self.max_cached_tokens:
                _, (_, tokens) = self.finished.popitem(last=False)
                self.num_cached_tokens -= tokens
        return copies
