"""Tests of the reliability assessment engine (Zhao et al. 2021): cells, r̂, Monte Carlo, bounds, coverage."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.reliability import (
    CROSS,
    EMPTY,
    NORMAL,
    CellTallyEngine,
    Grid,
    ReliabilityAssessor,
    ReliabilityOptions,
    ReliabilityWarning,
    assess_reliability,
    closest_opposite_pair,
    r_separation,
)
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.engines.core.guard import probing
from pytest_dnnsafety.engines.reliability.profile import PCA, OperationalProfile
from _reliability import _quiet, _truth

UNIT_BOX = ([0.0, 0.0], [1.0, 1.0])


def _uniform(n: int, seed: int, d: int = 2) -> torch.Tensor:
    return torch.rand(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ====================================================================== grid
def test_grid_shape_edges_bounds_and_locate() -> None:
    grid = Grid.build([0.0, -1.0], [1.0, 1.0], [0.3, 0.5])
    assert grid.shape == (4, 4) and grid.n_cells == 16
    assert grid.edges(0).tolist() == pytest.approx([0.0, 0.3, 0.6, 0.9, 1.0])  # the last cell is clipped
    lo, hi = grid.bounds(torch.tensor([0, 15]))
    assert torch.allclose(lo, torch.tensor([[0.0, -1.0], [0.9, 0.5]], dtype=torch.float64))
    assert torch.allclose(hi, torch.tensor([[0.3, -0.5], [1.0, 1.0]], dtype=torch.float64))
    flat = grid.locate(torch.tensor([[0.05, -0.9], [1.0, 1.0], [0.95, 0.6], [1.2, 0.0], [-0.1, 0.0]]))
    assert flat.tolist() == [0, 15, 15, -1, -1]
    centres = grid.centres(torch.arange(16))
    assert torch.equal(grid.locate(centres), torch.arange(16))
    exact = Grid.build([0.0, 0.0], [1.0, 1.0], 0.004)  # the paper's running example
    assert exact.shape == (250, 250)


@pytest.mark.parametrize("eps", [1.5, [0.5, 2.0]])
def test_eps_larger_than_the_box_is_rejected(eps) -> None:
    with pytest.raises(ConfigError, match="larger than the box"):
        Grid.build([0, 0], [1, 1], eps)
    with pytest.raises(ConfigError, match="larger than the box"):
        _quiet(assess_reliability, lambda x: _truth(x), _uniform(100, 0), box=UNIT_BOX, eps=eps)


def test_bad_box_and_eps() -> None:
    with pytest.raises(ConfigError, match="below upper"):
        Grid.build([1, 0], [0, 1], 0.1)
    with pytest.raises(ConfigError, match="eps must be > 0"):
        Grid.build([0, 0], [1, 1], 0.0)
    with pytest.raises(ConfigError, match="one entry per dimension"):
        Grid.build([0, 0], [1, 1], [0.1, 0.1, 0.1])


# ====================================================================== r-separation
def test_r_separation_matches_brute_force() -> None:
    rng = np.random.default_rng(3)
    x = rng.random((300, 3))
    y = rng.integers(0, 3, 300)
    dist = np.abs(x[:, None, :] - x[None, :, :]).max(-1)
    dist[y[:, None] == y[None, :]] = np.inf
    r, i, j = closest_opposite_pair(x, y, chunk_elems=1000)  # many chunks
    assert r == pytest.approx(dist.min() / 2)
    assert dist[i, j] == pytest.approx(dist.min()) and y[i] != y[j]
    assert r_separation(x, y) == pytest.approx(r)
    assert r_separation(x, np.zeros(300, dtype=int)) == math.inf


def test_eps_auto_reproduces_the_paper_grid() -> None:
    # two labelled points of different classes 2·0.004013 apart in L∞: r̂ = 0.004013 (the running example)
    x_lab = torch.tensor([[0.30, 0.30], [0.30 + 0.008026, 0.301], [0.9, 0.9]], dtype=torch.float64)
    y_lab = torch.tensor([0, 1, 1])
    assessor = ReliabilityAssessor(_uniform(200, 0), (x_lab, y_lab),
                                   options=ReliabilityOptions.of(eps="auto", box=UNIT_BOX, bootstrap=0))
    assert assessor.r_hat == pytest.approx(0.004013)
    assert assessor.grid.shape == (250, 250)
    assert assessor.grid.eps[0] == pytest.approx(0.004)
    assert not assessor.eps_exceeds_r


def test_eps_not_below_r_hat_warns_and_is_flagged() -> None:
    x_lab = torch.tensor([[0.2, 0.2], [0.3, 0.2]], dtype=torch.float64)  # r̂ = 0.05
    with pytest.warns(ReliabilityWarning, match="r̂"):
        result = assess_reliability(lambda x: _truth(x), _uniform(200, 0), (x_lab, torch.tensor([0, 1])),
                                    eps=0.1, box=UNIT_BOX, samples_per_cell=10, bootstrap=0)
    assert result.eps_exceeds_r and result.r_hat == pytest.approx(0.05)
    with pytest.raises(ConfigError, match="labelled points of at least two classes"):
        assess_reliability(lambda x: _truth(x), _uniform(200, 0), eps="auto", box=UNIT_BOX)


# ====================================================================== engine protocol
def test_cell_tally_engine_update_merge_payload() -> None:
    a = CellTallyEngine(3, 2)
    b = CellTallyEngine(3, 2)
    a.update(torch.tensor([0, 0, 1]), torch.tensor([1, 0, 1]))
    b.update(torch.tensor([1, 2, 2]), torch.tensor([1, 0, 0]), cell_range=(1, 3))
    a.merge(b)
    assert a.compute().tolist() == [[1, 1], [0, 2], [2, 0]]
    back = Engine.from_payload(json.loads(json.dumps(a.state_payload())))
    assert isinstance(back, CellTallyEngine) and torch.equal(back.counts, a.counts)
    with pytest.raises(ValueError, match="n_cells"):
        a.merge(CellTallyEngine(4, 2))
    with pytest.raises(ConfigError):
        CellTallyEngine(3, 1)


# ====================================================================== the synthetic 2-D problem with known pmi
def test_synthetic_strip_estimate_within_three_standard_errors() -> None:
    """Uniform OP on [0,1]², truth x₁ ≥ 0.5, model x₁ ≥ 0.5 + δ: the true pmi is δ (the strip's mass)."""
    delta = 0.13  # 2.6 cells of side 0.05: two cells with λ_i = 1 and one with λ_i = 0.6
    result = _quiet(
        assess_reliability,
        lambda x: (x[:, 0] >= 0.5 + delta).long(),
        OperationalProfile(_uniform(4000, 1), bandwidth=0.02),
        (_uniform(4000, 2), _truth(_uniform(4000, 2))),
        eps=0.05, box=UNIT_BOX, samples_per_cell=2000, bootstrap=50, method="normal",
        compare_methods=("chernoff", "clopper-pearson", "jeffreys"), seed=7,
    )
    assert result.cells_normal == 400 and result.cells_empty == 0 and result.cells_cross == 0
    assert abs(result.E - delta) <= 3 * result.std, (result.E, result.std)
    assert result.std > 0
    for alt in result.alternatives.values():
        assert alt.Ub >= result.E - 3 * result.std
    assert result.alternatives["chernoff"].Ub >= result.E
    assert result.model_queries == 400 * 2000
    partial = result.cells.unastuteness[(result.cells.lower[:, 0] - 0.6).abs() < 1e-9]
    assert partial.mean().item() == pytest.approx(0.6, abs=0.02)  # the cell the model boundary cuts


def test_cell_types_votes_and_cross_boundary_cells() -> None:
    # labelled points: class 0 in cell (0,0), classes 0 and 1 in cell (1,1), nothing elsewhere
    x_lab = torch.tensor([[0.1, 0.1], [0.6, 0.6], [0.7, 0.7]], dtype=torch.float64)
    y_lab = torch.tensor([0, 0, 1])
    result = _quiet(assess_reliability, lambda x: torch.ones(x.shape[0], dtype=torch.long),
                    _uniform(500, 3), (x_lab, y_lab), eps=0.5, box=UNIT_BOX, samples_per_cell=50, bootstrap=0,
                    method="normal")
    cells = result.cells
    by_flat = {int(f): i for i, f in enumerate(cells.flat)}
    assert int(cells.cell_type[by_flat[0]]) == NORMAL and int(cells.label[by_flat[0]]) == 0
    assert int(cells.cell_type[by_flat[3]]) == CROSS and int(cells.trials[by_flat[3]]) == 0
    assert int(cells.cell_type[by_flat[1]]) == EMPTY and int(cells.label[by_flat[1]]) == 1  # the model's vote
    assert (result.cells_normal, result.cells_empty, result.cells_cross) == (1, 2, 1)
    lam = cells.unastuteness
    assert lam[by_flat[0]] == 1.0 and lam[by_flat[3]] == 1.0 and lam[by_flat[1]] == 0.0
    assert result.model_queries == 3 * 50  # the cross-boundary cell is not sampled
    expected = float(cells.op[by_flat[0]] + cells.op[by_flat[3]])
    assert result.E == pytest.approx(expected)


def test_critical_confusions_count_only_the_named_pairs() -> None:
    x_lab = _uniform(2000, 4)
    y_lab = _truth(x_lab)
    swap = lambda x: 1 - _truth(x)  # noqa: E731 - always wrong
    common = dict(eps=0.25, box=UNIT_BOX, samples_per_cell=20, bootstrap=0, method="normal")
    everything = _quiet(assess_reliability, swap, _uniform(800, 5), (x_lab, y_lab), **common)
    only_1_to_0 = _quiet(assess_reliability, swap, _uniform(800, 5), (x_lab, y_lab), failures=[(1, 0)], **common)
    assert everything.E == pytest.approx(1.0)
    right_half = everything.cells.op[everything.cells.label == 1].sum().item()
    assert only_1_to_0.E == pytest.approx(right_half)
    assert only_1_to_0.failure_set == ((1, 0),)
    with pytest.raises(ConfigError, match="distinct"):
        assess_reliability(swap, _uniform(50, 0), failures=[(1, 1)], eps=0.5, box=UNIT_BOX)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda f: (lambda x: torch.nn.functional.one_hot(f(x), 2).float() * 3.0 - 1.0),  # logits
        lambda f: (lambda x: torch.nn.functional.one_hot(f(x), 2).double()),  # probabilities
        lambda f: (lambda x: f(x).numpy()),  # numpy labels from any callable
    ],
)
def test_model_outputs_logits_probabilities_or_labels(wrap) -> None:
    labels = lambda x: (x[:, 0] >= 0.6).long()  # noqa: E731
    common = dict(eps=0.1, box=UNIT_BOX, samples_per_cell=100, bootstrap=0, method="normal", seed=1)
    ref = _quiet(assess_reliability, labels, _uniform(500, 6), (_uniform(500, 7), _truth(_uniform(500, 7))), **common)
    got = _quiet(assess_reliability, wrap(labels), _uniform(500, 6), (_uniform(500, 7), _truth(_uniform(500, 7))),
                 **common)
    assert got.E == ref.E and torch.equal(got.cells.failures, ref.cells.failures)


