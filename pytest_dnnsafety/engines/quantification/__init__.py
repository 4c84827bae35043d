"""DeepQuant: Lipschitzian safety quantification (Xu, Ruan, Huang et al., "Quantifying safety risks of deep neural
networks").

Modules: :mod:`.common` (checks, expressions, balls, draws), :mod:`.options` (the option records:
:class:`SafetyProperty`, :class:`SearchBudget`, :class:`Certification`, :class:`GatedRadius`),
:mod:`.gradients` (gradient-norm ascent, the PGD check), :mod:`.search` (the pattern search),
:mod:`.certified` (the certified radius), :mod:`.scale` (which search runs — the coordinate search, a batched
minimum-norm attack or the certificate alone — its query estimate and refusal), :mod:`.engine` (:class:`SafeRadiusEngine`, the per-input
states), :mod:`.dataset` (:func:`quantify_safety`). Every public name is importable from here.

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

**Gradient-norm seeds.** Before the pattern search, :func:`.gradients.gradient_ascent` climbs the
dual norm of the gradient ``‖∇s‖_q`` from ``ascent_starts`` points (``x`` and random points of the
ball; ``ascent_steps`` steps each). The Lipschitz constant ``L`` of ``s`` on ``B(x,d,p) ∩ clip``
is the supremum of ``‖∇s‖_q`` there and bounds ``Q`` from above (mean value theorem), so Theorem 1
holds with ``L``; every gradient norm and every centred ratio seen is a lower bound on ``L``. The
search reports ``q = max(q_ratio, q_gradient)``: it never reports less steepness than it has
seen. On an affine ``s`` the gradient is constant and ``q`` is the closed form ``‖w_1 − w_2‖_q``
from the first gradient, with ``clip`` too (the ball ∩ box has interior whenever ``d > 0``).

Every evaluated point counts (the incumbent is the best ratio seen), so ``q`` is a *lower bound*
on ``L``. The safe-radius **estimate** ``d' = clamp(s(x)/q, 0, d)`` (Theorem 1; ``d`` when
``q = 0``, 0 when ``s(x) < 0``) may therefore *overstate* the true safe radius: it is a heuristic,
a guarantee only if the optimisation were proven global, which no local search is. The search
also reports the nearest evaluated point with ``s < 0`` (``unsafe_distance``: an upper bound on
the true safe radius, in the search norm).

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
:class:`~pytest_dnnsafety.engines.core.guard.ForwardGuard` its one check at the end. The gradient-norm ascent
adds none; the PGD check of :func:`quantify_safety` one per batch (selecting the inputs with a
radius > 0).

**Certified companion** (:func:`certified_radius`): where
:class:`~pytest_dnnsafety.engines.bounds.model.BoundedModel` covers the model (logits out,
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

:func:`quantify_safety` runs both over a data set in batches, checks every input's estimate and
gated radius against the nearest adversarial example found (PGD on ``s`` with the gate's budget,
:func:`.gradients.pgd_nearest_unsafe`) and summarises the result for the ``min_safe_radius`` gate
(:class:`SafetyQuantification`): by default it gates the certified radius (``statistic="certified"``),
the estimate only when asked (``statistic="estimate"``). Pure torch; no pytest import.
"""

from __future__ import annotations

from pytest_dnnsafety.engines.quantification.certified import certified_radius
from pytest_dnnsafety.engines.quantification.common import (
    BOUND_METHODS, EXPRESSIONS, NORMS, SEARCHES, confidence_interval, lp_norm, project_ball, project_l1_ball,
    reachability, safety_values, uncertainty,
)
from pytest_dnnsafety.engines.quantification.dataset import SafetyQuantification, quantify_safety
from pytest_dnnsafety.engines.quantification.engine import SafeRadiusEngine
from pytest_dnnsafety.engines.quantification.gradients import dual_norm, gradient_ascent, pgd_nearest_unsafe
from pytest_dnnsafety.engines.quantification.options import (
    SEARCH_MODES, STATISTICS, Certification, GatedRadius, SafetyProperty, SearchBudget, SearchPlan,
)
from pytest_dnnsafety.engines.quantification.scale import (
    COORDINATE_MAX_DIMS, estimate_queries, gradient_search, plan_search, resolve_search,
)
from pytest_dnnsafety.engines.quantification.search import LipschitzSearch, lipschitz_search

__all__ = [
    "EXPRESSIONS", "NORMS", "SEARCHES", "BOUND_METHODS", "STATISTICS",
    "safety_values", "confidence_interval", "uncertainty", "reachability",
    "project_ball", "project_l1_ball", "lp_norm", "dual_norm",
    "LipschitzSearch", "lipschitz_search", "gradient_ascent", "pgd_nearest_unsafe", "certified_radius",
    "SafetyQuantification", "quantify_safety", "SafeRadiusEngine",
    "SafetyProperty", "SearchBudget", "Certification", "GatedRadius", "SearchPlan", "SEARCH_MODES",
    "COORDINATE_MAX_DIMS", "estimate_queries", "plan_search", "resolve_search", "gradient_search",
]
