"""The certified companion: a proved lower bound on the L∞ safe radius from CROWN/IBP bounds (see the package
docstring)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.perturb.adversarial import check_clip, detect_outputs, log_probs
from pytest_dnnsafety.data.checks import check_choice, check_count, check_positive
from pytest_dnnsafety.runtime.progress import tick
from pytest_dnnsafety.engines.quantification.common import (
    BOUND_METHODS, _applicable, _check_expression, _check_inputs, _check_label_range,
    _check_outputs, _classes, _evaluate, _forward, _to_model,
)

__all__ = ["certified_radius"]


def _margin_bound(kind: str, eps: float, margins: Tensor, top: Tensor, other: Tensor) -> Tensor:
    """A sound lower bound of ``s`` from lower bounds of logit margins (see the module docstring)."""
    L = margins.to(torch.float64)
    y = other if kind == "reachability" else top
    others = torch.ones_like(L, dtype=torch.bool).scatter(1, y[:, None], False)
    den = 1.0 + torch.where(others, torch.exp(-L), torch.zeros_like(L)).sum(dim=1)
    if kind == "reachability":
        return 1.0 / den - eps
    if kind == "top_vs_runner_up":
        m_o = torch.where(others, L, torch.full_like(L, math.inf)).amin(dim=1)
    else:
        m_o = L.gather(1, other[:, None]).squeeze(1)
    num = -torch.expm1(-m_o)
    return torch.where(num >= 0, num / den, num) - eps


def certified_radius(
    model: Any,
    x: Tensor,
    expression: str = "top_vs_runner_up",
    *,
    d: float,
    label: int | None = None,
    eps: float = 0.0,
    clip: tuple[float, float] | None = (0.0, 1.0),
    method: str = "crown",
    steps: int = 10,
    outputs: str = "auto",
    bounded: Any = None,
) -> tuple[Tensor | None, str | None]:
    """A proved lower bound on the L∞ safe radius of every input, or ``(None, reason)``.

    Per input the largest ``r`` of a bisection over ``[0, d]`` (``d`` first, then ``steps``
    halvings) for which a sound lower bound of ``s`` over ``[x − r, x + r] ∩ clip`` is positive
    (see the module docstring for the bounds); 0 where none was proved (``s(x) < 0`` included),
    NaN where the expression does not apply. Float64 ``(N,)`` on the model's device.
    ``bounded``: a :class:`BoundedModel` of ``model`` to reuse. A model the bounds do not cover
    — an :class:`UnsupportedLayerError`, or a model that returns probabilities — gives
    ``(None, reason)``.
    """
    from pytest_dnnsafety.engines.bounds.model import BoundedModel, UnsupportedLayerError

    kind, label, eps = _check_expression(expression, label, eps)
    d = check_positive(d, "d", fix="give the ball's radius in input units, e.g. d=0.1 for inputs in [0, 1].")
    method = check_choice(method, "method", BOUND_METHODS, "use 'crown' (tighter) or 'ibp' (faster).")
    steps = check_count(steps, "steps", 0)
    clip = check_clip(clip)
    outputs = _check_outputs(outputs)
    if bounded is None:
        try:
            bounded = BoundedModel(model)
        except UnsupportedLayerError as exc:
            return None, str(exc)
    x = _to_model(model, x)
    dtype, device = x.dtype, x.device
    _check_inputs(x, clip)  # one host read: a point outside clip would give an empty box
    with torch.no_grad():
        logits = _forward(model, x, None)
        _check_label_range(label, logits.shape[1])
        if outputs == "auto":
            outputs = detect_outputs(logits)
        if outputs != "logits":
            return None, ("the model returns probabilities; the certified bounds propagate logits. Fix: certify the "
                          "logits model (without its final softmax) — the probabilities are bounded from the logits.")
        lp0 = log_probs(logits, "logits")
        top, other = _classes(kind, lp0, label)
        applicable = _applicable(kind, top, other)
        s0 = _evaluate(kind, eps, lp0, top, other)
        m = logits.shape[1]
        # the tangent point of the uncertainty bound: any distribution q gives LSE(w) ≥ q·w + H(q) (Gibbs)
        q0 = torch.softmax(logits.to(torch.float64), dim=1)
        h0 = -torch.special.xlogy(q0, q0).sum(dim=1)
        low, high = (None, None) if clip is None else clip
        view = (-1,) + (1,) * (x.ndim - 1)

        def lower(sel: Tensor, r: Tensor) -> Tensor:
            xs = x[sel]
            rr = r.to(dtype).reshape(view)
            lo, hi = xs - rr, xs + rr
            if clip is not None:
                lo, hi = lo.clamp(min=low), hi.clamp(max=high)
            if kind == "uncertainty":
                c = q0[sel] - 1.0 / m  # (B, m): the tangent's linear part (sums to 0)
                if method == "crown":
                    lin = bounded.crown(lo, hi, c.to(dtype).unsqueeze(1), check=False)[0][:, 0].to(torch.float64)
                else:
                    z_lo, z_hi = (t.to(torch.float64) for t in bounded.ibp(lo, hi, check=False))
                    lin = (c.clamp(min=0) * z_lo + c.clamp(max=0) * z_hi).sum(dim=1)
                return h0[sel] - math.log(m) + lin - eps
            y = other[sel] if kind == "reachability" else top[sel]
            margins = bounded.margin_lower_bounds(lo, hi, y, method, check=False)
            return _margin_bound(kind, eps, margins, top[sel], other[sel])

        radius = torch.zeros(x.shape[0], dtype=torch.float64, device=device)
        todo = torch.nonzero(applicable & (s0 > 0)).squeeze(1)  # a host sync
        if todo.numel():
            full = torch.full((todo.numel(),), d, dtype=torch.float64, device=device)
            tick(0, steps + 1, "bisection steps")
            ok = lower(todo, full) > 0
            lo_r = torch.where(ok, full, torch.zeros_like(full))
            hi_r = full.clone()
            if method == "ibp" and steps > 1:
                # IBP is inclusion-monotone: a box that fails at the finest radius d/2^steps fails at every larger
                # one, so those inputs end here (radius 0) instead of bisecting (the same result, fewer bounds)
                floor = full / 2 ** steps
                tick(1, steps + 1, "bisection steps")
                at_floor = ok | (lower(todo, floor) > 0)
                hi_r = torch.where(at_floor, hi_r, torch.zeros_like(hi_r))
                ok = ok | ~at_floor
            for i in range(steps if bool((~ok).any()) else 0):  # a host read: nothing left to bisect
                tick(i + 1, steps + 1, "bisection steps")
                mid = (lo_r + hi_r) / 2
                proved = lower(todo, mid) > 0
                lo_r = torch.where(~ok & proved, mid, lo_r)
                hi_r = torch.where(~ok & ~proved, mid, hi_r)
            radius[todo] = lo_r
        radius = torch.where(applicable, radius, torch.full_like(radius, math.nan))
    return radius, None
