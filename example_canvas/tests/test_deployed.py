"""The detector's detection gates run three ways: the eager module, its ONNX export, and recorded detections.

The same five gates as ``tests/test_detection.py`` (same thresholds, same scenario groups), each written once
per way, ``test_<gate>_<way>``, naming what it reads by its role keywords (``canvas_demo.deploy`` writes the
files; ``python -m canvas_demo.train`` calls it):

- ``eager``: the default ``model`` and ``dataset`` (``models/detector.pt`` on ``data/eval_detection.npz``);
- ``onnx``: ``models/detector.onnx`` — the detector with its decoding exported by the legacy exporter, run by
  onnxruntime (fixture ``onnx_detector``; skipped without the ``[onnx]`` extra);
- ``recorded``: ``data/coco/results_eager.json``, the detections recorded on the COCO copy of the evaluation
  canvases (``data/coco/annotations.json`` + ``images/``) — no model is run (fixtures ``recorded_detector``,
  ``coco_data``).

The plain tests below check that the three give the same values (the gates' values and bounds, to float
tolerance) and that those equal pycocotools' ``COCOeval`` on the same annotation and results files.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from canvas_demo.deploy import (
    CATEGORY_OFFSET,
    ExportedDetector,
    coco_detections,
    load_detector,
    unpadded,
)

PROJECT = Path(__file__).resolve().parent.parent
ONNX_FILE = PROJECT / "models" / "detector.onnx"
COCO = PROJECT / "data" / "coco"
ANNOTATIONS = COCO / "annotations.json"
RESULTS = COCO / "results_eager.json"

#: the gates of tests/test_detection.py (the same thresholds): name -> (marker, threshold, keywords, what)
GATES = {
    "map_holds_in_every_lighting": ("min_detection_map", 0.65, {"iou": "0.5", "by": "lighting", "confidence": 0.95},
                                    "mAP@0.5 per lighting"),
    "map_holds_under_clutter": ("min_detection_map", 0.52, {"iou": "0.5", "by": "clutter", "confidence": 0.95},
                                "mAP@0.5 per clutter level"),
    "map_holds_with_overlapping_digits": ("min_detection_map", 0.58,
                                          {"iou": "0.5", "by": "overlap", "confidence": 0.95},
                                          "mAP@0.5 with and without overlapping digits"),
    "coco_map_holds_in_every_lighting": ("min_detection_map", 0.33, {"by": "lighting", "confidence": 0.95},
                                         "mAP@[0.5:0.95] per lighting"),
    "every_digit_is_found_in_every_lighting": ("min_detection_recall", 0.2, {"score_threshold": 0.5, "by": "lighting"},
                                               "recall per digit class at score >= 0.5, per lighting"),
}

#: the three ways: the role keywords each gate gets (none: the default ``model`` and ``dataset``)
WAYS = {
    "eager": {},
    "onnx": {"model": "onnx_detector"},
    "recorded": {"model": "recorded_detector", "data": "coco_data"},
}


def _gate_test(name: str, way: str):
    """``test_<name>_<way>``: gate ``name`` of :data:`GATES` with the role keywords of ``way``. (One function per
    gate and way rather than a parametrization: the fixtures a marker's roles request belong to the test
    function, so each way gets its own.)"""
    marker, threshold, keywords, what = GATES[name]

    def test():
        pass

    test.__name__ = test.__qualname__ = f"test_{name}_{way}"
    test.__doc__ = f"{what}: tests/test_detection.py's gate, read from the {way} detector."
    return getattr(pytest.mark, marker)(threshold, **keywords, **WAYS[way])(test)


# ------------------------------------------------------------------------------------- the artifacts


def _needs(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"{path.relative_to(PROJECT)} is missing: run `python -m canvas_demo.deploy` (or canvas_demo.train)")
    return path


@pytest.fixture(scope="session")
def eager_detections(dataset):
    """The eager detector's detections on data/eval_detection.npz (CPU), one torchvision dict per canvas."""
    with torch.no_grad():
        return load_detector()(dataset.x)


