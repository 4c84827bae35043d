"""The safe-radius search at scale: the plan (which search, its query estimate, the refusal) and the gradient estimate.

The pattern search of :mod:`.search` polls every coordinate both ways: ``2n + 1`` forwards per poll — 301,057 at
3×224×224. :class:`~.options.SearchPlan` chooses the search before any work:

* ``"coordinate"`` — the DeepQuant pattern search (GPS/MADS) with gradient-norm seeds: the estimate
  ``d' = s(x)/Q`` (Theorem 1), ``Q`` a lower bound found by search, so ``d'`` may *overstate* the safe radius;
* ``"gradient"`` — :func:`gradient_search`: a batched minimum-norm attack (FMN-style, Pintor et al. 2021: signed /
  normalised steps on ``s`` inside a ball whose radius shrinks below every adversarial point found and grows
  while none is found), ``attack_steps`` gradient steps per input. Its estimate is the distance of the nearest
  point with ``s < 0`` it found: an **upper bound** on the true minimal adversarial radius (a real adversarial
  example lies there), ``d`` when it found none (then it proves nothing);
* ``"certified"`` — no estimate: only the certified radius (a sound **lower** bound), checked by a PGD attack of
  ``attack_steps`` steps inside it;
* ``"auto"`` (default) — ``"coordinate"`` when the input has at most :data:`COORDINATE_MAX_DIMS` elements and its
  estimate fits ``max_queries``, else ``"gradient"``.

:func:`estimate_queries` counts the work per input in single-input forwards (a gradient step counts
:data:`GRADIENT`) before anything runs; :func:`plan_search` raises :class:`ConfigError` naming the estimate and the
knobs when the chosen search exceeds ``max_queries`` per input. Every search's certified radius (when asked) is the
bisection over sound bounds of :func:`.certified.certified_radius`; with ``certified=True`` it uses CROWN for the
coordinate search and IBP (cost: about two forwards per bound) otherwise.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.guard import ForwardGuard
from pytest_dnnsafety.engines.perturb.adversarial import detect_outputs, log_probs
from pytest_dnnsafety.engines.quantification.common import (
    _applicable, _check_inputs, _check_label_range, _classes, _evaluate, _forward, _to_model, lp_norm, project_ball,
)
from pytest_dnnsafety.engines.quantification.gradients import dual_norm, steepest
from pytest_dnnsafety.engines.quantification.options import SafetyProperty, SearchBudget, SearchPlan
from pytest_dnnsafety.engines.quantification.search import LipschitzSearch
from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.runtime.progress import tick

__all__ = ["COORDINATE_MAX_DIMS", "GRADIENT", "BOUND_FORWARDS", "estimate_queries", "plan_search",
           "resolve_search", "gradient_search"]

#: ``search="auto"`` runs the coordinate search only for inputs of at most this many elements.
COORDINATE_MAX_DIMS = 4096
#: Forwards one gradient step counts (a forward and a backward).
GRADIENT = 3.0
#: Forwards one bound call counts, per method (IBP: a lower and an upper pass; CROWN: far more, its backward passes).
BOUND_FORWARDS = {"ibp": 2.0, "crown": 50.0}


def estimate_queries(search: str, dims: int, budget: SearchBudget, plan: SearchPlan,
                     bound: str | None, bound_steps: int) -> tuple[float, str]:
    """Per input: the single-input forwards of ``search`` (resolved) and what they are made of."""
    cert = (bound_steps + 1) * BOUND_FORWARDS.get(bound or "", 0.0) if bound else 0.0
    if search == "coordinate":
        poll = 2 * dims + 1
        polls = budget.starts * budget.iterations * poll
        ascent = GRADIENT * budget.ascent_starts * (budget.ascent_steps + 1)
        pgd = GRADIENT * 2 * budget.starts * (budget.iterations + 1)
        total = 1 + polls + ascent + pgd + cert
        return total, (f"{total:,.0f} forwards per input: starts {budget.starts} × iterations {budget.iterations} × a "
                       f"poll of {poll:,} (2 × {dims:,} input elements + 1) = {polls:,.0f}, ascent {ascent:,.0f}, "
                       f"PGD check {pgd:,.0f}, certified bisection {cert:,.0f}")
    attack = GRADIENT * plan.attack_steps + 1
    total = attack + cert
    what = "minimum-norm attack" if search == "gradient" else "PGD check"
    return total, (f"{total:,.0f} forwards per input: {what} {plan.attack_steps} gradient steps × {GRADIENT:g} "
                   f"+ a forward = {attack:,.0f}, certified bisection {cert:,.0f}")


def plan_search(plan: SearchPlan, dims: int, budget: SearchBudget, bound: str | None,
                bound_steps: int) -> tuple[str, float, str]:
    """``(search, queries per input, what)``: ``plan.search`` resolved for inputs of ``dims`` elements.

    Raises :class:`ConfigError` naming the estimate and the knobs when it exceeds ``plan.max_queries``.
    """
    search = plan.search
    if search == "auto":
        coordinate, _ = estimate_queries("coordinate", dims, budget, plan, bound, bound_steps)
        search = "coordinate" if dims <= COORDINATE_MAX_DIMS and coordinate <= plan.max_queries else "gradient"
    queries, what = estimate_queries(search, dims, budget, plan, bound, bound_steps)
    if queries > plan.max_queries:
        knobs = ("iterations, starts, ascent_starts, ascent_steps, certified_steps" if search == "coordinate"
                 else "attack_steps, certified_steps")
        alt = (" — or use search='gradient' (a batched minimum-norm attack) or search='certified' (the bounds "
               "only), which do not step along every coordinate" if search == "coordinate" else "")
        raise ConfigError(
            f"@pytest.mark.min_safe_radius: search={search!r} on inputs of {dims:,} elements is estimated at "
            f"{what}, above max_queries={plan.max_queries:,}; refused before any work. Fix: shrink it with "
            f"{knobs}{alt}; or raise max_queries=.")
    return search, queries, what


def resolve_search(plan: SearchPlan, dims: int, budget: SearchBudget, certified: str | None,
                   bound_steps: int) -> tuple[str, float, str, str | None]:
    """``(search, queries per input, what, bound method)``: :func:`plan_search` with the certificate's method resolved
    — ``certified=True`` (``plan.auto_bound``, given as ``"crown"``) keeps CROWN for the coordinate search and uses IBP
    for the others. The one place the engine and the gate's cost estimate both ask (so they cannot disagree)."""
    bound = certified
    if certified == "crown" and plan.auto_bound and plan.search != "coordinate":
        bound = "ibp" if plan_search(plan, dims, budget, "ibp", bound_steps)[0] != "coordinate" else "crown"
    search, queries, what = plan_search(plan, dims, budget, bound, bound_steps)
    return search, queries, what, bound


