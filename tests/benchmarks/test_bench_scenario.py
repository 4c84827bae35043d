"""Benchmark: scenario k-projection coverage of 10^6 rows × 10 conditions, the plugin vs ``np.unique`` (no timing
asserts).

Issue #31. Ten operating conditions of 2–12 values (realistic domain sizes), one restriction (snow in
summer is impossible), 10^6 seeded rows with skewed value frequencies and one combination never seen
(so there are holes to report and close). Side by side, interleaved (A, B, C, D, A, B, C, D, …) at the
process's torch thread count (nothing set here):

* ``table``: :meth:`ScenarioTable.coverage` at its default settings (k given; 5 proposals, pair grids,
  the restriction's row check), on a table built beforehand — the user-facing call;
* ``engine``: :class:`ScenarioCoverageEngine` alone on the int64 codes (construction, range check,
  ``update``, ``compute``);
* ``engine_cached``: the engine alone on the table's cached int16 columns (no conversion, no check): the
  counting the table layer wraps;
* ``numpy``: ``np.unique(codes[:, subset], axis=0)`` per k-subset of conditions (the distinct value
  combinations of each projection), on uint8 codes (numpy's fastest dtype here). It sorts rows of a
  structured dtype, about 2 s per subset here: timed on :data:`NUMPY_SUBSETS` evenly spaced k-subsets
  (their counts checked) and scaled to all of them, which keeps the run to minutes;
* ``numpy_key``: a stronger numpy reference, per k-subset one int64 mixed-radix key over the subset's
  columns (contiguous int64 columns prepared beforehand, as the table caches its own) and ``np.unique``
  of that 1-D key.

The covered-cell counts per k-subset are asserted identical across all five. Medians and minima of the
rounds go to ``benchmark.extra_info``: ``ratio_numpy_unique_over_plugin_k2`` / ``_k3`` (``numpy``'s time
over ``table``'s, > 1: the plugin is faster), ``ratio_numpy_key_unique_over_plugin_k2`` / ``_k3`` (the same
for ``numpy_key``), ``ratio_engine_over_table`` (the engine alone over the table;
< 1 means the table layer adds time; the smaller of k = 2 and 3) and per k, and printed. The first
``coverage`` call of a fresh table (which builds the cached columns) is timed once too. With benchmarks
disabled (the normal suite) only a 5,000-row version runs, once, as a correctness check.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pytest_dnnsafety.engines import ScenarioCoverageEngine
from pytest_dnnsafety.scenarios import Conditions, ScenarioTable

ROWS = 1_000_000
SMALL_ROWS = 5_000
ROUNDS = 3
#: k-subsets on which the slow ``np.unique(axis=0)`` reference is timed (scaled to all subsets of a k)
NUMPY_SUBSETS = 6
#: (name, number of values): 2–12 values, as in driving-scenario catalogues
DOMAINS = (("weather", 5), ("season", 4), ("time", 12), ("road", 6), ("lanes", 3), ("traffic", 8),
           ("pedestrians", 2), ("light", 10), ("camera", 2), ("speed", 7))


def scenario_table(rows: int, seed: int = 31) -> ScenarioTable:
    """Seeded rows: skewed value frequencies (weight 1/(v+1)), no snow in summer, no time=11 with road=0."""
    conditions = Conditions(
        {name: [f"{name}{v}" for v in range(card)] for name, card in DOMAINS},
        restrictions=[{"weather": ["weather4"], "season": ["season2"]}],
    )
    gen = torch.Generator().manual_seed(seed)
    columns = []
    for _, card in DOMAINS:
        weights = 1.0 / torch.arange(1, card + 1, dtype=torch.float64)
        columns.append(torch.multinomial(weights, rows, replacement=True, generator=gen))
    codes = torch.stack(columns, dim=1)
    snow_summer = (codes[:, 0] == 4) & (codes[:, 1] == 2)
    codes[snow_summer, 0] = 0  # the restriction: no row breaks it
    codes[(codes[:, 2] == 11) & (codes[:, 3] == 0), 3] = 1  # a combination never seen: holes at k = 2 and 3
    return ScenarioTable(conditions, codes)


def sampled_subsets(n: int, k: int) -> list[int]:
    """Positions of :data:`NUMPY_SUBSETS` evenly spaced k-subsets among all of them."""
    total = len(list(itertools.combinations(range(n), k)))
    return sorted({round(i * (total - 1) / max(NUMPY_SUBSETS - 1, 1)) for i in range(NUMPY_SUBSETS)})


def numpy_unique_counts(codes: np.ndarray, k: int, positions: list[int]) -> list[int]:
    """Distinct value combinations of the k-subsets at ``positions``, ``np.unique(axis=0)`` per subset."""
    subsets = list(itertools.combinations(range(codes.shape[1]), k))
    return [len(np.unique(codes[:, list(subsets[p])], axis=0)) for p in positions]


def numpy_key_counts(columns: list[np.ndarray], cards: list[int], k: int) -> list[int]:
    """The same by one int64 mixed-radix key per subset and a 1-D ``np.unique``."""
    counts = []
    for subset in itertools.combinations(range(len(columns)), k):
        key = columns[subset[0]]
        for c in subset[1:]:
            key = key * cards[c] + columns[c]
        counts.append(len(np.unique(key)))
    return counts


def table_counts(table: ScenarioTable, k: int) -> list[int]:
    return [s.covered for s in table.coverage(k=k).per_subset]


def engine_counts(table: ScenarioTable, codes: torch.Tensor, k: int) -> list[int]:
    engine = ScenarioCoverageEngine(table.conditions.cardinalities, k=k)
    engine.update(codes)
    return engine.compute().covered_per_subset.tolist()


def engine_cached_counts(table: ScenarioTable, k: int) -> list[int]:
    engine = ScenarioCoverageEngine(table.conditions.cardinalities, k=k)
    engine.update(table._columns().t(), validate=False)
    return engine.compute().covered_per_subset.tolist()


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def test_bench_scenario_coverage_vs_numpy_unique(benchmark) -> None:
    full = not getattr(benchmark, "disabled", False)
    rows, rounds = (ROWS, ROUNDS) if full else (SMALL_ROWS, 1)
    fresh = scenario_table(rows)
    first_call_s, _ = _timed(lambda: fresh.coverage(k=3))  # builds the cached columns
    table = scenario_table(rows)
    codes = table.codes
    codes_u8 = codes.numpy().astype(np.uint8)
    columns_i64 = [np.ascontiguousarray(codes.numpy()[:, c]) for c in range(codes.shape[1])]
    cards = list(table.conditions.cardinalities)
    for k in (2, 3):  # warm: the cached columns, the conditions' feasibility tables (timed cold above)
        table.coverage(k=k)
    info: dict[str, Any] = {"rows": rows, "conditions": len(DOMAINS), "cardinalities": [c for _, c in DOMAINS],
                            "rounds": rounds, "torch_threads": torch.get_num_threads(),
                            "table_first_call_k3_seconds": first_call_s}
    lines = [(f"\nscenario coverage, {rows:,} rows × {len(DOMAINS)} conditions, {rounds} interleaved rounds, "
              f"torch threads {torch.get_num_threads()}: median (min) seconds")]
    contenders: dict[str, Callable[[int], list[int]]] = {
        "table": lambda k: table_counts(table, k),
        "engine": lambda k: engine_counts(table, codes, k),
        "engine_cached": lambda k: engine_cached_counts(table, k),
        "numpy": lambda k: numpy_unique_counts(codes_u8, k, sampled_subsets(len(cards), k)),
        "numpy_key": lambda k: numpy_key_counts(columns_i64, cards, k),
    }
    ratios_engine: list[float] = []
    for k in (2, 3):
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(rounds):
            results = {}
            positions = sampled_subsets(len(cards), k)
            for name, fn in contenders.items():
                seconds, results[name] = _timed(fn, k)
                scale = len(results["table"]) / len(positions) if name == "numpy" else 1.0
                times[name].append(seconds * scale)  # np.unique(axis=0): scaled from the sampled subsets
            assert results["table"] == results["engine"] == results["engine_cached"] == results["numpy_key"]
            assert results["numpy"] == [results["table"][p] for p in positions]
        median = {name: statistics.median(t) for name, t in times.items()}
        least = {name: min(t) for name, t in times.items()}
        ratio_numpy = median["numpy"] / median["table"]
        ratio_engine = median["engine"] / median["table"]
        ratios_engine.append(ratio_engine)
        info.update({f"{name}_k{k}_seconds_median": median[name] for name in contenders})
        info.update({f"{name}_k{k}_seconds_min": least[name] for name in contenders})
        info.update({
            f"covered_k{k}": sum(results["table"]),
            f"ratio_numpy_unique_over_plugin_k{k}": ratio_numpy,
            f"ratio_numpy_unique_over_plugin_k{k}_min": least["numpy"] / least["table"],
            f"ratio_numpy_key_unique_over_plugin_k{k}": median["numpy_key"] / median["table"],
            f"ratio_numpy_key_unique_over_plugin_k{k}_min": least["numpy_key"] / least["table"],
            f"ratio_engine_over_table_k{k}": ratio_engine,
            f"ratio_engine_over_table_k{k}_min": least["engine"] / least["table"],
            f"ratio_engine_cached_over_table_k{k}": median["engine_cached"] / median["table"],
        })
        lines.append(
            f"  k={k}: table {median['table']:.3f} ({least['table']:.3f}), engine {median['engine']:.3f} "
            f"({least['engine']:.3f}), engine on cached columns {median['engine_cached']:.3f} "
            f"({least['engine_cached']:.3f}), np.unique(axis=0) per subset (scaled) {median['numpy']:.3f} "
            f"({least['numpy']:.3f}), np.unique of a key per subset {median['numpy_key']:.3f} "
            f"({least['numpy_key']:.3f}); ratio_numpy_unique_over_plugin_k{k} {ratio_numpy:.1f}, "
            f"ratio_numpy_key_unique_over_plugin_k{k} {median['numpy_key'] / median['table']:.1f}, "
            f"ratio_engine_over_table_k{k} {ratio_engine:.2f}; {sum(results['table']):,} covered cells, identical"
        )
    info["ratio_engine_over_table"] = min(ratios_engine)
    lines.append(f"  first coverage(k=3) of a fresh table (builds the cached columns): {first_call_s:.3f} s")
    benchmark.pedantic(lambda: table.coverage(k=3), rounds=1, iterations=1)
    benchmark.extra_info.update(info)
    print("\n".join(lines))
