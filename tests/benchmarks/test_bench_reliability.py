"""Benchmarks: the reliability assessment on the paper's running-example scale (no timing asserts).

The paper (Zhao et al. 2021, Table 1) partitions [0,1]² into 250 × 250 cells of side 0.004,
estimates the OP by a KDE with 100 bootstrap refits and samples 10,000 inputs per cell; its
prototype calls the model cell by cell (about 16 minutes on a machine like ours). Here:

* the engine (:func:`assess_reliability`, all of it: KDE masses, bootstrap, cell typing,
  batched Monte Carlo, aggregation) on that grid with a small torch MLP (2→32→32→2) at 1,000
  and 10,000 samples per cell;
* a per-cell loop reference — per cell: draw the cell's samples, one model call, count the
  failures (``.item()``), i.e. the prototype's structure in torch — timed on a subset of cells and
  extrapolated to the 62,500 cells (its OP and aggregation work is not even counted).

Model queries per second of both and the ratio go to ``benchmark.extra_info``: ``ratio`` is the
extrapolated reference time over the engine's full assessment; ``sampling_ratio_interleaved``
compares the Monte Carlo throughput alone, the reference and the engine's sampling timed
alternately on the same cells (robust to other load on a shared machine).
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch

from pytest_dnnsafety.engines.reliability import (ReliabilityAssessor, ReliabilityOptions, ReliabilityWarning,
                                                   assess_reliability)
from pytest_dnnsafety.engines.reliability.profile import OperationalProfile

GRID = 250
EPS = 1.0 / GRID
BOX = ([0.0, 0.0], [1.0, 1.0])
BOOTSTRAP = 100


def _problem() -> tuple[torch.nn.Module, OperationalProfile, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2021)
    op = (0.5 + 0.18 * torch.randn(2000, 2, generator=gen, dtype=torch.float64)).clamp(0.0, 1.0)
    x_lab = torch.rand(2000, 2, generator=gen, dtype=torch.float64)
    y_lab = ((x_lab[:, 0] - 0.5) ** 2 + (x_lab[:, 1] - 0.5) ** 2 < 0.09).long()  # a disc
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 2))
    optim = torch.optim.Adam(mlp.parameters(), lr=0.02)
    xf, yf = x_lab.float(), y_lab
    for _ in range(300):
        optim.zero_grad()
        torch.nn.functional.cross_entropy(mlp(xf), yf).backward()
        optim.step()
    return mlp.eval(), OperationalProfile(op), x_lab, y_lab


MODEL, PROFILE, X_LAB, Y_LAB = _problem()


def _engine(samples_per_cell: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReliabilityWarning)
        return assess_reliability(MODEL, PROFILE, (X_LAB, Y_LAB), eps=EPS, box=BOX, samples_per_cell=samples_per_cell,
                                  bootstrap=BOOTSTRAP, method="normal", compare_methods=("chernoff",), seed=1)


def per_cell_reference(model: torch.nn.Module, lower: torch.Tensor, labels: torch.Tensor, n: int) -> list[int]:
    """The prototype's structure: one model call per cell, failures read back per cell."""
    failures = []
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for lo, label in zip(lower, labels.tolist()):
            x = lo + torch.rand(n, 2, generator=gen) * EPS
            pred = model(x).argmax(1)
            failures.append(int((pred != label).sum().item()))
    return failures


