"""What a reliability assessment returns: :class:`ReliabilityResult`, :class:`MethodBound`, :class:`CellTable`.

Part of :mod:`pytest_dnnsafety.engines.reliability`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.reliability.cells import CROSS, EMPTY, NORMAL, NORMS

#: ``cells_plot`` (the details' per-cell scatter data, for plots) holds at most this many evaluated
#: cells, those of largest OP mass.
CELLS_PLOT_LIMIT = 2000

#: How ``cells_plot`` names the cell types (as the ``cells`` counts of the details do).
_PLOT_TYPES = {NORMAL: "normal", EMPTY: "empty", CROSS: "cross_boundary"}


@dataclass(frozen=True)
class MethodBound:
    """One aggregation method's ``E``, ``Var`` and ``Ub`` at ``confidence``."""

    method: str
    E: float
    Var: float
    Ub: float
    confidence: float

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "E": self.E, "Var": self.Var, "Ub": self.Ub, "confidence": self.confidence}


@dataclass(frozen=True, eq=False)
class CellTable:
    """Per evaluated cell (in descending OP order): grid index, corners, OP mass and variance, type, label, counts.

    ``failures``/``trials`` are 0 for cross-boundary cells (not sampled; ``λ_i = 1``).
    """

    flat: Tensor
    lower: Tensor
    upper: Tensor
    op: Tensor
    op_var: Tensor
    cell_type: Tensor
    label: Tensor
    failures: Tensor
    trials: Tensor

    @property
    def unastuteness(self) -> Tensor:
        """``λ̂_i`` (eq. 13), 1 for cross-boundary cells."""
        lam = self.failures.to(torch.float64) / self.trials.clamp_min(1).to(torch.float64)
        return torch.where(self.cell_type == CROSS, torch.ones_like(lam), lam)


