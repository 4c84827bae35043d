"""DeepQuant: Lipschitzian safety quantification (Mu et al.; seed 004; METRICS.md §11).

**Safety expressions** ``s(x)`` over the model's probabilities ``f(x)`` (softmax of logits, or the
model's own probabilities); ``s < 0`` is a risk. The classes an expression names are fixed at the
centre ``x`` of the ball (``top = argmax f(x)``) and ``s`` is then a function of ``x̂``:

* ``"top_vs_runner_up"`` — ``s(x̂) = f_top(x̂) − max_{j≠top} f_j(x̂) − ε``. At ``x̂ = x`` this is the
  paper's Case-1 ``s_CI(x)(j1, j2)``; away from ``x`` the paper keeps ``j2`` fixed, here the
  strongest competitor is re-taken at ``x̂`` (``min_l s_CI(x̂)(top, l)``), so ``s ≥ 0`` on a ball is
  exactly the paper's *safe norm ball* (Definition 4 with the ε-labelling of eq. 1): no class
  comes within ε of the top class, a third class overtaking included;
* ``"top_vs_label"`` — Case-2, ``f_top(x̂) − f_label(x̂) − ε`` for a given label (targeted);
  an input whose top class *is* the label is not applicable (its radius is NaN);
* ``"top_vs_least"`` — Case-3, ``f_top(x̂) − f_least(x̂) − ε`` with ``least = argmin f(x)``;
* ``"uncertainty"`` — ``s_U(x̂) = KL(uniform ‖ f(x̂)) − ε = −log m − (1/m)·Σ_l log f_l(x̂) − ε``
  (eq. 8). Natural logarithms throughout: the reference implementation mixed ``log`` and
  ``log10``, which scales the divergence (and so the meaning of ε) by ``1/ln 10`` in places;
* ``"reachability"`` — ``s_R(x̂)(l) = f_l(x̂) − ε`` for ``label`` (default: the top class at ``x``).

:func:`safety_values`, :func:`confidence_interval`, :func:`uncertainty` and :func:`reachability`
evaluate them batched: ``(model, x, ...) -> (N,)``.

**The Lipschitzian metric** ``Q(s, x, d, p) = sup_{x̂ ∈ B(x,d,p) ∩ clip} |s(x) − s(x̂)| / ‖x − x̂‖_p``
(Definition 6) is estimated by :func:`lipschitz_search`, a derivative-free pattern search that
*maximises* the ratio (the paper minimises its reciprocal ``w``), for many inputs at once:

* each input runs ``starts`` independent searches (default 2): the first from ``x`` (ratio 0 by
  convention) with mesh size ``Δ₀ = mesh_init·d`` (the far field), the second from ``x`` with
  ``Δ₀·10⁻³`` (the near field, where the ratio tends to the local slope, the dual norm of the
  gradient), the others from random points of the ball; ``Q`` is the best of them. Pattern
  search is local: on two 2-D ReLU networks one start missed a dense grid's supremum by up to 38%,
  two by up to 10%, four by under 5% (see the tests);
* each iteration polls ``x̂_inc ± Δ·D`` — ``"gps"``: the 2n coordinate directions ``±e_i``
  (the authors' ``D = [I, −I]``); ``"mads"``: the 2n columns ``±h_i`` of a random Householder
  matrix ``H = I − 2vvᵀ`` (OrthoMADS, Abramson et al. 2009), ``v`` drawn afresh per search and
  iteration — plus a one-point *search step* (MADS allows any): the incumbent mirrored through
  ``x``, ``2x − x̂_inc`` (for a nearly linear ``s`` the ratio is nearly symmetric in ``x̂ − x`` and
  the curvature decides which side is larger). Every point is projected onto the ball (L∞: clamp;
  L2: radial rescale; L1: the exact Euclidean projection, :func:`project_l1_ball`) and then
  clamped to ``clip`` — the clamp only moves coordinates towards ``x`` (which lies in ``clip``), so
  the point stays in the ball: it lies in ``B(x,d,p) ∩ clip`` (not always the exact projection
  onto the intersection);
* the poll points of **all** active searches go to the model as one batch (chunked to at most
  ``max_batch`` rows per forward pass); the best point of a complete poll replaces the incumbent
  when its ratio is higher by a relative 1e-9 (success: ``Δ ← min(expansion·Δ, 2d)``; the
  authors' 1.3), else ``Δ ← contraction·Δ`` (0.8);
* a search stops when ``Δ < mesh_tol`` (1e-5, the authors') or after ``iterations`` polls. The
  authors ran 1500 iterations; the default here is 100 (a gate runs on a whole data set); raise
  it when the searches have not converged (``iterations`` and ``converged`` are returned: on
  8×8 digits GPS moves one pixel per poll, and 100 polls rarely converge).

Every evaluated point counts towards ``Q`` (the incumbent is the best ratio seen), so ``Q`` is a
*lower bound* on the true supremum. The safe-radius **estimate** ``d' = clamp(s(x)/Q, 0, d)``
(Theorem 1; ``d`` when ``Q = 0``, 0 when ``s(x) < 0``) may therefore *overstate* the true safe
radius: it is an estimate, never a certificate. The search also reports the nearest evaluated
point with ``s < 0`` (``unsafe_distance``: an upper bound on the true safe radius, in the
search norm).

Batching never changes a result: each search's random numbers (MADS directions, random starts)
are counter-based draws keyed by ``(seed, index_offset + i, start, iteration)`` (an integer hash,
the same on every device), so a search run on a whole batch gives the same numbers as the same
search run input by input, up to the rounding of the model's batched kernels: within 1e-12 in
float64 (measured: bitwise or ≤ 3e-16 on the CPU, ≤ 3e-13 on an H100), within float32 rounding
on the digits CNN (≤ 2e-5 relative in ``Q``).

Host synchronisation: exactly one per iteration for the whole batch (selecting the searches still
active, which spares the forward passes of converged ones; checked with
``torch.cuda.set_sync_debug_mode``), plus per call one for the input checks, one for the first
selection, with ``outputs="auto"`` one to detect the output kind, and with a
:class:`~pytest_dnnsafety.outputs.ForwardGuard` its one check at the end.

**Certified companion** (:func:`certified_radius`): where
:class:`~pytest_dnnsafety.engines.robustness.bounds.BoundedModel` covers the model (logits out,
supported layers), sound bounds give a *proved* lower bound ``r`` on the safe radius: every
``x̂`` with ``‖x̂ − x‖∞ ≤ r`` inside ``clip`` has ``s(x̂) ≥ 0`` — more precisely, a sound lower
bound of ``s`` over that box is positive. The bound on ``s`` is built from logit bounds:

* confidence intervals and reachability, from the CROWN/IBP lower bounds ``L_j`` of the logit
  margins ``z_t − z_j`` (:meth:`BoundedModel.margin_lower_bounds`): with ``m_j = z_t − z_j``,
  ``f_t − f_o = (1 − e^{−m_o}) / (1 + Σ_{j≠t} e^{−m_j})``, increasing in every ``m_j``, so
  plugging in the ``L_j`` bounds it from below (for ``min_o m_o`` in the runner-up case);
  ``f_l ≥ 1/(1 + Σ_{j≠l} e^{−L_j})`` with the margins of ``l``. With ``ε = 0`` this is exactly
  "the top class stays ahead" (``L > 0``); with ``ε > 0`` the softmax is bounded soundly, not
  assumed away;
* uncertainty, from a tangent of the convex log-sum-exp: ``KL(u ‖ f(x̂)) = LSE(z − z̄) − log m`` and
  Gibbs' inequality ``LSE(w) ≥ q·w + H(q)`` for any distribution ``q`` give, with ``q = f(x)``,
  ``KL(u ‖ f(x̂)) ≥ H(f(x)) − log m + (f(x) − 1/m)·z(x̂)`` (equality at ``x̂ = x``), a linear
  function of the logits bounded from below by CROWN (or IBP).

With ``ε = 0`` the runner-up certificate is exactly what ``min_verified_robustness`` proves at
radius ``r`` with the predicted class as the label (every margin ``z_top − z_j > 0``). The bounds
are sound up to floating-point rounding, as those of :class:`BoundedModel` are. ``r`` is found by
bisection over ``[0, d]`` (``steps`` halvings after a first test of ``d``; the radii differ per
input, one bounds call per step for the whole batch). Only radii that were
proved are returned, so the result is sound even where the bounds are not monotone in ``r``.
The certificate is an L∞ statement; the L∞ ball of radius ``r`` contains the L2 and L1 balls
of radius ``r``, so it is also a sound (loose) lower bound for ``norm="l2"``/``"l1"``. A model the
bounds do not cover (a Softmax layer, an unsupported op, a non-module) gives ``None`` with the
reason — not an error.

:func:`quantify_safety` runs both over a data set in batches and summarises the result for the
``min_safe_radius`` gate (:class:`SafetyQuantification`). Pure torch; no pytest import.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .. import progress
from ..data import iter_batches, known_length
from ..errors import ConfigError, DataError, MetricError
from ..outputs import ForwardGuard, model_dtype_device
from .robustness.attacks import OUTPUTS, check_clip, detect_outputs, log_probs

__all__ = [
    "EXPRESSIONS", "NORMS", "SEARCHES", "BOUND_METHODS",
    "safety_values", "confidence_interval", "uncertainty", "reachability",
    "project_ball", "project_l1_ball", "lp_norm",
    "LipschitzSearch", "lipschitz_search", "certified_radius",
    "SafetyQuantification", "quantify_safety",
]

#: The safety expressions (see the module docstring).
EXPRESSIONS = ("top_vs_runner_up", "top_vs_label", "top_vs_least", "uncertainty", "reachability")
#: The ball norms.
NORMS = ("linf", "l2", "l1")
#: The pattern searches.
SEARCHES = ("gps", "mads")
#: The bound methods of the certified radius.
BOUND_METHODS = ("crown", "ibp")

_CI = ("top_vs_runner_up", "top_vs_label", "top_vs_least")
_LABELLED = ("top_vs_label", "reachability")
_M32 = 0xFFFFFFFF
#: A poll succeeds when its best ratio beats the incumbent's by this relative margin (so rounding noise
#: cannot keep expanding the mesh forever).
_INCREASE = 1e-9
#: The second start's first mesh, relative to the first's: it searches the near field of x, where the ratio tends to
#: the local slope (the dual norm of the gradient), while the first start's coarse mesh explores the whole ball.
_NEAR = 1e-3


# ----------------------------------------------------------------------------- argument checks


def _real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_expression(expression: Any, label: Any, eps: Any) -> tuple[str, int | None, float]:
    if expression not in EXPRESSIONS:
        raise ConfigError(f"expression={expression!r} is not one of {list(EXPRESSIONS)}. Fix: name a safety "
                          f"expression, e.g. expression='top_vs_runner_up'.")
    if label is not None and (isinstance(label, bool) or not isinstance(label, numbers.Integral) or label < 0):
        raise ConfigError(f"label={label!r} is not a class index (an integer ≥ 0). Fix: give the index of a class "
                          f"of the model's output, e.g. label=3.")
    if expression == "top_vs_label" and label is None:
        raise ConfigError("expression='top_vs_label' needs label=: the class the top class must stay ahead of. "
                          "Fix: give label=<class index>, or use expression='top_vs_runner_up'.")
    if label is not None and expression not in _LABELLED:
        raise ConfigError(f"label={label!r} is used only by the expressions {list(_LABELLED)}, not by "
                          f"{expression!r}. Fix: drop label=, or use expression='top_vs_label'.")
    if not _real(eps) or not math.isfinite(eps) or eps < 0:
        raise ConfigError(f"eps={eps!r} is not a finite number ≥ 0. Fix: give the required margin ε, e.g. eps=0.0.")
    if expression != "uncertainty" and eps > 1:
        raise ConfigError(f"eps={eps!r} exceeds 1; {expression!r} compares probabilities, so ε must lie in [0, 1]. "
                          f"Fix: give a probability margin, e.g. eps=0.1.")
    return str(expression), None if label is None else int(label), float(eps)


def _check_positive(name: str, value: Any, fix: str) -> float:
    if not _real(value) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={value!r} is not a positive finite number. Fix: {fix}")
    return float(value)


def _check_choice(name: str, value: Any, choices: tuple[str, ...], fix: str) -> str:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {list(choices)}. Fix: {fix}")
    return str(value)


def _check_int(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ConfigError(f"{name}={value!r} is not an integer ≥ {least}. Fix: give an integer ≥ {least}.")
    return int(value)


def _check_outputs(outputs: Any) -> str:
    return _check_choice("outputs", outputs, ("auto", *OUTPUTS),
                         "say what the model returns: 'auto' (detected), 'logits' or 'probabilities'.")


def _check_label_range(label: int | None, classes: int) -> None:
    if label is not None and label >= classes:
        raise ConfigError(f"label={label} is not a class of the model: it returns {classes} class scores (classes "
                          f"0..{classes - 1}). Fix: give a label in [0, {classes - 1}].")


# ----------------------------------------------------------------------------- expressions


def _to_model(model: Any, x: Any) -> Tensor:
    """``x`` as a non-empty batch on the model's device in its dtype (float32 for a model without parameters)."""
    dtype, device = model_dtype_device(model)
    x = torch.as_tensor(x).detach()
    if x.ndim < 2 or x.shape[0] == 0:
        raise DataError(f"safety quantification needs a non-empty batch of inputs (N, ...); got shape "
                        f"{tuple(x.shape)}. Fix: give at least one input, with the batch as the first dimension.")
    device = device or x.device
    dtype = dtype or (x.dtype if x.is_floating_point() else torch.float32)
    return x.to(device=device, dtype=dtype, non_blocking=device.type != "cpu")


