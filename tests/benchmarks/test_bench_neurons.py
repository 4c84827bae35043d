"""Benchmarks: neuron k-activation coverage engine vs a naive Python loop (no timing asserts).

Sizes from the paper (Cheng et al. 2018, §II-B; its reference kit needed 48.9 s for 256 neurons ×
1,000 inputs at k = 2): 256 × 1,000 at k = 2 and k = 3, and 512 × 100,000 at k = 2.

The naive reference walks every k-tuple and every input in Python and marks the seen patterns
in a set, like the paper's kit. Its time grows with (tuples × inputs), so it runs on a
subsample (fewer inputs, for k = 3 also fewer neurons) of about 10^7 tuple-input steps; its
steps per second give the estimated time on the full size. The naive result is checked equal
to the engine's on the same subsample. Times, rates and ratios go to ``benchmark.extra_info``.
"""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch
from _timing import engine_seconds as best_seconds

from pytest_dnnsafety.engines import NeuronKActivationEngine

#: (neurons, inputs, k, naive neurons, naive inputs)
CASES = {
    "256x1000_k2": (256, 1_000, 2, 256, 150),
    "256x1000_k3": (256, 1_000, 3, 64, 150),
    "512x100000_k2": (512, 100_000, 2, 512, 60),
}


def activations(n_inputs: int, n_neurons: int, seed: int = 20180427) -> torch.Tensor:
    """ReLU-like activations; per-neuron biases make some neurons rarely (or almost always) fire."""
    gen = torch.Generator().manual_seed(seed + n_neurons)
    bias = torch.randn(n_neurons, generator=gen) * 1.5 - 0.5
    return torch.relu(torch.randn(n_inputs, n_neurons, generator=gen) + bias)


def naive_k_activation(on_rows: list[list[int]], n_neurons: int, k: int) -> int:
    """The paper's procedure, literally: for every k-tuple, for every input, mark the pattern."""
    occupied: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for tup in itertools.combinations(range(n_neurons), k):
        for row in on_rows:
            occupied.add((tup, tuple(row[i] for i in tup)))
    return len(occupied)


def engine_k_activation(acts: torch.Tensor, k: int) -> int:
    engine = NeuronKActivationEngine(acts.shape[1], k=k)
    engine.update(acts)
    return engine.compute().covered



@pytest.mark.parametrize("case", list(CASES))
def test_bench_k_activation_vs_naive(benchmark, case: str) -> None:
    n_neurons, n_inputs, k, naive_neurons, naive_inputs = CASES[case]
    acts = activations(n_inputs, n_neurons)
    covered = benchmark.pedantic(engine_k_activation, args=(acts, k), rounds=3, iterations=1, warmup_rounds=1)
    total = math.comb(n_neurons, k) * 2**k
    assert 0 < covered <= total
    engine_seconds = best_seconds(benchmark, lambda: engine_k_activation(acts, k))

    sample = acts[:naive_inputs, :naive_neurons]
    on_rows = (sample > 0).to(torch.int64).tolist()
    start = time.perf_counter()
    naive_covered = naive_k_activation(on_rows, naive_neurons, k)
    naive_seconds = time.perf_counter() - start
    assert naive_covered == engine_k_activation(sample, k)

    naive_steps = math.comb(naive_neurons, k) * naive_inputs
    full_steps = math.comb(n_neurons, k) * n_inputs
    naive_rate = naive_steps / naive_seconds
    naive_full_estimate = full_steps / naive_rate
    benchmark.extra_info.update(
        {
            "neurons": n_neurons,
            "inputs": n_inputs,
            "k": k,
            "cells": total,
            "covered": covered,
            "engine_seconds": engine_seconds,
            "engine_inputs_per_s": n_inputs / engine_seconds,
            "naive_neurons": naive_neurons,
            "naive_inputs": naive_inputs,
            "naive_seconds": naive_seconds,
            "naive_tuple_input_steps_per_s": naive_rate,
            "naive_full_seconds_estimated": naive_full_estimate,
            "speedup_estimated": naive_full_estimate / engine_seconds,
            "torch_threads": torch.get_num_threads(),
        }
    )
    print(
        f"\n{case}: engine {engine_seconds:.4f} s ({n_inputs / engine_seconds:,.0f} inputs/s, "
        f"{covered:,}/{total:,} cells); naive {naive_seconds:.2f} s on {naive_neurons}×{naive_inputs} "
        f"({naive_rate:,.0f} tuple·input steps/s) → est. {naive_full_estimate:,.0f} s full; "
        f"speedup ×{naive_full_estimate / engine_seconds:,.0f}"
    )
