"""The performance family's task variants: how a model's rows become per-scenario-group scores, and the gates' readings.

:func:`for_task` picks the variant of the gate's task, as torchmetrics has a binary, a multiclass and a
multilabel variant of one metric:

* :class:`SingleLabelPerformance` — class-index predictions against class-index labels. ``score="accuracy"``
  counts the hits per group in the ``sum`` states of
  :class:`~pytest_dnnsafety.engines.performance.scenario.ScenarioPerformanceEngine` (all-reduced under torchrun;
  ``per_class=True`` counts group × class too, the number of classes agreed over every rank's labels);
  precision/recall/F1 read one-hot decisions (:func:`~pytest_dnnsafety.engines.performance.multilabel.score_counts`).
* :class:`MultiLabelPerformance` — the predicted sets
  (:func:`~pytest_dnnsafety.engines.core.multilabel.predicted_sets`) against the ``(N, K)`` 0/1 label matrix:
  subset accuracy (every class decided right; exact Clopper–Pearson) or precision/recall/F1.

A gate runs :meth:`~ScenarioPerformance.rows` on its torchrun rank's shard of the session's shared forward
pass (inside the mechanism's ``together``, so a failing rank fails every rank), then
:meth:`~ScenarioPerformance.assess` against the scenario groups (a
:class:`~pytest_dnnsafety.scenarios.groups.ScenarioGroups`, read duck-typed: ``by``, ``domains``, ``feasible``,
``index``, ``check_rows``), and :meth:`~ScenarioPerformance.min_accuracy` /
:meth:`~ScenarioPerformance.degradation` give the gate's :class:`~pytest_dnnsafety.results.Measurement`.
What is not a sum over shards — the bootstrap of precision/recall/F1 resamples inputs, a user ``metric=`` is
called on whole tensors — gathers every rank's rows first. Pure torch; no pytest import.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.multilabel import (
    check_label_matrix,
    output_kind,
    predicted_sets,
    refuse_multilabel_options,
)
from pytest_dnnsafety.engines.performance.multilabel import score_counts
from pytest_dnnsafety.engines.performance.scenario import (
    ScenarioPerformanceEngine,
    ScenarioPerformanceResult,
)
from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.runtime import torchrun as ranks

__all__ = ["MultiLabelPerformance", "PerformanceOptions", "PerformanceRows", "ScenarioPerformance",
           "SingleLabelPerformance", "for_task"]


@dataclass(frozen=True)
class PerformanceOptions:
    """The options of a performance gate (its marker keywords, checked at collection) and what the errors name:
    ``marker`` and ``data`` (the data fixture's name); ``seed`` seeds the bootstrap."""

    marker: str
    data: str
    seed: int
    confidence: float = 0.95
    min_samples: int = 30
    allow_small_groups: bool = False
    allow_empty_groups: bool = False
    per_class: bool = False
    metric: Callable[[Tensor, Tensor], Any] | None = None
    score: str = "accuracy"
    average: str = "micro"
    decision_threshold: Any = None
    outputs: str | None = None
    replicates: int = 2000
    statistic: str = "point"

    @classmethod
    def of(cls, options: Mapping[str, Any], *, marker: str, data: str, seed: int) -> PerformanceOptions:
        """The record of a gate's ``options`` (keywords of other gates are left out)."""
        named = {"marker", "data", "seed"}  # not marker keywords
        given = {f.name: options[f.name] for f in fields(cls) if f.name in options and f.name not in named}
        return cls(marker=marker, data=data, seed=int(seed), **given)


@dataclass(frozen=True)
class PerformanceRows:
    """One rank's pass: its :class:`~pytest_dnnsafety.engines.core.capture.ModelOutputs`, its shard (None: the
    whole data) and, with ``per_class``, its (smallest label, largest label, largest prediction)."""

    out: Any
    shard: Any
    extremes: tuple[int, int, int] | None = None


class ScenarioPerformance(ABC):
    """What the task variants share: this rank's rows, the engine over the groups, a user metric, the readings."""

    task = ""

    def __init__(self, options: PerformanceOptions) -> None:
        self.options = options

    # ------------------------------------------------------------------ this rank's rows
    def rows(self, out: Any, groups: Any, shard: Any) -> PerformanceRows:
        """This rank's outputs checked: labelled, in range, and as many rows as the scenario table describes."""
        opts = self.options
        if out.labels is None:
            raise MetricError(f"the data (fixture {opts.data!r}) has no labels; accuracy per scenario needs them. "
                              "Fix: give labelled evaluation data, e.g. an .npz with arrays x and y")
        out.check_labels(opts.data)
        groups.check_rows(out.n_inputs if shard is None else shard.n_rows)
        extremes = None
        if opts.per_class:
            extremes = (int(out.labels.min()), int(out.labels.max()), int(out.predictions.max()))
        return PerformanceRows(out, shard, extremes)

    @abstractmethod
    def assess(self, rows: PerformanceRows, groups: Any) -> tuple[ScenarioPerformanceResult, dict[str, Any] | None]:
        """The per-group result and the user ``metric=``'s values (None without one)."""

    # ------------------------------------------------------------------ shared steps
    def _engine(self, groups: Any, device: Any, num_classes: int | None = None) -> ScenarioPerformanceEngine:
        opts = self.options
        return ScenarioPerformanceEngine(groups.by, groups.domains, feasible=groups.feasible,
                                         confidence=float(opts.confidence), min_samples=opts.min_samples,
                                         num_classes=num_classes, device=device)

    @staticmethod
    def _gathered(shard: Any, predicted: Tensor, labels: Tensor, device: Any) -> tuple[Tensor, Tensor]:
        """Every rank's rows in one tensor each (on ``device``), for what is not a sum over shards."""
        if shard is None:
            return predicted, labels
        parts = ranks.gather((predicted.cpu(), labels.cpu()))
        return torch.cat([p for p, _ in parts]).to(device), torch.cat([y for _, y in parts]).to(device)

    def _scored(self, groups: Any, predicted: Tensor, labels: Tensor,
                num_classes: int | None) -> tuple[ScenarioPerformanceResult, dict[str, Any] | None]:
        """Precision/recall/F1 of every rank's rows: bootstrap estimates per group."""
        opts = self.options
        engine = self._engine(groups, predicted.device)
        index = groups.index.to(engine.device)
        result = engine.compute_scores(index, score_counts(predicted, labels, num_classes), opts.score, opts.average,
                                       replicates=opts.replicates, seed=opts.seed, per_class=opts.per_class)
        return result, self._user_metric(result, index, predicted, labels)

    def _user_metric(self, result: ScenarioPerformanceResult, groups: Tensor, predictions: Tensor,
                     labels: Tensor) -> dict[str, Any] | None:
        """``metric(predictions, labels) -> float`` on all rows and on each group with rows (reported, not gated).

        One call per group (groups are few; the rows are never looped over in Python). A metric that
        raises or returns a non-finite number is an error naming it.
        """
        metric = self.options.metric
        if metric is None:
            return None
        name = getattr(metric, "__name__", type(metric).__name__)

        def call(mask: Tensor) -> float:
            try:
                value = float(metric(predictions[mask], labels[mask]))
            except Exception as exc:
                raise MetricError(f"metric {name!r} raised {type(exc).__name__}: {exc}. Fix: a metric is called as "
                                  f"metric(predictions, labels) with two 1-D int64 tensors and returns a "
                                  f"number") from exc
            if not math.isfinite(value):
                raise MetricError(f"metric {name!r} returned {value!r}. Fix: return a finite number")
            return value

        overall = call(groups >= 0)
        per_group = {g.label(): call(groups == g.index) for g in result.groups if g.size}
        return {"name": name, "overall": overall, "per_group": per_group}

    # ------------------------------------------------------------------ the gates' readings
    def inconclusive(self, result: ScenarioPerformanceResult) -> str | None:
        """Why the gate is inconclusive (empty or small groups not allowed); nothing assessable is an error."""
        opts = self.options
        problems = []
        if result.empty and not opts.allow_empty_groups:
            problems.append(f"{len(result.empty)} group(s) of the declared domain have no rows: "
                            + ", ".join(g.label() for g in result.empty[:10])
                            + (", …" if len(result.empty) > 10 else ""))
        if result.small and not opts.allow_small_groups:
            shown = ", ".join(f"{g.label()} ({g.size} rows)" for g in result.small[:10])
            problems.append(f"{len(result.small)} group(s) have fewer than min_samples={result.min_samples} rows "
                            f"and are not assessable: {shown}" + (", …" if len(result.small) > 10 else ""))
        if not problems:
            if not result.assessable:
                raise MetricError(f"no group of by={list(result.by)} has min_samples={result.min_samples} rows; "
                                  f"nothing to assess. Fix: lower min_samples or add evaluation data")
            return None
        fix = ("Fix: add evaluation data for these scenarios, declare impossible combinations as restrictions in the "
               "conditions file, or accept them with allow_empty_groups=True / allow_small_groups=True "
               "(they are then left out of the gated value)")
        return "; ".join(problems) + ". " + fix

    def min_accuracy(self, result: ScenarioPerformanceResult, user: dict[str, Any] | None) -> Measurement:
        """The worst assessable group's score and its lower bound (the gated number)."""
        why = self.inconclusive(result)
        worst = result.worst
        details = {**result.to_details(), **({"user_metric": user} if user else {})}
        if worst is None:  # only reachable when small groups are not allowed: inconclusive
            return Measurement(value=float("nan"), detail=result.detail(), details=details, inconclusive=why)
        return Measurement(value=worst.accuracy, bound=worst.lower, detail=result.detail(), details=details,
                           inconclusive=why)

    def degradation(self, result: ScenarioPerformanceResult, user: dict[str, Any] | None) -> Measurement:
        """The largest drop of an assessable group's score against the whole data (or its sound bound)."""
        why = self.inconclusive(result)
        statistic = self.options.statistic
        group = result.largest_degradation(statistic)
        details = {**result.to_details(), "statistic": statistic, **({"user_metric": user} if user else {})}
        if group is None:
            return Measurement(value=float("nan"), detail=result.detail(), details=details, inconclusive=why)
        if why is None and len(result.assessable) == 1 and group.size == result.n:  # compared with itself
            why = (f"only group {group.label()} has rows, so its accuracy is the whole data's and the drop is 0 by "
                   f"construction, not by measurement. Fix: add evaluation data for the other groups of "
                   f"by={list(result.by)}, or group by a condition whose values the data covers")
        what = "drop" if statistic == "point" else f"drop bound ({result.confidence:.0%}, U_all − L_group)"
        if result.bound_kind != "bound" and statistic == "bound":
            what += ", bootstrap estimate"
        count = f"{group.correct}/{group.size}" if result.score == "accuracy" else f"n={group.size}"
        detail = (f"largest {what} {group.label()}: {result.score_name} {group.accuracy:.3f} ({count}) vs "
                  f"overall {result.accuracy:.3f} (n={result.n}); {len(result.assessable)}/{len(result.groups)} "
                  f"groups assessable; scenario coverage {result.scenario_coverage:.3f}")
        bound = None if statistic == "point" else group.drop_bound
        return Measurement(value=group.drop, bound=bound, detail=detail, details=details, inconclusive=why)


class SingleLabelPerformance(ScenarioPerformance):
    """Class-index predictions: accuracy from summed hit counts (exact bounds), or one-hot precision/recall/F1."""

    task = "single-label"

    def assess(self, rows: PerformanceRows, groups: Any) -> tuple[ScenarioPerformanceResult, dict[str, Any] | None]:
        opts, out, shard = self.options, rows.out, rows.shard
        refuse_multilabel_options(opts.marker, {"decision_threshold": opts.decision_threshold,
                                                "outputs": opts.outputs}, multi=False)
        if opts.score != "accuracy":
            predicted, labels = self._gathered(shard, out.predictions, out.labels, out.predictions.device)
            k = out.num_classes or int(torch.maximum(predicted.max(), labels.max())) + 1
            out.check_labels(opts.data)
            return self._scored(groups, predicted, labels, k)
        num_classes = self._num_classes(rows)

        def count() -> ScenarioPerformanceEngine:
            engine = self._engine(groups, out.predictions.device, num_classes)
            index = groups.index.to(engine.device)
            mine = index if shard is None else index[shard.row_slice]  # the table rows of this rank's data rows
            engine.update(mine, out.predictions == out.labels, out.labels if num_classes else None)
            return engine

        engine = ranks.merged(count, shard)  # per-group (and per-class) row and hit counts: sum
        result = engine.compute()
        index = groups.index.to(engine.device)
        predictions, labels = out.predictions, out.labels
        if opts.metric is not None:  # not decomposable: every rank's rows in one tensor
            predictions, labels = self._gathered(shard, predictions, labels, index.device)
        return result, self._user_metric(result, index, predictions, labels)

    def _num_classes(self, rows: PerformanceRows) -> int | None:
        """The classes counted per group with ``per_class`` (the model's, else the largest label or prediction
        of any rank + 1); labels outside them are an error."""
        if not self.options.per_class:
            return None
        seen = ranks.gather(rows.extremes) if rows.shard is not None else [rows.extremes]
        low, high, top = min(e[0] for e in seen), max(e[1] for e in seen), max(e[2] for e in seen)
        num_classes = rows.out.num_classes or max(high, top) + 1
        if low < 0 or high >= num_classes:
            raise MetricError(f"labels range over {low}..{high} but the model has {num_classes} classes. Fix: give "
                              f"labels 0..{num_classes - 1}")
        return num_classes


class MultiLabelPerformance(ScenarioPerformance):
    """Predicted sets against the 0/1 label matrix: subset accuracy (exact bounds), or precision/recall/F1."""

    task = "multi-label"

    def assess(self, rows: PerformanceRows, groups: Any) -> tuple[ScenarioPerformanceResult, dict[str, Any] | None]:
        opts, out, shard = self.options, rows.out, rows.shard
        k = check_label_matrix(out, opts.marker, opts.data)
        threshold = 0.5 if opts.decision_threshold is None else opts.decision_threshold
        if isinstance(threshold, (list, tuple)) and len(threshold) != k:
            raise ConfigError(f"{opts.marker}: decision_threshold lists {len(threshold)} values but the model has {k} "
                              "outputs. Fix: one number, or one per class in the model's output order.")
        predicted = predicted_sets(out.logits, threshold, output_kind(opts.outputs, out.logits, shard is not None))
        if opts.per_class and opts.score == "accuracy":
            raise ConfigError(f"{opts.marker}: per_class=True with score='accuracy' on a multi-label model: subset "
                              "accuracy (all classes right) has no per-class value. Fix: score='recall', 'precision' "
                              "or 'f1' with per_class=True, or drop per_class.")
        predicted, labels = self._gathered(shard, predicted.long(), out.labels.to(predicted.device).long(),
                                           out.predictions.device)
        if opts.score != "accuracy":
            return self._scored(groups, predicted, labels, None)
        engine = self._engine(groups, predicted.device)  # subset accuracy: a proportion of inputs, exact bound
        index = groups.index.to(engine.device)
        engine.update(index, (predicted == labels).all(1))
        result = engine.compute()
        return result, self._user_metric(result, index, predicted, labels)


def for_task(task: str, options: PerformanceOptions) -> ScenarioPerformance:
    """The variant of ``task`` ('single-label' or 'multi-label'; the gates declare no other)."""
    return (MultiLabelPerformance if task == "multi-label" else SingleLabelPerformance)(options)
