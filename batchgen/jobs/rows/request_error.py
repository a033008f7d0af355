"""The error of one Batch API request: an error row whose message carries the API's error code."""

from __future__ import annotations

from batchgen.io.inputs.openai_batch import api_error
from batchgen.jobs.prompting.prompts import RowError


class RequestError(RowError):
    """A request the API would answer with an error: the row's message is "<code>: <text>"."""

    def __init__(self, code: str, message: str, *, param: str | None = None):
        super().__init__(api_error(code, message, param), column="body")
