"""Tests of norm-ball cells around operational inputs (``assess_reliability(cells="balls")``, Zhao et al. 2021, §IV)."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from pytest_dnnsafety.engines.reliability import (
    AUTO_RADIUS_CAP,
    BLOCK,
    CROSS,
    EMPTY,
    NORMAL,
    ReliabilityAssessor,
    ReliabilityOptions,
    ReliabilityWarning,
    assess_reliability,
    r_separation,
)
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.engines.core.guard import probing
from pytest_dnnsafety.engines.reliability.profile import PCA, OperationalProfile

SHIFT = 0.52  # the model's boundary; the ground truth's is 0.5


def _rand(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _shifted(x: torch.Tensor) -> torch.Tensor:
    """Two-class logits of a 1-D model whose boundary is SHIFT (class 1 right of it)."""
    s = x.reshape(x.shape[0], -1)[:, 0].to(torch.float64) - SHIFT
    return torch.stack([-s, s], 1)


# labelled points 0.1 apart (+ 0.45 and 0.55): r̂ = 0.05, truth: class 1 right of 0.5
_LAB_X = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.45, 0.55, 0.6, 0.7, 0.8, 0.9], dtype=torch.float64)[:, None]
_LAB_Y = (_LAB_X[:, 0] >= 0.5).long()


def _reference(centres: torch.Tensor, radius: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force, one ball at a time: each ball's type and exact unastuteness under the shifted model."""
    types, lam = [], []
    for c in centres[:, 0].tolist():
        lo, hi = max(0.0, c - radius), min(1.0, c + radius)
        p1 = min(max((hi - SHIFT) / (hi - lo), 0.0), 1.0)  # share of the ball the model calls class 1
        inside = {int(y) for x, y in zip(_LAB_X[:, 0].tolist(), _LAB_Y.tolist()) if abs(x - c) <= radius}
        if len(inside) > 1:
            types.append(CROSS)
            lam.append(1.0)
        elif len(inside) == 1:
            types.append(NORMAL)
            lam.append(1.0 - p1 if inside.pop() == 1 else p1)
        else:  # empty: the model's majority vote is the label (Assumption 5)
            types.append(EMPTY)
            lam.append(min(p1, 1.0 - p1))
    return torch.tensor(types), torch.tensor(lam, dtype=torch.float64)


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_ball_pmi_matches_a_brute_force_reference(norm: str) -> None:
    centres = _rand((200, 1), 1)
    radius, n = 0.04, 400
    result = assess_reliability(_shifted, centres, (_LAB_X, _LAB_Y), cells="balls", radius=radius, norm=norm,
                                clip=(0.0, 1.0), samples_per_cell=n, bootstrap=0, batch_size=BLOCK)
    types, lam = _reference(centres, radius)
    table = result.cells
    assert table is not None
    assert torch.equal(table.flat, torch.arange(200))
    assert torch.equal(table.cell_type, types)
    assert result.cells_normal + result.cells_empty + result.cells_cross == 200
    assert result.cells_normal > 0 and result.cells_empty > 0
    ref = float(lam.mean())
    se = math.sqrt(float((lam * (1 - lam)).sum()) / n) / 200
    assert ref > 0.005
    assert abs(result.E - ref) <= 3 * se + 1e-12, (result.E, ref, se)
    assert result.Ub >= result.E
    assert result.r_hat == pytest.approx(0.05)
    assert not result.eps_exceeds_r


def _recorder(store: list[torch.Tensor]):
    def model(x: torch.Tensor) -> torch.Tensor:
        if not probing():  # the guard's determinism probe repeats inputs; not samples
            store.append(x.detach().clone())
        return torch.zeros(x.shape[0], 2)
    return model


