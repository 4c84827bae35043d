"""``min_verified_robustness`` modes (issue #30 §2): CROWN-IBP and ``auto``, attacks first, and a 224² ResNet-18.

Known answers on the digits CNN (a reversed last layer is plainly not robust; a constant model has
exact verdicts), the order of the modes' verified counts (IBP ≤ CROWN-IBP ≤ CROWN), the attack run
before the tighter bounds (a falsified input costs no CROWN work), and — slow — one 224×224 image
through the real-width ResNet-18 of the scale project reaching a verdict (its time is printed).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from _digits import digits_cnn, digits_images
from pytest_dnnsafety.engines.robustness.verification import verify_robustness

CLIP = (0.0, 1.0)
MODELS = Path(__file__).resolve().parents[3] / "benchmarks" / "scale_project" / "scale_demo" / "models.py"


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = digits_images()
    return x[1200:1248], y[1200:1248]


def test_modes_order_on_the_digits_cnn(digits: tuple[torch.Tensor, torch.Tensor]) -> None:
    model = digits_cnn()
    results = {method: verify_robustness(model, digits, 0.01, method=method, clip=CLIP, attack_steps=10)
               for method in ("ibp", "crown-ibp", "crown", "auto")}
    verified = {method: r.verified for method, r in results.items()}
    assert verified["ibp"] < verified["crown-ibp"] <= verified["crown"] == verified["auto"]
    falsified = {r.falsified for r in results.values()}
    assert len(falsified) == 1  # the attack sees the same inputs whatever the bound (IBP decides first)
    assert results["crown-ibp"].bounded_by["crown"] == 0 and results["crown"].bounded_by["crown-ibp"] == 0
    assert results["auto"].bounded_by == results["crown"].bounded_by
    print({method: r.detail() for method, r in results.items()})


def test_attacks_first_spare_the_bounds(digits: tuple[torch.Tensor, torch.Tensor]) -> None:
    model = digits_cnn()
    x, y = digits
    attacked = verify_robustness(model, (x, y), 0.05, method="crown-ibp", clip=CLIP, attack_steps=10)
    plain = verify_robustness(model, (x, y), 0.05, method="crown-ibp", clip=CLIP, attack_steps=0)
    assert attacked.verified == plain.verified  # the order changes the work, not what is proved
    assert attacked.falsified > plain.falsified
    # with the attack first, the falsified inputs were bounded by IBP only
    assert attacked.bounded_by["crown-ibp"] <= plain.bounded_by["crown-ibp"] - (attacked.falsified - plain.falsified)


def test_reversed_last_layer_fails_with_crown_ibp(digits: tuple[torch.Tensor, torch.Tensor]) -> None:
    model = digits_cnn()
    with torch.no_grad():
        model.classifier[2].weight.neg_()
        model.classifier[2].bias.neg_()
    result = verify_robustness(model, digits, 0.01, method="crown-ibp", clip=CLIP)
    assert result.verified == 0 and result.falsified >= 40


@pytest.mark.parametrize("method", ["crown-ibp", "auto"])
def test_nan_logits_are_refused_by_the_new_modes(digits: tuple[torch.Tensor, torch.Tensor], method: str) -> None:
    """Non-finite outputs never become verdicts: the runner's guard refuses them before any bound (one NaN weight
    in the last layer: one class's logit is NaN on every input)."""
    model = digits_cnn()
    with torch.no_grad():
        model.classifier[2].weight[3, 0] = float("nan")
    with pytest.raises(Exception, match="(?i)nan") as info:
        verify_robustness(model, digits, 0.01, method=method, clip=CLIP)
    assert "Fix" in str(info.value) or "fix" in str(info.value)


def test_constant_model_exact_with_crown_ibp() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10), nn.ReLU(), nn.Linear(10, 10))
    with torch.no_grad():
        model[1].weight.zero_()
        model[1].bias.copy_(torch.arange(10, 0, -1, dtype=torch.float32))
        model[3].weight.copy_(torch.eye(10))
        model[3].bias.zero_()
    x, y = digits_images(60)
    for method in ("crown-ibp", "auto"):
        result = verify_robustness(model.eval(), (x, y), 0.1, method=method, clip=CLIP)
        assert result.verified == int((y == 0).sum()) and result.unknown == 0


def _resnet18_224() -> nn.Module:
    spec = importlib.util.spec_from_file_location("_scale_demo_models", MODELS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.resnet18(width=64, classes=10, stem="imagenet", seed=0)


@pytest.mark.slow
def test_resnet18_224_reaches_a_verdict() -> None:
    """One 224×224 image through the real-width ResNet-18: ``auto`` picks CROWN-IBP and reaches a verdict.

    Measured (2-core CPU shared with other jobs, see docs/gates/robustness.md): attack first and bounds
    skipped ~10–25 s; bounds alone (attack_steps=0) ~8–20 s.
    """
    model = _resnet18_224()
    x = torch.rand(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = model(x).argmax(1)
    times = {}
    for steps in (20, 0):
        start = time.perf_counter()
        result = verify_robustness(model, (x, y), 1 / 255, clip=CLIP, batch_size=1, attack_steps=steps)
        times[steps] = time.perf_counter() - start
        assert result.n == 1 and result.verified + result.falsified + result.unknown == 1
        if steps == 0:
            assert result.bounded_by["crown-ibp"] == 1  # auto: full CROWN would bound ~10⁶ neurons one by one
        print(f"ResNet-18 224² attack_steps={steps}: {result.detail()} in {times[steps]:.1f}s")
