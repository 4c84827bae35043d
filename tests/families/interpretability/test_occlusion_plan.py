"""The occlusion gates' plan (:mod:`pytest_dnnsafety.engines.interpretability.plan`): the task variants, the values a
shared run is keyed by, the run itself, and when a value is a convention rather than a measurement of the model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pytest_dnnsafety.engines.interpretability.detector import DetectorOcclusion
from pytest_dnnsafety.engines.interpretability.occlusion import OcclusionResult, assess_occlusion
from pytest_dnnsafety.engines.interpretability.plan import ClassifierOcclusion, DetectorOcclusionPlan, OcclusionPlan
from pytest_dnnsafety.errors import ConfigError

#: the options of an occlusion marker as the marker parser gives them (defaults filled in)
OPTIONS: dict[str, Any] = {"size": 2, "stride": 1, "fill": 0.0, "rho": 0.5, "aggregate": "mean",
                           "target": "predicted", "no_hot": "skip", "empty_mask": "error", "outputs": "auto",
                           "max_batch": 4096, "iou": 0.5}


def _result(**given: Any) -> OcclusionResult:
    fields = {"n": 3, "n_interpret": 3, "n_occsen": 3, "no_hot": 0, "empty_masks": 0, "interpret_mean": 0.5,
              "interpret_min": 0.25, "interpret_max": 0.75, "occsen_mean": 0.4, "occsen_min": 0.1,
              "occsen_max": 0.9, "hot_total": 9, "occluding_total": 30, "both_total": 5, "below_rho": 0}
    return OcclusionResult(**{**fields, **given})


def test_for_task_picks_the_variant_and_the_gates_share_one_run() -> None:
    plan = OcclusionPlan.for_task("single-label", "min_interpretation_precision", OPTIONS)
    assert isinstance(plan, ClassifierOcclusion) and plan.needs_masks and plan.size == (2, 2)
    other = OcclusionPlan.for_task("single-label", "max_occlusion_sensitivity", {**OPTIONS, "aggregate": "max"})
    assert other.key(16, "cpu") == plan.key(16, "cpu")  # the aggregate is the gate's own, not the run's
    assert OcclusionPlan.for_task("single-label", "m", {**OPTIONS, "rho": 0.4}).key(16, "cpu") != plan.key(16, "cpu")
    detector = OcclusionPlan.for_task("detection", "m", {**OPTIONS, "stride": (1, 2)})
    assert isinstance(detector, DetectorOcclusionPlan) and not detector.needs_masks
    assert detector.memo_name != plan.memo_name and detector.stride == (1, 2)


def test_a_detector_refuses_outputs() -> None:
    with pytest.raises(ConfigError, match="m: outputs='logits' is for classifiers; .*Fix: drop outputs= for a "
                                          "detector"):
        OcclusionPlan.for_task("detection", "m", {**OPTIONS, "outputs": "logits"})


def test_the_classifier_plan_runs_assess_occlusion_and_words_its_value() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(2 * 8 * 8, 3)).eval()
    x, y = torch.rand(12, 1, 8, 8), torch.arange(12) % 3
    masks = x[:, 0] > 0.5
    plan = OcclusionPlan.for_task("single-label", "min_interpretation_precision", OPTIONS)
    result = plan.assess(model, (x, y), masks, batch_size=8, device="cpu")
    direct = assess_occlusion(model, (x, y), masks, size=2, batch_size=8)
    assert result.interpret_mean == direct.interpret_mean and result.occsen_max == direct.occsen_max
    report = plan.report(result, "interpret")
    assert report["value"] == result.interpret_mean
    assert report["detail"].startswith("occluder 2x2, stride 1x1, fill 0, ρ=0.5, predicted class: M_interpret mean ")
    assert report["details"]["gated"] == "M_interpret" and report["details"]["aggregate"] == "mean"


def test_no_signal_is_inconclusive() -> None:
    plan = OcclusionPlan.for_task("single-label", "m", OPTIONS)
    assert plan.report(_result(), "occsen")["inconclusive"] is None
    why = plan.report(_result(below_rho=3), "occsen")["inconclusive"]
    assert "below ρ=0.5 on every one of the 3 inputs" in why and "M_OccSen reflects the masks' geometry" in why
    convention = OcclusionPlan.for_task("single-label", "m", {**OPTIONS, "no_hot": "one"})
    assert "no_hot='one''s convention" in convention.report(_result(no_hot=3), "interpret")["inconclusive"]
    assert convention.report(_result(no_hot=3), "occsen")["inconclusive"] is None  # M_OccSen is defined


def test_a_detector_missing_every_object_is_inconclusive_as_a_classifier_and_the_strict_reading_is_chosen() -> None:
    """Issue #29 §2: the same situation, the same verdict across tasks (a classifier below ρ everywhere is
    inconclusive, so is a detector that misses every object, in either reading); missing some objects is measured."""
    plan = OcclusionPlan.for_task("detection", "m", OPTIONS)
    setup = {"occluding": "ground-truth boxes"}
    both = DetectorOcclusion(_result(below_rho=3, setup=setup), _result(below_rho=3, occsen_mean=0.0, setup=setup))
    report = plan.report(both, "occsen")
    assert report["value"] == 0.4 and report["details"]["missed_objects"] == 3
    assert report["inconclusive"].startswith("the detector misses every object: its matched score is below ρ=0.5 on "
                                             "every one of the 3 ground-truth objects")
    assert "IoU ≥ 0.5; occluding = ground-truth boxes); 3 of 3 objects missed" in report["detail"]
    strict = plan.report(both, "occsen", strict=True)
    assert strict["value"] == 0.0 and strict["inconclusive"] == report["inconclusive"]
    some = DetectorOcclusion(_result(below_rho=2, setup=setup), _result(below_rho=2, occsen_mean=0.0, setup=setup))
    assert plan.report(some, "occsen")["inconclusive"] is None
    assert plan.report(some, "occsen", strict=True)["inconclusive"] is None
