"""The step being run on this thread: what a patched model function (attention, rotary) sees.

Hugging Face modules call our attention function and the fused rotary embedding with their own
arguments only, so the step's paged-cache metadata reaches them through this context instead. It
lives apart from attention and the kernels so both can read it without importing each other.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen.engine.attention.paged import AttentionMetadata

# per thread: engines on other threads (data-parallel replicas) run their own forwards meanwhile
_local = threading.local()


def current_metadata() -> AttentionMetadata | None:
    """The metadata of the forward running on this thread, or None outside one."""
    return getattr(_local, "metadata", None)


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    """Make `metadata` visible to the attention function for one forward pass on this thread."""
    assert current_metadata() is None, "forward contexts do not nest"
    _local.metadata = metadata
    try:
        yield
    finally:
        _local.metadata = None
