"""What a model does: the task notion, detection boxes, and the checks each task's data and outputs get.

Three tasks (``dnnsafety_task``, marker keyword ``task=``; ``auto`` infers it from the data):

* ``single-label`` — one class per input: outputs ``(batch, classes)`` logits or probabilities,
  labels ``(N,)`` class indices (what every gate has always read);
* ``multi-label`` — any set of classes per input: outputs ``(batch, classes)``, one logit or
  probability per class (a class is predicted when its probability reaches a threshold), labels a
  ``(N, classes)`` 0/1 matrix;
* ``detection`` — boxes per image: the model returns, per image, a dict with ``boxes`` ``(n, 4)``
  (``x1, y1, x2, y2`` in pixels), ``scores`` ``(n,)`` and ``labels`` ``(n,)`` (torchvision's
  detection output format); targets are the same dicts without scores.

Inside the plugin a batch's boxes travel *packed* as one :class:`BoxSet` — every box of the batch
in one tensor with the index of its image — so engines work with matrix operations instead of
Python lists of dicts. :class:`DetectionData` holds a detection data set (images plus packed
targets, the ``.npz`` layout with ragged arrays as offsets) and :func:`detection_collate` is the
``collate_fn`` for a user's ``DataLoader`` of ``(image, target)`` pairs.

Each gate declares the tasks it supports (``GateDef.tasks``); a gate given data of another task is
an error naming the task and the fix (:func:`unsupported`), never a pass. Pure torch; no pytest import.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.settings import TASK_NAMES
from pytest_dnnsafety.errors import DataError, MetricError
from pytest_dnnsafety.data.boxes import group_starts, paired_iou

__all__ = [
    "TASKS", "SINGLE", "MULTI", "DETECTION", "BoxSet", "DetectionData", "detection_collate", "infer_task",
    "as_boxset", "detections_from_output", "is_detection_output", "check_multilabel", "unsupported", "matched_scores", "bad_boxes", "bad_scores", "detector_output_problem",
    "label_problem", "task_mismatch"]

#: Every task a gate may declare, in the order the docs list them.
TASKS = TASK_NAMES
SINGLE, MULTI, DETECTION = TASKS

_WHAT = {
    SINGLE: "a single-label classifier (outputs (batch, classes), labels (N,) class indices)",
    MULTI: "a multi-label classifier (outputs (batch, classes), labels a (N, classes) 0/1 matrix)",
    DETECTION: "an object detector (outputs per image: a dict of boxes, scores and labels)",
}


def unsupported(marker: str, task: str, supported: Sequence[str], source: str) -> DataError:
    """The error for a gate given a task it does not support: names the task, where it came from, and the fix."""
    gates = ", ".join(supported)
    fix = {
        DETECTION: "for a detector use min_detection_map, min_detection_recall, the occlusion, adversarial confidence, "
                   "monitor, neuron and scene coverage gates (they accept task='detection')",
        MULTI: "for a multi-label classifier use max_class_confusion, max_class_bias, min_scenario_accuracy / "
               "max_scenario_degradation (score='accuracy', 'precision', 'recall', 'f1'; average='micro'|'macro'), "
               "neuron and scene coverage gates",
        SINGLE: "for a single-label classifier use the classifier gates",
    }[task]
    return DataError(
        f"{marker} supports {gates} models, but this model is {_WHAT[task]} (task {task!r} {source}). "
        f"Fix: {fix}; if the task was inferred wrongly, set dnnsafety_task or the marker keyword task='...'.")


# ------------------------------------------------------------------------------------- boxes


@dataclass(frozen=True)
class BoxSet:
    """The boxes of ``n_images`` images, packed: row ``j`` is box ``boxes[j]`` of image ``image[j]``.

    ``boxes``: ``(M, 4)`` floating ``x1, y1, x2, y2``; ``labels``: ``(M,)`` int64 classes;
    ``image``: ``(M,)`` int64 image index in ``0 .. n_images - 1``, non-decreasing; ``scores``:
    ``(M,)`` confidence of a detection, ``None`` for ground truth. Ground truth may also carry COCO's
    ``crowd`` ``(M,)`` bool (``iscrowd``: an "ignore" region) and ``area`` ``(M,)`` float64 (the annotation's
    area, which sorts an object into COCO's small/medium/large ranges); ``None``: no crowd regions, and the
    area of a box is ``(x2 − x1)·(y2 − y1)``.
    """

    boxes: Tensor
    labels: Tensor
    image: Tensor
    n_images: int
    scores: Tensor | None = None
    crowd: Tensor | None = None
    area: Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.boxes.device

    def __len__(self) -> int:
        return int(self.boxes.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "BoxSet":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return BoxSet(move(self.boxes), move(self.labels), move(self.image), self.n_images, move(self.scores),
                      move(self.crowd), move(self.area))

    def box_area(self) -> Tensor:
        """``(M,)`` float64: the ``area`` given (COCO's annotation area), else ``(x2 − x1)·(y2 − y1)``."""
        if self.area is not None:
            return self.area.to(torch.float64)
        b = self.boxes.to(torch.float64)
        return (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])

    def counts(self) -> Tensor:
        """Boxes per image, ``(n_images,)`` int64."""
        return torch.bincount(self.image, minlength=self.n_images)[: self.n_images]

    def offsets(self) -> Tensor:
        """``(n_images + 1,)`` offsets: image ``i``'s boxes are rows ``offsets[i]:offsets[i + 1]`` (on the host)."""
        counts = self.counts().cpu()
        return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])

    def images(self, start: int, stop: int) -> "BoxSet":
        """The boxes of images ``start .. stop - 1`` (renumbered from 0); needs non-decreasing ``image``."""
        lo, hi = torch.searchsorted(self.image.cpu(), torch.tensor([start, stop])).tolist()
        pick = slice(lo, hi)
        return BoxSet(self.boxes[pick], self.labels[pick], self.image[pick] - start, stop - start,
                      *(None if t is None else t[pick] for t in (self.scores, self.crowd, self.area)))

    def select(self, keep: Tensor) -> "BoxSet":
        """The rows where the boolean ``keep`` is true (images unchanged)."""
        return BoxSet(self.boxes[keep], self.labels[keep], self.image[keep], self.n_images,
                      *(None if t is None else t[keep] for t in (self.scores, self.crowd, self.area)))

    def to_dicts(self) -> list[dict[str, Tensor]]:
        """torchvision's format: one dict per image (``scores`` only for detections)."""
        bounds = self.offsets().tolist()
        out = []
        for i in range(self.n_images):
            rows = slice(bounds[i], bounds[i + 1])
            item = {"boxes": self.boxes[rows], "labels": self.labels[rows]}
            if self.scores is not None:
                item["scores"] = self.scores[rows]
            out.append(item)
        return out

    @staticmethod
    def cat(parts: Sequence["BoxSet"]) -> "BoxSet":
        """The images of ``parts`` one after the other (image indices shifted)."""
        shift, images = 0, []
        for part in parts:
            images.append(part.image + shift)
            shift += part.n_images
        scores = [p.scores for p in parts]
        crowd = area = None
        if any(p.crowd is not None for p in parts):  # a part without crowd regions has none
            crowd = torch.cat([p.crowd if p.crowd is not None else torch.zeros(len(p), dtype=torch.bool,
                                                                              device=p.device) for p in parts])
        if any(p.area is not None for p in parts):
            area = torch.cat([p.box_area() for p in parts])
        return BoxSet(torch.cat([p.boxes for p in parts]) if parts else torch.zeros(0, 4),
                      torch.cat([p.labels for p in parts]) if parts else torch.zeros(0, dtype=torch.int64),
                      torch.cat(images) if parts else torch.zeros(0, dtype=torch.int64), shift,
                      torch.cat(scores) if parts and all(s is not None for s in scores) else None, crowd, area)


