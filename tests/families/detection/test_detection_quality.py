"""The detection gates' steps on hand-made passes: the matching plan of ``iou=``, one pass matched in batches, and the
worst scenario group's mAP and recall with the problems that make a reading inconclusive or an error.

Ten images, one object each in the first eight: a day image's object is found exactly (score 0.9), a night image's
is missed, and the two dusk images hold no object at all.
"""

from __future__ import annotations

import pytest
import torch

from pytest_dnnsafety.data.tasks import BoxSet
from pytest_dnnsafety.engines.core.capture import ModelOutputs
from pytest_dnnsafety.engines.detection.matching import BoxMatchEngine
from pytest_dnnsafety.engines.detection.quality import (
    QualityOptions,
    match_detections,
    match_plan,
    worst_map,
    worst_recall,
)
from pytest_dnnsafety.errors import DataError, MetricError
from pytest_dnnsafety.scenarios import Conditions, ScenarioTable
from pytest_dnnsafety.scenarios.groups import ScenarioGroups

LIGHTING = ["day"] * 4 + ["night"] * 4 + ["dusk"] * 2
FIXTURES = {"scenarios": "scenario_table", "data": "dataset"}
BOX = [0.0, 0.0, 10.0, 10.0]


def _pass() -> ModelOutputs:
    targets = BoxSet(torch.tensor([BOX] * 8), torch.zeros(8, dtype=torch.int64), torch.arange(8), 10)
    found = BoxSet(torch.tensor([BOX] * 4), torch.zeros(4, dtype=torch.int64), torch.arange(4), 10,
                   torch.full((4,), 0.9))
    return ModelOutputs(torch.zeros(10, dtype=torch.int64), torch.ones(10), targets, None, detections=found)


def _engine(thresholds: tuple[float, ...] | None = None, batch_size: int = 3) -> BoxMatchEngine:
    return match_detections(_pass(), thresholds, max_detections=100, batch_size=batch_size, shard=None,
                            marker="min_detection_recall", data="dataset")


def _groups(by: tuple[str, ...] = ("lighting",)) -> ScenarioGroups:
    table = ScenarioTable(Conditions({"lighting": ["day", "dusk", "night"]}), [{"lighting": v} for v in LIGHTING])
    return ScenarioGroups.of(table if by else None, list(by), n_rows=10, fixtures=FIXTURES)


def _options(**options: object) -> QualityOptions:
    return QualityOptions.of({"min_images": 1, "bootstrap": 100, **options}, marker="min_detection_recall", seed=0)


@pytest.mark.parametrize(("iou", "plan"), [
    ("0.5:0.95", (None, list(range(10)))), (" 0.5:0.95 ", (None, list(range(10)))), (0.5, (None, [0])),
    ("0.75", (None, [5])), (0.62, ((0.62,), [0])),
])
def test_an_iou_among_cocos_ten_shares_their_matching(iou: object, plan: tuple) -> None:
    assert match_plan(iou) == plan


def test_one_pass_matched_in_batches_is_the_pass_matched_at_once() -> None:
    batched, whole = _engine(batch_size=3), _engine(batch_size=100)
    assert batched.n_images == whole.n_images == 10
    assert all(torch.equal(a, b) for a, b in zip(batched.records(), whole.records()))


def test_a_classifier_or_data_without_boxes_is_an_error_naming_the_marker() -> None:
    classifier = ModelOutputs(torch.zeros(4, dtype=torch.int64), torch.ones(4), torch.zeros(4), 3)
    with pytest.raises(MetricError, match="min_detection_recall: the model returned class scores, not detections"):
        match_detections(classifier, None, max_detections=100, batch_size=2, shard=None, marker="min_detection_recall",
                         data="dataset")
    boxless = ModelOutputs(torch.zeros(4, dtype=torch.int64), torch.ones(4), None, None, detections=_pass().detections)
    with pytest.raises(DataError, match="the data \\(fixture 'dataset'\\) has no boxes"):
        match_detections(boxless, None, max_detections=100, batch_size=2, shard=None, marker="min_detection_recall",
                         data="dataset")


def test_the_worst_group_is_the_night_and_a_group_without_objects_is_inconclusive() -> None:
    m = worst_recall(_engine((0.5,)), _groups(), [0], _options(iou=0.5, statistic="estimate"))
    assert m.value == 0.0 and m.bound is None and m.details["worst_group"] == "lighting=night"
    assert m.detail.startswith("worst lighting=night, class 0: recall 0.000 at score ≥ 0.5, IoU ≥ 0.5, the estimate "
                               "is compared (statistic='estimate')")
    assert m.inconclusive.startswith("1 group(s) hold no ground-truth object, so their recall is undefined: "
                                     "lighting=dusk")
    assert [row["group"] for row in m.details["recall_groups"]] == ["lighting=day", "lighting=night"]


def test_all_images_as_one_group_give_cocos_map() -> None:
    m = worst_map(_engine(), _groups(()), list(range(10)), _options())
    # half of the objects found at full precision: precision 1 at the 51 recall points 0.00 … 0.50, 0 after
    assert m.value == pytest.approx(51 / 101) and m.bound == m.details["map_groups"][0]["lower"]
    assert m.details["worst_group"] == "all" and m.details["by"] == [] and m.inconclusive is None
    assert m.detail.startswith(f"worst group all: mAP@[.5:.95] {51 / 101:.3f}, 95% wide (min of BCa and "
                                f"bias-extrapolated, at 1 − α/5) bootstrap lower bound")


def test_small_groups_are_inconclusive_unless_allowed_and_nothing_assessable_is_an_error() -> None:
    m = worst_map(_engine(), _groups(), list(range(10)), _options(min_images=3))
    assert m.details["small_groups"] == ["lighting=dusk (2 images)"]
    assert m.inconclusive.startswith("1 group(s) have fewer than min_images=3 images: lighting=dusk (2 images)")
    with pytest.raises(MetricError, match="min_detection_recall: no group of by=\\['lighting'\\] has min_images=5 "
                                          "images with at least one ground-truth object; nothing to assess; 3 "
                                          "group\\(s\\) have fewer"):
        worst_map(_engine(), _groups(), list(range(10)), _options(min_images=5))