@pytest.fixture(scope="session")
def onnx_detector():
    """models/detector.onnx run by onnxruntime, loaded as ``dnnsafety_model = "models/detector.onnx"`` loads it (the
    file's bytes checked first; its ``boxes``/``scores``/``labels`` outputs read as detections, padding dropped)."""
    pytest.importorskip("onnxruntime", reason="needs the [onnx] extra")
    from pytest_dnnsafety import OnnxModel

    return OnnxModel.from_file(_needs(ONNX_FILE), "fixture 'onnx_detector' (models/detector.onnx)")


@pytest.fixture(scope="session")
def coco_data():
    """The evaluation canvases in COCO's format (data/coco/annotations.json, images/<id>.npy)."""
    from pytest_dnnsafety import CocoDetectionData

    return CocoDetectionData.from_coco(_needs(ANNOTATIONS), images=COCO / "images")


@pytest.fixture(scope="session")
def recorded_detector(coco_data):
    """The detections recorded on the COCO images (data/coco/results_eager.json), standing in for the model: joined
    to ``coco_data`` by image id, category ids mapped to its labels; no model is loaded."""
    from pytest_dnnsafety import RecordedPredictions

    return RecordedPredictions.from_file(_needs(RESULTS), coco_data)


# ------------------------------------------------------------------------------------- the gates, three ways

for _name in GATES:
    for _way in WAYS:
        _test = _gate_test(_name, _way)
        globals()[_test.__name__] = _test


# ------------------------------------------------------------------------------------- plain checks


def test_export_wrapper_keeps_exactly_the_eager_detections(dataset):
    """ExportedDetector's rows with label >= 0 are the eager decoding's detections, image by image (the same boxes,
    scores and labels, bit for bit, in the same order); the rest is padding (label -1, score 0)."""
    net = load_detector()
    wrapper = ExportedDetector(net).eval()
    with torch.no_grad():
        eager = net(dataset.x)
        boxes, scores, labels = wrapper(dataset.x)
    assert boxes.shape == (len(dataset), 36, 4) and scores.shape == labels.shape == (len(dataset), 36)
    pad = labels < 0
    assert bool((scores[pad] == 0).all()) and bool((boxes[pad] == 0).all())
    kept = unpadded(boxes, scores, labels)
    assert sum(len(d["labels"]) for d in eager) > 1000
    for i, (a, b) in enumerate(zip(eager, kept)):
        for key in ("boxes", "scores", "labels"):
            assert torch.equal(a[key], b[key]), f"canvas {i}: {key} differ"


