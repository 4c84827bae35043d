"""Benchmark: DeepQuant's pattern search on 1,000 digits images, batched vs one input at a time.

:func:`~pytest_dnnsafety.engines.quantification.lipschitz_search` (GPS, L∞ ball of d = 0.05,
top class vs runner-up, one start, 50 polls) evaluates each poll — 2n + 1 = 129 points per 8×8
image — for every still-active input in one batched forward pass (at most 8,192 rows each). The
reference runs the same search input by input (``x[i:i+1]`` with ``index_offset=i``: the same
draws, the same numbers), as a per-image loop would; it runs on a subsample of 10 images and its
time is extrapolated to the 1,000. On the subsample both give the same Q (up to float32 rounding of
batched vs single-image convolutions). The batched search also runs once with the certified
companion (CROWN bisection, 10 steps) to time it. Times and the ratio go to
``benchmark.extra_info`` and are printed. Under ``--benchmark-disable`` (the suite's default) it
runs on 64 images with 10 polls and a loop over 4, as a quick check.
"""

from __future__ import annotations

import time

import torch
from _timing import engine_seconds

from _digits import digits_cnn, digits_images
from pytest_dnnsafety.engines.quantification import SafetyProperty, SearchBudget, certified_radius, lipschitz_search

N_IMAGES = 1_000
N_LOOP = 10
ITERATIONS = 50
D = 0.05
SAFETY = SafetyProperty(d=D, clip=(0.0, 1.0))
OPTIONS = dict(seed=0, outputs="logits")


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def test_bench_pattern_search_batched_vs_one_input_at_a_time(benchmark) -> None:
    full = not getattr(benchmark, "disabled", False)
    n_images, n_loop, iterations = (N_IMAGES, N_LOOP, ITERATIONS) if full else (64, 4, 10)
    device = _device()
    model = digits_cnn().to(device)
    x, _ = digits_images(n_images)
    x = x.to(device)

    def batched():
        res = lipschitz_search(model, x, SAFETY, SearchBudget("gps", iterations=iterations, starts=1), **OPTIONS)
        _sync(device)
        return res

    res = benchmark.pedantic(batched, rounds=3 if full else 1, iterations=1, warmup_rounds=1)
    batched_seconds = engine_seconds(benchmark, batched)
    assert res.q.shape == (n_images,) and bool((res.radius >= 0).all() & (res.radius <= D).all())

    start = time.perf_counter()
    singles = [lipschitz_search(model, x[i:i + 1], SAFETY, SearchBudget("gps", iterations=iterations, starts=1),
                                index_offset=i, **OPTIONS)
               for i in range(n_loop)]
    _sync(device)
    loop_seconds = time.perf_counter() - start
    q_loop = torch.cat([s.q for s in singles])
    max_rel = float(((q_loop - res.q[:n_loop]).abs() / res.q[:n_loop].clamp_min(1e-12)).max())
    assert max_rel < 1e-3  # the same search (float32 convolutions round differently in a batch of 1)

    start = time.perf_counter()
    cert, reason = certified_radius(model, x, d=D, method="crown", steps=10)
    _sync(device)
    cert_seconds = time.perf_counter() - start
    assert reason is None and bool((cert <= res.unsafe_distance).all())

    loop_full = loop_seconds * n_images / n_loop
    rows = int(res.evaluations.sum())
    benchmark.extra_info.update(
        {
            "device": str(device),
            "images": n_images,
            "iterations": iterations,
            "points_per_poll": 2 * 64 + 1,
            "model_evaluations": rows,
            "batched_seconds": batched_seconds,
            "batched_evaluations_per_s": rows / batched_seconds,
            "loop_images": n_loop,
            "loop_seconds": loop_seconds,
            "loop_full_seconds_estimated": loop_full,
            "ratio_estimated": loop_full / batched_seconds,
            "max_relative_q_difference": max_rel,
            "certified_seconds": cert_seconds,
            "min_estimate": float(res.radius.min()),
            "min_certified": float(cert.min()),
            "torch_threads": torch.get_num_threads(),
        }
    )
    print(
        f"\npattern search (gps, L∞ d={D}, {iterations} polls of {2 * 64 + 1} points) on {n_images} digits, "
        f"{device}: "
        f"batched {batched_seconds:.2f} s ({rows / batched_seconds:,.0f} model evaluations/s); one input at a time "
        f"{loop_seconds:.2f} s on {n_loop} images → est. {loop_full:.1f} s for {n_images}; ratio "
        f"×{loop_full / batched_seconds:,.1f}; max relative |ΔQ| {max_rel:.1e}; certified radii (CROWN, 11 bound "
        f"calls) {cert_seconds:.2f} s; min estimate {float(res.radius.min()):.4f}, "
        f"min certified {float(cert.min()):.4f}"
    )