def _forward(model: Any, x: Tensor, guard: ForwardGuard | None) -> Tensor:
    out = guard(model, x) if guard is not None else model(x)
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
        out = out[0]
    if not isinstance(out, Tensor) or out.ndim != 2 or out.shape[1] < 2 or not out.is_floating_point():
        raise MetricError(f"safety quantification needs class scores of shape (batch, classes); the model returned "
                          f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}. Fix: return logits or "
                          f"probabilities, one row per input.")
    return out


def _classes(kind: str, lp0: Tensor, label: int | None) -> tuple[Tensor, Tensor]:
    """Per input ``(top, other)`` fixed at the centre: ``other`` is the label, the least class, or the top."""
    top = lp0.argmax(dim=1)
    if kind == "top_vs_least":
        other = lp0.argmin(dim=1)
    elif label is not None:
        other = torch.full_like(top, label)
    else:  # top_vs_runner_up (re-taken at x̂), uncertainty (unused), reachability of the top class
        other = top
    return top, other


def _evaluate(kind: str, eps: float, lp: Tensor, top: Tensor, other: Tensor) -> Tensor:
    """``s`` (float64) from log-probabilities ``lp`` (M, m) and each row's fixed classes."""
    lp = lp.to(torch.float64)
    if kind == "uncertainty":
        m = lp.shape[1]
        return -math.log(m) - lp.mean(dim=1) - eps
    p = lp.exp()
    if kind == "reachability":
        return p.gather(1, other[:, None]).squeeze(1) - eps
    p_top = p.gather(1, top[:, None]).squeeze(1)
    if kind == "top_vs_runner_up":
        rival = p.scatter(1, top[:, None], -math.inf).amax(dim=1)
    else:
        rival = p.gather(1, other[:, None]).squeeze(1)
    return p_top - rival - eps


