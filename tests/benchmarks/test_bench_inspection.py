"""Benchmark: DeepInspect NAPVD + avg_bias, batched engine vs a direct loop over pairs and triplets.

The workload of a DeepInspect gate after the forward pass: the activity of 512 units on 10,000 inputs
predicted into 100 classes (the ``InspectionEngine``'s scatter-add updates in batches of 2,048, then
``compute``: p(n|k), the NAPVD matrix from Gram products, the confused pairs, avg_bias over all
triplets and the biased pairs); and 1,000 classes on 50,000 inputs (only with benchmarks enabled).
The classes come in groups of ten with similar unit profiles, so some pairs are confusable and the
bias is not trivially zero. The reference is the straightforward implementation: p(n|k) class by
class, NAPVD pair by pair (numpy over the units), bias triplet by triplet in Python. It runs on all
100 classes (and on the first 100 of the 1,000, its time extrapolated: pairs × (K/K_sub)², triplets ×
(K/K_sub)³); both give the same NAPVD and avg_bias to 1e-12. Times (the session's torch threads and a
single thread, which is steadier on a shared machine), the time with labels (type-1 confusion and
avg_cd too) and the ratio go to ``benchmark.extra_info`` and are printed. Under
``--benchmark-disable`` (the suite's default) it runs 20 classes × 64 units × 1,000 inputs as a check.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from _timing import engine_seconds

from pytest_dnnsafety.engines.inspection.deepinspect import InspectionEngine

N_CLASSES, N_UNITS, N_INPUTS = 100, 512, 10_000
BIG_CLASSES, BIG_INPUTS, SUB_CLASSES = 1_000, 50_000, 100
BATCH = 2048


def make_case(k: int, n: int, n_inputs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activity (bool), predictions and labels: classes in groups of ten sharing a noisy unit profile."""
    gen = torch.Generator().manual_seed(seed)
    groups = torch.rand(-(-k // 10), n, generator=gen) ** 2
    profiles = (groups.repeat_interleave(10, 0)[:k] + 0.15 * torch.randn(k, n, generator=gen)).clamp(0, 1)
    pred = torch.randint(0, k, (n_inputs,), generator=gen)
    active = torch.rand(n_inputs, n, generator=gen) < profiles[pred]
    noise = torch.randint(0, k, (n_inputs,), generator=gen)
    labels = torch.where(torch.rand(n_inputs, generator=gen) < 0.8, pred, noise)
    return active, pred, labels


def engine_run(active: torch.Tensor, pred: torch.Tensor, k: int, labels: torch.Tensor | None = None):
    engine = InspectionEngine(active.shape[1], k)
    for start in range(0, active.shape[0], BATCH):
        stop = start + BATCH
        engine.update(active[start:stop], pred[start:stop], None if labels is None else labels[start:stop])
    return engine.compute()


def loop_reference(active: np.ndarray, pred: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """NAPVD and avg_bias the direct way: per class, per pair (numpy over units), per triplet (Python)."""
    times: dict[str, float] = {}
    start = time.perf_counter()
    p = np.stack([active[pred == c].mean(axis=0) for c in range(k)], axis=1)  # every class is predicted here
    times["p"] = time.perf_counter() - start
    start = time.perf_counter()
    d = np.zeros((k, k))
    for a in range(k):
        for b in range(a + 1, k):
            used = (p[:, a] > 0) | (p[:, b] > 0)
            diff = p[used, a] - p[used, b]
            d[a, b] = d[b, a] = math.sqrt(float(diff @ diff)) / math.sqrt(int(used.sum())) if used.any() else 0.0
    times["pairs"] = time.perf_counter() - start
    start = time.perf_counter()
    cutoff = float(d.mean() - d.std())
    rows = d.tolist()
    bias = np.zeros((k, k))
    for a in range(k):
        da = rows[a]
        for b in range(a + 1, k):
            db, total = rows[b], 0.0
            for c in range(k):
                x, y = da[c], db[c]
                if x > 1e-5 and y > 1e-5 and (x < cutoff or y < cutoff):
                    total += abs(x / (x + y) - 0.5)
            bias[a, b] = bias[b, a] = total / (k - 2)
    times["triplets"] = time.perf_counter() - start
    return d, bias, times


def _best(fn, rounds: int = 3) -> float:
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _single_thread(fn, rounds: int = 3) -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _best(fn, rounds)
    finally:
        torch.set_num_threads(threads)


def _check_against_loop(res, active: torch.Tensor, pred: torch.Tensor, k: int):
    d, bias, times = loop_reference(active.numpy(), pred.numpy(), k)
    max_napvd = float(np.abs(res.napvd.numpy() - d).max())
    max_bias = float(np.abs(res.avg_bias.numpy() - bias).max())
    assert max_napvd <= 1e-12 and max_bias <= 1e-12, (max_napvd, max_bias)
    assert float(res.pair_bias.max()) > 0 and bool(res.confused.any())
    return times, max(max_napvd, max_bias)


def test_bench_napvd_and_bias_100_classes(benchmark) -> None:
    full = not getattr(benchmark, "disabled", False)
    k, n, n_inputs = (N_CLASSES, N_UNITS, N_INPUTS) if full else (20, 64, 1_000)
    active, pred, labels = make_case(k, n, n_inputs)
    res = benchmark.pedantic(engine_run, args=(active, pred, k), rounds=3, iterations=1, warmup_rounds=1)
    seconds = engine_seconds(benchmark, lambda: engine_run(active, pred, k))
    single = _single_thread(lambda: engine_run(active, pred, k))
    labelled = _best(lambda: engine_run(active, pred, k, labels))
    assert res.n_pairs == k * (k - 1) // 2
    times, max_diff = _check_against_loop(res, active, pred, k)
    loop_seconds = sum(times.values())
    benchmark.extra_info.update({
        "classes": k, "units": n, "inputs": n_inputs, "batch": BATCH, "engine_seconds": seconds,
        "engine_seconds_single_thread": single, "engine_seconds_with_labels": labelled,
        "loop_seconds": loop_seconds, "loop_seconds_parts": times, "ratio": loop_seconds / seconds,
        "ratio_single_thread": loop_seconds / single, "max_abs_difference": max_diff,
        "confused_pairs": int(res.confused.sum()), "biased_pairs": int(res.biased.sum()),
        "max_avg_bias": res.max_bias(), "target_seconds": 1.0, "torch_threads": torch.get_num_threads(),
    })
    print(f"\nDeepInspect NAPVD + avg_bias, {k} classes × {n} units × {n_inputs:,} inputs: engine {seconds:.3f} s "
          f"({torch.get_num_threads()} threads; 1 thread {single:.3f} s; with labels {labelled:.3f} s); direct loop "
          f"{loop_seconds:.2f} s (p {times['p']:.2f}, pairs {times['pairs']:.2f}, triplets {times['triplets']:.2f}); "
          f"ratio ×{loop_seconds / seconds:,.0f} (1 thread ×{loop_seconds / single:,.0f}); max |difference| "
          f"{max_diff:.1e}; {int(res.confused.sum())} confused, {int(res.biased.sum())} biased pairs")


def test_bench_napvd_and_bias_1000_classes(benchmark) -> None:
    if getattr(benchmark, "disabled", False):
        pytest.skip("1,000 classes only with benchmarks enabled (--benchmark-enable)")
    k = BIG_CLASSES
    active, pred, labels = make_case(k, N_UNITS, BIG_INPUTS, seed=1)
    res = benchmark.pedantic(engine_run, args=(active, pred, k), rounds=1, iterations=1, warmup_rounds=0)
    seconds = engine_seconds(benchmark, lambda: engine_run(active, pred, k))
    single = _single_thread(lambda: engine_run(active, pred, k), rounds=1)
    labelled = _best(lambda: engine_run(active, pred, k, labels), rounds=1)
    sub = pred < SUB_CLASSES
    sub_res = engine_run(active[sub], pred[sub], SUB_CLASSES)
    times, max_diff = _check_against_loop(sub_res, active[sub], pred[sub], SUB_CLASSES)
    scale = k / SUB_CLASSES
    loop_full = (times["p"] + times["pairs"]) * scale ** 2 + times["triplets"] * scale ** 3
    benchmark.extra_info.update({
        "classes": k, "units": N_UNITS, "inputs": BIG_INPUTS, "engine_seconds": seconds,
        "engine_seconds_single_thread": single, "engine_seconds_with_labels": labelled,
        "loop_classes": SUB_CLASSES, "loop_seconds_subsample": sum(times.values()), "loop_seconds_parts": times,
        "loop_full_seconds_estimated": loop_full, "ratio_estimated": loop_full / seconds,
        "max_abs_difference_subsample": max_diff, "confused_pairs": int(res.confused.sum()),
        "biased_pairs": int(res.biased.sum()), "target_seconds": 60.0, "torch_threads": torch.get_num_threads(),
    })
    print(f"\nDeepInspect NAPVD + avg_bias, {k:,} classes × {N_UNITS} units × {BIG_INPUTS:,} inputs: engine "
          f"{seconds:.2f} s (1 thread {single:.2f} s; with labels {labelled:.2f} s); direct loop on {SUB_CLASSES} "
          f"classes {sum(times.values()):.2f} s → est. {loop_full / 60:.1f} min for {k:,}; ratio "
          f"×{loop_full / seconds:,.0f}; max |difference| on the subsample {max_diff:.1e}")
