"""The runtime-monitor detection gate on an object detector: a score-based monitor (``DetectionScore``: one minus
the image's top detection score) fitted and calibrated on in-distribution images, the fault families applied to
the images as for a classifier.

Known answers on the blob detector (:mod:`_blob_detector`): a detector whose score drops when the background
turns noisy lets the monitor separate noisy images from clean ones (the gate passes); a detector whose score
is the same on every image gives the monitor nothing to read (the gate fails). A classifier monitor given a
detector, the adversarial faults and the selective-risk gate are errors naming the fix.
"""

from __future__ import annotations

import pytest
import torch

from _blob_detector import BlobDetector, blob_data, blob_project, gates_of
from conftest import GateProject
from pytest_dnnsafety.engines.monitors import DetectionScore, MonitorView, fit_monitor
from pytest_dnnsafety.tasks import DetectionData

MONITORS = """

@pytest.fixture(scope="session")
def monitors():
    from pytest_dnnsafety import MSP
    from pytest_dnnsafety.engines.monitors import DetectionScore
    return {"det": DetectionScore(), "top3": DetectionScore(k=3), "msp": MSP()}
"""
GATE = "min_monitor_detection(0.5, monitor='det', faults='gaussian_noise', severity=(3, 4, 5))"


def test_monitor_on_a_detector_that_sees_noise_passes(gate_project: GateProject) -> None:
    project = blob_project(gate_project, {"det": GATE}, model={"score": "clean_background"}, extra=MONITORS)
    result = project.run("--dnnsafety-json=evidence.json")
    gate = gates_of(project)["det"]
    assert gate["status"] == "passed", result.stdout.str()
    assert gate["value"] > 0.7


def test_monitor_that_cannot_separate_fails_and_bad_configurations_are_errors(gate_project: GateProject) -> None:
    project = blob_project(gate_project, {
        "blind": GATE,
        "msp": "min_monitor_detection(0.5, monitor='msp', faults='gaussian_noise', severity=3)",
        "adversarial": "min_monitor_detection(0.5, monitor='det', faults='fgsm', severity=3)",
        "risk": "max_monitor_selective_risk(0.5, monitor='det')",
    }, model={"score": "constant"}, extra=MONITORS)
    result = project.run("--dnnsafety-json=evidence.json")
    gates = gates_of(project)
    assert gates["blind"]["status"] == "failed" and gates["blind"]["value"] == 0.0
    assert {gates[k]["status"] for k in ("msp", "adversarial", "risk")} == {"error"}
    result.stdout.fnmatch_lines(["*the model is an object detector*Fix: use DetectionScore()*"])
    result.stdout.fnmatch_lines(["*fault family 'fgsm' attacks a classifier's true class*"])
    result.stdout.fnmatch_lines(["*max_monitor_selective_risk supports single-label models*detection*"])


def test_detection_score_reads_the_top_detections_and_subsets_keep_them() -> None:
    d = blob_data(20)
    data = DetectionData.from_offsets(d["x"], d["boxes"], d["labels"], d["offsets"])
    model = BlobDetector()
    view = MonitorView(model, data, batch_size=8)
    top1 = DetectionScore().fit(view).score(view)
    confidence = view.outputs().confidence  # each image's top detection score
    expected = 1 - confidence
    assert torch.allclose(top1, expected)
    # one detection per image: the top-2 mean is half the top score
    assert torch.allclose(DetectionScore(k=2).fit(view).score(view), 1 - confidence / 2)
    rows = torch.tensor([7, 2, 11])
    assert torch.allclose(DetectionScore().fit(view).score(view.subset(rows)), expected[rows])
    fitted = fit_monitor(DetectionScore(), model, data, batch_size=8)
    assert fitted.threshold is not None and fitted.fit_info["n_calibration"] == 4
    with pytest.raises(Exception, match="k=0 is not a positive integer"):
        DetectionScore(k=0)
