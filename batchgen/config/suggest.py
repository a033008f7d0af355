"""The name a user most likely meant, for every error that answers a name it does not know.

One rule for config keys, column names, template placeholders and flags, so that a typo gets the
same "did you mean" wherever it is made.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# difflib's ratio at or above which a known name counts as the one meant (its own default)
_CUTOFF = 0.6


def closest(asked: str, known: Iterable[str]) -> str | None:
    """The known name closest to `asked`, compared without case; None when none is close."""
    lowered: dict[str, str] = {}
    for name in known:
        lowered.setdefault(name.lower(), name)
    match = difflib.get_close_matches(asked.lower(), list(lowered), n=1, cutoff=_CUTOFF)
    return lowered[match[0]] if match else None


def did_you_mean(asked: str, known: Iterable[str]) -> str:
    """"; did you mean 'x'?" for the closest known name, or "" when none is close."""
    match = closest(asked, known)
    return f"; did you mean {match!r}?" if match is not None else ""
