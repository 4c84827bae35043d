"""Certified bounds for more layers: LeakyReLU, sigmoid, tanh, GELU, SiLU, ConvTranspose2d, torch.cat; refusals.

Every relaxation is checked to enclose its function on a dense grid (a hypothesis property over
random intervals), every network's IBP and CROWN bounds against dense sampling and a PGD attack
(an attack never beats a certified bound), and LayerNorm / softmax / attention are refused by the
constructor, before any input is bounded.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pytest_dnnsafety.engines.bounds import smooth as bounds_smooth
from pytest_dnnsafety.engines.bounds.box import input_box
from pytest_dnnsafety.engines.bounds.model import FUNCTION_KINDS, SUPPORTED, BoundedModel, UnsupportedLayerError
from pytest_dnnsafety.engines.bounds.ops import ConvTransposeOp, LeakyReluOp

# ----------------------------------------------------------------------------- the activations

ACTS = {
    "sigmoid": (lambda: nn.Sigmoid(), torch.sigmoid),
    "tanh": (lambda: nn.Tanh(), torch.tanh),
    "gelu": (lambda: nn.GELU(), F.gelu),
    "gelu_tanh": (lambda: nn.GELU(approximate="tanh"), lambda x: F.gelu(x, approximate="tanh")),
    "silu": (lambda: nn.SiLU(), F.silu),
    "leaky": (lambda: nn.LeakyReLU(0.1), lambda x: F.leaky_relu(x, 0.1)),
    "leaky_steep": (lambda: nn.LeakyReLU(2.5), lambda x: F.leaky_relu(x, 2.5)),
    "leaky_negative": (lambda: nn.LeakyReLU(-0.5), lambda x: F.leaky_relu(x, -0.5)),
}


def _op(name: str, n: int):  # noqa: ANN202 - an ElementwiseOp
    head = ("test", (0,), ((n,),), (n,))
    if name.startswith("leaky"):
        return LeakyReluOp(*head, {"leaky": 0.1, "leaky_steep": 2.5, "leaky_negative": -0.5}[name])
    if name == "gelu_tanh":
        return bounds_smooth.gelu_op(*head, approximate="tanh")
    return bounds_smooth.ACTIVATIONS[name](*head)


def _check_relaxation(name: str, lo: torch.Tensor, hi: torch.Tensor, points: int = 4001) -> None:
    """The two lines and the IBP interval enclose ``f`` on a dense grid of every ``[lo, hi]``; IBP is tight."""
    fn = ACTS[name][1]
    op = _op(name, lo.shape[1])
    al, bl, au, bu = (t.double() for t in op.relax(lo, hi))
    i_lo, i_hi = (t.double() for t in op.ibp([(lo, hi)]))
    t = torch.linspace(0, 1, points, dtype=torch.float64)
    x = lo.double()[..., None] + (hi - lo).double()[..., None] * t  # (1, n, P)
    x[..., -1] = hi.double()
    y = fn(x)
    tol = 1e-9 if lo.dtype == torch.float64 else 2e-6
    scale = 1 + y.abs() + (al[..., None] * x).abs() + (au[..., None] * x).abs()
    assert bool((al[..., None] * x + bl[..., None] <= y + tol * scale).all()), name
    assert bool((au[..., None] * x + bu[..., None] >= y - tol * scale).all()), name
    assert bool((i_lo[..., None] <= y + tol * (1 + y.abs())).all() & (i_hi[..., None] >= y - tol * (1 + y.abs())).all())
    # IBP is exact up to the grid (the extremes of f on the interval; f is 2.5-Lipschitz at most)
    gap = 1e-5 + 2.5 * (hi - lo).double() / (points - 1)
    assert bool(((y.amin(-1) - i_lo) <= gap).all() & ((i_hi - y.amax(-1)) <= gap).all()), name
    assert bool((al.isfinite() & bl.isfinite() & au.isfinite() & bu.isfinite()).all())


_END = st.floats(-12, 12, allow_nan=False)
_WIDTH = st.one_of(st.floats(0, 1e-5), st.floats(1e-5, 0.5), st.floats(0.5, 20))


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(ACTS)), ends=st.lists(st.tuples(_END, _WIDTH), min_size=1, max_size=24),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_property_relaxation_encloses_the_function(name: str, ends: list[tuple[float, float]],
                                                  dtype: torch.dtype) -> None:
    lo = torch.tensor([[a for a, _ in ends]], dtype=dtype)
    hi = lo + torch.tensor([[w for _, w in ends]], dtype=dtype)
    _check_relaxation(name, lo, hi, points=2001)


@pytest.mark.parametrize("name", sorted(ACTS))
def test_relaxation_on_a_grid_of_intervals(name: str) -> None:
    """Every interval with ends on a grid over [−8, 8] (straddling, one-sided, narrow, wide) is enclosed."""
    ends = torch.linspace(-8, 8, 41, dtype=torch.float64)
    lo, hi = torch.meshgrid(ends, ends, indexing="ij")
    keep = lo <= hi
    lo, hi = lo[keep][None], hi[keep][None]
    _check_relaxation(name, lo, hi, points=1001)
    _check_relaxation(name, lo.float(), hi.float(), points=1001)
    _check_relaxation(name, (lo + 1e-7).float(), (lo + 3e-7).float(), points=11)  # degenerate widths


@pytest.mark.slow
def test_relaxation_on_extreme_intervals() -> None:
    """Saturated, huge, tiny and denormal-width intervals: still enclosed, every coefficient finite."""
    lo = torch.tensor([[-80.0, -50, 30, -1000, -1e4, 5, -0.1, -40, 1e-30, -3e-8]], dtype=torch.float64)
    hi = torch.tensor([[-70.0, 50, 1000, 1000, -1e4 + 1, 5.0000001, 1e-9, 0, 2e-30, 3e-8]], dtype=torch.float64)
    for name in sorted(ACTS):
        for dtype in (torch.float64, torch.float32):
            _check_relaxation(name, lo.to(dtype), hi.to(dtype), points=20001)


def test_relaxation_is_exact_where_it_can_be() -> None:
    """Chords and tangents of the S-shaped functions touch them; stable LeakyReLU neurons are exact."""
    lo, hi = torch.tensor([[-3.0, 0.5]], dtype=torch.float64), torch.tensor([[-1.0, 2.0]], dtype=torch.float64)
    al, bl, au, bu = _op("sigmoid", 2).relax(lo, hi)
    assert torch.allclose(au[0, 0] * -3 + bu[0, 0], torch.sigmoid(torch.tensor(-3.0, dtype=torch.float64)))  # chord
    assert torch.allclose(al[0, 1] * 2 + bl[0, 1], torch.sigmoid(torch.tensor(2.0, dtype=torch.float64)))  # chord
    al, bl, au, bu = _op("leaky", 2).relax(torch.tensor([[1.0, -3.0]]), torch.tensor([[2.0, -1.0]]))
    assert al.tolist() == au.tolist() == [[1.0, pytest.approx(0.1)]] and bl.abs().max() == bu.abs().max() == 0


def test_second_derivative_constants() -> None:
    """``M ≥ sup |f''|`` for every activation (autograd on a grid of step 1e-4 over [−30, 30]), and not loose."""
    x = torch.linspace(-30, 30, 600_001, dtype=torch.float64, requires_grad=True)
    for name, fn in [("sigmoid", torch.sigmoid), ("tanh", torch.tanh), ("gelu", F.gelu),
                     ("gelu_tanh", ACTS["gelu_tanh"][1]), ("silu", F.silu)]:
        (d1,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
        (d2,) = torch.autograd.grad(d1.sum(), x)
        peak = float(d2.abs().max())
        assert peak <= bounds_smooth.M2[name] <= 1.05 * peak, (name, peak)
    assert bounds_smooth.M2["gelu"] >= 2 / math.sqrt(2 * math.pi)  # 2φ(0), the proved maximum
    for name, star in [("gelu", bounds_smooth._GELU_STAR), ("gelu_tanh", bounds_smooth._GELU_TANH_STAR),
                       ("silu", bounds_smooth._SILU_STAR)]:
        fn = ACTS[name][1]
        grid = torch.linspace(-5, 5, 100_001, dtype=torch.float64)
        assert abs(float(grid[fn(grid).argmin()]) - star) < 1e-3
        assert float(fn(torch.tensor(star, dtype=torch.float64))) <= float(fn(grid).min()) + 1e-12


# ----------------------------------------------------------------------------- networks


class CatNet(nn.Module):
    """Two branches concatenated (the same tensor twice too), and a constant class token expanded to the batch."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.a, self.b, self.act = nn.Linear(4, 5), nn.Linear(4, 3), act
        self.token = nn.Parameter(torch.randn(1, 2))
        self.out = nn.Linear(5 + 3 + 3 + 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.act(self.b(x))
        z = torch.cat([self.act(self.a(x)), b, b, self.token.expand(x.shape[0], -1)], dim=-1)
        return self.out(z)


class UpNet(nn.Module):
    """A small encoder-decoder: conv, activation, transposed convs (stride, output padding, dilation), cat."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.down = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.act = act
        self.up = nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1)
        self.up2 = nn.ConvTranspose2d(6, 2, 2, dilation=2, bias=False)
        self.head = nn.Linear(2 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.up(self.act(self.down(x))))  # (4, 6, 6)
        h = torch.cat((h, x), 1)  # (6, 6, 6)
        return self.head(F.leaky_relu(self.up2(h), 0.2).flatten(1))


class FunctionalNet(nn.Module):
    """The functional spellings: F.leaky_relu, torch.sigmoid, .tanh(), F.gelu, F.silu, torch.cat."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(self.fc1(x), 0.3)
        a = torch.sigmoid(self.fc2(h)) + self.fc2(h).tanh()
        b = F.silu(F.gelu(self.fc2(h), approximate="tanh")) - F.gelu(h)
        return self.fc3(torch.concat([a, b], dim=1))


def mlp(act: str, seed: int, sizes: tuple[int, ...] = (4, 12, 12, 3)) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(ACTS[act][0]())
    return nn.Sequential(*layers).eval()


def pgd_extremes(model: nn.Module, x_lo: torch.Tensor, x_hi: torch.Tensor, steps: int = 20,
                 restarts: int = 2) -> torch.Tensor:
    """(B, S, out) outputs at PGD points maximising and minimising each output (random starts included)."""
    b = x_lo.shape[0]
    with torch.no_grad():
        out = model((x_lo + x_hi) / 2).shape[1]
    reps = 2 * out * restarts
    lo, hi = x_lo.repeat_interleave(reps, 0), x_hi.repeat_interleave(reps, 0)
    index = torch.arange(out).repeat_interleave(2).repeat(restarts * b)
    sign = torch.tensor([1.0, -1.0], dtype=x_lo.dtype).repeat(out * restarts * b)
    gen = torch.Generator().manual_seed(0)
    x = lo + (hi - lo) * torch.rand(lo.shape, generator=gen, dtype=lo.dtype)
    step = (hi - lo) / 4
    for _ in range(steps):
        x = x.detach().requires_grad_(True)
        z = model(x).gather(1, index[:, None]).squeeze(1)
        (grad,) = torch.autograd.grad((z * sign).sum(), [x])
        x = torch.minimum(torch.maximum(x + step * grad.sign(), lo), hi)
        step = step * 0.85
    with torch.no_grad():
        return model(x).reshape(b, reps, out)


def sampled(model: nn.Module, x_lo: torch.Tensor, x_hi: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    """(B, 2n, out) outputs at n uniform points and n corners of each box."""
    gen = torch.Generator().manual_seed(seed)
    shape = (x_lo.shape[0], n, *x_lo.shape[1:])
    u = torch.rand(shape, generator=gen, dtype=x_lo.dtype)
    corners = (torch.rand(shape, generator=gen) < 0.5).to(x_lo.dtype)
    lo, hi = x_lo.unsqueeze(1), x_hi.unsqueeze(1)
    points = torch.cat([lo + (hi - lo) * u, lo + (hi - lo) * corners], dim=1)
    with torch.no_grad():
        return model(points.reshape(-1, *x_lo.shape[1:])).reshape(x_lo.shape[0], 2 * n, -1)


def check_sound(model: nn.Module, x: torch.Tensor, eps: float, samples: int = 256) -> dict[str, torch.Tensor]:
    """IBP and CROWN enclose sampled and PGD outputs, CROWN within IBP, margins below PGD's; returns widths."""
    bm = BoundedModel(model)
    x_lo, x_hi = input_box(x, eps)
    ibp_lo, ibp_hi = bm.ibp(x_lo, x_hi)
    cr_lo, cr_hi = bm.crown(x_lo, x_hi)
    assert bool((cr_lo >= ibp_lo).all() & (cr_hi <= ibp_hi).all() & (cr_lo <= cr_hi + 1e-6).all())
    z = torch.cat([sampled(model, x_lo, x_hi, samples), pgd_extremes(model, x_lo, x_hi)], dim=1)
    tol = 1e-5 + 1e-5 * z.abs()
    for lo, hi in ((ibp_lo, ibp_hi), (cr_lo, cr_hi)):
        assert bool((z >= lo.unsqueeze(1) - tol).all()), float((lo.unsqueeze(1) - z).max())
        assert bool((z <= hi.unsqueeze(1) + tol).all()), float((z - hi.unsqueeze(1)).max())
    y = z[:, 0].argmax(1)
    true = z.gather(2, y[:, None, None].expand(-1, z.shape[1], 1)) - z
    for method in ("ibp", "crown"):
        margins = bm.margin_lower_bounds(x_lo, x_hi, y, method)
        finite = torch.where(torch.isinf(margins), torch.full_like(margins, -1e9), margins)
        assert bool((true >= finite.unsqueeze(1) - 1e-5 - 1e-5 * true.abs()).all()), method
    return {"ibp": ibp_hi - ibp_lo, "crown": cr_hi - cr_lo, "true": z.amax(1) - z.amin(1)}


@pytest.mark.slow
@pytest.mark.parametrize("act", sorted(ACTS))
def test_mlps_sound_and_crown_tighter(act: str) -> None:
    for seed in range(2):
        model = mlp(act, seed)
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
        widths = check_sound(model, x, eps=0.2)
        assert float(widths["crown"].mean()) < float(widths["ibp"].mean())


@pytest.mark.slow
@pytest.mark.parametrize("act", ["sigmoid", "gelu", "leaky"])
def test_conv_transpose_and_cat_nets_sound(act: str) -> None:
    torch.manual_seed(3)
    model = UpNet(ACTS[act][0]()).eval()
    x = torch.rand(2, 2, 6, 6, generator=torch.Generator().manual_seed(1))
    check_sound(model, x, eps=0.05, samples=32)


@pytest.mark.parametrize("act", ["silu", "tanh", "leaky_steep"])
def test_cat_with_constants_and_functional_spellings_sound(act: str) -> None:
    torch.manual_seed(4)
    check_sound(CatNet(ACTS[act][0]()).eval(), torch.randn(4, 4), eps=0.3)
    check_sound(FunctionalNet().eval(), torch.randn(4, 4), eps=0.2)


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), eps=st.floats(1e-3, 1.0), act=st.sampled_from(sorted(ACTS)),
       depth=st.integers(1, 3), width=st.integers(2, 10))
