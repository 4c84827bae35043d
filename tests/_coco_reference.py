"""Random detection cases and pycocotools' COCOeval on them (the independent reference of test_detection_map);
faster-coco-eval's ``COCOeval_faster`` on the same inputs (the speed reference of test_bench_detection)."""

from __future__ import annotations

import contextlib
import io
import time

import numpy as np
import torch

from pytest_dnnsafety.data.tasks import BoxSet


def random_case(seed: int, n_images: int = 12, n_classes: int = 4, crowded: bool = False, ties: bool = False,
                integer: bool = True, noise: float = 1.5) -> tuple[BoxSet, BoxSet]:
    """Targets and detections with empty images, images without detections, detections without objects,
    overlapping crowds and (``ties``) scores drawn from a few values."""
    rng = np.random.default_rng(seed)
    gts, dets = [], []
    for i in range(n_images):
        kind = rng.integers(0, 5)
        n_gt = 0 if kind == 0 else int(rng.integers(1, 12 if crowded else 5))
        n_det = 0 if kind == 1 else int(rng.integers(0, 25 if crowded else 8))
        centre = rng.uniform(20, 60, size=2)
        def boxes(n: int) -> np.ndarray:
            spread = 8 if crowded else 40
            xy = centre + rng.uniform(-spread, spread, size=(n, 2))
            wh = rng.uniform(8, 40, size=(n, 2))
            out = np.concatenate([xy, xy + wh], 1)
            return np.round(out) if integer else out
        g = boxes(n_gt)
        # detections: jittered copies of objects plus clutter
        d = boxes(n_det)
        if n_gt and n_det:
            copy = rng.integers(0, n_gt, size=n_det)
            near = rng.random(n_det) < (0.9 if noise < 1 else 0.7)
            jitter = rng.normal(0, noise, size=(n_det, 4))
            d[near] = g[copy[near]] + (np.round(jitter[near]) if integer else jitter[near])
            d[:, 2:] = np.maximum(d[:, 2:], d[:, :2] + 1)
        g_lab = rng.integers(0, n_classes, size=n_gt)
        d_lab = rng.integers(0, n_classes, size=n_det)
        if n_gt and n_det:
            d_lab[near] = np.where(rng.random(int(near.sum())) < 0.85, g_lab[copy[near]], d_lab[near])
        score = rng.choice([0.3, 0.5, 0.7, 0.9], size=n_det) if ties else rng.random(n_det)
        gts.append({"boxes": torch.tensor(g, dtype=torch.float32).reshape(-1, 4),
                    "labels": torch.tensor(g_lab, dtype=torch.int64)})
        dets.append({"boxes": torch.tensor(d, dtype=torch.float32).reshape(-1, 4),
                     "labels": torch.tensor(d_lab, dtype=torch.int64),
                     "scores": torch.tensor(score, dtype=torch.float32)})
    from pytest_dnnsafety.data.tasks import as_boxset

    return as_boxset(dets, n_images, "dets", scores=True), as_boxset(gts, n_images, "gts")