def test_torch_module_model() -> None:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).eval()
    result = _quiet(assess_reliability, mlp, _uniform(300, 8), eps=0.25, box=UNIT_BOX, samples_per_cell=64,
                    bootstrap=0)
    assert result.cells_empty == 16 and result.model_queries == 16 * 64
    assert 0.0 <= result.E <= result.Ub <= 1.0


@pytest.mark.parametrize(
    "bad_model, match",
    [
        (lambda x: torch.zeros(x.shape[0], 1), r"single score per input is ambiguous"),
        (lambda x: torch.zeros(x.shape[0], 2, 2), r"returned shape \(2, 2, 2\)"),
        (lambda x: torch.zeros(x.shape[0]), "integer class labels"),
        (lambda x: torch.zeros(x.shape[0] + 1, 2), "expected logits"),
        (lambda x: (torch.zeros(x.shape[0], 2),), "returned shape"),
        (lambda x: {"logits": 1}, "returned dict"),
    ],
)
def test_model_with_the_wrong_output_shape_is_a_clear_error(bad_model, match: str) -> None:
    with pytest.raises(MetricError, match=match):
        _quiet(assess_reliability, bad_model, _uniform(100, 0), eps=0.5, box=UNIT_BOX, samples_per_cell=4,
               bootstrap=0)


