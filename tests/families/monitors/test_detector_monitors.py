"""The runtime-monitor detection gate on an object detector: a score-based monitor (``DetectionScore``: one minus
the image's top detection score) fitted and calibrated on in-distribution images, the fault families applied to
the images as for a classifier.

Known answers on the blob detector (:mod:`_blob_detector`): a detector whose score drops when the background
turns noisy lets the monitor separate noisy images from clean ones (the gate passes); a detector whose score
is the same on every image gives the monitor nothing to read (the gate fails). The system view counts an image
as the detector's error when it misses an object or detects one that is not there: a detector whose boxes are
shifted off the objects is wrong on every image and a monitor that cannot tell fails max_monitor_selective_risk.
A classifier monitor given a detector and the adversarial faults are errors naming the fix.
"""

from __future__ import annotations

import pytest
import torch

from _blob_detector import BlobDetector, blob_data, blob_project, gates_of
from conftest import GateProject
from pytest_dnnsafety.engines.monitors import DetectionScore, MonitorView, fit_monitor
from pytest_dnnsafety.engines.core.detections import image_errors
from pytest_dnnsafety.data.tasks import BoxSet, DetectionData

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
        "rotation": "max_monitor_selective_risk(0.5, monitor='det', faults='rotation', severity=3)",
    }, model={"score": "constant"}, extra=MONITORS)
    result = project.run("--dnnsafety-json=evidence.json")
    gates = gates_of(project)
    assert gates["blind"]["status"] == "failed" and gates["blind"]["value"] == 0.0
    assert {gates[k]["status"] for k in ("msp", "adversarial", "rotation")} == {"error"}
    result.stdout.fnmatch_lines(["*the model is an object detector*Fix: use DetectionScore()*"])
    result.stdout.fnmatch_lines(["*fault family 'fgsm' attacks a classifier's true class*"])
    result.stdout.fnmatch_lines(["*fault family 'rotation' moves a detector's objects off their boxes*"])


RISK = "max_monitor_selective_risk(0.2, monitor='det', faults=('gaussian_noise', 'black_frame'), severity=5)"


def test_selective_risk_counts_missed_and_false_detections(gate_project: GateProject) -> None:
    project = blob_project(gate_project, {"risk": RISK}, model={"score": "clean_background"}, extra=MONITORS)
    result = project.run("--dnnsafety-json=evidence.json")
    gate = gates_of(project)["risk"]
    assert gate["status"] == "passed", result.stdout.str()
    system = gate["details"]["system"]
    # black frames have no right answer (every decision an error) and no bright blob: the monitor rejects them
    assert gate["details"]["per_set"]["black_frame"]["accepted"] == 0
    assert system["accepted_errors"] == 0 and system["model_risk"] > 0


def test_detector_with_shifted_boxes_fails_selective_risk(pytester: pytest.Pytester) -> None:
    project = blob_project(GateProject(pytester), {"risk": "max_monitor_selective_risk(0.2, monitor='det')"},
                           model={"shift": 8.0}, extra=MONITORS)
    project.run("--dnnsafety-json=evidence.json")
    gate = gates_of(project)["risk"]
    assert gate["status"] == "failed" and gate["value"] == 1.0  # every accepted image: a miss and a false box


def test_image_errors_are_misses_and_false_detections() -> None:
    targets = BoxSet(torch.tensor([[0., 0, 4, 4], [8, 8, 12, 12], [0, 0, 4, 4]]), torch.tensor([0, 1, 0]),
                     torch.tensor([0, 0, 2]), 4)
    dets = BoxSet(torch.tensor([[0., 0, 4, 4], [8, 8, 12, 12], [0, 0, 4, 4], [5, 5, 9, 9], [0, 0, 4, 4]]),
                  torch.tensor([0, 1, 0, 0, 0]), torch.tensor([0, 0, 1, 2, 2]), 4,
                  torch.tensor([0.9, 0.8, 0.7, 0.3, 0.6]))
    # image 0 right; image 1 a false detection; image 2 right (the 0.3 box is below the operating point);
    # image 3 nothing to find, nothing found
    assert image_errors(dets, targets).tolist() == [False, True, False, False]
    weak = BoxSet(dets.boxes, dets.labels, dets.image, 4, torch.tensor([0.9, 0.4, 0.7, 0.3, 0.6]))
    assert image_errors(weak, targets).tolist() == [True, True, False, False]  # image 0 misses its class-1 object


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
