"""The one loader's cache key: a cached library is found again only while nothing it was built
from changed, every csrc/ header included, so a stale .so is never loaded after a header edit."""

from __future__ import annotations

import shutil

from batchgen.engine.kernels import loader


def test_the_cache_key_changes_with_any_header(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(loader.CSRC, csrc)
    source = csrc / "argmax.c"
    before = loader.cache_key(source, "cc 1.0")
    assert loader.cache_key(source, "cc 1.0") == before
    headers = sorted(csrc.glob("*.h"))
    assert {"common.h", "bf16_convert.h", "row_max.h"} <= {h.name for h in headers}
    for header in headers:
        original = header.read_bytes()
        header.write_bytes(original.replace(b"#endif", b"#endif /* edited */", 1))
        assert loader.cache_key(source, "cc 1.0") != before, f"{header.name} edited, same key"
        header.write_bytes(original)
    assert loader.cache_key(source, "cc 1.0") == before
    (csrc / "added.h").write_text("/* a new header */\n")
    assert loader.cache_key(source, "cc 1.0") != before
    (csrc / "added.h").unlink()
    source.write_text(source.read_text() + "\n")
    assert loader.cache_key(source, "cc 1.0") != before
    assert loader.cache_key(csrc / "argmax.c", "cc 2.0") != loader.cache_key(csrc / "argmax.c", "cc 1.0")