def test_property_random_mlps_sound(seed: int, eps: float, act: str, depth: int, width: int) -> None:
    model = mlp(act, seed, (3, *([width] * depth), 3))
    check_sound(model, torch.randn(2, 3, generator=torch.Generator().manual_seed(seed)) * 2, eps, samples=128)


@pytest.mark.slow
def test_chains_of_nonlinear_ops_and_float64() -> None:
    """Activation after activation, a smooth activation into a max-pool and as the last op; float64 kept."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.GELU(), nn.MaxPool2d(2), nn.Sigmoid(), nn.ReLU(),
                          nn.Flatten(), nn.Linear(12, 6), nn.LeakyReLU(0.2), nn.Tanh(), nn.SiLU(),
                          nn.Linear(6, 3), nn.Sigmoid()).eval()
    check_sound(model, torch.rand(2, 1, 4, 4), eps=0.1, samples=64)
    model = model.double()
    lo, hi = BoundedModel(model).crown(*input_box(torch.rand(2, 1, 4, 4, dtype=torch.float64), 0.1))
    assert lo.dtype == hi.dtype == torch.float64


@pytest.mark.parametrize("config", [
    dict(stride=1, padding=0), dict(stride=2, padding=1, output_padding=1), dict(stride=3, padding=2, dilation=2),
    dict(stride=2, padding=1, dilation=3, output_padding=2, groups=2), dict(stride=(2, 1), padding=(0, 1)),
])
def test_conv_transpose_adjoint(config: dict) -> None:
    """``⟨T x, a⟩ = ⟨x, Tᵀ a⟩`` for the op's transpose, |T| on radii, and the traced output padding."""
    torch.manual_seed(0)
    module = nn.ConvTranspose2d(4, 6, 3, **config).double()
    x = torch.randn(3, 4, 5, 4, dtype=torch.float64)
    y = module(x)
    op = ConvTransposeOp("t", (0,), ((4, 5, 4),), tuple(y.shape[1:]), module)
    assert torch.allclose(op.forward([x]), y)
    a = torch.randn(3, 2, *y.shape[1:], dtype=torch.float64)
    (back,), bias = op.back(a)
    lhs = (a * op.forward([x], bias=False).unsqueeze(1)).flatten(2).sum(-1)
    rhs = (back * x.unsqueeze(1)).flatten(2).sum(-1)
    assert torch.allclose(lhs, rhs)
    assert torch.allclose(bias, (a * module.bias.reshape(1, 1, -1, 1, 1)).flatten(2).sum(-1))
    big = nn.ConvTranspose2d(4, 6, 3, **config).double()
    with torch.no_grad():
        big.weight.copy_(module.weight.abs())
    assert torch.allclose(op.abs_forward([x.abs()]), big(x.abs()) - big.bias.reshape(1, -1, 1, 1))


