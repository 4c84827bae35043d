"""Benchmarks: neuron k-activation coverage engine vs a naive Python loop (no timing asserts).

Sizes from the paper (Cheng et al. 2018, §II-B; its reference kit needed 48.9 s for 256 neurons ×
1,000 inputs at k = 2): 256 × 1,000 at k = 2 and k = 3, and 512 × 100,000 at k = 2.

The naive reference walks every k-tuple and every input in Python and marks the seen patterns
in a set, like the paper's kit. Its time grows with (tuples × inputs), so it runs on a
subsample (fewer inputs, for k = 3 also fewer neurons) of about 10^7 tuple-input steps; its
steps per second give the estimated time on the full size. The naive result is checked equal
to the engine's on the same subsample. Times, rates and ratios go to ``benchmark.extra_info``.

Engine vs a plain Gram-matrix implementation (k = 2, 2,048 neurons × 100,000 inputs streamed in
1,000-row batches as a gate's forward pass would): the reference keeps the on/off matrix A of each
batch as float32, accumulates ``G += AᵀA`` and the column sums, and derives the four pattern counts of
every pair at the end (``n11 = G_ij``, ``n10 = S_i − G_ij``, …; a cell is occupied iff its count is
positive). The activations are layer-like: ReLU of correlated pre-activations (32 latent factors plus
noise), firing rates 5–60 %, 12 % of the neurons rarely on (0.01–0.5 %), 3 % never on, 5 % near
copies of another neuron. Contenders alternate (engine, Gram, engine, …; 3 rounds), both occupied
tables are asserted identical (and the engine's covered count), and ``ratio_gram_over_plugin``
(median Gram time / median engine time, >1 = engine faster) goes to ``extra_info``. Under
``--benchmark-disable`` it runs 192 neurons × 6,000 inputs once, as a correctness check.
"""

from __future__ import annotations

import itertools
import math
import statistics
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


# ---------------------------------------------------------------------------- engine vs plain Gram matrix
def layer_batches(n_inputs: int, n_neurons: int, batch: int = 1_000, seed: int = 31) -> list[torch.Tensor]:
    """Layer-like post-ReLU activations in batches (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    factors = 32
    mix = torch.randn(factors, n_neurons, generator=gen) / math.sqrt(factors)
    std = (mix.pow(2).sum(0) + 0.5**2).sqrt()
    kind = torch.rand(n_neurons, generator=gen)
    rate = 0.05 + 0.55 * torch.rand(n_neurons, generator=gen)
    rare = kind < 0.12
    rate[rare] = (10 ** (-4 + 1.7 * torch.rand(n_neurons, generator=gen)))[rare]
    bias = -std * torch.special.ndtri(1 - rate)  # P(pre-activation + bias > 0) = rate
    bias[(kind >= 0.12) & (kind < 0.15)] = -50.0  # never on
    copies = (kind >= 0.15) & (kind < 0.20)
    source = torch.randint(0, n_neurons, (n_neurons,), generator=gen)[copies]
    out = []
    for start in range(0, n_inputs, batch):
        rows = min(batch, n_inputs - start)
        z = torch.randn(rows, factors, generator=gen) @ mix + 0.5 * torch.randn(rows, n_neurons, generator=gen)
        z[:, copies] = z[:, source] + 0.05 * torch.randn(rows, len(source), generator=gen)
        out.append(torch.relu(z + bias))
    return out


def gram_occupied(batches: list[torch.Tensor]) -> torch.Tensor:
    """The plain Gram-matrix implementation: ``(C(c, 2), 4)`` occupied table in the engine's layout."""
    c = batches[0].shape[1]
    gram = torch.zeros(c, c)
    sums = torch.zeros(c)
    n = 0
    for x in batches:
        a = (x > 0).to(torch.float32)
        gram.addmm_(a.T, a)
        sums += a.sum(0)
        n += a.shape[0]
    i, j = torch.triu_indices(c, c, 1)  # row-major: combinations order
    p, si, sj = gram[i, j], sums[i], sums[j]
    return torch.stack([n - si - sj + p > 0, sj - p > 0, si - p > 0, p > 0], dim=1)


def engine_occupied(batches: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    engine = NeuronKActivationEngine(batches[0].shape[1], k=2)
    for x in batches:
        engine.update(x)
    return engine.occupied, engine.compute().covered


def test_bench_k2_vs_plain_gram(benchmark) -> None:
    full = not getattr(benchmark, "disabled", False)
    n_neurons, n_inputs = (2_048, 100_000) if full else (192, 6_000)
    batches = layer_batches(n_inputs, n_neurons)
    rounds = 3 if full else 1
    engine_times: list[float] = []
    gram_times: list[float] = []
    for _ in range(rounds):  # interleaved: engine, Gram, engine, Gram, …
        start = time.perf_counter()
        occupied, covered = engine_occupied(batches)
        engine_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        reference = gram_occupied(batches)
        gram_times.append(time.perf_counter() - start)
        assert torch.equal(occupied, reference)
        assert covered == int(reference.sum())
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    engine_s, gram_s = statistics.median(engine_times), statistics.median(gram_times)
    ratio = gram_s / engine_s
    total = math.comb(n_neurons, 2) * 4
    benchmark.extra_info.update(
        {
            "neurons": n_neurons,
            "inputs": n_inputs,
            "batch_rows": batches[0].shape[0],
            "cells": total,
            "covered": covered,
            "engine_seconds_median": engine_s,
            "engine_seconds_min": min(engine_times),
            "gram_seconds_median": gram_s,
            "gram_seconds_min": min(gram_times),
            "ratio_gram_over_plugin": ratio,
            "ratio_gram_over_plugin_min": min(gram_times) / min(engine_times),
            "rounds": rounds,
            "torch_threads": torch.get_num_threads(),
        }
    )
    print(
        f"\nk=2, {n_neurons} neurons × {n_inputs:,} inputs ({covered:,}/{total:,} cells): engine "
        f"{engine_s:.2f} s (min {min(engine_times):.2f}), plain Gram {gram_s:.2f} s (min {min(gram_times):.2f}); "
        f"ratio_gram_over_plugin {ratio:.2f} over {rounds} interleaved rounds, tables identical"
    )
