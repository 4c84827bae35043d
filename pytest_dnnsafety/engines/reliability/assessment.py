"""The reliability assessor: settings, planning, aggregation into bounds and the labelled-data checks.

Part of :mod:`pytest_dnnsafety.engines.reliability`. :class:`ReliabilityAssessor` combines the
planning (:mod:`~pytest_dnnsafety.engines.reliability.planning`) and the Monte Carlo
(:mod:`~pytest_dnnsafety.engines.reliability.sampler`) and the aggregation into bounds
(:mod:`~pytest_dnnsafety.engines.reliability.aggregation`); the labelled-data checks are here.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.stats import intervals as stats
from pytest_dnnsafety.engines.reliability.aggregation import BoundAggregator
from pytest_dnnsafety.engines.reliability.cells import (
    CROSS,
    EMPTY,
    MAX_GRID_CELLS,
    MAX_SCAN_CELLS,
    NORMAL,
    NORMS,
    Grid,
    ReliabilityWarning,
    _float_tuple,
    r_separation,
)
from pytest_dnnsafety.engines.reliability.planning import (
    CellPlanner,
    _labels_tensor,
    _raw_tensor,
)
from pytest_dnnsafety.engines.reliability.result import (
    CellTable,
    MethodBound,
    ReliabilityResult,
)
from pytest_dnnsafety.engines.reliability.sampler import MonteCarloSampler
from pytest_dnnsafety.engines.reliability.latent import KDE_MAX_DIM, OperationalInputs, high_dimensional_error
from pytest_dnnsafety.engines.reliability.streamed import RowSource, StreamedBalls, is_streamed
from pytest_dnnsafety.engines.reliability.tally import CellTallyEngine
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.engines.reliability.options import ReliabilityOptions
from pytest_dnnsafety.engines.reliability.profile import OperationalProfile


def _check_kde_dim(profile: Any) -> None:
    """Grid cells fit a KDE in the profile's space: refuse raw inputs above :data:`KDE_MAX_DIM` values (naming
    ``cells="balls"`` and ``latent=``) before anything of their size is allocated."""
    if isinstance(profile, OperationalProfile):
        dim = 0 if profile.latent else profile.dim
    elif isinstance(profile, OperationalInputs):
        first = next(iter(profile.batches()), None)
        dim = 0 if first is None else int(first[0].numel())
    elif isinstance(profile, torch.utils.data.DataLoader):
        raise ConfigError("max_pmi_ub: grid cells fit a KDE on the operational data, which a DataLoader does not "
                          "hold. Fix: cells='balls' (streamed), or latent=<int> for a KDE in a PCA latent space")
    else:
        shape = getattr(profile, "shape", None)
        dim = math.prod(shape[1:]) if shape is not None and len(shape) > 1 else 0
    if dim > KDE_MAX_DIM:
        raise high_dimensional_error(dim, "the operational profile")


class ReliabilityAssessor(CellPlanner, StreamedBalls, MonteCarloSampler, BoundAggregator):
    """Plans, samples and aggregates one reliability assessment (the steps of :func:`assess_reliability`).

    Construction does the model-independent work: the grid (or, with ``cells="balls"``, the
    balls around the operational inputs), ``r̂``, the OP masses and their bootstrap, the cell
    selection and types. Then :meth:`sample` runs the model (possibly a
    share of the blocks per worker: ``rank``/``world_size``) into a :class:`CellTallyEngine`,
    and :meth:`finish` turns the (merged) engine into a :class:`ReliabilityResult`.
    :meth:`assess` does both. ``options``: the assessment's option records
    (:class:`~pytest_dnnsafety.engines.reliability.options.ReliabilityOptions`; None: the defaults),
    documented at :func:`assess_reliability`.
    """

    def __init__(self, profile: OperationalProfile | Any, labelled: tuple[Any, Any] | None = None,
                 options: ReliabilityOptions | None = None) -> None:
        started = time.perf_counter()
        options = ReliabilityOptions() if options is None else options
        cell, masses, plan, bound, labels = options.cells, options.masses, options.plan, options.bound, options.labels
        self.empty_cell_label = labels.empty_cell_label
        self.labelled_from_profile = labels.labelled_from_profile
        self.accept_violated_assumptions = labels.accept_violated_assumptions
        self.num_classes = labels.num_classes
        self.failure_pairs = labels.failures
        self._x_lab_raw: Tensor | None = None
        self._lab_source: Any = None  # streamed labelled data (cells="balls" from a DataLoader)
        self._lab_pred = None
        self.labelled_queries = 0
        self.confidence, self.method, self.compare_methods = bound.confidence, bound.method, bound.compare_methods
        self.alpha_op_share, self.posterior_draws = bound.alpha_op_share, bound.posterior_draws
        self.samples_per_cell, self.allocation = plan.samples_per_cell, plan.allocation
        self.query_budget, self.target_width = plan.query_budget, plan.target_width
        self.pilot_samples, self.pilot_fraction = plan.pilot_samples, plan.pilot_fraction
        self.max_queries, self.batch_size, self.input_dtype = plan.max_queries, plan.batch_size, plan.input_dtype
        self.bootstrap, self.mass, self.bootstrap_size = masses.bootstrap, masses.mass, masses.bootstrap_size
        self.normalize, self.mass_target, self.max_cells = masses.normalize, masses.mass_target, masses.max_cells
        self.conservative_rest = masses.conservative_rest
        self.seed = options.seed
        self.cell_kind, self.norm = cell.cells, cell.norm
        self.clip: tuple[float, float] | None = None
        self.radius: float | None = None
        eps, eps_fraction, box, device = cell.eps, cell.eps_fraction, cell.box, options.device
        bandwidth = masses.bandwidth
        if self.cell_kind == "balls":
            self._init_balls(profile, labelled, radius=cell.radius, eps=eps, eps_fraction=eps_fraction, box=box,
                             bandwidth=bandwidth, max_balls=cell.max_balls, clip=cell.clip, device=device)
            self.plan_seconds = time.perf_counter() - started
            return

        # ---------------------------------------------------------------- profile
        _check_kde_dim(profile)
        if not isinstance(profile, OperationalProfile):
            profile = OperationalProfile(profile, "scott" if bandwidth is None else bandwidth, device=device)
        elif bandwidth is not None:
            profile = profile.with_bandwidth(bandwidth)
        self.profile = profile
        self.device = profile.device if device is None else torch.device(device)

        # ---------------------------------------------------------------- labelled points, r̂
        if labelled is not None and is_streamed(labelled):  # a latent profile: encoded a batch at a time
            lab = RowSource(labelled, "labelled data", profile.device, labelled=True)
            lab.scan()
            assert lab.labels is not None
            z_lab = torch.cat([profile.encode(raw) for _, _, raw in lab.batches()])
            y_lab = lab.labels
            self._lab_source = lab
            self.r_hat = r_separation(z_lab, y_lab)
        elif labelled is not None:
            if not isinstance(labelled, (tuple, list)) or len(labelled) != 2:
                raise DataError("labelled must be a pair (inputs, labels)")
            self._x_lab_raw = _raw_tensor(labelled[0])
            z_lab = profile.encode(labelled[0])
            y_lab = _labels_tensor(labelled[1], z_lab.shape[0], profile.device)
            self.r_hat = r_separation(z_lab, y_lab)
        else:
            z_lab, y_lab = None, None
            self.r_hat = float("nan")
        self._z_lab, self._y_lab = z_lab, y_lab

        # ---------------------------------------------------------------- box and grid
        if box is None or isinstance(box, str):
            # the data's range: the bounding box of the operational and the labelled points; "padded"
            # widens it by three kernel standard deviations per side (the KDE's tails)
            if box not in (None, "padded"):
                raise ConfigError(f"box must be (lower corner, upper corner), None (the data's range) or 'padded' "
                                  f"(the data's range ± 3 bandwidths), got {box!r}")
            pts = profile.points if z_lab is None else torch.cat([profile.points, z_lab])
            low, high = pts.min(0).values, pts.max(0).values
            if box == "padded":
                pad = 3.0 * (profile.bandwidth if profile.bandwidth is not None
                             else profile.covariance.diagonal().sqrt())
                low, high = low - pad, high + pad
            lower, upper = low.tolist(), high.tolist()
            self.box_rule = "data range" if box is None else "data range ± 3 bandwidths"
        else:
            self.box_rule = "given"
            if not isinstance(box, (tuple, list)) or len(box) != 2:
                raise ConfigError("box must be a pair (lower corner, upper corner)")
            lower = _float_tuple(box[0], profile.dim, "box lower corner")
            upper = _float_tuple(box[1], profile.dim, "box upper corner")
        if isinstance(eps, str):
            if eps != "auto":
                raise ConfigError(f"eps must be a positive number, one per dimension, or 'auto', got {eps!r}")
            if not math.isfinite(self.r_hat):
                raise ConfigError(
                    "eps='auto' takes a fraction of r̂, which needs labelled points of at least two classes; "
                    "Fix: pass labelled=(x, y) or give eps"
                )
            if isinstance(eps_fraction, bool) or not isinstance(eps_fraction, (int, float)) or eps_fraction <= 0:
                raise ConfigError(f"eps_fraction must be a positive number, got {eps_fraction!r}")
            target = float(eps_fraction) * self.r_hat
            if target <= 0:
                raise ConfigError("r̂ is 0: two labelled points of different classes coincide; give eps")
            eps = [(hi - lo) / (math.floor((hi - lo) / target) + 1) for lo, hi in zip(lower, upper)]
        self.grid = Grid.build(lower, upper, _float_tuple(eps, profile.dim, "eps"))
        self.eps_exceeds_r = bool(math.isfinite(self.r_hat) and max(self.grid.eps) >= self.r_hat)
        if self.eps_exceeds_r:
            warnings.warn(
                f"cell side eps={max(self.grid.eps):.6g} ≥ r̂={self.r_hat:.6g}: cells may contain inputs of different "
                f"ground-truth classes (Assumption 4). Use eps='auto' or a smaller eps",
                ReliabilityWarning,
                stacklevel=2,
            )
        if self.grid.n_cells > MAX_SCAN_CELLS:
            raise ConfigError(
                f"the grid has {self.grid.n_cells:.3g} cells (shape {self.grid.shape}); ranking them by OP mass means "
                f"scanning them all, and more than {MAX_SCAN_CELLS:.3g} is out of reach. Fix: a larger eps, a smaller "
                f"box, or fewer latent dimensions"
            )
        if self.grid.n_cells > MAX_GRID_CELLS and self.max_cells is None:
            raise ConfigError(
                f"the grid has {self.grid.n_cells:,} cells (shape {self.grid.shape}), more than {MAX_GRID_CELLS:,} "
                f"can be ranked at once. Fix: give max_cells (a budget of top-OP cells), a larger eps or a smaller box"
            )

        self._warn_cost()
        self._plan()
        self.plan_seconds = time.perf_counter() - started

    # ------------------------------------------------------------------ aggregation
    def _failure_matrix(self, k: int) -> Tensor:
        if self.failure_pairs is None:
            return ~torch.eye(k, dtype=torch.bool)
        fm = torch.zeros(k, k, dtype=torch.bool)
        for true, pred in self.failure_pairs:
            fm[true, pred] = True
        return fm

    def finish(self, engine: CellTallyEngine | None, *, model_queries: int | None = None,
               seconds: float | None = None) -> ReliabilityResult:
        """Aggregate the (merged) engine into a :class:`ReliabilityResult` by :attr:`method` (and the comparisons)."""
        started = time.perf_counter()
        n_s = self.n_sampled_cells
        count = int(self._flat.shape[0])
        sampled = self._sampled.cpu()
        types = self._types.cpu()
        labels = self._labels.cpu().clone()
        failures_all = torch.zeros(count, dtype=torch.int64)
        trials_all = torch.zeros(count, dtype=torch.int64)
        if n_s:
            if engine is None:
                raise ConfigError("finish() needs the engine filled by sample()")
            counts = engine.compute().cpu()
            trials = counts.sum(1)
            if not torch.equal(trials, self._trials):
                short = int(torch.nonzero(trials != self._trials)[0, 0])
                raise MetricError(
                    f"sampled cell {short} has {int(trials[short])} samples, the plan gives "
                    f"{int(self._trials[short])}; merge the engines of every rank (and run each block once) before finish()"
                )
            k = counts.shape[1]
            fm = self._failure_matrix(k)
            cell_labels = labels[sampled]
            voted = counts.argmax(1)
            cell_labels = torch.where(cell_labels < 0, voted, cell_labels)
            labels[sampled] = cell_labels
            fails = (counts * fm[cell_labels].to(torch.int64)).sum(1)
            vote_fails = (counts * fm[voted].to(torch.int64)).sum(1)
            failures_all[sampled] = fails
            trials_all[sampled] = trials
        else:
            k = self.num_classes or 2
            fails = torch.zeros(0, dtype=torch.int64)
            trials = torch.zeros(0, dtype=torch.int64)
            voted = vote_fails = torch.zeros(0, dtype=torch.int64)

        op = self._op.cpu()
        op_var = self._op_var.cpu()
        reps = None if self._reps is None else self._reps.cpu()
        rest = self.rest if self.conservative_rest else 0.0
        rest_reps = None if self._rest_reps is None else self._rest_reps.cpu()
        cross = types == CROSS
        methods = (self.method, *self.compare_methods)
        bounds = {m: self._bound(m, op, op_var, reps, rest, rest_reps, cross, sampled, fails, trials)
                  for m in methods}
        main = bounds[self.method]
        checks = self._labelled_checks(main, op, types, sampled, fails, vote_fails, voted, trials, k)
        lam_hat = torch.where(cross, torch.ones(count, dtype=torch.float64),
                              failures_all.to(torch.float64) / trials_all.clamp_min(1).to(torch.float64))
        if self.cell_kind == "balls":
            assert self.radius is not None
            if self._centres is None:  # streamed centres: no corners (the flat index names the input)
                lo = hi = torch.empty(count, 0, dtype=torch.float64)
            else:
                centres = self._centres.cpu()
                lo, hi = centres - self.radius, centres + self.radius
                if self.clip is not None:
                    lo, hi = lo.clamp_min(self.clip[0]), hi.clamp_max(self.clip[1])
        else:
            lo, hi = self.grid.bounds(self._flat.cpu())
        table = CellTable(flat=self._flat.cpu(), lower=lo, upper=hi, op=op, op_var=op_var, cell_type=types,
                          label=labels, failures=failures_all, trials=trials_all)
        queries = getattr(self, "queries", 0) if model_queries is None else int(model_queries)
        elapsed = seconds if seconds is not None else self.plan_seconds + (time.perf_counter() - started)
        balls = self.cell_kind == "balls"
        if balls:
            assert self.radius is not None
            bw, eps, shape, total = None, (self.radius,), (), self.n_operational
        else:
            bw = None if self.profile.bandwidth is None else tuple(float(v) for v in self.profile.bandwidth)
            eps, shape, total = self.grid.eps, self.grid.shape, self.grid.n_cells
        return ReliabilityResult(
            E=main.E, Var=main.Var, Ub=main.Ub, confidence=self.confidence, method=self.method,
            r_hat=self.r_hat, eps=eps, eps_exceeds_r=self.eps_exceeds_r, grid_shape=shape,
            cells_total=total, cells_evaluated=count,
            cells_normal=int((types == NORMAL).sum()), cells_empty=int((types == EMPTY).sum()),
            cells_cross=int(cross.sum()), mass_evaluated=self.mass_evaluated,
            mass_rest=max(0.0, 1.0 - self.mass_evaluated), conservative_rest=self.conservative_rest,
            mass_method="empirical" if balls else self.mass, bootstrap=self.bootstrap, bandwidth=bw,
            samples_per_cell=self.samples_per_cell, allocation=self.allocation,
            acu=float(lam_hat.mean()) if count else float("nan"), model_queries=queries, seconds=float(elapsed),
            failure_set=self.failure_pairs, latent=False if balls else self.profile.latent,
            labelled_outside_box=self.labelled_outside_box,
            alternatives={m: b for m, b in bounds.items() if m != self.method}, cells=table,
            cell_kind=self.cell_kind, norm=self.norm if balls else None, clip=self.clip,
            empty_cell_label=self.empty_cell_label, labelled_from_profile=self.labelled_from_profile,
            labelled_queries=self.labelled_queries, queries_pilot=self.queries_pilot,
            queries_final=queries - self.queries_pilot, allocation_plan=self.allocation_plan,
            box=None if balls else (tuple(self.grid.lower), tuple(self.grid.upper)),
            box_rule=None if balls else self.box_rule, bootstrap_size=self.bootstrap_size, **checks,
        )

    # ------------------------------------------------------------------ does the evidence hold together?
    def _violations(self, n_cross: int) -> list[str]:
        """The method's assumptions that the plan itself shows to be violated (each a sentence with numbers)."""
        balls = self.cell_kind == "balls"
        what = "ball" if balls else "cell"
        found = []
        if self.eps_exceeds_r:
            size = (f"ball radius {self.radius:.4g} ({NORMS[self.norm]})" if balls
                    else f"cell side ε = {max(self.grid.eps):.4g}")
            cross = (f"; {n_cross:,} {what}s hold labelled points of different classes (counted with λ = 1)"
                     if n_cross else "")
            found.append(
                f"{size} ≥ r̂ = {self.r_hat:.4g}: a {what} can hold inputs of two ground-truth classes, so "
                f"robustness within it does not mean correctness (Assumption 4, Remark 2){cross}. Fix: "
                f"{'radius' if balls else 'eps'}='auto' or a value below r̂"
            )
        elif n_cross:
            found.append(f"{n_cross:,} {what}s hold labelled points of different classes (Assumption 4; counted "
                         f"with λ = 1)")
        if not balls and self.labelled_outside_box:
            n_lab = int(self._y_lab.numel()) if self._y_lab is not None else 0
            found.append(
                f"{self.labelled_outside_box:,} of {n_lab:,} labelled points lie outside the box "
                f"{list(self.grid.lower)}–{list(self.grid.upper)}: the assessed domain misses part of the data "
                f"and no cell is checked against them. Fix: a box that covers the data (box=None takes their range)"
            )
        return found

    def _labelled_checks(self, main: MethodBound, op: Tensor, types: Tensor, sampled: Tensor, fails: Tensor,
                         vote_fails: Tensor, voted: Tensor, trials: Tensor, k: int) -> dict[str, Any]:
        """Hold the bound against the labelled data and list violated assumptions (see :func:`assess_reliability`).

        (a) The model's error on the labelled points — by default a sample of the operational
        profile — has an exact lower confidence bound (:func:`stats.labelled_error_check`); above
        ``Ub`` the two statements cannot both hold. (b) Assumption 5 tested where the ground truth is
        known: on the evaluated cells holding labelled points, the model's majority vote against
        their label; the OP-weighted amount by which the vote under-states the unastuteness there,
        carried over to the empty cells labelled by the vote, must not lift the estimate above ``Ub``.
        """
        balls = self.cell_kind == "balls"
        what = "balls" if balls else "cells"
        contradictions: list[str] = []
        n_cross = int((types == CROSS).sum())
        violations = self._violations(n_cross)
        empty = types == EMPTY
        empty_mass = float(op[empty].sum())
        n_empty = int(empty.sum())
        ub = main.Ub
        vote_words = (f"the labels of the {n_empty:,} empty {what} (OP mass {empty_mass:.3g}) came from the model's "
                      f"own majority vote (Assumption 5), which counts a region the model gets consistently wrong "
                      f"as correct")
        # ---- (a) the model's error on the labelled points
        labelled_check: dict[str, Any] | None = None
        if self._lab_pred is not None and self._y_lab is not None:
            y = self._y_lab.cpu()
            pred = self._lab_pred
            kk = max(k, int(y.max()) + 1, int(pred.max()) + 1 if pred.numel() else 0)
            fm = self._failure_matrix(kk)
            errors = int(fm[y, pred.clamp(0, kk - 1)].sum())
            check = stats.labelled_error_check(errors, int(y.numel()), ub, self.confidence)
            labelled_check = {**check.to_dict(), "applied": self.labelled_from_profile,
                              "labelled_from_profile": self.labelled_from_profile}
            if not self.labelled_from_profile:
                labelled_check["skipped"] = ("labelled_from_profile=False: the labelled points are not a sample of "
                                             "the operational profile, so their error rate does not bound the pmi")
            elif check.contradicts:
                cause = (vote_words if self.empty_cell_label == "model" and empty_mass > 0 else
                         "the assessment's premises fail for this model and data (cell labels, the cell size against "
                         "r̂, or the operational profile)")
                fix = ("Fix: empty_cell_label='nearest' (label empty cells from the nearest labelled point)"
                       if self.empty_cell_label == "model" and empty_mass > 0 else
                       "Fix: check the model and the assessment's settings")
                contradictions.append(
                    f"the model misclassifies {errors:,} of {check.n:,} labelled points (error {check.rate:.3g}, "
                    f"≥ {check.lower:.3g} at {self.confidence * 100:g}% by Clopper–Pearson) but the bound says "
                    f"pmi ≤ {ub:.3g}: {cause}. The labelled points are taken as a sample of the operational profile "
                    f"(if they are not, set labelled_from_profile=False). {fix}"
                )
        # ---- (b) Assumption 5 on the cells whose ground truth is known
        vote_check: dict[str, Any] | None = None
        normal_s = types[sampled] == NORMAL if sampled.numel() else torch.zeros(0, dtype=torch.bool)
        if bool(normal_s.any()):
            idx = sampled[normal_s]
            truth = self._labels.cpu()[idx]
            wrong = voted[normal_s] != truth
            t = trials[normal_s].clamp_min(1).to(torch.float64)
            gap = ((fails[normal_s] - vote_fails[normal_s]).to(torch.float64) / t).clamp_min(0.0)
            w = op[idx]
            normal_mass = float(w.sum())
            g = float((w * gap).sum()) / normal_mass if normal_mass > 0 else 0.0
            uses_vote = self.empty_cell_label == "model" and n_empty > 0
            implied = main.E + g * empty_mass if uses_vote else main.E
            vote_check = {
                "cells_with_labels": int(normal_s.sum()), "vote_disagrees": int(wrong.sum()),
                "mass_with_labels": normal_mass, "mass_vote_disagrees": float(w[wrong].sum()),
                "mean_understatement": g, "empty_mass_labelled_by_vote": empty_mass if uses_vote else 0.0,
                "implied_estimate": implied,
            }
            if uses_vote and int(wrong.sum()) and implied > ub:
                contradictions.append(
                    f"in {int(wrong.sum()):,} of {int(normal_s.sum()):,} evaluated {what} holding labelled points "
                    f"the model's majority vote disagrees with their label (OP mass {float(w[wrong].sum()):.3g} of "
                    f"{normal_mass:.3g}; the vote under-states their unastuteness by {g:.3g} on average). "
                    f"{vote_words[0].upper()}{vote_words[1:]}; if they behave like the labelled ones the estimate "
                    f"is about {implied:.3g}, above the bound {ub:.3g}. Fix: empty_cell_label='nearest'"
                )
        return {"violations": tuple(violations), "violations_accepted": self.accept_violated_assumptions,
                "contradictions": tuple(contradictions), "labelled_check": labelled_check, "vote_check": vote_check}

    def assess(self, model: Callable[[Tensor], Any]) -> ReliabilityResult:
        """:meth:`sample` then :meth:`finish` in this process; ``seconds`` covers planning too."""
        started = time.perf_counter()
        engine = self.sample(model)
        result = self.finish(engine, model_queries=self.queries)
        return replace(result, seconds=self.plan_seconds + time.perf_counter() - started)