def _applicable(kind: str, top: Tensor, other: Tensor) -> Tensor:
    if kind in ("top_vs_label", "top_vs_least"):
        return top != other
    return torch.ones_like(top, dtype=torch.bool)


def safety_values(model: Any, x: Tensor, expression: str = "top_vs_runner_up", *, label: int | None = None,
                  eps: float = 0.0, outputs: str = "auto") -> Tensor:
    """``s(x)`` per input, float64 ``(N,)``, for one of :data:`EXPRESSIONS` (see the module docstring).

    ``outputs``: ``"logits"``, ``"probabilities"`` or ``"auto"`` (detected on this batch). For
    ``top_vs_label`` an input whose top class is ``label`` gets ``−ε`` (the formula; the search
    treats it as not applicable).
    """
    kind, label, eps = _check_expression(expression, label, eps)
    outputs = _check_outputs(outputs)
    with torch.no_grad():
        out = _forward(model, _to_model(model, x), None)
    _check_label_range(label, out.shape[1])
    if outputs == "auto":
        outputs = detect_outputs(out)
    lp = log_probs(out, outputs)
    top, other = _classes(kind, lp, label)
    return _evaluate(kind, eps, lp, top, other)


def confidence_interval(model: Any, x: Tensor, case: str = "top_vs_runner_up", label: int | None = None,
                        eps: float = 0.0, *, outputs: str = "auto") -> Tensor:
    """``s_CI(x) = f_top(x) − f_other(x) − ε`` per input (eq. 3); ``case`` one of the three CI cases."""
    if case not in _CI:
        raise ConfigError(f"case={case!r} is not one of {list(_CI)}. Fix: pick a confidence-interval case.")
    return safety_values(model, x, case, label=label, eps=eps, outputs=outputs)


