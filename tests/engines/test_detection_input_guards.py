"""Hostile detection inputs of issue #29 §3: every one is refused naming the file/fixture, the argument and the fix.

Scores outside [0, 1] (percent, ``scores + 1``, NaN) are flagged on the device and read once after the loop;
offsets of any integer dtype are checked (start 0, end M, rising: a wrapped ``uint8`` is named); target labels
beyond the detector's declared classes are named with the range; one image with many objects is matched within a
bounded working set; a detector's training-mode output or one dict per batch gets a detector's hint; the shared
pass's errors say what ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from _hostile import make_settings
from pytest_dnnsafety.data.tasks import BoxSet, DetectionData, matched_scores
from pytest_dnnsafety.engines.core.capture import capture
from pytest_dnnsafety.engines.core.detections import detector_classes
from pytest_dnnsafety.engines.core.guard import ForwardGuard
from pytest_dnnsafety.errors import DataError, MetricError
from pytest_dnnsafety.gates import builtin_registry, evaluate, parse_marker

GATES = dict(builtin_registry())
N = 40
BOX = (2.0, 2.0, 10.0, 10.0)


class Detector(nn.Module):
    """One box per image at ``BOX`` of class 0, scored in (0.6, 0.9) from the image; ``scores`` rescales it."""

    def __init__(self, scores: str = "good", label: int = 0, shape: str = "list") -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)
        self.scores, self.label, self.shape = scores, label, shape

    def forward(self, x: torch.Tensor) -> Any:
        score = 0.6 + 0.3 * torch.sigmoid(self.conv(x).mean(dim=(1, 2, 3)))
        if self.scores == "percent":
            score = score * 100
        elif self.scores == "plus_one":
            score = score + 1
        elif self.scores == "nan":
            score = torch.where(torch.arange(x.shape[0]) == 1, torch.nan, score)
        elif self.scores == "negative":
            score = score - 1
        out = [{"boxes": torch.tensor([BOX]), "scores": score[i:i + 1], "labels": torch.tensor([self.label])}
               for i in range(x.shape[0])]
        if self.shape == "training":
            return {}, out
        if self.shape == "per_batch":
            return {key: torch.cat([o[key] for o in out]) for key in ("boxes", "scores", "labels")}
        return out


def _data(n: int = N, labels: torch.Tensor | None = None) -> DetectionData:
    gen = torch.Generator().manual_seed(0)
    return DetectionData(torch.rand(n, 1, 16, 16, generator=gen),
                         BoxSet(torch.tensor([BOX]).repeat(n, 1),
                                torch.zeros(n, dtype=torch.int64) if labels is None else labels,
                                torch.arange(n), n))


def _run(tmp_path: Path, marker: str, options: dict[str, Any], fixtures: dict[str, Any], threshold: float = 0.5):
    spec = parse_marker(marker, (threshold,), options, "t.py::test", GATES)
    return evaluate(spec, {role: fixtures[role] for role in spec.fixtures if role in fixtures},
                    make_settings(tmp_path), "t.py::test", {})


# ------------------------------------------------------------------------------------- 1. scores outside [0, 1]


@pytest.mark.parametrize("scores, shown", [("percent", "scores range over"), ("plus_one", "scores range over"),
                                           ("negative", "scores range over"), ("nan", "NaN")])
def test_scores_outside_the_unit_interval_are_refused_after_the_loop(scores: str, shown: str) -> None:
    guard = ForwardGuard("occlusion: detector on clean images", task="detection")
    model = Detector(scores).eval()
    x = _data(8).x
    with torch.no_grad():
        for start in (0, 4):
            guard(model, x[start:start + 4])  # flagged on the device: no error inside the loop
    with pytest.raises(MetricError) as info:
        guard.check()
    text = str(info.value)
    assert text.startswith("occlusion: detector on clean images: the model's detection scores")
    assert "outside [0, 1]" in text and shown in text and "first bad batch is batch 0" in text
    assert "Fix:" in text and "probabilit" in text


def test_good_scores_pass_and_the_score_check_syncs_only_in_check(monkeypatch: pytest.MonkeyPatch) -> None:
    guard = ForwardGuard("g", task="detection")
    model = Detector().eval()
    x = _data(8).x
    with torch.no_grad():
        guard(model, x[:4])  # the determinism probe reads; the later batches must not
        outs = [model(x[4:])]
    calls = []
    for name in ("item", "__bool__", "__int__", "__float__", "tolist"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name: calls.append(_n) or _o(self))
    for out in outs:
        guard.observe(out, x[4:])
    assert calls == []
    guard.check()
    assert calls  # the one read


@pytest.mark.parametrize("marker, options", [
    ("min_detection_recall", {"min_images": 10, "bootstrap": 100}),
    ("min_detection_map", {"min_images": 10, "bootstrap": 100})])
def test_a_gate_on_percent_scores_is_an_error_not_a_pass(tmp_path: Path, marker: str, options: dict) -> None:
    good = _run(tmp_path, marker, options, {"model": Detector().eval(), "data": _data()})
    assert good.status == "passed"
    percent = _run(tmp_path, marker, options, {"model": Detector("percent").eval(), "data": _data()})
    assert percent.status == "error" and "outside [0, 1]" in percent.summary, percent.summary


# ------------------------------------------------------------------------------------- 2. offsets of any integer dtype


def _ragged(m_per_image: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n, m = len(m_per_image), sum(m_per_image)
    x = np.zeros((n, 1, 8, 8), dtype=np.float32)
    boxes = np.tile(np.array([[1, 1, 4, 4]], dtype=np.float32), (m, 1))
    offsets = np.concatenate([[0], np.cumsum(m_per_image)])
    return x, boxes, np.zeros(m, dtype=np.int64), offsets


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.uint64])
def test_offsets_of_any_integer_dtype_are_read(dtype: Any) -> None:
    x, boxes, labels, offsets = _ragged([2, 0, 3, 1])
    data = DetectionData.from_offsets(x, boxes, labels, offsets.astype(dtype))
    assert data.targets.image.tolist() == [0, 0, 2, 2, 2, 3]
    assert data.targets.image.dtype == torch.int64


def test_wrapped_uint8_offsets_are_named_with_the_fix() -> None:
    x, boxes, labels, offsets = _ragged([200, 100])  # 300 boxes: uint8 offsets wrap to 0, 200, 44
    with pytest.raises(DataError) as info:
        DetectionData.from_offsets(x, boxes, labels, offsets.astype(np.uint8), "fixture 'dataset' (d.npz)")
    text = str(info.value)
    assert text.startswith("fixture 'dataset' (d.npz): offsets")
    assert "uint8" in text and "255" in text and "int64" in text and "Fix:" in text


def test_boolean_offsets_are_refused() -> None:
    x, boxes, labels, _ = _ragged([1, 0])
    with pytest.raises(DataError, match="offsets must be"):
        DetectionData.from_offsets(x, boxes, labels, np.array([False, True, True]))


# ------------------------------------------------------------------------------------- 3. labels beyond the classes


class Declared(Detector):
    num_classes = 3


class _Head(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.classification_head = nn.Module()
        self.classification_head.num_classes = k


def test_detector_classes_read_from_declared_and_torchvision_layouts() -> None:
    assert detector_classes(Declared()) == 3
    assert detector_classes(Detector()) is None
    retina = nn.Module()
    retina.head = _Head(91)
    assert detector_classes(retina) == 91
    faster = nn.Module()
    faster.roi_heads = nn.Module()
    faster.roi_heads.box_predictor = nn.Module()
    faster.roi_heads.box_predictor.cls_score = nn.Linear(4, 5)
    assert detector_classes(faster) == 5


def test_target_labels_beyond_the_detectors_classes_are_named() -> None:
    labels = torch.zeros(N, dtype=torch.int64)
    labels[7], labels[30] = 5, 3
    with pytest.raises(DataError) as info:
        capture(Declared().eval(), _data(labels=labels), [], outputs=[], batch_size=16)
    text = str(info.value)
    assert "target labels" in text and "0..5" in text and "3 classes (0..2" in text and "2 of 40 objects" in text
    assert "first bad batch is batch 0" in text and "Fix:" in text and "num_classes" in text


def test_a_gate_refuses_labels_beyond_the_detectors_classes(tmp_path: Path) -> None:
    labels = torch.zeros(N, dtype=torch.int64)
    labels[::5] = 4
    result = _run(tmp_path, "min_detection_recall", {"min_images": 10, "bootstrap": 100},
                  {"model": Declared().eval(), "data": _data(labels=labels)})
    assert result.status == "error" and "3 classes" in result.summary, result.summary
    ok = _run(tmp_path, "min_detection_recall", {"min_images": 10, "bootstrap": 100},
              {"model": Declared().eval(), "data": _data()})
    assert ok.status == "passed"


PERTURBATION_GATES = [("min_interpretation_precision", {"size": 4, "stride": 4}),
                      ("max_adversarial_confidence_loss", {"eps": 0.05, "families": ["gaussian_noise"]}),
                      ("min_robust_accuracy", {"eps": 0.05, "families": ["gaussian_noise"]})]


@pytest.mark.parametrize("marker, options", PERTURBATION_GATES)
def test_occlusion_and_robustness_gates_refuse_bad_scores_and_labels(tmp_path: Path, marker: str,
                                                                     options: dict) -> None:
    fixtures = {"model": Detector("percent").eval(), "data": _data(8), "masks": None}
    result = _run(tmp_path, marker, options, fixtures)
    assert result.status == "error" and "outside [0, 1]" in result.summary, result.summary  # was: a loss of 1.49
    labels = torch.zeros(8, dtype=torch.int64)
    labels[3] = 6
    result = _run(tmp_path, marker, options, {**fixtures, "model": Declared().eval(), "data": _data(8, labels)})
    assert result.status == "error" and "3 classes (0..2" in result.summary, result.summary


def test_detections_beyond_the_declared_classes_are_flagged() -> None:
    guard = ForwardGuard("g", task="detection")
    class Wide(Declared):
        pass
    with torch.no_grad():
        guard(Wide(label=7).eval(), _data(4).x)
    with pytest.raises(MetricError, match="a label outside the 3 classes"):
        guard.check()


# ------------------------------------------------------------------------------------- 4. many objects in one image


def _crowd(m: int, d: int = 100) -> tuple[BoxSet, BoxSet]:
    """One image of ``m`` disjoint 2×2 objects on a grid and ``d`` detections, each on one object (IoU 0.68)."""
    i = torch.arange(m)
    xy = torch.stack([(i % 500) * 3.0, (i // 500) * 3.0], 1)
    gt = BoxSet(torch.cat([xy, xy + 2], 1), torch.zeros(m, dtype=torch.int64), torch.zeros(m, dtype=torch.int64), 1)
    dets = BoxSet(gt.boxes[:d] + 0.2, torch.zeros(d, dtype=torch.int64), torch.zeros(d, dtype=torch.int64), 1,
                  torch.linspace(0.99, 0.5, d))
    return dets, gt


def _largest_iou_block(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the largest broadcast shape (elements) the IoU kernel is asked for, in matching and matched_scores."""
    from pytest_dnnsafety.data import tasks
    from pytest_dnnsafety.engines.detection import matching

    largest = [0]
    kernel = tasks.paired_iou

    def counting(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        largest[0] = max(largest[0], int(torch.broadcast_shapes(a.shape, b.shape).numel()))
        return kernel(a, b)

    monkeypatch.setattr(matching, "paired_iou", counting)
    monkeypatch.setattr(tasks, "paired_iou", counting)
    return largest


def test_one_image_with_many_objects_is_matched_in_a_bounded_working_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_dnnsafety.engines.detection import matching

    m, d = 20_000, 100
    dets, gt = _crowd(m, d)
    largest = _largest_iou_block(monkeypatch)
    thresholds = matching.COCO_IOU_THRESHOLDS
    *_, matched = matching._match(dets, gt, thresholds, 100)
    assert matched.shape == (d, 10) and bool(matched[:, :4].all()) and not bool(matched[:, 4:].any())  # IoU 0.68
    assert largest[0] <= 4 * m  # one rank's row of IoUs at a time, never the (detections × objects) block
    largest[0] = 0
    found = matched_scores(dets, gt, 0.5)
    assert torch.equal(found[:d], dets.scores.float()) and not bool(found[d:].any())
    monkeypatch.setattr("pytest_dnnsafety.data.tasks.PAIR_CHUNK", 50_000)  # the same answer in bounded spans
    largest[0] = 0
    assert torch.equal(matched_scores(dets, gt, 0.5), found)
    assert largest[0] <= 4 * (50_000 + m)  # a span: the chunk plus at most one detection's pairs


def test_chunked_matching_gives_the_unchunked_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many images and classes, some cells crowded: tiny spans (cells and pairs) give the same bits."""
    from pytest_dnnsafety.data import tasks
    from pytest_dnnsafety.engines.detection import matching

    gen = torch.Generator().manual_seed(3)
    n, m, d = 12, 900, 400
    def boxes(k: int) -> torch.Tensor:
        xy = torch.rand(k, 2, generator=gen) * 40
        return torch.cat([xy, xy + 2 + torch.rand(k, 2, generator=gen) * 6], 1)
    gt_image = torch.sort(torch.randint(0, n, (m,), generator=gen)).values
    gt_image[:300] = 4  # one crowded image
    gt_image = torch.sort(gt_image).values
    gt = BoxSet(boxes(m), torch.randint(0, 3, (m,), generator=gen), gt_image, n)
    det_image = torch.sort(torch.randint(0, n, (d,), generator=gen)).values
    dets = BoxSet(boxes(d), torch.randint(0, 3, (d,), generator=gen), det_image, n, torch.rand(d, generator=gen))
    thresholds = matching.COCO_IOU_THRESHOLDS
    whole = matching._match(dets, gt, thresholds, 100)
    scores = matched_scores(dets, gt, 0.5)
    monkeypatch.setattr(matching, "MATCH_CHUNK_ELEMENTS", 2_000)
    monkeypatch.setattr(tasks, "PAIR_CHUNK", 1_000)
    assert len(matching._cell_spans([5] * 30, [300] + [20] * 29, 10)) > 3
    parts = matching._match(dets, gt, thresholds, 100)
    for a, b in zip(whole, parts):
        assert torch.equal(a, b)
    assert torch.equal(matched_scores(dets, gt, 0.5), scores)


# ------------------------------------------------------------------------- 5. training mode, one dict per batch


@pytest.mark.parametrize("task", ["detection", "any"])
def test_training_mode_output_gets_a_detectors_hint(task: str) -> None:
    guard = ForwardGuard("g", task=task)
    with pytest.raises(MetricError) as info:
        guard(Detector(shape="training"), _data(2).x)  # 2 images: the tuple's length equals the batch
    text = str(info.value)
    assert "(losses, detections)" in text and "model.eval()" in text and "classifier" not in text


@pytest.mark.parametrize("task", ["detection", "any"])
def test_one_dict_per_batch_gets_a_detectors_hint(task: str) -> None:
    guard = ForwardGuard("g", task=task)
    with pytest.raises(MetricError) as info:
        guard(Detector(shape="per_batch"), _data(4).x)
    text = str(info.value)
    assert "one dict for the whole batch" in text and "one dict per image" in text and "logits" not in text


# ------------------------------------------------------------------------------------- 6. what ran


def test_the_shared_pass_says_what_ran() -> None:
    with pytest.raises(MetricError) as info:
        capture(Detector("percent").eval(), _data(8), [], outputs=[], batch_size=4)
    assert str(info.value).startswith("the shared forward pass (model outputs): ")
    with pytest.raises(MetricError) as info:
        capture(Detector("percent").eval(), _data(8), ["conv"], outputs=[], batch_size=4)
    assert str(info.value).startswith("the shared forward pass (model outputs and layer activations): ")
