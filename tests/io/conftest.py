"""Fixtures of the io tests."""

from __future__ import annotations

import pytest

from batchgen.io.store.writers import PartWriter, publish_staged


@pytest.fixture
def write_part():
    """Write rows as one visible part (stage, then publish), all or nothing: the part write a job
    does without the manifest. On failure nothing of the part is left and the name is reused."""

    def write(writer: PartWriter, rows):
        seq = writer.next_seq
        try:
            staged = writer.stage_part(rows)
            try:
                publish_staged([staged])
            except BaseException:
                staged.temp_path.unlink(missing_ok=True)
                staged.final_path.unlink(missing_ok=True)
                raise
        except BaseException:
            writer.next_seq = seq
            raise
        return staged.final_path

    return write
