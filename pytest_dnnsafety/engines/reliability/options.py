"""The option records of a reliability assessment: cells, OP masses, the sampling plan, the bound, the labels.

Part of :mod:`pytest_dnnsafety.engines.reliability`.
:class:`~pytest_dnnsafety.engines.reliability.assessment.ReliabilityAssessor` takes one
:class:`ReliabilityOptions`, which groups the options (frozen dataclasses, each validated once
when it is built, with the messages the keywords had; the keywords are documented at
:func:`~pytest_dnnsafety.engines.reliability.api.assess_reliability`):

* :class:`CellOptions` — the cells: a grid of side ``eps`` over a ``box``, or norm balls of
  ``radius`` around the operational inputs;
* :class:`MassOptions` — the OP masses (KDE, its bootstrap) and which cells are evaluated;
* :class:`SamplingPlan` — the Monte Carlo: samples per cell, the allocation, the query cap, the
  model batches;
* :class:`BoundOptions` — the aggregation into a bound: the method, the others reported, the confidence;
* :class:`LabelOptions` — the classes, the failures that count, how empty cells get their label and
  the checks against the labelled data.

:meth:`ReliabilityOptions.of` builds them from the flat keywords of ``assess_reliability``. Pure
torch; no pytest import.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pytest_dnnsafety.data.checks import check_count
from pytest_dnnsafety.engines.reliability.allocation import DEFAULT_MAX_QUERIES
from pytest_dnnsafety.engines.reliability.cells import _check_norm
from pytest_dnnsafety.engines.reliability.profile import BOOTSTRAP_SIZES, canonical_mass
from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.stats import intervals as stats

__all__ = ["CellOptions", "MassOptions", "SamplingPlan", "BoundOptions", "LabelOptions", "ReliabilityOptions",
           "EMPTY_CELL_LABELS"]

#: How empty cells (no labelled point inside) get their label (``empty_cell_label=``): the model's
#: majority vote on the cell's samples (the paper's Assumption 5) or the label of the nearest
#: labelled point (Euclidean, in the profile's space).
EMPTY_CELL_LABELS: tuple[str, ...] = ("model", "nearest")


def _set(record: Any, **values: Any) -> None:
    """Store the validated (normalised) ``values`` on a frozen record."""
    for name, value in values.items():
        object.__setattr__(record, name, value)


def _fraction(value: Any) -> bool:
    """Whether ``value`` is a number strictly between 0 and 1 (not a bool)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < 1


@dataclass(frozen=True)
class CellOptions:
    """The cells: ``"grid"`` (side ``eps`` or ``"auto"``, below ``eps_fraction · r̂``, over ``box``) or
    ``"balls"`` (``radius`` under ``norm`` around at most ``max_balls`` operational inputs, samples in
    ``clip``). ``radius``, ``max_balls``, ``clip`` and a ``norm`` other than ``"linf"`` are ball settings."""

    cells: str = "grid"
    eps: float | Sequence[float] | str = "auto"
    eps_fraction: float = 1.0
    box: tuple[Any, Any] | str | None = None
    radius: float | str | None = None
    norm: str = "linf"
    max_balls: int | None = None
    clip: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.cells not in ("grid", "balls"):
            raise ConfigError(f"cells must be 'grid' (cells of side eps over a box) or 'balls' (norm balls around the "
                              f"operational inputs, for high-dimensional inputs such as images), got {self.cells!r}")
        norm = _check_norm(self.norm)
        if self.cells == "grid":
            for name, value in (("radius", self.radius), ("max_balls", self.max_balls), ("clip", self.clip)):
                if value is not None:
                    raise ConfigError(f"{name} applies to cells='balls' only; grid cells are set by eps, box and "
                                      f"max_cells")
            if norm != "linf":
                raise ConfigError(f"norm={norm!r} applies to cells='balls' only; grid cells are L∞ boxes")
        # lists (a marker's keywords) as tuples
        _set(self, cells=str(self.cells), norm=norm, box=tuple(self.box) if isinstance(self.box, list) else self.box,
             clip=tuple(self.clip) if isinstance(self.clip, list) else self.clip)


