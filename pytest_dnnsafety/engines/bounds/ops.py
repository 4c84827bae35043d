"""The operations of :class:`~pytest_dnnsafety.engines.bounds.model.BoundedModel`: interval and linear relaxations.

Each traced node of a model becomes one op over per-sample shapes (the batch is always the
first dimension). An op knows three things:

* its **interval** transfer (interval bound propagation, Gowal et al. 2018): affine ops map a
  box in centre/radius form, ``c' = W·c + b``, ``r' = |W|·r`` (exact for one affine map);
  monotone ops (ReLU, max-pooling) map the two corners;
* for the affine ops, the **transpose** used by the backward linear bound propagation of CROWN
  (Zhang et al. 2018): a coefficient tensor ``A`` of shape ``(Bs, K, *out_shape)`` (K linear
  functions of the op's output, ``Bs`` 1 when shared by the whole batch) becomes the coefficients
  of the op's inputs plus a bias ``(Bs, K)``; a convolution goes back through
  ``conv_transpose2d`` (with the output padding that restores the input size), pooling through
  its autograd vector-Jacobian product;
* for the nonlinear ops, a sound **linear relaxation** built from bounds of the op's input and
  used in the *lower-bound* pass (an upper bound of ``A·z`` is minus the lower bound of ``−A·z``):

  - ReLU (CROWN): ``y ≤ u/(u−l)·(x−l)`` and ``y ≥ α·x`` with the adaptive slope ``α = 1`` if
    ``u > −l`` else ``0``; stable neurons are exact (``y = x`` or ``y = 0``);
  - max-pooling: ``y ≥ x_{j*}`` with ``j*`` the window's input of largest lower bound, and
    ``y ≤ max_j u_j``, or ``y = x_{j*}`` exactly when ``l_{j*} ≥ u_j`` for every other ``j``;
  - elementwise activations (:class:`ElementwiseOp`): two lines per neuron,
    ``al·x + bl ≤ f(x) ≤ au·x + bu`` on ``[l, u]``; LeakyReLU here (the ReLU relaxation with the
    negative slope), the smooth ones (sigmoid, tanh, GELU, SiLU) in :mod:`.smooth`.

Multi-input linear ops: residual sums (:class:`SumOp`) and ``torch.cat`` (:class:`ConcatOp`, whose
transpose splits the coefficients). A transposed convolution (:class:`ConvTransposeOp`) goes back
through its adjoint, ``conv2d`` with the same weight.

No Python loops over neurons; everything runs on the tensors' device in their dtype.
Part of :mod:`pytest_dnnsafety.engines.bounds.model` (no pytest import).
"""

from __future__ import annotations

import abc
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Op", "Linear", "Nonlinear", "LinearOp", "ConvOp", "PositiveLinearOp", "AffineOp", "SumOp", "ReshapeOp", "ReluOp",
           "MaxPoolOp", "ConvTransposeOp", "ConcatOp", "ElementwiseOp", "LeakyReluOp", "PermuteOp"]


#: A convolution's transpose runs on channels-last data on the CPU when its input has at least this many pixels.
CHANNELS_LAST_PIXELS = 256


def _pos(a: Tensor) -> Tensor:
    return a.clamp(min=0)


def _neg(a: Tensor) -> Tensor:
    return a.clamp(max=0)


def _row_dot(a: Tensor, v: Tensor) -> Tensor:
    """``Σ a·v`` over the per-row dims: ``a`` (Bs, K, *s), ``v`` (Bv, *s) or (*s) → (max(Bs, Bv), K)."""
    flat_a = a.flatten(2)
    if v.ndim == a.ndim - 1:  # (Bv, *s)
        return torch.matmul(flat_a, v.reshape(v.shape[0], -1, 1)).squeeze(-1)
    return torch.matmul(flat_a, v.reshape(-1))