def _dict_part(item: Any, key: str, what: str, index: int) -> Tensor:
    if not isinstance(item, Mapping) or key not in item:
        found = sorted(item) if isinstance(item, Mapping) else type(item).__name__
        raise DataError(f"{what}: image {index} has no {key!r} (found {found}). Fix: give one dict per image with "
                        "'boxes' (n, 4) x1, y1, x2, y2 and 'labels' (n,) (detections also 'scores' (n,)).")
    return torch.as_tensor(item[key])


def as_boxset(value: Any, n: int, what: str, *, scores: bool = False, error: type = DataError) -> BoxSet:
    """``value`` (a :class:`BoxSet` or a list of one dict per image) as a checked :class:`BoxSet` of ``n`` images.

    Shapes are checked here (host metadata, no sync); the values' finiteness and ``x2 >= x1``,
    ``y2 >= y1`` are for the caller to flag on the device (:func:`bad_boxes`).
    """
    if isinstance(value, BoxSet):
        if value.n_images != n:
            raise error(f"{what}: {value.n_images} images of boxes for {n} inputs. Fix: give one entry per image.")
        if scores and value.scores is None:
            raise error(f"{what}: the boxes have no scores. Fix: give detections with 'scores'.")
        return value
    if isinstance(value, Mapping) or not isinstance(value, (list, tuple)):
        raise error(f"{what}: expected one dict of boxes per image (a list of {n}), got {type(value).__name__}. "
                    "Fix: return/give a list of dicts with 'boxes' (n, 4), 'labels' (n,)"
                    + (" and 'scores' (n,)" if scores else "") + " per image (torchvision's format).")
    if len(value) != n:
        raise error(f"{what}: {len(value)} dicts of boxes for {n} images. Fix: give exactly one dict per image "
                    "(an empty one, boxes of shape (0, 4), for an image without objects).")
    keys = ("boxes", "labels", "scores") if scores else ("boxes", "labels")
    parts: dict[str, list[Tensor]] = {key: [] for key in keys}
    for i, item in enumerate(value):
        for key in keys:
            parts[key].append(_dict_part(item, key, what, i))
        boxes, labels = parts["boxes"][-1], parts["labels"][-1]
        if boxes.numel() == 0:
            parts["boxes"][-1] = boxes = boxes.reshape(0, 4)
        if boxes.ndim != 2 or boxes.shape[1] != 4:
            raise error(f"{what}: image {i}'s boxes have shape {tuple(boxes.shape)}; expected (n, 4) x1, y1, x2, y2.")
        for key in keys[1:]:
            if parts[key][-1].reshape(-1).shape[0] != boxes.shape[0]:
                raise error(f"{what}: image {i} has {boxes.shape[0]} boxes but {key} of shape "
                            f"{tuple(parts[key][-1].shape)}. Fix: one {key[:-1]} per box.")
        if labels.is_floating_point() and labels.numel():
            raise error(f"{what}: image {i}'s labels are {labels.dtype}; class indices must be integers.")
    device = parts["boxes"][0].device if parts["boxes"] else torch.device("cpu")
    counts = torch.tensor([b.shape[0] for b in parts["boxes"]], dtype=torch.int64, device=device)
    image = torch.repeat_interleave(torch.arange(n, device=device), counts)
    boxes = torch.cat(parts["boxes"]).to(device) if n else torch.zeros(0, 4)
    labels = torch.cat([t.reshape(-1) for t in parts["labels"]]).to(device).long() if n else torch.zeros(0).long()
    score = torch.cat([t.reshape(-1) for t in parts["scores"]]).to(device) if scores and n else None
    extra: dict[str, Tensor | None] = {"iscrowd": None, "area": None}  # COCO targets' crowd regions and areas
    for key in extra:
        if not scores and n and all(isinstance(item, Mapping) and key in item for item in value):
            extra[key] = torch.cat([torch.as_tensor(item[key]).reshape(-1) for item in value]).to(device)
            if extra[key].shape[0] != boxes.shape[0]:
                raise error(f"{what}: {extra[key].shape[0]} {key} values for {boxes.shape[0]} boxes. Fix: one per box.")
    return BoxSet(boxes if boxes.is_floating_point() else boxes.float(), labels, image, n, score,
                  None if extra["iscrowd"] is None else extra["iscrowd"].bool(),
                  None if extra["area"] is None else extra["area"].to(torch.float64))


