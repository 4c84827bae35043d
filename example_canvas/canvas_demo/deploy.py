"""The detector as it is deployed: an ONNX export, the evaluation set in COCO's format, detections recorded there.

Run from the project folder (``example_canvas/``), after ``python -m canvas_demo.train`` (which calls it too)::

    python -m canvas_demo.deploy

It reads ``models/detector.pt`` and ``data/eval_detection.npz`` and writes (all git-ignored, regenerated):

- ``models/detector.onnx``: :class:`ExportedDetector` exported with ``torch.onnx.export(dynamo=False)``; input
  ``images`` ``(N, 1, 48, 48)`` (dynamic ``N``), outputs ``boxes`` ``(N, 36, 4)`` float32 x1, y1, x2, y2,
  ``scores`` ``(N, 36)`` float32 and ``labels`` ``(N, 36)`` int64, one row per grid cell, label ``-1`` on the
  rows the eager decoding drops (the plugin's ONNX detector convention: those rows are padding);
- ``data/coco/annotations.json`` and ``data/coco/images/<id>.npy``: the evaluation canvases in COCO's
  format. Image ids 1..N in canvas order (``<id>.npy`` holds the canvas, float32 ``(1, 48, 48)``), category
  id ``100 + digit`` named after the digit (deliberately not 0..9, so a reader must map the ids
  explicitly), one annotation per digit with ``bbox`` ``[x, y, w, h]``, ``area = w * h``, ``iscrowd 0``;
- ``data/coco/results_eager.json``: the eager detector's detections on those images as a COCO results
  file (``[{image_id, category_id, bbox [x, y, w, h], score}]``) — standing for the predictions a test
  bench records on the target.

``ExportedDetector`` decodes exactly as :meth:`canvas_demo.models.GridDetector.decode` (same scores,
boxes, class-wise greedy NMS at IoU 0.5, score >= 0.05, at most 20 per image, the same order), but with
tensor operations only, so that the legacy ONNX exporter can trace it: the sorts are ranks from pairwise
comparisons (ties broken by cell index, as the eager stable sort does) and the greedy NMS is unrolled over
the 36 candidate ranks.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from canvas_demo.models import BOX_UNIT, STRIDE, GridDetector, box_iou, build_detector

__all__ = [
    "CATEGORY_OFFSET",
    "INPUT_NAME",
    "OUTPUT_NAMES",
    "ExportedDetector",
    "coco_detections",
    "export_onnx",
    "load_detector",
    "main",
    "record_results",
    "write_all",
    "write_coco",
]

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CATEGORY_OFFSET = 100  # COCO category id of digit d: 100 + d
INPUT_NAME = "images"
OUTPUT_NAMES = ("boxes", "scores", "labels")
OPSET = 17


def load_detector(path: Path | str = PROJECT_ROOT / "models" / "detector.pt") -> GridDetector:
    """The trained detector (eval mode, CPU)."""
    net = build_detector()
    net.load_state_dict(torch.load(path, weights_only=True))
    return net.eval()


def _rank(key: Tensor, tie: Tensor) -> Tensor:
    """Each entry's position in a descending stable sort of ``key`` (n, c) along dim 1: the number of entries
    with a larger key, or an equal key and a smaller index (``tie``: the constant (c, c) mask j < i)."""
    ahead = (key[:, None, :] > key[:, :, None]) | ((key[:, None, :] == key[:, :, None]) & tie)
    return ahead.sum(-1)


def _by_rank(values: Tensor, rank: Tensor) -> Tensor:
    """``values`` (n, c) permuted so that entry i lands at position ``rank[:, i]`` (the ranks are a permutation)."""
    return torch.zeros_like(values).scatter(1, rank, values)


class ExportedDetector(nn.Module):
    """``GridDetector`` with a fixed-size, export-friendly decoding: ``forward(x)`` returns ``(boxes, scores,
    labels)`` of shapes ``(N, 36, 4)``, ``(N, 36)``, ``(N, 36)``, one row per grid cell, the kept detections
    first in the eager order, then padding rows (label ``-1``, score 0, box 0)."""

    def __init__(self, detector: GridDetector) -> None:
        super().__init__()
        self.detector = detector
        self.num_classes = detector.num_classes
        self.score_threshold = float(detector.score_threshold)
        self.iou_threshold = float(detector.iou_threshold)
        self.max_detections = int(detector.max_detections)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        out = self.detector.raw(x)
        gh, gw = int(out.shape[2]), int(out.shape[3])  # 6 x 6: fixed by the 48 x 48 input
        cells = gh * gw
        out = out.flatten(2).transpose(1, 2)                                     # (n, cells, 15)
        obj = out[..., 0].sigmoid()
        prob, label = out[..., 1:1 + self.num_classes].softmax(-1).max(-1)
        score = obj * prob
        cell = torch.arange(cells)
        gx = (cell % gw).to(out.dtype)
        gy = torch.div(cell, gw, rounding_mode="floor").to(out.dtype)
        t = out[..., 1 + self.num_classes:]
        cx = (gx + t[..., 0].sigmoid()) * STRIDE
        cy = (gy + t[..., 1].sigmoid()) * STRIDE
        w = t[..., 2].clamp(-4, 4).exp() * BOX_UNIT
        h = t[..., 3].clamp(-4, 4).exp() * BOX_UNIT
        coords = [(cx - w / 2).clamp(0, 48), (cy - h / 2).clamp(0, 48), (cx + w / 2).clamp(0, 48),
                  (cy + h / 2).clamp(0, 48)]
        tie = torch.arange(cells)[None, :] < torch.arange(cells)[:, None]        # [i, j]: j < i

        # class-wise greedy NMS in descending score order (models.nms, unrolled)
        rank = _rank(score, tie)
        sorted_boxes = torch.stack([_by_rank(c, rank) for c in coords], -1)      # (n, cells, 4)
        sorted_label = _by_rank(label, rank)
        same = sorted_label[:, :, None] == sorted_label[:, None, :]
        over = (box_iou(sorted_boxes, sorted_boxes) > self.iou_threshold) & same & tie.T  # [j, i]: j < i
        keep = torch.ones_like(score, dtype=torch.bool)
        for i in range(1, cells):
            suppressed = (keep & over[:, :, i]).any(1, keepdim=True)             # by a kept, earlier box
            keep = keep & ~(suppressed & (cell == i))
        keep = keep.gather(1, rank) & (score >= self.score_threshold)            # back to cell order

        # kept detections by descending score (stable), at most max_detections, then padding
        final = _rank(torch.where(keep, score, torch.full_like(score, -1.0)), tie)
        keep = keep & (final < self.max_detections)
        zero = torch.zeros_like(score)
        boxes = torch.stack([_by_rank(torch.where(keep, c, zero), final) for c in coords], -1)
        scores = _by_rank(torch.where(keep, score, zero), final)
        labels = _by_rank(torch.where(keep, label, torch.full_like(label, -1)), final)
        return boxes, scores, labels


def unpadded(boxes: Tensor, scores: Tensor, labels: Tensor) -> list[dict[str, Tensor]]:
    """The padded outputs as one dict per image (torchvision's format), the rows with label -1 dropped."""
    return [{"boxes": b[k], "scores": s[k], "labels": lab[k]}
            for b, s, lab in zip(boxes, scores, labels) for k in [lab >= 0]]


def export_onnx(path: Path | str = PROJECT_ROOT / "models" / "detector.onnx", detector: GridDetector | None = None
                ) -> Path:
    """Write the detector with its decoding as ONNX (legacy exporter): input ``images`` with a dynamic batch axis,
    outputs ``boxes``, ``scores``, ``labels``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapper = ExportedDetector(detector if detector is not None else load_detector()).eval()
    dynamic = {name: {0: "batch"} for name in (INPUT_NAME, *OUTPUT_NAMES)}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the legacy exporter's DeprecationWarning and tracer warnings
        torch.onnx.export(wrapper, (torch.zeros(2, 1, 48, 48),), str(path), dynamo=False, opset_version=OPSET,
                          input_names=[INPUT_NAME], output_names=list(OUTPUT_NAMES), dynamic_axes=dynamic,
                          do_constant_folding=True)
    return path


def _eval_arrays(npz: Path | str) -> dict[str, np.ndarray]:
    with np.load(npz) as f:
        return {k: f[k] for k in ("x", "boxes", "labels", "offsets")}


def write_coco(folder: Path | str = PROJECT_ROOT / "data" / "coco",
               npz: Path | str = PROJECT_ROOT / "data" / "eval_detection.npz") -> Path:
    """The evaluation canvases in COCO's format: ``annotations.json`` and ``images/<id>.npy`` (see the module
    docstring). Returns the annotations file."""
    folder = Path(folder)
    d = _eval_arrays(npz)
    images_dir = folder / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for i in range(len(d["x"])):
        image_id = i + 1
        name = f"{image_id}.npy"
        np.save(images_dir / name, np.ascontiguousarray(d["x"][i], dtype=np.float32), allow_pickle=False)
        images.append({"id": image_id, "file_name": name, "width": 48, "height": 48})
        for row in range(int(d["offsets"][i]), int(d["offsets"][i + 1])):
            x1, y1, x2, y2 = (float(v) for v in d["boxes"][row])
            w, h = x2 - x1, y2 - y1
            annotations.append({"id": row + 1, "image_id": image_id,
                                "category_id": CATEGORY_OFFSET + int(d["labels"][row]),
                                "bbox": [x1, y1, w, h], "area": w * h, "iscrowd": 0})
    categories = [{"id": CATEGORY_OFFSET + c, "name": str(c), "supercategory": "digit"} for c in range(10)]
    doc = {"info": {"description": "canvas_demo evaluation canvases (generated by canvas_demo.deploy)"},
           "images": images, "annotations": annotations, "categories": categories}
    out = folder / "annotations.json"
    out.write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")
    return out


def coco_detections(detections: list[dict[str, Tensor]], image_ids: list[int]) -> list[dict]:
    """Detections (one torchvision dict per image) as COCO results: ``[{image_id, category_id, bbox, score}]``
    with ``bbox`` ``[x, y, w, h]`` and ``category_id`` ``100 + label``."""
    results = []
    for image_id, det in zip(image_ids, detections):
        for box, score, label in zip(det["boxes"].tolist(), det["scores"].tolist(), det["labels"].tolist()):
            x1, y1, x2, y2 = box
            results.append({"image_id": int(image_id), "category_id": CATEGORY_OFFSET + int(label),
                            "bbox": [x1, y1, x2 - x1, y2 - y1], "score": score})
    return results


def record_results(path: Path | str = PROJECT_ROOT / "data" / "coco" / "results_eager.json",
                   annotations: Path | str = PROJECT_ROOT / "data" / "coco" / "annotations.json",
                   detector: GridDetector | None = None, batch_size: int = 64) -> Path:
    """Run the eager detector on the COCO copy's images (read from ``images/<file_name>``) and write its
    detections as a COCO results file."""
    path, annotations = Path(path), Path(annotations)
    net = detector if detector is not None else load_detector()
    doc = json.loads(annotations.read_text(encoding="utf-8"))
    ids = [img["id"] for img in doc["images"]]
    files = [annotations.parent / "images" / img["file_name"] for img in doc["images"]]
    results = []
    with torch.no_grad():
        for start in range(0, len(files), batch_size):
            x = torch.from_numpy(np.stack([np.load(f, allow_pickle=False) for f in files[start:start + batch_size]]))
            results += coco_detections(net(x), ids[start:start + batch_size])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, separators=(",", ":")) + "\n", encoding="utf-8")
    return path


def write_all(root: Path | str = PROJECT_ROOT, detector: GridDetector | None = None) -> list[Path]:
    """Every deployment artifact of the module docstring under ``root`` (from its models/ and data/). Without the
    ``onnx`` package (the ``[onnx]`` extra) the export is skipped, with a note; the COCO files are written."""
    root = Path(root)
    net = detector if detector is not None else load_detector(root / "models" / "detector.pt")
    coco = write_coco(root / "data" / "coco", root / "data" / "eval_detection.npz")
    written = [coco, record_results(root / "data" / "coco" / "results_eager.json", coco, net)]
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs it)
    except ImportError:
        print("canvas_demo.deploy: the onnx package is not installed (pip install -e '..[onnx]'): "
              "models/detector.onnx not written")
    else:
        written.insert(0, export_onnx(root / "models" / "detector.onnx", net))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the same float sums as the training run's files
    for path in write_all(args.out):
        print(f"canvas_demo.deploy: wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
