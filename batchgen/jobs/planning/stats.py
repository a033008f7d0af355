"""Counting token lengths in bounded memory: a uniform reservoir sample, nearest-rank quantiles,
Spearman's rank correlation, and the ceiling division that turns tokens into blocks or steps.

Used by the output-length predictor (batchgen.jobs.planning.length) and by `batchgen plan`'s job-wide
quantiles; plain Python, no torch.
"""

from __future__ import annotations

import math
import random
from typing import Any


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up, in integers (tokens -> blocks, excess -> rounds)."""
    return -(-a // b)


def nearest_rank(sorted_values: list[int], q: float) -> int:
    """The q-quantile of a sorted, non-empty list by the nearest-rank rule."""
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def distribution(values: list[int]) -> dict[str, Any]:
    """count, total, mean, p50, p90, max of a list of token counts (nearest-rank quantiles)."""
    if not values:
        return {"count": 0, "total": 0, "mean": None, "p50": None, "p90": None, "max": None}
    s = sorted(values)
    return {"count": len(s), "total": sum(s), "mean": round(sum(s) / len(s), 1), "p50": nearest_rank(s, 0.5),
            "p90": nearest_rank(s, 0.9), "max": s[-1]}


class Reservoir:
    """A uniform sample of at most `size` values out of `count` seen (Vitter's algorithm R).

    The random generator is the caller's, so that several samples drawn from one stream of
    rows stay reproducible together.
    """

    __slots__ = ("size", "count", "values", "_sorted")

    def __init__(self, size: int, count: int = 0, values: list[Any] | None = None):
        self.size = size
        self.count = count
        self.values = list(values or [])[:size]
        self._sorted: list[Any] | None = None

    def add(self, value: Any, rng: random.Random) -> None:
        self.count += 1
        if len(self.values) < self.size:
            self.values.append(value)
        else:
            i = rng.randrange(self.count)
            if i >= self.size:
                return
            self.values[i] = value
        self._sorted = None

    def quantile(self, q: float) -> int:
        if self._sorted is None:
            self._sorted = sorted(self.values)
        return nearest_rank(self._sorted, q)

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "values": self.values}

    @classmethod
    def from_json(cls, size: int, data: dict[str, Any]) -> Reservoir:
        values = [int(v) for v in data["values"]]
        return cls(size, max(int(data["count"]), len(values)), values)


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (ties get their average rank); None when either side is constant."""
    rx, ry = _ranks(xs), _ranks(ys)
    n = len(rx)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    if vx == 0 or vy == 0:
        return None
    return cov / math.sqrt(vx * vy)


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks
