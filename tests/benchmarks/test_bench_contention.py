"""Benchmark: the engines with one competing CPU-bound process alongside, torch's threads vs the plugin's.

Issue #13 item 2: on a shared machine torch's default intra-op threads (one per core) oversubscribe
the cores — OpenMP's threads wait at a barrier after every parallel loop for the one whose core
another process holds — so the engines ran 6–25× slower than they need to. Two workloads:

* ``neurons``: a gate's neuron k-activation coverage (Cheng et al. 2018, eq. (2), k = 2) of a conv
  layer: 4,000 28×28 images through a 64-channel conv, channel means, the engine's update;
* ``reliability``: the reliability assessment (Zhao et al. 2021) of a 2→32→32→2
  MLP on a 25 × 25 grid at 1,000 samples per cell (625,000 model queries, 20 bootstrap refits).

Each is timed (best of :data:`ROUNDS`) with *before* = torch's own default thread count (read from
a fresh interpreter) and *after* = the plugin's ``auto`` policy (:func:`pytest_dnnsafety.runtime.threads.plan`,
its load measured while the competitor runs), on a quiet machine and with one competitor (a
Python busy loop in a subprocess). A table is printed; times and ratios go to
``benchmark.extra_info``. No timing asserts: the machine may be shared. The figures in the
CHANGELOG come from a quiet 2-core machine; other load makes *before* worse, not *after*.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from typing import Any, Callable

import pytest
import torch

from pytest_dnnsafety.runtime import threads
from pytest_dnnsafety.settings import Settings
from pytest_dnnsafety.engines import NeuronKActivationEngine
from pytest_dnnsafety.engines.reliability import assess_reliability
from pytest_dnnsafety.engines.reliability.profile import OperationalProfile

ROUNDS = 3
SPIN = "while True:\n    pass\n"


def _torch_default_threads() -> int:
    """torch's own default intra-op thread count, from a fresh interpreter without OMP/MKL_NUM_THREADS."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                         capture_output=True, text=True, check=True, timeout=120)
    return int(out.stdout.strip())


def _neurons_workload() -> Callable[[], Any]:
    gen = torch.Generator().manual_seed(13)
    images = torch.rand(4_000, 1, 28, 28, generator=gen)
    torch.manual_seed(13)
    conv = torch.nn.Sequential(torch.nn.Conv2d(1, 64, 5, stride=2), torch.nn.ReLU()).eval()

    def run() -> int:
        engine = NeuronKActivationEngine(64, k=2)
        with torch.inference_mode():
            for batch in images.split(500):
                engine.update(conv(batch).mean(dim=(2, 3)) - 0.05)
        return engine.compute().covered

    return run


def _reliability_workload() -> Callable[[], Any]:
    gen = torch.Generator().manual_seed(2021)
    op = (0.5 + 0.18 * torch.randn(2000, 2, generator=gen, dtype=torch.float64)).clamp(0.0, 1.0)
    x = torch.rand(2000, 2, generator=gen, dtype=torch.float64)
    y = ((x[:, 0] - 0.5) ** 2 + (x[:, 1] - 0.5) ** 2 < 0.09).long()
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                              torch.nn.Linear(32, 2)).eval()
    profile = OperationalProfile(op)

    def run() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return assess_reliability(mlp, profile, (x, y), eps=1 / 25, box=([0.0, 0.0], [1.0, 1.0]),
                                      samples_per_cell=1_000, bootstrap=20, method="normal", seed=1)

    return run


WORKLOADS = {"neurons": _neurons_workload, "reliability": _reliability_workload}


def _best(fn: Callable[[], Any], n_threads: int) -> float:
    torch.set_num_threads(n_threads)
    fn()  # warm-up: first-call set-up is not the steady speed
    best = float("inf")
    for _ in range(ROUNDS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _auto_threads() -> threads.ThreadPlan:
    """The plugin's auto plan now (defaults, no OMP/MKL variables), its load measured afresh."""
    settings = Settings(cli={}, ini=lambda name: "", env={})
    return threads.plan(settings, env={}, busy=threads.busy_cores(0.3))


@pytest.mark.slow
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_bench_contention(benchmark: Any, workload: str) -> None:
    if benchmark.disabled:  # a timing with and without a competing process, nothing else: meaningless untimed
        pytest.skip("timing only: runs timed in CI step 2 (--benchmark-enable --benchmark-only)")
    saved = torch.get_num_threads()
    fn = WORKLOADS[workload]()
    before = _torch_default_threads()
    rows: dict[str, dict[str, Any]] = {}
    try:
        quiet = _auto_threads()
        rows["quiet"] = {"threads_before": before, "threads_after": quiet.threads, "plan": quiet.reason,
                         "before_s": _best(fn, before), "after_s": _best(fn, quiet.threads)}
        competitor = subprocess.Popen([sys.executable, "-c", SPIN])
        try:
            time.sleep(0.2)
            loaded = _auto_threads()
            after_s = _best(fn, loaded.threads)
            benchmark.pedantic(fn, rounds=1, iterations=1)  # pytest-benchmark's record: the plugin's count
            rows["1 competitor"] = {"threads_before": before, "threads_after": loaded.threads, "plan": loaded.reason,
                                    "before_s": _best(fn, before), "after_s": after_s}
        finally:
            competitor.kill()
            competitor.wait()
    finally:
        torch.set_num_threads(saved)
    for row in rows.values():
        row["ratio"] = row["before_s"] / row["after_s"]
    benchmark.extra_info.update({"workload": workload, "cores": threads.usable_cores(), **{
        f"{case}_{key}": value for case, row in rows.items() for key, value in row.items()}})
    lines = [f"\n{workload}: best of {ROUNDS}, torch default threads (before) vs the plugin's auto policy (after)",
             f"  {'load':<13} {'before':>16} {'after':>16} {'ratio':>7}  plan"]
    for case, row in rows.items():
        lines.append(f"  {case:<13} {row['before_s']:>9.3f} s ({row['threads_before']}t) "
                     f"{row['after_s']:>9.3f} s ({row['threads_after']}t) {row['ratio']:>6.1f}×  {row['plan']}")
    print("\n".join(lines))
    assert all(row["before_s"] > 0 and row["after_s"] > 0 for row in rows.values())
