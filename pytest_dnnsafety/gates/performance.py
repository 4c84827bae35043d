"""Built-in gate family: performance per scenario (``min_scenario_accuracy``, ``max_scenario_degradation``).

Cheng et al. 2018, §II-E. The evaluation rows are grouped by the values of the ``by`` conditions of
the scenario table (every value combination of their declared domains is a group, also one without
rows); the engine is :class:`~pytest_dnnsafety.engines.performance.scenario.ScenarioPerformanceEngine`. The
predictions come from the session's shared forward pass
(:func:`.shared.outputs_for`): one pass per model and data for all
gates, neuron gates included.

Groups with fewer than ``min_samples`` rows are *not assessable* and groups of the declared domain
with no row at all are *empty*; either makes the gate inconclusive (it fails, naming the groups)
unless ``allow_small_groups`` / ``allow_empty_groups`` says otherwise, and then they are left out of
the gated value. Groups the declared restrictions rule out are never required. Labels outside the
model's classes are an error (accuracy would be 0 everywhere, so nothing would "degrade"), and a
degradation with a single group holding every row is inconclusive (the data compared with itself).
No torch import at module level.

**Scores and multi-label models** (``tasks=("single-label", "multi-label")``). ``score="accuracy"``
(default) is the share of inputs decided right — for a multi-label model *subset accuracy*, every
class's decision right (a class is predicted when its probability, the sigmoid of a logit or the
output itself, reaches ``decision_threshold``; ``outputs=`` says which) — with the exact
Clopper–Pearson bounds. ``score="precision" | "recall" | "f1"`` with ``average="micro" | "macro"``
(either kind of model; single-label decisions count as one-hot) gate a group's point value on
``statistic="point"`` and a seeded bootstrap *estimate* of its bound (the details say
``bound_kind: "estimate"``; :mod:`pytest_dnnsafety.engines.inspection.multilabel`); ``per_class=True`` adds each
group's per-class values. ``decision_threshold``/``outputs`` on a single-label model are an error.
A user ``metric=`` of a multi-label model receives the ``(N, K)`` 0/1 predicted sets and labels.

Under torchrun (:mod:`pytest_dnnsafety.runtime.torchrun`) each rank forwards only its share of the data's
batches, counts its rows' groups (the scenario table rows sliced alike) and the engine's counts are
all-reduced (``sum``): the same counts, hence the same accuracies and Clopper–Pearson bounds, as one
process. A user ``metric=`` is not decomposable (a macro F1 is not a sum over shards): it is called
on every rank's predictions gathered into one tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Mapping

from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param, in_range, one_of
from pytest_dnnsafety.gates.inspection import _MULTI  # decision_threshold=, outputs= (multi-label only)
from pytest_dnnsafety.gates.shared import outputs_for

__all__ = ["MIN_SCENARIO_ACCURACY", "MAX_SCENARIO_DEGRADATION", "pytest_dnnsafety_register_gates"]


def _performance(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Any:
    """The gate's :class:`ScenarioPerformanceResult` (predictions from the session's shared pass)."""
    from pytest_dnnsafety.runtime import torchrun as ranks
    from pytest_dnnsafety.engines.performance.scenario import ScenarioPerformanceEngine, resolve_by
    from pytest_dnnsafety.scenarios import ScenarioTable, check_rows_match, count_samples

    opts = spec.options
    table = fx["scenarios"]
    if not isinstance(table, ScenarioTable):
        raise MetricError(f"fixture {spec.fixtures['scenarios']!r} returned {type(table).__name__}, not a "
                          "ScenarioTable. Fix: return pytest_dnnsafety.ScenarioTable(Conditions(...), rows)")
    resolve_by(table, _by_names(opts))  # an unknown condition is this gate's error, before any forward pass
    check_rows_match(table, count_samples(fx["data"]), table_fixture=spec.fixtures["scenarios"],
                     data_fixture=spec.fixtures["data"])
    shard = ctx.shard(fx["data"])  # None: the whole data on every rank

    def predict() -> tuple[Any, tuple[int, int, int] | None]:
        out = outputs_for(spec, fx, ctx, shard=shard)
        if out.labels is None:
            raise MetricError(f"the data (fixture {spec.fixtures['data']!r}) has no labels; accuracy per scenario "
                              "needs them. Fix: give labelled evaluation data, e.g. an .npz with arrays x and y")
        out.check_labels(spec.fixtures["data"])
        check_rows_match(table, out.n_inputs if shard is None else shard.n_rows,
                         table_fixture=spec.fixtures["scenarios"], data_fixture=spec.fixtures["data"])
        extremes = None
        if opts["per_class"]:
            extremes = (int(out.labels.min()), int(out.labels.max()), int(out.predictions.max()))
        return out, extremes

    out, extremes = ranks.together(predict, sharded=shard is not None)
    multi = ctx.task == "multi-label"
    predicted, labels = _decisions(spec, out, multi, shard)
    if multi or opts["score"] != "accuracy":
        return _scored(spec, fx, ctx, table, shard, out, predicted, labels, multi)
    num_classes = None
    if opts["per_class"]:
        seen = ranks.gather(extremes) if shard is not None else [extremes]
        low, high, top = min(e[0] for e in seen), max(e[1] for e in seen), max(e[2] for e in seen)
        num_classes = out.num_classes or max(high, top) + 1
        if low < 0 or high >= num_classes:
            raise MetricError(f"labels range over {low}..{high} but the model has {num_classes} classes. Fix: give "
                              f"labels 0..{num_classes - 1}")

    def count() -> tuple[Any, Any]:
        engine = ScenarioPerformanceEngine.from_table(table, _by_names(opts), confidence=float(opts["confidence"]),
                                                      min_samples=opts["min_samples"], num_classes=num_classes,
                                                      device=out.predictions.device)
        groups = engine.group_index(table)
        mine = groups if shard is None else groups[shard.row_slice]  # the table rows of this rank's data rows
        engine.update(mine, out.predictions == out.labels, out.labels if num_classes else None)
        return engine, groups

    engine, groups = ranks.together(count, sharded=shard is not None)
    if shard is not None:
        engine.sync()  # per-group (and per-class) row and hit counts: sum
    result = engine.compute()
    predictions, labels = out.predictions, out.labels
    if opts["metric"] is not None and shard is not None:  # not decomposable: every rank's rows in one tensor
        import torch

        parts = ranks.gather((predictions.cpu(), labels.cpu()))
        predictions = torch.cat([p for p, _ in parts]).to(groups.device)
        labels = torch.cat([y for _, y in parts]).to(groups.device)
    user = _user_metric(opts["metric"], result, groups, predictions, labels)
    return result, user


def _decisions(spec: GateSpec, out: Any, multi: bool, shard: Any) -> tuple[Any, Any]:
    """(predictions, labels): class indices for a single-label model, the multi-hot predicted set and the 0/1
    label matrix for a multi-label one; options that only a multi-label model reads are refused otherwise."""
    from pytest_dnnsafety.gates.inspection import output_kind, refuse_multilabel_options

    opts = spec.options
    refuse_multilabel_options(spec, multi)
    if not multi:
        return out.predictions, out.labels
    from pytest_dnnsafety.engines.core.multilabel import check_label_matrix, predicted_sets

    k = check_label_matrix(out, spec.marker, spec.fixtures["data"])
    threshold = 0.5 if opts["decision_threshold"] is None else opts["decision_threshold"]
    if isinstance(threshold, (list, tuple)) and len(threshold) != k:
        raise ConfigError(f"{spec.marker}: decision_threshold lists {len(threshold)} values but the model has {k} "
                          "outputs. Fix: one number, or one per class in the model's output order.")
    predicted = predicted_sets(out.logits, threshold, output_kind(spec, out.logits, shard))
    if opts["per_class"] and opts["score"] == "accuracy":
        raise ConfigError(f"{spec.marker}: per_class=True with score='accuracy' on a multi-label model: subset "
                          "accuracy (all classes right) has no per-class value. Fix: score='recall', 'precision' "
                          "or 'f1' with per_class=True, or drop per_class.")
    return predicted.long(), out.labels.to(predicted.device).long()


def _scored(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext, table: Any, shard: Any, out: Any,
            predicted: Any, labels: Any, multi: bool) -> tuple[Any, Any]:
    """Subset accuracy of a multi-label model (exact Clopper–Pearson), or precision/recall/F1 of either kind
    (bootstrap estimates; every rank's rows gathered first, the bootstrap resamples inputs)."""
    import torch

    from pytest_dnnsafety.runtime import torchrun as ranks
    from pytest_dnnsafety.engines.performance.multilabel import score_counts
    from pytest_dnnsafety.engines.performance.scenario import ScenarioPerformanceEngine

    opts = spec.options
    if shard is not None:  # not decomposable: every rank's rows in one tensor (as a user metric)
        parts = ranks.gather((predicted.cpu(), labels.cpu()))
        predicted = torch.cat([p for p, _ in parts]).to(out.predictions.device)
        labels = torch.cat([y for _, y in parts]).to(out.predictions.device)
    engine = ScenarioPerformanceEngine.from_table(table, _by_names(opts), confidence=float(opts["confidence"]),
                                                  min_samples=opts["min_samples"], device=predicted.device)
    groups = engine.group_index(table)
    if opts["score"] == "accuracy":  # multi-label subset accuracy: a proportion of inputs, exact bound
        engine.update(groups, (predicted == labels).all(1))
        result = engine.compute()
    else:
        k = None
        if not multi:
            k = out.num_classes or int(torch.maximum(predicted.max(), labels.max())) + 1
            out.check_labels(spec.fixtures["data"])
        counts = score_counts(predicted, labels, k)
        result = engine.compute_scores(groups, counts, opts["score"], opts["average"], replicates=opts["replicates"],
                                       seed=ctx.seed, per_class=opts["per_class"])
    return result, _user_metric(opts["metric"], result, groups, predicted, labels)


def _user_metric(metric: Any, result: Any, groups: Any, predictions: Any, labels: Any) -> dict[str, Any] | None:
    """``metric(predictions, labels) -> float`` on all rows and on each group with rows (reported, not gated).

    One call per group (groups are few; the rows are never looped over in Python). A metric that
    raises or returns a non-finite number is an error naming it.
    """
    if metric is None:
        return None
    import math

    name = getattr(metric, "__name__", type(metric).__name__)

    def call(mask: Any) -> float:
        try:
            value = float(metric(predictions[mask], labels[mask]))
        except Exception as exc:
            raise MetricError(f"metric {name!r} raised {type(exc).__name__}: {exc}. Fix: a metric is called as "
                              f"metric(predictions, labels) with two 1-D int64 tensors and returns a number") from exc
        if not math.isfinite(value):
            raise MetricError(f"metric {name!r} returned {value!r}. Fix: return a finite number")
        return value

    overall = call(groups >= 0)
    per_group = {g.label(): call(groups == g.index) for g in result.groups if g.size}
    return {"name": name, "overall": overall, "per_group": per_group}


def _missing(spec: GateSpec, result: Any) -> str | None:
    """Why the gate is inconclusive (empty or small groups not allowed), and the details to add."""
    opts = spec.options
    problems = []
    if result.empty and not opts["allow_empty_groups"]:
        problems.append(f"{len(result.empty)} group(s) of the declared domain have no rows: "
                        + ", ".join(g.label() for g in result.empty[:10]) + (", …" if len(result.empty) > 10 else ""))
    if result.small and not opts["allow_small_groups"]:
        shown = ", ".join(f"{g.label()} ({g.size} rows)" for g in result.small[:10])
        problems.append(f"{len(result.small)} group(s) have fewer than min_samples={result.min_samples} rows and are "
                        f"not assessable: {shown}" + (", …" if len(result.small) > 10 else ""))
    if not problems:
        if not result.assessable:
            raise MetricError(f"no group of by={list(result.by)} has min_samples={result.min_samples} rows; nothing "
                              f"to assess. Fix: lower min_samples or add evaluation data")
        return None
    fix = ("Fix: add evaluation data for these scenarios, declare impossible combinations as restrictions in the "
           "conditions file, or accept them with allow_empty_groups=True / allow_small_groups=True "
           "(they are then left out of the gated value)")
    return "; ".join(problems) + ". " + fix


def _measure_min_accuracy(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """The worst assessable group's accuracy and its one-sided Clopper–Pearson lower bound (the gated number)."""
    result, user = _performance(spec, fx, ctx)
    why = _missing(spec, result)
    worst = result.worst
    details = {**result.to_details(), **({"user_metric": user} if user else {})}
    if worst is None:  # only reachable when small groups are not allowed: inconclusive below
        return Measurement(value=float("nan"), detail=result.detail(), details=details, inconclusive=why)
    return Measurement(value=worst.accuracy, bound=worst.lower, detail=result.detail(), details=details,
                       inconclusive=why)


def _measure_degradation(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """The largest drop of an assessable group's accuracy against the whole data (or its sound bound)."""
    result, user = _performance(spec, fx, ctx)
    why = _missing(spec, result)
    statistic = spec.options["statistic"]
    group = result.largest_degradation(statistic)
    details = {**result.to_details(), "statistic": statistic, **({"user_metric": user} if user else {})}
    if group is None:
        return Measurement(value=float("nan"), detail=result.detail(), details=details, inconclusive=why)
    if why is None and len(result.assessable) == 1 and group.size == result.n:  # compared with itself: 0 by construction
        why = (f"only group {group.label()} has rows, so its accuracy is the whole data's and the drop is 0 by "
               f"construction, not by measurement. Fix: add evaluation data for the other groups of "
               f"by={list(result.by)}, or group by a condition whose values the data covers")
    what = "drop" if statistic == "point" else f"drop bound ({result.confidence:.0%}, U_all − L_group)"
    if result.bound_kind != "bound" and statistic == "bound":
        what += ", bootstrap estimate"
    count = f"{group.correct}/{group.size}" if result.score == "accuracy" else f"n={group.size}"
    detail = (f"largest {what} {group.label()}: {result.score_name} {group.accuracy:.3f} ({count}) vs "
              f"overall {result.accuracy:.3f} (n={result.n}); {len(result.assessable)}/{len(result.groups)} groups "
              f"assessable; scenario coverage {result.scenario_coverage:.3f}")
    if statistic == "point":
        return Measurement(value=group.drop, detail=detail, details=details, inconclusive=why)
    return Measurement(value=group.drop, bound=group.drop_bound, detail=detail, details=details, inconclusive=why)


# ------------------------------------------------------------------------------------- marker keywords


def _by_names(opts: Mapping[str, Any]) -> list[str]:
    """``by=`` as a list of condition names (one name may be given as a string)."""
    by = opts["by"]
    return [by] if isinstance(by, str) else list(by)


def _by_list(value: Any) -> str | None:
    if isinstance(value, str):
        value = [value]
    if not value:
        return "is empty; name at least one condition of the scenario table"
    for name in value:
        if not isinstance(name, str) or not name:
            return f"{name!r} is not a condition name (a non-empty string)"
    if len(set(value)) != len(value):
        return f"{list(value)!r} names a condition twice"
    return None


def _open_unit(value: Any) -> str | None:
    return None if 0 < value < 1 else f"{value!r} must lie strictly between 0 and 1"


_COMMON = (
    Param("by", (list, tuple, str), REQUIRED, _by_list,
          "name the scenario table's conditions to group by, e.g. by=\"lighting\" or by=[\"lighting\", \"noise\"]"),
    Param("confidence", (int, float), 0.95, _open_unit,
          "give the one-sided confidence of the Clopper–Pearson bounds strictly between 0 and 1, e.g. 0.95"),
    Param("min_samples", (int,), 30, in_range(1, 10**9),
          "give the rows a group needs to be assessed, a positive integer, e.g. min_samples=30"),
    Param("allow_small_groups", (bool,), False, None,
          "True leaves groups below min_samples out of the gate instead of failing it"),
    Param("allow_empty_groups", (bool,), False, None,
          "True leaves groups of the declared domain without any row out of the gate instead of failing it"),
    Param("per_class", (bool,), False, None, "True adds each group's per-class recall to the details"),
    Param("metric", (type(None), Callable), None, None,
          "give a callable metric(predictions, labels) -> float to report per group (e.g. a macro F1)"),
    Param("score", (str,), "accuracy", one_of("accuracy", "precision", "recall", "f1"),
          "use 'accuracy' (multi-label: subset accuracy, all classes right), 'precision', 'recall' or 'f1'"),
    Param("average", (str,), "micro", one_of("micro", "macro"),
          "use 'micro' (counts pooled over classes) or 'macro' (mean of the per-class values)"),
    *_MULTI,
    Param("replicates", (int,), 2000, in_range(100, 10**6),
          "give the bootstrap replicates of the precision/recall/F1 bounds, e.g. replicates=2000"),
)
_FIXTURES = {"model": "model", "data": "dataset", "scenarios": "scenario_table"}

MIN_SCENARIO_ACCURACY = GateDef(
    marker="min_scenario_accuracy",
    metric="worst scenario group accuracy",
    op=">=",
    threshold_range=(0.0, 1.0),
    params=_COMMON,
    fixtures=_FIXTURES,
    measure=_measure_min_accuracy,
    tasks=("single-label", "multi-label"),
    shards=True,
    doc="fail unless every scenario group of the `by` conditions has an accuracy whose one-sided Clopper–Pearson "
        "lower bound at `confidence` reaches `threshold` (Cheng et al. 2018, §II-E); groups below `min_samples` "
        "rows or without rows fail the gate unless allowed",
)

MAX_SCENARIO_DEGRADATION = GateDef(
    marker="max_scenario_degradation",
    metric="largest scenario accuracy degradation",
    op="<=",
    threshold_range=(0.0, 1.0),
    params=(*_COMMON,
            Param("statistic", (str,), "point", one_of("point", "bound"),
                  "use 'point' (overall accuracy − group accuracy) or 'bound' (a sound upper confidence bound "
                  "on that drop)")),
    fixtures=_FIXTURES,
    measure=_measure_degradation,
    tasks=("single-label", "multi-label"),
    shards=True,
    doc="fail if some scenario group of the `by` conditions is more than `threshold` less accurate than the whole "
        "data (point estimate, or its upper bound with statistic='bound'); groups below `min_samples` rows or "
        "without rows fail the gate unless allowed; a single group holding every row is inconclusive",
)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add(MIN_SCENARIO_ACCURACY)
    registry.add(MAX_SCENARIO_DEGRADATION)