def _num(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class ReliabilityResult:
    """What :func:`assess_reliability` returns: the pmi estimate, its bound and how it was obtained.

    ``E``, ``Var`` and ``Ub`` are the chosen ``method``'s: for ``"normal"``, ``"chernoff"`` and
    ``"clopper-pearson"`` ``E``/``Var`` are the point estimate and eq. (6)'s variance (the bound
    is the method's); for ``"jeffreys"`` the posterior mean and variance. ``alternatives`` holds
    the other methods asked for with ``compare_methods``. ``cells`` has the per-cell evidence.

    Ball cells (``cell_kind == "balls"``, :func:`assess_reliability` with ``cells="balls"``): the
    grid fields say so — ``grid_shape == ()``, ``eps == (radius,)``, ``cells_total`` is the number
    of operational inputs (one possible ball each), ``cells_evaluated`` the number of balls,
    ``mass_evaluated == 1`` (the balls carry the whole empirical profile), ``bandwidth`` is
    ``None`` (no KDE); ``norm`` (``"linf"``/``"l2"``) and ``clip`` describe the balls. The cell
    table's ``flat`` holds each ball's centre index into the operational data and
    ``lower``/``upper`` its bounding box (clipped; for L∞ balls the ball itself).
    """

    E: float
    Var: float
    Ub: float
    confidence: float
    method: str
    r_hat: float
    eps: tuple[float, ...]
    eps_exceeds_r: bool
    grid_shape: tuple[int, ...]
    cells_total: int
    cells_evaluated: int
    cells_normal: int
    cells_empty: int
    cells_cross: int
    mass_evaluated: float
    mass_rest: float
    conservative_rest: bool
    mass_method: str
    bootstrap: int
    bandwidth: tuple[float, ...] | None
    samples_per_cell: int
    allocation: str
    acu: float
    model_queries: int
    seconds: float
    failure_set: tuple[tuple[int, int], ...] | None = None
    latent: bool = False
    labelled_outside_box: int = 0
    alternatives: Mapping[str, MethodBound] = field(default_factory=dict)
    cell_kind: str = "grid"
    norm: str | None = None
    clip: tuple[float, float] | None = None
    empty_cell_label: str = "model"
    labelled_from_profile: bool = True
    labelled_queries: int = 0
    violations: tuple[str, ...] = ()
    violations_accepted: bool = False
    contradictions: tuple[str, ...] = ()
    labelled_check: Mapping[str, Any] | None = None
    vote_check: Mapping[str, Any] | None = None
    #: the gridded domain ``(lower corner, upper corner)`` in profile space (``None`` for ball cells)
    box: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    #: how the box was chosen: ``"given"``, ``"data range"`` (``box=None``) or
    #: ``"data range ± 3 bandwidths"`` (``box="padded"``); ``None`` for ball cells
    box_rule: str | None = None
    #: ``"full"`` (the standard bootstrap) or ``"half"`` (the paper's N/2-point KDE refits)
    bootstrap_size: str = "full"
    #: where :meth:`write_cells` last wrote the per-cell table (set by the gate's ``cells_file=``)
    cells_file: str | None = None
    #: Monte Carlo queries of the pilot stage (``allocation="adaptive"``; 0 otherwise) and of the final
    #: stage; ``queries_pilot + queries_final == model_queries``
    queries_pilot: int = 0
    queries_final: int = 0
    #: ``allocation="adaptive"``: the plan chosen from the pilot (pilot samples per cell, budget,
    #: target width and whether the prediction reached it, the strata with their cells, mass,
    #: weight ``w_g`` and final queries); ``None`` otherwise
    allocation_plan: Mapping[str, Any] | None = None
    cells: CellTable | None = field(default=None, repr=False, compare=False)

    @property
    def std(self) -> float:
        """``√Var`` (the paper's Table 1 column "V")."""
        return math.sqrt(max(self.Var, 0.0))

    @property
    def balls(self) -> bool:
        """Whether the cells are norm balls around operational inputs (``cells="balls"``)."""
        return self.cell_kind == "balls"

    def _ball_words(self) -> str:
        """E.g. ``"balls 270 (L∞ radius 0.05)"`` (with the population when subsampled, and the clip range)."""
        of = "" if self.cells_evaluated == self.cells_total else f" of {self.cells_total} operational inputs"
        clip = "" if self.clip is None else f", clipped to [{self.clip[0]:g}, {self.clip[1]:g}]"
        return (f"balls {self.cells_evaluated}{of} ({NORMS.get(self.norm or '', self.norm)} radius "
                f"{self.eps[0]:.6g}{clip})")

    def _box_words(self) -> str:
        """E.g. ``"[0, 0]–[1, 1] (the data's range)"``: the gridded domain and how it was chosen."""
        if self.box is None:
            return "n/a"
        corners = "–".join("[" + ", ".join(f"{v:.6g}" for v in c) + "]" for c in self.box)
        rule = {"given": "given", "data range": "the data's range"}.get(self.box_rule or "", self.box_rule)
        return f"{corners}{f' ({rule})' if rule else ''}"

    def write_cells(self, path: Any) -> Path:
        """Write the per-cell evidence (the :class:`CellTable`) to ``path`` for audit; returns the path.

        One row per evaluated cell, in descending OP mass: ``rank``, ``cell`` (the grid's flat
        index; for ball cells the centre's row in the operational data), ``type`` (normal, empty,
        cross_boundary), ``label`` (the cell's ground-truth or voted label), ``op`` (``Op_i`` as used,
        normalised), ``op_var`` (``V[Op_i]``), ``lambda_hat`` (``λ̂_i = k_i/n_i``, eq. 13; 1 for
        cross-boundary cells), ``failures`` (``k_i``), ``samples`` (``n_i``; 0 for cross-boundary
        cells) and the corners ``lower_0..``/``upper_0..`` (profile space; for balls the ball's
        clipped bounding box). ``Σ op · lambda_hat`` over the rows, plus ``mass_rest`` when
        ``conservative_rest`` (counted with λ = 1), is the estimate ``E`` of the point-estimate
        methods. A ``.jsonl`` suffix writes JSON lines, anything else CSV; parent folders are made.
        A symbolic link at ``path`` is not followed (OSError where the platform can tell).

        Raises:
            MetricError: the result holds no cell table (e.g. one rebuilt from a JSON report).
        """
        import csv
        import json

        from pytest_dnnsafety.errors import MetricError

        table = self.cells
        if table is None:
            raise MetricError("this result holds no per-cell table (only assess_reliability's own results do); "
                              "Fix: call write_cells on the result assess_reliability returned")
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        d = int(table.lower.shape[1]) if table.lower.ndim == 2 else 0
        head = ["rank", "cell", "type", "label", "op", "op_var", "lambda_hat", "failures", "samples",
                *(f"lower_{k}" for k in range(d)), *(f"upper_{k}" for k in range(d))]
        columns = [
            range(table.flat.shape[0]), table.flat.tolist(),
            [_PLOT_TYPES.get(t, str(t)) for t in table.cell_type.tolist()], table.label.tolist(),
            table.op.tolist(), table.op_var.tolist(), table.unastuteness.tolist(), table.failures.tolist(),
            table.trials.tolist(), *table.lower.T.tolist(), *table.upper.T.tolist(),
        ]
        rows = zip(*columns)
        import os

        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)  # never through a link
        with open(os.open(out, flags, 0o666), "w", newline="", encoding="utf-8") as fh:
            if out.suffix == ".jsonl":
                for row in rows:
                    fh.write(json.dumps(dict(zip(head, row))) + "\n")
            else:
                writer = csv.writer(fh)
                writer.writerow(head)
                writer.writerows(rows)
        return out

    @property
    def empty_label_words(self) -> str:
        """How empty cells got their labels, in words."""
        return ("the model's majority vote (Assumption 5)" if self.empty_cell_label == "model"
                else "the nearest labelled point")

    def checks_summary(self) -> list[str]:
        """Lines on the labelled-data checks, violated assumptions and contradictions (for :meth:`summary`)."""
        lines = [f"  empty {'balls' if self.balls else 'cells'} labelled by {self.empty_label_words}"]
        lc = self.labelled_check
        if lc is not None:
            state = ("checked" if lc.get("applied") else
                     "not checked (labelled_from_profile=False: not a sample of the profile)")
            lines.append(f"  labelled points: {lc['errors']:,} of {lc['n']:,} misclassified (error ≥ {lc['lower']:.4g} "
                         f"at {lc['confidence'] * 100:g}%), against Ub {lc['bound']:.4g}: {state}")
        vc = self.vote_check
        if vc is not None:
            lines.append(f"  Assumption 5 where labels are known: the model's vote disagrees in {vc['vote_disagrees']:,} "
                         f"of {vc['cells_with_labels']:,} labelled {'balls' if self.balls else 'cells'}")
        for v in self.violations:
            lines.append(f"  VIOLATED ASSUMPTION{' (accepted by the user)' if self.violations_accepted else ''}: {v}")
        for c in self.contradictions:
            lines.append(f"  CONTRADICTION: {c}")
        return lines

    def detail(self) -> str:
        """One line: the bound, r̂ and ε, cells by type, OP mass evaluated, queries and time."""
        r = "n/a" if not math.isfinite(self.r_hat) else f"{self.r_hat:.6g}"
        types = f"(normal {self.cells_normal}, empty {self.cells_empty}, cross {self.cells_cross})"
        if self.balls:
            warn = " (radius ≥ r̂!)" if self.eps_exceeds_r else ""
            return (
                f"pmi E={self.E:.4e} Ub{self.confidence * 100:g}%={self.Ub:.4e} [{self.method}]; "
                f"r̂={r}{warn}; {self._ball_words()} {types}, empirical OP 1/{self.cells_evaluated} each; "
                f"empty balls labelled by {self.empty_label_words}; "
                f"{self.model_queries:,} model queries in {self.seconds:.1f} s"
            )
        eps = f"{self.eps[0]:.6g}" if len(set(self.eps)) == 1 else "(" + ", ".join(f"{e:.4g}" for e in self.eps) + ")"
        warn = " (ε ≥ r̂!)" if self.eps_exceeds_r else ""
        return (
            f"pmi E={self.E:.4e} Ub{self.confidence * 100:g}%={self.Ub:.4e} [{self.method}]; "
            f"r̂={r} ε={eps}{warn}; cells {self.cells_evaluated}/{self.cells_total} "
            f"{types}; "
            f"OP mass evaluated {self.mass_evaluated:.4f}"
            f"{' (rest λ=1)' if self.conservative_rest else ' (rest at average pmi)'}; "
            f"empty cells labelled by {self.empty_label_words}; "
            f"{self.model_queries:,} model queries in {self.seconds:.1f} s"
        )

    def _allocation_summary(self) -> list[str]:
        """``allocation="adaptive"``: queries per stage and the strata (for :meth:`summary`)."""
        plan = self.allocation_plan
        if plan is None:
            return []
        target = ""
        if plan.get("target_width") is not None:
            target = (f"; target width {plan['target_width']:.3g} "
                      f"{'predicted reachable' if plan.get('target_reached') else 'NOT reachable by the prediction'}"
                      f", reached: {self.Ub - self.E <= plan['target_width']}")
        lines = [f"  adaptive: pilot {self.queries_pilot:,} queries ({plan['pilot_samples_per_cell']} per cell), "
                 f"final {self.queries_final:,}; predicted Ub {plan['predicted_ub']:.4g}{target}"]
        for g in plan.get("strata", []):
            lines.append(f"    stratum {g['stratum']}: {g['cells']:,} cells, OP mass {g['mass']:.4g}, weight "
                         f"{g['weight']:.3g}, {g['queries']:,} queries, {g['pilot_failures']:,} pilot failures")
        return lines

    def summary(self) -> str:
        """A multi-line report (the paper's Table 1 columns and the settings)."""
        lines = [
            f"reliability assessment ({self.method}, confidence {self.confidence:g})",
            f"  E[λ] = {self.E:.6g}   sd = {self.std:.6g}   Ub = {self.Ub:.6g}   ACU = {self.acu:.6g}",
        ]
        for name, alt in self.alternatives.items():
            lines.append(f"  {name:>16}: E = {alt.E:.6g}   Ub = {alt.Ub:.6g}")
        r = "n/a (fewer than two labelled classes)" if not math.isfinite(self.r_hat) else f"{self.r_hat:.6g}"
        if self.balls:
            lines += [
                f"  r̂ = {r} ({NORMS.get(self.norm or '', self.norm)}, input space)   radius = {self.eps[0]:.6g}"
                + ("   WARNING: radius ≥ r̂ (balls may straddle the ground-truth boundary)"
                   if self.eps_exceeds_r else ""),
                f"  {self._ball_words()}: normal {self.cells_normal}, empty {self.cells_empty}, "
                f"cross-boundary {self.cells_cross}",
                f"  OP: empirical, 1/{self.cells_evaluated} per ball; "
                + (f"multinomial bootstrap B = {self.bootstrap}" if self.bootstrap else "masses taken as known"),
                f"  samples per ball {self.samples_per_cell} ({self.allocation}); failure = "
                + ("any misclassification" if self.failure_set is None else f"confusions {list(self.failure_set)}"),
                f"  {self.model_queries:,} model queries in {self.seconds:.2f} s"
                f" ({self.model_queries / max(self.seconds, 1e-9):,.0f} /s)",
                *self._allocation_summary(),
                *self.checks_summary(),
            ]
            return "\n".join(lines)
        lines += [
            f"  r̂ = {r}   ε = {', '.join(f'{e:.6g}' for e in self.eps)}"
            + ("   WARNING: ε ≥ r̂ (cells may straddle the ground-truth boundary)" if self.eps_exceeds_r else ""),
            f"  grid {' × '.join(map(str, self.grid_shape))} = {self.cells_total} cells"
            f"{' (latent space)' if self.latent else ''}; evaluated {self.cells_evaluated}: "
            f"normal {self.cells_normal}, empty {self.cells_empty}, cross-boundary {self.cells_cross}",
            f"  OP mass evaluated {self.mass_evaluated:.6g}; rest {self.mass_rest:.6g} counted "
            + ("with λ = 1 (conservative)" if self.conservative_rest else "at the evaluated cells' average pmi"),
            f"  box {self._box_words()}",
            f"  OP masses: {self.mass_method}, bootstrap B = {self.bootstrap}"
            f"{' (half-size refits, the paper’s variant)' if self.bootstrap_size == 'half' else ''}, bandwidth "
            + ("full covariance" if self.bandwidth is None else ", ".join(f"{h:.4g}" for h in self.bandwidth)),
            f"  samples per cell {self.samples_per_cell} ({self.allocation}); failure = "
            + ("any misclassification" if self.failure_set is None else f"confusions {list(self.failure_set)}"),
            f"  {self.model_queries:,} model queries in {self.seconds:.2f} s"
            f" ({self.model_queries / max(self.seconds, 1e-9):,.0f} /s)",
            *self._allocation_summary(),
            *self.checks_summary(),
        ]
        return "\n".join(lines)

    def verdict(self) -> dict[str, str | None]:
        """What the bound is worth as a gate's evidence: ``detail``, ``inconclusive`` and ``contradiction``.

        * ``contradiction`` — the labelled data refute the bound (the model's labelled error is above
          ``Ub`` at the confidence, or the model's vote, Assumption 5, is refuted where labels are
          known): a gate fails whatever the comparison.
        * ``inconclusive`` — an assumption of the method is violated (``ε``/radius ``≥ r̂``, labelled
          points outside the box, cross-boundary cells), unless ``accept_violated_assumptions=True``
          was given: then the bound is compared and ``detail`` says so.
        """
        detail = self.detail()
        inconclusive = None
        if self.violations:
            joined = "; ".join(self.violations)
            if self.violations_accepted:
                detail += f"; VIOLATED ASSUMPTIONS ACCEPTED (accept_violated_assumptions=True): {joined}"
            else:
                inconclusive = (f"violated assumption(s) of the reliability method: {joined}. The bound is not "
                                f"evidence until they hold (or, knowingly, accept_violated_assumptions=True)")
        contradiction = "; ".join(self.contradictions) or None
        return {"detail": detail, "inconclusive": inconclusive, "contradiction": contradiction}

    def to_details(self) -> dict[str, Any]:
        """Plain JSON-able values (non-finite numbers become ``None``).

        ``cells_plot`` (when the result holds its cell table): :meth:`cells_plot`, at most
        :data:`CELLS_PLOT_LIMIT` cells.
        """
        details: dict[str, Any] = {
            "E": self.E,
            "Var": self.Var,
            "std": self.std,
            "Ub": self.Ub,
            "confidence": self.confidence,
            "method": self.method,
            "r_hat": _num(self.r_hat),
            "eps": list(self.eps),
            "eps_exceeds_r": self.eps_exceeds_r,
            "grid_shape": list(self.grid_shape),
            "cells_total": self.cells_total,
            "cells_evaluated": self.cells_evaluated,
            "cells": {"normal": self.cells_normal, "empty": self.cells_empty, "cross_boundary": self.cells_cross},
            "mass_evaluated": self.mass_evaluated,
            "mass_rest": self.mass_rest,
            "rest": "lambda=1 (conservative)" if self.conservative_rest else "average pmi of evaluated cells",
            "mass_method": self.mass_method,
            "bootstrap": self.bootstrap,
            "bandwidth": None if self.bandwidth is None else list(self.bandwidth),
            "samples_per_cell": self.samples_per_cell,
            "allocation": self.allocation,
            "acu": self.acu,
            "failure_set": None if self.failure_set is None else [list(p) for p in self.failure_set],
            "latent": self.latent,
            "labelled_outside_box": self.labelled_outside_box,
            "model_queries": self.model_queries,
            "seconds": self.seconds,
            "alternatives": {name: alt.to_dict() for name, alt in self.alternatives.items()},
            "cell_kind": self.cell_kind,
            "norm": self.norm,
            "radius": self.eps[0] if self.balls else None,
            "clip": None if self.clip is None else list(self.clip),
            "empty_cell_label": self.empty_cell_label,
            "labelled_from_profile": self.labelled_from_profile,
            "labelled_queries": self.labelled_queries,
            "queries_pilot": self.queries_pilot,
            "queries_final": self.queries_final,
            "allocation_plan": None if self.allocation_plan is None else dict(self.allocation_plan),
            "labelled_check": None if self.labelled_check is None else dict(self.labelled_check),
            "vote_check": None if self.vote_check is None else dict(self.vote_check),
            "violations": list(self.violations),
            "violations_accepted": self.violations_accepted,
            "contradictions": list(self.contradictions),
            "box": None if self.box is None else [list(self.box[0]), list(self.box[1])],
            "box_rule": self.box_rule,
            "bootstrap_size": self.bootstrap_size,
            "cells_file": self.cells_file,
        }
        if self.cells is not None:
            details["cells_plot"] = self.cells_plot()
        return details

    def cells_plot(self, limit: int = CELLS_PLOT_LIMIT) -> dict[str, list[Any]]:
        """Per evaluated cell, for plots: OP mass, ``λ̂_i`` (1 for cross-boundary cells) and type.

        The ``limit`` cells of largest mass, sorted by mass (descending; ties in table order).
        """
        table = self.cells
        if table is None:
            return {"mass": [], "failure_rate": [], "type": []}
        order = torch.argsort(table.op, descending=True, stable=True)[:limit]
        return {
            "mass": [float(v) for v in table.op[order].tolist()],
            "failure_rate": [float(v) for v in table.unastuteness[order].tolist()],
            "type": [_PLOT_TYPES.get(int(v), str(int(v))) for v in table.cell_type[order].tolist()],
        }