def test_conv_transpose_with_output_size() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1)
            self.fc = nn.Linear(2 * 8 * 8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.tanh(self.up(x, output_size=[8, 8])).flatten(1))

    check_sound(Net().eval(), torch.rand(2, 2, 4, 4), eps=0.1, samples=64)


class PermuteNet(nn.Module):
    """transpose / permute / torch.transpose of the per-sample dimensions (a patch embedding's layout change)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.fc2 = nn.Linear(3, 4), nn.Linear(4 * 5 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 2, 5, 3)
        h = torch.tanh(self.fc(x)).transpose(1, 3).permute(0, 2, 3, 1)  # (B, 5, 2, 4)
        return self.fc2(F.gelu(torch.transpose(h, -1, -2)).flatten(1))


def test_transpose_and_permute_sound_and_batch_kept_first() -> None:
    torch.manual_seed(6)
    check_sound(PermuteNet().eval(), torch.randn(3, 2, 5, 3), eps=0.1, samples=64)

    class Moves(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.transpose(0, 1)

    with pytest.raises(UnsupportedLayerError, match=r"operation 'transpose'.*moves the batch dimension.*Fix: "):
        BoundedModel(Moves().eval())


def test_supported_text_and_function_table() -> None:
    for name in ("LeakyReLU", "nn.Sigmoid", "nn.Tanh", "nn.GELU", "nn.SiLU", "nn.ConvTranspose2d", "torch.cat"):
        assert name in SUPPORTED
    for fn, kind in [(torch.sigmoid, "sigmoid"), (torch.tanh, "tanh"), (F.gelu, "gelu"), (F.silu, "silu"),
                     (F.leaky_relu, "leaky_relu"), (torch.cat, "cat")]:
        assert FUNCTION_KINDS[fn] == kind


# ----------------------------------------------------------------------------- refusals


class Encoder(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.block = nn.TransformerEncoderLayer(4, 2, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layernorm":
            return self.norm(self.q(x))
        if self.kind == "F.layer_norm":
            return F.layer_norm(self.q(x), (4,))
        if self.kind == "mha":
            return self.attn(x, x, x)[0]
        if self.kind == "transformer":
            return self.block(x)
        if self.kind == "scores":
            return self.q(x) @ self.k(x)
        if self.kind == "torch.matmul":
            return torch.matmul(self.q(x), self.k(x))
        if self.kind == "F.softmax":
            return F.softmax(self.q(x), dim=-1)
        if self.kind == "torch.softmax":
            return torch.softmax(self.q(x), -1)
        if self.kind == ".softmax":
            return self.q(x).softmax(-1)
        if self.kind == "sdpa":
            return F.scaled_dot_product_attention(self.q(x), self.k(x), x)
        if self.kind == "const_matmul":
            return self.q(x) @ self.k.weight
        raise AssertionError(self.kind)


@pytest.mark.parametrize(("kind", "pattern"), [
    ("layernorm", r"layer 'norm' \(LayerNorm\) is not supported by certified bounds; supported: .*It normalises "
                  r"each sample.*Fix: verify a model with eval-mode BatchNorm"),
    ("F.layer_norm", r"operation 'layer_norm' \(function layer_norm\).*normalises each sample.*Fix: "),
    ("mha", r"layer 'attn' \(MultiheadAttention\) is not supported by certified bounds; .*Softmax attention.*"
            r"Fix: use the attack-based robustness gates"),
    ("transformer", r"layer 'block' \(TransformerEncoderLayer\).*Softmax attention.*Fix: "),
    ("scores", r"operation 'matmul' \(function matmul\).*multiplies two tensors computed from the input.*Fix: "),
    ("torch.matmul", r"operation 'matmul' \(function matmul\).*multiplies two tensors.*Fix: "),
    ("F.softmax", r"operation 'softmax' \(function softmax\).*is not supported.*A softmax.*Fix: for a final Softmax"),
    ("torch.softmax", r"operation 'softmax' \(function softmax\).*A softmax.*Fix: "),
    (".softmax", r"operation 'softmax' \(method softmax\).*A softmax.*Fix: "),
    ("sdpa", r"operation 'scaled_dot_product_attention'.*Softmax attention.*Fix: "),
    ("const_matmul", r"operation 'matmul'.*by a constant matrix.*Fix: use nn\.Linear"),
])
def test_layernorm_softmax_attention_refused_by_the_constructor(kind: str, pattern: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model = Encoder(kind).eval()
    calls = []
    for module in model.modules():
        module.register_forward_hook(lambda *args: calls.append(1))

    def no_bounds(*args: object, **kwargs: object) -> None:
        raise AssertionError("bounds were computed before the refusal")

    monkeypatch.setattr(BoundedModel, "_build_ops", no_bounds)
    monkeypatch.setattr(BoundedModel, "_prepare", no_bounds)
    with pytest.raises(UnsupportedLayerError, match=pattern):
        BoundedModel(model)
    assert calls == []  # no forward ran (tracing is symbolic)


def test_scale_demo_vit_is_refused_and_its_resnet_is_not() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "scale_project"))
    try:
        from scale_demo.models import resnet18, vit
    finally:
        sys.path.pop(0)
    with pytest.raises(UnsupportedLayerError, match=r"layer 'blocks\.0\.norm1' \(LayerNorm\).*Fix: "):
        BoundedModel(vit(image=32, patch=16, dim=8, depth=1, heads=2))
    BoundedModel(resnet18(width=4, stem="cifar"))


@pytest.mark.parametrize(("model", "pattern"), [
    (nn.Sequential(nn.LeakyReLU(float("nan"))), r"layer '0' \(LeakyReLU\) has negative_slope=nan.*Fix: "),
    (nn.Sequential(nn.LeakyReLU(float("inf"))), r"layer '0' \(LeakyReLU\) has negative_slope=inf"),
])
def test_bad_activation_parameters_refused(model: nn.Module, pattern: str) -> None:
    with pytest.raises(UnsupportedLayerError, match=pattern):
        BoundedModel(model.eval())


def test_cat_along_the_batch_or_of_per_sample_values_refused() -> None:
    class Batch(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x], 0)

    class Negative(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x], dim=-2)

    class Index(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = torch.arange(x.shape[0], dtype=x.dtype).unsqueeze(1)
            return torch.cat([x, rows], 1)

    with pytest.raises(UnsupportedLayerError, match=r"operation 'cat'.*dim=0.*Fix: concatenate along dim=1"):
        BoundedModel(Batch().eval())
    bm = BoundedModel(Negative().eval())
    with pytest.raises(UnsupportedLayerError, match=r"operation 'cat'.*batch"):
        bm.ibp(*input_box(torch.zeros(2, 3), 0.1))
    with pytest.raises(UnsupportedLayerError, match=r"neither computed from the input nor the same tensor"):
        BoundedModel(Index().eval()).ibp(*input_box(torch.zeros(2, 3), 0.1))