def bad_boxes(boxes: BoxSet, num_classes: int | None = None) -> Tensor:
    """A device tensor: true where a box is not finite, inverted, or its label is out of range (the scores are
    :func:`bad_scores`' concern)."""
    bad = ~torch.isfinite(boxes.boxes).all(dim=1)
    bad |= (boxes.boxes[:, 2] < boxes.boxes[:, 0]) | (boxes.boxes[:, 3] < boxes.boxes[:, 1])
    bad |= boxes.labels < 0
    if num_classes is not None:
        bad |= boxes.labels >= num_classes
    return bad


def bad_scores(scores: Tensor) -> Tensor:
    """A device tensor: true where a detection score is NaN or outside ``[0, 1]``.

    Every detection gate reads a score as a probability (COCO's ranking, the recall's and the monitors'
    ``score_threshold``, the matched score of Cheng et al. 2018): a detector that returns percent, logits or
    ``scores + 1`` would make a threshold of 0.5 mean nothing, so its scores are refused, never rescaled."""
    return ~((scores >= 0) & (scores <= 1))


def detector_output_problem(out: Any, n: int) -> str | None:
    """What is wrong with a detector's output that is not one dict per image, in a detector's words, else None.

    Two shapes a torchvision-style detector returns outside inference: ``(losses, detections)`` (a model left in
    training mode, or a scripted detector, returns both) and one dict of boxes, scores and labels for the whole
    batch instead of one per image. Only a host-side look at the containers (no tensor is read)."""
    if (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], Mapping) and "boxes" not in out[0]
            and isinstance(out[1], (tuple, list)) and (not out[1] or isinstance(out[1][0], Mapping))):
        return (f"the model returned a pair (losses, detections) — a dict of {len(out[0])} loss(es) and "
                f"{len(out[1])} detection dicts — the training-mode (or scripted) shape of a torchvision detector. "
                "Fix: call model.eval() in the model fixture (the plugin switches an nn.Module to eval, but not "
                "a wrapper that ignores it), or return only the list of detections (out[1]), one dict per image")
    if isinstance(out, Mapping) and "boxes" in out:
        shapes = ", ".join(f"{key} {tuple(getattr(value, 'shape', ()))}" for key, value in out.items())
        return (f"the model returned one dict for the whole batch of {n} images ({shapes}), but a detector "
                "returns one dict per image. Fix: return a list of n dicts, image i's boxes (n_i, 4), scores "
                "(n_i,) and labels (n_i,) in dict i (torchvision's format)")
    return None


