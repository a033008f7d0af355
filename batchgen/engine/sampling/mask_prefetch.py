"""The next step's grammar masks, filled on a worker thread while the model runs the next forward.

Once a step's tokens are accepted, every constrained row that goes on has the grammar state its
next token is drawn under, so its mask can be filled then instead of after the next forward.
llguidance's batch fill (`LLExecutor.unsafe_compute_mask_ptr`) runs in Rust with the GIL released
for the whole batch, and torch releases it inside its ops, so the fill and the forward run side by
side. Checked on this project's CPU machine with the embedded
tokenizer: a Python loop on the main thread kept its pace while a worker filled 32 rows' masks in a
loop through the executor, and lost a third of it with the per-row `fill_next_token_bitmask`
(its Python glue takes the GIL back between rows): the executor is the one used.

A prefetched mask is tagged with the row's seq id and the number of generated tokens its grammar
had consumed; `GrammarMasks.mask` takes it only for a row whose count still equals that, and fills
any other constrained row synchronously (a row that joined the batch, a continued row, a row whose
mask was not prefetched). While a fill is in flight its matchers are the worker's: the owner calls
none of their methods until `take()` has joined it (llguidance objects refuse a second borrower).
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class MaskPrefetch:
    def __init__(self, executor) -> None:
        self._executor = executor  # llguidance.LLExecutor: its threads fill the masks
        self._worker: ThreadPoolExecutor | None = None  # one thread: at most one fill in flight
        self._future: Future | None = None
        # seq id -> (its first row in _bitmask, generated tokens it is for, the drafts its next rows are after)
        self._rows: dict[int, tuple[int, int, list[int]]] = {}
        self._bitmask: torch.Tensor | None = None  # [num_rows, num_words] int32, filled by the worker
        self.background_s = 0.0  # the worker's seconds in fills (off the step's critical path when overlapped)

    def start(self, rows: list[tuple[int, int, object, list[int]]], num_words: int) -> None:
        """Fill the masks of `rows` (seq id, generated tokens after this step, matcher, drafts) in the
        background: a row with drafts (jump_forward.py) gets one mask more after each of them."""
        assert self._future is None, "take() the fill in flight first"
        self._rows = {}
        self._bitmask = None
        if not rows:
            return
        starts = list(itertools.accumulate((1 + len(drafts) for *_, drafts in rows), initial=0))
        self._rows = {seq_id: (start, num_tokens, drafts)
                      for start, (seq_id, num_tokens, _, drafts) in zip(starts, rows, strict=False)}
        self._bitmask = torch.full((starts[-1], num_words), -1, dtype=torch.int32)
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchgen-grammar")
        matchers = [(m, start, drafts) for start, (_, _, m, drafts) in zip(starts, rows, strict=False)]
        self._future = self._worker.submit(self._fill, matchers, self._bitmask)

    def _fill(self, matchers: list[tuple[object, int, list[int]]], bitmask: torch.Tensor) -> None:

        t0 = time.perf_counter()
        fill_masks(self._executor, matchers, bitmask)
        self.background_s += time.perf_counter() - t0

    def take(self) -> tuple[dict[int, tuple[int, int, list[int]]], torch.Tensor | None]:
        """Join the fill in flight (if any): (seq id -> (first row, generated tokens, drafts), the filled masks)."""
        if self._future is not None:
            future, self._future = self._future, None
            future.result()  # a fill that raised raises here, on the engine's thread
        rows, bitmask = self._rows, self._bitmask
        self._rows, self._bitmask = {}, None
        return rows, bitmask


def fill_masks(executor, matchers: list[tuple[object, int, list[int]]], bitmask: torch.Tensor) -> None:
    """Each (matcher, row, drafts)'s mask into bitmask[row], and with drafts the mask after each draft
    into the rows that follow (llguidance's draft fill refuses a row without drafts: two batches).

    The executor's pointer calls are what `llguidance.torch`'s fill functions make after their
    checks; that module is not imported because importing it compiles a kernel with
    `torch.compile`, which imports torch._dynamo, and the first constrained step would wait for it."""
    assert bitmask.dtype == torch.int32 and bitmask.device.type == "cpu" and bitmask.dim() == 2
    assert bitmask.is_contiguous()  # the executor writes rows at data_ptr + row * row_bytes
    num_rows, num_words = bitmask.shape
    plain = [(m, j) for m, j, drafts in matchers if not drafts]
    drafting = [row for row in matchers if row[2]]
    if plain:
        executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), num_words * 4, num_rows)
    if drafting:
        executor.unsafe_compute_mask_ptr_with_draft_token(drafting, bitmask.data_ptr(), num_words * 4, num_rows)
