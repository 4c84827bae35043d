"""mAP of the example detector (example_canvas) equals pycocotools' COCOeval (issue #22 acceptance).

The trained detector of the second example project runs on its 540 evaluation canvases (1–4 digits,
crowded ones with overlapping digits included) plus blank canvases with no object (empty images) and
blank canvases with an annotated object the detector cannot find (images without detections). Our
streamed, batched :class:`~pytest_dnnsafety.engines.detection.matching.BoxMatchEngine` must give pycocotools'
mAP@[.5:.95], mAP@.5 and every class's AP to 1e-6.

The project's trained files are used when README command 1 (or CI step 1) already wrote them;
otherwise the project is trained into a temporary folder (about a minute).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pytest_dnnsafety.data.forms import iter_batches
from pytest_dnnsafety.engines.detection.matching import BoxMatchEngine
from pytest_dnnsafety.engines.core.guard import ForwardGuard
from pytest_dnnsafety.data.tasks import BoxSet, DetectionData

pytest.importorskip("pycocotools")
from _coco_reference import coco_eval  # noqa: E402

PROJECT = Path(__file__).resolve().parents[3] / "example_canvas"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if (PROJECT / "models" / "detector.pt").exists() and (PROJECT / "data" / "eval_detection.npz").exists():
        return PROJECT
    out = tmp_path_factory.mktemp("canvas")
    subprocess.run([sys.executable, "-m", "canvas_demo.train", "--out", str(out)], cwd=PROJECT, check=True,
                   capture_output=True)
    return out


def _detector(root: Path) -> torch.nn.Module:
    sys.path.insert(0, str(PROJECT))
    try:
        from canvas_demo.models import build_detector
    finally:
        sys.path.remove(str(PROJECT))
    net = build_detector()
    net.load_state_dict(torch.load(root / "models" / "detector.pt", weights_only=True))
    return net.eval()


def _with_blank_canvases(root: Path) -> DetectionData:
    with np.load(root / "data" / "eval_detection.npz") as f:
        data = DetectionData.from_offsets(f["x"], f["boxes"], f["labels"], f["offsets"])
    blank = torch.zeros(20, *data.x.shape[1:], dtype=data.x.dtype)
    # 10 blank canvases without objects, then 10 whose one annotated digit is not there to be found
    unseen = BoxSet(torch.tensor([[10.0, 10.0, 26.0, 26.0]]).repeat(10, 1), torch.arange(10),
                    torch.arange(10, 20), 20)
    return DetectionData(torch.cat([data.x, blank]), BoxSet.cat([data.targets, unseen]))


def test_map_of_the_example_detector_equals_pycocotools(trained: Path) -> None:
    model = _detector(trained)
    data = _with_blank_canvases(trained)
    guard = ForwardGuard("example detector", task="detection", num_classes=10)
    engine = BoxMatchEngine()
    parts = []
    start = 0
    with torch.no_grad():
        for x, targets in iter_batches(data, 128):
            dets = guard(model, x)
            engine.update(dets, targets, start=start)
            parts.append(dets)
            start += x.shape[0]
    guard.check()
    dets = BoxSet.cat(parts)
    counts, objects = dets.counts(), data.targets.counts()
    assert int(((counts == 0) & (objects > 0)).sum()) >= 10, "images with objects but no detection"
    assert int(((objects == 0)).sum()) >= 10, "empty images"
    assert int((objects >= 4).sum()) > 50, "crowded canvases"
    ours = engine.evaluate()
    ref_map, ref_map50, precision = coco_eval(dets, data.targets, 10)
    assert ours.map == pytest.approx(ref_map, abs=1e-6)
    assert ours.map50 == pytest.approx(ref_map50, abs=1e-6)
    assert 0.3 < ours.map < 0.9  # a trained detector, not a degenerate case
    ref_ap = np.where(precision > -1, precision, np.nan).mean(axis=1)  # (T, K) AP per threshold and class
    for i, cls in enumerate(ours.classes):
        np.testing.assert_allclose(ours.ap[i].numpy(), ref_ap[:, cls], atol=1e-6)
