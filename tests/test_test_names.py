"""Test modules have unique file names: the suite has no __init__.py files, so pytest imports each
test module by its base name, and a second tests/**/test_x.py stops collection for the whole run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_two_test_modules_share_a_name():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [name for name, count in names.items() if count > 1]