def _stream(store: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(store[1:]).reshape(sum(t.shape[0] for t in store[1:]), -1).to(torch.float64)  # drop the probe


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_samples_are_uniform_in_their_balls_with_the_input_shape(norm: str) -> None:
    centres = 0.3 + 0.4 * _rand((6, 2, 3), 2)  # "images" of shape (2, 3), far from the clip range's edges
    radius, n = 0.1, 3000
    store: list[torch.Tensor] = []
    assess_reliability(_recorder(store), centres, cells="balls", radius=radius, norm=norm, samples_per_cell=n,
                       bootstrap=0, batch_size=BLOCK, clip=(0.0, 1.0))
    assert all(t.shape[1:] == (2, 3) for t in store)
    x = _stream(store)
    assert x.shape[0] == 6 * n
    off = x - centres.reshape(6, -1).repeat_interleave(n, 0)
    d = off.shape[1]
    if norm == "linf":
        dist = off.abs().amax(1)
        assert float(dist.max()) <= radius * (1 + 1e-5)
        assert abs(float(off.mean())) < 0.01 and float(off.var()) == pytest.approx(radius**2 / 3, rel=0.05)
    else:
        dist = off.norm(dim=1)
        assert float(dist.max()) <= radius * (1 + 1e-5)
        assert float((dist / radius).pow(d).mean()) == pytest.approx(0.5, abs=0.02)  # uniform volume
        direction = off / dist[:, None]
        assert float(direction.mean(0).abs().max()) < 0.03


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_samples_stay_inside_clip(norm: str) -> None:
    centres = torch.tensor([[0.0, 0.02], [0.99, 1.0], [0.5, 0.5]], dtype=torch.float64)
    store: list[torch.Tensor] = []
    radius = 0.2
    assess_reliability(_recorder(store), centres, cells="balls", radius=radius, norm=norm, samples_per_cell=2000,
                       bootstrap=0, batch_size=BLOCK, clip=(0.0, 1.0))
    x = _stream(store)
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    off = x - centres.repeat_interleave(2000, 0)
    dist = off.abs().amax(1) if norm == "linf" else off.norm(dim=1)
    assert float(dist.max()) <= radius * (1 + 1e-5)
    if norm == "linf":  # uniform on the clipped box: the ball at the corner has samples filling [0, 0.2]²
        first = x[:2000]
        assert float(first[:, 0].mean()) == pytest.approx(0.1, abs=0.01)


def test_cross_boundary_balls_get_lambda_one_and_no_samples() -> None:
    centres = torch.tensor([[0.5], [0.2], [0.8]], dtype=torch.float64)
    lab_x = torch.tensor([[0.49], [0.51], [0.2], [0.8]], dtype=torch.float64)
    lab_y = torch.tensor([0, 1, 0, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReliabilityWarning)
        result = assess_reliability(lambda x: (x[:, 0] >= 0.5).long(), centres, (lab_x, lab_y), cells="balls",
                                    radius=0.05, samples_per_cell=100, bootstrap=0, num_classes=2,
                                    compare_methods=("normal",))
    table = result.cells
    assert table is not None
    assert table.cell_type.tolist() == [CROSS, NORMAL, NORMAL]
    assert table.unastuteness.tolist() == [1.0, 0.0, 0.0]
    assert table.trials.tolist() == [0, 100, 100]
    assert result.cells_cross == 1 and result.eps_exceeds_r  # r̂ = 0.01 < 0.05
    assert result.E == pytest.approx(1 / 3)
    assert result.model_queries == 200


def test_empty_balls_take_the_models_majority_vote() -> None:
    centres = torch.tensor([[0.1], [0.45]], dtype=torch.float64)
    # ball 0 = [0, 0.2] lies left of 0.42 → all class 0; ball 1 = [0.35, 0.55]: class 1 on [0.42, 0.55] (65 %)
    result = assess_reliability(lambda x: (x[:, 0] >= 0.42).long(), centres, cells="balls", radius=0.1,
                                samples_per_cell=4000, bootstrap=0, num_classes=2)
    table = result.cells
    assert table is not None
    assert table.cell_type.tolist() == [EMPTY, EMPTY]
    assert table.label.tolist() == [0, 1]
    assert int(table.failures[0]) == 0
    assert float(table.unastuteness[1]) == pytest.approx(0.35, abs=0.03)
    assert math.isnan(result.r_hat)


def test_zero_failures_chernoff_is_positive_normal_is_zero() -> None:
    """No failure anywhere: every λ̂_j = 0 with sample variance 0, so eq. (6) gives Var = 0 (the OP term is
    E[λ_j]²·V[Op_j] = 0) and eq. (7) claims Ub = E = 0 — overconfident; the Chernoff bound stays positive."""
    centres = _rand((50, 2), 3)
    result = assess_reliability(lambda x: torch.zeros(x.shape[0], dtype=torch.long), centres, cells="balls",
                                radius=0.05, samples_per_cell=50, bootstrap=20, num_classes=2,
                                compare_methods=("normal", "clopper-pearson", "jeffreys"))
    assert result.E == 0.0
    assert result.Ub > 0.0
    assert result.alternatives["normal"].Ub == 0.0
    assert result.alternatives["clopper-pearson"].Ub > 0.0
    assert result.alternatives["jeffreys"].Ub > 0.0


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_result_does_not_depend_on_batch_size(norm: str) -> None:
    centres = _rand((40, 3), 4)
    model = lambda x: torch.stack([x.sum(1) - 1.5, 1.5 - x.sum(1)], 1)  # noqa: E731
    results = [assess_reliability(model, centres, cells="balls", radius=0.1, norm=norm, samples_per_cell=300,
                                  bootstrap=0, batch_size=b, clip=(0.0, 1.0))
               for b in (BLOCK, 3 * BLOCK, "auto")]
    failures = [r.cells.failures for r in results if r.cells is not None]
    assert failures[0].sum() > 0
    assert all(torch.equal(failures[0], f) for f in failures[1:])
    assert results[0].E == results[1].E == results[2].E


def test_op_masses_variance_and_bootstrap() -> None:
    centres = _rand((30, 2), 5)
    model = lambda x: (x[:, 0] > 0.5).long()  # noqa: E731
    with_boot = ReliabilityAssessor(centres, options=ReliabilityOptions.of(cells="balls", radius=0.1, bootstrap=50,
                                                                           num_classes=2, samples_per_cell=50))
    m = 30
    assert torch.allclose(with_boot._op, torch.full((m,), 1 / m, dtype=torch.float64))
    assert torch.allclose(with_boot._op_var, torch.full((m,), (1 / m) * (1 - 1 / m) / m, dtype=torch.float64))
    assert with_boot._reps is not None and torch.allclose(with_boot._reps.sum(1), torch.ones(50, dtype=torch.float64))
    no_boot = ReliabilityAssessor(centres, options=ReliabilityOptions.of(cells="balls", radius=0.1, bootstrap=0,
                                                                         num_classes=2, samples_per_cell=50))
    assert float(no_boot._op_var.abs().max()) == 0.0
    a, b = with_boot.assess(model), no_boot.assess(model)
    assert a.E == b.E and a.Var > b.Var


def test_profile_input_max_balls_and_reports() -> None:
    centres = _rand((100, 2), 6)
    model = lambda x: (x[:, 0] > 0.5).long()  # noqa: E731
    kwargs = dict(cells="balls", radius=0.05, samples_per_cell=100, bootstrap=0, num_classes=2)
    raw = assess_reliability(model, centres, **kwargs)
    via_profile = assess_reliability(model, OperationalProfile(centres), **kwargs)
    assert raw.E == via_profile.E
    sub = assess_reliability(model, centres, max_balls=30, **kwargs)
    again = assess_reliability(model, centres, max_balls=30, **kwargs)
    assert sub.cells is not None and again.cells is not None
    assert torch.equal(sub.cells.flat, again.cells.flat)
    assert sub.cells.flat.unique().numel() == 30 and bool((sub.cells.flat.diff() > 0).all())
    assert sub.cells_evaluated == 30 and sub.cells_total == 100
    assert raw.grid_shape == () and raw.eps == (0.05,) and raw.cell_kind == "balls" and raw.norm == "linf"
    assert raw.mass_evaluated == 1.0 and raw.bandwidth is None
    assert "balls 100 (L∞ radius 0.05)" in raw.detail()
    assert "balls 30 of 100 operational inputs (L∞ radius 0.05)" in sub.detail()
    assert "balls 100 (L∞ radius 0.05)" in raw.summary() and "grid" not in raw.summary()
    details = raw.to_details()
    assert details["cell_kind"] == "balls" and details["norm"] == "linf" and details["radius"] == 0.05
    assert details["grid_shape"] == []
    json.dumps(details)
    l2 = assess_reliability(model, centres, norm="l2", clip=(0, 1), **kwargs)
    assert "balls 100 (L2 radius 0.05, clipped to [0, 1])" in l2.detail()


def test_auto_radius_is_r_separation_under_the_norm_and_capped() -> None:
    x = _rand((40, 3), 7)
    y = (x[:, 0] > 0.5).long()
    for norm in ("linf", "l2"):
        r_hat = r_separation(x, y, norm=norm)
        a = ReliabilityAssessor(x, (x, y), options=ReliabilityOptions.of(cells="balls", norm=norm, bootstrap=0,
                                                                         samples_per_cell=10))
        assert a.r_hat == pytest.approx(r_hat, rel=1e-12)
        assert a.radius is not None and a.radius < r_hat and a.radius == pytest.approx(min(r_hat, 0.1 * (
            float((x.max(0).values - x.min(0).values).max()) if norm == "linf"
            else float((x.max(0).values - x.min(0).values).norm()))))
    # brute-force L2 r̂, and L∞ r̂ in many dimensions (the distance-matrix path)
    dist = torch.cdist(x, x)
    assert r_separation(x, y, norm="l2") == pytest.approx(float(dist[y[:, None] != y[None, :]].min()) / 2)
    wide = _rand((60, 20), 10)
    wide_y = (wide[:, 0] > 0.5).long()
    linf = (wide[:, None] - wide[None]).abs().amax(-1)
    assert r_separation(wide, wide_y) == float(linf[wide_y[:, None] != wide_y[None, :]].min()) / 2
    # classes far apart: the cap (a tenth of the data's diameter) applies
    far_x = torch.tensor([[0.0, 0.0], [1.0, 1.0]], dtype=torch.float64)
    a = ReliabilityAssessor(far_x, (far_x, torch.tensor([0, 1])),
                            options=ReliabilityOptions.of(cells="balls", bootstrap=0, samples_per_cell=10))
    assert a.radius == pytest.approx(AUTO_RADIUS_CAP * 1.0)


def test_errors_name_the_fix() -> None:
    x = _rand((10, 2), 8)
    with pytest.raises(ConfigError, match="cells must be"):
        ReliabilityAssessor(x, options=ReliabilityOptions.of(cells="hexagons"))
    for bad in (0.0, -0.1, float("nan"), "big"):
        with pytest.raises(ConfigError, match="radius"):
            ReliabilityAssessor(x, options=ReliabilityOptions.of(cells="balls", radius=bad))
    with pytest.raises(ConfigError, match="labelled"):
        ReliabilityAssessor(x, options=ReliabilityOptions.of(cells="balls"))  # radius 'auto' without labelled data
    with pytest.raises(ConfigError, match="norm"):
        ReliabilityAssessor(x, options=ReliabilityOptions.of(cells="balls", radius=0.1, norm="l1"))
    with pytest.raises(ConfigError, match="empty_cell_label"):
        ReliabilityAssessor(x, options=ReliabilityOptions.of(cells="balls", radius=0.1, empty_cell_label="vote"))
    with pytest.raises(ConfigError, match="labels empty cells from the labelled points"):
        # no labelled points
        ReliabilityAssessor(x, options=ReliabilityOptions.of(cells="balls", radius=0.1, empty_cell_label="nearest"))
    with pytest.raises(ConfigError, match="radius"):
        ReliabilityAssessor(x, options=ReliabilityOptions.of(cells="balls", eps=0.1))
    with pytest.raises(ConfigError, match="max_balls"):
        ReliabilityAssessor(x, options=ReliabilityOptions.of(cells="balls", radius=0.1, max_cells=3))
    with pytest.raises(ConfigError, match="cells='balls' only"):
        ReliabilityAssessor(x, options=ReliabilityOptions.of(radius=0.1, eps=0.5, box=([0, 0], [1, 1])))
    with pytest.raises(ConfigError, match="clip"):
        ReliabilityAssessor(x, options=ReliabilityOptions.of(cells="balls", radius=0.1, clip=(1.0, 0.0)))
    with pytest.raises(DataError, match="outside clip"):
        ReliabilityAssessor(x + 2, options=ReliabilityOptions.of(cells="balls", radius=0.1, clip=(0.0, 1.0)))
    with pytest.raises(DataError, match="values each"):
        ReliabilityAssessor(x, (torch.zeros(3, 5), torch.tensor([0, 1, 0])),
                            options=ReliabilityOptions.of(cells="balls", radius=0.1))
    with pytest.raises(ConfigError, match="max_balls"):
        ReliabilityAssessor(x, options=ReliabilityOptions.of(cells="balls", radius=0.1, max_balls=0))


class _TinyConv(torch.nn.Module):
    """A conv net on (N, 1, 8, 8) images: fails loudly if samples arrive flattened."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.head = torch.nn.Linear(4 * 8 * 8, 3)
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(x.shape[1:]))
        return self.head(torch.relu(self.conv(x)).flatten(1))


@pytest.mark.parametrize("given_as", ["tensor", "flat_profile", "latent_profile", "flat_centres"])
def test_ball_samples_reach_a_conv_model_as_images(given_as: str) -> None:
    images = _rand((40, 1, 8, 8), 5).to(torch.float32)
    labels = torch.arange(40) % 3
    if given_as == "tensor":
        profile = images
    elif given_as == "flat_profile":
        profile = OperationalProfile(images, bandwidth=0.1)
    elif given_as == "latent_profile":  # the example project's PCA profile: balls use its raw inputs
        pca = PCA(2).fit(images)
        profile = OperationalProfile(images, encoder=pca.encode, decoder=pca.decode)
    else:  # flat operational data: the labelled inputs' shape is the model's
        profile = images.reshape(40, 64)
    model = _TinyConv().eval()
    result = assess_reliability(model, profile, (images, labels), cells="balls", radius=0.02, clip=(0.0, 1.0),
                                samples_per_cell=20, bootstrap=0, empty_cell_label="nearest")
    assert set(model.shapes) == {(1, 8, 8)}
    assert result.cells_normal == 40 and result.model_queries == 40 * 20 and result.labelled_queries == 40
    assert result.labelled_check is not None and result.labelled_check["n"] == 40


def test_nearest_labels_for_empty_balls_and_the_vote_check() -> None:
    centres = torch.tensor([[0.05], [0.33], [0.62], [0.97]], dtype=torch.float64)
    vote = assess_reliability(_shifted, centres, (_LAB_X, _LAB_Y), cells="balls", radius=0.01, clip=(0.0, 1.0),
                              samples_per_cell=50, bootstrap=0)
    near = assess_reliability(_shifted, centres, (_LAB_X, _LAB_Y), cells="balls", radius=0.01, clip=(0.0, 1.0),
                              samples_per_cell=50, bootstrap=0, empty_cell_label="nearest")
    assert vote.cells_empty == near.cells_empty == 4
    assert near.cells is not None and near.cells.label.tolist() == [0, 0, 1, 1]  # nearest of _LAB_X
    assert near.E == pytest.approx(0.0) and near.vote_check is None  # no labelled point inside any ball
    assert "nearest labelled point" in near.summary() and near.to_details()["empty_cell_label"] == "nearest"
