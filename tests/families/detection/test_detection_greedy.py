"""The batched greedy matching (engines/detection/greedy.py) against a per-cell Python loop written from
pycocotools' ``evaluateImg``: the same kept detections, order and matched bits, also in tiny spans, with ties in
scores and IoUs, cells without objects or without detections, the ``max_detections`` cap and negative labels;
and the engine's thread policy (one thread inside, the caller's count restored)."""

from __future__ import annotations

import pytest
import torch
from _coco_reference import random_case

from pytest_dnnsafety.data.boxes import box_iou
from pytest_dnnsafety.data.tasks import BoxSet
from pytest_dnnsafety.engines.detection import greedy
from pytest_dnnsafety.engines.detection.matching import (
    COCO_IOU_THRESHOLDS,
    BoxMatchEngine,
)


def loop_match(dets: BoxSet, gts: BoxSet, thr: torch.Tensor, max_det: int):
    """pycocotools' evaluateImg per (image, class), in plain Python: cells in (image, class) order, detections by
    score descending (stable), capped; each takes the unmatched object with the highest IoU >= t, the later of
    equal IoUs."""
    rows = []
    cells = sorted({(int(i), int(c)) for i, c in zip(dets.image, dets.labels)})
    for img, lab in cells:
        d = [j for j in range(len(dets)) if int(dets.image[j]) == img and int(dets.labels[j]) == lab]
        d = sorted(d, key=lambda j: -float(dets.scores[j].double()))[:max_det]
        g = [j for j in range(len(gts)) if int(gts.image[j]) == img and int(gts.labels[j]) == lab]
        ious = box_iou(dets.boxes[d], gts.boxes[g]) if g else torch.zeros(len(d), 0)
        for t_i, t in enumerate(thr.tolist()):
            taken = [False] * len(g)
            for r, j in enumerate(d):
                best, m = min(t, 1 - 1e-10), -1
                for q in range(len(g)):
                    if taken[q] or float(ious[r, q]) < best:
                        continue
                    best, m = float(ious[r, q]), q
                if m >= 0:
                    taken[m] = True
                rows.append((img, lab, r, j, t_i, m >= 0))
    D = len({(a[3]) for a in rows})
    order = []
    for img, lab, r, j, t_i, hit in rows:
        if t_i == 0:
            order.append(j)
    matched = torch.zeros(D, thr.numel(), dtype=torch.bool)
    pos = {j: k for k, j in enumerate(order)}
    for img, lab, r, j, t_i, hit in rows:
        matched[pos[j], t_i] = hit
    idx = torch.tensor(order, dtype=torch.int64)
    return dets.scores.double()[idx], dets.labels[idx], dets.image[idx], matched


def duplicated_case(seed: int) -> tuple[BoxSet, BoxSet]:
    """Few images, copies of the same object box (equal IoUs), equal scores, a negative label."""
    gen = torch.Generator().manual_seed(seed)
    n = 5
    base = torch.tensor([[10.0, 10.0, 30.0, 30.0], [12.0, 11.0, 31.0, 33.0], [40.0, 40.0, 60.0, 55.0]])
    g_img = torch.sort(torch.randint(0, n, (18,), generator=gen)).values
    g_box = base[torch.randint(0, 3, (18,), generator=gen)]
    g_lab = torch.randint(-1, 2, (18,), generator=gen)
    d_img = torch.sort(torch.randint(0, n, (40,), generator=gen)).values
    d_box = base[torch.randint(0, 3, (40,), generator=gen)] + torch.randint(-2, 3, (40, 4), generator=gen).float()
    d_lab = torch.randint(-1, 2, (40,), generator=gen)
    score = torch.tensor([0.2, 0.5, 0.9])[torch.randint(0, 3, (40,), generator=gen)]
    return BoxSet(d_box, d_lab, d_img, n, score), BoxSet(g_box, g_lab, g_img, n)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("limit", [greedy.MATCH_CHUNK_ELEMENTS, 60])
@pytest.mark.parametrize("max_det", [100, 2])
def test_batched_greedy_equals_the_per_cell_loop(seed: int, limit: int, max_det: int) -> None:
    cases = [random_case(seed, n_images=10, n_classes=3, crowded=True, ties=bool(seed % 2)), duplicated_case(seed)]
    for dets, gts in cases:
        got = greedy.match_batch(dets, gts, COCO_IOU_THRESHOLDS, max_det, limit)
        want = loop_match(dets, gts, COCO_IOU_THRESHOLDS, max_det)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_batches_without_objects_or_detections() -> None:
    dets, gts = random_case(1, n_images=6, n_classes=2)
    empty_gt = BoxSet(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 6)
    matched = greedy.match_batch(dets, empty_gt, COCO_IOU_THRESHOLDS, 100)[3]
    assert matched.shape == (len(dets), 10) and not bool(matched.any())
    no_dets = BoxSet(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 6,
                     torch.zeros(0))
    assert greedy.match_batch(no_dets, gts, COCO_IOU_THRESHOLDS, 100)[3].shape == (0, 10)
    other = BoxSet(gts.boxes, gts.labels + 5, gts.image, 6)  # objects only of other classes: nothing to match
    assert not bool(greedy.match_batch(dets, other, COCO_IOU_THRESHOLDS, 100)[3].any())


def test_cell_spans_respect_the_limit() -> None:
    spans = greedy.cell_spans([5] * 30, [300] + [20] * 29, 10, limit=2_000)
    assert spans[0] == (0, 1, 5, 300) and spans[-1][1] == 30
    assert all((c1 - c0) * sg * 10 <= 2_000 or c1 - c0 == 1 for c0, c1, _sd, sg in spans)


def test_engine_matches_on_one_thread_and_restores_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_dnnsafety.engines.detection import matching

    dets, gts = random_case(2, n_images=8, n_classes=3)
    seen = []
    real = matching.match_batch

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(matching, "match_batch", spy)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        engine = BoxMatchEngine()
        engine.update(dets, gts)
        assert seen == [1] and torch.get_num_threads() == 2
        engine.evaluate()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
