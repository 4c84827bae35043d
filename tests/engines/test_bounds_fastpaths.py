"""CROWN's fast paths (issue #31) give the same coefficients and bounds as the plain ones.

* :meth:`ReluOp.back_sparse` (the sign-dependent relaxation on the unstable neurons only, gathered per
  sample) equals :meth:`ReluOp.back_relaxed`, on contiguous and on channels-last coefficients, shared
  (one row set for the batch) or per sample;
* a convolution's transpose on channels-last data (:data:`ops.CHANNELS_LAST_PIXELS`) equals the
  contiguous one and the autograd transpose;
* the bounds of a residual CNN and of a max-pooling CNN are the same (float64) with the sparse ReLU path
  forced on everywhere, off everywhere, and with the channels-last transpose on or off.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pytest_dnnsafety.engines.bounds import crown as bounds_crown
from pytest_dnnsafety.engines.bounds import ops as bounds_ops
from pytest_dnnsafety.engines.bounds.box import input_box
from pytest_dnnsafety.engines.bounds.model import BoundedModel
from pytest_dnnsafety.engines.bounds.ops import ConvOp, ReluOp


def _relu_case(seed: int, bs: int, b: int = 3, k: int = 5, shape=(4, 6, 5)):
    gen = torch.Generator().manual_seed(seed)
    lo = torch.randn(b, *shape, generator=gen, dtype=torch.float64)
    hi = lo + torch.rand(b, *shape, generator=gen, dtype=torch.float64) * 1.5
    lo[0] = lo[0].abs()  # a sample without unstable neurons
    a = torch.randn(bs, k, *shape, generator=gen, dtype=torch.float64)
    op = ReluOp("relu", (0,), (shape,), shape)
    return op, op.relax(lo, hi), a


@pytest.mark.parametrize("bs", [1, 3])
@pytest.mark.parametrize("channels_last", [False, True])
def test_back_sparse_equals_back_relaxed(bs: int, channels_last: bool) -> None:
    for seed in range(4):
        op, relax, a = _relu_case(seed, bs)
        if channels_last:  # the layout a convolution's transpose leaves behind
            a = a.reshape(-1, *a.shape[2:]).contiguous(memory_format=torch.channels_last).reshape(a.shape)
            assert not a.is_contiguous()
        sparse = ReluOp.unstable_index(relax, 1.0)
        assert sparse is not None
        want, want_bias = op.back_relaxed(a, relax)
        got, got_bias = op.back_sparse(a, relax[0], sparse)
        assert got.shape == want.shape
        assert torch.equal(got, want)
        if got_bias is None:
            assert float(want_bias.abs().max()) == 0.0
        else:
            assert torch.allclose(got_bias, want_bias, rtol=1e-12, atol=1e-12)


def test_unstable_index_declines_dense_layers() -> None:
    _, relax, _ = _relu_case(0, 1)
    assert ReluOp.unstable_index(relax, 0.0) is None
    idx = ReluOp.unstable_index(relax, 1.0)[0]
    varying = (relax[0] != relax[1]) | (relax[2] != 0)
    assert idx.shape[1] == int(varying.flatten(1).sum(1).max())
    assert int(varying[0].sum()) == 0


@pytest.mark.parametrize(("stride", "size"), [(1, 16), (2, 16), (1, 6)])
def test_channels_last_conv_transpose(stride: int, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3, stride=stride, padding=1).double()
    out = conv(torch.zeros(1, 3, size, size, dtype=torch.float64)).shape[1:]
    op = ConvOp("conv", (0,), ((3, size, size),), tuple(out), conv)
    a = torch.randn(2, 5, *out, dtype=torch.float64)
    monkeypatch.setattr(bounds_ops, "CHANNELS_LAST_PIXELS", 1)
    fast = op.back(a)[0][0]
    monkeypatch.setattr(bounds_ops, "CHANNELS_LAST_PIXELS", 10**9)
    plain = op.back(a)[0][0]
    vjp = bounds_ops._vjp(lambda z: conv(z) - conv.bias.reshape(1, -1, 1, 1), a, (3, size, size))
    assert torch.allclose(fast, plain, atol=1e-12) and torch.allclose(plain, vjp, atol=1e-12)


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))) + x)


def _models() -> list[nn.Module]:
    torch.manual_seed(3)
    residual = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), _Block(4),
                             nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 64, 5))
    for m in residual.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    pooled = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1),
                           nn.ReLU(), nn.Flatten(), nn.Linear(4 * 64, 5))
    return [residual.eval().double(), pooled.eval().double()]


@pytest.mark.parametrize("index", [0, 1])
def test_bounds_equal_with_and_without_the_fast_paths(index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _models()[index]
    x = torch.rand(3, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lo, hi = input_box(x, 0.02, (0.0, 1.0))
    results = []
    for share, pixels in [(1.0, 1), (0.0, 10**9), (1.0, 10**9), (0.0, 1)]:
        monkeypatch.setattr(bounds_crown, "SPARSE_SHARE", share)
        monkeypatch.setattr(bounds_ops, "CHANNELS_LAST_PIXELS", pixels)
        results.append(BoundedModel(model).crown(lo, hi))
    for lo_b, hi_b in results[1:]:
        assert torch.allclose(lo_b, results[0][0], rtol=1e-9, atol=1e-9)
        assert torch.allclose(hi_b, results[0][1], rtol=1e-9, atol=1e-9)
    out = model(x)
    assert bool((results[0][0] <= out + 1e-9).all() & (out <= results[0][1] + 1e-9).all())
