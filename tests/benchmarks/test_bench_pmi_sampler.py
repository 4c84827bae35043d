"""Benchmark: ``max_pmi_ub``'s ball-cell Monte Carlo against the model's own batched forward pass (issue #21).

The issue's target: the gate's queries per second on L∞/L2 balls around images within 2× of the
model's batched forward throughput, i.e. the sampler (uniforms, ball corners, clipping, tallies)
must not dominate. Two models of the scale project (``benchmarks/scale_project``):
``resnet18(width=16, stem="cifar")`` on 3×32×32 and ``resnet18(width=8)`` (ImageNet stem) on
3×224×224. For each norm: the model's forward rate (inputs/s, ``torch.no_grad``, eval, one batch
of :data:`FORWARD_BATCH`) and the gate's Monte Carlo rate (:meth:`ReliabilityAssessor.sample`,
``cells="balls"``, ``clip=(0, 1)``, ``batch_size="auto"``: model queries/s) are timed alternately,
best of :data:`REPEATS` (a shared machine's load only ever slows a run), and ``ratio`` =
forward rate / sampler rate goes to ``benchmark.extra_info``. Reported, never asserted.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from pytest_dnnsafety.engines.reliability import ReliabilityAssessor, ReliabilityOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "scale_project"))
from scale_demo.models import resnet18  # noqa: E402

FORWARD_BATCH = 256
REPEATS = 3


def _rates(model: torch.nn.Module, shape: tuple[int, ...], norm: str, balls: int, per_ball: int,
           batch: int, repeats: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    centres = 0.1 + 0.8 * torch.rand((balls, *shape), generator=gen)
    labels = torch.arange(balls) % 10
    radius = 8 / 255 if norm == "linf" else 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assessor = ReliabilityAssessor(centres, (centres, labels), options=ReliabilityOptions.of(
            cells="balls", norm=norm, radius=radius, clip=(0.0, 1.0), samples_per_cell=per_ball, bootstrap=0, seed=1))
    x = torch.rand((batch, *shape), generator=gen)
    forward = sampler = 0.0
    with torch.no_grad():
        model(x[:2])
        for _ in range(repeats):
            start = time.perf_counter()
            model(x)
            forward = max(forward, batch / (time.perf_counter() - start))
            start = time.perf_counter()
            assessor.sample(model)
            sampler = max(sampler, assessor.queries / (time.perf_counter() - start))
    return {"forward_inputs_per_s": forward, "sampler_queries_per_s": sampler, "ratio": forward / sampler,
            "queries": assessor.queries, "blocks_per_batch": assessor.blocks_per_batch,
            "batch_inputs": assessor.blocks_per_batch * assessor._block}


def _report(benchmark, name: str, model: torch.nn.Module, shape: tuple[int, ...], balls: int, per_ball: int,
            batch: int) -> None:
    repeats = REPEATS if not benchmark.disabled else 1
    found: dict[str, dict[str, float]] = {}

    def run() -> None:
        for norm in ("linf", "l2"):
            found[norm] = _rates(model, shape, norm, balls, per_ball, batch, repeats)

    benchmark.pedantic(run, rounds=1, iterations=1, warmup_rounds=0)
    benchmark.extra_info.update({"model": name, "shape": list(shape), "torch_threads": torch.get_num_threads(),
                                 **{f"{norm}_{k}": v for norm, rates in found.items() for k, v in rates.items()}})
    for norm, rates in found.items():
        print(f"\n{name} {norm}: forward {rates['forward_inputs_per_s']:,.0f} inputs/s (batch {batch}), gate sampler "
              f"{rates['sampler_queries_per_s']:,.0f} queries/s (batches of {rates['batch_inputs']:.0f}): "
              f"ratio ×{rates['ratio']:.2f}")


def test_bench_pmi_sampler_cifar_resnet(benchmark) -> None:
    model = resnet18(width=16, stem="cifar").eval()
    per_ball = 512 if not benchmark.disabled else 64
    _report(benchmark, "resnet18(width=16, stem='cifar')", model, (3, 32, 32), 8, per_ball,
            FORWARD_BATCH if not benchmark.disabled else 64)


@pytest.mark.slow
def test_bench_pmi_sampler_imagenet_resnet(benchmark) -> None:
    if benchmark.disabled:  # seconds per batch of 224×224 images on a CPU: timed in the benchmark step only
        pytest.skip("224x224 benchmark: runs timed with --benchmark-enable --benchmark-only")
    model = resnet18(width=8).eval()
    _report(benchmark, "resnet18(width=8)", model, (3, 224, 224), 4, 64, 64)
