"""A detector's confidence in its ground-truth objects, per object and per image, with matrix operations.

The occlusion, adversarial-confidence and monitor gates read a detector through one quantity: the
*matched score* of a ground-truth object, "the maximum probability of the correct class over all
detected boxes that have a significant Jaccard similarity with the ground truth bounding box"
(Cheng et al. 2018, §II-F step 2): the highest score of a detection of the object's class, in its
image, with IoU ≥ ``iou``, else 0 (:func:`~pytest_dnnsafety.data.tasks.matched_scores`).

:func:`repeat_targets` lays out the
targets of copies of images (copy ``k`` of image ``images[k]``), :func:`top_scores` gives each
image's mean top-``k`` detection score (a score-based runtime monitor reads ``1 −`` it),
:func:`select_images` takes a subset of images out of a packed set and :func:`image_errors` tells,
per image, whether the detector got it wrong (a missed object or a false detection); :func:`declared_classes`
reads the class count a detector declares (``num_classes``, torchvision's heads). Pure torch; no pytest import.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.data.boxes import group_starts
from pytest_dnnsafety.data.tasks import BoxSet, matched_scores

__all__ = ["repeat_targets", "top_scores", "select_images",
           "image_errors", "declared_classes", "detector_classes"]


def repeat_targets(targets: BoxSet, images: Tensor) -> tuple[BoxSet, Tensor]:
    """The targets of copies of images: copy ``k`` is image ``images[k]`` of ``targets``.

    Returns the packed targets of the ``len(images)`` copies (copy ``k``'s objects are image ``k``) and,
    per row, the object's row in ``targets`` (so a copy's matched scores go back to its object).
    """
    device = targets.device
    images = images.to(device)
    counts = torch.bincount(targets.image, minlength=targets.n_images)[: targets.n_images]
    per_copy = counts[images]
    copy_of = torch.repeat_interleave(torch.arange(images.shape[0], device=device), per_copy)
    within = torch.arange(copy_of.shape[0], device=device) - group_starts(per_copy)[copy_of]
    obj = group_starts(counts)[images[copy_of]] + within
    return BoxSet(targets.boxes[obj], targets.labels[obj], copy_of, int(images.shape[0])), obj


def top_scores(detections: BoxSet, k: int = 1) -> Tensor:
    """Per image the mean of its ``k`` highest detection scores, a missing detection counting 0: ``(n_images,)``."""
    n = detections.n_images
    if detections.scores is None:
        raise ValueError("top_scores needs detections with scores")
    device = detections.device
    if len(detections) == 0 or n == 0:
        return torch.zeros(n, device=device)
    scores = detections.scores.float()
    # sort by image, then by descending score: rank within the image
    order = torch.argsort(scores, descending=True, stable=True)
    order = order[torch.argsort(detections.image[order], stable=True)]
    image = detections.image[order]
    counts = torch.bincount(image, minlength=n)[:n]
    rank = torch.arange(order.shape[0], device=device) - group_starts(counts)[image]
    keep = rank < k
    total = torch.zeros(n, device=device).index_add(0, image[keep], scores[order][keep])
    return total / k


def select_images(boxes: BoxSet, rows: Tensor) -> BoxSet:
    """The boxes of images ``rows`` (any order, 1-D int64), renumbered ``0 .. len(rows) - 1`` in that order."""
    device = boxes.device
    rows = rows.to(device).long()
    position = torch.full((max(boxes.n_images, 1),), -1, dtype=torch.int64, device=device)
    position[rows] = torch.arange(rows.shape[0], device=device)
    new = position[boxes.image] if len(boxes) else boxes.image
    keep = new >= 0
    new = new[keep]
    order = torch.argsort(new, stable=True)
    pick = keep.nonzero().squeeze(1)[order]
    return BoxSet(boxes.boxes[pick], boxes.labels[pick], new[order], int(rows.shape[0]),
                  None if boxes.scores is None else boxes.scores[pick])


def image_errors(detections: BoxSet, targets: BoxSet, iou: float = 0.5, score: float = 0.5) -> Tensor:
    """Per image ``(n_images,)`` bool: the detector is wrong on it at operating point ``score``.

    Wrong = a ground-truth object without a same-class detection of score ≥ ``score`` and IoU ≥ ``iou``
    (a miss), or a detection of score ≥ ``score`` that overlaps no same-class object with IoU ≥ ``iou``
    (a false detection). The image-level decision the system view of a runtime monitor counts.
    """
    n = targets.n_images
    device = targets.device
    dets = detections.to(device)
    missed = (matched_scores(dets, targets, iou) < score).to(torch.int64)
    confident = dets.select(dets.scores >= score)
    as_dets = BoxSet(targets.boxes, targets.labels, targets.image, n, torch.ones(len(targets), device=device))
    found = BoxSet(confident.boxes, confident.labels, confident.image, n)
    false = (matched_scores(as_dets, found, iou) <= 0).to(torch.int64)
    counts = torch.zeros(n, dtype=torch.int64, device=device).index_add(0, targets.image, missed)
    return counts.index_add(0, confident.image, false) > 0


def declared_classes(model: Any) -> tuple[int, str] | None:
    """The class count a detector declares and where it was read, or ``None`` when it declares none.

    Read, in order: ``model.num_classes`` (any detector may declare it; an int ≥ 1), torchvision's
    single-stage heads (RetinaNet, FCOS, SSD: ``model.head.classification_head.num_classes``) and its
    two-stage box predictor (Faster/Mask R-CNN: ``model.roi_heads.box_predictor.cls_score.out_features``,
    class 0 being the background). Attributes only: the model is not run. A detector's labels (and the
    data's target labels) must lie in ``0 .. count - 1``.
    """
    paths = (("num_classes",), ("head", "classification_head", "num_classes"),
             ("roi_heads", "box_predictor", "cls_score", "out_features"))
    for path in paths:
        value: Any = model
        try:
            for name in path:
                value = getattr(value, name)
        except Exception:  # absent (or a module whose __getattr__ refuses): not declared there
            continue
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 1:
            return int(value), "model." + ".".join(path)
    return None


def detector_classes(model: Any) -> int | None:
    """The class count a detector declares (:func:`declared_classes`), or ``None``."""
    found = declared_classes(model)
    return None if found is None else found[0]