def is_detection_output(out: Any) -> bool:
    """True for a detector's output: a list/tuple of dicts (torchvision) or a :class:`BoxSet`."""
    if isinstance(out, BoxSet):
        return True
    return isinstance(out, (list, tuple)) and (not out or isinstance(out[0], Mapping))


def detections_from_output(out: Any, n: int, what: str) -> BoxSet:
    """A detector's output for ``n`` images as a :class:`BoxSet` with scores (shapes checked; errors are MetricError)."""
    problem = detector_output_problem(out, n)
    if problem is not None:
        raise MetricError(f"{what}: {problem}.")
    if not is_detection_output(out):
        shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise MetricError(
            f"{what}: the model returned {shape}, not detections; the task is 'detection'. Fix: return one dict "
            "per image with 'boxes' (n, 4), 'scores' (n,) and 'labels' (n,) (torchvision's format), or set "
            "dnnsafety_task / the marker keyword task= to the model's task.")
    return as_boxset(out, n, what, scores=True, error=MetricError)


def matched_scores(detections: BoxSet, targets: BoxSet, iou: float = 0.5) -> Tensor:
    """Per ground-truth object: the highest score of a detection *of its class* in *its image* whose IoU with
    it is at least ``iou``, else 0 — the detector's "probability of the correct class" of Cheng et al. 2018,
    §II-F step 2 ("the maximum probability of the correct class over all detected boxes that have a significant
    Jaccard similarity with the ground truth bounding box").

    ``(len(targets),)`` float32 on the targets' device, differentiable in the detections' scores (the pairing
    itself is a selection). Each detection is paired only with the objects of its own image (``Σ_i D_i·M_i``
    pairs, not a ``D × M`` matrix), so a chunk of thousands of occluded or perturbed copies costs memory linear
    in its boxes; more than :data:`PAIR_CHUNK` pairs (one image of 10^6 objects) are paired in spans of
    detections, so the working set stays bounded. Laying the pairs out reads their number to the host once per
    call: detections are ragged, so their pairing cannot be sized without it.
    """
    if detections.scores is None:
        raise ValueError("matched_scores needs detections with scores")
    device = targets.device
    m = len(targets)
    if m == 0 or len(detections) == 0:
        return torch.zeros(m, device=device)
    dets = detections.to(device)
    n = max(dets.n_images, targets.n_images)
    t_counts = torch.bincount(targets.image, minlength=n)[:n]
    t_starts = group_starts(t_counts)
    per_det = t_counts[dets.image]  # pair j: detection d with the objects of its image, one after the other
    ends = torch.cumsum(per_det, 0)
    total = int(ends[-1])  # the one read: the number of pairs
    spans = [(0, len(dets), total)]
    if total > PAIR_CHUNK:  # e.g. 100 detections on an image of 10^6 objects: spans of detections, pairs bounded
        marks = torch.arange(PAIR_CHUNK, total, PAIR_CHUNK, device=device)
        cuts = sorted({0, len(dets), *torch.searchsorted(ends, marks, right=True).tolist()})
        at = torch.cat([ends.new_zeros(1), ends])[cuts].tolist()
        spans = [(a, b, at[i + 1] - at[i]) for i, (a, b) in enumerate(zip(cuts[:-1], cuts[1:]))]
    starts = ends - per_det
    out = torch.zeros(m, device=device, dtype=torch.float32)
    for d0, d1, size in spans:
        det_of = d0 + torch.repeat_interleave(torch.arange(d1 - d0, device=device), per_det[d0:d1], output_size=size)
        within = torch.arange(det_of.shape[0], device=device) + (starts[d0] - starts[det_of])  # rank in its image
        obj_of = t_starts[dets.image[det_of]] + within
        overlap = paired_iou(dets.boxes[det_of], targets.boxes[obj_of])
        ok = (overlap >= iou) & (dets.labels[det_of] == targets.labels[obj_of])
        score = torch.where(ok, dets.scores[det_of].float(), torch.zeros((), device=device))
        out = out.scatter_reduce(0, obj_of, score, reduce="amax", include_self=True)
    return out


