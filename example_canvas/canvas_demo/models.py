"""The two models under test, pure torch (no torchvision).

Both read float32 canvases ``(N, 1, 48, 48)`` in [0, 1]. Layers have dotted names for hooks.

**Backbone** (both models, the same layout, trained separately): a canvas to a 6x6 grid of 64 features
(stride 8, receptive field 46 px), ``backbone.0`` .. ``backbone.9``:

=================  ==========================================  ==============
``backbone.0``     Conv2d(1, 16, 3, stride=2, padding=1)       (N, 16, 24, 24)
``backbone.1``     ReLU
``backbone.2``     Conv2d(16, 32, 3, padding=1) + ``.3`` ReLU  (N, 32, 24, 24)
``backbone.4``     MaxPool2d(2)                                (N, 32, 12, 12)
``backbone.5``     Conv2d(32, 64, 3, padding=1) + ``.6`` ReLU  (N, 64, 12, 12)
``backbone.7``     MaxPool2d(2)                                (N, 64, 6, 6)
``backbone.8``     Conv2d(64, 64, 3, padding=1) + ``.9`` ReLU  (N, 64, 6, 6)
=================  ==========================================  ==============

**Reader** (``build_reader``, multi-label): which digits are on the canvas? The 1x1 convolution
``head`` gives per grid cell an objectness logit and 10 class logits; the probability that digit
``c`` is on the canvas is the largest ``sigmoid(objectness) * softmax(class)_c`` over the cells, and
``forward`` returns it as a logit, ``(N, 10)`` (a digit is read as present when its probability
reaches 0.5). Trained with the cell of every digit's centre as supervision (the same targets as
the detector, without the box): image-level labels alone did not train in the CPU budget.

**Detector** (``build_detector``): a one-stage, anchor-free grid detector of stride 8. The backbone
maps a canvas to the 6x6 grid; the 1x1 convolution ``head`` gives per cell 15 numbers: objectness, 10 class logits,
and the box (``tx, ty``: the centre inside the cell through a sigmoid; ``tw, th``: log of width and
height over 16 px); ``raw`` returns that ``(N, 15, 6, 6)`` map (for the loss). ``forward`` decodes it: score = sigmoid(objectness) * max softmax(class), boxes with score
>= 0.05, class-wise greedy NMS at IoU 0.5 (batched over images, deterministic), and returns
torchvision's format: one dict per image with ``boxes`` ``(n, 4)`` float32 x1, y1, x2, y2 pixels,
``scores`` ``(n,)`` and ``labels`` ``(n,)`` int64 (``n`` may be 0).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["Reader", "GridDetector", "build_reader", "build_detector", "STRIDE", "GRID", "NUM_CLASSES"]

NUM_CLASSES = 10
STRIDE = 8
GRID = 48 // STRIDE
BOX_UNIT = 16.0   # tw = log(width / 16)


def _backbone() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, stride=2, padding=1), nn.ReLU(),                # 24
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),         # 12
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),         # 6
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),                          # 6
    )


class Reader(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.backbone = _backbone()
        self.head = nn.Conv2d(64, 1 + num_classes, 1)

    def raw(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    def forward(self, x: Tensor) -> Tensor:
        out = self.raw(x).flatten(2)                                             # (n, 11, cells)
        p = (out[:, :1].sigmoid() * out[:, 1:].softmax(1)).amax(2).clamp(1e-6, 1 - 1e-6)
        return torch.log(p) - torch.log1p(-p)


class GridDetector(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES, score_threshold: float = 0.05, iou_threshold: float = 0.5,
                 max_detections: int = 20) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.score_threshold = score_threshold
        self.iou_threshold = iou_threshold
        self.max_detections = max_detections
        self.backbone = _backbone()
        self.head = nn.Conv2d(64, 5 + num_classes, 1)

    def raw(self, x: Tensor) -> Tensor:
        return self.head(self.backbone(x))

    def forward(self, x: Tensor):
        return self.decode(self.raw(x))

    def decode(self, out: Tensor) -> list[dict[str, Tensor]]:
        n, _, gh, gw = out.shape
        out = out.flatten(2).transpose(1, 2)                                     # (n, cells, 15)
        obj = out[..., 0].sigmoid()
        prob, label = out[..., 1:1 + self.num_classes].softmax(-1).max(-1)
        score = obj * prob
        cell = torch.arange(gh * gw, device=out.device)
        gx = (cell % gw).to(out.dtype)
        gy = torch.div(cell, gw, rounding_mode="floor").to(out.dtype)
        t = out[..., 1 + self.num_classes:]
        cx = (gx + t[..., 0].sigmoid()) * STRIDE
        cy = (gy + t[..., 1].sigmoid()) * STRIDE
        w = t[..., 2].clamp(-4, 4).exp() * BOX_UNIT
        h = t[..., 3].clamp(-4, 4).exp() * BOX_UNIT
        boxes = torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1).clamp(0, 48)
        keep = nms(boxes, score, label, self.iou_threshold) & (score >= self.score_threshold)
        # per image: kept boxes by descending score (stable), at most max_detections
        order = torch.sort(torch.where(keep, score, -1.0), dim=1, descending=True, stable=True).indices
        order = order[:, : self.max_detections]
        keep = keep.gather(1, order)
        boxes = boxes.gather(1, order[..., None].expand(-1, -1, 4))
        score, label = score.gather(1, order), label.gather(1, order)
        counts = keep.sum(1).tolist()                                            # one host sync per batch
        return [{"boxes": boxes[i, :k], "scores": score[i, :k], "labels": label[i, :k]}
                for i, k in enumerate(counts)]


def box_iou(a: Tensor, b: Tensor) -> Tensor:
    """Pairwise IoU of ``(..., n, 4)`` and ``(..., m, 4)`` boxes: ``(..., n, m)``."""
    lo = torch.maximum(a[..., :, None, :2], b[..., None, :, :2])
    hi = torch.minimum(a[..., :, None, 2:], b[..., None, :, 2:])
    inter = (hi - lo).clamp(min=0).prod(-1)
    area_a = (a[..., 2:] - a[..., :2]).clamp(min=0).prod(-1)
    area_b = (b[..., 2:] - b[..., :2]).clamp(min=0).prod(-1)
    return inter / (area_a[..., :, None] + area_b[..., None, :] - inter).clamp(min=1e-9)


def nms(boxes: Tensor, scores: Tensor, labels: Tensor, iou_threshold: float) -> Tensor:
    """Class-wise greedy NMS of ``(n, c, 4)`` boxes per image, batched: ``(n, c)`` bool kept.

    Exact greedy (a box is dropped when a kept, higher-scoring box of its class overlaps it by more
    than ``iou_threshold``), one vectorised step per candidate rank; ties broken by cell index.
    """
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    b = boxes.gather(1, order[..., None].expand(-1, -1, 4))
    lab = labels.gather(1, order)
    same = lab[:, :, None] == lab[:, None, :]
    over = (box_iou(b, b) > iou_threshold) & same                                # (n, c, c)
    c = scores.shape[1]
    keep = torch.ones_like(scores, dtype=torch.bool)
    for i in range(1, c):
        suppressed = (keep[:, :i] & over[:, :i, i]).any(1)
        keep[:, i] = ~suppressed
    out = torch.zeros_like(keep)
    out.scatter_(1, order, keep)
    return out


def build_reader() -> nn.Module:
    """A fresh, untrained multi-label reader (the reader's model factory)."""
    return Reader()


def build_detector() -> nn.Module:
    """A fresh, untrained grid detector (the detector's model factory)."""
    return GridDetector()