@dataclass(frozen=True)
class MassOptions:
    """The OP masses: ``bootstrap`` KDE refits (0: masses known; ``bootstrap_size`` ``"full"`` or the
    paper's ``"half"``), the KDE ``bandwidth``, ``mass`` ``"exact"`` or ``"centre"``, ``normalize`` over
    the box; and the cells evaluated: by descending mass up to ``mass_target`` and/or ``max_cells``,
    the rest at ``λ = 1`` (``conservative_rest``) or at the evaluated cells' average pmi."""

    bootstrap: int = 100
    bootstrap_size: str = "full"
    bandwidth: Any = None
    mass: str = "exact"
    normalize: bool = True
    mass_target: float = 1.0
    max_cells: int | None = None
    conservative_rest: bool = True

    def __post_init__(self) -> None:
        bootstrap = check_count(self.bootstrap, "bootstrap", 0)
        if bootstrap == 1:
            raise ConfigError("bootstrap must be 0 (OP masses taken as known) or at least 2 refits, got 1")
        mass = canonical_mass(self.mass)  # "center" is a spelling of "centre"; reported as "centre"
        if self.bootstrap_size not in BOOTSTRAP_SIZES:
            raise ConfigError(f"bootstrap_size must be one of {list(BOOTSTRAP_SIZES)} ('full': the standard bootstrap, "
                              f"N of N points per KDE refit; 'half': the paper's N/2-point refits), got "
                              f"{self.bootstrap_size!r}")
        target = self.mass_target
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target <= 1:
            raise ConfigError(f"mass_target must be a number in (0, 1], got {target!r}")
        _set(self, bootstrap=bootstrap, mass=mass, bootstrap_size=str(self.bootstrap_size),
             normalize=bool(self.normalize), mass_target=float(target),
             max_cells=None if self.max_cells is None else check_count(self.max_cells, "max_cells", 1),
             conservative_rest=bool(self.conservative_rest))


@dataclass(frozen=True)
class SamplingPlan:
    """The Monte Carlo: ``samples_per_cell``, the ``allocation`` (``"uniform"``, ``"proportional"`` or
    ``"adaptive"`` with its ``query_budget``, ``target_width``, ``pilot_samples`` and ``pilot_fraction``),
    the cap ``max_queries`` on a plan (None: none), the model ``batch_size`` (or ``"auto"``) and the
    inputs' ``input_dtype``."""

    samples_per_cell: int = 1000
    allocation: str = "uniform"
    query_budget: int | None = None
    target_width: float | None = None
    max_queries: int | None = DEFAULT_MAX_QUERIES
    pilot_samples: int | None = None
    pilot_fraction: float = 0.05
    batch_size: int | str = "auto"
    input_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        samples = check_count(self.samples_per_cell, "samples_per_cell", 1)
        if self.allocation not in ("uniform", "proportional", "adaptive"):
            raise ConfigError(f"allocation must be 'uniform', 'proportional' or 'adaptive' (a pilot, then the budget "
                              f"spread where it tightens the bound), got {self.allocation!r}")
        if self.allocation != "adaptive":
            for name, value, default in (("query_budget", self.query_budget, None),
                                         ("target_width", self.target_width, None),
                                         ("pilot_samples", self.pilot_samples, None),
                                         ("pilot_fraction", self.pilot_fraction, 0.05)):
                if value != default:
                    raise ConfigError(f"{name} applies to allocation='adaptive' only. Fix: allocation='adaptive', or "
                                      f"drop {name}")
        budget = None if self.query_budget is None else check_count(self.query_budget, "query_budget", 2)
        width = self.target_width
        if width is not None and (not _fraction(width) or not math.isfinite(width)):
            raise ConfigError(f"target_width is the bound width Ub − E to reach, a number in (0, 1), e.g. 1e-3; got "
                              f"{width!r}")
        pilot = None if self.pilot_samples is None else check_count(self.pilot_samples, "pilot_samples", 1)
        if not _fraction(self.pilot_fraction):
            raise ConfigError(f"pilot_fraction is the share of query_budget (or of samples_per_cell) spent on the "
                              f"pilot, strictly between 0 and 1, e.g. 0.05; got {self.pilot_fraction!r}")
        cap = None if self.max_queries is None else check_count(self.max_queries, "max_queries", 1)
        batch_size = self.batch_size
        if isinstance(batch_size, str):
            if batch_size != "auto":
                raise ConfigError(f"batch_size must be a positive int or 'auto', got {batch_size!r}")
        else:
            batch_size = check_count(batch_size, "batch_size", 1)
        _set(self, samples_per_cell=samples, allocation=str(self.allocation), query_budget=budget,
             target_width=None if width is None else float(width), pilot_samples=pilot,
             pilot_fraction=float(self.pilot_fraction), max_queries=cap, batch_size=batch_size)


def _check_method(method: Any, name: str) -> str:
    if method not in stats.METHODS:
        raise ConfigError(f"{name}: unknown method {method!r}; use one of {list(stats.METHODS)}")
    return str(method)


@dataclass(frozen=True)
class BoundOptions:
    """The bound: ``method`` (``"chernoff"``, ``"normal"``, ``"clopper-pearson"``, ``"jeffreys"``), the
    ``compare_methods`` reported beside it, the ``confidence`` ``1 − α``, the share of ``α`` the sound
    methods spend on OP uncertainty (``alpha_op_share``) and the ``posterior_draws`` of ``"jeffreys"``."""

    method: str = "chernoff"
    compare_methods: Sequence[str] = ()
    confidence: float = 0.975
    alpha_op_share: float = 0.5
    posterior_draws: int = 1000

    def __post_init__(self) -> None:
        confidence = stats.check_confidence(self.confidence)
        method = _check_method(self.method, "method")
        compare = tuple(dict.fromkeys(_check_method(m, "compare_methods") for m in self.compare_methods
                                      if m != method))
        if not _fraction(self.alpha_op_share):
            raise ConfigError(f"alpha_op_share must lie strictly between 0 and 1, got {self.alpha_op_share!r}")
        _set(self, confidence=confidence, method=method, compare_methods=compare,
             alpha_op_share=float(self.alpha_op_share),
             posterior_draws=check_count(self.posterior_draws, "posterior_draws", 1))


