"""DeepQuant (Xu, Ruan, Huang et al.): safety expressions, the Lipschitzian search, the certified radius, the PGD check.

Expressions against hand formulas; the search against the analytic Lipschitz constant of a linear
model (the dual norm of its gradient) and against a dense 401×401 grid over the ball of a small
ReLU network in 2-D; batched runs against input-by-input runs (bitwise up to 1e-12); the L1
projection against a QP solved by scipy; hypothesis: every x̂ lies in ball ∩ clip; the certified
radius against the true safe radius on a dense grid (soundness); affine models: Q is the closed form
(with and without clip, box corners included); a model whose cliff the search misses: PGD refutes the
estimate and names the inputs, the certified radius holds; the digits CNN on (N, 1, 8, 8) images;
bad inputs.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from _digits import digits_cnn, digits_images
from pytest_dnnsafety.engines.quantification import (
    EXPRESSIONS,
    Certification,
    GatedRadius,
    SafetyProperty,
    SearchBudget,
    certified_radius,
    confidence_interval,
    lipschitz_search,
    lp_norm,
    project_ball,
    project_l1_ball,
    quantify_safety,
    reachability,
    safety_values,
    uncertainty,
)
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError

DUAL = {"linf": 1.0, "l2": 2.0, "l1": math.inf}  # the dual exponent q of each ball norm p


class LinearProbabilities(nn.Module):
    """Two classes with probabilities linear in x: f_0 = a·x + c, f_1 = 1 − f_0 (valid on [0, 1]^n)."""

    def __init__(self, a: list[float], c: float) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a, dtype=torch.float64))
        self.c = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = x.flatten(1) @ self.a + self.c
        return torch.stack([p, 1 - p], dim=1)


class Constant(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)[:, :1] * 0 + torch.tensor([[1.0, 0.0]], dtype=torch.float64)


def _mlp(inputs: int = 2, hidden: int = 16, classes: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                        nn.Linear(hidden, classes))
    return net.double().eval()


def _sharp_mlp(seed: int = 1) -> nn.Module:
    """A 2-D ReLU network with confident outputs and all three classes inside [0, 1]²."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)).double()
    with torch.no_grad():
        net[0].weight.mul_(8)
        net[0].bias.mul_(2)
        net[4].weight.mul_(3)
    return net.eval()


def _grid(net: nn.Module, x: torch.Tensor, d: float, norm: str, points: int = 401) -> tuple[torch.Tensor, torch.Tensor]:
    """Every point of a points×points grid over [x − d, x + d] ∩ [0, 1]² inside the ball: (points, deltas)."""
    g = torch.linspace(-d, d, points, dtype=torch.float64)
    dx, dy = torch.meshgrid(g, g, indexing="ij")
    delta = torch.stack([dx.flatten(), dy.flatten()], dim=1)
    pts = (x + delta[lp_norm(delta, norm) <= d * (1 + 1e-12)]).clamp(0, 1)
    return pts, pts - x


def _s_at(net: nn.Module, centre: torch.Tensor, pts: torch.Tensor, expression: str, label: int | None = None,
          eps: float = 0.0) -> torch.Tensor:
    """s(x̂) at each point with the classes fixed at ``centre``, by hand from the softmax."""
    with torch.no_grad():
        p0 = torch.softmax(net(centre[None]), dim=1)[0]
        p = torch.softmax(net(pts), dim=1)
    top = int(p0.argmax())
    if expression == "top_vs_runner_up":
        others = torch.cat([p[:, :top], p[:, top + 1:]], dim=1)
        return p[:, top] - others.max(dim=1).values - eps
    if expression == "top_vs_label":
        return p[:, top] - p[:, label] - eps
    if expression == "top_vs_least":
        return p[:, top] - p[:, int(p0.argmin())] - eps
    if expression == "reachability":
        return p[:, top if label is None else label] - eps
    m = p.shape[1]
    return (torch.full_like(p, 1 / m) * torch.log((1 / m) / p)).sum(dim=1) - eps


