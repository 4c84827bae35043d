"""Timing helper shared by the benchmarks (pytest-benchmark's best round, or our own when disabled)."""

from __future__ import annotations

import time
from typing import Any, Callable


def engine_seconds(benchmark: Any, fn: Callable[[], Any]) -> float:
    """The benchmark's best round; timed here (best of 3) when benchmarks are disabled."""
    stats = getattr(benchmark, "stats", None)
    if stats is not None:
        return float(stats.stats.min)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
