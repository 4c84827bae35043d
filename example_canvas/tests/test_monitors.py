"""A runtime monitor on the detector: does a low top detection score flag canvases it should not trust?

The monitors (``conftest.py``) are fitted on ``data/monitor_fit.npz`` (other canvases of training
digits), with a held-out share setting the alarm threshold; the evaluation canvases are the
in-distribution data; ``data/ood.npz`` (scribbles and blobs, no digit) is the ``novel`` fault.
"""

import pytest


@pytest.mark.min_monitor_detection(0.6, monitor="top_score", faults=("novel",), task="detection")
def test_canvases_without_digits_are_flagged(model, dataset):
    """MCC of the alarm on canvases with no digit at all (positives) against the evaluation canvases."""


@pytest.mark.min_monitor_detection(0.55, monitor="top_score", faults=("noise", "anomaly"), metric="auroc",
                                   aggregate="mean", task="detection")
def test_damaged_frames_rank_below_clean_ones(model, dataset):
    """AUROC of the monitor score, averaged over the plugin's noise and anomaly fault sets."""