def _grad_norms(net: nn.Module, centre: torch.Tensor, pts: torch.Tensor, expression: str, norm: str) -> torch.Tensor:
    """‖∇s(x̂)‖_q at each point (the dual norm of the ball norm), by autograd on the hand formula."""
    pts = pts.clone().requires_grad_(True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(_s_at_grad(net, centre, pts, expression).sum(), pts)
    return torch.linalg.vector_norm(g, ord=DUAL[norm], dim=1)


def _s_at_grad(net: nn.Module, centre: torch.Tensor, pts: torch.Tensor, expression: str) -> torch.Tensor:
    with torch.no_grad():
        p0 = torch.softmax(net(centre[None]), dim=1)[0]
    p = torch.softmax(net(pts), dim=1)
    top = int(p0.argmax())
    if expression == "top_vs_runner_up":
        return p[:, top] - torch.cat([p[:, :top], p[:, top + 1:]], dim=1).max(dim=1).values
    if expression == "reachability":
        return p[:, top]
    return -torch.log(p).mean(dim=1)


# ----------------------------------------------------------------------------- expressions


def test_expressions_match_hand_formulas() -> None:
    net = _mlp(4, 8, 5, seed=3)
    x = torch.rand(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        p = torch.softmax(net(x), dim=1)
    top = p.argmax(dim=1)
    sorted_p = p.sort(dim=1, descending=True).values
    rows = torch.arange(6)
    torch.testing.assert_close(confidence_interval(net, x, eps=0.1), sorted_p[:, 0] - sorted_p[:, 1] - 0.1,
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(confidence_interval(net, x, "top_vs_label", label=2),
                               p[rows, top] - p[:, 2], rtol=0, atol=1e-12)
    torch.testing.assert_close(confidence_interval(net, x, "top_vs_least", eps=0.05),
                               sorted_p[:, 0] - sorted_p[:, -1] - 0.05, rtol=0, atol=1e-12)
    kl = (0.2 * torch.log(0.2 / p)).sum(dim=1)  # KL(uniform ‖ f), natural logarithms
    torch.testing.assert_close(uncertainty(net, x, eps=0.3), kl - 0.3, rtol=0, atol=1e-12)
    # eq. (8) as printed: −ε − Σ (1/m)·log(m·f_l)
    torch.testing.assert_close(uncertainty(net, x), -(0.2 * torch.log(5 * p)).sum(dim=1), rtol=0, atol=1e-12)
    torch.testing.assert_close(reachability(net, x, label=4, eps=0.01), p[:, 4] - 0.01, rtol=0, atol=1e-12)
    torch.testing.assert_close(reachability(net, x), p[rows, top], rtol=0, atol=1e-12)
    assert bool((uncertainty(net, x) >= 0).all())  # a KL divergence


def test_expressions_on_a_model_that_returns_probabilities() -> None:
    model = LinearProbabilities([0.2, -0.1], 0.4)
    x = torch.tensor([[0.5, 0.5], [0.0, 1.0]], dtype=torch.float64)
    f0 = x @ torch.tensor([0.2, -0.1], dtype=torch.float64) + 0.4
    torch.testing.assert_close(safety_values(model, x, "reachability", label=0), f0, rtol=0, atol=1e-12)
    torch.testing.assert_close(safety_values(model, x, "top_vs_label", label=0),
                               (1 - f0) - f0, rtol=0, atol=1e-12)  # the top class is 1 here


def test_the_gate_knows_every_expression_without_importing_torch() -> None:
    from pytest_dnnsafety.gates.quantification import EXPRESSION_NAMES

    assert EXPRESSION_NAMES == EXPRESSIONS


# ----------------------------------------------------------------------------- the search


@pytest.mark.parametrize("method", ["gps", "mads"])
@pytest.mark.parametrize("norm", ["linf", "l2", "l1"])
def test_linear_model_lipschitz_constant_is_the_dual_norm(norm: str, method: str) -> None:
    """s_R = f_0 = a·x + c: Q = sup |a·δ|/‖δ‖_p = ‖a‖_q, and Theorem 1 is tight: d' = s(x)/‖a‖_q."""
    a = [0.2, -0.1]
    model = LinearProbabilities(a, 0.4)
    x = torch.tensor([[0.5, 0.5], [0.3, 0.7], [0.0, 1.0], [0.95, 0.95]], dtype=torch.float64)  # top class 1
    dual = float(torch.linalg.vector_norm(torch.tensor(a, dtype=torch.float64), ord=DUAL[norm]))
    for expression, label, factor, eps in (("reachability", 0, 1.0, 0.35), ("top_vs_label", 0, 2.0, 0.0)):
        res = lipschitz_search(model, x, SafetyProperty(expression, d=0.3, label=label, eps=eps, norm=norm),
                               SearchBudget(method, iterations=400, starts=1, mesh_tol=1e-10))
        torch.testing.assert_close(res.q, torch.full((4,), factor * dual, dtype=torch.float64), rtol=1e-6, atol=0)
        expected = (res.s / (factor * dual)).clamp(0, 0.3)
        torch.testing.assert_close(res.radius, expected, rtol=1e-6, atol=0)
        ascent = res.settings["ascent_starts"] * (res.settings["ascent_steps"] + 1)  # the gradient seeds' points
        assert bool((res.evaluations == 1 + res.iterations * 5 + ascent).all())  # 2n + 1 points per poll, n = 2


@pytest.mark.parametrize("network", ["smooth", "sharp"])
@pytest.mark.parametrize("method", ["gps", "mads"])
@pytest.mark.parametrize("norm", ["linf", "l2", "l1"])
def test_relu_network_within_a_few_percent_of_a_dense_grid(norm: str, method: str, network: str) -> None:
    """Q of a small ReLU network in 2-D against the best ratio over a 401×401 grid of the ball (4 starts)."""
    net = _mlp() if network == "smooth" else _sharp_mlp()
    x = torch.rand(6 if network == "smooth" else 4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    d = 0.2
    for expression in ("top_vs_runner_up", "reachability", "uncertainty"):
        res = lipschitz_search(net, x, SafetyProperty(expression, d=d, norm=norm),
                               SearchBudget(method, iterations=300, starts=4))
        for i in range(x.shape[0]):
            pts, delta = _grid(net, x[i], d, norm)
            s = _s_at(net, x[i], pts, expression)
            s0 = _s_at(net, x[i], x[i:i + 1], expression)
            dist = lp_norm(delta, norm)
            grid_q = float(((s0 - s).abs() / dist)[dist > 0].max())
            # q also holds the gradient norms seen: at most the grid's largest ‖∇s‖_q (the Lipschitz constant L)
            grid_l = max(grid_q, float(_grad_norms(net, x[i], pts, expression, norm).max()))
            assert 0.95 * grid_q <= float(res.q_ratio[i]) <= 1.02 * grid_q, (expression, i, float(res.q_ratio[i]))
            assert 0.95 * grid_q <= float(res.q[i]) <= 1.02 * grid_l, (expression, i, float(res.q[i]), grid_q, grid_l)
            torch.testing.assert_close(res.s[i], s0[0], rtol=0, atol=1e-12)


def _fields(res) -> dict[str, torch.Tensor]:
    return {name: getattr(res, name) for name in ("s", "q", "radius", "x_hat", "s_hat", "iterations", "evaluations",
                                                    "converged", "unsafe_distance", "applicable", "top", "other")}


@pytest.mark.parametrize("method", ["gps", "mads"])
@pytest.mark.parametrize("norm", ["linf", "l2", "l1"])
def test_a_batched_search_equals_the_same_search_input_by_input(norm: str, method: str) -> None:
    net = _mlp(5, 32, 4, seed=1)
    x = torch.rand(9, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    safety, search = SafetyProperty(d=0.2, norm=norm), SearchBudget(method, iterations=40, starts=3)
    batched = _fields(lipschitz_search(net, x, safety, search, seed=7))
    singles = [_fields(lipschitz_search(net, x[i:i + 1], safety, search, seed=7, index_offset=i)) for i in range(9)]
    for name, value in batched.items():
        alone = torch.cat([s[name] for s in singles])
        if value.is_floating_point():
            torch.testing.assert_close(value, alone, rtol=0, atol=1e-12, equal_nan=True, msg=name)
        else:
            assert torch.equal(value, alone), name
    # chunked polls change nothing either: few rows per forward pass, few values per poll tensor (the 2n + 1 = 11
    # points of a poll in slices of 3 directions, one search at a time)
    for limits in ({"max_batch": 23}, {"max_elements": 30}):
        chunked = _fields(lipschitz_search(net, x, safety, dataclasses.replace(search, **limits), seed=7))
        for name, value in batched.items():
            torch.testing.assert_close(value, chunked[name], rtol=0, atol=1e-12, equal_nan=True, msg=name)


def test_the_seed_changes_mads_and_only_mads() -> None:
    net = _mlp(5, 32, 4, seed=1)
    x = torch.rand(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    safety, budget = SafetyProperty(d=0.2), dict(iterations=15, starts=1, ascent_starts=0)
    gps = [lipschitz_search(net, x, safety, SearchBudget("gps", **budget), seed=s).q for s in (0, 1)]
    mads = [lipschitz_search(net, x, safety, SearchBudget("mads", **budget), seed=s).q for s in (0, 1)]
    assert torch.equal(gps[0], gps[1])
    assert not torch.equal(mads[0], mads[1])
    assert torch.equal(mads[0], lipschitz_search(net, x, safety, SearchBudget("mads", **budget), seed=0).q)
    # the gradient-norm ascent's random starts are keyed by the seed too: same seed, same numbers
    seeded = [lipschitz_search(net, x, safety, SearchBudget("gps", iterations=15, starts=1), seed=s) for s in (0, 0, 1)]
    assert torch.equal(seeded[0].q_gradient, seeded[1].q_gradient) and torch.equal(seeded[0].q, seeded[1].q)
    assert not torch.equal(seeded[0].q_gradient, seeded[2].q_gradient)


def test_quantify_safety_over_data_does_not_depend_on_the_batch_size() -> None:
    net = _mlp(5, 32, 4, seed=1)
    x = torch.rand(20, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    runs = [quantify_safety(net, (x, torch.zeros(20, dtype=torch.int64)), SafetyProperty(d=0.2),
                            SearchBudget("mads", iterations=20, starts=2), Certification("crown"), GatedRadius(worst=3),
                            batch_size=b) for b in (7, 20)]
    for name in ("s", "q", "radius", "iterations", "evaluations", "unsafe_distance", "certified", "q_ratio",
                 "q_gradient", "pgd_distance"):
        torch.testing.assert_close(getattr(runs[0], name), getattr(runs[1], name), rtol=0, atol=1e-12)
    assert runs[0].statistic == "certified"  # the default: the gated value is the proved radius
    assert runs[0].value == runs[1].value == float(runs[0].certified.min())
    assert runs[0].worst == runs[1].worst
    assert [w["index"] for w in runs[0].worst] == runs[0].certified.argsort(stable=True)[:3].tolist()


def test_estimate_edge_cases_unsafe_centre_and_constant_model() -> None:
    x = torch.tensor([[0.5, 0.5], [0.2, 0.9]], dtype=torch.float64)
    flat = lipschitz_search(Constant(), x, SafetyProperty("top_vs_runner_up", d=0.1),
                            SearchBudget(iterations=50, starts=1))
    assert torch.equal(flat.q, torch.zeros(2, dtype=torch.float64))
    assert torch.equal(flat.radius, torch.full((2,), 0.1, dtype=torch.float64))  # Q = 0: safe on the whole ball
    assert bool(flat.converged.all()) and torch.equal(flat.x_hat, x)
    model = LinearProbabilities([0.2, -0.1], 0.4)
    unsafe = lipschitz_search(model, x, SafetyProperty("reachability", d=0.1, label=0, eps=0.9),
                              SearchBudget(iterations=20, starts=1))
    assert bool((unsafe.s < 0).all())
    assert torch.equal(unsafe.radius, torch.zeros(2, dtype=torch.float64))
    assert torch.equal(unsafe.unsafe_distance, torch.zeros(2, dtype=torch.float64))


def test_top_vs_label_does_not_apply_to_inputs_of_that_class() -> None:
    net = _sharp_mlp()
    x = torch.rand(30, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        top = net(x).argmax(dim=1)
    label = int(top[0])
    assert 0 < int((top == label).sum()) < 30
    res = lipschitz_search(net, x, SafetyProperty("top_vs_label", d=0.1, label=label),
                           SearchBudget(iterations=5, starts=1))
    assert torch.equal(res.applicable, top != label)
    assert bool(torch.isnan(res.radius[top == label]).all())
    assert bool(torch.isfinite(res.radius[top != label]).all())
    assert bool((res.evaluations[top == label] == 1).all())  # no search for them
    summary = quantify_safety(net, x, SafetyProperty("top_vs_label", d=0.1, label=label),
                              SearchBudget(iterations=5, starts=1), None, GatedRadius("estimate"))
    assert summary.n_applicable == int((top != label).sum())
    assert summary.value == float(res.radius[top != label].min())
    assert summary.to_details()["not_applicable"] == int((top == label).sum())
    only = x[top == label]
    with pytest.raises(MetricError, match="applies to no input.*Fix: "):
        quantify_safety(net, only, SafetyProperty("top_vs_label", d=0.1, label=label),
                        SearchBudget(iterations=5, starts=1))


class AffineProbabilities(nn.Module):
    """Three classes with probabilities affine in x: f = A·x + c (columns of A sum to 0, c to 1).

    Valid probabilities near [0, 1]^n (so also without clip)."""

    def __init__(self, n: int = 6, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        a = (torch.rand(3, n, dtype=torch.float64, generator=g) - 0.5) * 0.06
        self.a = nn.Parameter(a - a.mean(dim=0, keepdim=True))
        self.c = torch.tensor([0.34, 0.33, 0.33], dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.flatten(1) - 0.5) @ self.a.T + self.c


@pytest.mark.parametrize("clip", [(0.0, 1.0), None], ids=["clip", "no-clip"])
@pytest.mark.parametrize("norm", ["linf", "l2", "l1"])
def test_affine_model_q_is_the_closed_form_with_and_without_clip(norm: str, clip: tuple | None) -> None:
    """s = f_l1 − f_l2 − ε is affine: its Lipschitz constant on B(x, d, p) ∩ clip is ‖a_l1 − a_l2‖_q exactly
    (the gradient is constant and the ball ∩ box has interior), and Theorem 1's s(x)/Q is then never above the
    exact radius s(x)/‖a_l1 − a_l2‖_q. With the default iterations the pattern search alone fell short of Q for
    most inputs; the gradient-norm seeds report it at their first step. Inputs include box corners, where no centred
    ratio inside the box reaches the dual norm (its sup over a cone of directions is smaller)."""
    model = AffineProbabilities()
    g = torch.Generator().manual_seed(1)
    x = torch.rand(40, 6, dtype=torch.float64, generator=g)
    x[:4] = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)  # a corner of the box
    with torch.no_grad():
        p = model(x)
    top, least = p.argmax(dim=1), p.argmin(dim=1)
    a = model.a.detach()
    for expression, label, eps in (("top_vs_least", None, 0.0), ("top_vs_label", 2, 0.0), ("reachability", 1, 0.3)):
        res = lipschitz_search(model, x, SafetyProperty(expression, d=0.2, label=label, eps=eps, norm=norm, clip=clip),
                               outputs="probabilities")
        other = least if expression == "top_vs_least" else torch.full_like(top, label)
        w = a[top] - a[other] if expression != "reachability" else a[other]
        exact_q = torch.linalg.vector_norm(w, ord=DUAL[norm], dim=1)
        ok = res.applicable
        torch.testing.assert_close(res.q[ok], exact_q[ok], rtol=1e-6, atol=0)
        exact_radius = (res.s / exact_q).clamp(0, 0.2)
        if expression == "top_vs_least":  # radii inside the ball: the comparison means something
            assert int((exact_radius[ok] < 0.2).sum()) >= 5
        assert bool((res.radius[ok] <= exact_radius[ok] * (1 + 1e-6)).all())
        assert bool((res.q_ratio[ok] <= exact_q[ok] * (1 + 1e-9)).all())  # every centred ratio is below L
    if clip is not None and norm == "linf":  # at the corner the centred ratio cannot reach ‖w‖₁: the gradient does
        res = lipschitz_search(model, x[:1], SafetyProperty("top_vs_label", d=0.2, label=2, norm=norm, clip=clip),
                               SearchBudget(iterations=400, mesh_tol=1e-10))
        exact = float(torch.linalg.vector_norm(a[int(top[0])] - a[2], ord=1))
        assert float(res.q_ratio[0]) < exact * (1 - 1e-3) and float(res.q[0]) == pytest.approx(exact, rel=1e-9)


def cliff_model(n: int = 16, t: float = 0.05, k: float = 200.0) -> nn.Module:
    """Logits whose margin is 1.5 − 0.5·(u + 1) − k·relu(u − t), u = mean(x − 0.5): gentle near x = 0.5, a cliff
    beyond u = t (the margin is 0 at u ≈ 0.0575, the exact L∞ safe radius at x = 0.5). Linear/ReLU: CROWN covers it."""
    first, last = nn.Linear(n, 2).double(), nn.Linear(2, 2).double()
    with torch.no_grad():
        first.weight.fill_(1.0 / n)
        first.bias.copy_(torch.tensor([-0.5 - t, 0.5]))
        last.weight.copy_(torch.tensor([[-k, -0.5], [0.0, 0.0]]))
        last.bias.copy_(torch.tensor([1.5, -0.5]))
    return nn.Sequential(first, nn.ReLU(), last).eval()


def test_pgd_finds_an_adversarial_example_inside_an_overstated_estimate() -> None:
    """Without the gradient seeds and with a short search, the pattern search misses the cliff and estimates the
    radius at d; PGD on s inside that ball finds s < 0 — the estimate is refuted and named; the certified radius
    (the default statistic) stays below the true radius, and the gradient-norm seeds make the estimate sound."""
    net = cliff_model()
    x = torch.full((3, 16), 0.5, dtype=torch.float64)
    x[2] = 0.3  # far from the cliff: u ≤ −0.1 in the ball, nothing to find
    blind = quantify_safety(net, x, SafetyProperty(d=0.1), SearchBudget(iterations=3, ascent_starts=0),
                            gated=GatedRadius("estimate"))
    assert blind.radius[:2].tolist() == [0.1, 0.1] and blind.value == 0.1
    assert bool(torch.isfinite(blind.pgd_distance[:2]).all()) and float(blind.pgd_distance[2]) == math.inf
    assert blind.closer_than_estimate.tolist() == [True, True, False]
    assert blind.contradiction is not None and "#0, #1" in blind.contradiction
    assert "statistic='certified'" in blind.contradiction
    pgd = blind.to_details()["pgd_check"]
    assert (pgd["checked"], pgd["closer_than_gated"], pgd["closer_than_gated_first"]) == (3, 2, [0, 1])
    assert "estimate (heuristic lower bound on Q ⇒ not a guarantee)" in blind.detail()
    default = quantify_safety(net, x, SafetyProperty(d=0.1), SearchBudget(iterations=3, ascent_starts=0))
    assert default.statistic == "certified" and default.contradiction is None
    assert default.value == pytest.approx(float(default.certified.min())) and default.value <= 0.0575
    assert default.to_details()["pgd_check"]["closer_than_estimate"] == 2  # reported, not gated
    assert "certified (CROWN)" in default.detail()
    seeded = quantify_safety(net, x, SafetyProperty(d=0.1), SearchBudget(iterations=3), gated=GatedRadius("estimate"))
    assert seeded.contradiction is None and float(seeded.radius[0]) < 0.0575
    assert float(seeded.q_gradient[0]) > 10 * float(blind.q[0])


def test_a_model_without_input_gradients_skips_the_pgd_check_and_says_so() -> None:
    class NoGrad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp(2, 8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return self.net(x)

    x = torch.rand(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    res = quantify_safety(NoGrad().eval(), x, SafetyProperty(d=0.1), SearchBudget(iterations=3), None,
                          GatedRadius("estimate"))
    assert res.pgd_distance is None and "no input gradient" in res.pgd_reason
    assert float(res.q_gradient.max()) == 0.0 and "PGD check not run" in res.detail()


# ----------------------------------------------------------------------------- balls


def _l1_qp(v: np.ndarray, r: float) -> np.ndarray:
    """argmin ‖y − v‖² s.t. ‖y‖₁ ≤ r, as a QP in y = p − q with p, q ≥ 0 (scipy SLSQP)."""
    from scipy.optimize import minimize

    n = v.size
    start = np.concatenate([np.clip(v, 0, None), np.clip(-v, 0, None)]) * min(1.0, r / max(np.abs(v).sum(), 1e-12))
    res = minimize(lambda z: float(((z[:n] - z[n:] - v) ** 2).sum()), start,
                   jac=lambda z: np.concatenate([2 * (z[:n] - z[n:] - v), -2 * (z[:n] - z[n:] - v)]),
                   bounds=[(0, None)] * (2 * n), method="SLSQP",
                   constraints=[{"type": "ineq", "fun": lambda z: r - z.sum(), "jac": lambda z: -np.ones(2 * n)}],
                   options={"ftol": 1e-14, "maxiter": 500})
    return res.x[:n] - res.x[n:]


def test_l1_projection_matches_a_qp() -> None:
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(40, 7, dtype=torch.float64, generator=gen)
    radii = torch.rand(40, dtype=torch.float64, generator=gen) * 4
    ours = project_l1_ball(v, radii)
    for i in range(40):
        ref = _l1_qp(v[i].numpy(), float(radii[i]))
        np.testing.assert_allclose(ours[i].numpy(), ref, atol=1e-6)
    inside = v.abs().sum(dim=1) <= radii
    assert torch.equal(ours[inside], v[inside])  # points inside the ball stay put


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(-5, 5), min_size=1, max_size=12), radius=st.floats(0, 6))
def test_ball_projections_are_projections(values: list[float], radius: float) -> None:
    v = torch.tensor([values], dtype=torch.float64)
    for norm in ("linf", "l2", "l1"):
        w = project_ball(v, radius, norm)
        assert float(lp_norm(w, norm)[0]) <= radius * (1 + 1e-12) + 1e-12
        torch.testing.assert_close(project_ball(w, radius, norm), w, rtol=0, atol=1e-12)  # idempotent
        if float(lp_norm(v, norm)[0]) <= radius:
            assert torch.equal(w, v)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), d=st.floats(0.01, 0.6), norm=st.sampled_from(["linf", "l2", "l1"]),
       method=st.sampled_from(["gps", "mads"]), expression=st.sampled_from(list(EXPRESSIONS)),
       starts=st.integers(1, 3))
def test_every_point_found_lies_in_the_ball_and_the_valid_range(seed: int, d: float, norm: str, method: str,
                                                                expression: str, starts: int) -> None:
    net = _mlp(3, 8, 3, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(5, 3, dtype=torch.float64, generator=gen)
    x[0] = 0.0
    x[1] = 1.0  # on the edges of the valid range
    label = 1 if expression in ("top_vs_label", "reachability") else None
    res = lipschitz_search(net, x, SafetyProperty(expression, d=d, label=label, norm=norm),
                           SearchBudget(method, iterations=15, starts=starts), seed=seed)
    assert bool((res.x_hat >= 0).all() & (res.x_hat <= 1).all())
    assert bool((lp_norm(res.x_hat - x, norm) <= d * (1 + 1e-9)).all())
    ok = res.applicable
    assert bool(((res.radius[ok] >= 0) & (res.radius[ok] <= d)).all())
    assert bool((res.unsafe_distance[ok] >= res.radius[ok] * (1 - 1e-9)).all())  # Theorem 1 vs points seen


# ----------------------------------------------------------------------------- the certified radius


@pytest.mark.parametrize(("expression", "label", "eps"), [
    ("top_vs_runner_up", None, 0.0), ("top_vs_runner_up", None, 0.1), ("top_vs_label", 1, 0.05),
    ("top_vs_least", None, 0.1), ("reachability", None, 0.3), ("reachability", 0, 0.3), ("uncertainty", None, 0.05)])
@pytest.mark.parametrize("method", ["crown", "ibp"])
def test_certified_radius_is_sound_against_a_dense_grid(expression: str, label: int | None, eps: float,
                                                        method: str) -> None:
    """The certified L∞ radius never exceeds the distance of the nearest unsafe grid point (the true radius)."""
    net = _sharp_mlp()
    x = torch.rand(12, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    d = 0.3
    cert, reason = certified_radius(net, x, expression, d=d, label=label, eps=eps, method=method, steps=12)
    assert reason is None and cert is not None
    proved, below_d, ratios = 0, 0, []
    for i in range(x.shape[0]):
        if math.isnan(float(cert[i])):
            continue
        pts, delta = _grid(net, x[i], d, "linf", points=201)
        s = _s_at(net, x[i], pts, expression, label, eps)
        s0 = float(_s_at(net, x[i], x[i:i + 1], expression, label, eps)[0])
        dist = lp_norm(delta, "linf")
        truth = 0.0 if s0 < 0 else float(torch.where(s < 0, dist, torch.full_like(dist, d)).min())
        assert float(cert[i]) <= truth + 1e-12, (i, float(cert[i]), truth)
        if float(cert[i]) > 0:  # 0: nothing proved (an unsafe centre among them)
            assert bool((s[dist <= float(cert[i])] >= -1e-12).all())
            proved += 1
        if 0 < truth < d:
            below_d += 1
            ratios.append(float(cert[i]) / truth)
    assert proved >= 3 and below_d >= 2  # not vacuous: proofs, and unsafe points inside the ball
    print(expression, eps, method, "certified / true radius:", [round(r, 2) for r in ratios])


def test_certified_radius_needs_a_model_the_bounds_cover() -> None:
    x = torch.rand(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    softmax = nn.Sequential(_mlp(), nn.Softmax(dim=1)).eval()
    cert, reason = certified_radius(softmax, x, d=0.1)
    assert cert is None and "Softmax" in reason
    cert, reason = certified_radius(LinearProbabilities([0.2, -0.1], 0.4), x, "reachability", d=0.1)
    assert cert is None and reason is not None
    res = lipschitz_search(softmax, x, SafetyProperty(d=0.1), SearchBudget(iterations=5),
                           certification=Certification("crown"))  # the estimate still comes
    assert res.certified is None and "Softmax" in res.certified_reason and bool((res.radius > 0).all())


# ----------------------------------------------------------------------------- images


@pytest.fixture(scope="module")
def digits_run():
    x, _ = digits_images()
    x = x[1200:1232]
    model = digits_cnn()
    return x, quantify_safety(model, x, SafetyProperty(d=0.05), SearchBudget(iterations=15, starts=2),
                              Certification("crown", steps=6), GatedRadius(worst=4), batch_size=16)


def test_digits_images(digits_run) -> None:
    x, res = digits_run
    assert res.n == 32 and res.n_applicable == 32
    assert res.outputs == "logits"
    assert bool((res.radius >= 0).all() & (res.radius <= 0.05).all())
    assert bool((res.q >= 0).all()) and float(res.q.max()) > 0
    ascent = res.settings["ascent_starts"] * (res.settings["ascent_steps"] + 1)  # the gradient seeds' points
    assert bool((res.iterations <= 15).all() & (res.evaluations <= 1 + 2 * 15 * 129 + ascent).all())
    assert bool(((res.evaluations - 1 - ascent) % 129 == 0).all())  # 2n + 1 = 129 points per poll on 8×8 images
    assert res.certified is not None and bool((res.certified <= res.unsafe_distance).all())
    assert res.contradiction is None
    assert len(res.worst) == 4 and len(res.worst_points) == 4
    for entry, (xi, x_hat) in zip(res.worst, res.worst_points, strict=True):
        assert torch.equal(xi, x[entry["index"]])
        assert x_hat.shape == (1, 8, 8)
        assert float((x_hat - xi).abs().max()) == pytest.approx(entry["linf_distance"])
        assert entry["linf_distance"] <= 0.05 + 1e-7 and len(entry["x_hat"]) == 64
        assert entry["estimate"] == pytest.approx(min(0.05, entry["s"] / entry["q"]) if entry["q"] > 0 else 0.05)
    details = res.to_details()
    import json

    json.dumps(details)
    assert details["certified"]["method"] == "crown" and details["value"] == res.value
    print("digits:", res.detail())


# ----------------------------------------------------------------------------- bad inputs


BAD = [
    (dict(expression="margin"), ConfigError, "expression='margin' is not one of.*Fix: "),
    (dict(expression="top_vs_label"), ConfigError, "needs label=.*Fix: "),
    (dict(expression="top_vs_label", label=12), ConfigError, "label=12 is not a class of the model.*10 class.*Fix: "),
    (dict(expression="uncertainty", label=1), ConfigError, "label=1 is used only by.*Fix: "),
    (dict(expression="reachability", label=-1), ConfigError, "label=-1 is not a class index.*Fix: "),
    (dict(d=0), ConfigError, "d=0 must be a finite number > 0.*Fix: "),
    (dict(d=-0.1), ConfigError, "d=-0.1 .*Fix: "),
    (dict(norm="l3"), ConfigError, "norm='l3' is not one of.*Fix: "),
    (dict(method="cma"), ConfigError, "method='cma' is not one of.*Fix: "),
    (dict(eps=1.5), ConfigError, "eps=1.5 exceeds 1.*Fix: "),
    (dict(eps=-0.1), ConfigError, "eps=-0.1 .*Fix: "),
    (dict(iterations=0), ConfigError, "iterations=0 .*Fix: "),
    (dict(contraction=1.2), ConfigError, "contraction=1.2 .*Fix: "),
    (dict(clip=(0.0, 0.5)), DataError, "outside the valid range clip=.*Fix: "),
]


@pytest.mark.parametrize(("options", "error", "message"), BAD, ids=[str(o) for o, _, _ in BAD])
def test_bad_inputs_name_the_fix(options: dict, error: type, message: str) -> None:
    x, _ = digits_images(4)
    opts = {"d": 0.1, "iterations": 2, **options}
    search = {name: opts.pop(name) for name in ("method", "iterations", "contraction") if name in opts}
    with pytest.raises(error, match=message):  # the records check their options when they are built
        lipschitz_search(digits_cnn(), x, SafetyProperty(**opts), SearchBudget(**search))


def test_non_finite_inputs_are_a_data_error() -> None:
    x, _ = digits_images(4)
    x[1, 0, 3, 3] = math.nan
    with pytest.raises(DataError, match="NaN or infinite.*Fix: "):
        lipschitz_search(digits_cnn(), x, SafetyProperty(d=0.1), SearchBudget(iterations=2))
