"""Detection quality of the digit detector per operating condition (COCO mAP and recall).

The compared number is the worst group's lower bound of a bootstrap over canvases at 95%
(canvases are the independent units, not digits). Thresholds: measured bound minus a margin of
about 0.05 (README, "Detector").
"""

import pytest


@pytest.mark.min_detection_map(0.68, iou="0.5", by="lighting", confidence=0.95)
def test_map_holds_in_every_lighting(model, dataset):
    """mAP@0.5 at day, dusk and night. Measured: see README."""


@pytest.mark.min_detection_map(0.55, iou="0.5", by="clutter", confidence=0.95)
def test_map_holds_under_clutter(model, dataset):
    """mAP@0.5 without, with little and with much clutter (strokes, blobs)."""


@pytest.mark.min_detection_map(0.6, iou="0.5", by="overlap", confidence=0.95)
def test_map_holds_with_overlapping_digits(model, dataset):
    """mAP@0.5 with separate and with partially overlapping digits."""


@pytest.mark.min_detection_map(0.37, by="lighting", confidence=0.95)
def test_coco_map_holds_in_every_lighting(model, dataset):
    """COCO's mAP@[0.5:0.95]: box tightness as well as finding the digit."""


@pytest.mark.min_detection_recall(0.28, score_threshold=0.5, by="lighting")
def test_every_digit_is_found_in_every_lighting(model, dataset):
    """Per digit class, the share of its digits found (IoU >= 0.5, score >= 0.5), worst class of the
    worst lighting."""