def test_labels_outside_num_classes_are_rejected() -> None:
    with pytest.raises(MetricError, match="num_classes"):
        assess_reliability(lambda x: torch.full((x.shape[0],), 5), _uniform(100, 0), eps=0.5, box=UNIT_BOX,
                           samples_per_cell=4, bootstrap=0, num_classes=3)


def test_a_label_out_of_range_in_a_later_batch_is_rejected_after_the_loop() -> None:
    calls = []

    def late_bad(x: torch.Tensor) -> torch.Tensor:
        if not probing():  # the guard's determinism probe gets the same answers twice
            calls.append(x.shape[0])
        labels = torch.zeros(x.shape[0], dtype=torch.int64)
        if len(calls) > 1:  # the probe passes; a sampling batch predicts class 7
            labels[-1] = 7
        return labels

    with pytest.raises(MetricError, match="predicted label 7, outside 0..2"):
        assess_reliability(late_bad, _uniform(100, 0), eps=0.5, box=UNIT_BOX, samples_per_cell=4, bootstrap=0,
                           num_classes=3)


# ====================================================================== bad inputs at the top level
def test_bad_inputs_have_clear_errors() -> None:
    model = lambda x: _truth(x)  # noqa: E731
    with pytest.raises(DataError, match="empty"):
        assess_reliability(model, torch.zeros(0, 2), eps=0.5, box=UNIT_BOX)
    nan_data = _uniform(50, 0)
    nan_data[3, 0] = float("nan")
    with pytest.raises(DataError, match="row 3, column 0"):
        assess_reliability(model, nan_data, eps=0.5, box=UNIT_BOX)
    nan_lab = _uniform(20, 1)
    nan_lab[4, 1] = float("nan")
    with pytest.raises(DataError, match="row 4, column 1"):
        assess_reliability(model, _uniform(50, 0), (nan_lab, _truth(_uniform(20, 1))), eps=0.5, box=UNIT_BOX)
    for bad in (0.0, 1.0, 1.5, -0.2):
        with pytest.raises(ConfigError, match="confidence"):
            assess_reliability(model, _uniform(50, 0), eps=0.5, box=UNIT_BOX, confidence=bad)
    with pytest.raises(ConfigError, match="unknown method"):
        assess_reliability(model, _uniform(50, 0), eps=0.5, box=UNIT_BOX, method="wald")
    with pytest.raises(ConfigError, match="bootstrap"):
        assess_reliability(model, _uniform(50, 0), eps=0.5, box=UNIT_BOX, bootstrap=1)
    with pytest.raises(ConfigError, match="samples_per_cell"):
        assess_reliability(model, _uniform(50, 0), eps=0.5, box=UNIT_BOX, samples_per_cell=0)
    with pytest.raises(ConfigError, match="mass_target"):
        assess_reliability(model, _uniform(50, 0), eps=0.5, box=UNIT_BOX, mass_target=0.0)
    with pytest.raises(ConfigError, match="bandwidth"):
        assess_reliability(model, _uniform(50, 0), eps=0.5, box=UNIT_BOX, bandwidth=-1.0)
    with pytest.raises(DataError, match="integer class indices"):
        assess_reliability(model, _uniform(50, 0), (_uniform(5, 1), torch.rand(5)), eps=0.5, box=UNIT_BOX)
    with pytest.raises(MetricError, match="no mass in the box"):
        assess_reliability(model, _uniform(50, 0) + 100.0, eps=0.5, box=UNIT_BOX, bandwidth=0.01)
    with pytest.raises(ConfigError, match="max_cells"):
        assess_reliability(model, _uniform(50, 0), eps=1e-4, box=UNIT_BOX)  # 10^8 cells without a budget
    with pytest.raises(ConfigError, match="out of reach"):
        assess_reliability(model, _uniform(50, 0, d=6), eps=0.01, box=([0] * 6, [1] * 6), max_cells=10)


