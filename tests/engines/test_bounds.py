"""Certified bounds (IBP, CROWN): soundness on many random networks, tightness, supported and refused layers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pytest_dnnsafety.engines.bounds import crown as bounds_crown
from pytest_dnnsafety.engines.bounds.model import BoundedModel, UnsupportedLayerError
from pytest_dnnsafety.engines.bounds.box import input_box
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError

# the "overlap" net's padding="same" with an even kernel pads asymmetrically (the transpose then goes by autograd)
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")

# ----------------------------------------------------------------------------- networks


def _randomise_bn(model: nn.Module, gen: torch.Generator) -> None:
    for module in model.modules():
        if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
            c = module.num_features
            module.running_mean.copy_(torch.randn(c, generator=gen) * 0.5)
            module.running_var.copy_(torch.rand(c, generator=gen) + 0.3)
            module.weight.data.copy_(torch.randn(c, generator=gen))
            module.bias.data.copy_(torch.randn(c, generator=gen) * 0.3)


def mlp(seed: int, sizes: tuple[int, ...] = (4, 12, 12, 3), bn: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            if bn:
                layers.append(nn.BatchNorm1d(b))
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    _randomise_bn(model, torch.Generator().manual_seed(seed))
    return model.eval()


class Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(torch.relu(self.bn(self.conv1(x)))) + x)


class ArithNet(nn.Module):
    """Normalisation and constant arithmetic in forward, torch.flatten and .view(x.size(0), -1)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.fc = nn.Linear(3 * 3 * 3, 5)
        self.out = nn.Linear(5, 3)
        self.register_buffer("mean", torch.tensor([0.3, 0.6]).reshape(2, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x - self.mean) / 0.25
        x = 2 * self.conv(x).relu() - 0.5
        x = -torch.flatten(x, 1)
        x = x.view(x.size(0), -1)
        return self.out(F.relu(self.fc(x) + 1.0))


def cnn(seed: int, variant: str) -> nn.Module:
    torch.manual_seed(seed)
    if variant == "maxpool":
        model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                              nn.Linear(4 * 3 * 3, 8), nn.ReLU(), nn.Linear(8, 3))
    elif variant == "bn_avgpool":
        model = nn.Sequential(nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                              nn.AvgPool2d(2, stride=1), nn.Conv2d(4, 4, (2, 1)), nn.ReLU(), nn.Flatten(),
                              nn.Dropout(0.3), nn.Linear(4 * 1 * 2, 3))
    elif variant == "residual":
        model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), Residual(3), nn.Flatten(),
                              nn.Linear(3 * 6 * 6, 3))
    elif variant == "overlap":  # overlapping padded max-pool, dilation, groups, padding="same", adaptive pool
        model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=2, dilation=2, groups=2), nn.ReLU(),
                              nn.MaxPool2d(3, stride=1, padding=1), nn.Conv2d(4, 4, 2, padding="same"), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(2), nn.Identity(), nn.Flatten(), nn.Linear(16, 3))
    elif variant == "arith":
        model = ArithNet()
    elif variant == "pool_first":  # max-pool fed by a conv (all its input bounds by CROWN), then a ReLU
        model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.MaxPool2d(2), nn.ReLU(), nn.Conv2d(4, 3, 1), nn.ReLU(),
                              nn.Flatten(), nn.Linear(12, 3))
    elif variant == "linear_on_rows":  # nn.Linear on the last dimension of a (C, H, W) input
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2), nn.Flatten(), nn.ReLU(),
                              nn.Linear(2 * 6 * 2, 3))
    else:  # pragma: no cover
        raise ValueError(variant)
    _randomise_bn(model, torch.Generator().manual_seed(seed))
    return model.eval()


CNN_VARIANTS = ["maxpool", "bn_avgpool", "residual", "overlap", "arith", "pool_first", "linear_on_rows"]

# ----------------------------------------------------------------------------- soundness helpers


