"""The safe-radius search at scale (:mod:`pytest_dnnsafety.engines.quantification.scale`): no coordinate search on
big inputs, a certified radius by bisection over IBP, a batched minimum-norm attack, the refusal naming the
estimate, and (slow) two 224² images of the width-64 ResNet-18 within the issue's 120 s."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from pytest_dnnsafety.engines.quantification import (
    COORDINATE_MAX_DIMS, SEARCH_MODES, Certification, GatedRadius, SafetyProperty, SearchBudget, SearchPlan,
    certified_radius, gradient_search, plan_search, quantify_safety, safety_values,
)
from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.gates import quantification as gate

SHAPE = (1, 80, 80)  # 6,400 elements: above COORDINATE_MAX_DIMS, so search='auto' never polls coordinates


def _linear(margin: float) -> tuple[nn.Module, torch.Tensor]:
    """Two logits ``[a·x + b, 0]`` with ``‖a‖₁ = 1`` and margin ``margin`` at ``x = 0.5``: the exact L∞ minimal
    adversarial radius is ``margin`` (the box [0, 1] is never reached)."""
    n = math.prod(SHAPE)
    lin = nn.Linear(n, 2)
    with torch.no_grad():
        lin.weight.zero_()
        lin.weight[0] = 1.0 / n
        lin.bias.copy_(torch.tensor([margin - 0.5, 0.0]))
    return nn.Sequential(nn.Flatten(), lin).eval(), torch.full((2, *SHAPE), 0.5)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 5, stride=4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 19 * 19, 10)).eval()


def test_the_gate_spells_the_engine_constants() -> None:
    assert gate.SEARCH_NAMES == SEARCH_MODES
    assert gate.COORDINATE_MAX_DIMS == COORDINATE_MAX_DIMS


def test_auto_picks_the_coordinate_search_for_small_inputs_only() -> None:
    budget, plan = SearchBudget(), SearchPlan()
    assert plan_search(plan, 64, budget, "crown", 10)[0] == "coordinate"
    assert plan_search(plan, 3 * 224 * 224, budget, "ibp", 10)[0] == "gradient"
    assert plan_search(plan, COORDINATE_MAX_DIMS + 1, budget, "ibp", 10)[0] == "gradient"


def test_the_coordinate_search_on_a_big_input_is_refused_naming_the_estimate() -> None:
    model, x = _linear(0.01)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        quantify_safety(model, x, SafetyProperty(d=0.1), SearchBudget(), Certification("ibp"), GatedRadius(),
                        plan=SearchPlan("coordinate"))
    message = str(info.value)
    assert time.perf_counter() - t0 < 10
    assert "search='coordinate'" in message and "6,400 elements" in message
    assert "2,561,567 forwards per input" in message and "a poll of 12,801" in message  # 2 × 100 × 12,801 + …
    assert "max_queries=2,000,000" in message and "Fix:" in message and "search='gradient'" in message
    # and at 224²: 60 million forwards per input
    with pytest.raises(ConfigError, match=r"60,\d{3},\d{3} forwards per input"):
        plan_search(SearchPlan("coordinate"), 3 * 224 * 224, SearchBudget(), "crown", 10)


def test_the_attack_over_max_queries_is_refused_too() -> None:
    with pytest.raises(ConfigError, match=r"search='gradient'.*31 forwards per input.*max_queries=20.*attack_steps"):
        plan_search(SearchPlan("gradient", max_queries=20), 10_000, SearchBudget(), None, 0)


def test_known_answer_a_non_robust_model_gets_a_small_radius_and_fails() -> None:
    model, x = _linear(0.01)
    res = quantify_safety(model, x, SafetyProperty(d=0.1), SearchBudget(), Certification("ibp"), GatedRadius(),
                          plan=SearchPlan("auto", attack_steps=20))
    assert res.search == "gradient"
    # IBP is exact on an affine model: the certificate reaches the true radius 0.01 up to the bisection's d/1024
    assert torch.all(res.certified <= 0.01) and torch.all(res.certified >= 0.01 - 0.1 / 1024)
    # the attack's estimate: an adversarial example not much farther than the true radius
    assert torch.all(res.radius >= 0.01 * (1 - 1e-4)) and torch.all(res.radius <= 0.0125)
    assert res.value < 0.05  # a gate at 0.05 fails
    assert res.contradiction is None
    assert "upper bound on the minimal adversarial radius" in res.detail()
    details = res.to_details()
    assert details["search"] == "gradient" and "upper bound" in details["estimate"]["note"]
    assert details["certified"]["note"].startswith("proved")


@pytest.mark.parametrize(("norm", "d"), [("linf", 0.05), ("l2", 2.0)])
def test_the_certified_radius_is_at_most_the_gradient_estimate(norm: str, d: float) -> None:
    model = _cnn()
    torch.manual_seed(1)
    x = torch.rand(3, *SHAPE)
    safety = SafetyProperty(d=d, norm=norm)
    cert, why = certified_radius(model, x, "top_vs_runner_up", d=d, method="ibp", steps=10)
    assert why is None
    est = gradient_search(model, x, safety, SearchPlan("gradient", attack_steps=20))
    # the attack's points lie in the L∞ ball of their L2 distance too: a sound L∞ certificate is below both
    assert torch.all(cert <= est.radius + 1e-12), (cert, est.radius)
    found = torch.isfinite(est.unsafe_distance)
    with torch.no_grad():  # every reported adversarial point is one: the top class changed there
        assert torch.all(model(est.x_hat[found]).argmax(1) != model(x[found]).argmax(1))
    assert found.any()


def test_the_certified_radius_is_sound_by_sampling_and_attack() -> None:
    model = _cnn()
    torch.manual_seed(2)
    x = torch.rand(2, *SHAPE)
    res = quantify_safety(model, x, SafetyProperty(d=0.05), SearchBudget(), Certification("ibp"), GatedRadius(),
                          plan=SearchPlan("certified", attack_steps=30))
    assert res.search == "certified" and res.pgd_distance is not None
    assert torch.isnan(res.radius).all() and "not run" in res.to_details()["estimate"]["note"]
    assert res.contradiction is None and torch.all(torch.isinf(res.pgd_distance))
    r = res.certified
    assert torch.all(r > 0)
    gen = torch.Generator().manual_seed(3)
    for i in range(2):  # corners and uniform points of the certified L∞ ball keep s ≥ 0
        corners = torch.randint(0, 2, (64, *SHAPE), generator=gen).to(x.dtype) * 2 - 1
        uniform = torch.rand((64, *SHAPE), generator=gen) * 2 - 1
        pts = (x[i] + float(r[i]) * torch.cat([corners, uniform])).clamp(0, 1)
        s = safety_values(model, pts)
        top = model(x[i:i + 1]).argmax(1)
        assert torch.all(model(pts).argmax(1) == top) and torch.all(s >= -1e-9)


def test_statistic_estimate_with_the_certified_search_is_a_config_error() -> None:
    model, x = _linear(0.01)
    with pytest.raises(ConfigError, match="search='certified' computes no estimate"):
        quantify_safety(model, x, SafetyProperty(d=0.1), SearchBudget(), Certification("ibp"),
                        GatedRadius("estimate"), plan=SearchPlan("certified"))


def test_the_gate_cost_follows_the_search() -> None:
    from pytest_dnnsafety.gates.cost import Workload

    opts = {**{p.name: p.default for p in gate.MIN_SAFE_RADIUS.params}, "d": 0.05}
    work = Workload(2, (3, 224, 224))
    cost = gate._cost(opts, work)
    assert "search='gradient'" in cost.what and cost.forwards < 2 * 100
    small = gate._cost(opts, Workload(2, (1, 8, 8)))
    assert small.forwards > 2 * 100 * 128  # the coordinate search's polls


@pytest.mark.slow
def test_two_224_images_of_the_width64_resnet18_reach_a_verdict() -> None:
    root = Path(__file__).resolve().parents[3] / "benchmarks" / "scale_project"
    sys.path.insert(0, str(root))
    try:
        from scale_demo.models import ResNet
    finally:
        sys.path.remove(str(root))
    torch.manual_seed(0)
    model = ResNet(width=64, stem="imagenet").eval()
    x = torch.rand(2, 3, 224, 224)
    load, t0 = os.getloadavg()[0], time.perf_counter()
    res = quantify_safety(model, x, SafetyProperty(d=0.05), SearchBudget(), Certification("crown"), GatedRadius(),
                          plan=SearchPlan("auto", auto_bound=True))
    seconds = time.perf_counter() - t0
    print(f"min_safe_radius, 2 × 3×224×224, width-64 ResNet-18: {seconds:.1f} s (load {load:.1f}); {res.detail()}")
    assert res.search == "gradient" and res.certified_method == "ibp"
    assert math.isfinite(res.value) and res.contradiction is None
    assert torch.all(res.certified <= res.radius)
    assert seconds < 240  # the 120 s on an idle CPU; this machine's load is shared
