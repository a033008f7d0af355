"""The job core of embed, score and classify jobs: planned windows in, finished rows out.

The same seam as JobCore (batchgen.jobs.pipeline.core) for the tasks that run one forward pass per
input and no decode loop:

    core = EncodeCore(config, model)
    for planned, results in core.generate(windows):   # windows of PlannedRows, pulled lazily
        ...                                            # write, commit, count

Each window's rows go to the encoder longest first, so the encoder's token-budget batches are cut
from rows of alike length and a window's padding-free batches hold few stragglers. Requests are
pulled lazily: the encoder takes a window only when it needs more rows, so memory stays bounded
by a window (and the encoder's own look-ahead) whatever the input's size.

A row yields once every one of its inputs is done (one, or an OpenAI embeddings line's several,
each an output row keyed by sample_index), so the executor commits a row's outputs together and
exactly-once stays a matter of row ids. `between_batches` runs between two of the encoder's
results: a signal stops the job there, and the rows already yielded are committed. With --dedup an
input equal to an earlier one is not run again but takes that one's result (encode_duplicates.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

from batchgen.config.job import JobConfig
from batchgen.engine.encode.encoder import Encoder, EncodeRequest, EncodeResult
from batchgen.engine.encode.load import EncodeModel
from batchgen.engine.metrics import StepStats
from batchgen.jobs.encoding.encode_duplicates import EncodeDuplicates
from batchgen.jobs.rows.planned_row import PlannedRow

log = logging.getLogger("batchgen")


def encode_inputs(planned: PlannedRow) -> list[list[int]]:
    """The token ids of each input a row sends to the encoder (one output row each)."""
    return planned.encode_inputs if planned.encode_inputs is not None else [planned.prompt_token_ids]


def sort_for_encoder(window: list[PlannedRow]) -> list[PlannedRow]:
    """Longest prompt first (stable): the encoder's batches are cut in this order."""
    return sorted(window, key=lambda r: max(len(ids) for ids in encode_inputs(r)), reverse=True)


class EncodeCore:
    """Planned rows -> (row, one EncodeResult per input) through one Encoder."""

    def __init__(self, config: JobConfig, model: EncodeModel, *, between_batches: Callable[[], None] | None = None):
        self.config = config
        self.model = model
        self.encoder = Encoder(model, max_num_batched_tokens=config.max_num_batched_tokens,
                               max_num_seqs=config.batch_size)
        self.between_batches = between_batches
        self.num_windows = 0
        self.num_requests = 0
        self.num_planned_rows = 0
        self.num_planned_prompt_tokens = 0  # of every input handed to the encoder so far
        # called once per encoder batch with its work as an engine step's (the ETA meter, the metrics)
        self.listeners: list[Callable[[StepStats], None]] = []
        self._seen = (0, 0, 0, 0.0)  # the encoder's (batches, rows, tokens, forward seconds) already reported
        self._pending: dict[str, tuple[PlannedRow, int]] = {}  # request id -> (row, input index)
        self._results: dict[int, list[EncodeResult | None]] = {}  # id(row) -> its inputs' results so far
        self._done: list[tuple[PlannedRow, list[EncodeResult]]] = []  # finished rows not yet yielded
        # --dedup: an input equal to one already run (or running) takes its result (encode_duplicates.py)
        self.duplicates = EncodeDuplicates() if config.dedup else None

    def generate(self, windows: Iterable[list[PlannedRow]]) -> Iterator[tuple[PlannedRow, list[EncodeResult]]]:
        for result in self.encoder.run(self._requests(windows)):
            self._report_batch()
            self._finish(result)
            if self.duplicates is not None:
                for copy in self.duplicates.served(result):
                    self._finish(copy)
            yield from self._take_done()
            if self.between_batches is not None:
                self.between_batches()
        yield from self._take_done()  # rows whose every input came from a finished copy

    def _finish(self, result: EncodeResult) -> None:
        planned, index = self._pending.pop(result.request_id)
        results = self._results[id(planned)]
        results[index] = result
        if all(r is not None for r in results):
            del self._results[id(planned)]
            self._done.append((planned, results))  # type: ignore[arg-type]  (every slot filled)

    def _take_done(self) -> list[tuple[PlannedRow, list[EncodeResult]]]:
        done, self._done = self._done, []
        return done

    def _requests(self, windows: Iterable[list[PlannedRow]]) -> Iterator[EncodeRequest]:
        for window in windows:
            for planned in sort_for_encoder(window):
                planned.window_index = self.num_windows
                inputs = encode_inputs(planned)
                self.num_planned_rows += 1
                self.num_planned_prompt_tokens += sum(len(ids) for ids in inputs)
                self._results[id(planned)] = [None] * len(inputs)
                for index, ids in enumerate(inputs):
                    request_id = str(self.num_requests)
                    self.num_requests += 1
                    self._pending[request_id] = (planned, index)
                    request = EncodeRequest(request_id, tuple(ids), score_from=planned.score_from,
                                            dimensions=planned.dimensions)
                    runs = True if self.duplicates is None else self.duplicates.admit(request)
                    if runs is True:
                        yield request
                    elif runs is not False:  # a finished copy's result
                        self._finish(runs)
            self.num_windows += 1

    def _report_batch(self) -> None:
        """A new batch ran (its first result is here): its rows, tokens and seconds to the listeners."""
        e = self.encoder
        now = (e.num_batches, e.num_rows, e.num_needed_tokens, e.forward_seconds)
        if now[0] == self._seen[0]:
            return
        rows, tokens, seconds = now[1] - self._seen[1], now[2] - self._seen[2], now[3] - self._seen[3]
        self._seen = now
        step = StepStats(step_seconds=seconds, num_running=rows, num_waiting=0, num_batched_tokens=tokens,
                         num_sampled_tokens=0, num_kv_blocks_used=0, num_kv_blocks_free=0, num_preempted=0,
                         forward_seconds=seconds, num_prompt_tokens=tokens)
        for listener in self.listeners:
            listener(step)

    @property
    def num_in_flight(self) -> int:
        """Rows handed to the encoder and not yet finished (they run again on resume)."""
        return len(self._results)

    def summary(self) -> dict:
        """The encoder's counters for the job summary: batches, tokens run vs needed (padding waste)."""
        e = self.encoder
        return {"num_batches": e.num_batches, "num_forward_tokens": e.num_forward_tokens,
                "num_needed_tokens": e.num_needed_tokens, "num_attention_tokens": e.num_attention_tokens,
                "padding_waste": round(e.padding_waste, 4), "forward_seconds": round(e.forward_seconds, 4)}
