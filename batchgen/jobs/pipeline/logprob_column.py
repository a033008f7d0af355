"""The `logprobs` output column of a --logprobs job: a Completion's TokenLogprobs as Arrow-ready cells.

Each token appears as its text (the tokenizer's decoding of that one id, special tokens kept, as
OpenAI's `token` is), its id and its logprob; the decodings are cached per id, since a job's tokens
repeat. The shape is batchgen.io.store.schema.LOGPROBS_FIELD.
"""

from __future__ import annotations

from typing import Any

from batchgen.engine.request import Completion


class LogprobColumn:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def cell(self, completion: Completion) -> list[dict[str, Any]] | None:
        if completion.logprobs is None:  # a Batch API request that did not ask
            return None
        return [{"token": self.token_text(e.token_id), "token_id": e.token_id, "logprob": e.logprob,
                 "top_logprobs": [{"token": self.token_text(t), "token_id": t, "logprob": v} for t, v in e.top]}
                for e in completion.logprobs]
