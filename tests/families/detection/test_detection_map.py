"""COCO mAP of :mod:`pytest_dnnsafety.engines.detection.matching` against independent references.

* pycocotools' ``COCOeval`` itself (bbox, xyxy -> xywh, area w·h) on seeded random cases with empty
  images, images without detections, detections without objects, crowded overlapping objects and
  tied scores: mAP@[.5:.95], mAP@.5 and every class's AP to 1e-6 (skipped without pycocotools);
* numbers pycocotools gave on fixed cases, stored as literals (run without it);
* a brute-force re-implementation of ``evaluateImg`` / ``accumulate`` in plain Python loops;
* the bootstrap: same seed same numbers, integer weights equal duplicated images, 0/1 weights equal
  the subset, and the 95 % lower bound covers a synthetic detector's population mAP in most seeds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from _coco_reference import random_case
from pytest_dnnsafety.engines.detection.matching import (
    COCO_IOU_THRESHOLDS, RECALL_POINTS, BoxMatchEngine, _class_score_order, average_precision, cell_iou)
from pytest_dnnsafety.data.boxes import box_iou
from pytest_dnnsafety.data.tasks import BoxSet, as_boxset

K = 4
CASES = [dict(), dict(crowded=True), dict(ties=True), dict(crowded=True, ties=True), dict(integer=False),
         dict(noise=0.3), dict(noise=0.3, crowded=True, ties=True)]


def _engine(dets: BoxSet, gts: BoxSet, cut: int = 5, **kwargs) -> BoxMatchEngine:
    """Matched in two batches (streaming), the first ``cut`` images first."""
    engine = BoxMatchEngine(**kwargs)
    engine.update(dets.images(0, cut), gts.images(0, cut))
    engine.update(dets.images(cut, dets.n_images), gts.images(cut, gts.n_images), start=cut)
    return engine


def _per_class(result, n_classes: int = K) -> np.ndarray:
    """(T, n_classes) AP, NaN where a class has no ground truth (or does not occur)."""
    out = np.full((result.ap.shape[1] if result.ap.numel() else 10, n_classes), np.nan)
    for i, c in enumerate(result.classes):
        out[:, c] = result.ap[i].numpy()
    return out


def test_thresholds_are_numpys_linspace_bit_for_bit() -> None:
    assert np.array_equal(COCO_IOU_THRESHOLDS.numpy(), np.linspace(.5, 0.95, 10, endpoint=True))
    assert np.array_equal(RECALL_POINTS.numpy(), np.linspace(.0, 1.00, 101, endpoint=True))


# ------------------------------------------------------------------------------------- pycocotools itself


@pytest.mark.parametrize("seed", range(12))
def test_equals_pycocotools(seed: int) -> None:
    pytest.importorskip("pycocotools")
    from _coco_reference import coco_eval

    options = CASES[seed % len(CASES)]
    dets, gts = random_case(1000 + seed, n_images=10 + seed, **options)
    result = _engine(dets, gts).evaluate()
    ref_map, ref_map50, precision = coco_eval(dets, gts, K)
    assert result.map == pytest.approx(ref_map, abs=1e-6, nan_ok=True)
    assert result.map50 == pytest.approx(ref_map50, abs=1e-6, nan_ok=True)
    ref_ap = np.where((precision > -1).all(1), precision.mean(1), np.nan)  # (T, K)
    ours = _per_class(result)
    assert np.array_equal(np.isnan(ours), np.isnan(ref_ap))
    assert np.nanmax(np.abs(ours - ref_ap), initial=0.0) < 1e-6


@pytest.mark.parametrize(("max_det", "iou"), [(3, None), (100, [0.6]), (2, [0.5, 0.75])])
def test_equals_pycocotools_with_a_detection_cap_and_other_thresholds(max_det: int, iou: list | None) -> None:
    pytest.importorskip("pycocotools")
    from _coco_reference import coco_eval

    dets, gts = random_case(77, n_images=14, crowded=True, ties=True)
    kwargs = {"max_detections": max_det, **({} if iou is None else {"iou_thresholds": iou})}
    result = _engine(dets, gts, **kwargs).evaluate()
    ref_map, ref_map50, _ = coco_eval(dets, gts, K, iou=iou, max_det=max_det)
    assert result.map == pytest.approx(ref_map, abs=1e-6)
    assert result.map50 == pytest.approx(ref_map50, abs=1e-6)


# numbers pycocotools 2.0.11 gave on these cases (tests/_coco_reference.coco_eval), kept for runs without it
LITERALS = [
    (101, {}, 0.09383663366336634, 0.11138613861386139, {}),
    (102, dict(crowded=True, ties=True), 0.12999866236166913, 0.19324597055978884, {}),
    (103, dict(integer=False), 0.08145214521452145, 0.11980198019801978, {}),
    (104, dict(crowded=True), 0.11380833841302682, 0.18564973336376947, {}),
    (105, dict(crowded=True), 0.08528406412069778, 0.12548326261197548, {"max_detections": 3}),
    (105, dict(crowded=True), 0.11699676270148023, 0.11699676270148023, {"iou_thresholds": [0.6]}),
    (106, dict(noise=0.3), 0.36858022340695606, 0.38770944402132523, {}),
    (107, dict(noise=0.3, crowded=True, ties=True), 0.29152830836021415, 0.30974131056998044, {}),
]


@pytest.mark.parametrize(("seed", "options", "expected", "expected50", "kwargs"), LITERALS)
def test_equals_stored_pycocotools_numbers(seed: int, options: dict, expected: float, expected50: float,
                                           kwargs: dict) -> None:
    dets, gts = random_case(seed, **options)
    result = _engine(dets, gts, **kwargs).evaluate()
    assert result.map == pytest.approx(expected, abs=1e-9)
    assert result.map50 == pytest.approx(expected50, abs=1e-9)


# ------------------------------------------------------------------------------------- brute force


def _brute_map(dets: BoxSet, gts: BoxSet, thresholds: list[float], max_det: int = 100) -> tuple[float, dict]:
    """evaluateImg + accumulate as plain loops over images, classes, thresholds, detections and objects."""
    iou = box_iou(dets.boxes, gts.boxes).numpy()
    classes = sorted(set(gts.labels.tolist()) | set(dets.labels.tolist()))
    rec_points = np.linspace(0, 1, 101)
    ap: dict[int, list[float]] = {}
    for c in classes:
        per_t = []
        n_gt = int((gts.labels == c).sum())
        if n_gt == 0:
            continue
        for t in thresholds:
            records = []  # (score, matched) in image order, each image's by score
            for i in range(gts.n_images):
                d_rows = [j for j in range(len(dets)) if int(dets.image[j]) == i and int(dets.labels[j]) == c]
                g_rows = [j for j in range(len(gts)) if int(gts.image[j]) == i and int(gts.labels[j]) == c]
                d_rows = sorted(d_rows, key=lambda j: -float(dets.scores[j]))[:max_det]  # sorted() is stable
                taken = set()
                for j in d_rows:
                    best, pick = min(t, 1 - 1e-10), None
                    for g in g_rows:
                        if g not in taken and iou[j, g] >= best:
                            best, pick = iou[j, g], g
                    if pick is not None:
                        taken.add(pick)
                    records.append((float(dets.scores[j]), pick is not None))
            records = sorted(records, key=lambda r: -r[0])
            tp = np.cumsum([m for _, m in records]).astype(float)
            fp = np.cumsum([not m for _, m in records]).astype(float)
            rc = tp / n_gt
            pr = list(tp / (fp + tp + np.spacing(1)))
            for n in range(len(pr) - 1, 0, -1):
                pr[n - 1] = max(pr[n - 1], pr[n])
            q = [pr[n] if n < len(pr) else 0.0 for n in np.searchsorted(rc, rec_points, side="left")]
            per_t.append(float(np.mean(q)))
        ap[c] = per_t
    values = [v for per_t in ap.values() for v in per_t]
    return (float(np.mean(values)) if values else math.nan), ap


@pytest.mark.parametrize("seed", range(6))
def test_equals_a_brute_force_reference_on_tiny_cases(seed: int) -> None:
    dets, gts = random_case(500 + seed, n_images=6, n_classes=3, crowded=seed % 2 == 0, ties=seed % 3 == 0)
    thresholds = COCO_IOU_THRESHOLDS.tolist()
    expected, ap = _brute_map(dets, gts, thresholds, max_det=4)
    result = _engine(dets, gts, cut=2, max_detections=4).evaluate()
    assert result.map == pytest.approx(expected, abs=1e-12, nan_ok=True)
    for i, c in enumerate(result.classes):
        if c in ap:
            assert result.ap[i].tolist() == pytest.approx(ap[c], abs=1e-12)
        else:
            assert torch.isnan(result.ap[i]).all()


def test_cell_iou_is_box_iou_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(3, 5, 4, generator=g) * 50, torch.rand(3, 7, 4, generator=g) * 50
    a[..., 2:] += a[..., :2]
    b[..., 2:] += b[..., :2]
    cells = cell_iou(a, b)
    for c in range(3):
        assert torch.equal(cells[c], box_iou(a[c], b[c]))


def test_hand_computed_case() -> None:
    """Two images, one class: a hit (0.9), a duplicate (0.8, FP), a miss; AP@.5 is 101 points of precision 1 up
    to recall 0.5 then nothing: 51/101."""
    gts = as_boxset([{"boxes": torch.tensor([[0., 0., 10., 10.]]), "labels": torch.tensor([1])},
                     {"boxes": torch.tensor([[0., 0., 10., 10.]]), "labels": torch.tensor([1])}], 2, "gts")
    dets = as_boxset([{"boxes": torch.tensor([[0., 0., 10., 10.], [1., 0., 10., 10.]]),
                       "labels": torch.tensor([1, 1]), "scores": torch.tensor([0.9, 0.8])},
                      {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64),
                       "scores": torch.zeros(0)}], 2, "dets", scores=True)
    engine = BoxMatchEngine([0.5])
    engine.update(dets, gts)
    assert engine.evaluate().map == pytest.approx(51 / 101)
    recall = engine.recall(score_threshold=0.5)
    assert recall.recall.tolist() == [0.5] and recall.overall == 0.5


def test_a_group_without_ground_truth_has_no_map_and_empty_data_no_records() -> None:
    dets, gts = random_case(3, n_images=8)
    engine = _engine(dets, gts)
    no_gt = (gts.counts() == 0)
    if not bool(no_gt.any()):
        pytest.skip("case has an object in every image")
    assert math.isnan(engine.evaluate(no_gt).map)
    empty = BoxMatchEngine()
    assert math.isnan(empty.evaluate().map)


# ------------------------------------------------------------------------------------- bootstrap


def _sorted_records(engine: BoxMatchEngine):
    score, label, image, matched, gimage, glabel = engine.records()
    classes = torch.unique(torch.cat([label, glabel]))
    cls, gcls = torch.searchsorted(classes, label), torch.searchsorted(classes, glabel)
    counts = torch.zeros(engine.n_images, len(classes), dtype=torch.float64)
    counts.index_put_((gimage, gcls), torch.ones(len(gimage), dtype=torch.float64), accumulate=True)
    order = _class_score_order(cls, score)
    bounds = torch.searchsorted(cls[order], torch.arange(len(classes) + 1)).tolist()
    return matched[order], image[order], bounds, counts


def test_bootstrap_same_seed_same_numbers_other_seed_other_numbers() -> None:
    dets, gts = random_case(11, n_images=30, crowded=True)
    engine = _engine(dets, gts)
    a = engine.evaluate(bootstrap=300, generator=torch.Generator().manual_seed(5))
    b = engine.evaluate(bootstrap=300, generator=torch.Generator().manual_seed(5))
    c = engine.evaluate(bootstrap=300, generator=torch.Generator().manual_seed(6))
    assert torch.equal(a.replicates, b.replicates) and (a.lower, a.upper) == (b.lower, b.upper)
    assert not torch.equal(a.replicates, c.replicates)
    assert a.lower <= a.map <= a.upper


def test_integer_weights_equal_duplicated_images_and_01_weights_the_subset() -> None:
    dets, gts = random_case(21, n_images=9, crowded=True)  # continuous scores: no ties across images
    engine = _engine(dets, gts)
    matched, image, bounds, counts = _sorted_records(engine)
    weights = torch.tensor([[2, 0, 1, 3, 1, 0, 1, 2, 1], [1, 1, 1, 0, 0, 0, 1, 1, 1]], dtype=torch.float64)
    weighted = average_precision(matched, image, bounds, counts, weights)
    for row, w in zip(weighted, weights.long().tolist()):
        picks = [i for i in range(9) for _ in range(w[i])]  # copies next to each other
        dup_d = BoxSet.cat([dets.images(i, i + 1) for i in picks])
        dup_g = BoxSet.cat([gts.images(i, i + 1) for i in picks])
        ref = BoxMatchEngine()
        ref.update(dup_d, dup_g)
        res = ref.evaluate()
        ours = {c: row[i] for i, c in enumerate(torch.unique(torch.cat([engine.records()[1], engine.records()[5]]))
                                                .tolist())}
        for i, c in enumerate(res.classes):
            assert ours[c].tolist() == pytest.approx(res.ap[i].tolist(), abs=1e-12, nan_ok=True)
    subset = engine.evaluate(weights[1].bool())
    assert float(torch.nanmean(weighted[1])) == pytest.approx(subset.map, abs=1e-12)


def _synthetic_pool(n_images: int, seed: int, thresholds: list[float] | None = None) -> BoxMatchEngine:
    """A detector whose misses cluster in 'hard' images (dependent objects), over a large image pool."""
    g = torch.Generator().manual_seed(seed)
    n_obj = torch.randint(1, 4, (n_images,), generator=g)
    hard = torch.rand(n_images, generator=g) < 0.3
    image = torch.repeat_interleave(torch.arange(n_images), n_obj)
    m = image.numel()
    xy = torch.rand(m, 2, generator=g) * 200
    boxes = torch.cat([xy, xy + 20], 1)
    labels = torch.randint(0, 2, (m,), generator=g)
    found = torch.rand(m, generator=g) < torch.where(hard[image], 0.3, 0.9)
    score = torch.where(found, 0.5 + 0.5 * torch.rand(m, generator=g), torch.rand(m, generator=g) * 0.6)
    jitter = torch.where(found[:, None], torch.rand(m, 4, generator=g) * 2, torch.full((m, 4), 15.0))
    targets = BoxSet(boxes, labels, image, n_images)
    dets = BoxSet(boxes + jitter, labels, image, n_images, score)
    engine = BoxMatchEngine(COCO_IOU_THRESHOLDS if thresholds is None else thresholds)
    for start in range(0, n_images, 4000):
        stop = min(start + 4000, n_images)
        engine.update(dets.images(start, stop), targets.images(start, stop), start)
    return engine


def test_bootstrap_lower_bound_covers_the_population_map() -> None:
    """100 samples of 60 images from a pool of 8000 (the population): the 95 % bound lies below the pool's
    mAP@.5 in at least 88 (mAP's small-sample bias makes a percentile bootstrap slightly optimistic; 91 here)."""
    pool = _synthetic_pool(8000, 0, [0.5])
    truth = pool.evaluate().map
    picker = torch.Generator().manual_seed(1)
    covered = 0
    for seed in range(100):
        sample = torch.randperm(8000, generator=picker)[:60]
        res = pool.evaluate(sample, bootstrap=200, confidence=0.95, generator=torch.Generator().manual_seed(seed))
        covered += res.lower <= truth
    assert covered >= 88, (covered, truth)


def test_recall_matches_a_direct_count() -> None:
    dets, gts = random_case(31, n_images=20, crowded=True)
    engine = _engine(dets, gts, iou_thresholds=[0.5])
    res = engine.recall(score_threshold=0.4, bootstrap=200, generator=torch.Generator().manual_seed(0))
    _, ap = _brute_map(dets.select(dets.scores >= 0.4), gts, [0.5])  # recall = matched / objects of the prefix
    score, label, image, matched, gimage, glabel = engine.records()
    for i, c in enumerate(res.classes):
        hits = int(((label == c) & (score >= 0.4) & matched[:, 0]).sum())
        assert res.recall[i] == pytest.approx(hits / int((glabel == c).sum()))
        assert res.lower[i] <= res.recall[i] + 1e-12
    assert res.objects == len(gts)