def gradient_search(model: Any, x: Tensor, safety: SafetyProperty, plan: SearchPlan, *, outputs: str = "auto",
                    guard: ForwardGuard | None = None, max_batch: int = 8192) -> LipschitzSearch:
    """The batched minimum-norm attack of every input of ``x`` (N, ...): see the module docstring.

    Returns a :class:`~.search.LipschitzSearch`: ``radius`` the distance (in the ball's norm) of the nearest point
    with ``s < 0`` found, clamped to ``d`` (``d`` where none was found, 0 for an unsafe centre, NaN where the
    expression does not apply) — an upper bound on the true minimal adversarial radius where one was found;
    ``unsafe_distance`` the same distance (inf where none); ``x_hat`` that point; ``q_ratio`` the centred ratio
    ``|s(x) − s(x̂)| / ‖x̂ − x‖`` there and ``q_gradient`` the largest ``‖∇s‖_q`` seen (both lower bounds on the
    Lipschitz constant); ``converged``: an adversarial point was found. Deterministic (no random start).
    """
    kind, label, eps, d, norm, clip = safety.expression, safety.label, safety.eps, safety.d, safety.norm, safety.clip
    steps = plan.attack_steps
    x = _to_model(model, x)
    _check_inputs(x, clip)
    n_in, shape = x.shape[0], tuple(x.shape[1:])
    f64 = {"dtype": torch.float64, "device": x.device}
    flat = x.reshape(n_in, -1)
    y0 = flat.detach().clone().requires_grad_(steps > 0)
    with torch.enable_grad() if steps > 0 else torch.no_grad():  # the centre's forward gives the first gradient too
        out0 = _forward(model, y0.reshape(-1, *shape), guard)
        _check_label_range(label, out0.shape[1])
        if outputs == "auto":
            outputs = detect_outputs(out0.detach())
        top, other = _classes(kind, log_probs(out0.detach(), outputs), label)
        s0_graph = _evaluate(kind, eps, log_probs(out0, outputs), top, other)
        g0 = torch.autograd.grad(s0_graph.sum(), y0)[0] if s0_graph.requires_grad else None
    s0 = s0_graph.detach()
    applicable = _applicable(kind, top, other)
    best = torch.where(s0 < 0, torch.zeros(n_in, **f64), torch.full((n_in,), math.inf, **f64))
    point, s_point = flat.clone(), s0.clone()
    q_grad = torch.zeros(n_in, **f64)
    for r0 in range(0, n_in, max_batch):
        sl = slice(r0, r0 + max_batch)
        c, t, o = flat[sl], top[sl], other[sl]
        radius = torch.full((c.shape[0],), d, **f64)
        y = c.clone()
        for k in range(steps + 1):
            tick(k, steps + 1, "attack steps")
            if k == 0:  # the centre: its forward and gradient were taken above
                s, g = s0[sl], (None if g0 is None or steps == 0 else g0[sl])
            else:
                with torch.enable_grad():
                    y = y.detach().requires_grad_(True)
                    s = _evaluate(kind, eps, log_probs(_forward(model, y.reshape(-1, *shape), guard), outputs), t, o)
                    g = torch.autograd.grad(s.sum(), y)[0] if (k < steps and s.requires_grad) else None
                s = s.detach()
            dist = lp_norm((y.detach() - c).to(torch.float64), norm)
            closer = (s < 0) & (dist < best[sl])
            best[sl] = torch.where(closer, dist, best[sl])
            point[sl] = torch.where(closer[:, None], y.detach(), point[sl])
            s_point[sl] = torch.where(closer, s, s_point[sl])
            if g is None:
                break
            q_grad[sl] = torch.maximum(q_grad[sl], torch.nan_to_num(dual_norm(g, norm), nan=0.0))
            # the ball shrinks just below an adversarial point, grows (up to d and the best found) while none is
            gamma = 0.05 + 0.25 * (1 + math.cos(math.pi * k / max(steps, 1))) / 2
            found = torch.isfinite(best[sl])
            radius = torch.where(s < 0, torch.minimum(radius, dist) * (1 - gamma),
                                 torch.minimum(radius * (1 + gamma),
                                               torch.where(found, best[sl], torch.full_like(radius, d))))
            radius = radius.clamp(max=d)
            alpha = (radius * (0.1 + 0.4 * (1 + math.cos(math.pi * k / max(steps, 1))) / 2)).to(y.dtype)[:, None]
            step = steepest(g.detach(), norm)
            delta = project_ball(y.detach() - c - alpha * step, radius.to(y.dtype), norm)
            y = c + delta
            if clip is not None:
                y = y.clamp(clip[0], clip[1])
    if guard is not None:
        guard.check()
    nan = torch.full_like(s0, math.nan)
    found = torch.isfinite(best)
    estimate = torch.where(found, best.clamp(max=d), torch.full_like(best, d))
    estimate = torch.where(applicable, estimate, nan)
    ratio = torch.where(found & (best > 0), (s0 - s_point).abs() / best.clamp_min(1e-300), torch.zeros_like(best))
    settings = {**{k: v for k, v in safety.settings().items() if k != "clip"}, "method": "gradient",
                "iterations": steps, "starts": 1, "clip": safety.settings()["clip"], "search": "gradient",
                "attack_steps": steps}
    return LipschitzSearch(
        s=s0, q=torch.maximum(ratio, q_grad), radius=estimate, x_hat=point.reshape(n_in, *shape), s_hat=s_point,
        iterations=torch.full((n_in,), steps, dtype=torch.int64, device=x.device),
        evaluations=torch.full((n_in,), steps + 1, dtype=torch.int64, device=x.device), converged=found,
        unsafe_distance=best, applicable=applicable, top=top, other=other, outputs=outputs, settings=settings,
        q_ratio=ratio, q_gradient=q_grad, gradient_reason=None)
