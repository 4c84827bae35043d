"""Built-in gate family: performance per scenario (``min_scenario_accuracy``, ``max_scenario_degradation``).

Cheng et al. 2018, §II-E. The evaluation rows are grouped by the values of the ``by`` conditions of
the scenario table (every value combination of their declared domains is a group, also one without
rows; :class:`~pytest_dnnsafety.scenarios.groups.ScenarioGroups`); the engine is
:class:`~pytest_dnnsafety.engines.performance.scenario.ScenarioPerformanceEngine`, read by the task variants of
:mod:`pytest_dnnsafety.engines.performance.tasks` (single-label, multi-label; they also give the gates' readings).
The predictions come from the session's shared forward pass (:func:`.shared.outputs_for`): one pass per model
and data for all gates, neuron gates included.

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
``bound_kind: "estimate"``; :mod:`pytest_dnnsafety.engines.performance.multilabel`); ``per_class=True`` adds each
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

from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.gates.family import Family
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.gates.core import REQUIRED, GateContext, GateDef, GateRegistry, GateSpec, Param
from pytest_dnnsafety.gates.checks import in_range, one_of
from pytest_dnnsafety.gates.inspection import _MULTI  # decision_threshold=, outputs= (multi-label only)
from pytest_dnnsafety.gates.shared import outputs_for, scenario_table, together

__all__ = ["MIN_SCENARIO_ACCURACY", "MAX_SCENARIO_DEGRADATION", "pytest_dnnsafety_register_gates"]


def _measure(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """``min_scenario_accuracy``: the worst assessable group's accuracy and its one-sided Clopper–Pearson lower bound
    (the gated number); ``max_scenario_degradation``: the largest drop of an assessable group's accuracy against the
    whole data (or its sound bound). Both read the same per-row records of the shared forward pass."""
    from pytest_dnnsafety.engines.performance.tasks import PerformanceOptions, for_task
    from pytest_dnnsafety.scenarios.groups import ScenarioGroups, by_names

    task = for_task(ctx.task, PerformanceOptions.of(spec.options, marker=spec.marker, data=spec.fixtures["data"],
                                                    seed=ctx.seed))
    groups = ScenarioGroups.of(scenario_table(spec, fx), by_names(spec.options), data=fx["data"],
                               fixtures=spec.fixtures)
    rows = together(spec, fx, ctx, lambda shard: task.rows(outputs_for(spec, fx, ctx, shard=shard), groups, shard))
    reading = task.min_accuracy if spec.marker == "min_scenario_accuracy" else task.degradation
    return reading(*task.assess(rows, groups))


# ------------------------------------------------------------------------------------- marker keywords


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
    measure=_measure,
    tasks=("single-label", "multi-label"),
    shards=True,
    outputs_only=True,  # reads the shared pass's outputs only: recorded predictions can stand in for the model
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
    measure=_measure,
    tasks=("single-label", "multi-label"),
    shards=True,
    outputs_only=True,  # reads the shared pass's outputs only: recorded predictions can stand in for the model
    signal=("model", "data"),  # relative: a model at chance degrades nowhere
    doc="fail if some scenario group of the `by` conditions is more than `threshold` less accurate than the whole "
        "data (point estimate, or its upper bound with statistic='bound'); groups below `min_samples` rows or "
        "without rows fail the gate unless allowed; a single group holding every row is inconclusive",
)


#: The performance family, declared once: its gates, its docs title and the plots of their details.
FAMILY = Family("performance", "Performance per scenario", (MIN_SCENARIO_ACCURACY, MAX_SCENARIO_DEGRADATION), order=50)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add_family(FAMILY)
