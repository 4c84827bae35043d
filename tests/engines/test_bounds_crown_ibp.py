"""CROWN-IBP margins and ``method="auto"`` (issue #30 §2): sound, between IBP and full CROWN, chosen by a cost model.

CROWN-IBP keeps the IBP intervals of every intermediate node and runs one CROWN pass back from the
margin specification; checked here on seeded random MLPs and CNNs (residual, max-pool, batch norm,
average pooling): its margins hold at sampled, corner and attacked points, are never below IBP's,
and on these nets not above full CROWN's; ``auto`` bounds each input by full CROWN or CROWN-IBP by
its estimated cost, and its progress ticks count estimated model passes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _digits import digits_cnn, digits_images
from pytest_dnnsafety.engines.bounds import crown_ibp
from pytest_dnnsafety.engines.bounds.model import BoundedModel
from pytest_dnnsafety.engines.bounds.box import input_box
from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.runtime import progress
from test_bounds import CNN_VARIANTS, box_points, cnn, extreme_points, mlp, outputs_at

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")

METHODS = ("ibp", "crown-ibp", "crown", "auto")


def _margins(model: nn.Module, x: torch.Tensor, eps: float, y: torch.Tensor) -> dict[str, torch.Tensor]:
    bm = BoundedModel(model)
    x_lo, x_hi = input_box(x, eps)
    return {method: bm.margin_lower_bounds(x_lo, x_hi, y, method) for method in METHODS}


def _true_margins(model: nn.Module, x: torch.Tensor, eps: float, y: torch.Tensor, seed: int) -> torch.Tensor:
    """(B, S, classes) margins z_y − z_j at sampled points, corners and sign-gradient attacks of each box."""
    x_lo, x_hi = input_box(x, eps)
    gen = torch.Generator().manual_seed(seed)
    points = torch.cat([box_points(x_lo, x_hi, 64, gen), extreme_points(model, x_lo, x_hi)], dim=1)
    z = outputs_at(model, points)
    return z.gather(2, y[:, None, None].expand(-1, z.shape[1], 1)) - z


def _check(model: nn.Module, x: torch.Tensor, eps: float, seed: int) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        y = model(x).argmax(1)
    margins = _margins(model, x, eps, y)
    true = _true_margins(model, x, eps, y, seed)
    for method, m in margins.items():
        assert m.shape == (x.shape[0], true.shape[2])
        assert bool(torch.isinf(m.gather(1, y[:, None])).all()), method
        finite = torch.where(torch.isinf(m), torch.full_like(m, -1e9), m)
        assert bool((true >= finite.unsqueeze(1) - 1e-4 - 1e-5 * true.abs()).all()), method  # sound
    assert bool((margins["crown-ibp"] >= margins["ibp"]).all())  # intersected with IBP: never looser
    assert bool((margins["crown"] >= margins["ibp"]).all())
    return margins


@pytest.mark.parametrize("seed", range(4))
def test_random_mlps_crown_ibp_sound_and_between(seed: int) -> None:
    model = mlp(seed, (6, 16, 16, 16, 4), bn=seed % 2 == 1)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed))
    for eps in (0.05, 0.2):
        margins = _check(model, x, eps, seed)
        finite = torch.isfinite(margins["crown"])
        # the same CROWN pass on wider intervals: looser than full CROWN here (not a theorem; the adaptive slopes
        # may differ), and tighter than IBP on average
        assert bool((margins["crown-ibp"][finite] <= margins["crown"][finite] + 1e-4).all())
        assert float(margins["crown-ibp"][finite].mean()) >= float(margins["ibp"][finite].mean())


@pytest.mark.parametrize("variant", CNN_VARIANTS)
def test_random_conv_nets_crown_ibp_sound(variant: str) -> None:
    model = cnn(1, variant)
    shape = (2, 6, 6) if variant != "linear_on_rows" else (2, 6, 6)
    x = torch.rand(4, *shape, generator=torch.Generator().manual_seed(1))
    margins = _check(model, x, 0.05, 1)
    assert torch.equal(margins["auto"], margins["crown"])  # small nets: auto is full CROWN


def test_auto_picks_crown_ibp_above_the_cost_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    model = cnn(2, "residual")
    x = torch.rand(6, 2, 6, 6, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = model(x).argmax(1)
    bm = BoundedModel(model)
    x_lo, x_hi = input_box(x, 0.05)
    used: list[torch.Tensor] = []
    small = bm.margin_lower_bounds(x_lo, x_hi, y, "auto", used=used)
    assert torch.cat(used).tolist() == [2] * 6
    monkeypatch.setattr(crown_ibp, "AUTO_MAX_PASSES", 0.0)
    used.clear()
    large = bm.margin_lower_bounds(x_lo, x_hi, y, "auto", used=used)
    assert torch.cat(used).tolist() == [1] * 6
    assert torch.equal(large, bm.margin_lower_bounds(x_lo, x_hi, y, "crown-ibp"))
    assert torch.equal(small, bm.margin_lower_bounds(x_lo, x_hi, y, "crown"))
    # a mixed batch: each input keeps the bound its own estimate picks (independent of its batch-mates)
    state = bm._prepare(x_lo, x_hi)
    full = crown_ibp.estimate(state, 2)[0]  # 3 classes: 2 margins besides e_y − e_y
    monkeypatch.setattr(crown_ibp, "AUTO_MAX_PASSES", float(full.median()))
    used.clear()
    mixed = bm.margin_lower_bounds(x_lo, x_hi, y, "auto", used=used)
    pick = full <= full.median()
    assert torch.cat(used).tolist() == [2 if p else 1 for p in pick.tolist()]
    assert torch.allclose(mixed[pick], small[pick], atol=1e-5)  # sub-batches round alike up to float error
    assert torch.allclose(mixed[~pick], large[~pick], atol=1e-5)


def test_estimates_grow_with_eps_for_crown_only() -> None:
    model = digits_cnn()
    x, _ = digits_images(4)
    bm = BoundedModel(model)
    passes = {}
    for eps in (0.001, 0.05):
        state = bm._prepare(*input_box(x, eps, (0, 1)))
        full, light, nodes = crown_ibp.estimate(state, 10)
        passes[eps] = (full, light)
        assert set(nodes) and bool((full >= light).all())
    assert bool((passes[0.05][0] > passes[0.001][0]).all())  # more unstable neurons, more rows
    assert torch.equal(passes[0.05][1], passes[0.001][1])  # CROWN-IBP: the spec's pass whatever ε
    assert bool((passes[0.05][0] <= crown_ibp.AUTO_MAX_PASSES).all())  # the digits CNN gets full CROWN


def test_digits_cnn_order_of_tightness() -> None:
    model = digits_cnn()
    x, y = digits_images()
    x, y = x[1200:1300], y[1200:1300]
    bm = BoundedModel(model)
    counts = {}
    for method in ("ibp", "crown-ibp", "crown"):
        counts[method] = int((bm.margin_lower_bounds(*input_box(x, 0.01, (0, 1)), y, method).min(1).values > 0).sum())
    assert counts["ibp"] < counts["crown-ibp"] <= counts["crown"]


def test_unknown_method_is_a_config_error() -> None:
    model = mlp(0)
    bm = BoundedModel(model)
    x = torch.zeros(2, 4)
    with pytest.raises(ConfigError, match="method='deeppoly'.*Fix"):
        bm.margin_lower_bounds(x, x, torch.zeros(2, dtype=torch.int64), "deeppoly")


def test_long_bounds_tick_progress_in_model_passes() -> None:
    model = cnn(0, "maxpool")
    x = torch.rand(3, 2, 6, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        y = model(x).argmax(1)
    bm = BoundedModel(model)
    lines: list[str] = []
    for method in ("crown", "crown-ibp"):
        with progress.active("verify", lines.append, tty=False, min_seconds=0.0, interval=0.0):
            bm.margin_lower_bounds(*input_box(x, 0.05), y, method)
    shown = [line for line in lines if crown_ibp.UNIT in line]
    assert shown and all(line.startswith("verify: ") for line in shown)
    assert any("100%" in line for line in shown)


def test_meter_counts_each_node_once() -> None:
    ticks: list[str] = []
    meter = crown_ibp.Meter({1: 10.0, 2: 30.0})
    with progress.active("m", ticks.append, tty=False, min_seconds=0.0, interval=0.0):
        meter(1, 0.5)
        meter(1, 1.0)
        meter(1, 1.0)  # repeated: ignored
        meter(3, 0.5)  # unknown node: ignored
        meter(2, 1.0)
    assert [t.split(", ")[0] for t in ticks[:3]] == ["m: 12% 5/40 bound passes", "m: 25% 10/40 bound passes",
                                                    "m: 100% 40/40 bound passes"]
