"""Smooth activations for :class:`~pytest_dnnsafety.engines.bounds.model.BoundedModel`: sigmoid, tanh, GELU, SiLU.

Each op is an :class:`~pytest_dnnsafety.engines.bounds.ops.ElementwiseOp`: IBP maps the
input interval exactly, and :meth:`relax` gives per neuron two lines
``al·x + bl ≤ f(x) ≤ au·x + bu`` valid on the whole input interval ``[l, u]`` (the CROWN
backward pass, Zhang et al. 2018, picks the lower line for a positive coefficient).
The relaxations are computed in float64 (float32 on a device without it) and returned in the
bounds' dtype.

**S-shaped: sigmoid, tanh** (:class:`SShapedOp`; Zhang et al. 2018, §3.3, "general activation
functions"): ``f`` is convex on ``x ≤ 0`` and concave on ``x ≥ 0``.

* ``u ≤ 0`` (convex): upper = the chord through ``(l, f(l))`` and ``(u, f(u))``; lower = the
  tangent at the midpoint ``m = (l + u)/2``. ``l ≥ 0`` (concave): the mirror image.
* ``l < 0 < u``: upper = the chord if it stays above ``f``, else the tangent at a point
  ``d ∈ [0, u]`` whose tangent passes above ``(l, f(l))``. With
  ``φ(d) = f(d) + f'(d)·(l − d) − f(l)``: ``φ' = f''(d)·(l − d) ≥ 0`` on ``d ≥ 0``, ``φ(0) ≤ 0``
  (a convex ``f`` on ``[l, 0]`` lies above its tangent at 0), and the chord is sound exactly when
  the root ``d*`` of ``φ`` is at least ``u`` (the slope of the line from ``(l, f(l))`` to
  ``(x, f(x))`` grows up to ``d*`` and shrinks after), i.e. when ``φ(u) ≤ 0``. Otherwise a
  bisection on ``[0, u]`` keeps its right end, where ``φ ≥ 0``: that tangent is above the
  concave part ``[0, ∞)``, above ``(l, f(l))`` and ``(0, f(0))``, hence above the convex part's
  chord between them and so above ``f`` on ``[l, u]``. The lower line is the mirror image
  (``ψ(d) = f(u) − f(d) − f'(d)·(u − d)``, bisection on ``[l, 0]`` keeping its left end).
* A very narrow interval (``u − l < 1e-4``, where a chord's slope would lose digits): the
  tangent at ``m`` shifted by ``±M·(u − l)²/8`` (Taylor: ``|f(x) − f(m) − f'(m)(x − m)| ≤
  M·(x − m)²/2``), with ``M ≥ sup |f''|``: ``|σ''| ≤ 1/(6√3) ≈ 0.0962`` (at
  ``σ = (3 ± √3)/6``), ``|tanh''| ≤ 4/(3√3) ≈ 0.7698`` (at ``tanh = ±1/√3``).

**Non-monotone: GELU, SiLU** (:class:`GridOp`): ``f = x·g(x)`` has one minimum at ``x* < 0``
(decreasing before, increasing after). IBP: ``[min(f(l), f(u), f(clamp(x*, l, u))),
max(f(l), f(u))]``. CROWN: for each of the candidate slopes ``a`` in ``{f'(l), f'(m), f'(u),
chord, 0}`` the offsets are the extremes of ``h(x) = f(x) − a·x`` over ``[l, u]``, bounded
rigorously from a grid of ``G`` points (step ``s = (u − l)/(G − 1)``, both ends included): a
function with ``|h''| ≤ M`` lies within ``M·s²/8`` of its linear interpolant between two grid
points (the interpolation error bound), so ``min h ≥ min_i h(x_i) − M·s²/8`` and
``max h ≤ max_i h(x_i) + M·s²/8`` — sound for *any* slope, since ``h'' = f''``. Per neuron the
lower line with the largest value at ``m`` (and the upper with the smallest) is kept: the line of
least area between it and ``f``. The constants:

* exact GELU, ``f = x·Φ(x)``: ``f'' = φ(x)·(2 − x²)``, whose derivative ``φ(x)·x·(x² − 4)``
  vanishes at 0 and ±2: ``f''(0) = 2φ(0) = √(2/π) ≈ 0.79788``, ``f''(±2) = −2φ(2) ≈ −0.108``,
  and ``f'' → 0`` in the tails, so ``|f''| ≤ 2φ(0) < M = 0.8``;
* tanh GELU, ``f = x·σ(2c·(x + 0.044715·x³))``, ``c = √(2/π)``: ``f''(0) = c`` again; the maximum
  of ``|f''|`` on a grid of step 1e-5 over ``[−30, 30]`` is ``c ≈ 0.79788`` (outside, ``f''`` is
  below 1e-300), and ``|f'''| < 3`` moves it by less than 1e-4 between grid points:
  ``M = 0.81`` (checked again by the tests);
* SiLU, ``f = x·σ(x)``: ``f'' = σ'(x)·(2 − x·tanh(x/2))`` with ``0 < σ' ≤ 1/4`` and
  ``x·tanh(x/2) ≥ 0``, so ``f'' ≤ 1/2``; below, ``σ'(x)·(x·tanh(x/2) − 2) ≤ e^{−|x|}·(|x| − 2) ≤
  e^{−3} < 1/2``: ``M = 0.5``.

Soundness is up to floating-point rounding, as for the other ops (the float64 relaxation is
rounded once to the bounds' dtype). Pure torch; no pytest import.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from pytest_dnnsafety.engines.bounds.ops import ElementwiseOp

__all__ = ["SShapedOp", "GridOp", "sigmoid_op", "tanh_op", "gelu_op", "silu_op", "ACTIVATIONS"]

Fn = Callable[[Tensor], Tensor]

#: Below this width the S-shaped relaxation uses the tangent at the midpoint with the Taylor slack.
_NARROW = 1e-4
#: Grid points per neuron for the offsets of the non-monotone activations.
GRID = 33
#: Bisection steps for the tangent points of the S-shaped activations (float64).
_BISECT = 40
#: Values per chunk of the grid evaluation (float64).
_CHUNK = 1 << 21


def _wide(t: Tensor) -> Tensor:
    """``t`` in float64 (float32 on a device without float64, e.g. Apple's MPS)."""
    return t.to(torch.float32 if t.device.type == "mps" else torch.float64)


def _sigmoid_d(x: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1 - s)


def _tanh_d(x: Tensor) -> Tensor:
    return 1 - torch.tanh(x) ** 2


def _gelu_d(x: Tensor) -> Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


_C = math.sqrt(2 / math.pi)


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_tanh_d(x: Tensor) -> Tensor:
    t = torch.tanh(_C * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _C * (1 + 3 * 0.044715 * x * x)


def _silu_d(x: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _argmin(fn: Fn, d: Fn, lo: float, hi: float) -> float:
    """The minimum of a unimodal ``fn`` on ``[lo, hi]`` (bisection on the sign of ``d``, float64)."""
    a, b = torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64)
    for _ in range(100):
        mid = (a + b) / 2
        if bool(d(mid) > 0):
            b = mid
        else:
            a = mid
    return float((a + b) / 2)


class SShapedOp(ElementwiseOp):
    """An S-shaped activation (sigmoid, tanh): convex below 0, concave above (see the module docstring)."""

    def __init__(self, label: str, inputs: tuple[int, ...], in_shapes: Any, out_shape: Any, fn: Fn, d: Fn,
                 m2: float) -> None:
        super().__init__(label, inputs, in_shapes, out_shape)
        self.fn, self.d, self.m2 = fn, d, m2

    def ibp(self, ivs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        lo, hi = ivs[0]
        return self.fn(lo), self.fn(hi)  # increasing

    def relax(self, lo: Tensor, hi: Tensor) -> tuple[Tensor, ...]:
        f, d = self.fn, self.d
        l, u = _wide(lo), _wide(hi)
        w, m = u - l, (l + u) / 2
        fl, fu, fm, dm = f(l), f(u), f(m), d(m)
        narrow = w < _NARROW
        k = torch.where(narrow, dm, (fu - fl) / torch.where(narrow, torch.ones_like(w), w))
        chord = (k, fl - k * l)
        tangent = (dm, fm - dm * m)
        zero = torch.zeros_like(l)
        # straddling: the upper tangent point in [0, u] (φ ≥ 0 kept at the right end) ...
        a, b = zero, u.clamp(min=0)
        for _ in range(_BISECT):
            mid = (a + b) / 2
            ok = f(mid) + d(mid) * (l - mid) - fl >= 0
            a, b = torch.where(ok, a, mid), torch.where(ok, mid, b)
        up_t = (d(b), f(b) - d(b) * b)
        chord_above = fu - fl - d(u) * w <= 0  # φ(u) ≤ 0: the chord is above f on [l, u]
        # ... and the lower one in [l, 0] (ψ ≥ 0 kept at the left end)
        a, b = l.clamp(max=0), zero
        for _ in range(_BISECT):
            mid = (a + b) / 2
            ok = fu - f(mid) - d(mid) * (u - mid) >= 0
            a, b = torch.where(ok, mid, a), torch.where(ok, b, mid)
        low_t = (d(a), f(a) - d(a) * a)
        chord_below = fu - fl - d(l) * w <= 0  # ψ(l) ≤ 0: the chord is below f on [l, u]
        convex, concave = u <= 0, l >= 0

        def pick(c_conv: tuple[Tensor, Tensor], c_conc: tuple[Tensor, Tensor], straddle_ok: Tensor,
                 straddle_alt: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
            return tuple(torch.where(convex, x, torch.where(concave, y, torch.where(straddle_ok, c, t)))  # type: ignore
                         for x, y, c, t in zip(c_conv, c_conc, chord, straddle_alt))

        al, bl = pick(tangent, chord, chord_below, low_t)
        au, bu = pick(chord, tangent, chord_above, up_t)
        slack = self.m2 * w * w / 8
        al, bl = torch.where(narrow, dm, al), torch.where(narrow, tangent[1] - slack, bl)
        au, bu = torch.where(narrow, dm, au), torch.where(narrow, tangent[1] + slack, bu)
        return tuple(t.to(lo.dtype) for t in (al, bl, au, bu))


class GridOp(ElementwiseOp):
    """A non-monotone activation ``x·g(x)`` with one minimum at ``x*`` (GELU, SiLU; see the module docstring)."""

    def __init__(self, label: str, inputs: tuple[int, ...], in_shapes: Any, out_shape: Any, fn: Fn, d: Fn,
                 m2: float, xstar: float) -> None:
        super().__init__(label, inputs, in_shapes, out_shape)
        self.fn, self.d, self.m2, self.xstar = fn, d, m2, xstar

    def ibp(self, ivs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        lo, hi = ivs[0]
        f_lo, f_hi = self.fn(lo), self.fn(hi)
        f_min = self.fn(lo.clamp(min=self.xstar).minimum(hi))
        return torch.minimum(torch.minimum(f_lo, f_hi), f_min), torch.maximum(f_lo, f_hi)

    def relax(self, lo: Tensor, hi: Tensor) -> tuple[Tensor, ...]:
        shape = lo.shape
        l, u = _wide(lo).reshape(-1), _wide(hi).reshape(-1)
        out = [torch.empty_like(l) for _ in range(4)]
        step = max(1, _CHUNK // (5 * GRID))
        for i in range(0, l.numel(), step):
            for t, v in zip(out, self._relax(l[i:i + step], u[i:i + step])):
                t[i:i + step] = v
        return tuple(t.reshape(shape).to(lo.dtype) for t in out)

    def _relax(self, l: Tensor, u: Tensor) -> tuple[Tensor, ...]:
        f, d = self.fn, self.d
        w, m = u - l, (l + u) / 2
        narrow = w < _NARROW
        k = torch.where(narrow, d(m), (f(u) - f(l)) / torch.where(narrow, torch.ones_like(w), w))
        slopes = torch.stack([d(l), d(m), d(u), k, torch.zeros_like(l)], dim=1)  # (N, 5)
        t = torch.linspace(0, 1, GRID, dtype=l.dtype, device=l.device)
        x = l[:, None] + w[:, None] * t
        x[:, -1] = u  # both ends exactly
        h = f(x)[:, None, :] - slopes[:, :, None] * x[:, None, :]  # (N, 5, G)
        slack = (self.m2 * (w / (GRID - 1)) ** 2 / 8)[:, None]
        b_lo, b_hi = h.amin(dim=2) - slack, h.amax(dim=2) + slack
        best_lo = (slopes * m[:, None] + b_lo).argmax(dim=1, keepdim=True)  # the highest lower line at m
        best_hi = (slopes * m[:, None] + b_hi).argmin(dim=1, keepdim=True)  # the lowest upper line at m
        return (slopes.gather(1, best_lo)[:, 0], b_lo.gather(1, best_lo)[:, 0],
                slopes.gather(1, best_hi)[:, 0], b_hi.gather(1, best_hi)[:, 0])


#: Bounds on ``sup |f''|`` (see the module docstring for the proofs).
M2 = {"sigmoid": 0.0963, "tanh": 0.77, "gelu": 0.8, "gelu_tanh": 0.81, "silu": 0.5}
_GELU_STAR = _argmin(F.gelu, _gelu_d, -2.0, 0.0)
_GELU_TANH_STAR = _argmin(_gelu_tanh, _gelu_tanh_d, -2.0, 0.0)
_SILU_STAR = _argmin(F.silu, _silu_d, -3.0, 0.0)


def sigmoid_op(*head: Any) -> SShapedOp:
    return SShapedOp(*head, torch.sigmoid, _sigmoid_d, M2["sigmoid"])


def tanh_op(*head: Any) -> SShapedOp:
    return SShapedOp(*head, torch.tanh, _tanh_d, M2["tanh"])


def gelu_op(*head: Any, approximate: str = "none") -> GridOp:
    if approximate == "tanh":
        return GridOp(*head, _gelu_tanh, _gelu_tanh_d, M2["gelu_tanh"], _GELU_TANH_STAR)
    return GridOp(*head, F.gelu, _gelu_d, M2["gelu"], _GELU_STAR)


def silu_op(*head: Any) -> GridOp:
    return GridOp(*head, F.silu, _silu_d, M2["silu"], _SILU_STAR)


#: The smooth activations by kind (the names :mod:`.model` classifies nodes into).
ACTIVATIONS = {"sigmoid": sigmoid_op, "tanh": tanh_op, "gelu": gelu_op, "silu": silu_op}
