"""The performance family's task variants on hand-made passes: dispatch by task, known answers per scenario group,
the readings the gates report, and the errors that name the marker and the data fixture.
"""

from __future__ import annotations

import math

import pytest
import torch

from pytest_dnnsafety.engines.core.capture import ModelOutputs
from pytest_dnnsafety.engines.performance.tasks import (
    MultiLabelPerformance,
    PerformanceOptions,
    SingleLabelPerformance,
    for_task,
)
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.scenarios import Conditions, ScenarioTable
from pytest_dnnsafety.scenarios.groups import ScenarioGroups

FIXTURES = {"scenarios": "scenario_table", "data": "dataset"}
#: 6 day rows, then 4 night rows
LIGHTING = ["day"] * 6 + ["night"] * 4


def _groups(lighting: list[str] = LIGHTING) -> ScenarioGroups:
    table = ScenarioTable(Conditions({"lighting": ["day", "night"]}), [{"lighting": v} for v in lighting])
    return ScenarioGroups.of(table, ["lighting"], n_rows=len(table), fixtures=FIXTURES)


def _options(**options: object) -> PerformanceOptions:
    return PerformanceOptions.of({"min_samples": 1, **options}, marker="min_scenario_accuracy", data="dataset",
                                 seed=0)


def _single(predictions: list[int], labels: list[int] | None, k: int = 3) -> ModelOutputs:
    p = torch.tensor(predictions)
    logits = torch.nn.functional.one_hot(p, k).float()
    return ModelOutputs(p, torch.ones(len(p)), None if labels is None else torch.tensor(labels), k, logits)


def _assess(task: object, out: ModelOutputs, groups: ScenarioGroups) -> tuple:
    return task.assess(task.rows(out, groups, None), groups)


def test_the_task_picks_the_variant_and_the_options_keep_their_own_keywords() -> None:
    opts = PerformanceOptions.of({"by": "lighting", "seed": 9, "score": "f1", "min_samples": 5}, marker="m",
                                 data="d", seed=3)
    assert (opts.score, opts.min_samples, opts.seed, opts.statistic) == ("f1", 5, 3, "point")
    assert isinstance(for_task("single-label", opts), SingleLabelPerformance)
    assert isinstance(for_task("multi-label", opts), MultiLabelPerformance)


def test_single_label_accuracy_per_group_and_the_worst_group() -> None:
    labels = [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    predictions = [0, 1, 2, 0, 1, 0, 0, 2, 1, 0]  # day: 5/6 right, night: 2/4 right
    task = for_task("single-label", _options(metric=lambda p, y: float((p == y).double().mean())))
    result, user = _assess(task, _single(predictions, labels), _groups())
    day, night = result.groups
    assert (day.correct, day.size, night.correct, night.size) == (5, 6, 2, 4)
    assert user["overall"] == pytest.approx(0.7) and user["per_group"] == {"lighting=day": pytest.approx(5 / 6),
                                                                            "lighting=night": 0.5}
    m = task.min_accuracy(result, user)
    assert m.value == 0.5 and m.bound == night.lower and m.inconclusive is None
    assert m.details["worst_group"] == "lighting=night" and list(m.details)[-1] == "user_metric"
    drop = for_task("single-label", _options(statistic="bound")).degradation(result, None)
    assert drop.value == pytest.approx(0.7 - 0.5) and drop.bound == night.drop_bound
    assert drop.detail.startswith("largest drop bound (95%, U_all − L_group) lighting=night: accuracy 0.500 (2/4)")


def test_per_class_counts_every_class_of_the_labels_and_predictions() -> None:
    task = for_task("single-label", _options(per_class=True))
    result, _ = _assess(task, _single([0, 1, 1, 0, 1, 1, 0, 1, 1, 0], [0] * 10, k=2), _groups())
    assert result.groups[0].class_sizes == (6, 0) and result.groups[0].recall == (pytest.approx(2 / 6), None)


def test_small_and_empty_groups_make_the_reading_inconclusive_unless_allowed() -> None:
    out = _single([0] * 10, [0] * 10)
    groups = _groups(["day"] * 10)
    result, _ = _assess(for_task("single-label", _options()), out, groups)
    m = for_task("single-label", _options()).min_accuracy(result, None)
    assert m.inconclusive.startswith("1 group(s) of the declared domain have no rows: lighting=night. Fix:")
    drop = for_task("single-label", _options(allow_empty_groups=True)).degradation(result, None)
    assert drop.value == 0 and drop.inconclusive.startswith("only group lighting=day has rows")
    with pytest.raises(MetricError, match="no group of by=\\['lighting'\\] has min_samples=30 rows"):
        task = for_task("single-label", _options(min_samples=30, allow_small_groups=True, allow_empty_groups=True))
        task.min_accuracy(_assess(task, out, groups)[0], None)


def test_single_label_refuses_multi_label_options_and_unlabelled_or_misaligned_data() -> None:
    task = for_task("single-label", _options(decision_threshold=0.3))
    with pytest.raises(ConfigError, match="min_scenario_accuracy: decision_threshold only applies to multi-label"):
        _assess(task, _single([0] * 10, [0] * 10), _groups())
    task = for_task("single-label", _options())
    with pytest.raises(MetricError, match="fixture 'dataset'\\) has no labels"):
        task.rows(_single([0] * 10, None), _groups(), None)
    with pytest.raises(MetricError, match="10 rows but the data has 9 samples"):
        task.rows(_single([0] * 9, [0] * 9), _groups(), None)
    with pytest.raises(DataError, match="range over 0..5"):
        task.rows(_single([0] * 10, [5] + [0] * 9), _groups(), None)


def test_single_label_f1_is_a_bootstrap_estimate() -> None:
    task = for_task("single-label", _options(score="f1", average="macro", replicates=200))
    decisions = [0, 1, 2, 0, 1, 2, 0, 0, 0, 0]  # all right; night holds class 0 only
    result, _ = _assess(task, _single(decisions, decisions), _groups())
    assert result.bound_kind == "estimate" and result.score_name == "macro f1"
    assert [g.accuracy for g in result.groups] == [1.0, pytest.approx(1 / 3)]  # an absent class's F1 counts 0


def test_multi_label_subset_accuracy_from_the_predicted_sets() -> None:
    logits = torch.tensor([[3.0, -3.0]] * 6 + [[3.0, 3.0]] * 4)  # night predicts both classes
    labels = torch.tensor([[1, 0]] * 10)
    out = ModelOutputs(torch.zeros(10, dtype=torch.int64), torch.ones(10), labels, 2, logits)
    task = for_task("multi-label", _options(outputs="logits"))
    result, _ = _assess(task, out, _groups())
    assert [(g.correct, g.size) for g in result.groups] == [(6, 6), (0, 4)] and result.bound_kind == "bound"
    strict = for_task("multi-label", _options(decision_threshold=[0.5, 0.99]))
    assert [g.correct for g in _assess(strict, out, _groups())[0].groups] == [6, 4]
    with pytest.raises(ConfigError, match="decision_threshold lists 3 values but the model has 2 outputs"):
        _assess(for_task("multi-label", _options(decision_threshold=[0.5, 0.5, 0.5])), out, _groups())
    with pytest.raises(ConfigError, match="per_class=True with score='accuracy' on a multi-label model"):
        _assess(for_task("multi-label", _options(per_class=True)), out, _groups())
    recall = for_task("multi-label", _options(score="recall", per_class=True, replicates=200))
    result, _ = _assess(recall, out, _groups())
    assert [g.accuracy for g in result.groups] == [1.0, 1.0] and math.isclose(result.groups[1].per_class[0], 1.0)