def _interleaved_rates(lower: torch.Tensor, labels: torch.Tensor, n: int, repeats: int
                       ) -> tuple[float, float, list[int]]:
    """Best-of-``repeats`` model queries/s of the reference and of the engine's sampling on the same cells.

    The two are timed alternately, so load from other processes on a shared machine hits both
    alike; best-of because contention only ever slows a run.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReliabilityWarning)
        sub = ReliabilityAssessor(PROFILE, (X_LAB, Y_LAB), options=ReliabilityOptions.of(
            eps=EPS, box=BOX, samples_per_cell=n, bootstrap=0, max_cells=lower.shape[0], method="normal", seed=1))
    best_ref = best_eng = 0.0
    failures: list[int] = []
    for _ in range(repeats):
        start = time.perf_counter()
        failures = per_cell_reference(MODEL, lower, labels, n)
        best_ref = max(best_ref, lower.shape[0] * n / (time.perf_counter() - start))
        start = time.perf_counter()
        sub.sample(MODEL)
        best_eng = max(best_eng, sub.queries / (time.perf_counter() - start))
    return best_ref, best_eng, failures


def _run(benchmark, samples_per_cell: int, reference_cells: int, rounds: int) -> None:
    """Engine: ``rounds`` full assessments (best taken); reference: best of 3 on ``reference_cells`` cells.

    Best-of timings because the 2-core CI/dev machines are shared: contention only ever slows a run.
    """
    results = []

    def engine() -> object:
        results.append(_engine(samples_per_cell))
        return results[-1]

    benchmark.pedantic(engine, rounds=rounds, iterations=1, warmup_rounds=0)
    result = min(results, key=lambda r: r.seconds)
    assert result.cells_evaluated == GRID * GRID
    assert result.model_queries == (GRID * GRID - result.cells_cross) * samples_per_cell
    # reference on the cells of highest OP (a contiguous share of the work), with the engine's labels
    cells = result.cells
    sampled = torch.nonzero(cells.trials > 0).reshape(-1)[:reference_cells]
    lower = cells.lower[sampled].float()
    labels = cells.label[sampled]
    ref_rate, sampling_rate, ref_failures = _interleaved_rates(lower, labels, samples_per_cell, repeats=3)
    ref_extrapolated = result.model_queries / ref_rate
    engine_rate = result.model_queries / result.seconds
    # the two agree statistically on the subset (different random inputs, same cells and labels)
    eng = int(cells.failures[sampled].sum())
    ref = sum(ref_failures)
    assert abs(eng - ref) <= 6 * (eng + ref + 1) ** 0.5 + 0.02 * (eng + ref)
    benchmark.extra_info.update(
        {
            "cells": GRID * GRID,
            "samples_per_cell": samples_per_cell,
            "bootstrap": BOOTSTRAP,
            "model_queries": result.model_queries,
            "engine_seconds": result.seconds,
            "engine_seconds_all_rounds": [r.seconds for r in results],
            "engine_queries_per_s": engine_rate,
            "reference_cells_timed": reference_cells,
            "reference_queries_per_s": ref_rate,
            "reference_seconds_extrapolated": ref_extrapolated,
            "ratio": ref_extrapolated / result.seconds,
            "engine_sampling_queries_per_s_interleaved": sampling_rate,
            "sampling_ratio_interleaved": sampling_rate / ref_rate,
            "E": result.E,
            "Ub_normal": result.Ub,
            "Ub_chernoff": result.alternatives["chernoff"].Ub,
            "torch_threads": torch.get_num_threads(),
        }
    )
    print(
        f"\n{GRID}x{GRID} cells, {samples_per_cell} samples/cell: engine {result.seconds:.1f} s "
        f"({engine_rate:,.0f} queries/s); per-cell loop {ref_rate:,.0f} queries/s → {ref_extrapolated:.1f} s "
        f"extrapolated; ratio ×{ref_extrapolated / result.seconds:.2f}; interleaved sampling "
        f"{sampling_rate:,.0f} queries/s, ×{sampling_rate / ref_rate:.2f}; E={result.E:.4g} "
        f"Ub(normal)={result.Ub:.4g} Ub(chernoff)={result.alternatives['chernoff'].Ub:.4g}"
    )


def test_bench_paper_grid_100_samples(benchmark) -> None:
    """Where per-call overhead dominates a per-cell loop (and on accelerators, at any size)."""
    _run(benchmark, 100, reference_cells=5000, rounds=3)


def test_bench_paper_grid_1000_samples(benchmark) -> None:
    if benchmark.disabled:  # the 100-sample case checks the same code untimed; this one is its timing at scale
        pytest.skip("timing at scale: runs timed in CI step 2 (--benchmark-enable --benchmark-only)")
    _run(benchmark, 1000, reference_cells=2000, rounds=3)


@pytest.mark.slow
def test_bench_paper_grid_10000_samples(benchmark) -> None:
    if benchmark.disabled:  # 625M model queries: a third of the suite's CPU time for a timing alone
        pytest.skip("paper-scale benchmark: runs timed in CI step 2 (--benchmark-enable --benchmark-only)")
    _run(benchmark, 10_000, reference_cells=300, rounds=1)