def box_points(x_lo: torch.Tensor, x_hi: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """(B, 2n, ...) points of each box: n uniform, n random corners."""
    shape = (x_lo.shape[0], n, *x_lo.shape[1:])
    u = torch.rand(shape, generator=gen, dtype=x_lo.dtype)
    corners = (torch.rand(shape, generator=gen) < 0.5).to(x_lo.dtype)
    lo, hi = x_lo.unsqueeze(1), x_hi.unsqueeze(1)
    return torch.cat([lo + (hi - lo) * u, lo + (hi - lo) * corners], dim=1)


def extreme_points(model: nn.Module, x_lo: torch.Tensor, x_hi: torch.Tensor, steps: int = 15) -> torch.Tensor:
    """(B, 2·out, ...) projected sign-gradient attacks maximising / minimising each output."""
    b = x_lo.shape[0]
    with torch.no_grad():
        out = model((x_lo + x_hi) / 2).shape[1]
    lo = x_lo.repeat_interleave(2 * out, 0)
    hi = x_hi.repeat_interleave(2 * out, 0)
    index = torch.arange(out).repeat_interleave(2).repeat(b)
    sign = torch.tensor([1.0, -1.0], dtype=x_lo.dtype).repeat(out * b)
    x = (lo + hi) / 2
    step = (hi - lo) / 4
    for _ in range(steps):
        x = x.detach().requires_grad_(True)
        z = model(x).gather(1, index[:, None]).squeeze(1)
        (grad,) = torch.autograd.grad((z * sign).sum(), [x])
        x = torch.minimum(torch.maximum(x + step * grad.sign(), lo), hi)
        step = step * 0.8
    return x.detach().reshape(b, 2 * out, *x_lo.shape[1:])


def outputs_at(model: nn.Module, points: torch.Tensor) -> torch.Tensor:
    b, s = points.shape[:2]
    with torch.no_grad():
        return model(points.reshape(b * s, *points.shape[2:])).reshape(b, s, -1)


def assert_within(z: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> None:
    tol = 1e-4 + 1e-5 * z.abs()
    assert bool((z >= lo.unsqueeze(1) - tol).all()), float((lo.unsqueeze(1) - z).max())
    assert bool((z <= hi.unsqueeze(1) + tol).all()), float((z - hi.unsqueeze(1)).max())


def check_model(model: nn.Module, x: torch.Tensor, eps: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """IBP and CROWN sound on sampled and attacked points; CROWN never looser than IBP; margins sound."""
    gen = torch.Generator().manual_seed(seed)
    bm = BoundedModel(model)
    x_lo, x_hi = input_box(x, eps)
    ibp_lo, ibp_hi = bm.ibp(x_lo, x_hi)
    cr_lo, cr_hi = bm.crown(x_lo, x_hi)
    assert bool((cr_lo >= ibp_lo).all() & (cr_hi <= ibp_hi).all())
    assert bool((cr_lo <= cr_hi + 1e-6).all())
    points = torch.cat([box_points(x_lo, x_hi, 64, gen), extreme_points(model, x_lo, x_hi)], dim=1)
    z = outputs_at(model, points)
    for lo, hi in ((ibp_lo, ibp_hi), (cr_lo, cr_hi)):
        assert_within(z, lo, hi)
    y = torch.randint(0, z.shape[2], (x.shape[0],), generator=gen)
    for method in ("ibp", "crown"):
        margins = bm.margin_lower_bounds(x_lo, x_hi, y, method)
        assert margins.shape == (x.shape[0], z.shape[2])
        assert bool(torch.isinf(margins.gather(1, y[:, None])).all())
        true = z.gather(2, y[:, None, None].expand(-1, z.shape[1], 1)) - z  # (B, S, classes)
        finite = torch.where(torch.isinf(margins), torch.full_like(margins, -1e9), margins)
        assert bool((true >= finite.unsqueeze(1) - 1e-4 - 1e-5 * true.abs()).all())
    return {"ibp": ibp_hi - ibp_lo, "crown": cr_hi - cr_lo}


# ----------------------------------------------------------------------------- soundness


@pytest.mark.parametrize("seed", range(6))
def test_random_mlps_sound_and_crown_tighter(seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    sizes = (3 + seed % 3, 10 + seed, 8 + 2 * seed, 4, 3)[: 3 + seed % 3] + (3,)
    model = mlp(seed, sizes, bn=seed % 2 == 1)
    x = torch.randn(5, sizes[0], generator=gen)
    widths = check_model(model, x, eps=[0.02, 0.1, 0.3][seed % 3], seed=seed)
    assert float(widths["crown"].mean()) <= float(widths["ibp"].mean())


@pytest.mark.parametrize("variant", CNN_VARIANTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_conv_nets_sound(variant: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    model = cnn(seed, variant)
    x = torch.rand(4, 2, 6, 6, generator=gen)
    check_model(model, x, eps=[0.03, 0.1][seed], seed=seed)


def test_crown_strictly_tighter_than_ibp_on_a_deep_mlp() -> None:
    model = mlp(7, (6, 32, 32, 32, 4))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(7))
    widths = check_model(model, x, eps=0.05)
    assert float(widths["crown"].mean()) < 0.8 * float(widths["ibp"].mean())


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), eps=st.floats(1e-3, 0.5), width=st.integers(2, 16), depth=st.integers(1, 3))
def test_property_random_mlp_bounds_sound(seed: int, eps: float, width: int, depth: int) -> None:
    model = mlp(seed, (3, *([width] * depth), 4))
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(seed))
    check_model(model, x, eps, seed)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), eps=st.floats(1e-3, 0.2), variant=st.sampled_from(CNN_VARIANTS))