def test_onnx_file_runs_like_the_wrapper(dataset, eager_detections):
    """onnxruntime on models/detector.onnx, in batches of 64 and of 1 (the batch axis is dynamic): the same
    detections as the eager decoding, boxes and scores within 1e-4 (float32 kernels differ in the last bits)."""
    ort = pytest.importorskip("onnxruntime", reason="needs the [onnx] extra")
    session = ort.InferenceSession(str(_needs(ONNX_FILE)), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["images"]
    assert [o.name for o in session.get_outputs()] == ["boxes", "scores", "labels"]
    x = dataset.x.numpy()
    parts = [session.run(None, {"images": x[s:s + 64]}) for s in range(0, len(x), 64)]
    outs = [torch.from_numpy(np.concatenate(p)) for p in zip(*parts)]
    single = [torch.from_numpy(o) for o in session.run(None, {"images": x[5:6]})]
    assert torch.equal(single[2], outs[2][5:6])
    torch.testing.assert_close(single[0], outs[0][5:6], atol=1e-4, rtol=0)
    for i, (a, b) in enumerate(zip(eager_detections, unpadded(*outs))):
        assert torch.equal(a["labels"], b["labels"]), f"canvas {i}: other detections under onnxruntime"
        torch.testing.assert_close(b["boxes"], a["boxes"], atol=1e-4, rtol=0)
        torch.testing.assert_close(b["scores"], a["scores"], atol=1e-4, rtol=0)


def test_coco_copy_holds_the_evaluation_canvases(dataset, eager_detections):
    """data/coco: image i + 1 is canvas i (the same float32 pixels), its annotations the canvas's digits (category
    100 + digit, bbox x, y, w, h, area w * h, no crowd); results_eager.json the eager detections."""
    doc = json.loads(_needs(ANNOTATIONS).read_text(encoding="utf-8"))
    assert [img["id"] for img in doc["images"]] == list(range(1, len(dataset) + 1))
    assert sorted(c["id"] for c in doc["categories"]) == [CATEGORY_OFFSET + d for d in range(10)]
    for i in (0, 1, len(dataset) - 1):
        pixels = np.load(COCO / "images" / doc["images"][i]["file_name"], allow_pickle=False)
        assert np.array_equal(pixels, dataset.x[i].numpy())
    anns = doc["annotations"]
    t = dataset.targets
    assert len(anns) == len(t)
    xywh = torch.tensor([a["bbox"] for a in anns], dtype=torch.float64)
    torch.testing.assert_close(torch.cat([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1), t.boxes.double())
    assert [a["category_id"] - CATEGORY_OFFSET for a in anns] == t.labels.tolist()
    assert [a["image_id"] - 1 for a in anns] == t.image.tolist()
    assert all(a["iscrowd"] == 0 and a["area"] == a["bbox"][2] * a["bbox"][3] for a in anns)
    eager = eager_detections
    assert json.loads(_needs(RESULTS).read_text(encoding="utf-8")) == json.loads(
        json.dumps(coco_detections(eager, list(range(1, len(dataset) + 1)))))


# ------------------------------------------------------------------------------------- the values, three ways


def _measure(gate: str, detections, targets, table, seed: int):
    """The gate ``gate``'s measurement (value, bound, per-group details) from ``detections`` (one torchvision dict
    per image, or a packed BoxSet with scores) against ``targets``, computed as the detection gates compute it
    (checked: the eager run's equal the gates' reported values and bounds)."""
    from pytest_dnnsafety.data.tasks import as_boxset
    from pytest_dnnsafety.engines.detection.matching import (
        COCO_IOU_THRESHOLDS,
        BoxMatchEngine,
    )
    from pytest_dnnsafety.engines.detection.quality import (
        QualityOptions,
        match_plan,
        worst_map,
        worst_recall,
    )
    from pytest_dnnsafety.scenarios.groups import ScenarioGroups

    marker, _, keywords, _ = GATES[gate]
    iou = keywords.get("iou", "0.5:0.95" if marker == "min_detection_map" else 0.5)
    thresholds, columns = match_plan(iou)
    engine = BoxMatchEngine(COCO_IOU_THRESHOLDS if thresholds is None else list(thresholds))
    if isinstance(detections, list):
        detections = as_boxset(detections, len(detections), "detections", scores=True)
    engine.update(detections, targets, 0)
    groups = ScenarioGroups.of(table, [keywords["by"]], n_rows=engine.n_images,
                               fixtures={"scenarios": "scenario_table", "data": "dataset"})
    reading = worst_map if marker == "min_detection_map" else worst_recall
    options = QualityOptions.of({**keywords, "iou": iou}, marker=marker, seed=seed)
    return reading(engine, groups, columns, options), groups


def _coco_eval(truth, results, image_ids: list[int], iou: float | None):
    """pycocotools' COCOeval (loaded ``truth`` and ``results``) on ``image_ids``, at ``iou`` (None: COCO's ten)."""
    from pycocotools.cocoeval import COCOeval

    evaluation = COCOeval(truth, results, "bbox")
    evaluation.params.imgIds = image_ids
    if iou is not None:
        evaluation.params.iouThrs = np.array([iou])
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return evaluation


def _check_against_pycocotools(gate: str, measurement, groups, results_file: Path, atol: float) -> int:
    """Every group's mAP (or per-class recall) of ``measurement`` equals pycocotools' on the same images, from
    data/coco/annotations.json and ``results_file``; the number of groups checked."""
    from pycocotools.coco import COCO as CocoApi

    marker, _, keywords, _ = GATES[gate]
    results = json.loads(results_file.read_text(encoding="utf-8"))
    if marker == "min_detection_recall":  # recall at a score threshold: pycocotools' recall of those detections
        results = [r for r in results if r["score"] >= keywords["score_threshold"]]
    with contextlib.redirect_stdout(io.StringIO()):
        truth = CocoApi(str(ANNOTATIONS))
        loaded = truth.loadRes(results)
    rows = measurement.details["map_groups" if marker == "min_detection_map" else "recall_groups"]
    masks = [(label, mask) for label, mask, _ in groups.masks()]
    assert [r["group"] for r in rows] == [label for label, _ in masks]
    for row, (_, mask) in zip(rows, masks):
        ids = (torch.nonzero(mask).flatten() + 1).tolist()  # image id = canvas + 1
        if marker == "min_detection_map":
            ev = _coco_eval(truth, loaded, ids, None)
            expected = ev.stats[1] if keywords.get("iou") == "0.5" else ev.stats[0]  # AP@.5 / AP@[.5:.95]
            assert row["map"] == pytest.approx(expected, abs=atol), (gate, row["group"])
        else:
            ev = _coco_eval(truth, loaded, ids, 0.5)
            recall = ev.eval["recall"][0, :, 0, -1]  # IoU 0.5, per category, area "all", 100 detections
            for c in row["classes"]:
                expected = recall[ev.params.catIds.index(CATEGORY_OFFSET + int(c["class"]))]
                assert c["recall"] == pytest.approx(expected, abs=atol), (gate, row["group"], c["class"])
    return len(rows)


@pytest.fixture(scope="session")
def onnx_detections(onnx_detector, dataset):
    """``onnx_detector``'s detections on data/eval_detection.npz, in batches of 64."""
    with torch.no_grad():
        return [d for s in range(0, len(dataset), 64) for d in onnx_detector(dataset.x[s:s + 64])]


@pytest.fixture(scope="session")
def eager_measurement(eager_detections, dataset, scenario_table, dnnsafety_settings):
    """``eager_measurement(gate)``: the gate's measurement of the eager run (computed once per gate)."""
    done: dict[str, object] = {}
    seed = dnnsafety_settings.get("seed").value

    def get(gate: str):
        if gate not in done:
            done[gate] = _measure(gate, eager_detections, dataset.targets, scenario_table, seed)[0]
        return done[gate]

    return get


def _same(a, b, atol: float) -> None:
    assert a.value == pytest.approx(b.value, abs=atol) and a.bound == pytest.approx(b.bound, abs=atol)
    assert a.details.get("worst_group") == b.details.get("worst_group")


@pytest.mark.parametrize("gate", list(GATES))
def test_recorded_values_equal_the_eager_ones_and_pycocotools(gate, scenario_table, dnnsafety_settings,
                                                              eager_measurement, coco_data, recorded_detector):
    """From the COCO copy and the recorded results file, each gate's value and bound equal the eager run's on
    data/eval_detection.npz (to 1e-9: the boxes went through x, y, w, h in JSON), and every group's numbers equal
    pycocotools' on the same two files."""
    seed = dnnsafety_settings.get("seed").value
    eager = eager_measurement(gate)
    recorded, groups = _measure(gate, recorded_detector.detections, coco_data.targets, scenario_table, seed)
    _same(recorded, eager, atol=1e-9)
    if importlib.util.find_spec("pycocotools") is not None:  # optional: the comparison needs it
        assert _check_against_pycocotools(gate, recorded, groups, RESULTS, atol=1e-9) >= 2


@pytest.mark.parametrize("gate", list(GATES))
def test_onnx_values_equal_the_eager_ones(gate, dataset, scenario_table, dnnsafety_settings, eager_measurement,
                                          onnx_detections):
    """models/detector.onnx under onnxruntime: each gate's value and bound equal the eager run's to 1e-6 (the
    float32 kernels differ in the last bits; no detection crosses the score threshold or an IoU threshold)."""
    seed = dnnsafety_settings.get("seed").value
    eager = eager_measurement(gate)
    onnx, _ = _measure(gate, onnx_detections, dataset.targets, scenario_table, seed)
    _same(onnx, eager, atol=1e-6)
