"""Benchmark: full CROWN of the plugin against auto_LiRPA 0.7.1's ``compute_bounds(method="CROWN")`` (no timing asserts).

Side by side on three models, the same margin specification ``C`` (rows ``e_y − e_j``, ``j ≠ y``, ``y``
the predicted class), lower bounds only:

* ``resnet``: the scale project's ``resnet18(width=4, stem="cifar")``, 2 inputs of 3×32×32, ε = 1/255;
* ``avgpool``: the digits CNN (``tests/_digits.py``) with its max-pooling replaced by 2×2 average pooling
  (same trained weights), 200 inputs, ε = 0.005;
* ``maxpool``: the digits CNN itself (max-pooling), 200 inputs, ε = 0.005.

The plugin is :meth:`BoundedModel.crown` with the spec (intermediate bounds by CROWN, intersected with IBP);
auto_LiRPA's ``BoundedModule`` in its default configuration (``conv_mode="patches"``, sparse intermediate
bounds). Timed interleaved (plugin, auto_LiRPA, plugin, …) in this process after a warm-up call of each,
medians and minima; the ratio ``auto_LiRPA time / plugin time`` (> 1: the plugin is faster) goes to
``benchmark.extra_info["ratio_auto_lirpa_over_plugin"]``. Peak memory: the growth of the peak RSS of one call,
each contender in a fresh process (Linux ``/proc``; skipped elsewhere). The bounds are asserted equal on the
ResNet and the average-pooling CNN (relative 1e-5 of the largest bound); on the max-pooling CNN they differ (the
two max-pool relaxations differ, see docs/gates/robustness.md, "CROWN against auto_LiRPA"): both are checked
below the margins of the box's corners and centre there, and the largest difference is reported.

auto_LiRPA 0.7.1 is not on PyPI (which has 0.3), so the benchmark skips when ``auto_LiRPA`` cannot be imported.
To reproduce::

    git clone https://github.com/Verified-Intelligence/auto_LiRPA /tmp/lirpa   # 0.7.1
    pip install appdirs tqdm graphviz
    PYTHONPATH=/tmp/lirpa python -m pytest tests/benchmarks/test_bench_crown_reference.py --benchmark-enable \\
        --benchmark-only -p no:xdist -p no:randomly -q -s

Under ``--benchmark-disable`` (the test suite) each model runs once on a small input (the ResNet at 8×8, 20
digits): the equality check, not a timing.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

lirpa = pytest.importorskip("auto_LiRPA", reason="auto_LiRPA (0.7.1, from GitHub) is not importable")
if tuple(int(p) for p in lirpa.__version__.split(".")[:2]) < (0, 7):  # pragma: no cover - PyPI's 0.3
    pytest.skip(f"auto_LiRPA {lirpa.__version__} is older than 0.7", allow_module_level=True)

from _digits import digits_cnn, digits_images
from _rss import run_script
from pytest_dnnsafety.engines.bounds.box import input_box
from pytest_dnnsafety.engines.bounds.model import BoundedModel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "scale_project"))
from scale_demo.models import resnet18

MODELS = ("resnet", "avgpool", "maxpool")
REPS = {"resnet": 3, "avgpool": 5, "maxpool": 5}


def avgpool_cnn() -> nn.Module:
    model = digits_cnn()
    model.features[4] = nn.AvgPool2d(2)
    return model.eval()


def problem(name: str, small: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(model, x, lo, hi, C)``: the model, its inputs, their box and the margin spec ``(B, classes − 1, classes)``."""
    if name == "resnet":
        torch.manual_seed(0)
        model = resnet18(width=4, stem="cifar").eval()
        size = 8 if small else 32
        x = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(0))
        eps = 1 / 255
    else:
        model = avgpool_cnn() if name == "avgpool" else digits_cnn()
        x = digits_images(20 if small else 200)[0]
        eps = 0.005
    with torch.no_grad():
        y = model(x).argmax(1)
    lo, hi = input_box(x, eps, (0.0, 1.0))
    n = model(x[:1]).shape[1]
    eye = torch.eye(n)
    rows = eye[y].unsqueeze(1) - eye.unsqueeze(0)  # (B, n, n)
    keep = torch.arange(n).unsqueeze(0) != y.unsqueeze(1)
    spec = rows[keep].reshape(x.shape[0], n - 1, n)
    return model, x, lo, hi, spec


