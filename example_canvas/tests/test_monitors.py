"""A runtime monitor on the detector: does a low top detection score flag canvases it should not trust?

The monitors (``conftest.py``) are fitted on ``data/monitor_fit.npz`` (other canvases of training
digits), with a held-out share setting the alarm threshold; the evaluation canvases are the
in-distribution data; ``data/ood.npz`` (scribbles and blobs, no digit) is the ``novel`` fault.
"""

import pytest


@pytest.mark.min_monitor_detection(0.6, monitor="top_score", faults=("novel",), task="detection")
def test_canvases_without_digits_are_flagged(model, dataset):
    """MCC of the alarm on canvases with no digit at all (positives) against the evaluation canvases.
    Measured: 0.717 (146 of 200 digit-free canvases flagged, 26 of 540 evaluation canvases; AUROC 0.947)."""


@pytest.mark.min_monitor_detection(0.55, monitor="top_score", faults=("noise", "anomaly"), metric="auroc",
                                   aggregate="mean", task="detection")
def test_damaged_frames_rank_below_clean_ones(model, dataset):
    """AUROC of the monitor score, averaged over the plugin's noise and anomaly fault sets.
    Measured: 0.605. A black frame is always flagged (1.00), zeroed or shifted rows at high severity
    (0.91, 0.90), but pixel noise hardly moves the top score (0.50-0.61): the detector mostly still
    finds the digits there, which is what the score measures."""


@pytest.mark.max_monitor_selective_risk(0.65, monitor="top_score", faults=("novel",), task="detection")
def test_accepted_canvases_are_read_no_worse_than_today(model, dataset):
    """Among the canvases the monitor accepts (evaluation canvases pooled with the digit-free ones), the
    share where the detector misses a digit or reports a false one (score 0.5, IoU 0.5); 95% bound.

    Measured: 327/568 = 0.576 (bound 0.610) at coverage 0.768; the detector alone 0.673 over all 740.
    The monitor removes most digit-free canvases but not the detector's own misses: on more than half
    of the canvases with 1-4 digits this small detector gets at least one digit wrong. The gate (0.65)
    records that state so that it cannot get worse; it is not a safety target met.
    """
