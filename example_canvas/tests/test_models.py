"""Plain unit tests of the project's own code: the detector's output format and its NMS."""

import torch

from canvas_demo.models import box_iou, build_detector, nms


def test_blank_canvases_give_empty_detections_of_the_right_shape(model):
    out = model(torch.zeros(3, 1, 48, 48, device=next(model.parameters(), torch.empty(0)).device))
    assert len(out) == 3
    for item in out:
        assert item["boxes"].shape == (0, 4) or item["boxes"].shape[1] == 4
        assert item["scores"].shape == item["labels"].shape == item["boxes"].shape[:1]
        assert item["labels"].dtype == torch.int64
    untrained = build_detector().eval()
    with torch.no_grad():
        untrained.head.bias.fill_(-20.0)  # objectness far below the score threshold: nothing detected
        empty = untrained(torch.zeros(2, 1, 48, 48))
    assert [d["boxes"].shape for d in empty] == [(0, 4), (0, 4)]
    assert [d["scores"].shape for d in empty] == [(0,), (0,)]


def test_detector_is_deterministic(model, dataset):
    x = dataset.x[:16].to(next(model.parameters(), torch.empty(0)).device)
    with torch.no_grad():
        a, b = model(x), model(x)
    for da, db in zip(a, b):
        for key in ("boxes", "scores", "labels"):
            assert torch.equal(da[key], db[key])


def _greedy(boxes, scores, labels, thr):
    keep = []
    for i in sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i)):
        if all(labels[j] != labels[i] or box_iou(boxes[i:i + 1], boxes[j:j + 1]).item() <= thr for j in keep):
            keep.append(i)
    return sorted(keep)


def test_nms_is_exact_greedy_per_class():
    gen = torch.Generator().manual_seed(0)
    xy = torch.rand(4, 36, 2, generator=gen) * 36
    wh = 6 + torch.rand(4, 36, 2, generator=gen) * 14
    boxes = torch.cat([xy, xy + wh], -1)
    scores = torch.rand(4, 36, generator=gen)
    labels = torch.randint(3, (4, 36), generator=gen)
    kept = nms(boxes, scores, labels, 0.5)
    for i in range(4):
        assert kept[i].nonzero().flatten().tolist() == _greedy(boxes[i], scores[i], labels[i], 0.5)