#: Detection–object pairs of one span of :func:`matched_scores` (each pair's boxes and IoU: ~100 bytes).
PAIR_CHUNK = 1 << 21


# ------------------------------------------------------------------------------------- data


def _ends(offsets: Tensor) -> str:
    """The offsets shown in an error: all of a short array, else its first and last three."""
    values = offsets.tolist()
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:3]))}, …, " \
        f"{', '.join(map(str, values[-3:]))}]"


def _wrapped(stored: str, m: int) -> str:
    """The likely cause when a narrow integer dtype cannot hold ``m``: its values wrapped when saved."""
    if stored in ("uint8", "int8", "int16", "uint16", "int32", "uint32"):
        top = int(torch.iinfo(getattr(torch, stored)).max)
        if m > top:
            return (f" — {stored} holds at most {top}, fewer than the {m} boxes, so the offsets wrapped when they "
                    "were saved; save them as int64 (offsets.astype(np.int64))")
    return ""


class DetectionData(torch.utils.data.Dataset):
    """A detection data set: images ``x`` ``(N, C, H, W)`` and their packed ground-truth :class:`BoxSet`.

    Item ``i`` is ``(x[i], {"boxes": (n, 4), "labels": (n,)})`` as torchvision's detection data sets
    give it; the plugin slices whole batches (:meth:`batch`) without building those dicts. Built by
    :meth:`from_offsets` from the ``.npz`` layout (``x``, ``boxes``, ``labels``, ``offsets``).
    """

    task = DETECTION

    def __init__(self, x: Tensor, targets: BoxSet) -> None:
        if targets.n_images != int(x.shape[0]):
            raise DataError(f"detection data: {x.shape[0]} images but targets for {targets.n_images}. Fix: give "
                            "one target entry per image.")
        self.x = x
        self.targets = targets

    @classmethod
    def from_offsets(cls, x: Any, boxes: Any, labels: Any, offsets: Any, what: str = "detection data"
                     ) -> "DetectionData":
        """From ragged arrays: image ``i``'s objects are rows ``offsets[i]:offsets[i + 1]`` of ``boxes``/``labels``."""
        x = torch.as_tensor(x)
        boxes = torch.as_tensor(boxes).to(torch.float32 if not torch.as_tensor(boxes).is_floating_point()
                                          else torch.as_tensor(boxes).dtype)
        labels, offsets = torch.as_tensor(labels), torch.as_tensor(offsets)
        if not (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool):
            labels = labels.to(torch.int64)  # any integer dtype (a uint64 above 2**63 turns negative: refused)
        n = int(x.shape[0]) if x.ndim else 0
        if boxes.numel() == 0:
            boxes = boxes.reshape(0, 4)
        problems = []
        if boxes.ndim != 2 or boxes.shape[1] != 4:
            problems.append(f"boxes has shape {tuple(boxes.shape)}, expected (M, 4) x1, y1, x2, y2")
        if labels.is_floating_point() or labels.reshape(-1).shape[0] != boxes.shape[0]:
            problems.append(f"labels must be M = {boxes.shape[0]} integers, got {labels.dtype} {tuple(labels.shape)}")
        stored = str(offsets.dtype).replace("torch.", "")
        if (offsets.is_floating_point() or offsets.is_complex() or offsets.dtype == torch.bool or offsets.ndim != 1
                or offsets.shape[0] != n + 1):
            problems.append(f"offsets must be N + 1 = {n + 1} integers, got {stored} {tuple(offsets.shape)}")
        else:  # any integer dtype: read as int64 (a uint64 above 2**63 turns negative and fails the checks)
            offsets = offsets.to(torch.int64)
            if n + 1 and (int(offsets[0]) != 0 or int(offsets[-1]) != boxes.shape[0]
                          or bool((offsets[1:] < offsets[:-1]).any())):
                problems.append(f"offsets must rise from 0 to M = {boxes.shape[0]}, got {_ends(offsets)} "
                                f"(stored as {stored})" + _wrapped(stored, boxes.shape[0]))
        if not problems and boxes.numel() and not bool(torch.isfinite(boxes).all()):
            problems.append("boxes hold NaN/inf")
        if not problems and boxes.numel() and bool(((boxes[:, 2] < boxes[:, 0]) | (boxes[:, 3] < boxes[:, 1])).any()):
            problems.append("some boxes have x2 < x1 or y2 < y1 (expected x1, y1, x2, y2)")
        if not problems and labels.numel() and int(labels.min()) < 0:
            problems.append("labels hold negative class indices")
        if problems:
            raise DataError(f"{what}: " + "; ".join(problems) + ". Fix: save x (N, C, H, W), boxes (M, 4), labels "
                            "(M,) and offsets (N + 1,) so that image i's objects are rows offsets[i]:offsets[i+1].")
        image = torch.repeat_interleave(torch.arange(n), offsets[1:] - offsets[:-1])
        return cls(x, BoxSet(boxes, labels.reshape(-1).long(), image, n))

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        return self.x[index], self._target(index)

    def _target(self, index: int) -> dict[str, Tensor]:
        one = self.targets.images(index, index + 1)
        item = {"boxes": one.boxes, "labels": one.labels}
        if one.crowd is not None:
            item["iscrowd"] = one.crowd
        if one.area is not None:
            item["area"] = one.area
        return item

    def batch(self, start: int, stop: int) -> tuple[Tensor, BoxSet]:
        """Images ``start .. stop - 1`` and their targets, packed."""
        return self.x[start:stop], self.targets.images(start, stop)


