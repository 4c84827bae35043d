"""Gradient parts of DeepQuant: gradient-norm ascent seeds for ``Q`` and the PGD check of a radius.

**Steepness seen by gradients.** For a safety expression ``s`` that is differentiable almost
everywhere (every network of Linear/Conv/ReLU/pooling/softmax layers), the Lipschitz constant of
``s`` on the convex set ``B(x, d, p) ∩ clip`` is ``L = sup_y ‖∇s(y)‖_q`` (``q`` the dual exponent of
``p``: ``‖·‖₁`` for L∞ balls, ``‖·‖₂`` for L2, ``‖·‖∞`` for L1), and by the mean value theorem
``|s(x) − s(x̂)| ≤ L·‖x − x̂‖_p``: ``L`` bounds the Lipschitzian metric ``Q`` of Definition 6 (DeepQuant,
eq. 4) from above, so Theorem 1 holds with ``L`` in place of ``Q``. Every gradient norm seen at a
point of the set is a lower bound on ``L``, and so is every centred ratio ``|s(x) − s(x̂)|/‖x − x̂‖_p``.
:func:`gradient_ascent` climbs ``‖∇s‖_q`` (double back-propagation; steps of the steepest ascent
for the ball's norm, ``sign`` for L∞) from ``starts`` points — ``x`` itself and random points of
the ball — and returns the largest gradient norm and the largest centred ratio it saw, and the
nearest point with ``s < 0``. Where the second derivative vanishes (a saturated softmax) or the
model has no double backward, a step descends ``s`` instead (the margin is steepest near the
boundary). On an affine ``s`` the gradient is constant, so the first gradient, at ``x``, is
``L`` exactly (the dual norm of the weight difference) — with ``clip`` too, as long as the ball
∩ box has interior (a centred ratio alone cannot reach it when ``x`` is a corner of the box).

**The PGD check** (:func:`pgd_nearest_unsafe`): projected gradient descent on ``s`` itself
(Madry et al. 2018, with per-input radii) inside the ``p``-ball of each input's claimed safe
radius, ``restarts`` runs (the first from ``x``, the others from random points of the ball) of
``steps`` signed (L∞), normalised (L2) or coordinate (L1) steps of ``2.5·r/steps``, projected
onto the ball and clamped to ``clip``; it returns the nearest iterate with ``s < 0``.

Random starts are counter-based draws keyed by ``(seed, data index, start)`` (see
:mod:`.common`), so batching never changes a result. Pure torch; the gradients are taken w.r.t.
the inputs only (``torch.autograd.grad``: the model's ``.grad`` is never touched). No host
synchronisation inside the step loops.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.guard import ForwardGuard
from pytest_dnnsafety.engines.perturb.adversarial import log_probs
from pytest_dnnsafety.engines.quantification.common import _evaluate, _forward, _uniform, lp_norm, project_ball

__all__ = ["dual_norm", "steepest", "gradient_ascent", "pgd_nearest_unsafe"]

#: Draw streams of the random starts (the pattern search uses 1-3).
_ASCENT_STREAM, _PGD_STREAM = 4, 5


def dual_norm(g: Tensor, norm: str) -> Tensor:
    """``‖g‖_q`` per row, float64: the dual of the ball norm (L∞ → L1, L2 → L2, L1 → L∞)."""
    g = g.to(torch.float64)
    if norm == "linf":
        return g.abs().sum(dim=-1)
    if norm == "l2":
        return torch.linalg.vector_norm(g, dim=-1)
    return g.abs().amax(dim=-1)


def steepest(v: Tensor, norm: str) -> Tensor:
    """The unit ``p``-norm direction ``δ`` maximising ``v·δ``, per row of ``v`` (M, n) (zero rows stay zero)."""
    if norm == "linf":
        return v.sign()
    if norm == "l2":
        return v / torch.linalg.vector_norm(v, dim=-1, keepdim=True).clamp_min(1e-30)
    one = torch.nn.functional.one_hot(v.abs().argmax(dim=-1), v.shape[-1]).to(v.dtype)
    return one * v.sign()


def _place(centre: Tensor, points: Tensor, radius: float | Tensor, norm: str,
           clip: tuple[float, float] | None) -> Tensor:
    out = centre + project_ball(points - centre, radius, norm)
    return out if clip is None else out.clamp(clip[0], clip[1])


def _s_fn(model: Any, kind: str, eps: float, outputs: str, shape: tuple[int, ...],
          guard: ForwardGuard | None) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    def s_of(rows: Tensor, top: Tensor, other: Tensor) -> Tensor:
        lp = log_probs(_forward(model, rows.reshape(-1, *shape), guard), outputs)
        return _evaluate(kind, eps, lp, top, other)
    return s_of


def _starts(centres: Tensor, index: Tensor, starts: int, radius: float | Tensor, norm: str,
            clip: tuple[float, float] | None, seed: int, stream: int) -> tuple[Tensor, Tensor]:
    """``(rows, owner)``: per input ``starts`` points, input-major: ``x`` then uniform points of the ball ∩ clip."""
    n_in, n = centres.shape
    owner = torch.arange(n_in, device=centres.device)[:, None].expand(n_in, starts).reshape(-1)
    start = torch.arange(starts, device=centres.device).repeat(n_in)
    c = centres[owner]
    r = radius[owner] if isinstance(radius, Tensor) else radius
    r_col = r[:, None].to(c.dtype) if isinstance(r, Tensor) else r
    u = _uniform(seed, index[owner], start, 0, n, stream).to(c.dtype)
    rnd = _place(c, c + (2 * u - 1) * r_col, r, norm, clip)
    rows = torch.where((start == 0)[:, None], c, rnd)
    return rows, owner


def gradient_ascent(
    model: Any, centres: Tensor, shape: tuple[int, ...], kind: str, eps: float, outputs: str, top: Tensor,
    other: Tensor, s0: Tensor, *, d: float, norm: str, clip: tuple[float, float] | None, steps: int, starts: int,
    seed: int, index: Tensor, max_batch: int, guard: ForwardGuard | None = None,
) -> tuple[dict[str, Tensor] | None, str | None]:
    """Gradient-norm ascent from ``starts`` points per input (see the module docstring).

    ``centres`` (N, n) flat inputs in the model's dtype; ``top``/``other``/``s0`` per input;
    ``index`` the data index of each input (keys the random starts). Returns ``(result, None)``
    with per-input float64 ``gradient`` (the largest ``‖∇s‖_q`` seen), ``ratio`` (the largest
    centred ratio seen), ``point`` (N, n, the point of ``ratio``; ``x`` when none), ``s_point``,
    ``unsafe`` (the nearest ``p``-distance of a point with ``s < 0``, inf when none) and
    ``evaluations``; or ``(None, reason)`` when the model gives no gradient.
    """
    n_in, n = centres.shape
    s_of = _s_fn(model, kind, eps, outputs, shape, guard)
    rows, owner = _starts(centres, index, starts, d, norm, clip, seed, _ASCENT_STREAM)
    alpha = 2.5 * d / max(steps, 1)
    f64 = {"dtype": torch.float64, "device": centres.device}
    m = rows.shape[0]
    gbest, rbest = torch.zeros(m, **f64), torch.zeros(m, **f64)
    point, s_point = centres[owner].clone(), s0[owner].clone()
    unsafe = torch.full((m,), math.inf, **f64)
    second = True
    for r0 in range(0, m, max_batch):
        sl = slice(r0, r0 + max_batch)
        y, c, o = rows[sl], centres[owner[sl]], owner[sl]
        for k in range(steps + 1):
            with torch.enable_grad():
                y = y.detach().requires_grad_(True)
                s = s_of(y, top[o], other[o])
                if not s.requires_grad:
                    return None, ("the safety expression has no gradient w.r.t. the input (the model is not "
                                  "differentiable in torch)")
                want_second = second and k < steps
                (g,) = torch.autograd.grad(s.sum(), y, create_graph=want_second)
                gn = dual_norm(g, norm)
                h = None
                if want_second:
                    try:
                        (h,) = torch.autograd.grad(gn.sum(), y)
                    except RuntimeError:  # no double backward through some op: descend s instead
                        second = False
            s, g, gn = s.detach(), g.detach(), gn.detach()
            gbest[sl] = torch.maximum(gbest[sl], torch.nan_to_num(gn, nan=0.0))
            dist = lp_norm((y.detach() - c).to(torch.float64), norm)
            ratio = torch.where(dist > 0, (s0[o] - s).abs() / dist.clamp_min(1e-300), torch.zeros_like(dist))
            ratio = torch.nan_to_num(ratio, nan=0.0)
            better = ratio > rbest[sl]
            rbest[sl] = torch.where(better, ratio, rbest[sl])
            point[sl] = torch.where(better[:, None], y.detach(), point[sl])
            s_point[sl] = torch.where(better, s, s_point[sl])
            unsafe[sl] = torch.where(s < 0, torch.minimum(unsafe[sl], dist), unsafe[sl])
            if k == steps:
                break
            move = -g
            if h is not None:
                h = h.detach()
                flat = (h.abs().amax(dim=1, keepdim=True) > 0) & torch.isfinite(h).all(dim=1, keepdim=True)
                move = torch.where(flat, h, -g)
            y = _place(c, y.detach() + alpha * steepest(move, norm), d, norm, clip)
    per = (n_in, starts)
    gradient = gbest.reshape(per).amax(dim=1)
    ratio, pick = rbest.reshape(per).max(dim=1)
    chosen = torch.arange(n_in, device=centres.device) * starts + pick
    return {"gradient": gradient, "ratio": ratio, "point": point[chosen], "s_point": s_point[chosen],
            "unsafe": unsafe.reshape(per).amin(dim=1),
            "evaluations": torch.full((n_in,), starts * (steps + 1), dtype=torch.int64, device=centres.device)}, None


def pgd_nearest_unsafe(
    model: Any, x: Tensor, kind: str, eps: float, outputs: str, top: Tensor, other: Tensor, radius: Tensor, *,
    norm: str, clip: tuple[float, float] | None, steps: int, restarts: int, seed: int, index: Tensor,
    max_batch: int, guard: ForwardGuard | None = None,
) -> tuple[Tensor, Tensor] | None:
    """PGD on ``s`` inside each input's ball of ``radius`` (N,): ``(distance, point)`` of the nearest ``s < 0``.

    ``x`` (N, ...) in the model's dtype; ``distance`` float64 (N,), inf where no iterate had
    ``s < 0`` (and where ``radius`` is 0); ``point`` (N, ...) that iterate (``x`` where none).
    None when the model gives no gradient.
    """
    shape = tuple(x.shape[1:])
    n_in = x.shape[0]
    centres = x.reshape(n_in, -1)
    s_of = _s_fn(model, kind, eps, outputs, shape, guard)
    f64 = {"dtype": torch.float64, "device": x.device}
    best = torch.full((n_in,), math.inf, **f64)
    found = centres.clone()
    todo = torch.nonzero(radius > 0).squeeze(1)  # one host sync per call
    if todo.numel() == 0:
        return best, found.reshape(x.shape)
    r_in = radius[todo]
    rows, owner = _starts(centres[todo], index[todo], restarts, r_in, norm, clip, seed, _PGD_STREAM)
    m = rows.shape[0]
    dist_rows = torch.full((m,), math.inf, **f64)
    point_rows = rows.clone()
    for r0 in range(0, m, max_batch):
        sl = slice(r0, r0 + max_batch)
        y, o = rows[sl], owner[sl]
        c, r = centres[todo][o], r_in[o]
        alpha = (2.5 * r / max(steps, 1)).to(y.dtype)[:, None]
        t, oth = top[todo][o], other[todo][o]
        for k in range(steps + 1):
            with torch.enable_grad():
                y = y.detach().requires_grad_(True)
                s = s_of(y, t, oth)
                if not s.requires_grad:
                    return None
                g = torch.autograd.grad(s.sum(), y)[0] if k < steps else None
            s = s.detach()
            dist = lp_norm((y.detach() - c).to(torch.float64), norm)
            closer = (s < 0) & (dist < dist_rows[sl])
            dist_rows[sl] = torch.where(closer, dist, dist_rows[sl])
            point_rows[sl] = torch.where(closer[:, None], y.detach(), point_rows[sl])
            if g is None:
                break
            y = _place(c, y.detach() - alpha * steepest(g.detach(), norm), r, norm, clip)
    d_in, pick = dist_rows.reshape(-1, restarts).min(dim=1)
    chosen = torch.arange(todo.numel(), device=x.device) * restarts + pick
    best[todo] = d_in
    found[todo] = point_rows[chosen]
    return best, found.reshape(x.shape)