# ====================================================================== many cells: mass target, budget, rest
def test_mass_target_budget_and_conservative_rest() -> None:
    op = 0.5 + 0.1 * torch.randn(2000, 2, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    model = lambda x: _truth(x)  # noqa: E731 - perfect model
    labelled = (_uniform(3000, 10), _truth(_uniform(3000, 10)))
    common = dict(eps=0.05, box=UNIT_BOX, samples_per_cell=10, bootstrap=20, method="normal")
    full = _quiet(assess_reliability, model, op, labelled, **common)
    top = _quiet(assess_reliability, model, op, labelled, mass_target=0.9, **common)
    assert full.cells_evaluated == 400 and full.E == pytest.approx(0.0, abs=1e-12)
    assert top.cells_evaluated < 100 and top.mass_evaluated >= 0.9
    assert top.E == pytest.approx(top.mass_rest) and top.mass_rest == pytest.approx(1 - top.mass_evaluated)
    op_sorted = top.cells.op
    assert torch.all(op_sorted[:-1] >= op_sorted[1:])  # descending OP
    budget = _quiet(assess_reliability, model, op, labelled, max_cells=10, **common)
    assert budget.cells_evaluated == 10 and budget.E == pytest.approx(budget.mass_rest)
    optimistic = _quiet(assess_reliability, model, op, labelled, max_cells=10, conservative_rest=False, **common)
    assert optimistic.E == pytest.approx(0.0, abs=1e-12) and not optimistic.conservative_rest
    assert optimistic.cells.op.sum().item() == pytest.approx(1.0)
    assert "average pmi" in optimistic.summary()


def test_big_grid_with_a_budget_keeps_the_top_cells() -> None:
    data = 0.5 + 0.01 * torch.randn(500, 2, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    assessor = _quiet(ReliabilityAssessor, data, options=ReliabilityOptions.of(eps=2.0e-4, box=UNIT_BOX, max_cells=50,
                                                                               bootstrap=0, samples_per_cell=2))
    assert assessor.grid.n_cells == 25_000_000
    centres = assessor.grid.centres(assessor._flat)
    assert torch.all((centres - 0.5).abs().max(1).values < 0.01)  # the densest cells, around the mode
    assert torch.all(assessor._op[:-1] >= assessor._op[1:])


def test_centre_masses_and_unnormalised_profile() -> None:
    data = _uniform(1000, 12) * 0.8 + 0.1
    labelled = (_uniform(1000, 13), _truth(_uniform(1000, 13)))
    common = dict(eps=0.1, box=UNIT_BOX, samples_per_cell=10, bootstrap=0, method="normal")
    exact = _quiet(assess_reliability, _truth, data, labelled, **common)
    centre = _quiet(assess_reliability, _truth, data, labelled, mass="centre", **common)
    assert exact.cells.op.sum().item() == pytest.approx(1.0)
    assert centre.cells.op.sum().item() == pytest.approx(1.0)
    assert torch.allclose(exact.cells.op.sort().values, centre.cells.op.sort().values, atol=2e-3)
    raw = _quiet(assess_reliability, _truth, data, labelled, normalize=False, bandwidth=0.2, **common)
    assert raw.mass_evaluated < 0.95 and raw.E == pytest.approx(raw.mass_rest)  # KDE mass outside the box


# ====================================================================== reproducibility and splitting
def test_results_do_not_depend_on_batch_size_or_worker_split() -> None:
    mlp = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).eval()
    data = _uniform(400, 14)
    labelled = (_uniform(400, 15), _truth(_uniform(400, 15)))
    kw = dict(eps=0.1, box=UNIT_BOX, samples_per_cell=300, bootstrap=0, seed=5)
    small = _quiet(ReliabilityAssessor, data, labelled, options=ReliabilityOptions.of(batch_size=4096, **kw))
    large = _quiet(ReliabilityAssessor, data, labelled, options=ReliabilityOptions.of(batch_size=40960, **kw))
    ref = small.sample(mlp)
    assert torch.equal(ref.counts, large.sample(mlp).counts)
    parts = [_quiet(ReliabilityAssessor, data, labelled, options=ReliabilityOptions.of(**kw)) for _ in range(3)]
    engines = [p.sample(mlp, rank=r, world_size=3) for r, p in enumerate(parts)]
    merged = engines[0].merge(engines[1]).merge(engines[2])
    assert torch.equal(merged.counts, ref.counts)
    assert parts[0].finish(merged).E == small.finish(ref).E
    with pytest.raises(MetricError, match="merge the engines"):
        parts[0].finish(engines[0].__class__(engines[0].n_cells, 2).merge(engines[1]))


def test_proportional_allocation() -> None:
    data = 0.5 + 0.15 * torch.randn(3000, 2, generator=torch.Generator().manual_seed(16), dtype=torch.float64)
    assessor = _quiet(ReliabilityAssessor, data, options=ReliabilityOptions.of(eps=0.1, box=UNIT_BOX, samples_per_cell=100,
                                                                               allocation="proportional", bootstrap=0))
    share = assessor._op / assessor._op.sum()
    expected = torch.round(share * 100 * 100).clamp_min(1).to(torch.int64)
    assert torch.equal(assessor._trials, expected)
    result = assessor.assess(lambda x: _truth(x))
    assert result.allocation == "proportional" and result.model_queries == int(expected.sum())


# ====================================================================== latent space
def test_latent_cells_are_decoded_before_the_model_sees_them() -> None:
    gen = torch.Generator().manual_seed(17)
    latent = torch.rand(1500, 2, generator=gen, dtype=torch.float64)
    mixing = torch.randn(2, 6, generator=gen, dtype=torch.float64)
    images = (latent @ mixing).reshape(1500, 2, 3)
    pca = PCA(2, dtype=torch.float64).fit(images)
    profile = OperationalProfile(images, encoder=pca.encode, decoder=pca.decode)
    seen_shapes = []

    def model(x: torch.Tensor) -> torch.Tensor:
        seen_shapes.append(tuple(x.shape[1:]))
        z = pca.encode(x.to(torch.float64))
        return (z[:, 0] >= 0.0).long()  # a model whose boundary is the first principal axis

    z_lab = pca.encode(images)
    result = _quiet(assess_reliability, model, profile, (images, (z_lab[:, 0] >= 0.0).long()), eps=0.25,
                    samples_per_cell=50, bootstrap=10, method="normal")
    assert set(seen_shapes) == {(2, 3)}
    # the model is right everywhere: the cross-boundary cells (λ_i = 1 by rule) contribute, and the few
    # boundary cells whose labelled points happen to lie on one side only
    assert result.latent and result.cells_cross > 0
    cross_mass = float(result.cells.op[result.cells.cell_type == CROSS].sum())
    assert cross_mass <= result.E <= cross_mass + 0.02
    assert json.dumps(result.to_details())


# ====================================================================== the result object
def test_result_reporting_is_json_able_and_complete() -> None:
    result = _quiet(assess_reliability, lambda x: _truth(x), _uniform(300, 18), (_uniform(300, 19),
                    _truth(_uniform(300, 19))), eps=0.25, box=UNIT_BOX, samples_per_cell=20, bootstrap=10,
                    compare_methods=("normal", "jeffreys"))
    details = result.to_details()
    text = json.dumps(details, allow_nan=False)
    for key in ("E", "Var", "Ub", "r_hat", "eps", "cells", "mass_evaluated", "model_queries", "seconds", "method"):
        assert key in details
    assert result.method == "chernoff" and set(result.alternatives) == {"normal", "jeffreys"}
    assert "Ub97.5%" in result.detail() and "model queries" in result.detail()
    assert "r̂" in result.summary() and "jeffreys" in result.summary()
    assert json.loads(text)["cells"]["normal"] == result.cells_normal
    no_labels = _quiet(assess_reliability, lambda x: _truth(x), _uniform(300, 18), eps=0.5, box=UNIT_BOX,
                       samples_per_cell=5, bootstrap=0)
    assert no_labels.to_details()["r_hat"] is None and no_labels.cells_empty == 4


# ====================================================================== coverage simulation
COVERAGE_SEEDS = 300


def _checker_model(side: float):
    """Correct except on a fine checkerboard of tiny squares: λ_i = side² in every cell of side 0.1.

    Period 1/40 in each coordinate (4 × 4 periods per cell); inside each period the square
    ``[0, side/40)²`` flips the answer, so the failure probability of a uniform input in any cell
    — and hence the pmi under *any* OP over the unit square — is exactly ``side²``.
    """

    def model(x: torch.Tensor) -> torch.Tensor:
        frac = torch.remainder(x * 40.0, 1.0)
        fail = (frac[:, 0] < side) & (frac[:, 1] < side)
        return torch.where(fail, 1 - _truth(x), _truth(x))

    return model


@pytest.mark.slow
@pytest.mark.parametrize("side", [0.01, 0.1], ids=["sparse-failures", "dense-failures"])
def test_coverage_simulation_per_method(side: float, capsys: pytest.CaptureFixture[str]) -> None:
    """Share of runs whose Ub covers the true pmi, per method, over 300 seeds.

    100 cells × 200 samples = 20,000 model queries per run; the true pmi is ``side²``.

    * sparse (pmi 1e-4): two failures are expected in all, so almost every cell sees none, and in
      e^{−2} ≈ 13.5 % of the runs no cell sees any. Documented expectation for the paper's
      ``"normal"`` method: zero-failure cells add no variance (eq. 14), so a run without failures
      gets ``Ub = E = 0`` and misses the truth; its coverage is at most ``1 − e^{−2} ≈ 0.86``
      (asserted below 0.95, against the nominal 0.975).
    * dense (pmi 1e-2): two failures per cell on average; the CLT behind eq. (7) holds and the
      paper's method is close to nominal (reported, asserted ≥ 0.9).

    The sound methods must reach the nominal 97.5 % in both regimes.
    """
    truth = side**2
    model = _checker_model(side)
    methods = ("normal", "chernoff", "clopper-pearson", "jeffreys")
    covered = {m: 0 for m in methods}
    ratio = {m: 0.0 for m in methods}
    zero_failure_runs = 0
    zero_cells = 0.0
    for seed in range(COVERAGE_SEEDS):
        op = _uniform(300, 10_000 + seed)
        labelled = _uniform(1000, 20_000 + seed)
        result = _quiet(
            assess_reliability, model, op, (labelled, _truth(labelled)), eps=0.1, box=UNIT_BOX,
            samples_per_cell=200, bootstrap=20, method="normal",
            compare_methods=("chernoff", "clopper-pearson", "jeffreys"), posterior_draws=500, seed=seed,
        )
        zero_failure_runs += int(result.cells.failures.sum() == 0)
        zero_cells += float((result.cells.failures == 0).double().mean()) / COVERAGE_SEEDS
        for m in methods:
            ub = result.Ub if m == "normal" else result.alternatives[m].Ub
            covered[m] += int(ub >= truth)
            ratio[m] += ub / truth / COVERAGE_SEEDS
    share = {m: covered[m] / COVERAGE_SEEDS for m in methods}
    with capsys.disabled():
        print(f"\ncoverage of the true pmi {truth:g} at nominal 97.5 % over {COVERAGE_SEEDS} seeds "
              f"({zero_cells:.0%} of cells and {zero_failure_runs} runs without any failure):")
        for m in methods:
            print(f"  {m:>16}: coverage {share[m]:.3f}   mean Ub/truth {ratio[m]:.2f}")
    assert share["chernoff"] >= 0.975
    assert share["clopper-pearson"] >= 0.975
    assert share["jeffreys"] >= 0.975  # empirically, thanks to the per-cell prior pseudo-failures
    if side == 0.01:
        assert share["normal"] < 0.95  # the documented failure of eq. (7) with zero-failure cells
    else:
        assert share["normal"] >= 0.9


# ====================================================================== the bound against the labelled data (issue #7)
def _known_truth(n_lab: int = 3000, n_op: int = 400):
    """Uniform OP on [0, 1]², truth x₁ > 0.5, a model saying x₁ > 0.55: true pmi = OP mass of the strip ≈ 0.05."""
    gen = np.random.default_rng(0)
    x_op = torch.from_numpy(gen.random((n_op, 2)))
    x_lab = torch.from_numpy(gen.random((n_lab, 2)))
    y_lab = (x_lab[:, 0] > 0.5).long()
    model = lambda x: torch.stack([0.55 - x[:, 0], x[:, 0] - 0.55], dim=1)  # noqa: E731
    profile = OperationalProfile(x_op)
    strip = float(profile.box_mass([[0.5, 0.0]], [[0.55, 1.0]])) / float(profile.box_mass([[0.0, 0.0]], [[1.0, 1.0]]))
    return model, profile, (x_lab, y_lab), strip


def test_known_truth_vote_labels_are_contradicted_and_nearest_labels_bound_the_truth() -> None:
    """Assumption 5 hides a consistently wrong strip: both labelled-data checks must say so; 'nearest' fixes it."""
    model, profile, labelled, truth = _known_truth()
    assert truth == pytest.approx(0.05, abs=0.01)
    common = dict(eps=0.01, box=UNIT_BOX, samples_per_cell=20, bootstrap=5, seed=3)
    vote = _quiet(assess_reliability, model, profile, labelled, **common)
    assert vote.empty_cell_label == "model" and vote.Ub < truth / 3  # the paper's bound misses the strip
    assert len(vote.contradictions) == 2, vote.contradictions
    first, second = vote.contradictions
    lc = vote.labelled_check
    assert lc is not None and lc["applied"] and lc["contradicts"] and lc["lower"] > vote.Ub
    assert f"misclassifies {lc['errors']:,} of 3,000 labelled points" in first and "Assumption 5" in first
    assert "majority vote disagrees" in second and "empty_cell_label='nearest'" in second
    assert vote.vote_check is not None and vote.vote_check["vote_disagrees"] > 0
    assert "CONTRADICTION" in vote.summary() and "majority vote (Assumption 5)" in vote.summary()

    near = _quiet(assess_reliability, model, profile, labelled, empty_cell_label="nearest", **common)
    assert near.empty_cell_label == "nearest" and "nearest labelled point" in near.detail()
    assert near.contradictions == ()
    assert near.Ub >= truth and abs(near.E - truth) < 0.01, (near.E, near.Ub, truth)
    details = near.to_details()
    assert details["empty_cell_label"] == "nearest" and details["labelled_check"]["contradicts"] is False
    json.dumps(details)


def test_labelled_from_profile_false_skips_the_error_check_but_records_it() -> None:
    model, profile, labelled, _ = _known_truth(n_lab=1000)
    result = _quiet(assess_reliability, model, profile, labelled, eps=0.02, box=UNIT_BOX, samples_per_cell=10,
                    bootstrap=0, labelled_from_profile=False)
    lc = result.labelled_check
    assert lc is not None and lc["applied"] is False and lc["contradicts"] and "labelled_from_profile" in lc["skipped"]
    assert all("labelled points (error" not in c for c in result.contradictions)
    assert any("majority vote disagrees" in c for c in result.contradictions)  # (b) does not need a profile sample
    assert "not checked" in result.summary()


@pytest.mark.slow
@pytest.mark.parametrize("empty_cell_label", ["model", "nearest"])
def test_known_truth_case_at_eps_auto(empty_cell_label: str) -> None:
    """The issue's case as a user runs it: eps='auto' (below r̂: 456 × 456 cells, no violated assumption)."""
    model, profile, labelled, truth = _known_truth()
    result = assess_reliability(model, profile, labelled, box=UNIT_BOX, samples_per_cell=10, bootstrap=5,
                                empty_cell_label=empty_cell_label)
    assert result.violations == () and not result.eps_exceeds_r
    if empty_cell_label == "model":
        assert result.Ub < 0.01 and len(result.contradictions) == 2
    else:
        assert result.contradictions == () and result.Ub >= truth and abs(result.E - truth) < 0.01


def test_nearest_labels_match_brute_force() -> None:
    from pytest_dnnsafety.engines.reliability import nearest_labels

    pts, lab = _uniform(500, 1, d=3), _uniform(70, 2, d=3)
    y = torch.arange(70) % 4
    brute = y[torch.cdist(pts, lab).argmin(1)]
    assert torch.equal(nearest_labels(pts, lab, y, chunk_elems=700), brute)


def test_violated_assumptions_are_listed() -> None:
    x_lab = torch.tensor([[0.45, 0.5], [0.55, 0.5], [1.5, 0.5]], dtype=torch.float64)
    y_lab = torch.tensor([0, 1, 1])
    result = _quiet(assess_reliability, lambda x: _truth(x), _uniform(200, 4), (x_lab, y_lab), eps=0.25,
                    box=UNIT_BOX, samples_per_cell=10, bootstrap=0, accept_violated_assumptions=True)
    assert result.eps_exceeds_r and result.violations_accepted
    text = " | ".join(result.violations)
    assert "cell side ε = 0.25 ≥ r̂ = 0.05" in text and "Assumption 4" in text
    assert "1 of 3 labelled points lie outside the box" in text
    assert "accepted by the user" in result.summary()
    clean = assess_reliability(lambda x: _truth(x), _uniform(200, 4), (x_lab[:2], y_lab[:2]), eps=0.04,
                               box=UNIT_BOX, samples_per_cell=10, bootstrap=0)
    assert clean.violations == () and clean.contradictions == ()


@pytest.mark.parametrize("poison", ["nan", "inf", "nan_rows_later", "labelled_only"])
def test_non_finite_logits_are_an_error_naming_the_first_bad_batch(poison: str) -> None:
    calls = []

    def model(x: torch.Tensor) -> torch.Tensor:
        if not probing():  # the guard's determinism probe gets the same answers twice
            calls.append(x.shape[0])
        out = torch.stack([0.5 - x[:, 0], x[:, 0] - 0.5], 1)
        if poison == "nan":
            out = torch.full_like(out, float("nan"))
        elif poison == "inf":
            out[:, 1] = float("inf")
        elif poison == "nan_rows_later" and len(calls) > 3:
            out[::7] = float("nan")
        elif poison == "labelled_only" and x.shape[0] == 37:
            out[5] = float("nan")
        return out

    x_lab = _uniform(37, 9)
    with pytest.raises(MetricError, match=r"NaN/inf .* first bad batch is batch \d+") as info:
        _quiet(assess_reliability, model, _uniform(100, 0), (x_lab, _truth(x_lab)), eps=0.1, box=UNIT_BOX,
               samples_per_cell=500, bootstrap=0, batch_size=4096)
    # the labelled points are queried first (their own guard), then the probe (batch 0) and the samples
    where = "cell samples" if poison == "nan_rows_later" else "labelled points"
    assert f"max_pmi_ub: model on the {where}" in str(info.value) if where == "labelled points" else where in str(info.value)
    if poison == "nan_rows_later":
        assert "in 6568 of 50002 inputs; the first bad batch is batch 2" in str(info.value)


def test_a_model_whose_class_count_changes_after_the_labelled_points_is_an_error() -> None:
    """One guard per phase would accept 2 classes on the labelled points and 3 on the cell samples."""
    calls = []

    def model(x: torch.Tensor) -> torch.Tensor:
        if not probing():  # the guard's determinism probe gets the same answers twice
            calls.append(x.shape[0])
        out = torch.stack([0.5 - x[:, 0], x[:, 0] - 0.5], 1)
        return out if len(calls) <= 1 else torch.cat([out, out[:, :1]], 1)

    x_lab = _uniform(37, 9)
    with pytest.raises(MetricError, match="returned 3 class scores, expected 2"):
        _quiet(assess_reliability, model, _uniform(100, 0), (x_lab, _truth(x_lab)), eps=0.1, box=UNIT_BOX,
               samples_per_cell=50, bootstrap=0, batch_size=4096)