def uncertainty(model: Any, x: Tensor, eps: float = 0.0, *, outputs: str = "auto") -> Tensor:
    """``s_U(x) = KL(uniform ‖ f(x)) − ε`` per input, natural logarithms (eq. 8)."""
    return safety_values(model, x, "uncertainty", eps=eps, outputs=outputs)


def reachability(model: Any, x: Tensor, label: int | None = None, eps: float = 0.0, *,
                 outputs: str = "auto") -> Tensor:
    """``s_R(x)(l) = f_l(x) − ε`` per input; ``label=None``: each input's top class."""
    return safety_values(model, x, "reachability", label=label, eps=eps, outputs=outputs)


# ----------------------------------------------------------------------------- balls


def lp_norm(v: Tensor, norm: str) -> Tensor:
    """The norm of each row of ``v`` (..., n) over its last dimension: ``"linf"``, ``"l2"`` or ``"l1"``."""
    if norm == "linf":
        return v.abs().amax(dim=-1)
    if norm == "l2":
        return torch.linalg.vector_norm(v, dim=-1)
    return v.abs().sum(dim=-1)


def project_l1_ball(v: Tensor, radius: float | Tensor) -> Tensor:
    """Euclidean projection of each row of ``v`` (M, n) onto the L1 ball of ``radius`` (a number or (M,)).

    The sort-based algorithm of Duchi et al. 2008 ("Efficient projections onto the l1-ball for
    learning in high dimensions", Fig. 1), batched: with ``u = sort(|v|, desc)`` and
    ``ρ = max{j : u_j − (Σ_{i≤j} u_i − r)/j > 0}``, ``θ = (Σ_{i≤ρ} u_i − r)/ρ`` and the result is
    ``sign(v)·max(|v| − θ, 0)``; rows already inside the ball are returned unchanged.
    """
    a = v.abs()
    n = v.shape[-1]
    # a number stays a Python scalar: a tensor made from it would be a host-to-device copy (a sync on CUDA)
    r: float | Tensor = (radius.to(v.dtype).reshape(*v.shape[:-1], 1) if isinstance(radius, Tensor)
                         else float(radius))
    inside = a.sum(dim=-1, keepdim=True) <= r
    u = a.sort(dim=-1, descending=True).values
    css = u.cumsum(dim=-1)
    j = torch.arange(1, n + 1, device=v.device)
    cond = u - (css - r) / j.to(v.dtype) > 0
    rho = (cond * j).amax(dim=-1, keepdim=True).clamp(min=1)
    theta = (css.gather(-1, rho - 1) - r) / rho.to(v.dtype)
    w = v.sign() * (a - theta).clamp(min=0)
    return torch.where(inside, v, w)


def project_ball(delta: Tensor, radius: float | Tensor, norm: str) -> Tensor:
    """Each row of ``delta`` (..., n) projected onto the ``norm`` ball of ``radius`` (a number or one per row).

    L∞: a clamp; L2: a radial rescale; L1: :func:`project_l1_ball`. All three are the exact
    Euclidean projections.
    """
    per_row = isinstance(radius, Tensor)
    r: float | Tensor = radius.to(delta.dtype) if per_row else float(radius)
    if norm == "linf":
        if per_row:
            r = r.unsqueeze(-1)
            return torch.minimum(torch.maximum(delta, -r), r)
        return delta.clamp(-r, r)
    if norm == "l2":
        n = torch.linalg.vector_norm(delta, dim=-1)
        factor = torch.where(n > r, r / n.clamp_min(torch.finfo(delta.dtype).tiny), torch.ones_like(n))
        return delta * factor.unsqueeze(-1)
    flat = delta.reshape(-1, delta.shape[-1])
    rr = r.expand(delta.shape[:-1]).reshape(-1) if per_row else r
    return project_l1_ball(flat, rr).reshape(delta.shape)


# ----------------------------------------------------------------------------- counter-based random draws


