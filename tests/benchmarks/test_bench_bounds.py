"""Benchmark: certified margin bounds (IBP, CROWN) on the digits CNN for 1,000 inputs at ε = 0.02 (no timing asserts).

The certified-robustness gate bounds ``z_y − z_j`` over the L∞ ball ∩ [0, 1] of every input
(:meth:`BoundedModel.margin_lower_bounds`): IBP (Gowal et al. 2018) is a few interval passes;
CROWN (Zhang et al. 2018) also bounds every intermediate ReLU/max-pool input by a backward pass
of its own, which is where the time goes. The engine runs a whole batch at a time (the runner's
default batch size, 256); the reference calls the same bounds one input at a time, as a
per-image verifier would, on a subsample of the inputs, extrapolated to the 1,000 (the margins
agree on that subsample). Times, verified counts, the ratio and the process's peak resident
memory go to ``benchmark.extra_info`` and are printed. Under ``--benchmark-disable`` (the test
suite) the engine runs once on one batch and the loop on a few inputs: a correctness check, not a
timing.
"""

from __future__ import annotations

import resource
import time

import pytest
import torch

from _digits import digits_cnn, digits_images
from pytest_dnnsafety.engines.bounds.model import BoundedModel
from pytest_dnnsafety.engines.bounds.box import input_box

N_INPUTS = 1_000
EPS = 0.02
CLIP = (0.0, 1.0)
BATCH = 256
N_LOOP = {"ibp": 200, "crown": 40}


def batched_margins(bounded: BoundedModel, x: torch.Tensor, y: torch.Tensor, method: str) -> torch.Tensor:
    parts = []
    for i in range(0, x.shape[0], BATCH):
        lo, hi = input_box(x[i:i + BATCH], EPS, CLIP)
        parts.append(bounded.margin_lower_bounds(lo, hi, y[i:i + BATCH], method))
    return torch.cat(parts)


def loop_margins(bounded: BoundedModel, x: torch.Tensor, y: torch.Tensor, method: str) -> torch.Tensor:
    rows = []
    for i in range(x.shape[0]):
        lo, hi = input_box(x[i:i + 1], EPS, CLIP)
        rows.append(bounded.margin_lower_bounds(lo, hi, y[i:i + 1], method))
    return torch.cat(rows)


def _max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


@pytest.mark.parametrize("method", ["ibp", "crown"])
def test_bench_margin_bounds_digits_cnn(benchmark, method: str) -> None:
    full = not getattr(benchmark, "disabled", False)
    n_inputs = N_INPUTS if full else BATCH
    model = digits_cnn()
    x, y = digits_images(n_inputs)
    bounded = BoundedModel(model)
    runs: list[float] = []

    def engine() -> torch.Tensor:
        start = time.perf_counter()
        out = batched_margins(bounded, x, y, method)
        runs.append(time.perf_counter() - start)
        return out

    rss_before = _max_rss_mb()
    margins = benchmark.pedantic(engine, rounds=3, iterations=1, warmup_rounds=1)
    rss_after = _max_rss_mb()
    stats = getattr(benchmark, "stats", None)
    engine_seconds = float(stats.stats.min) if stats is not None else min(runs)
    assert margins.shape == (n_inputs, 10)
    worst = margins.min(dim=1).values
    verified = int((worst > 0).sum())
    with torch.no_grad():
        correct = int((model(x).argmax(1) == y).sum())
    assert verified <= correct

    n_loop = N_LOOP[method] if full else 4
    start = time.perf_counter()
    looped = loop_margins(bounded, x[:n_loop], y[:n_loop], method)
    loop_seconds = time.perf_counter() - start
    finite = torch.isfinite(looped)
    assert torch.allclose(looped[finite], margins[:n_loop][finite], rtol=1e-4, atol=1e-4)
    loop_full = loop_seconds * n_inputs / n_loop

    benchmark.extra_info.update(
        {
            "method": method,
            "inputs": n_inputs,
            "eps": EPS,
            "batch_size": BATCH,
            "engine_seconds": engine_seconds,
            "engine_inputs_per_s": n_inputs / engine_seconds,
            "verified": verified,
            "correct": correct,
            "verified_share": verified / n_inputs,
            "margin_median": float(worst.median()),
            "loop_inputs": n_loop,
            "loop_seconds": loop_seconds,
            "loop_full_seconds_estimated": loop_full,
            "ratio_estimated": loop_full / engine_seconds,
            "max_rss_mb_before": rss_before,
            "max_rss_mb_after": rss_after,
            "torch_threads": torch.get_num_threads(),
        }
    )
    print(
        f"\n{method} margins, digits CNN, {n_inputs} inputs at ε={EPS}: {engine_seconds:.3f} s "
        f"({n_inputs / engine_seconds:,.0f} inputs/s, batches of {BATCH}); verified {verified}/{n_inputs} "
        f"(correct {correct}); per-input loop {loop_seconds:.2f} s on {n_loop} → est. {loop_full:.1f} s; "
        f"ratio ×{loop_full / engine_seconds:,.1f}; peak RSS {rss_after:,.0f} MB"
    )
