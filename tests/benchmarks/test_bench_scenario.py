"""Benchmarks: the scenario coverage engine vs a naive per-row Python loop (no timing asserts).

The engine counts 10^6 rows × 10 conditions (cardinalities ≤ 8, seeded) at k = 2 and k = 3;
the naive reference (dict/set per subset, one Python iteration per row and subset) runs on
a 2·10^4-row subsample so the suite stays fast. Rows per second of both and their ratio go to
``benchmark.extra_info``; the naive value is checked equal to the engine's on the subsample.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import pytest
import torch

from pytest_dnnsafety.engines import ScenarioCoverageEngine

ROWS = 1_000_000
NAIVE_ROWS = 20_000
N_CONDITIONS = 10


def _table() -> tuple[list[int], torch.Tensor]:
    gen = torch.Generator().manual_seed(20180101)
    cards = torch.randint(2, 9, (N_CONDITIONS,), generator=gen).tolist()
    codes = torch.stack([torch.randint(0, c, (ROWS,), generator=gen) for c in cards], dim=1)
    return cards, codes


CARDS, CODES = _table()


def naive_coverage(rows: list[list[int]], cards: list[int], k: int) -> tuple[int, int]:
    """The paper's procedure, literally: per row, per subset, mark the projection cell."""
    covered = total = 0
    for subset in itertools.combinations(range(len(cards)), k):
        seen: set[tuple[int, ...]] = set()
        for row in rows:
            seen.add(tuple(row[c] for c in subset))
        covered += len(seen)
        size = 1
        for c in subset:
            size *= cards[c]
        total += size
    return covered, total


def engine_coverage(codes: torch.Tensor, k: int) -> tuple[int, int]:
    engine = ScenarioCoverageEngine(CARDS, k=k)
    engine.update(codes)
    out = engine.compute()
    return int(out.covered), int(out.total)


def _best_of(fn: Callable[[], object], rounds: int = 3) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize("k", [2, 3])
def test_bench_engine_million_rows(benchmark, k: int) -> None:
    covered, total = benchmark.pedantic(engine_coverage, args=(CODES, k), rounds=3, iterations=1, warmup_rounds=1)
    assert 0 < covered <= total
    engine_seconds = _best_of(lambda: engine_coverage(CODES, k))
    sample = CODES[:NAIVE_ROWS]
    rows = sample.tolist()
    assert naive_coverage(rows, CARDS, k) == engine_coverage(sample, k)
    naive_seconds = _best_of(lambda: naive_coverage(rows, CARDS, k), rounds=1)
    engine_rate = ROWS / engine_seconds
    naive_rate = NAIVE_ROWS / naive_seconds
    benchmark.extra_info.update(
        {
            "rows": ROWS,
            "conditions": N_CONDITIONS,
            "cardinalities": CARDS,
            "k": k,
            "engine_seconds": engine_seconds,
            "engine_rows_per_s": engine_rate,
            "naive_rows": NAIVE_ROWS,
            "naive_rows_per_s": naive_rate,
            "speedup": engine_rate / naive_rate,
            "torch_threads": torch.get_num_threads(),
        }
    )
    print(
        f"\nk={k}: engine {engine_seconds:.3f} s for {ROWS} rows ({engine_rate:,.0f} rows/s); "
        f"naive {naive_rate:,.0f} rows/s; speedup ×{engine_rate / naive_rate:,.0f}"
    )


@pytest.mark.parametrize("k", [2, 3])
def test_bench_naive_reference_subsample(benchmark, k: int) -> None:
    rows = CODES[:NAIVE_ROWS].tolist()
    covered, total = benchmark.pedantic(naive_coverage, args=(rows, CARDS, k), rounds=3, iterations=1)
    assert (covered, total) == engine_coverage(CODES[:NAIVE_ROWS], k)
    benchmark.extra_info.update({"rows": NAIVE_ROWS, "k": k})
