"""The batched pattern search for the Lipschitzian metric, after gradient-norm ascent seeds (see the package doc)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.guard import ForwardGuard
from pytest_dnnsafety.engines.perturb.adversarial import detect_outputs, log_probs
from pytest_dnnsafety.data.checks import check_count
from pytest_dnnsafety.runtime.progress import tick
from pytest_dnnsafety.engines.quantification.common import (
    _INCREASE, _NEAR, _applicable, _check_inputs, _check_label_range, _check_outputs, _classes, _evaluate, _forward,
    _gaussian, _to_model, _uniform, lp_norm, project_ball,
)
from pytest_dnnsafety.engines.quantification.gradients import gradient_ascent
from pytest_dnnsafety.engines.quantification.options import Certification, SafetyProperty, SearchBudget

__all__ = ["LipschitzSearch", "lipschitz_search"]


@dataclass(frozen=True)
class LipschitzSearch:
    """Per-input results of :func:`lipschitz_search` (tensors on the search's device, first dim N).

    ``s``: ``s(x)`` (float64). ``q``: the steepness seen, ``max(q_ratio, q_gradient)``, a lower
    bound on the Lipschitz constant ``L`` of ``s`` on the ball ∩ clip (which bounds ``Q`` from
    above); ``q_ratio``: the largest centred ratio ``|s(x) − s(x̂)| / ‖x − x̂‖_p`` evaluated (pattern
    search and ascent), a lower bound on ``Q``; ``q_gradient``: the largest ``‖∇s‖_q`` the
    gradient-norm ascent saw (0 where it did not run; ``gradient_reason`` says why). ``radius``:
    the estimate ``d' = clamp(s/q, 0, d)`` (``d`` for ``q = 0``, NaN where not applicable).
    ``x_hat``: the point of ``q_ratio`` (``x`` itself when no
    change was found), in the input's shape; ``s_hat``: ``s`` there. ``iterations`` and
    ``evaluations`` (the centre included) per input; ``converged``: the mesh fell below
    ``mesh_tol``. ``unsafe_distance``: the ``p``-distance of the nearest evaluated point with
    ``s < 0`` (0 for an unsafe centre, inf when none). ``applicable``: False for ``top_vs_label``
    / ``top_vs_least`` inputs whose top class is the other class. ``top``, ``other``: the classes
    fixed at the centre. ``certified``: the certified L∞ radius per input (NaN where not
    applicable), or None with ``certified_reason``.
    """

    s: Tensor
    q: Tensor
    radius: Tensor
    x_hat: Tensor
    s_hat: Tensor
    iterations: Tensor
    evaluations: Tensor
    converged: Tensor
    unsafe_distance: Tensor
    applicable: Tensor
    top: Tensor
    other: Tensor
    outputs: str
    settings: dict[str, Any] = field(default_factory=dict)
    certified: Tensor | None = None
    certified_reason: str | None = None
    q_ratio: Tensor | None = None
    q_gradient: Tensor | None = None
    gradient_reason: str | None = None


def _settings(safety: SafetyProperty, search: SearchBudget, seed: int) -> dict[str, Any]:
    """The search's settings as plain values, in the order the results have always listed them."""
    prop, rules = safety.settings(), search.settings()
    return {**{k: prop[k] for k in ("expression", "label", "eps", "d", "norm")},
            **{k: rules[k] for k in ("method", "iterations", "starts")}, "clip": prop["clip"], "seed": seed,
            **{k: rules[k] for k in ("expansion", "contraction", "mesh_tol", "mesh_init", "ascent_steps",
                                     "ascent_starts")}}


def lipschitz_search(
    model: Any,
    x: Tensor,
    safety: SafetyProperty,
    search: SearchBudget = SearchBudget(),
    *,
    certification: Certification | None = None,
    seed: int = 0,
    index_offset: int = 0,
    outputs: str = "auto",
    guard: ForwardGuard | None = None,
) -> LipschitzSearch:
    """Estimate ``Q(s, x, d, p)`` and the safe radius of every input of ``x`` (N, ...) by pattern search.

    See the module docstring for the method. ``safety``: the expression and the ball
    (:class:`~.options.SafetyProperty`); ``search``: the search's budget and rules
    (:class:`~.options.SearchBudget`: ``starts`` independent searches per input, the first from
    ``x``, the others from random points of the ball; ``Q`` is the best of them — pattern search is
    local, more starts escape more local maxima, each costs one more search; its
    ``ascent_starts`` gradient-norm ascents run first, :func:`.gradients.gradient_ascent`, so ``q``
    never reports less steepness than a gradient or a ratio seen anywhere). ``seed`` and
    ``index_offset`` key the random draws (``index_offset`` is the data index of ``x[0]``, so a data
    set searched batch by batch draws what one big batch would). ``certification``: also run
    :func:`certified_radius` with its method and steps (None: not).

    Runs under ``torch.no_grad`` on the model's device in the model's dtype; the model's mode
    is the caller's business (use eval mode). Raises :class:`ConfigError` for bad arguments (a
    label outside the model's classes included) and :class:`DataError` for inputs outside
    ``clip`` or not finite.
    """
    kind, label, eps, d, norm, clip = safety.expression, safety.label, safety.eps, safety.d, safety.norm, safety.clip
    method, iterations, starts, max_batch = search.method, search.iterations, search.starts, search.max_batch
    expansion, contraction, mesh_tol = search.expansion, search.contraction, search.mesh_tol
    seed = check_count(seed, "seed", 0)
    index_offset = check_count(index_offset, "index_offset", 0)
    outputs = _check_outputs(outputs)
    settings = _settings(safety, search, seed)
    max_elements, ascent_steps, ascent_starts = search.max_elements, search.ascent_steps, search.ascent_starts
    mesh_init = search.mesh_init

    x = _to_model(model, x)
    dtype, device = x.dtype, x.device
    _check_inputs(x, clip)  # one host read
    n_in, shape = x.shape[0], tuple(x.shape[1:])
    n = max(1, math.prod(shape))
    k_dirs = 2 * n
    k_poll = k_dirs + 1  # the poll and the one-point search step
    low, high = (None, None) if clip is None else clip

    def evaluate(rows: Tensor, top_r: Tensor, other_r: Tensor) -> Tensor:
        """``s`` at flat points ``rows`` (M, n): forward passes of at most ``max_batch`` rows."""
        lp = torch.cat([log_probs(_forward(model, rows[r0:r0 + max_batch].reshape(-1, *shape), guard), outputs)
                        for r0 in range(0, rows.shape[0], max_batch)])
        return _evaluate(kind, eps, lp, top_r, other_r)

    def place(centre: Tensor, points: Tensor) -> Tensor:
        """``points`` (c, K, n) moved into the ball around ``centre`` (c, n), then into ``clip``."""
        out = centre[:, None, :] + project_ball(points - centre[:, None, :], d, norm)
        return out if clip is None else out.clamp(low, high)

    with torch.no_grad():
        out0 = _forward(model, x, guard)
        _check_label_range(label, out0.shape[1])
        if outputs == "auto":
            outputs = detect_outputs(out0)  # one host read
        lp0 = log_probs(out0, outputs)
        top, other = _classes(kind, lp0, label)
        s0 = _evaluate(kind, eps, lp0, top, other)
        applicable = _applicable(kind, top, other)
        seeds, gradient_reason = None, "not run (ascent_starts=0)"
        if ascent_starts:  # gradient-norm ascent first: the steepness the gradients see (under enable_grad)
            seeds, gradient_reason = gradient_ascent(
                model, x.reshape(n_in, n), shape, kind, eps, outputs, top, other, s0, d=d, norm=norm, clip=clip,
                steps=ascent_steps, starts=ascent_starts, seed=seed,
                index=torch.arange(n_in, device=device) + index_offset, max_batch=max_batch, guard=guard)

        # one search per (input, start), input-major: search v belongs to input v // starts
        # (expand + reshape, not repeat_interleave: that reads its output size on the host)
        v_in = torch.arange(n_in, device=device)[:, None].expand(n_in, starts).reshape(-1)
        v_start = torch.arange(starts, device=device).repeat(n_in)
        v_index = v_in + index_offset
        centres = x.reshape(n_in, n)[v_in]
        v_s0, v_top, v_other, v_ok = s0[v_in], top[v_in], other[v_in], applicable[v_in]
        f64 = {"dtype": torch.float64, "device": device}
        inc = centres.clone()
        best = torch.zeros(v_in.numel(), **f64)
        s_inc = v_s0.clone()
        unsafe = torch.where(v_s0 < 0, torch.zeros_like(v_s0), torch.full_like(v_s0, math.inf))
        evals = torch.ones(v_in.numel(), dtype=torch.int64, device=device)
        if starts > 2:  # starts 2, 3, …: a uniform point of the box [−d, d]^n, moved into the ball ∩ clip
            # the searches' positions as an index tensor (a boolean mask would read its count on the host)
            rnd = (torch.arange(n_in, device=device)[:, None] * starts
                   + torch.arange(2, starts, device=device)[None, :]).reshape(-1)
            u = _uniform(seed, v_index[rnd], v_start[rnd], 0, n, 3).to(dtype)
            pts = place(centres[rnd], (centres[rnd] + (2 * u - 1) * d)[:, None, :])[:, 0]
            s_pts = evaluate(pts, v_top[rnd], v_other[rnd])
            dist = lp_norm((pts - centres[rnd]).to(torch.float64), norm)
            inc[rnd] = pts
            s_inc[rnd] = s_pts
            best[rnd] = torch.where(dist > 0, (v_s0[rnd] - s_pts).abs() / dist.clamp_min(1e-300),
                                    torch.zeros_like(dist))
            unsafe[rnd] = torch.where(s_pts < 0, torch.minimum(dist, unsafe[rnd]), unsafe[rnd])
            evals[rnd] += 1
        mesh = torch.full((v_in.numel(),), mesh_init * d, **f64)
        mesh = torch.where(v_start == 1, mesh * _NEAR, mesh)  # start 1: from x with a fine mesh (the near field)
        iters = torch.zeros(v_in.numel(), dtype=torch.int64, device=device)
        # Poll points are built for `chunk` searches at a time, `slice` directions of each at a time, so that no
        # poll tensor holds more than max_elements values (one slice of all 2n + 1 points unless n is large).
        per_slice = max(1, min(k_poll, max_elements // n))
        slices = [(j0, min(k_poll, j0 + per_slice)) for j0 in range(0, k_poll, per_slice)]
        chunk = max(1, min(max_elements // (per_slice * n), max_batch // per_slice)) if len(slices) == 1 else 1
        eye = torch.eye(n, dtype=dtype, device=device) if method == "gps" and len(slices) == 1 else None

        def moves_of(j0: int, j1: int, v: Tensor | None) -> Tensor:
            """The unit poll directions j0..j1 (without the mirror point, j = 2n): (len, n) or (c, len, n)."""
            j = torch.arange(j0, min(j1, k_dirs), device=device)
            sign = torch.where(j < n, 1.0, -1.0).to(dtype)[:, None]
            if v is None:  # GPS: D = [I, −I]
                unit = eye[j % n] if eye is not None else torch.nn.functional.one_hot(j % n, n).to(dtype)
                return unit * sign
            # OrthoMADS: the columns ±h_i of the Householder matrix H = I − 2vvᵀ (symmetric): e_i − 2·v_i·v
            unit = torch.nn.functional.one_hot(j % n, n).to(dtype)[None] - 2 * v[:, j % n, None] * v[:, None, :]
            return unit * sign[None]

        active = torch.nonzero(v_ok).squeeze(1)  # a host sync (as every iteration's selection)
        for k in range(iterations):
            if active.numel() == 0:
                break
            tick(k, iterations, "polls")
            for c0 in range(0, active.numel(), chunk):
                idx = active[c0:c0 + chunk]
                c = idx.numel()
                step = mesh[idx].to(dtype)[:, None, None]
                centre, here = centres[idx], inc[idx]
                v = None
                if method == "mads":
                    v = _gaussian(seed, v_index[idx], v_start[idx], k, n)
                    v = (v / torch.linalg.vector_norm(v, dim=1, keepdim=True).clamp_min(1e-300)).to(dtype)
                pick = torch.arange(c, device=device)
                top_ratio = torch.full((c,), -math.inf, dtype=torch.float64, device=device)
                top_point, top_s = here, s_inc[idx]
                nearest = unsafe[idx]
                for j0, j1 in slices:
                    points = here[:, None, :] + step * moves_of(j0, j1, v)
                    if j1 > k_dirs:
                        # the search step (one point): the incumbent mirrored through x — for a nearly linear s
                        # the ratio is nearly symmetric, and curvature decides which side holds the larger one
                        points = torch.cat([points, (2 * centre - here)[:, None, :]], dim=1)
                    width = j1 - j0
                    cand = place(centre, points)
                    s = evaluate(cand.reshape(c * width, n), v_top[idx][:, None].expand(c, width).reshape(-1),
                                 v_other[idx][:, None].expand(c, width).reshape(-1)).reshape(c, width)
                    dist = lp_norm((cand - centre[:, None, :]).to(torch.float64), norm)
                    ratio = torch.where(dist > 0, (v_s0[idx][:, None] - s).abs() / dist.clamp_min(1e-300),
                                        torch.zeros_like(dist))
                    slice_ratio, arg = ratio.max(dim=1)
                    nearest = torch.minimum(nearest, torch.where(s < 0, dist, torch.full_like(dist, math.inf))
                                            .amin(dim=1))
                    better = slice_ratio > top_ratio  # ties: the earlier direction
                    top_point = torch.where(better[:, None], cand[pick, arg], top_point)
                    top_s = torch.where(better, s[pick, arg], top_s)
                    top_ratio = torch.where(better, slice_ratio, top_ratio)
                unsafe[idx] = nearest
                success = top_ratio > best[idx] * (1 + _INCREASE)  # a sufficient increase, not rounding noise
                inc[idx] = torch.where(success[:, None], top_point, here)
                s_inc[idx] = torch.where(success, top_s, s_inc[idx])
                best[idx] = torch.where(success, top_ratio, best[idx])
                mesh[idx] = torch.where(success, (mesh[idx] * expansion).clamp(max=2.0 * d), mesh[idx] * contraction)
                iters[idx] += 1
                evals[idx] += k_poll
            # the one host sync of the iteration: which searches go on
            active = torch.nonzero(v_ok & (mesh >= mesh_tol)).squeeze(1)

        # per input, the best of its starts (ties: the first start)
        q_ratio, pick = best.reshape(n_in, starts).max(dim=1)
        chosen = torch.arange(n_in, device=device) * starts + pick
        x_hat = inc[chosen].reshape(n_in, *shape)
        s_hat = s_inc[chosen]
        q_gradient = torch.zeros_like(q_ratio)
        unsafe_seed = torch.full_like(q_ratio, math.inf)
        seed_evals = torch.zeros(n_in, dtype=torch.int64, device=device)
        if seeds is not None:
            took = seeds["ratio"] > q_ratio  # the ascent's points count as evaluated points too
            q_ratio = torch.where(took, seeds["ratio"], q_ratio)
            x_hat = torch.where(took.reshape(-1, *(1,) * len(shape)), seeds["point"].reshape(n_in, *shape), x_hat)
            s_hat = torch.where(took, seeds["s_point"], s_hat)
            q_gradient = torch.where(applicable, seeds["gradient"], q_gradient)
            unsafe_seed, seed_evals = seeds["unsafe"], seeds["evaluations"]
        q = torch.maximum(q_ratio, q_gradient)
        radius = torch.where(q > 0, s0 / q.clamp_min(1e-300), torch.full_like(s0, d)).clamp(0.0, d)
        radius = torch.where(s0 < 0, torch.zeros_like(radius), radius)
        radius = torch.where(applicable, radius, torch.full_like(radius, math.nan))
        per = (n_in, starts)
        iterations_used = iters.reshape(per).amax(dim=1)
        evaluations = evals.reshape(per).sum(dim=1) - (starts - 1)  # the centre is evaluated once per input
        evaluations = evaluations + torch.where(applicable, seed_evals, torch.zeros_like(seed_evals))
        converged = (mesh < mesh_tol).reshape(per).all(dim=1)
        unsafe_distance = torch.minimum(unsafe.reshape(per).amin(dim=1),
                                        torch.where(applicable, unsafe_seed, torch.full_like(unsafe_seed, math.inf)))
    if guard is not None:
        guard.check()
    cert, reason = None, None
    if certification is not None:
        from pytest_dnnsafety.engines.quantification.certified import certified_radius

        cert, reason = certified_radius(model, x, kind, d=d, label=label, eps=eps, clip=clip,
                                        method=certification.method, steps=certification.steps, outputs=outputs)
    return LipschitzSearch(
        s=s0, q=q, radius=radius, x_hat=x_hat, s_hat=s_hat, iterations=iterations_used, evaluations=evaluations,
        converged=converged, unsafe_distance=unsafe_distance, applicable=applicable, top=top, other=other,
        outputs=outputs, settings=settings, certified=cert, certified_reason=reason, q_ratio=q_ratio,
        q_gradient=q_gradient, gradient_reason=gradient_reason)


