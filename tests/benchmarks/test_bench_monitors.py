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

Plugin vs direct torch, forward included: MSP, energy and Mahalanobis scores of 10,000 CIFAR-sized inputs
(3×32×32, a small seeded CNN: two conv–ReLU–max-pool stages and two dense layers, batch 256), once through
the plugin (``monitor.score`` on a fresh :class:`MonitorView`, so its shared pass runs: the runner, the
forward guard, the activation capture, the checks) and once as a plain torch loop (``model(x)`` per batch
under ``no_grad`` and the same score in a few torch ops; Mahalanobis reads the layer with a forward hook and
uses the fitted monitor's whitening). Interleaved rounds (plugin, direct, plugin, …), medians (and minima);
the scores are asserted equal first (MSP and energy bit for bit, Mahalanobis to float32 rounding).
``ratio_direct_over_plugin_<monitor>`` (median direct time / median plugin time, 1 = no overhead) goes to
``extra_info`` and is printed; under ``--benchmark-disable``: 300 inputs, one round.
"""

from __future__ import annotations

import statistics
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


# ----------------------------------------------------------------------------- plugin vs direct torch

BATCH = 256
HIDDEN = "7"  # the first dense layer's ReLU output (128 features) of the CIFAR-sized CNN below


def _cifar_cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Sequential(nn.Linear(32 * 8 * 8, 128)), nn.ReLU(), nn.Linear(128, 10)).eval()


def _direct(name: str, monitor, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The monitor's scores written directly in torch: a plain batch loop, the forward included."""
    parts, feats = [], []
    handle = None
    if name == "mahalanobis":
        handle = dict(model.named_modules())[HIDDEN].register_forward_hook(lambda m, a, out: feats.append(out))
        center, whiten, mw, seen = monitor.center, monitor.whiten, monitor.means_w, monitor.seen
        mm = (mw * mw).sum(1)
    try:
        with torch.no_grad():
            for start in range(0, x.shape[0], BATCH):
                logits = model(x[start:start + BATCH])
                if name == "msp":
                    parts.append(-torch.softmax(logits, dim=1).amax(dim=1))
                elif name == "energy":
                    parts.append(-torch.logsumexp(logits, dim=1))
                else:
                    z = (feats.pop() - center) @ whiten
                    d = ((z * z).sum(1, keepdim=True) - 2.0 * (z @ mw.T) + mm).clamp_min_(0.0)
                    parts.append(d.masked_fill_(~seen, float("inf")).amin(1))
    finally:
        if handle is not None:
            handle.remove()
    return torch.cat(parts)


DIRECT = {"msp": lambda: MSP(), "energy": lambda: Energy(), "mahalanobis": lambda: Mahalanobis(layer=HIDDEN)}


@pytest.mark.parametrize("name", list(DIRECT))
def test_bench_monitor_vs_direct_torch(benchmark, name: str) -> None:
    full = not getattr(benchmark, "disabled", False)
    n, n_fit, rounds = (N_IMAGES, 2_000, 7) if full else (300, 200, 1)
    model = _cifar_cnn()
    gen = torch.Generator().manual_seed(1)
    x_fit, x = torch.rand(n_fit, 3, 32, 32, generator=gen), torch.rand(n, 3, 32, 32, generator=gen)
    monitor = fit_monitor(DIRECT[name](), model, x_fit, seed=0)

    def plugin() -> torch.Tensor:  # a fresh view: its own shared pass (forward, capture, checks) every time
        return monitor.score(MonitorView(model, x, batch_size=BATCH, plan=monitor.layers()))

    mine, direct = plugin(), _direct(name, monitor, model, x)
    if name == "mahalanobis":  # the same float32 arithmetic on 256-row batches vs all rows: GEMM rounding only
        assert torch.allclose(mine, direct, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(mine, direct)
    plugin_times: list[float] = []
    direct_times: list[float] = []
    for _ in range(rounds):  # interleaved: plugin, direct, plugin, direct, …
        start = time.perf_counter()
        plugin()
        plugin_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        _direct(name, monitor, model, x)
        direct_times.append(time.perf_counter() - start)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    plugin_s, direct_s = statistics.median(plugin_times), statistics.median(direct_times)
    key = f"ratio_direct_over_plugin_{name}"
    benchmark.extra_info.update({
        "monitor": name, "images": n, "batch_size": BATCH, "rounds": rounds,
        "plugin_seconds_median": plugin_s, "plugin_seconds_min": min(plugin_times),
        "direct_seconds_median": direct_s, "direct_seconds_min": min(direct_times),
        key: direct_s / plugin_s, f"{key}_min": min(direct_times) / min(plugin_times),
        "max_abs_difference": float((mine - direct).abs().max()), "torch_threads": torch.get_num_threads()})
    print(f"\n{name}, {n:,} inputs 3x32x32 forward included: plugin {plugin_s:.3f} s (min {min(plugin_times):.3f}), "
          f"direct torch {direct_s:.3f} s (min {min(direct_times):.3f}); {key} {direct_s / plugin_s:.3f} "
          f"(of minima {min(direct_times) / min(plugin_times):.3f}) over {rounds} interleaved rounds, "
          f"max |difference| {float((mine - direct).abs().max()):.2g}")
