"""Performance per scenario group (Cheng et al. 2018, §II-E): accuracy, its exact lower bound, the worst group.

The rows of the evaluation data are split into *groups* by the values of one or more operating
conditions of the scenario table (``by=["lighting"]`` or ``by=["lighting", "noise"]``). Groups are
the cells of the product of the ``by`` conditions' *declared* value domains, numbered in mixed radix
(first condition most significant, as :class:`~pytest_dnnsafety.engines.core.projection.ProjectionLayout`),
so a group the data never reaches is still a group, with size 0.

:class:`ScenarioPerformanceEngine` keeps int64 ``sum`` states: per group the rows and the correct
rows, and optionally per group × class the rows and the correct rows (per-class recall). ``update``
folds a batch with ``index_add_`` (no ``bincount``, whose output size needs a host sync on CUDA), so
it never synchronises with the host; ``compute`` does once.

Bounds. Each group's accuracy gets an exact one-sided Clopper–Pearson lower bound at ``confidence``,
``L = Beta⁻¹(1 − confidence; k, n − k + 1)`` (0 when ``k = 0``): ``P(L ≤ p) ≥ confidence`` for every
true accuracy ``p`` and every group size ``n``. Not Wilson and not the normal (Wald) bound: both are
approximations whose coverage drops below nominal for small ``n`` and ``p`` near 1 — exactly the
regime of an accuracy gate — and Wald collapses to ``L = 1`` on three correct out of three, the lucky
samples the gate must not pass. Clopper–Pearson is conservative (coverage ≥ nominal everywhere; the
simulation in ``tests/families/performance/test_scenario_performance.py`` checks it).

A gate on the worst group's bound needs no multiplicity correction: it claims that *every* group
reaches the threshold and passes only when every group's bound does; if some group falls short, its
bound lies above its true accuracy with probability ≤ 1 − confidence, so a false pass is at most
that likely (an intersection–union test, Berger 1982). Rows are taken as independent draws.

Degradation of a group: ``overall accuracy − group accuracy`` (the point estimate; the overall
accuracy is over all rows). Its sound upper bound ``U_all − L_g`` uses one-sided Clopper–Pearson
bounds at ``(1 + confidence)/2`` each (overall upper, group lower): by the union bound both hold
together with probability ≥ ``confidence``, whatever their dependence, so the true drop of that group
is at most ``U_all − L_g`` with probability ≥ ``confidence``; the intersection–union argument above
makes the largest of them a sound gate over all groups.

Other scores (:meth:`ScenarioPerformanceEngine.compute_scores`): precision, recall or F1, ``micro``
or ``macro``, per group from per-input true/false positive and false negative counts (multi-label
predicted sets, or one-hot single-label decisions; :mod:`pytest_dnnsafety.engines.inspection.multilabel`). Their
``lower``/``drop_bound``/``overall_upper`` are *estimates* (``bound_kind="estimate"``): a seeded
percentile bootstrap over inputs, made no tighter than a Clopper–Pearson bound with the inputs as
trials; the result's ``accuracy`` then holds the score. A multi-label model's ``accuracy`` is subset
accuracy (every class decided right), a proportion of inputs with the exact bound above.

Coverage discount (the paper's perf × M_scene): ``M_scene`` here is eq. (1) restricted to the one
condition subset ``by`` (k = ``len(by)``): the share of *feasible* groups (cells the declared
restrictions allow) that hold ≥ 1 row — equal to ``ScenarioTable.coverage(k=len(by)).per_subset``'s
value for that subset with ``min_count=1``. ``coverage_discounted = overall accuracy × M_scene``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError

__all__ = [
    "MAX_GROUPS", "GroupPerformance", "ScenarioPerformanceEngine", "ScenarioPerformanceResult", "resolve_by",
]

#: Largest number of groups (product of the ``by`` domains' sizes) an engine accepts.
MAX_GROUPS = 100_000


@dataclass(frozen=True)
class GroupPerformance:
    """One group: its condition values, size and accuracy with bounds (None where the group is empty).

    ``lower``: one-sided Clopper–Pearson lower bound at the result's ``confidence``; ``drop``:
    overall accuracy − accuracy; ``drop_bound``: the sound upper bound on the drop (module docstring).
    ``feasible``: the declared restrictions allow the group; ``assessable``: ≥ ``min_samples`` rows.
    ``recall``: per-class recall (None for a class without rows) when the engine counts classes.
    """

    index: int
    key: Mapping[str, str]
    size: int
    correct: int
    accuracy: float | None
    lower: float | None
    drop: float | None
    drop_bound: float | None
    feasible: bool
    assessable: bool
    recall: tuple[float | None, ...] | None = None
    class_sizes: tuple[int, ...] | None = None
    #: with a score other than accuracy: the group's per-class values of that score (``per_class=True``)
    per_class: tuple[float, ...] | None = None

    def label(self) -> str:
        """``lighting=night × noise=high``."""
        return " × ".join(f"{name}={value}" for name, value in self.key.items())

    def to_details(self) -> dict[str, Any]:
        out: dict[str, Any] = {"key": dict(self.key), "group": self.label(), "size": self.size,
                               "correct": self.correct, "accuracy": self.accuracy, "lower": self.lower,
                               "drop": self.drop, "drop_bound": self.drop_bound, "feasible": self.feasible,
                               "assessable": self.assessable}
        if self.recall is not None:
            out["recall"] = list(self.recall)
            out["class_sizes"] = list(self.class_sizes or ())
        if self.per_class is not None:
            out["per_class"] = list(self.per_class)
        return out


def _sort_key(group: GroupPerformance) -> tuple[int, float, float, int]:
    """Worst first: assessable groups by lower bound, then small groups, then empty ones."""
    rank = 0 if group.assessable else (1 if group.size else 2)
    return (rank, group.lower if group.lower is not None else 2.0,
            group.accuracy if group.accuracy is not None else 2.0, group.index)


@dataclass(frozen=True)
class ScenarioPerformanceResult:
    """What :meth:`ScenarioPerformanceEngine.compute` returns (plain Python numbers)."""

    by: tuple[str, ...]
    confidence: float
    min_samples: int
    groups: tuple[GroupPerformance, ...]  # in group-index order
    n: int
    correct: int
    accuracy: float
    overall_upper: float  # one-sided Clopper–Pearson upper bound at (1 + confidence)/2
    scenario_coverage: float  # M_scene of the `by` subset: feasible groups with ≥ 1 row / feasible groups
    coverage_discounted: float  # accuracy × scenario_coverage
    #: what ``accuracy`` holds: "accuracy" (multi-label: subset accuracy) or precision/recall/f1 (``average``)
    score: str = "accuracy"
    average: str | None = None
    #: how ``lower``/``drop_bound``/``overall_upper`` were obtained (exact Clopper–Pearson, or a bootstrap estimate)
    bound_method: str = "clopper-pearson one-sided"
    #: an exact bound ("bound") or an approximate one ("estimate")
    bound_kind: str = "bound"

    @property
    def score_name(self) -> str:
        return self.score if self.average is None else f"{self.average} {self.score}"

    @property
    def assessable(self) -> tuple[GroupPerformance, ...]:
        return tuple(g for g in self.groups if g.assessable)

    @property
    def small(self) -> tuple[GroupPerformance, ...]:
        """Groups with 1 … min_samples − 1 rows (not assessable)."""
        return tuple(g for g in self.groups if 0 < g.size < self.min_samples)

    @property
    def empty(self) -> tuple[GroupPerformance, ...]:
        """Feasible groups of the declared domain without a row."""
        return tuple(g for g in self.groups if g.size == 0 and g.feasible)

    @property
    def worst(self) -> GroupPerformance | None:
        """The assessable group with the smallest lower bound (None when no group is assessable)."""
        ranked = sorted(self.assessable, key=_sort_key)
        return ranked[0] if ranked else None

    def largest_degradation(self, statistic: str = "point") -> GroupPerformance | None:
        """The assessable group with the largest drop (``"point"``) or drop bound (``"bound"``)."""
        if statistic not in ("point", "bound"):
            raise ConfigError(f"statistic must be 'point' or 'bound', got {statistic!r}")
        field = "drop" if statistic == "point" else "drop_bound"
        ranked = sorted(self.assessable, key=lambda g: (-getattr(g, field), g.index))
        return ranked[0] if ranked else None

    @property
    def degradation(self) -> float | None:
        group = self.largest_degradation("point")
        return None if group is None else group.drop

    @property
    def degradation_bound(self) -> float | None:
        group = self.largest_degradation("bound")
        return None if group is None else group.drop_bound

    def detail(self) -> str:
        worst = self.worst
        name = self.score_name
        how = (f"{worst.correct}/{worst.size}, {self.confidence:.0%} one-sided Clopper–Pearson"
               if self.score == "accuracy" and worst is not None else
               f"n={worst.size if worst is not None else 0}, {self.confidence:.0%} {self.bound_method}")
        head = (f"worst group {worst.label()}: {name} {worst.accuracy:.3f}, lower bound {worst.lower:.3f} ({how})"
                if worst is not None else f"no group has ≥ {self.min_samples} rows")
        counted = sum(1 for g in self.groups if g.feasible or g.size)
        return (f"{head}; overall {self.accuracy:.3f} (n={self.n}), {len(self.assessable)}/{counted} groups "
                f"assessable; scenario coverage {self.scenario_coverage:.3f}, {name} × coverage "
                f"{self.coverage_discounted:.3f}")

    def to_details(self) -> dict[str, Any]:
        worst = self.worst
        drop, drop_bound = self.largest_degradation("point"), self.largest_degradation("bound")
        out: dict[str, Any] = {
            "by": list(self.by), "confidence": self.confidence, "bound": self.bound_method,
            "bound_kind": self.bound_kind, "score": self.score, "average": self.average,
            "min_samples": self.min_samples, "n": self.n, "correct": self.correct, "accuracy": self.accuracy,
            "overall_upper": self.overall_upper, "scenario_coverage": self.scenario_coverage,
            "coverage_discounted": self.coverage_discounted,
            "worst_group": None if worst is None else worst.label(),
            "worst_lower": None if worst is None else worst.lower,
            "degradation": None if drop is None else drop.drop,
            "degradation_group": None if drop is None else drop.label(),
            "degradation_bound": None if drop_bound is None else drop_bound.drop_bound,
            "degradation_bound_group": None if drop_bound is None else drop_bound.label(),
            "empty_groups": [g.label() for g in self.empty],
            "small_groups": [g.label() for g in self.small],
            "groups": [g.to_details() for g in sorted(self.groups, key=_sort_key)],
        }
        if self.score != "accuracy":  # "accuracy" holds the score; counts of correct inputs do not apply
            out["value_of"] = self.score_name
            del out["correct"]
            for row in out["groups"]:
                del row["correct"]
        return out


def _cp_lower(k: Tensor, n: Tensor, confidence: float) -> Tensor:
    """One-sided Clopper–Pearson lower bounds (n ≥ 1 everywhere)."""
    from pytest_dnnsafety.stats.intervals import clopper_pearson_lower

    return clopper_pearson_lower(k, n, confidence) if k.numel() else torch.zeros(0, dtype=torch.float64)


class ScenarioPerformanceEngine(Engine):
    """Per-group correct/total counts over the product of the ``by`` conditions' domains.

    Args:
        by: the condition names (order = the key order; first is the most significant radix digit).
        domains: each ``by`` condition's declared values, in the scenario table's code order.
        confidence: one-sided level of the Clopper–Pearson bounds, in (0, 1).
        min_samples: rows a group needs to be *assessable* (worst group and degradation use only those).
        num_classes: count per group × class too (per-class recall); ``update`` then needs labels.
        feasible: per group, whether the declared restrictions allow it (default: all); infeasible
            groups are neither *empty* nor part of the scenario coverage.
    """

    def __init__(self, by: Sequence[str], domains: Sequence[Sequence[str]], *, confidence: float = 0.95,
                 min_samples: int = 1, num_classes: int | None = None,
                 feasible: Sequence[bool] | Tensor | None = None, device: torch.device | str | None = None) -> None:
        super().__init__(device)
        by, domains = tuple(str(b) for b in by), tuple(tuple(str(v) for v in d) for d in domains)
        if not by or len(by) != len(domains) or len(set(by)) != len(by) or not all(domains):
            raise ConfigError(f"by={list(by)!r} must be distinct condition names, one non-empty domain each "
                              f"(got {len(domains)} domain(s))")
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
            raise ConfigError(f"confidence must lie strictly between 0 and 1, got {confidence!r}")
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 1:
            raise ConfigError(f"min_samples must be a positive int, got {min_samples!r}")
        if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)
                                        or num_classes < 1):
            raise ConfigError(f"num_classes must be a positive int or None, got {num_classes!r}")
        self.by, self.domains = by, domains
        self.confidence, self.min_samples, self.num_classes = float(confidence), min_samples, num_classes
        self.n_groups = math.prod(len(d) for d in domains)
        if self.n_groups > MAX_GROUPS:
            raise ConfigError(f"by={list(by)} has {self.n_groups} groups (product of the domain sizes), more than "
                              f"{MAX_GROUPS}; group by fewer conditions")
        strides, stride = [], 1
        for domain in reversed(domains):
            strides.append(stride)
            stride *= len(domain)
        self.strides = tuple(reversed(strides))
        mask = torch.ones(self.n_groups, dtype=torch.bool) if feasible is None else torch.as_tensor(
            feasible, dtype=torch.bool).reshape(-1).cpu()
        if mask.numel() != self.n_groups:
            raise ConfigError(f"feasible has {mask.numel()} entries for {self.n_groups} groups")
        self.feasible = mask
        zeros = torch.zeros(self.n_groups, dtype=torch.int64)
        self.add_state("total", zeros, "sum")
        self.add_state("correct", zeros.clone(), "sum")
        if num_classes is not None:
            self.add_state("class_total", torch.zeros(self.n_groups, num_classes, dtype=torch.int64), "sum")
            self.add_state("class_correct", torch.zeros(self.n_groups, num_classes, dtype=torch.int64), "sum")

    # ------------------------------------------------------------------ building from a scenario table
    @classmethod
    def from_table(cls, table: Any, by: Sequence[str], **options: Any) -> ScenarioPerformanceEngine:
        """An engine over ``table``'s conditions named in ``by``, feasibility from its restrictions.

        Raises :class:`ConfigError` naming the known conditions when ``by`` names an unknown one.
        """
        columns = resolve_by(table, by)
        conditions = table.conditions
        domains = [conditions.domains[name] for name in by]
        return cls(by, domains, feasible=_feasible_groups(conditions, columns, domains), **options)

    def group_index(self, table: Any) -> Tensor:
        """Each row's group (int64, on the engine's device): mixed radix over the ``by`` columns' codes."""
        columns = resolve_by(table, self.by)
        domains = tuple(tuple(table.conditions.domains[name]) for name in self.by)
        if domains != self.domains:
            raise DataError(f"the table's domains of {list(self.by)} differ from the engine's; build the engine "
                            f"with ScenarioPerformanceEngine.from_table(table, by)")
        codes = table.codes[:, list(columns)].to(self.device, torch.int64)
        return (codes * torch.tensor(self.strides, dtype=torch.int64, device=self.device)).sum(1)

    def config(self) -> dict[str, Any]:
        return {"by": list(self.by), "domains": [list(d) for d in self.domains], "confidence": self.confidence,
                "min_samples": self.min_samples, "num_classes": self.num_classes,
                "feasible": [bool(v) for v in self.feasible.tolist()]}

    # ------------------------------------------------------------------ protocol
    def update(self, group_index: Tensor, correct: Tensor, labels: Tensor | None = None) -> None:  # type: ignore[override]
        """Fold a batch: ``group_index`` (B,) in ``[0, n_groups)``, ``correct`` (B,) bool, ``labels`` (B,)
        in ``[0, num_classes)`` (needed with ``num_classes``). No host sync: indices are not range-checked
        here (use :meth:`group_index`)."""
        group = group_index.reshape(-1).to(self.device, torch.int64)
        hit = correct.reshape(-1).to(self.device, torch.int64)
        if group.shape != hit.shape:
            raise DataError(f"group_index has {group.numel()} entries but correct has {hit.numel()}")
        self.total.index_add_(0, group, torch.ones_like(group))
        self.correct.index_add_(0, group, hit)
        if self.num_classes is not None:
            if labels is None:
                raise DataError("per-class recall needs the labels: call update(group_index, correct, labels)")
            cls = labels.reshape(-1).to(self.device, torch.int64)
            if cls.shape != group.shape:
                raise DataError(f"labels has {cls.numel()} entries but group_index has {group.numel()}")
            flat = group * self.num_classes + cls
            self.class_total.view(-1).index_add_(0, flat, torch.ones_like(flat))
            self.class_correct.view(-1).index_add_(0, flat, hit)

    def compute(self) -> ScenarioPerformanceResult:
        total, correct = self.total.cpu(), self.correct.cpu()
        n, k = int(total.sum()), int(correct.sum())
        if n == 0:
            raise MetricError("no rows: every group is empty; the accuracy per scenario needs data")
        c, split = self.confidence, (1.0 + self.confidence) / 2.0
        filled = torch.nonzero(total > 0).reshape(-1)
        lower = torch.full((self.n_groups,), math.nan, dtype=torch.float64)
        lower_split = lower.clone()
        lower[filled] = _cp_lower(correct[filled], total[filled], c)
        lower_split[filled] = _cp_lower(correct[filled], total[filled], split)
        from pytest_dnnsafety.stats.intervals import clopper_pearson_upper

        accuracy = k / n
        upper_all = float(clopper_pearson_upper(torch.tensor([k]), torch.tensor([n]), split)[0])
        recall = class_sizes = None
        if self.num_classes is not None:
            class_sizes = self.class_total.cpu()
            ratio = self.class_correct.cpu().double() / class_sizes.double().clamp_min(1)
            recall = torch.where(class_sizes > 0, ratio, torch.full_like(ratio, math.nan))
        groups = []
        for g, (size, hits) in enumerate(zip(total.tolist(), correct.tolist())):
            key = dict(zip(self.by, (d[(g // s) % len(d)] for d, s in zip(self.domains, self.strides))))
            acc = hits / size if size else None
            groups.append(GroupPerformance(
                index=g, key=key, size=size, correct=hits, accuracy=acc,
                lower=float(lower[g]) if size else None,
                drop=accuracy - acc if acc is not None else None,
                drop_bound=upper_all - float(lower_split[g]) if size else None,
                feasible=bool(self.feasible[g]), assessable=size >= self.min_samples,
                recall=None if recall is None else tuple(None if math.isnan(v) else v for v in recall[g].tolist()),
                class_sizes=None if class_sizes is None else tuple(class_sizes[g].tolist())))
        feasible = self.feasible
        m_scene = float(((total > 0) & feasible).sum()) / max(int(feasible.sum()), 1)
        return ScenarioPerformanceResult(
            by=self.by, confidence=c, min_samples=self.min_samples, groups=tuple(groups), n=n, correct=k,
            accuracy=accuracy, overall_upper=upper_all, scenario_coverage=m_scene,
            coverage_discounted=accuracy * m_scene)


    def compute_scores(self, group_index: Tensor, counts: Tensor, score: str, average: str, *,
                       replicates: int = 2000, seed: int = 0, per_class: bool = False) -> ScenarioPerformanceResult:
        """Precision, recall or F1 per group from per-input ``(N, 3, K)`` TP/FP/FN counts
        (:func:`~pytest_dnnsafety.engines.performance.multilabel.score_counts`), with bootstrap bounds.

        The counts are not sum states (the bootstrap resamples inputs): a sharded caller gathers every rank's
        rows first. ``lower`` is the more conservative of a percentile bootstrap over the group's inputs and
        a Clopper–Pearson bound with the inputs as trials (:mod:`~pytest_dnnsafety.engines.inspection.multilabel`);
        an estimate, not an exact bound. One bootstrap per group with rows (groups are few) plus the whole data.
        """
        from pytest_dnnsafety.engines.performance.multilabel import bootstrap_bounds, scores
        from pytest_dnnsafety.stats.intervals import clopper_pearson_lower, clopper_pearson_upper

        group = group_index.reshape(-1).to(counts.device, torch.int64)
        if group.shape[0] != counts.shape[0]:
            raise DataError(f"group_index has {group.shape[0]} entries but counts {counts.shape[0]} rows")
        n = int(group.shape[0])
        if n == 0:
            raise MetricError("no rows: every group is empty; the score per scenario needs data")
        c, split = self.confidence, (1.0 + self.confidence) / 2.0
        sums = torch.zeros((self.n_groups, *counts.shape[1:]), dtype=torch.int64, device=counts.device)
        sums.index_add_(0, group, counts.to(torch.int64))
        sizes = torch.bincount(group, minlength=self.n_groups).cpu()
        value, per = (t.cpu() for t in scores(sums, score, average))
        overall = float(scores(counts.sum(0), score, average)[0])
        _, high = bootstrap_bounds(counts, score, average, levels=[split], replicates=replicates, seed=seed)
        upper_all = max(float(high[0]), float(clopper_pearson_upper([math.ceil(overall * n - 1e-9)], [n], split)[0]))
        order = torch.argsort(group, stable=True)
        bounds = torch.split(order, sizes.tolist())  # each group's rows (a view per group, no row loop)
        groups = []
        for g, size in enumerate(sizes.tolist()):
            key = dict(zip(self.by, (d[(g // s) % len(d)] for d, s in zip(self.domains, self.strides))))
            lower = lower_split = None
            v = float(value[g]) if size else None
            if size:
                low, _ = bootstrap_bounds(counts[bounds[g]], score, average, levels=[c, split], replicates=replicates,
                                          seed=seed + 1 + g)
                k = torch.tensor([math.floor(v * size + 1e-9)] * 2)
                cp = torch.stack([clopper_pearson_lower(k[:1], [size], c), clopper_pearson_lower(k[1:], [size], split)])
                lower, lower_split = (min(float(low[i]), float(cp[i])) for i in range(2))
            groups.append(GroupPerformance(
                index=g, key=key, size=size, correct=0, accuracy=v, lower=lower,
                drop=overall - v if v is not None else None,
                drop_bound=upper_all - lower_split if lower_split is not None else None,
                feasible=bool(self.feasible[g]), assessable=size >= self.min_samples,
                per_class=tuple(per[g].tolist()) if per_class and size else None))
        feasible = self.feasible
        m_scene = float(((sizes > 0) & feasible).sum()) / max(int(feasible.sum()), 1)
        return ScenarioPerformanceResult(
            by=self.by, confidence=c, min_samples=self.min_samples, groups=tuple(groups), n=n, correct=0,
            accuracy=overall, overall_upper=upper_all, scenario_coverage=m_scene,
            coverage_discounted=overall * m_scene, score=score, average=average,
            bound_method=f"percentile bootstrap over inputs ({replicates} replicates, seeded) or Clopper–Pearson "
                         "with inputs as trials, whichever is more conservative",
            bound_kind="estimate")


# ------------------------------------------------------------------ helpers (no scenarios import: duck-typed)
def resolve_by(table: Any, by: Sequence[str]) -> tuple[int, ...]:
    """The column of each ``by`` condition in ``table``; :class:`ConfigError` naming the known ones otherwise."""
    names = tuple(table.conditions.names)
    unknown = [name for name in by if name not in names]
    if unknown:
        raise ConfigError(f"by names unknown condition(s) {', '.join(map(repr, unknown))}; the scenario table's "
                          f"conditions are: {', '.join(names)}. Fix: group by declared conditions")
    return tuple(names.index(name) for name in by)


def _feasible_groups(conditions: Any, columns: Sequence[int], domains: Sequence[Sequence[str]]) -> Tensor:
    """Which groups the declared restrictions allow: the ``by`` subset's block of ``cell_feasibility(k)``."""
    if not getattr(conditions, "restrictions", ()):
        return torch.ones(math.prod(len(d) for d in domains), dtype=torch.bool)
    from pytest_dnnsafety.engines.core.projection import ProjectionLayout

    k = len(columns)
    mask, _exact = conditions.cell_feasibility(k)
    layout = ProjectionLayout(tuple(conditions.cardinalities), k)
    s = layout.subsets.index(tuple(sorted(columns)))
    cells = layout.subset_cells(s)  # values in sorted-column order
    order = [tuple(sorted(columns)).index(c) for c in columns]
    strides, stride = [], 1
    for domain in reversed(domains):
        strides.append(stride)
        stride *= len(domain)
    index = (cells[:, order] * torch.tensor(list(reversed(strides)), dtype=torch.int64)).sum(1)
    out = torch.ones(stride, dtype=torch.bool)
    out[index] = mask[layout.offsets[s]:layout.offsets[s + 1]]
    return out