def coco_eval(dets: BoxSet, gts: BoxSet, n_classes: int, iou: list[float] | None = None,
              max_det: int = 100) -> tuple[float, float, np.ndarray]:
    """pycocotools' (mAP@[.5:.95], mAP@.5, precision array) for packed boxes (xyxy -> xywh, area w*h)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    def xywh(b: torch.Tensor) -> list[float]:
        x1, y1, x2, y2 = (float(v) for v in b)
        return [x1, y1, x2 - x1, y2 - y1]

    images = [{"id": i + 1} for i in range(gts.n_images)]
    anns = []
    for j in range(len(gts)):
        box = xywh(gts.boxes[j])
        anns.append({"id": j + 1, "image_id": int(gts.image[j]) + 1, "category_id": int(gts.labels[j]) + 1,
                     "bbox": box, "area": box[2] * box[3], "iscrowd": 0})
    coco = COCO()
    coco.dataset = {"images": images, "annotations": anns,
                    "categories": [{"id": k + 1} for k in range(n_classes)]}
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
        results = [{"image_id": int(dets.image[j]) + 1, "category_id": int(dets.labels[j]) + 1,
                    "bbox": xywh(dets.boxes[j]), "score": float(dets.scores[j])} for j in range(len(dets))]
        res = coco.loadRes(results) if results else COCO()
        if not results:
            res.dataset = {"images": images, "annotations": [], "categories": coco.dataset["categories"]}
            res.createIndex()
        ev = COCOeval(coco, res, "bbox")
        ev.params.maxDets = sorted({1, min(10, max_det), max_det})  # COCOeval sorts them; the last is used
        if iou is not None:
            ev.params.iouThrs = np.asarray(iou, dtype=float)
        ev.evaluate()
        ev.accumulate()
    prec = ev.eval["precision"][:, :, :, 0, -1]  # (T, R, K) area all, maxDets max_det
    valid = prec > -1
    all_map = float(prec[valid].mean()) if valid.any() else float("nan")
    p50 = prec[:1]
    map50 = float(p50[p50 > -1].mean()) if (p50 > -1).any() else float("nan")
    return all_map, map50, prec


def coco_inputs(dets: BoxSet, gts: BoxSet, n_classes: int) -> tuple[dict, list[dict]]:
    """COCO's in-memory inputs for packed boxes: the ground-truth dataset dict (images, annotations with xywh
    boxes and area w*h, categories) and the detection results list (image_id, category_id, bbox, score), ids from
    1 — the same floats as :func:`coco_eval` builds (float32 boxes widened to float64, then x2 - x1)."""
    def xywh(b: torch.Tensor) -> np.ndarray:
        b = b.double().numpy().reshape(-1, 4)
        return np.concatenate([b[:, :2], b[:, 2:] - b[:, :2]], 1)

    gb, db = xywh(gts.boxes), xywh(dets.boxes)
    g_img, g_lab = (gts.image + 1).tolist(), (gts.labels + 1).tolist()
    d_img, d_lab = (dets.image + 1).tolist(), (dets.labels + 1).tolist()
    area = (gb[:, 2] * gb[:, 3]).tolist()
    gbl, dbl, scores = gb.tolist(), db.tolist(), dets.scores.double().tolist()
    anns = [{"id": j + 1, "image_id": g_img[j], "category_id": g_lab[j], "bbox": gbl[j], "area": area[j],
             "iscrowd": 0} for j in range(len(gbl))]
    dataset = {"images": [{"id": i + 1} for i in range(gts.n_images)], "annotations": anns,
               "categories": [{"id": k + 1} for k in range(n_classes)]}
    results = [{"image_id": d_img[j], "category_id": d_lab[j], "bbox": dbl[j], "score": scores[j]}
               for j in range(len(dbl))]
    return dataset, results


def _summary(prec: np.ndarray) -> tuple[float, float]:
    valid = prec > -1
    all_map = float(prec[valid].mean()) if valid.any() else float("nan")
    p50 = prec[:1]
    map50 = float(p50[p50 > -1].mean()) if (p50 > -1).any() else float("nan")
    return all_map, map50


def timed_reference(library: str, dataset: dict, results: list[dict], max_det: int = 100
                    ) -> tuple[float, float, float, float]:
    """(mAP@[.5:.95], mAP@.5, total seconds, evaluate + accumulate seconds) of ``library`` (``"faster_coco_eval"``:
    its ``COCOeval_faster``; ``"pycocotools"``: ``COCOeval``) as users run it from in-memory inputs: the total
    includes building the ground-truth ``COCO`` object and ``loadRes`` of the results list (both libraries index
    and copy them), the second time only ``evaluate`` + ``accumulate``. ``loadRes`` writes into the result dicts,
    so give each call fresh inputs (:func:`coco_inputs`)."""
    if library == "faster_coco_eval":
        from faster_coco_eval import COCO
        from faster_coco_eval import COCOeval_faster as Evaluator
    else:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval as Evaluator
    with contextlib.redirect_stdout(io.StringIO()):
        start = time.perf_counter()
        coco = COCO()
        coco.dataset = dataset
        coco.createIndex()
        res = coco.loadRes(results)
        ev = Evaluator(coco, res, "bbox")
        ev.params.maxDets = sorted({1, min(10, max_det), max_det})
        begin = time.perf_counter()
        ev.evaluate()
        ev.accumulate()
        end = time.perf_counter()
    all_map, map50 = _summary(ev.eval["precision"][:, :, :, 0, -1])
    return all_map, map50, end - start, end - begin
