"""The prompt hash of each committed ok row (a resume under --id-column compares them), as a view.

A dict of a million ids to a million hex strings would cost ~150 MiB; the hashes are held per part
(batchgen.io.ids.compact_lists.HashList, 9 bytes a row) and found through the id index.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchgen.io.manifest.state import ManifestState


class PromptHashes(Mapping):
    """ok id -> prompt hash, read from the parts that hold them (no dict of a million entries)."""

    def __init__(self, state: ManifestState):
        self._state = state

    def __getitem__(self, row_id: Any) -> str:
        found = self._state.ok_ids.position(row_id)
        digest = None if found is None or found[0].hashes is None else found[0].hashes[found[1]]
        if digest is None:
            raise KeyError(row_id)
        return digest

    def __len__(self) -> int:
        return self._state.num_prompt_hashes

    def __iter__(self) -> Iterator[Any]:
        for record in list(self._state.parts.values()):
            if record.hashes is not None:
                for i in record.ok_positions():
                    if record.hashes[i] is not None:
                        yield record.ids[i]