def _mul32(h: Tensor, c: int) -> Tensor:
    """``h·c mod 2^32`` for int64 ``h`` in ``[0, 2^32)`` without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & _M32


def _mix32(h: Tensor) -> Tensor:
    """A 32-bit integer hash (Wellons' "lowbias32"), on int64 tensors holding 32-bit values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def _uniform(seed: int, index: Tensor, start: Tensor, iteration: int, n: int, stream: int) -> Tensor:
    """Uniform numbers in (0, 1), float64 ``(len(index), n)``: a pure function of (seed, index, start, iteration,
    stream, coordinate), so a row's numbers do not depend on the other rows of the batch."""
    device = index.device
    h = torch.full((1, 1), (seed & _M32) ^ 0x9E3779B9, dtype=torch.int64, device=device)
    for key in ((seed >> 32) & _M32, iteration & _M32, stream & _M32):
        h = _mix32(_mix32(h) ^ key)
    h = _mix32(h ^ (index.to(torch.int64)[:, None] & _M32))
    h = _mix32(h ^ (start.to(torch.int64)[:, None] & _M32))
    h = _mix32(h ^ torch.arange(n, dtype=torch.int64, device=device)[None, :])
    return (h.to(torch.float64) + 0.5) / 4294967296.0


def _gaussian(seed: int, index: Tensor, start: Tensor, iteration: int, n: int) -> Tensor:
    """Standard normal draws ``(len(index), n)`` by Box–Muller from two counter-based streams."""
    u1, u2 = _uniform(seed, index, start, iteration, n, 1), _uniform(seed, index, start, iteration, n, 2)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


# ----------------------------------------------------------------------------- the pattern search


@dataclass(frozen=True)
class LipschitzSearch:
    """Per-input results of :func:`lipschitz_search` (tensors on the search's device, first dim N).

    ``s``: ``s(x)`` (float64). ``q``: the largest ratio ``|s(x) − s(x̂)| / ‖x − x̂‖_p`` found, a
    lower bound on ``Q``. ``radius``: the estimate ``d' = clamp(s/q, 0, d)`` (``d`` for
    ``q = 0``, NaN where not applicable). ``x_hat``: the point of ``q`` (``x`` itself when no
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


def _settings(expression: str, label: int | None, eps: float, d: float, norm: str, method: str, iterations: int,
              starts: int, clip: tuple[float, float] | None, seed: int, expansion: float, contraction: float,
              mesh_tol: float, mesh_init: float) -> dict[str, Any]:
    return {"expression": expression, "label": label, "eps": eps, "d": d, "norm": norm, "method": method,
            "iterations": iterations, "starts": starts, "clip": None if clip is None else [clip[0], clip[1]],
            "seed": seed, "expansion": expansion, "contraction": contraction, "mesh_tol": mesh_tol,
            "mesh_init": mesh_init}


def lipschitz_search(
    model: Any,
    x: Tensor,
    expression: str = "top_vs_runner_up",
    *,
    d: float,
    label: int | None = None,
    eps: float = 0.0,
    norm: str = "linf",
    method: str = "gps",
    iterations: int = 100,
    starts: int = 2,
    clip: tuple[float, float] | None = (0.0, 1.0),
    seed: int = 0,
    index_offset: int = 0,
    expansion: float = 1.3,
    contraction: float = 0.8,
    mesh_tol: float = 1e-5,
    mesh_init: float = 1.0,
    outputs: str = "auto",
    max_batch: int = 8192,
    max_elements: int = 1 << 24,
    guard: ForwardGuard | None = None,
    certified: str | None = None,
    bisection_steps: int = 10,
) -> LipschitzSearch:
    """Estimate ``Q(s, x, d, p)`` and the safe radius of every input of ``x`` (N, ...) by pattern search.

    See the module docstring for the method. ``d``: the ball's radius in input units; ``norm``:
    ``"linf"``, ``"l2"`` or ``"l1"``; ``method``: ``"gps"`` or ``"mads"``; ``starts``: independent
    searches per input (the first from ``x``, the others from random points of the ball; ``Q`` is
    the best of them — pattern search is local, more starts escape more local maxima, each costs
    one more search); ``mesh_init``: the first mesh size as a fraction of ``d``;
    ``expansion``/``contraction``/``mesh_tol``: the mesh rules; ``seed`` and ``index_offset`` key
    the random draws (``index_offset`` is the data index of ``x[0]``, so a data set searched batch
    by batch draws what one big batch would); ``max_batch``: rows per forward pass;
    ``max_elements``: the largest poll tensor built at once. ``certified``: ``"crown"``/``"ibp"``
    also runs :func:`certified_radius` (None: not).

    Runs under ``torch.no_grad`` on the model's device in the model's dtype; the model's mode
    is the caller's business (use eval mode). Raises :class:`ConfigError` for bad arguments (a
    label outside the model's classes included) and :class:`DataError` for inputs outside
    ``clip`` or not finite.
    """
    kind, label, eps = _check_expression(expression, label, eps)
    d = _check_positive("d", d, "give the ball's radius in input units, e.g. d=0.1 for inputs in [0, 1].")
    norm = _check_choice("norm", norm, NORMS, "use 'linf', 'l2' or 'l1'.")
    method = _check_choice("method", method, SEARCHES, "use 'gps' (coordinate polls) or 'mads' (random "
                                                       "orthogonal polls).")
    iterations = _check_int("iterations", iterations, 1)
    starts = _check_int("starts", starts, 1)
    clip = check_clip(clip)
    seed = _check_int("seed", seed, 0)
    index_offset = _check_int("index_offset", index_offset, 0)
    if not _real(expansion) or not math.isfinite(expansion) or expansion < 1:
        raise ConfigError(f"expansion={expansion!r} is not a finite number ≥ 1. Fix: e.g. expansion=1.3.")
    if not _real(contraction) or not 0 < contraction < 1:
        raise ConfigError(f"contraction={contraction!r} is not in (0, 1). Fix: e.g. contraction=0.8.")
    mesh_tol = _check_positive("mesh_tol", mesh_tol, "e.g. mesh_tol=1e-5.")
    mesh_init = _check_positive("mesh_init", mesh_init, "give the first mesh size as a fraction of d, e.g. 1.0.")
    outputs = _check_outputs(outputs)
    max_batch = _check_int("max_batch", max_batch, 1)
    max_elements = _check_int("max_elements", max_elements, 1)
    if certified is not None:
        certified = _check_choice("certified", certified, BOUND_METHODS, "use 'crown', 'ibp' or None.")
    settings = _settings(kind, label, eps, d, norm, method, iterations, starts, clip, seed, float(expansion),
                         float(contraction), mesh_tol, mesh_init)

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
        q, pick = best.reshape(n_in, starts).max(dim=1)
        chosen = torch.arange(n_in, device=device) * starts + pick
        radius = torch.where(q > 0, s0 / q.clamp_min(1e-300), torch.full_like(s0, d)).clamp(0.0, d)
        radius = torch.where(s0 < 0, torch.zeros_like(radius), radius)
        radius = torch.where(applicable, radius, torch.full_like(radius, math.nan))
        x_hat = inc[chosen].reshape(n_in, *shape)
        s_hat = s_inc[chosen]
        per = (n_in, starts)
        iterations_used = iters.reshape(per).amax(dim=1)
        evaluations = evals.reshape(per).sum(dim=1) - (starts - 1)  # the centre is evaluated once per input
        converged = (mesh < mesh_tol).reshape(per).all(dim=1)
        unsafe_distance = unsafe.reshape(per).amin(dim=1)
    if guard is not None:
        guard.check()
    cert, reason = None, None
    if certified is not None:
        cert, reason = certified_radius(model, x, kind, d=d, label=label, eps=eps, clip=clip, method=certified,
                                        steps=bisection_steps, outputs=outputs)
    return LipschitzSearch(
        s=s0, q=q, radius=radius, x_hat=x_hat, s_hat=s_hat, iterations=iterations_used, evaluations=evaluations,
        converged=converged, unsafe_distance=unsafe_distance, applicable=applicable, top=top, other=other,
        outputs=outputs, settings=settings, certified=cert, certified_reason=reason)


def _check_inputs(x: Tensor, clip: tuple[float, float] | None) -> None:
    """DataError for non-finite inputs or inputs outside ``clip`` (one host read)."""
    from .robustness.bounds import outside_clip, outside_clip_error

    bad, outside = torch.stack([(~torch.isfinite(x)).sum(), outside_clip(x, clip)]).tolist()
    if bad:
        raise DataError(f"{bad} input value(s) are NaN or infinite. Fix: give finite inputs.")
    if outside:
        raise outside_clip_error(int(outside), clip)


# ----------------------------------------------------------------------------- the certified radius


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
    from .robustness.bounds import BoundedModel, UnsupportedLayerError

    kind, label, eps = _check_expression(expression, label, eps)
    d = _check_positive("d", d, "give the ball's radius in input units, e.g. d=0.1 for inputs in [0, 1].")
    method = _check_choice("method", method, BOUND_METHODS, "use 'crown' (tighter) or 'ibp' (faster).")
    steps = _check_int("steps", steps, 0)
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
            ok = lower(todo, full) > 0
            lo_r = torch.where(ok, full, torch.zeros_like(full))
            hi_r = full.clone()
            for _ in range(steps):
                mid = (lo_r + hi_r) / 2
                proved = lower(todo, mid) > 0
                lo_r = torch.where(~ok & proved, mid, lo_r)
                hi_r = torch.where(~ok & ~proved, mid, hi_r)
            radius[todo] = lo_r
        radius = torch.where(applicable, radius, torch.full_like(radius, math.nan))
    return radius, None


# ----------------------------------------------------------------------------- over a data set


def _quantile(values: Tensor, q: float) -> float:
    """The lower empirical ``q``-quantile (``q = 0``: the minimum) of the values that are not NaN."""
    v = values[~torch.isnan(values)].sort().values
    if v.numel() == 0:
        return math.nan
    return float(v[math.floor(q * (v.numel() - 1))])


def _num(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


@dataclass(frozen=True)
class SafetyQuantification:
    """DeepQuant over a data set (:func:`quantify_safety`): per-input CPU tensors and the gated value.

    ``value``: the lower ``quantile`` of the applicable inputs' radius estimates (``quantile=0``:
    the minimum). ``certified``: per-input certified L∞ radii (or None, ``certified_reason``
    saying why). ``worst``: JSON-able dicts of the inputs with the smallest estimates (index, s,
    Q, estimate, certified, distances of x̂, ``s`` at x̂, iterations; ``x_hat`` as a flat list for
    inputs of at most 4096 values); ``worst_points``: ``(x, x̂)`` CPU tensor pairs for them.
    """

    value: float
    quantile: float
    n: int
    s: Tensor
    q: Tensor
    radius: Tensor
    iterations: Tensor
    evaluations: Tensor
    converged: Tensor
    unsafe_distance: Tensor
    linf_distance: Tensor
    applicable: Tensor
    outputs: str
    settings: dict[str, Any]
    worst: tuple[dict[str, Any], ...] = ()
    worst_points: tuple[tuple[Tensor, Tensor], ...] = field(default=(), compare=False, repr=False)
    certified: Tensor | None = None
    certified_method: str | None = None
    certified_reason: str | None = None

    @property
    def n_applicable(self) -> int:
        return int(self.applicable.sum())

    @property
    def certified_value(self) -> float | None:
        """The same quantile of the certified radii, or None without a certificate."""
        if self.certified is None:
            return None
        return _quantile(self.certified, self.quantile)

    @property
    def contradiction(self) -> str | None:
        """Why the certificate contradicts the search (an unsafe point inside a certified ball), or None."""
        if self.certified is None:
            return None
        bad = (self.unsafe_distance < self.certified * (1 - 1e-6)) & self.applicable
        if not bool(bad.any()):
            return None
        i = int(torch.nonzero(bad)[0])
        return (f"input {i}: the search found s < 0 at distance {float(self.unsafe_distance[i]):.6g} inside the "
                f"certified radius {float(self.certified[i]):.6g} (unsound bounds: the traced graph does not compute "
                f"what the model computes). Please report this with the model.")

    def _what(self) -> str:
        st = self.settings
        label = f", label={st['label']}" if st["label"] is not None else ""
        return f"{st['expression']}{label}, ε={st['eps']:g}, {st['norm']} d={st['d']:g}"

    def detail(self) -> str:
        """``min safe-radius estimate 0.0213 (top_vs_runner_up, ε=0, linf d=0.1; 300 inputs, gps); certified ...``."""
        st = self.settings
        which = "min" if self.quantile == 0 else f"q{self.quantile:g}"
        text = (f"{which} safe-radius estimate {self.value:.4g} ({self._what()}; {self.n_applicable}/{self.n} inputs, "
                f"{st['method']} ≤{st['iterations']} it.)")
        if self.certified is not None:
            text += f"; certified ({self.certified_method}, L∞) {which} {self.certified_value:.4g}"
        if self.worst:
            w = self.worst[0]
            text += f"; worst input #{w['index']}: s={w['s']:.3g}, Q≥{w['q']:.3g}"
        return text

    def to_details(self) -> dict[str, Any]:
        """JSON-able details (plain str/int/float/bool/list/dict/None only)."""
        ok = self.applicable
        radius = self.radius[ok]
        q = self.q[ok]
        details: dict[str, Any] = {
            "metric": "safe_radius_estimate",
            "value": _num(self.value),
            "quantile": float(self.quantile),
            "n": int(self.n),
            "n_applicable": self.n_applicable,
            "not_applicable": int(self.n - self.n_applicable),
            "outputs": self.outputs,
            "estimate": {
                "min": _num(float(radius.min())) if radius.numel() else None,
                "median": _num(_quantile(radius, 0.5)),
                "mean": _num(float(radius.mean())) if radius.numel() else None,
                "max": _num(float(radius.max())) if radius.numel() else None,
                "at_d": int((radius >= self.settings["d"]).sum()),
                "note": "d' = s(x)/Q with Q a lower bound found by search: an estimate that may overstate the "
                        "true safe radius",
            },
            "lipschitz": {"max": _num(float(q.max())) if q.numel() else None, "median": _num(_quantile(q, 0.5))},
            "unsafe_centres": int(((self.s < 0) & ok).sum()),
            "unsafe_found": int((torch.isfinite(self.unsafe_distance) & ok).sum()),
            "converged": int((self.converged & ok).sum()),
            "iterations_mean": _num(float(self.iterations[ok].double().mean())) if radius.numel() else None,
            "evaluations": int(self.evaluations.sum()),
            "worst": [dict(w) for w in self.worst],
            "settings": dict(self.settings),
        }
        if self.certified is not None:
            c = self.certified[ok]
            details["certified"] = {
                "method": self.certified_method, "norm": "linf", "value": _num(self.certified_value),
                "min": _num(float(c.min())) if c.numel() else None, "median": _num(_quantile(c, 0.5)),
                "note": "proved: s ≥ 0 on the whole L∞ ball of this radius ∩ clip (a lower bound on the safe "
                        "radius; for l2/l1 balls too, which the L∞ ball contains)"}
        else:
            details["certified"] = None
            details["certified_reason"] = self.certified_reason
        return details


def quantify_safety(
    model: Any,
    data: Any,
    expression: str = "top_vs_runner_up",
    *,
    d: float,
    label: int | None = None,
    eps: float = 0.0,
    norm: str = "linf",
    method: str = "gps",
    iterations: int = 100,
    starts: int = 2,
    clip: tuple[float, float] | None = (0.0, 1.0),
    quantile: float = 0.0,
    certified: str | None = "crown",
    worst: int = 5,
    seed: int = 0,
    batch_size: int = 256,
    device: torch.device | str = "cpu",
    outputs: str = "auto",
    expansion: float = 1.3,
    contraction: float = 0.8,
    mesh_tol: float = 1e-5,
    mesh_init: float = 1.0,
    bisection_steps: int = 10,
    max_batch: int = 8192,
) -> SafetyQuantification:
    """:func:`lipschitz_search` (and :func:`certified_radius` with ``certified="crown"``/``"ibp"``) over ``data``.

    ``data``: anything :func:`~pytest_dnnsafety.data.iter_batches` reads (labels are not used).
    Batches of ``batch_size`` inputs; each input's random draws are keyed by its index in the
    data, so the batch size does not change the numbers. ``device`` is used only for a model
    without parameters. The certificate's bounded model is built once; a model it does not
    cover gives ``certified=None`` and the reason.
    """
    from .robustness.bounds import BoundedModel, UnsupportedLayerError

    if not _real(quantile) or not 0 <= quantile <= 1:
        raise ConfigError(f"quantile={quantile!r} is not in [0, 1]. Fix: 0 gates the minimum, 0.05 the 5% quantile.")
    worst = _check_int("worst", worst, 0)
    batch_size = _check_int("batch_size", batch_size, 1)
    if certified is not None:
        certified = _check_choice("certified", certified, BOUND_METHODS, "use 'crown', 'ibp' or None.")
    _check_expression(expression, label, eps)
    _, model_device = model_dtype_device(model)
    target = model_device or torch.device(device)
    guard = ForwardGuard("min_safe_radius: model on the pattern search's points")
    bounded, reason = None, None
    if certified is not None:
        try:
            bounded = BoundedModel(model)
        except UnsupportedLayerError as exc:
            reason = str(exc)
    parts: dict[str, list[Tensor]] = {k: [] for k in ("s", "q", "radius", "iterations", "evaluations", "converged",
                                                      "unsafe", "linf", "applicable", "certified")}
    kept: dict[str, Tensor] | None = None
    outputs_seen, settings = outputs, {}
    total, done = known_length(data) or 0, 0
    for x, _ in iter_batches(data, batch_size):
        x = torch.as_tensor(x).to(target, non_blocking=target.type != "cpu")
        res = lipschitz_search(model, x, expression, d=d, label=label, eps=eps, norm=norm, method=method,
                               iterations=iterations, starts=starts, clip=clip, seed=seed, index_offset=done,
                               expansion=expansion,
                               contraction=contraction, mesh_tol=mesh_tol, mesh_init=mesh_init, outputs=outputs_seen,
                               guard=guard, max_batch=max_batch)
        outputs_seen, settings = res.outputs, res.settings  # detected once, on the first batch
        cert = None
        if bounded is not None:
            cert, why = certified_radius(model, x, expression, d=d, label=label, eps=eps, clip=clip,
                                         method=certified, steps=bisection_steps, outputs=outputs_seen,
                                         bounded=bounded)
            if cert is None:
                bounded, reason = None, why
                parts["certified"] = []
        xin = x.to(res.x_hat.dtype)
        linf = (res.x_hat - xin).flatten(1).abs().amax(dim=1).to(torch.float64)
        for key, value in (("s", res.s), ("q", res.q), ("radius", res.radius), ("iterations", res.iterations),
                           ("evaluations", res.evaluations), ("converged", res.converged),
                           ("unsafe", res.unsafe_distance), ("linf", linf), ("applicable", res.applicable)):
            parts[key].append(value)
        if cert is not None:
            parts["certified"].append(cert)
        if worst:
            kept = _keep_worst(kept, res, cert, xin, linf, done, worst)
        done += int(x.shape[0])
        progress.tick(done, total, "inputs")
    if done == 0:
        raise DataError("min_safe_radius: the data set is empty. Fix: give at least one input.")
    cat = {k: torch.cat(v).cpu() for k, v in parts.items() if v}
    applicable = cat["applicable"]
    if not bool(applicable.any()):
        raise MetricError(f"min_safe_radius: the expression {expression!r} applies to no input: every input's top "
                          f"class is the other class (label={label!r}). Fix: pick another label, or use "
                          f"expression='top_vs_runner_up'.")
    value = _quantile(cat["radius"], float(quantile))
    cert_all = cat.get("certified") if bounded is not None else None
    listed, points = _worst_list(kept, norm, cert_all is not None)
    return SafetyQuantification(
        value=value, quantile=float(quantile), n=done, s=cat["s"], q=cat["q"], radius=cat["radius"],
        iterations=cat["iterations"], evaluations=cat["evaluations"], converged=cat["converged"],
        unsafe_distance=cat["unsafe"], linf_distance=cat["linf"], applicable=applicable, outputs=outputs_seen,
        settings=settings, worst=listed, worst_points=points, certified=cert_all,
        certified_method=certified if cert_all is not None else None,
        certified_reason=None if cert_all is not None else (reason or "not requested (certified=False)"))


def _keep_worst(kept: dict[str, Tensor] | None, res: LipschitzSearch, cert: Tensor | None, x: Tensor, linf: Tensor,
                offset: int, k: int) -> dict[str, Tensor]:
    """The running ``k`` inputs with the smallest estimates (ties by index), merged on the device."""
    n = res.s.shape[0]
    key = torch.where(res.applicable, res.radius, torch.full_like(res.radius, math.inf))
    batch = {"key": key, "index": torch.arange(offset, offset + n, device=key.device), "s": res.s, "q": res.q,
             "s_hat": res.s_hat, "iterations": res.iterations, "linf": linf,
             "dist": lp_norm((res.x_hat - x).flatten(1).to(torch.float64), res.settings["norm"]),
             "unsafe": res.unsafe_distance, "applicable": res.applicable,
             "certified": cert if cert is not None else torch.full_like(key, math.nan),
             "x": x, "x_hat": res.x_hat}
    if kept is not None:
        batch = {name: torch.cat([kept[name], value]) for name, value in batch.items()}
    order = torch.sort(batch["key"], stable=True).indices[:k]
    return {name: value[order] for name, value in batch.items()}


def _worst_list(kept: dict[str, Tensor] | None, norm: str,
                with_cert: bool) -> tuple[tuple[dict[str, Any], ...], tuple[tuple[Tensor, Tensor], ...]]:
    if kept is None:
        return (), ()
    rows = {k: v.cpu() for k, v in kept.items()}
    listed, points = [], []
    for i in range(rows["key"].shape[0]):
        if not bool(rows["applicable"][i]):
            continue
        entry: dict[str, Any] = {
            "index": int(rows["index"][i]), "s": float(rows["s"][i]), "q": float(rows["q"][i]),
            "estimate": float(rows["key"][i]), "s_hat": float(rows["s_hat"][i]),
            "linf_distance": float(rows["linf"][i]), f"{norm}_distance": float(rows["dist"][i]),
            "iterations": int(rows["iterations"][i]),
            "unsafe_distance": _num(float(rows["unsafe"][i])),
        }
        if with_cert:
            entry["certified"] = _num(float(rows["certified"][i]))
        x_hat = rows["x_hat"][i]
        if x_hat.numel() <= 4096:
            entry["x_hat"] = [round(float(v), 6) for v in x_hat.reshape(-1).tolist()]
        listed.append(entry)
        points.append((rows["x"][i], x_hat))
    return tuple(listed), tuple(points)
