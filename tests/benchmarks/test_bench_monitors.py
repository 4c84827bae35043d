"""Benchmarks: runtime-monitor overhead on 10,000 digits images, and batched scoring vs per-input loops.

Overhead (Ferreira et al.: "monitor time per input relative to the model's"): each monitor is fitted
on 1,000 digits and scored on 10,000 (the 1,797 digits repeated) with the digits CNN, batch 256,
through :func:`~pytest_dnnsafety.engines.monitors.measure_overhead`: the model's forward pass per
input, and what the monitor adds once the shared pass is cached (output and feature monitors only
their arithmetic; ODIN its forward + input-gradient backward + second forward). The ratio is the
monitor's cost in forward-pass equivalents (ODIN: two forwards and one input-gradient backward, so
about 3 on a CPU; reported, never asserted: wall-clock ratios depend on the machine and its load).
Ratios go to ``benchmark.extra_info`` and are printed.

Batched vs naive: the Mahalanobis and outside-the-box scores of the 10,000 inputs as matrix
products over all inputs, classes and boxes, against a per-input Python loop (each input's distance
to each class or box computed on its own), run on a subsample of 200 and extrapolated; both give the
same scores on the subsample. Under ``--benchmark-disable`` (the suite's default) everything runs on
1,000 images and a loop over 20, as a quick check.
"""

from __future__ import annotations

import time

import pytest
import torch
from _timing import engine_seconds

from _digits import digits_cnn, digits_images
from pytest_dnnsafety.engines.monitors import (MSP, ODIN, ActivationPatterns, Energy, Mahalanobis, MonitorView,
                                               OutsideTheBox, fit_monitor, measure_overhead)

N_IMAGES = 10_000
N_LOOP = 200
LAYER = "classifier.1"

MONITORS = {
    "msp": lambda: MSP(),
    "energy": lambda: Energy(),
    "odin": lambda: ODIN(temperature=1000.0, epsilon=0.0014),
    "outside_the_box": lambda: OutsideTheBox(layer=LAYER, clusters=3, enlarge=0.1),
    "patterns": lambda: ActivationPatterns(layer=LAYER),
    "mahalanobis": lambda: Mahalanobis(layer=LAYER),
}


def _setup(full: bool) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = digits_cnn()
    x_fit, y_fit = digits_images(1000)
    x, _ = digits_images(N_IMAGES if full else 1000)
    return model, x_fit, y_fit, x


@pytest.mark.parametrize("name", list(MONITORS))
def test_bench_monitor_overhead(benchmark, name: str) -> None:
    full = not getattr(benchmark, "disabled", False)
    model, x_fit, y_fit, x = _setup(full)
    monitor = fit_monitor(MONITORS[name](), model, (x_fit, y_fit), seed=0)
    view = MonitorView(model, x, batch_size=256, plan=monitor.layers())
    scores = benchmark.pedantic(monitor.score, args=(view,), rounds=3, iterations=1, warmup_rounds=1)
    assert scores.shape == (x.shape[0],) and bool(torch.isfinite(scores).all())
    o = measure_overhead(monitor, view, repeats=5 if full else 2)
    benchmark.extra_info.update({"monitor": name, "images": x.shape[0], **o.to_dict()})
    print(f"\n{name}: monitor {o.monitor_s_per_input * 1e6:.2f} µs/input, model {o.model_s_per_input * 1e6:.2f} "
          f"µs/input, ratio {o.ratio:.3f} forward-equivalents, state {o.state_bytes / 1024:.1f} KiB")


def _mahalanobis_loop(monitor: Mahalanobis, feats: torch.Tensor) -> torch.Tensor:
    means, _, seen = monitor.stats.compute()
    precision = monitor.precision()
    out = torch.empty(feats.shape[0], dtype=torch.float64)
    for i in range(feats.shape[0]):
        best = float("inf")
        for k in range(means.shape[0]):
            if bool(seen[k]):
                diff = feats[i].double() - means[k]
                best = min(best, float(diff @ precision @ diff))
        out[i] = best
    return out


def _boxes_loop(monitor: OutsideTheBox, feats: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    lo, hi, valid = monitor.boxes()
    floor = torch.clamp_min(1e-3 * (monitor.span_hi - monitor.span_lo), 1e-6)
    out = torch.empty(feats.shape[0])
    for i in range(feats.shape[0]):
        best = float("inf")
        k = int(pred[i])
        for m in range(lo.shape[1]):
            if bool(valid[k, m]):
                den = torch.maximum(hi[k, m] - lo[k, m], floor)
                gap = torch.maximum(torch.maximum(lo[k, m] - feats[i], feats[i] - hi[k, m]), torch.zeros(()))
                best = min(best, float((gap / den).max()))
        out[i] = best
    return out


@pytest.mark.parametrize("name", ["mahalanobis", "outside_the_box"])
def test_bench_feature_monitor_batched_vs_per_input_loop(benchmark, name: str) -> None:
    full = not getattr(benchmark, "disabled", False)
    n_loop = N_LOOP if full else 20
    model, x_fit, y_fit, x = _setup(full)
    monitor = fit_monitor(MONITORS[name](), model, (x_fit, y_fit), seed=0)
    view = MonitorView(model, x, batch_size=256, plan=monitor.layers())
    feats, pred = view.features(LAYER, monitor.reduce), view.predictions()
    scores = benchmark.pedantic(monitor.score, args=(view,), rounds=3, iterations=1, warmup_rounds=1)
    batched = engine_seconds(benchmark, lambda: monitor.score(view))
    start = time.perf_counter()
    if name == "mahalanobis":
        looped = _mahalanobis_loop(monitor, feats[:n_loop])
        assert torch.allclose(looped, scores[:n_loop].double(), rtol=1e-3, atol=1e-3)
    else:
        looped = _boxes_loop(monitor, feats[:n_loop], pred[:n_loop])
        assert torch.allclose(looped, scores[:n_loop], rtol=1e-5, atol=1e-6)
    loop_full = (time.perf_counter() - start) * x.shape[0] / n_loop
    benchmark.extra_info.update({"monitor": name, "images": x.shape[0], "batched_s": batched,
                                 "loop_s_extrapolated": loop_full, "ratio": loop_full / batched})
    print(f"\n{name} scores of {x.shape[0]} inputs: batched {batched * 1e3:.1f} ms, per-input loop "
          f"{loop_full:.2f} s (extrapolated from {n_loop}), ×{loop_full / batched:.0f}")