def test_property_random_conv_bounds_sound(seed: int, eps: float, variant: str) -> None:
    model = cnn(seed, variant)
    x = torch.rand(2, 2, 6, 6, generator=torch.Generator().manual_seed(seed))
    check_model(model, x, eps, seed)


def test_margin_bounds_sound_against_pgd() -> None:
    from pytest_dnnsafety.engines.perturb.adversarial import pgd

    model = cnn(3, "maxpool")
    x = torch.rand(16, 2, 6, 6, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y = model(x).argmax(1)
    bm = BoundedModel(model)
    for eps in (0.02, 0.1):
        x_lo, x_hi = input_box(x, eps, (0.0, 1.0))
        margins = bm.margin_lower_bounds(x_lo, x_hi, y)
        xa = pgd(model, x, y, eps, torch.Generator().manual_seed(0), steps=30, clip=(0.0, 1.0), loss="margin")
        with torch.no_grad():
            z = model(xa)
        true = z.gather(1, y[:, None]) - z
        assert bool((torch.isinf(margins) | (true >= margins - 1e-4)).all())
        verified = margins.min(1).values > 0
        assert not bool((verified & (z.argmax(1) != y)).any())
        assert bool((margins >= bm.margin_lower_bounds(x_lo, x_hi, y, "ibp")).all())


# ----------------------------------------------------------------------------- exactness of CROWN


def reference_crown(model: nn.Sequential, x_lo: torch.Tensor, x_hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A literal CROWN for Linear-ReLU MLPs, one sample and explicit matrices (float64): the cross-check."""
    linears = [m for m in model if isinstance(m, nn.Linear)]
    ws = [m.weight.detach().double() for m in linears]
    bs = [m.bias.detach().double() for m in linears]
    los, his = [], []
    for lo_x, hi_x in zip(x_lo.double(), x_hi.double()):
        c, r = (lo_x + hi_x) / 2, (hi_x - lo_x) / 2
        pre: list[tuple[torch.Tensor, torch.Tensor]] = []  # bounds of each pre-activation
        ibp = (lo_x, hi_x)
        for k in range(len(ws)):
            # IBP of pre-activation k from the previous (plain IBP) interval
            cc, rr = (ibp[0] + ibp[1]) / 2, (ibp[1] - ibp[0]) / 2
            i_lo, i_hi = ws[k] @ cc + bs[k] - ws[k].abs() @ rr, ws[k] @ cc + bs[k] + ws[k].abs() @ rr
            bounds = []
            for sign in (1.0, -1.0):
                a = sign * torch.eye(ws[k].shape[0], dtype=torch.float64)
                bias = torch.zeros(ws[k].shape[0], dtype=torch.float64)
                for i in range(k, -1, -1):
                    bias = bias + a @ bs[i]
                    a = a @ ws[i]
                    if i == 0:
                        break
                    lo, hi = pre[i - 1]
                    unstable = (lo < 0) & (hi > 0)
                    su = torch.where(unstable, hi / (hi - lo), (lo >= 0).double())
                    bu = torch.where(unstable, -su * lo, torch.zeros_like(lo))
                    sl = torch.where(unstable, (hi > -lo).double(), (lo >= 0).double())
                    bias = bias + a.clamp(max=0) @ bu
                    a = a.clamp(min=0) * sl + a.clamp(max=0) * su
                bounds.append(sign * (bias + a @ c - a.abs() @ r))
            pre.append((torch.maximum(bounds[0], i_lo), torch.minimum(bounds[1], i_hi)))
            ibp = (i_lo.clamp(min=0), i_hi.clamp(min=0))
        los.append(pre[-1][0])
        his.append(pre[-1][1])
    return torch.stack(los), torch.stack(his)


@pytest.mark.parametrize("sizes", [(3, 8, 3), (4, 10, 9, 3), (5, 12, 10, 8, 4)])
def test_crown_equals_literal_reference_on_mlps(sizes: tuple[int, ...]) -> None:
    model = mlp(len(sizes), sizes).double()
    x = torch.randn(6, sizes[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x_lo, x_hi = input_box(x, 0.15)
    lo, hi = BoundedModel(model).crown(x_lo, x_hi)
    ref_lo, ref_hi = reference_crown(model, x_lo, x_hi)
    assert torch.allclose(lo, ref_lo, atol=1e-9) and torch.allclose(hi, ref_hi, atol=1e-9)


@pytest.mark.parametrize("variant", ["maxpool", "bn_avgpool", "residual", "pool_first"])
def test_closed_form_chunking_and_general_path_agree(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shortcuts (closed form after one ReLU, dense Jacobians, row selection, chunks) change no bound."""
    model = cnn(0, variant).double()
    x = torch.rand(6, 2, 6, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x_lo, x_hi = input_box(x, 0.05)
    y = torch.arange(6) % 3
    reference = BoundedModel(model).crown(x_lo, x_hi)
    margins = BoundedModel(model).margin_lower_bounds(x_lo, x_hi, y)
    small = BoundedModel(model, max_elements=500)  # chunks of a few rows and samples
    for got, want in zip(small.crown(x_lo, x_hi), reference):
        assert torch.allclose(got, want, atol=1e-9)
    assert torch.allclose(small.margin_lower_bounds(x_lo, x_hi, y), margins, atol=1e-9)
    calls: list[int] = []
    original = bounds_crown.BoundState._one_relu_bounds
    monkeypatch.setattr(bounds_crown.BoundState, "_one_relu_bounds",
                        lambda self, p: calls.append(p) or original(self, p))
    BoundedModel(model).crown(x_lo, x_hi)
    monkeypatch.setattr(bounds_crown.BoundState, "_one_relu_bounds", lambda self, p: None)
    monkeypatch.setattr(bounds_crown, "_DENSE_INPUTS", 0)  # no dense Jacobians either
    for got, want in zip(BoundedModel(model).crown(x_lo, x_hi), reference):
        assert torch.allclose(got, want, atol=1e-9)
    assert torch.allclose(BoundedModel(model).margin_lower_bounds(x_lo, x_hi, y), margins, atol=1e-9)
    assert calls  # the closed form was tried (and applies to the second layer of these nets)


def test_crown_with_a_spec_and_a_shared_spec() -> None:
    model = mlp(2, (4, 10, 10, 3))
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    bm = BoundedModel(model)
    x_lo, x_hi = input_box(x, 0.1)
    spec = torch.randn(2, 3, generator=torch.Generator().manual_seed(3))
    lo_shared, hi_shared = bm.crown(x_lo, x_hi, spec)
    lo, hi = bm.crown(x_lo, x_hi, spec.expand(5, 2, 3))
    assert lo.shape == (5, 2) and torch.allclose(lo, lo_shared, atol=1e-5) and torch.allclose(hi, hi_shared, atol=1e-5)
    z = outputs_at(model, box_points(x_lo, x_hi, 200, torch.Generator().manual_seed(4)))
    values = z @ spec.T
    assert_within(values, lo, hi)
    with pytest.raises(DataError, match="spec of shape"):
        bm.crown(x_lo, x_hi, torch.ones(5, 2, 4))


# ----------------------------------------------------------------------------- exhaustive 2-D cross-check


def test_verified_boxes_have_no_misclassified_grid_point(record_property: pytest.RecordProperty) -> None:
    model = mlp(11, (2, 16, 16, 3))
    gen = torch.Generator().manual_seed(11)
    centres = torch.rand(60, 2, generator=gen) * 4 - 2
    with torch.no_grad():
        y = model(centres).argmax(1)
    bm = BoundedModel(model)
    grid = torch.stack(torch.meshgrid(torch.linspace(0, 1, 101), torch.linspace(0, 1, 101), indexing="ij"), -1)
    grid = grid.reshape(-1, 2)
    stats: dict[str, int] = {}
    for eps in (0.05, 0.15, 0.4):
        x_lo, x_hi = input_box(centres, eps)
        points = x_lo[:, None] + (x_hi - x_lo)[:, None] * grid[None]  # (B, 101², 2)
        with torch.no_grad():
            wrong = (model(points.reshape(-1, 2)).argmax(1).reshape(60, -1) != y[:, None]).any(1)
        for method in ("ibp", "crown"):
            verified = bm.margin_lower_bounds(x_lo, x_hi, y, method).min(1).values > 0
            assert not bool((verified & wrong).any()), f"{method} verified a box with a misclassified grid point"
            stats[f"{method}_eps{eps}_verified"] = int(verified.sum())
            stats[f"{method}_eps{eps}_unknown"] = int((~verified & ~wrong).sum())
        stats[f"eps{eps}_grid_falsified"] = int(wrong.sum())
        assert stats[f"crown_eps{eps}_verified"] >= stats[f"ibp_eps{eps}_verified"]
    assert stats["crown_eps0.05_verified"] > 0
    for key, value in stats.items():
        record_property(key, value)
    print("grid cross-check:", stats)


# ----------------------------------------------------------------------------- dtypes, boxes, errors


def test_float64_model_gives_float64_bounds() -> None:
    model = cnn(1, "residual").double()
    x = torch.rand(3, 2, 6, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    bm = BoundedModel(model)
    x_lo, x_hi = input_box(x, 0.05)
    lo, hi = bm.crown(x_lo.float(), x_hi.float())  # float32 inputs go to the model's dtype
    assert lo.dtype == torch.float64 and hi.dtype == torch.float64
    check_model(model, x, 0.05)


def test_input_box_and_bad_boxes() -> None:
    x = torch.tensor([[0.0, 0.5, 1.0]])
    lo, hi = input_box(x, 0.1, (0.0, 1.0))
    assert torch.allclose(lo, torch.tensor([[0.0, 0.4, 0.9]])) and torch.allclose(hi, torch.tensor([[0.1, 0.6, 1.0]]))
    with pytest.raises(DataError, match="outside the valid range"):
        input_box(x + 0.5, 0.1, (0.0, 1.0))
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ConfigError, match="eps"):
            input_box(x, bad)
    bm = BoundedModel(mlp(0, (3, 4, 2)))
    with pytest.raises(DataError, match="x_lo > x_hi"):
        bm.ibp(hi, lo - 1)
    with pytest.raises(DataError, match="NaN"):
        bm.ibp(lo * math.nan, hi)
    with pytest.raises(DataError, match="label"):
        bm.margin_lower_bounds(lo, hi, torch.tensor([5]))
    with pytest.raises(ConfigError, match="method"):
        bm.margin_lower_bounds(lo, hi, torch.tensor([1]), method="deeppoly")


class Head(nn.Module):
    def __init__(self, last: nn.Module) -> None:
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(6, 3), last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 5, batch_first=True)
        self.fc = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.fc(out[:, -1])


class FunctionNet(nn.Module):
    def __init__(self, fn: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.fc(x)
        if self.fn == "exp":
            return torch.exp(z)
        if self.fn == "product":
            return z * z
        if self.fn == "branch":
            return z if z.sum() > 0 else -z
        return z, z  # tuple output


@pytest.mark.parametrize(
    ("model", "pattern"),
    [
        (Head(nn.Softmax(dim=1)), r"layer 'head\.2' \(Softmax\) is not supported by certified bounds; supported: "),
        (Head(nn.Softplus()), r"layer 'head\.2' \(Softplus\)"),
        (Head(nn.ELU()), r"layer 'head\.2' \(ELU\).*Fix: "),
        (LSTMNet(), r"layer 'lstm' \(LSTM\)"),
        (FunctionNet("exp"), r"operation 'exp' \(function exp\)"),
        (FunctionNet("product"), r"operation 'mul'.*multiplies or divides two tensors"),
        (FunctionNet("branch"), r"could not be traced with torch\.fx"),
        (FunctionNet("tuple"), r"the model's output is not one tensor"),
        (nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect")), r"layer '0' \(Conv2d\).*reflect"),
        (nn.Sequential(nn.MaxPool2d(2, ceil_mode=True)), r"layer '0' \(MaxPool2d\).*ceil_mode"),
        (nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False)), r"layer '1' \(BatchNorm1d\)"),
    ],
    ids=["softmax", "softplus", "elu", "lstm", "torch.exp", "product", "branch", "tuple", "reflect", "ceil",
         "bn-batch-stats"],
)
def test_unsupported_layers_are_named(model: nn.Module, pattern: str) -> None:
    with pytest.raises(UnsupportedLayerError, match=pattern):
        BoundedModel(model.eval())


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_unsupported_models() -> None:
    scripted = torch.jit.script(mlp(0, (4, 5, 3)))
    with pytest.raises(UnsupportedLayerError, match="TorchScript"):
        BoundedModel(scripted)
    with pytest.raises(UnsupportedLayerError, match="not an nn.Module"):
        BoundedModel(lambda x: x)  # type: ignore[arg-type]
    wrapped = nn.Sequential(nn.Linear(4, 4), torch.jit.script(nn.Sequential(nn.ReLU())))
    with pytest.raises(UnsupportedLayerError, match="layer '1'.*TorchScript"):
        BoundedModel(wrapped.eval())
    assert issubclass(UnsupportedLayerError, MetricError)


def test_torch_export_program_is_refused() -> None:
    model = mlp(0, (4, 5, 3))
    program = torch.export.export(model, (torch.zeros(2, 4),))
    with pytest.raises(UnsupportedLayerError, match="torch.export program"):
        BoundedModel(program)  # type: ignore[arg-type]


def test_training_mode_is_refused_with_a_fix() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(8, 2))
    with pytest.raises(UnsupportedLayerError, match=r"(?s)training mode.*BatchNorm.*model\.eval\(\)"):
        BoundedModel(model.train())
    bm = BoundedModel(model.eval())
    x_lo, x_hi = input_box(torch.rand(2, 1, 4, 4), 0.1)
    bm.ibp(x_lo, x_hi)
    model.train()
    with pytest.raises(UnsupportedLayerError, match=r"model\.eval\(\)"):
        bm.crown(x_lo, x_hi)
    with pytest.raises(UnsupportedLayerError, match="training mode"):
        BoundedModel(mlp(0).train())


def test_batch_mixing_reshape_is_refused() -> None:
    class Mix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.reshape(-1, 8))  # (B, 4) → (B/2, 8): mixes samples

    bm = BoundedModel(Mix().eval())
    with pytest.raises(UnsupportedLayerError, match="batch as its first dimension"):
        bm.ibp(*input_box(torch.rand(4, 4), 0.1))


def test_digits_cnn_bounds_memory_and_ordering() -> None:
    from _digits import digits_cnn, digits_images

    model = digits_cnn()
    x, y = digits_images(64)
    bm = BoundedModel(model)
    x_lo, x_hi = input_box(x, 0.02, (0.0, 1.0))
    ibp = bm.margin_lower_bounds(x_lo, x_hi, y, "ibp").min(1).values
    crown = bm.margin_lower_bounds(x_lo, x_hi, y, "crown").min(1).values
    assert bool((crown >= ibp).all())
    assert int((crown > 0).sum()) > int((ibp > 0).sum())
    assert int((crown > 0).sum()) >= 40