def detection_collate(items: Sequence[tuple[Any, Any]]) -> tuple[Tensor, BoxSet]:
    """``collate_fn`` for a ``DataLoader`` of ``(image, target dict)`` pairs: stacked images and packed targets."""
    images = torch.stack([torch.as_tensor(item[0]) for item in items])
    return images, as_boxset([item[1] for item in items], len(items), "detection targets")


# ------------------------------------------------------------------------------------- inference


def label_problem(y: Tensor) -> str | None:
    """What is wrong with labels read whole (one host read), naming the first bad value and its position, else None.

    A ``(N, classes)`` matrix is a multi-label one and must hold 0/1 (or booleans); ``(N,)`` labels must be integer
    class indices (a float 3.0 is accepted, 0.5 and NaN are not)."""
    if y.dtype == torch.bool or y.numel() == 0:
        return None
    if y.ndim == 2:
        bad = ~((y == 0) | (y == 1))
    else:
        bad = ~torch.isfinite(y) | (y != y.round()) if y.is_floating_point() else torch.zeros_like(y, dtype=torch.bool)
    flat = bad.reshape(-1).nonzero()
    if flat.numel() == 0:
        return None
    count, first = int(bad.sum()), int(flat[0])
    value = y.reshape(-1)[first].item()
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    if y.ndim == 2:
        row, column = divmod(first, int(y.shape[1]))
        return (f"multi-label labels must be 0 or 1 (a (N, classes) label matrix is a multi-label one: 0/1 or "
                f"booleans), but it holds {count} other value(s), the first {shown} at row {row}, column {column}. "
                "Fix: save one 0/1 column "
                "per class (threshold or round soft labels, fill missing ones); for one class index per input give "
                "(N,) labels")
    return (f"labels y must be integer class indices, but {count} are not, the first {shown} at row {first}. Fix: "
            "give class indices 0, 1, ... (a (N, classes) 0/1 matrix for a multi-label model)")