def _vjp(fn: Callable[[Tensor], Tensor], a: Tensor, in_shape: tuple[int, ...]) -> Tensor:
    """The transpose of the linear map ``fn`` applied to the rows of ``a`` (autograd, exact)."""
    bs, k = a.shape[:2]
    z = torch.zeros((bs * k, *in_shape), dtype=a.dtype, device=a.device, requires_grad=True)
    with torch.enable_grad():
        out = fn(z)
        (grad,) = torch.autograd.grad(out, z, a.reshape(out.shape))
    return grad.reshape(bs, k, *in_shape)


class Op(abc.ABC):
    """One node of the bound graph. ``inputs``: indices of its tensor inputs (earlier nodes).

    Every op is either a :class:`Linear` op (an affine map: forward, its absolute value, its
    transpose) or a :class:`Nonlinear` op (a sound linear relaxation and its transpose); ``linear``
    says which, so the CROWN pass never calls a method an op does not have.
    """

    linear: bool

    def __init__(self, label: str, inputs: tuple[int, ...], in_shapes: tuple[tuple[int, ...], ...],
                 out_shape: tuple[int, ...]) -> None:
        self.label = label
        self.inputs = inputs
        self.in_shapes = in_shapes
        self.out_shape = out_shape

    @property
    def numel(self) -> int:
        return math.prod(self.out_shape)

    @abc.abstractmethod
    def ibp(self, ivs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """Interval transfer: bounds of the output from bounds of the inputs."""


class Linear(Op):
    """An affine op: ``forward``, ``abs_forward`` (|linear part| on radii) and ``back`` (its transpose)."""

    linear = True

    @abc.abstractmethod
    def forward(self, xs: list[Tensor], bias: bool = True) -> Tensor:
        """The op on concrete inputs (``bias=False``: its linear part only)."""

    @abc.abstractmethod
    def abs_forward(self, rs: list[Tensor]) -> Tensor:
        """``|linear part|`` applied to the (non-negative) radii of the inputs."""

    @abc.abstractmethod
    def back(self, a: Tensor) -> tuple[list[Tensor], Tensor | None]:
        """Coefficients ``a`` (Bs, K, *out) → coefficients of each input and a bias (Bs, K) or None."""

    def ibp(self, ivs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """Interval transfer in centre/radius form."""
        cs = [(lo + hi) / 2 for lo, hi in ivs]
        rs = [(hi - lo) / 2 for lo, hi in ivs]
        c, r = self.forward(cs), self.abs_forward(rs)
        return c - r, c + r


class Nonlinear(Op):
    """A nonlinear op with a sound linear relaxation built from its input's bounds."""

    linear = False

    @abc.abstractmethod
    def relax(self, lo: Tensor, hi: Tensor) -> tuple[Tensor, ...]:
        """The relaxation's coefficients for input bounds ``lo``/``hi``."""

    @abc.abstractmethod
    def back_relaxed(self, a: Tensor, relax: tuple[Tensor, ...]) -> tuple[Tensor, Tensor | None]:
        """Coefficients ``a`` through the relaxation: input coefficients and a bias."""


class LinearOp(Linear):
    """``nn.Linear`` on the last dimension."""

    def __init__(self, label: str, inputs: tuple[int, ...], in_shapes: Any, out_shape: Any, weight: Tensor,
                 bias: Tensor | None) -> None:
        super().__init__(label, inputs, in_shapes, out_shape)
        self.weight, self.bias = weight, bias

    def forward(self, xs: list[Tensor], bias: bool = True) -> Tensor:
        return F.linear(xs[0], self.weight, self.bias if bias else None)

    def abs_forward(self, rs: list[Tensor]) -> Tensor:
        return F.linear(rs[0], self.weight.abs())

    def back(self, a: Tensor) -> tuple[list[Tensor], Tensor | None]:
        bias = None
        if self.bias is not None:
            bias = torch.matmul(a, self.bias).reshape(a.shape[0], a.shape[1], -1).sum(-1)
        return [torch.matmul(a, self.weight)], bias


class WeightedOp(Linear):
    """A linear op ``x ↦ apply(x, W, b)`` (convolutions): forward with the bias, abs-forward with ``|W|``."""

    weight: Tensor
    bias: Tensor | None

    @abc.abstractmethod
    def _apply(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor: ...

    def forward(self, xs: list[Tensor], bias: bool = True) -> Tensor:
        return self._apply(xs[0], self.weight, self.bias if bias else None)

    def abs_forward(self, rs: list[Tensor]) -> Tensor:
        return self._apply(rs[0], self.weight.abs(), None)


class ConvOp(WeightedOp):
    """``nn.Conv2d`` (any stride, padding, dilation, groups; zeros padding)."""

    def __init__(self, label: str, inputs: tuple[int, ...], in_shapes: Any, out_shape: Any,
                 module: torch.nn.Conv2d) -> None:
        super().__init__(label, inputs, in_shapes, out_shape)
        self.weight, self.bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
        self.stride, self.padding = module.stride, module.padding
        self.dilation, self.groups = module.dilation, module.groups
        self.output_padding: tuple[int, int] | None = None
        if not isinstance(self.padding, str):
            _, h, w = in_shapes[0]
            kh, kw = self.weight.shape[2:]
            pads = []
            for size, out, k, s, p, d in zip((h, w), out_shape[1:], (kh, kw), self.stride, self.padding,
                                             self.dilation):
                pads.append(size - ((out - 1) * s - 2 * p + d * (k - 1) + 1))
            self.output_padding = (pads[0], pads[1])

    def _apply(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups)

    def back(self, a: Tensor) -> tuple[list[Tensor], Tensor | None]:
        bs, k = a.shape[:2]
        in_shape = self.in_shapes[0]
        if self.output_padding is None:  # padding="same"/"valid": autograd transpose
            out = _vjp(lambda z: self._apply(z, self.weight, None), a, in_shape)
        else:
            flat = a.reshape(bs * k, *self.out_shape)
            # CPU kernels: a transposed convolution of many small images with few channels runs 3-10x faster on
            # channels-last data (measured with 4-8 channels at 16x16-32x32, copies included); not on small images
            wide = a.device.type == "cpu" and in_shape[1] * in_shape[2] >= CHANNELS_LAST_PIXELS
            if wide:
                flat = flat.contiguous(memory_format=torch.channels_last)
            out = F.conv_transpose2d(flat, self.weight, None, self.stride, self.padding, self.output_padding,
                                     self.groups, self.dilation)
            out = out.reshape(bs, k, *in_shape)  # channels-last strides kept: the ReLUs' transposes work in them
        bias = None
        if self.bias is not None:
            bias = torch.matmul(a.sum(dim=(3, 4)), self.bias)
        return [out], bias


class PositiveLinearOp(Linear):
    """A linear map with non-negative coefficients and no bias (average pooling): ``f(lo) ≤ f(x) ≤ f(hi)``."""

    def __init__(self, label: str, inputs: tuple[int, ...], in_shapes: Any, out_shape: Any,
                 fn: Callable[[Tensor], Tensor]) -> None:
        super().__init__(label, inputs, in_shapes, out_shape)
        self.fn = fn

    def forward(self, xs: list[Tensor], bias: bool = True) -> Tensor:
        return self.fn(xs[0])

    def abs_forward(self, rs: list[Tensor]) -> Tensor:
        return self.fn(rs[0])

    def back(self, a: Tensor) -> tuple[list[Tensor], Tensor | None]:
        return [_vjp(self.fn, a, self.in_shapes[0])], None


class AffineOp(Linear):
    """Elementwise ``y = scale·x + shift`` with constants broadcastable to ``(1, *shape)``.

    Eval-mode batch norm (per-channel scale and shift) and arithmetic with constants
    (``x + c``, ``c − x``, ``x·c``, ``x / c``, ``−x``).
    """

    def __init__(self, label: str, inputs: tuple[int, ...], in_shapes: Any, out_shape: Any, scale: Tensor,
                 shift: Tensor) -> None:
        super().__init__(label, inputs, in_shapes, out_shape)
        full = (1, *out_shape)
        self.scale = scale.reshape((1,) * (len(full) - scale.ndim) + tuple(scale.shape))
        self.shift = shift.reshape((1,) * (len(full) - shift.ndim) + tuple(shift.shape))

    def forward(self, xs: list[Tensor], bias: bool = True) -> Tensor:
        y = xs[0] * self.scale
        return y + self.shift if bias else y

    def abs_forward(self, rs: list[Tensor]) -> Tensor:
        return rs[0] * self.scale.abs()

    def back(self, a: Tensor) -> tuple[list[Tensor], Tensor | None]:
        shift = self.shift.expand(1, *self.out_shape)
        per_channel = a.ndim == 5 and self.shift.ndim == 4 and self.shift.shape[2:] == (1, 1)
        dot = (lambda: torch.matmul(a.sum(dim=(3, 4)), shift[0, :, 0, 0])) if per_channel else (
            lambda: _row_dot(a, shift[0]))  # per channel (batch norm): no flattening of channels-last coefficients
        if shift.device.type == "cpu":  # skip a zero shift's bias (reading it costs nothing on the CPU)
            bias = dot() if bool((shift != 0).any()) else None
        else:  # on an accelerator always add it (a zero bias adds exact zeros): no host sync
            bias = dot()
        return [a * self.scale.unsqueeze(1)], bias


class SumOp(Linear):
    """``y = α₁·x₁ + α₂·x₂`` of two bounded tensors of one shape (residual additions, ``x − y``)."""

    def __init__(self, label: str, inputs: tuple[int, ...], in_shapes: Any, out_shape: Any,
                 coeffs: tuple[float, ...]) -> None:
        super().__init__(label, inputs, in_shapes, out_shape)
        self.coeffs = coeffs

    def forward(self, xs: list[Tensor], bias: bool = True) -> Tensor:
        return sum((c * x for c, x in zip(self.coeffs, xs)), torch.zeros((), dtype=xs[0].dtype, device=xs[0].device))

    def abs_forward(self, rs: list[Tensor]) -> Tensor:
        return sum((abs(c) * r for c, r in zip(self.coeffs, rs)),
                   torch.zeros((), dtype=rs[0].dtype, device=rs[0].device))

    def back(self, a: Tensor) -> tuple[list[Tensor], Tensor | None]:
        return [a if c == 1 else a * c for c in self.coeffs], None


class ReshapeOp(Linear):
    """Flatten / view / reshape / identity / eval-mode dropout: a per-sample relayout (batch kept first)."""

    def forward(self, xs: list[Tensor], bias: bool = True) -> Tensor:
        return xs[0].reshape(xs[0].shape[0], *self.out_shape)

    def abs_forward(self, rs: list[Tensor]) -> Tensor:
        return self.forward(rs)

    def ibp(self, ivs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        lo, hi = ivs[0]
        return self.forward([lo]), self.forward([hi])

    def back(self, a: Tensor) -> tuple[list[Tensor], Tensor | None]:
        return [a.reshape(a.shape[0], a.shape[1], *self.in_shapes[0])], None


class PermuteOp(Linear):
    """``transpose`` / ``permute`` of the per-sample dimensions (the batch stays first): ``perm`` over them."""

    def __init__(self, label: str, inputs: tuple[int, ...], in_shapes: Any, out_shape: Any,
                 perm: tuple[int, ...]) -> None:
        super().__init__(label, inputs, in_shapes, out_shape)
        self.perm = perm
        self.inverse = tuple(sorted(range(len(perm)), key=perm.__getitem__))

    def forward(self, xs: list[Tensor], bias: bool = True) -> Tensor:
        return xs[0].permute(0, *(d + 1 for d in self.perm))

    def abs_forward(self, rs: list[Tensor]) -> Tensor:
        return self.forward(rs)

    def ibp(self, ivs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        lo, hi = ivs[0]
        return self.forward([lo]), self.forward([hi])

    def back(self, a: Tensor) -> tuple[list[Tensor], Tensor | None]:
        return [a.permute(0, 1, *(d + 2 for d in self.inverse))], None


class ReluOp(Nonlinear):
    """ReLU with the CROWN relaxation (adaptive lower slope)."""

    def ibp(self, ivs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        lo, hi = ivs[0]
        return lo.clamp(min=0), hi.clamp(min=0)

    def relax(self, lo: Tensor, hi: Tensor) -> tuple[Tensor, ...]:
        """Per neuron ``(lower slope, upper slope, upper intercept)``: ``sl·x ≤ relu(x) ≤ su·x + bu``."""
        active = lo >= 0
        unstable = (lo < 0) & (hi > 0)
        width = torch.where(unstable, hi - lo, torch.ones_like(hi))
        su = torch.where(unstable, hi / width, active.to(hi.dtype))
        bu = torch.where(unstable, -su * lo, torch.zeros_like(lo))
        sl = torch.where(unstable, (hi > -lo).to(hi.dtype), active.to(hi.dtype))
        return sl, su, bu

    def back_relaxed(self, a: Tensor, relax: tuple[Tensor, ...]) -> tuple[Tensor, Tensor | None]:
        sl, su, bu = relax
        slope = torch.where(a >= 0, sl.unsqueeze(1), su.unsqueeze(1))
        bias = _row_dot(_neg(a), bu)
        return a * slope, bias

    @staticmethod
    def unstable_index(relax: tuple[Tensor, ...], dense_share: float) -> tuple[Tensor, ...] | None:
        """The neurons whose relaxation depends on the coefficient's sign, per sample, for :meth:`back_sparse`.

        ``(index (B, m), sl, su, bu at the index)`` with ``m`` the most such neurons of a sample (read
        on the host): the unstable ones first, padded with distinct stable ones. None when ``m`` exceeds
        ``dense_share`` of the neurons (the dense :meth:`back_relaxed` is then cheaper).
        """
        sl, su, bu = (t.flatten(1) for t in relax)
        varying = (sl != su) | (bu != 0)  # stable neurons have sl = su (0 or 1) and no intercept
        m = int(varying.sum(dim=1).max()) if varying.numel() else 0
        if m > dense_share * sl.shape[1]:
            return None
        idx = torch.sort(varying.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :m]
        return idx, sl.gather(1, idx), su.gather(1, idx), bu.gather(1, idx)

    def back_sparse(self, a: Tensor, sl: Tensor, sparse: tuple[Tensor, ...]) -> tuple[Tensor, Tensor | None]:
        """:meth:`back_relaxed` with the sign-dependent part on the unstable neurons only (the same values):
        ``a·sl`` everywhere (exact where stable: ``sl = su``, ``bu = 0``), the unstable ones gathered, relaxed by
        their sign and scattered back. One full-size product instead of a compare, a select, a product, a clamp."""
        idx, sl_u, su_u, bu_u = sparse
        bc, n = sl.shape[0], idx.shape[1]
        shape = self.out_shape
        last = a.ndim == 5 and a.permute(0, 1, 3, 4, 2).is_contiguous() and not a.is_contiguous()
        if last:  # channels-last coefficients (a convolution's transpose): work in that order, no relayout
            c, hw = shape[0], shape[1] * shape[2]
            flat = a.permute(0, 1, 3, 4, 2).reshape(a.shape[0], a.shape[1], -1)
            sl = sl.reshape(bc, c, hw).transpose(1, 2)
            idx = (idx % hw) * c + idx // hw
        else:
            flat = a.flatten(2)
        k = flat.shape[1]
        out = flat * sl.reshape(bc, 1, -1)
        if n:
            ix = idx.unsqueeze(1).expand(bc, k, n)
            a_u = flat.expand(bc, k, -1).gather(2, ix)
            out.scatter_(2, ix, a_u * torch.where(a_u >= 0, sl_u.unsqueeze(1), su_u.unsqueeze(1)))
            bias = torch.matmul(a_u.clamp_(max=0), bu_u.unsqueeze(2)).squeeze(2)
        else:
            bias = None
        if last:
            return out.reshape(bc, k, shape[1], shape[2], shape[0]).permute(0, 1, 4, 2, 3), bias
        return out.reshape(bc, k, *shape), bias


class MaxPoolOp(Nonlinear):
    """``nn.MaxPool2d`` (floor mode) with a sound linear relaxation per window.

    Lower: ``y ≥ x_{j*}``, ``j*`` = argmax of the window's lower bounds. Upper: ``y = x_{j*}`` when
    ``l_{j*} ≥ max_{j≠j*} u_j`` (one input dominates: exact), else the constant ``max_j u_j``.
    """


    def __init__(self, label: str, inputs: tuple[int, ...], in_shapes: Any, out_shape: Any,
                 module: torch.nn.MaxPool2d, device: torch.device) -> None:
        super().__init__(label, inputs, in_shapes, out_shape)
        self.module = module
        pair = torch.nn.modules.utils._pair
        self.kernel, self.stride = pair(module.kernel_size), pair(module.stride or module.kernel_size)
        self.padding, self.dilation = pair(module.padding), pair(module.dilation)
        c, h, w = in_shapes[0]
        index = torch.arange(c * h * w, dtype=torch.float64, device=device).reshape(1, c, h, w)
        # (C, kk, L): flat input index of every window slot, −1 for padding
        self.index = self._windows(index, -1.0)[0].round().to(torch.int64)

    def _windows(self, x: Tensor, pad_value: float) -> Tensor:
        """``(B, C, kh·kw, L)`` window contents (padding filled with ``pad_value``)."""
        ph, pw = self.padding
        if ph or pw:
            x = F.pad(x, (pw, pw, ph, ph), value=pad_value)
        (kh, kw), (dh, dw), (sh, sw) = self.kernel, self.dilation, self.stride
        win = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)[..., ::dh, ::dw]
        b, c, ho, wo = win.shape[:4]  # (B, C, Ho, Wo, kh, kw) → (B, C, kh·kw, Ho·Wo)
        return win.reshape(b, c, ho * wo, kh * kw).transpose(2, 3)

    def ibp(self, ivs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        lo, hi = ivs[0]
        return self.module(lo), self.module(hi)

    def relax(self, lo: Tensor, hi: Tensor) -> tuple[Tensor, ...]:
        """``(j* flat input index (B, Lout), dominated (B, Lout) bool, max upper bound (B, Lout))``."""
        b = lo.shape[0]
        lows = self._windows(lo, -math.inf)
        highs = self._windows(hi, -math.inf)
        lstar, slot = lows.max(dim=2)
        index = self.index.unsqueeze(0).expand(b, -1, -1, -1)
        jstar = index.gather(2, slot.unsqueeze(2)).squeeze(2)
        others = highs.scatter(2, slot.unsqueeze(2), -math.inf).amax(dim=2)
        dominated = lstar >= others
        upper = highs.amax(dim=2)
        return jstar.reshape(b, -1), dominated.reshape(b, -1), upper.reshape(b, -1)

    def back_relaxed(self, a: Tensor, relax: tuple[Tensor, ...]) -> tuple[Tensor, Tensor | None]:
        jstar, dominated, upper = relax
        bc = jstar.shape[0]
        lam = a.flatten(2)
        neg = _neg(lam)
        dom = dominated.unsqueeze(1).to(lam.dtype)
        coef = (_pos(lam) + neg * dom).expand(bc, -1, -1)
        bias = _row_dot(neg * (1 - dom), upper)
        k = lam.shape[1]
        out = torch.zeros((bc, k, math.prod(self.in_shapes[0])), dtype=lam.dtype, device=lam.device)
        out.scatter_add_(2, jstar.unsqueeze(1).expand(bc, k, -1), coef)
        return out.reshape(bc, k, *self.in_shapes[0]), bias


class ConvTransposeOp(WeightedOp):
    """``nn.ConvTranspose2d`` (any stride, padding, dilation, groups, output padding; zeros padding).

    Its transpose is ``conv2d`` with the same weight, stride, padding, dilation and groups (the
    transposed convolution *is* the adjoint of that convolution); the output padding appends
    rows/columns that only the bias reaches, and the adjoint's extra outputs (an output padding of
    at least the stride, possible with a dilation) are cropped. The output padding is read from
    the traced shapes, so a forward call with ``output_size`` is covered too.
    """

    def __init__(self, label: str, inputs: tuple[int, ...], in_shapes: Any, out_shape: Any,
                 module: torch.nn.ConvTranspose2d) -> None:
        super().__init__(label, inputs, in_shapes, out_shape)
        self.weight, self.bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
        self.stride, self.padding = module.stride, module.padding
        self.dilation, self.groups = module.dilation, module.groups
        _, h, w = in_shapes[0]
        kh, kw = self.weight.shape[2:]
        self.output_padding = tuple(out - ((size - 1) * s - 2 * p + d * (k - 1) + 1) for size, out, k, s, p, d in
                                    zip((h, w), out_shape[1:], (kh, kw), self.stride, self.padding, self.dilation))

    def _apply(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return F.conv_transpose2d(x, weight, bias, self.stride, self.padding, self.output_padding, self.groups,
                                  self.dilation)

    def back(self, a: Tensor) -> tuple[list[Tensor], Tensor | None]:
        bs, k = a.shape[:2]
        in_shape = self.in_shapes[0]
        flat = a.reshape(bs * k, *self.out_shape)
        out = F.conv2d(flat, self.weight, None, self.stride, self.padding, self.dilation, self.groups)
        out = out[..., :in_shape[1], :in_shape[2]]
        if tuple(out.shape[1:]) != tuple(in_shape):  # pragma: no cover - the adjoint never comes out smaller
            out = _vjp(lambda z: self._apply(z, self.weight, None), a, in_shape).reshape(bs * k, *in_shape)
        bias = None
        if self.bias is not None:
            bias = torch.matmul(a.sum(dim=(3, 4)), self.bias)
        return [out.reshape(bs, k, *in_shape)], bias


class ConcatOp(Linear):
    """``torch.cat`` along a per-sample dimension ``dim`` of bounded tensors and constants.

    ``pieces``: in order, ``None`` for the next bounded input (``inputs`` in that order, a tensor
    may appear twice) or a constant ``(1, *piece_shape)`` (the same for every sample, e.g. a class
    token expanded to the batch): the constants are the op's bias. The transpose splits the
    coefficients along ``dim`` (Bs, K, *out) into the inputs' pieces.
    """

    def __init__(self, label: str, inputs: tuple[int, ...], in_shapes: Any, out_shape: Any, dim: int,
                 pieces: list[Tensor | None]) -> None:
        super().__init__(label, inputs, in_shapes, out_shape)
        self.dim, self.pieces = dim, pieces
        shapes = iter(in_shapes)
        self.sizes = [int(p.shape[dim + 1]) if p is not None else next(shapes)[dim] for p in pieces]

    def _cat(self, xs: list[Tensor], const: bool) -> Tensor:
        it = iter(xs)
        b = xs[0].shape[0]
        parts = []
        for p in self.pieces:
            if p is None:
                parts.append(next(it))
            else:
                parts.append((p if const else torch.zeros_like(p)).expand(b, *p.shape[1:]))
        return torch.cat(parts, dim=self.dim + 1)

    def forward(self, xs: list[Tensor], bias: bool = True) -> Tensor:
        return self._cat(xs, bias)

    def abs_forward(self, rs: list[Tensor]) -> Tensor:
        return self._cat(rs, False)

    def back(self, a: Tensor) -> tuple[list[Tensor], Tensor | None]:
        parts = torch.split(a, self.sizes, dim=self.dim + 2)
        ins, bias = [], None
        for p, part in zip(self.pieces, parts):
            if p is None:
                ins.append(part)
            else:
                add = _row_dot(part, p[0])
                bias = add if bias is None else bias + add
        return ins, bias


class ElementwiseOp(Nonlinear):
    """An elementwise activation relaxed by two lines per neuron on its input's bounds ``[l, u]``.

    :meth:`relax` returns ``(al, bl, au, bu)`` shaped like the bounds with
    ``al·x + bl ≤ f(x) ≤ au·x + bu`` for every ``x`` in ``[l, u]``; the backward pass takes the
    lower line where a coefficient is positive and the upper one where it is negative (CROWN,
    Zhang et al. 2018, §3.2, Theorem 3.2).
    """

    def back_relaxed(self, a: Tensor, relax: tuple[Tensor, ...]) -> tuple[Tensor, Tensor | None]:
        al, bl, au, bu = relax
        pos, neg = _pos(a), _neg(a)
        a_in = pos * al.unsqueeze(1) + neg * au.unsqueeze(1)
        return a_in, _row_dot(pos, bl) + _row_dot(neg, bu)


class LeakyReluOp(ElementwiseOp):
    """``f(x) = x`` for ``x ≥ 0``, ``s·x`` below (``nn.LeakyReLU``, ``F.leaky_relu``) for any finite slope ``s``.

    ``s ≤ 1``: ``f = max(x, s·x)`` is convex (also for a negative ``s``, where it is not monotone);
    ``s > 1``: ``f = min(x, s·x)`` is concave. For an unstable neuron (``l < 0 < u``) the chord
    ``k·(x − l) + s·l``, ``k = (u − s·l)/(u − l)``, bounds a convex ``f`` from above and a concave
    one from below; the other side is the line through the origin with the adaptive slope of
    CROWN's ReLU (1 if ``u > −l`` else ``s``: the one of smaller area between it and ``f``), below
    a convex ``f`` (every slope in ``[s, 1]`` is) and above a concave one (every slope in
    ``[1, s]``). Stable neurons are exact. IBP: ``[min(f(l), f(clamp(0, l, u))), max(f(l), f(u))]``,
    exact for both shapes (a convex ``f`` peaks at an end, its minimum is at 0 or an end; a
    concave ``f`` with ``s > 1`` is increasing).
    """

    def __init__(self, label: str, inputs: tuple[int, ...], in_shapes: Any, out_shape: Any, slope: float) -> None:
        super().__init__(label, inputs, in_shapes, out_shape)
        self.slope = float(slope)

    def _f(self, x: Tensor) -> Tensor:
        return torch.where(x >= 0, x, x * self.slope)

    def ibp(self, ivs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        lo, hi = ivs[0]
        f_lo, f_hi = self._f(lo), self._f(hi)
        mid = self._f(torch.minimum(torch.maximum(torch.zeros_like(lo), lo), hi))
        return torch.minimum(f_lo, mid), torch.maximum(f_lo, f_hi)

    def relax(self, lo: Tensor, hi: Tensor) -> tuple[Tensor, ...]:
        s = self.slope
        unstable = (lo < 0) & (hi > 0)
        exact = torch.where(lo >= 0, torch.ones_like(lo), torch.full_like(lo, s))  # stable: f(x) = exact·x
        width = torch.where(unstable, hi - lo, torch.ones_like(hi))
        k = torch.where(unstable, (hi - s * lo) / width, exact)
        kb = torch.where(unstable, (s - k) * lo, torch.zeros_like(lo))
        adaptive = torch.where(unstable, torch.where(hi > -lo, torch.ones_like(lo), torch.full_like(lo, s)), exact)
        zero = torch.zeros_like(lo)
        if s <= 1:  # convex: lower through the origin, upper the chord
            return adaptive, zero, k, kb
        return k, kb, adaptive, zero  # concave
