"""When a sequence stops, and what text it leaves: EOS ids, stop token ids, stop strings, token limits."""

from __future__ import annotations

from batchgen.engine.request import FinishReason
from batchgen.engine.sequence import Sequence


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, seq: Sequence) -> FinishReason | None:
        """Called after each sampled token."""
        params = seq.request.sampling
        last = seq.token_ids[-1]
        # before min_tokens nothing but the length ends a row (the sampler masks EOS until then)
        may_stop = seq.num_generated_tokens >= params.min_tokens
        if may_stop and not params.ignore_eos and last in self.eos_token_ids:
            return FinishReason.STOP
        if may_stop and last in params.stop_token_ids:  # vLLM: stop_token_ids end a row even with ignore_eos
            return FinishReason.STOP
        if may_stop and params.stop and self._stop_string_at_tail(seq) is not None:
            return FinishReason.STOP
        if seq.num_generated_tokens >= params.max_new_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _stop_string_at_tail(self, seq: Sequence) -> str | None:
        # Only the tail can hold a new match: decode a window wide enough for the longest stop
        # string (a token is at least one byte; a few extra cover partial UTF-8 sequences).
        stops = seq.request.sampling.stop
        window = max(len(s.encode("utf-8")) for s in stops) + 4
        tail_ids = seq.generated_token_ids[-window:]
        tail = self.tokenizer.decode(tail_ids, skip_special_tokens=seq.request.sampling.skip_special_tokens)
        return next((s for s in stops if s in tail), None)

    def finalize(self, seq: Sequence) -> tuple[list[int], str]:
        """The generated token ids and text to report. The text is cut before a stop string and
        leaves out a final stop token id's text, unless include_stop_str_in_output (vLLM's rules)."""
        params = seq.request.sampling
        token_ids = seq.generated_token_ids
        skip = params.skip_special_tokens
        ended_by_stop_id = bool(token_ids) and token_ids[-1] in params.stop_token_ids  # masked before min_tokens
        text_ids = token_ids[:-1] if ended_by_stop_id and not params.include_stop_str_in_output else token_ids
        text = self.tokenizer.decode(text_ids, skip_special_tokens=skip)
        stops = params.stop
        if stops and not ended_by_stop_id:
            # a stop string counts only where it ends after the first min_tokens tokens
            min_tokens = params.min_tokens
            start = len(self.tokenizer.decode(token_ids[:min_tokens], skip_special_tokens=skip)) if min_tokens else 0
            found = [(i, s) for i, s in ((text.find(s, max(0, start - len(s) + 1)), s) for s in stops) if i >= 0]
            if found:
                cut, stop = min(found)
                text = text[:cut + len(stop)] if params.include_stop_str_in_output else text[:cut]
        return token_ids, text