def check_multilabel(y: Tensor, what: str) -> None:
    """Raise unless ``y`` is a ``(N, classes)`` 0/1 matrix (on the host; for data read whole)."""
    if y.ndim != 2 or y.shape[1] < 2:
        raise DataError(f"{what}: multi-label labels must be a (N, classes) 0/1 matrix, got shape {tuple(y.shape)}.")
    problem = label_problem(y)
    if problem is not None:
        raise DataError(f"{what}: {problem}.")


_PEEKED: "weakref.WeakKeyDictionary[Any, str | None]" = weakref.WeakKeyDictionary()


def _peeked_task(dataset: Any) -> str | None:
    """The task of a map-style dataset's first item (read once per dataset and process, then remembered)."""
    try:
        return _PEEKED[dataset]
    except (KeyError, TypeError):
        pass
    task: str | None = None
    try:
        item = dataset[0]
    except Exception:
        item = None
    if isinstance(item, (tuple, list)) and len(item) > 1:
        if isinstance(item[1], Mapping):
            task = DETECTION
        else:
            y = torch.as_tensor(item[1])
            task = MULTI if y.ndim == 1 and y.shape[0] > 1 else SINGLE
    try:
        _PEEKED[dataset] = task
    except TypeError:  # not weak-referenceable: read again next time
        pass
    return task


