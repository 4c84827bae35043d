"""Box geometry of the detection task: IoU of boxes ``x1, y1, x2, y2`` (COCO's, crowd regions included) and the
first rows of packed groups. Pure torch, on the boxes' device; :mod:`.tasks` holds the boxes themselves."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["box_iou", "group_starts", "paired_iou"]


def paired_iou(a: Tensor, b: Tensor, crowd: Tensor | None = None) -> Tensor:
    """Jaccard index (IoU) of ``a[..., :]`` with ``b[..., :]``, boxes ``x1, y1, x2, y2`` broadcast against each
    other over the leading dimensions, in float64 (as COCO evaluates it). The one IoU kernel of the plugin:
    :func:`box_iou` (every pair of two lists), per-image pairings and per-cell matrices all call it, so they
    give the same bits for the same two boxes. Areas are ``(x2 - x1)·(y2 - y1)`` (no +1 pixel convention);
    two empty boxes have IoU 0. ``crowd`` (bool, broadcast against ``b``'s leading dimensions): where true, ``b``
    is a COCO crowd region and the overlap is the intersection over ``a``'s area (pycocotools' ``iscrowd``).
    """
    a, b = a.double(), b.double()
    area_a = (a[..., 2] - a[..., 0]).clamp_min(0) * (a[..., 3] - a[..., 1]).clamp_min(0)
    area_b = (b[..., 2] - b[..., 0]).clamp_min(0) * (b[..., 3] - b[..., 1]).clamp_min(0)
    lt = torch.maximum(a[..., :2], b[..., :2])
    rb = torch.minimum(a[..., 2:], b[..., 2:])
    inter = (rb - lt).clamp_min(0).prod(dim=-1)
    union = area_a + area_b - inter
    if crowd is not None:
        union = torch.where(crowd, area_a.expand_as(union), union)
    return torch.where(union > 0, inter / union.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(inter))


def box_iou(a: Tensor, b: Tensor) -> Tensor:
    """``(len(a), len(b))`` IoU of every box of ``a`` with every box of ``b`` (:func:`paired_iou`)."""
    return paired_iou(a[:, None, :], b[None, :, :])


def group_starts(counts: Tensor) -> Tensor:
    """Exclusive cumulative sum of ``counts``: the first row of each group of packed rows (on their device)."""
    return torch.cumsum(counts, 0) - counts
