"""Occlusion interpretability gates on an object detector: per ground-truth object, matched scores (Cheng et al.
2018, §II-F step 2 and eq. 5).

Known answers on a tiny deterministic detector of bright blobs (:mod:`_blob_detector`): the detector that
boxes the blob passes (every hot position lies on the object); the same detector with its boxes shifted
off the objects matches nothing, so every position is hot and M_interpret is the box's share of the
positions: it fails min_interpretation_precision, and min/max_occlusion_sensitivity fail too.
"""

from __future__ import annotations

import pytest
import torch

from _blob_detector import BlobDetector, blob_data, blob_project, gates_of
from conftest import GateProject
from pytest_dnnsafety.engines.core.detections import select_images, top_scores
from pytest_dnnsafety.engines.interpretability.detector import assess_detector_occlusion
from pytest_dnnsafety.errors import DataError
from pytest_dnnsafety.data.boxes import box_iou
from pytest_dnnsafety.data.tasks import BoxSet, DetectionData, matched_scores

GATES = {
    "precision": "min_interpretation_precision(0.9, size=3)",
    "sensitive": "min_occlusion_sensitivity(0.02, size=3)",
    "fragile": "max_occlusion_sensitivity(0.5, size=3)",
}


def _data(n: int = 12) -> DetectionData:
    d = blob_data(n)
    return DetectionData.from_offsets(d["x"], d["boxes"], d["labels"], d["offsets"])


def test_detector_that_looks_at_the_object_passes_and_shifted_boxes_fail(gate_project: GateProject) -> None:
    project = blob_project(gate_project, GATES)
    result = project.run("--dnnsafety-json=evidence.json")
    gates = gates_of(project)
    assert {k: g["status"] for k, g in gates.items()} == dict.fromkeys(GATES, "passed"), result.stdout.str()
    assert gates["precision"]["value"] == 1.0
    assert gates["precision"]["details"]["units"] == "ground-truth objects"
    assert gates["precision"]["details"]["occluding"] == "ground-truth boxes"


def test_shifted_boxes_that_miss_every_object_are_inconclusive_as_a_classifier_is(pytester: pytest.Pytester) -> None:
    """Issue #29 §2: a detector that misses every object gets the classifier analogue's verdict (every position hot:
    the value is the boxes' geometry), not a failure one task and an inconclusive the other."""
    project = blob_project(GateProject(pytester), GATES, model={"shift": 8.0})
    project.run("--dnnsafety-json=evidence.json")
    gates = gates_of(project)
    assert {k: g["status"] for k, g in gates.items()} == dict.fromkeys(GATES, "inconclusive")
    for gate in gates.values():
        assert gate["details"]["inconclusive"].startswith("the detector misses every object: its matched score is "
                                                          "below ρ=0.5 on every one of the 24 ground-truth objects")
    # no matched box: every position hot, precision = the box's share of the 14x14 positions (reported, not judged)
    assert 0.1 < gates["precision"]["value"] < 0.3
    assert gates["precision"]["details"]["missed_objects"] == 24
    assert gates["sensitive"]["value"] == 0.0 and gates["fragile"]["value"] == 1.0


def test_detector_options_that_mean_nothing_are_errors(gate_project: GateProject) -> None:
    project = blob_project(gate_project, {"bad": "min_interpretation_precision(0.9, size=3, outputs='probabilities')"})
    result = project.run("--dnnsafety-json=evidence.json")
    assert gates_of(project)["bad"]["status"] == "error"
    result.stdout.fnmatch_lines(["*outputs='probabilities' is for classifiers*Fix: drop outputs=*"])


def test_per_object_masks_equal_the_boxes_when_they_fill_them() -> None:
    data = _data()
    boxes = data.targets.boxes.long()
    ar = torch.arange(16)
    masks = ((ar[None, :, None] >= boxes[:, 1, None, None]) & (ar[None, :, None] < boxes[:, 3, None, None])
             & (ar[None, None, :] >= boxes[:, 0, None, None]) & (ar[None, None, :] < boxes[:, 2, None, None]))
    by_box = assess_detector_occlusion(BlobDetector(), data, size=3, batch_size=5)
    by_mask = assess_detector_occlusion(BlobDetector(), data, masks, size=3, batch_size=7)
    for a, b in ((by_box.result, by_mask.result), (by_box.strict, by_mask.strict)):
        assert (a.interpret_mean, a.occsen_mean, a.hot_total, a.both_total) == \
            (b.interpret_mean, b.occsen_mean, b.hot_total, b.both_total)
    assert by_mask.result.setup["occluding"] == "per-object masks"
    with pytest.raises(DataError, match="11 masks for 12 ground-truth objects"):
        assess_detector_occlusion(BlobDetector(), data, masks[:11], size=3)


def test_matched_scores_pairing_per_image_equals_the_dense_matrix() -> None:
    gen = torch.Generator().manual_seed(0)

    def boxes(m: int, n: int, scores: bool) -> BoxSet:
        xy = torch.rand(m, 2, generator=gen) * 10
        wh = torch.rand(m, 2, generator=gen) * 6 + 1
        image = torch.sort(torch.randint(0, n, (m,), generator=gen)).values
        return BoxSet(torch.cat([xy, xy + wh], 1), torch.randint(0, 2, (m,), generator=gen), image, n,
                      torch.rand(m, generator=gen) if scores else None)

    for _ in range(5):
        dets, targets = boxes(60, 7, True), boxes(25, 7, False)
        for iou in (0.1, 0.5):
            dense = box_iou(dets.boxes, targets.boxes)  # every detection against every object, then masked
            ok = ((dets.image[:, None] == targets.image[None, :]) & (dets.labels[:, None] == targets.labels[None, :])
                  & (dense >= iou))
            expected = torch.where(ok, dets.scores[:, None], torch.zeros(())).amax(dim=0)
            assert torch.equal(matched_scores(dets, targets, iou), expected)
    dets = boxes(30, 5, True)
    best = torch.zeros(5).scatter_reduce(0, dets.image, dets.scores, "amax")
    assert torch.allclose(top_scores(dets, 1), best)
    picked = select_images(dets, torch.tensor([3, 1]))
    assert picked.n_images == 2 and torch.equal(picked.boxes, torch.cat([dets.boxes[dets.image == 3],
                                                                        dets.boxes[dets.image == 1]]))


def test_masks_stay_required_for_a_classifier(gate_project: GateProject) -> None:
    gate = "min_interpretation_precision(0.9, size=3, task='single-label')"
    project = blob_project(gate_project, {"classifier": gate})
    result = project.run("--dnnsafety-json=evidence.json")
    assert gates_of(project)["classifier"]["status"] == "error"
    result.stdout.fnmatch_lines(["*the segmentation masks (fixture `masks`) is not configured: dnnsafety_masks is "
                                 "unset*"])