def _label_shape(data: Any) -> tuple[int, ...] | None:
    """The shape of labels held whole (a tensor pair, a dict, a TensorDataset), else None (not read)."""
    source = data.dataset if isinstance(data, torch.utils.data.DataLoader) else data
    y: Any = None
    if isinstance(source, torch.utils.data.TensorDataset):
        y = source.tensors[1] if len(source.tensors) > 1 else None
    elif isinstance(source, Mapping):
        y = source.get("y")
    elif isinstance(source, (tuple, list)) and len(source) == 2 and hasattr(source[0], "shape"):
        y = source[1]
    shape = getattr(y, "shape", None)
    return tuple(int(v) for v in shape) if shape is not None else None


def task_mismatch(task: str, source: str, data: Any, fixture: str = "data") -> DataError | None:
    """The error for a task set explicitly (``source``: where it was set) that the data's labels contradict, or None.

    Without it a ``task='single-label'`` on a ``(N, classes)`` label matrix reaches the metric as a raw size error.
    Only the two classifier tasks are compared (a detector's data set to a classifier task is the gate's own
    concern, e.g. occlusion's masks); data whose task cannot be told (:func:`infer_task` is None) are left to
    the gate's own checks."""
    if task not in (SINGLE, MULTI):
        return None
    inferred = infer_task(data)
    if inferred not in (SINGLE, MULTI) or inferred == task:
        return None
    shape = _label_shape(data)
    form = {SINGLE: "(N,) class indices", MULTI: "a (N, classes) 0/1 matrix", DETECTION: "boxes per image"}[inferred]
    seen = f"labels of shape {shape}, i.e. {form}" if shape is not None else f"labels of the form {form}"
    extra = (" (one-hot labels of a single-label model: give class indices y.argmax(1) instead)"
             if inferred == MULTI and task == SINGLE else "")
    return DataError(
        f"task {task!r} ({source}) does not fit fixture {fixture!r}: it holds {seen}, the labels of "
        f"{_WHAT[inferred]}, where task {task!r} needs {_WHAT[task]}. Fix: set task={inferred!r} (or leave task "
        f"out / dnnsafety_task=auto to infer it){extra}, or give data with the labels task {task!r} needs.")


def infer_task(data: Any) -> str | None:
    """The task the data's labels imply: ``detection`` for boxes, ``multi-label`` for a 2-D label matrix,
    ``single-label`` for 1-D labels, ``None`` when it cannot be told. Tensors and ``TensorDataset`` are
    read from their shapes; a ``DataLoader`` with :func:`detection_collate`, or over a dataset with a
    ``task`` attribute, says so; another map-style dataset has its first item read once (remembered per
    dataset), an iterable one is not read (``None``)."""
    source = data.dataset if isinstance(data, torch.utils.data.DataLoader) else data
    declared = getattr(source, "task", None)
    if declared in TASKS:
        return declared
    if isinstance(data, torch.utils.data.DataLoader) and data.collate_fn is detection_collate:
        return DETECTION
    y: Any = None
    if isinstance(source, torch.utils.data.TensorDataset):
        y = source.tensors[1] if len(source.tensors) > 1 else None
    elif isinstance(source, Mapping):
        if "boxes" in source or "targets" in source:
            return DETECTION
        y = source.get("y")
    elif isinstance(source, (tuple, list)) and len(source) == 2 and hasattr(source[0], "shape"):
        y = source[1]
        if is_detection_output(y):
            return DETECTION
    elif isinstance(source, torch.utils.data.Dataset) and not isinstance(source, torch.utils.data.IterableDataset):
        return _peeked_task(source)
    else:
        return None
    if y is None:
        return None
    shape = getattr(y, "shape", None)
    if shape is None:
        return None
    return MULTI if len(shape) == 2 else SINGLE