def _check_failures(failures: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    pairs = []
    for pair in failures:
        try:
            true, pred = (int(v) for v in pair)
        except (TypeError, ValueError):
            raise ConfigError(
                f"failures must be (true, predicted) class pairs, e.g. [(0, 1)] for red→green; got {pair!r}"
            ) from None
        if true < 0 or pred < 0 or true == pred:
            raise ConfigError(f"failure pair {pair!r}: classes must be distinct non-negative indices")
        pairs.append((true, pred))
    if not pairs:
        raise ConfigError("failures is empty; give at least one (true, predicted) pair, or None for any error")
    return tuple(sorted(set(pairs)))


@dataclass(frozen=True)
class LabelOptions:
    """The labels: ``num_classes`` (when the model returns labels), the ``failures`` that count (None:
    any misclassification; stored as sorted distinct pairs), ``empty_cell_label`` (``"model"``'s vote
    or the ``"nearest"`` labelled point), whether the labelled data are a sample of the profile
    (``labelled_from_profile``: their error is checked against the bound) and
    ``accept_violated_assumptions``."""

    num_classes: int | None = None
    failures: Iterable[tuple[int, int]] | None = None
    empty_cell_label: str = "model"
    labelled_from_profile: bool = True
    accept_violated_assumptions: bool = False

    def __post_init__(self) -> None:
        if self.empty_cell_label not in EMPTY_CELL_LABELS:
            raise ConfigError(f"empty_cell_label must be one of {list(EMPTY_CELL_LABELS)} (the model's majority vote, "
                              f"the paper's Assumption 5; or the label of the nearest labelled point), got "
                              f"{self.empty_cell_label!r}")
        for name, flag in (("labelled_from_profile", self.labelled_from_profile),
                           ("accept_violated_assumptions", self.accept_violated_assumptions)):
            if not isinstance(flag, (bool, np.bool_)):
                raise ConfigError(f"{name} must be True or False, got {flag!r}")
        _set(self, empty_cell_label=str(self.empty_cell_label), labelled_from_profile=bool(self.labelled_from_profile),
             accept_violated_assumptions=bool(self.accept_violated_assumptions),
             num_classes=None if self.num_classes is None else check_count(self.num_classes, "num_classes", 2),
             failures=None if self.failures is None else _check_failures(self.failures))


_RECORDS = {"labels": LabelOptions, "bound": BoundOptions, "plan": SamplingPlan, "masses": MassOptions,
            "cells": CellOptions}


@dataclass(frozen=True)
class ReliabilityOptions:
    """Every option of one assessment: the five records, the ``seed`` (of the bootstrap, the cell samples
    and the posterior draws) and the ``device`` (None: the profile's).

    Ball cells take neither ``bootstrap_size="half"`` (their empirical profile's bootstrap variance is
    exact) nor the grid's other settings (checked when the balls are planned).
    """

    cells: CellOptions = field(default_factory=CellOptions)
    masses: MassOptions = field(default_factory=MassOptions)
    plan: SamplingPlan = field(default_factory=SamplingPlan)
    bound: BoundOptions = field(default_factory=BoundOptions)
    labels: LabelOptions = field(default_factory=LabelOptions)
    seed: int = 0
    device: torch.device | str | None = None

    def __post_init__(self) -> None:
        _set(self, seed=check_count(self.seed, "seed", 0))
        if self.cells.cells == "balls" and self.masses.bootstrap_size != "full":
            raise ConfigError("bootstrap_size='half' resizes the KDE refits of grid cells (the paper's variant); "
                              "ball cells use the empirical profile, whose multinomial bootstrap variance is "
                              "exact. Fix: drop bootstrap_size with cells='balls'")

    @classmethod
    def of(cls, **keywords: Any) -> ReliabilityOptions:
        """The records from the flat keywords of :func:`~pytest_dnnsafety.engines.reliability.api.assess_reliability`
        (each record's own field names, plus ``seed`` and ``device``); an unknown keyword raises ``TypeError``."""
        unknown = sorted(set(keywords) - {f.name for r in _RECORDS.values() for f in dataclasses.fields(r)}
                         - {"seed", "device"})
        if unknown:
            raise TypeError(f"assess_reliability() got unexpected keyword argument(s) {unknown}")
        records = {name: record(**{f.name: keywords[f.name] for f in dataclasses.fields(record) if f.name in keywords})
                   for name, record in _RECORDS.items()}
        return cls(**records, **{k: keywords[k] for k in ("seed", "device") if k in keywords})