def contenders(model: nn.Module, x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, spec: torch.Tensor):
    bounded = BoundedModel(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = lirpa.BoundedModule(model, torch.zeros_like(x[:1]), device="cpu", verbose=0)
    ball = lirpa.BoundedTensor(x, lirpa.perturbations.PerturbationLpNorm(norm=float("inf"), x_L=lo, x_U=hi))

    def plugin() -> torch.Tensor:
        return bounded.crown(lo, hi, spec)[0]

    def auto_lirpa() -> torch.Tensor:
        with torch.no_grad():
            return reference.compute_bounds(x=(ball,), method="CROWN", C=spec, bound_upper=False)[0]

    return plugin, auto_lirpa


_RSS = """
    import sys, warnings
    sys.path.insert(0, "tests"); sys.path.insert(0, "tests/benchmarks")
    warnings.simplefilter("ignore")
    from test_bench_crown_reference import contenders, problem
    torch.set_num_threads({threads})
    model, x, lo, hi, spec = problem({name!r}, False)
    plugin, auto_lirpa = contenders(model, x, lo, hi, spec)
    fn = plugin if {who!r} == "plugin" else auto_lirpa
    open("/proc/self/clear_refs", "w").write("5")
    base = hwm()
    fn()
    print(hwm() - base)
"""


def peak_growth_mb(name: str, who: str) -> float | None:
    """Peak RSS growth (MiB) of one call of ``who`` on ``name`` in a fresh process; None where /proc cannot say."""
    if not Path("/proc/self/clear_refs").exists():
        return None
    out = run_script(_RSS.format(name=name, who=who, threads=torch.get_num_threads()), 1800)
    return int(out.strip().splitlines()[-1]) / 2**20


def corner_margins(model: nn.Module, lo: torch.Tensor, hi: torch.Tensor, spec: torch.Tensor) -> torch.Tensor:
    """The spec at the box's centre and at 16 random corners (B, K): a sound lower bound is below all of them."""
    gen = torch.Generator().manual_seed(0)
    points = [(lo + hi) / 2] + [torch.where(torch.rand(lo.shape, generator=gen) < 0.5, lo, hi) for _ in range(16)]
    with torch.no_grad():
        values = [torch.einsum("bkn,bn->bk", spec, model(p)) for p in points]
    return torch.stack(values).amin(0)


@pytest.mark.parametrize("name", MODELS)
def test_bench_crown_against_auto_lirpa(benchmark, name: str) -> None:
    full = not getattr(benchmark, "disabled", False)
    model, x, lo, hi, spec = problem(name, small=not full)
    plugin, auto_lirpa = contenders(model, x, lo, hi, spec)
    ours, theirs = plugin(), auto_lirpa()  # warm-up, and the bounds compared
    gap = float((ours - theirs).abs().max())
    scale = max(1.0, float(theirs.abs().max()))
    if name != "maxpool":
        assert gap <= 1e-5 * scale, f"{name}: bounds differ by {gap:.3g}"
    truth = corner_margins(model, lo, hi, spec)
    tol = 1e-5 * max(1.0, float(truth.abs().max()))
    assert bool((ours <= truth + tol).all()) and bool((theirs <= truth + tol).all())

    times: dict[str, list[float]] = {"plugin": [], "auto_lirpa": []}

    def interleaved() -> None:
        for _ in range(REPS[name] if full else 1):
            for who, fn in (("plugin", plugin), ("auto_lirpa", auto_lirpa)):
                start = time.perf_counter()
                fn()
                times[who].append(time.perf_counter() - start)

    benchmark.pedantic(interleaved, rounds=1, iterations=1)
    med = {who: statistics.median(ts) for who, ts in times.items()}
    low = {who: min(ts) for who, ts in times.items()}
    ratio, ratio_min = med["auto_lirpa"] / med["plugin"], low["auto_lirpa"] / low["plugin"]
    memory = {who: peak_growth_mb(name, who) for who in times} if full else {"plugin": None, "auto_lirpa": None}
    benchmark.extra_info.update({
        "model": name, "inputs": int(x.shape[0]), "input_shape": list(x.shape[1:]), "reps": len(times["plugin"]),
        "plugin_seconds_median": med["plugin"], "auto_lirpa_seconds_median": med["auto_lirpa"],
        "plugin_seconds_min": low["plugin"], "auto_lirpa_seconds_min": low["auto_lirpa"],
        "ratio_auto_lirpa_over_plugin": ratio, "ratio_of_minima": ratio_min,
        "plugin_peak_growth_mib": memory["plugin"], "auto_lirpa_peak_growth_mib": memory["auto_lirpa"],
        "max_bound_difference": gap, "torch_threads": torch.get_num_threads(),
        "auto_lirpa_version": lirpa.__version__,
    })
    mem = ""
    if memory["plugin"] is not None and memory["auto_lirpa"]:
        mem = (f"; peak RSS growth {memory['plugin']:.0f} MiB vs {memory['auto_lirpa']:.0f} MiB "
               f"(×{memory['plugin'] / memory['auto_lirpa']:.2f})")
    print(f"\nfull CROWN, {name}, {x.shape[0]} inputs: plugin {med['plugin']:.3f} s (min {low['plugin']:.3f}), "
          f"auto_LiRPA {lirpa.__version__} {med['auto_lirpa']:.3f} s (min {low['auto_lirpa']:.3f}); "
          f"ratio ×{ratio:.2f} (minima ×{ratio_min:.2f}); bounds differ by {gap:.2g}{mem}; "
          f"{torch.get_num_threads()} threads")
