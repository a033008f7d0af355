"""The resume rule: which input rows an earlier run already settled, and each row's prompt hash.

With derived ids ("<file>:<row>") the inputs are the same files as when the rows were committed
(batchgen.jobs.identity refuses any change), so a committed id is settled. With --id-column rows
and files may change between runs, so a committed id is settled only while its prompt is: the
row's prompt is built again and its hash compared with the committed one; a changed prompt is
generated again and its new row replaces the old one (batchgen.jobs.commit), as a retried error
row does. Error rows are generated again unless --no-retry-errors.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchgen.io.manifest import ManifestState

if TYPE_CHECKING:
    from batchgen.jobs.prepare import JobInputs


def prompt_hash(token_ids: list[int], settings: str | None = None) -> str:
    """The documented `prompt_hash` output column: blake2b-64 (16 hex digits) of the prompt's
    token ids as little-endian uint32, then of the row's own generation `settings` where it has
    them (an OpenAI Batch request's max_tokens, sampling, seed, stop: its "prompt" is the request)."""
    packed = array("I", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    h = hashlib.blake2b(packed.tobytes(), digest_size=8)
    if settings is not None:
        h.update(b"\x00" + settings.encode())
    return h.hexdigest()


@dataclass(slots=True)
class ResumeRule:
    """Which rows an earlier run already settled. `state` is the live manifest state."""

    state: ManifestState
    retry_errors: bool
    check_prompts: bool  # --id-column: a committed row counts only while its prompt hash is unchanged

    def skips(self, row_id: Any) -> bool:
        """Settled without looking at the row's prompt."""
        if row_id in self.state.ok_ids:
            return not self.needs_prompt(row_id)
        return not self.retry_errors and row_id in self.state.error_ids

    def needs_prompt(self, row_id: Any) -> bool:
        """A committed ok row whose prompt must be built to tell whether it changed."""
        return self.check_prompts and row_id in self.state.prompt_hashes

    def unchanged(self, row_id: Any, digest: str) -> bool:
        return self.state.prompt_hashes.get(row_id) == digest

    @property
    def num_rows_done(self) -> int:
        return len(self.state.ok_ids) + (0 if self.retry_errors else len(self.state.error_ids))

    def nothing_to_do(self, inputs: JobInputs) -> bool:
        """Every input row is settled, so a run would generate nothing (and need no model).

        Ids are unique, so fewer settled rows than input rows means work without reading a row;
        otherwise one pass over the ids (the id column alone, or none for derived ids) decides. Under
        --id-column a committed row is settled only once its prompt hash is compared, which needs the
        tokenizer, so such a rerun is never "nothing to do" here."""
        if not self.state.num_committed_rows or self.num_rows_done < inputs.scan.num_rows:
            return False
        return all(self.skips(row_id) for row_id in inputs.source.iter_ids(inputs.scan.shard_rows))
