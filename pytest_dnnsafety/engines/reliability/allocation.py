"""Sound adaptive allocation of the Monte Carlo queries (``allocation="adaptive"``; beyond the paper).

Part of :mod:`pytest_dnnsafety.engines.reliability`. The paper (Zhao et al. 2021, eqs. 13–14)
samples every cell ``n`` times. The default bound (``"chernoff"``,
:func:`~pytest_dnnsafety.stats.intervals.chernoff_upper`) is driven by the largest weight
``w* = max_i Op_i/n_i``: all failure mass may sit on the heaviest-weight cell, so one Chernoff
bound over all cells gains nothing from sampling some cells more finely than the coarsest one —
proportional allocation (equal weights) is already optimal for it, and saves only
``mean(Op)/max(Op)`` of the queries of a uniform allocation.

What does gain is a **stratified** bound (:func:`~pytest_dnnsafety.stats.intervals.stratified_chernoff_upper`):

1. *Pilot.* ``n₀`` samples in every sampled cell, from their own block-seed stream; then a label
   round: empty cells whose pilot samples disagree (the decision boundary crosses them) get
   ``max(32, 16·n₀)`` more (within the budget) from a third stream, so that their label — the
   vote, Assumption 5 — is the model's majority and not a coin toss of a few samples (a wrong
   label inflates the estimate by ``Op_i·|1 − 2p_i|``).
2. *Strata from the pilot only*: cells whose pilot saw a failure (the decision boundary, little
   mass) and the others (failure-free so far, most of the mass).
3. *Weights.* Stratum ``g`` gets one weight ``w_g``; cell ``i`` gets ``n_i = max(1, ⌈a_i/w_g⌉)``
   samples, ``a_i`` the cell's largest mass over the bootstrap replicates (so every replicate's
   weight ``Op_{b,i}/n_i`` is at most ``w_g`` — a tiny-mass cell cannot inflate ``w*``). The
   ``w_g`` minimise the bound predicted from the pilot, ``Σ_g w_g · μ_{α/G}(Ê_g/w_g)``
   (:func:`~pytest_dnnsafety.stats.intervals.poisson_chernoff_mu`, ``Ê_g`` the pilot's failure mass of
   the stratum, half a failure for the failure-free one), under the remaining query budget — or
   give the fewest queries whose predicted ``Ub − E`` is at most ``target_width``. Failure-free
   strata cost about ``w_g · ln(G/α)`` each, so they take few samples; the boundary stratum, small
   in mass, gets fine weights cheaply. A search over 160 log-spaced weights per stratum (exact
   query counts ``Σ⌈a_i/w⌉``) and all pairs.
4. *Final stage*: fresh samples ``n_i`` per cell from a second, independent block-seed stream;
   the bound is the stratified Chernoff bound of the final counts only (at ``α_λ/G`` per stratum).

**Soundness.** The strata, the ``n_i`` and (with ``empty_cell_label="model"``) the labels of empty
cells are functions of the pilot samples (and the seed) only. The final samples are drawn from
generators seeded independently of the pilot's, so conditional on the pilot the final counts are
independent ``K_i ~ Bin(n_i, λ_i)`` with ``λ_i`` the failure probability against the fixed label.
The stratified Chernoff bound holds with probability ``≥ 1 − α_λ`` for *every* ``λ`` vector and
every choice of strata and ``n_i`` fixed in advance, hence conditionally on any pilot outcome,
hence unconditionally. Nothing is re-tested sequentially: ``target_width`` only chooses the plan
from the pilot's *prediction*; whether the final width met it is reported, never acted on.

The labels of empty cells are the pilot's majority vote (Assumption 5 applied to the pilot): were
they voted on the final samples, a cell sampled once could never fail. For "any
misclassification", ``λ_i`` against any label is at least ``λ_i`` against the majority label, so
the bound also covers the pmi under the majority-vote labels of the uniform allocation.

**Sharding.** The pilot is cheap and deterministic: every rank runs it in full and derives the
same plan without communication; only the final stage's blocks are split by
``rank``/``world_size`` (merging the engines equals one process). ``queries_pilot`` counts one
pilot per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.stats import intervals as stats
from pytest_dnnsafety.errors import ConfigError

#: Candidate weights per stratum in the search of :func:`plan_adaptive`.
CANDIDATES = 160

#: The default cap on one assessment's Monte Carlo queries (``max_queries``; the pytest setting
#: ``dnnsafety_max_queries``). 10⁹ is where the cost warning already starts: minutes for a small
#: model on a GPU, hours on a CPU. A plan above it is refused before it is sampled.
DEFAULT_MAX_QUERIES = 10**9

#: The model's query rate assumed for a refused plan's time estimate when none was measured.
ASSUMED_QUERY_RATE = 5e6

#: Stratum ids.
CLEAN, FAILING = 0, 1

_CHUNK = 1 << 22


@dataclass(frozen=True)
class AdaptivePlan:
    """The final-stage plan chosen from the pilot (see the module docstring)."""

    strata: Tensor  # (n_s,) int64, CLEAN / FAILING
    trials: Tensor  # (n_s,) int64, final-stage samples per cell
    predicted_ub: float  # the pilot's prediction of the λ-part of the bound (no cross mass)
    predicted_e: float
    target_reached: bool | None  # None: no target_width given
    groups: list[dict[str, Any]] = field(default_factory=list)

    @property
    def queries(self) -> int:
        return int(self.trials.sum())


class QueryCapError(ConfigError):
    """A plan asks for more Monte Carlo queries than ``max_queries``: refused before it is sampled."""

    def __init__(self, head: str, tail: str, fix: str, source: str | None = None) -> None:
        where = f" (from {source})" if source else ""
        super().__init__(f"{head}{where}{tail}. Fix: {fix}.")
        self.head, self.tail, self.fix = head, tail, fix

    def with_source(self, source: str) -> "QueryCapError":
        """The same error, naming where the cap was set (e.g. ``"default"``, ``"ini option ..."``)."""
        return QueryCapError(self.head, self.tail, self.fix, source)


def _duration(seconds: float) -> str:
    for unit, size in (("years", 365.25 * 86400), ("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:,.1f} {unit}"
    return f"{seconds:.1f} s"


def check_query_cap(planned: int, cap: int | None, what: str, fix: str, *, rate: float | None = None) -> None:
    """Raise a :class:`QueryCapError` when ``planned`` queries exceed ``cap`` (``None``: no cap).

    ``what`` names the plan, ``fix`` its own remedy (raising the cap is always added); ``rate``
    (queries per second, e.g. measured on the pilot) gives the time estimate, else
    :data:`ASSUMED_QUERY_RATE`.
    """
    if cap is None or planned <= cap:
        return
    measured = rate is not None and math.isfinite(rate) and rate > 0
    qps = float(rate) if measured else ASSUMED_QUERY_RATE  # type: ignore[arg-type]
    raise QueryCapError(
        f"{what} plans {planned:,} model queries ({planned:.2g}), more than max_queries={cap:,}",
        f": at {qps:.3g} queries/s ({'measured on the pilot' if measured else 'assumed'}) that is about "
        f"{_duration(planned / qps)}. Refused before sampling them",
        f"{fix}; or raise the cap (max_queries=..., in pytest the marker keyword max_queries or the setting "
        f"dnnsafety_max_queries / --dnnsafety-max-queries / DNNSAFETY_MAX_QUERIES)")


def _queries(a: Tensor, w: Tensor) -> Tensor:
    """``Σ_i max(1, ⌈a_i / w_c⌉)`` for every candidate weight ``w_c`` (exact integer counts, cells in chunks)."""
    out = torch.zeros(w.numel(), dtype=torch.float64)
    step = max(1, _CHUNK // max(1, w.numel()))
    for s in range(0, a.numel(), step):
        out += torch.ceil(a[s : s + step][None, :] / w[:, None]).clamp_min(1.0).sum(1)
    return out


def _candidates(a: Tensor, cap: float) -> Tensor:
    """Log-spaced weights from ``max a`` (one sample per cell) down to ``Σa / cap`` (``cap`` queries)."""
    hi = float(a.max()) if a.numel() else 0.0
    if hi <= 0.0:
        return torch.tensor([1.0], dtype=torch.float64)
    lo = min(hi, float(a.sum()) / max(cap, 1.0))
    return torch.logspace(math.log10(lo), math.log10(hi), CANDIDATES, dtype=torch.float64)


def plan_adaptive(alloc_mass: Tensor, op: Tensor, pilot_fails: Tensor, pilot_trials: Tensor, *,
                  budget: int | None, target_width: float | None, confidence: float) -> AdaptivePlan:
    """Strata and final-stage samples from the pilot (module docstring, steps 2–3).

    Args:
        alloc_mass: ``a_i`` — each sampled cell's largest OP mass over the bootstrap replicates.
        op: ``Op_i`` — the point masses (for the predicted estimate).
        pilot_fails, pilot_trials: the pilot's failures and samples per cell.
        budget: final-stage queries available (``None``: no cap; then ``target_width`` is needed).
        target_width: the predicted ``Ub − E`` to reach with the fewest queries (``None``: the
            smallest predicted bound within ``budget``).
        confidence: ``1 − α_λ`` of the λ part of the bound.
    """
    a = alloc_mass.to(torch.float64).clamp_min(0.0)
    o = op.to(torch.float64)
    k0, n0 = pilot_fails.to(torch.float64), pilot_trials.to(torch.float64).clamp_min(1.0)
    strata = torch.where(pilot_fails > 0, FAILING, CLEAN).to(torch.int64)
    live = [g for g in (CLEAN, FAILING) if bool((strata == g).any()) and float(a[strata == g].sum()) > 0]
    if not live:  # no mass anywhere: one sample per cell
        trials = torch.ones_like(strata)
        return AdaptivePlan(strata, trials, 0.0, 0.0, None if target_width is None else True)
    n_groups = len(live)
    conf_g = 1.0 - (1.0 - confidence) / n_groups
    cap = float(budget) if budget is not None else 1e12
    cands, queries, bounds, est = [], [], [], []
    for g in live:
        sel = strata == g
        a_g, o_g = a[sel], o[sel]
        if g == FAILING:
            e_g = float((o_g * k0[sel] / n0[sel]).sum())
        else:  # no pilot failure: half a failure over the stratum's pilot samples
            e_g = float(o_g.sum()) * 0.5 / float(n0[sel].sum())
        w = _candidates(a_g, cap)
        m_g = float(a_g.sum())
        b = torch.tensor([min(m_g, float(wc) * stats.poisson_chernoff_mu(e_g / float(wc), conf_g)) for wc in w],
                         dtype=torch.float64)
        cands.append(w)
        queries.append(_queries(a_g, w))
        bounds.append(b)
        est.append(e_g)
    e_pred = sum(est)
    # every combination of one candidate per stratum (G ≤ 2: at most 160² pairs)
    tot_q = queries[0]
    tot_b = bounds[0]
    for q, b in zip(queries[1:], bounds[1:]):
        tot_q = (tot_q[:, None] + q[None, :]).reshape(-1)
        tot_b = (tot_b[:, None] + b[None, :]).reshape(-1)
    fits = tot_q <= cap if budget is not None else torch.ones_like(tot_q, dtype=torch.bool)
    reached: bool | None = None
    choice = -1
    if target_width is not None:
        ok = fits & (tot_b - e_pred <= target_width)
        reached = bool(ok.any())
        if reached:
            choice = int(torch.where(ok, tot_q, torch.full_like(tot_q, math.inf)).argmin())
    if choice < 0:
        if bool(fits.any()):
            choice = int(torch.where(fits, tot_b, torch.full_like(tot_b, math.inf)).argmin())
        else:  # nothing fits (checked by the caller): the coarsest plan
            choice = int(tot_q.argmin())
    # unravel the choice into one candidate per stratum
    picks = []
    rem = choice
    for w in reversed(cands):
        picks.append(rem % w.numel())
        rem //= w.numel()
    picks.reverse()
    trials = torch.ones_like(strata)
    groups = []
    pred_ub = 0.0
    for g, w, q, b, e_g, p in zip(live, cands, queries, bounds, est, picks):
        sel = strata == g
        wg = float(w[p])
        trials[sel] = torch.ceil(a[sel] / wg).clamp_min(1.0).to(torch.int64)
        pred_ub += float(b[p])
        groups.append({"stratum": "failing" if g == FAILING else "clean", "cells": int(sel.sum()),
                       "mass": float(o[sel].sum()), "weight": wg, "queries": int(trials[sel].sum()),
                       "pilot_failures": int(pilot_fails[sel].sum()), "predicted_E": e_g,
                       "predicted_ub": float(b[p])})
    return AdaptivePlan(strata, trials, pred_ub, e_pred, reached, groups)
