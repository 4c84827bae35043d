"""The relative gates' shared precondition (:mod:`pytest_dnnsafety.engines.core.signal`, issue #29 §2): known answers.

Each case on hand-made :class:`~pytest_dnnsafety.engines.core.capture.ModelOutputs`: a classifier at chance, a
collapsed one, one better than chance, unlabelled data; a detector without a detection above 0.5 and one with;
a multi-label model predicting nothing (as logits and as probabilities) and one predicting; the counts of two
shards merged equal the whole's; the confidence-loss check (robustness) uses the same bound.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pytest_dnnsafety.data.tasks import BoxSet
from pytest_dnnsafety.engines.core.capture import ModelOutputs
from pytest_dnnsafety.engines.core.signal import SignalCounts, chance_lower_bound
from pytest_dnnsafety.engines.robustness.plan import at_chance
from pytest_dnnsafety.stats.intervals import clopper_pearson_lower


def _classifier(predictions: list[int], labels: list[int] | None, k: int = 4) -> ModelOutputs:
    p = torch.tensor(predictions)
    return ModelOutputs(p, torch.ones(len(p)), None if labels is None else torch.tensor(labels), k,
                        torch.nn.functional.one_hot(p, k).float())


def test_chance_lower_bound_is_the_one_sided_clopper_pearson_bound() -> None:
    lower, above = chance_lower_bound(60, 100, 0.5)
    assert lower == pytest.approx(float(clopper_pearson_lower([60], 100, 0.95)[0])) and lower == pytest.approx(0.5130,
                                                                                                             abs=1e-4)
    assert above and not chance_lower_bound(58, 100, 0.5)[1]
    assert chance_lower_bound(0, 0, 0.1) == (0.0, False)


def test_a_classifier_at_chance_and_a_collapsed_one_give_no_signal_with_the_numbers() -> None:
    labels = [0, 1, 2, 3] * 50 + [0] * 40  # 240 inputs, most frequent label 0: 90/240 = 0.375
    collapsed = SignalCounts.of(_classifier([0] * 240, labels), "single-label")
    why = collapsed.reason("dataset")
    lower = float(clopper_pearson_lower([90], 240, 0.95)[0])
    assert why == (f"no signal: the model's accuracy 0.375 (90/240; 95% Clopper–Pearson lower bound {lower:.3f}) is "
                   "not above chance 0.375 (the share of the most frequent label, 4 classes, 240 inputs of fixture "
                   "'dataset'); it predicts 1 of 4 classes; a relative gate compares nothing on a model that is not "
                   "shown better than chance. Fix: check the model (weights loaded? eval mode? the right model for "
                   "this data?) and the data's labels (the model's class order?); gate a model that is better than "
                   "chance")
    details = collapsed.to_details()
    assert details["accuracy"] == 0.375 and details["chance_accuracy"] == 0.375 and details["above_chance"] is False
    assert details["predicted_classes"] == 1 and details["accuracy_lower_bound"] == pytest.approx(lower)
    shifted = [(y + 1) % 4 for y in labels]  # every answer wrong, all classes predicted
    assert "accuracy 0.000 (0/240" in SignalCounts.of(_classifier(shifted, labels), "single-label").reason()
    good = SignalCounts.of(_classifier(labels[:200] + [1] * 40, labels), "single-label")
    assert good.reason() is None and good.to_details()["above_chance"] is True


def test_unlabelled_data_are_not_checked() -> None:
    counts = SignalCounts.of(_classifier([0] * 10, None), "single-label")
    assert counts.reason() is None and "cannot be checked" in counts.to_details()["checked"]


def test_a_detector_without_a_detection_above_the_score_gives_no_signal() -> None:
    def outputs(scores: list[float]) -> ModelOutputs:
        n = len(scores)
        boxes = BoxSet(torch.tensor([[0.0, 0, 4, 4]] * n), torch.zeros(n, dtype=torch.int64), torch.arange(n), 5,
                       torch.tensor(scores))
        return ModelOutputs(torch.zeros(5, dtype=torch.int64), torch.zeros(5), None, None, None, detections=boxes)

    dim = SignalCounts.of(outputs([0.2, 0.49, 0.1]), "detection")
    assert dim.reason("dataset").startswith("no signal: the detector makes no detection with a score of at least 0.5 "
                                            "on any of the 5 images of fixture 'dataset' (the highest score 0.490)")
    assert dim.to_details()["detections_above"] == 0
    assert "(no detection at all)" in SignalCounts.of(outputs([]), "detection").reason()
    assert SignalCounts.of(outputs([0.2, 0.5]), "detection").reason() is None
    assert SignalCounts.of(outputs([0.2, 0.3]), "detection", threshold=0.25).reason() is None  # a gate's own score


def test_a_multilabel_model_that_predicts_nothing_gives_no_signal() -> None:
    def outputs(logits: torch.Tensor) -> ModelOutputs:
        return ModelOutputs(logits.argmax(1), torch.ones(len(logits)), torch.zeros(len(logits), 3), None, logits)

    silent = SignalCounts.of(outputs(torch.full((6, 3), -4.0)), "multi-label")
    why = silent.reason("dataset")
    assert why.startswith("no signal: the multi-label model predicts no class on any of the 6 inputs of fixture "
                          "'dataset' (no probability, its outputs read as logits, reaches its decision threshold 0.5; "
                          "the highest probability 0.018)"), why
    probabilities = SignalCounts.of(outputs(torch.full((6, 3), 0.3)), "multi-label")  # in [0, 1]: probabilities
    assert "read as probabilities" in probabilities.reason()
    assert SignalCounts.of(outputs(torch.full((6, 3), 0.3)), "multi-label", threshold=0.25).reason() is None
    assert SignalCounts.of(outputs(torch.full((6, 3), 0.3)), "multi-label", kind="logits").reason() is None
    assert SignalCounts.of(outputs(torch.full((6, 3), 0.3)), "multi-label", threshold=[0.4, 0.4, 0.9]).reason() \
        .count("decision thresholds") == 1


def test_the_counts_of_two_shards_merge_into_the_wholes() -> None:
    labels = [0, 1, 2, 3] * 25
    predictions = [0] * 60 + labels[60:]
    whole = SignalCounts.of(_classifier(predictions, labels), "single-label")
    a = SignalCounts.of(_classifier(predictions[:37], labels[:37]), "single-label")
    b = SignalCounts.of(_classifier(predictions[37:], labels[37:]), "single-label")
    assert SignalCounts.merge_all([a, b]) == whole
    logits = torch.randn(10, 3)
    ml = lambda x: ModelOutputs(x.argmax(1), torch.ones(len(x)), None, None, x)  # noqa: E731
    merged = SignalCounts.of(ml(logits[:4]), "multi-label").merge(SignalCounts.of(ml(logits[4:]), "multi-label"))
    assert merged == SignalCounts.of(ml(logits), "multi-label")


def test_the_confidence_loss_check_uses_the_same_bound() -> None:
    result = SimpleNamespace(chance_accuracy=0.5, clean_accuracy=0.57, n=100)
    assert at_chance(result) is not None and not chance_lower_bound(57, 100, 0.5)[1]
    assert at_chance(SimpleNamespace(chance_accuracy=0.5, clean_accuracy=0.59, n=100)) is None
    assert chance_lower_bound(59, 100, 0.5)[1]
