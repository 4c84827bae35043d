"""Detection quality per scenario group: a pass's detections matched, the groups sorted, the worst group read.

What the detection gates (``min_detection_map``, ``min_detection_recall``) compute on top of
:class:`~pytest_dnnsafety.engines.detection.matching.BoxMatchEngine`:

* :func:`match_plan` — the IoU thresholds to match at and the columns of the gate's ``iou=`` among them:
  COCO's ten whenever ``iou`` is one of them (so the mAP and recall gates on one model and data share one
  matching), else that one threshold;
* :func:`match_detections` — one rank's part of the session's shared forward pass matched, ``batch_size``
  images at a time (the engine keeps per-detection records, never the images);
* :func:`worst_map` / :func:`worst_recall` — per scenario group (a
  :class:`~pytest_dnnsafety.scenarios.groups.ScenarioGroups`, read duck-typed: ``by`` and ``masks()``), mAP or
  recall with a seeded bootstrap over the group's images, its lower bound read by ``method``
  (:mod:`~pytest_dnnsafety.engines.detection.bootstrap`; default ``"wide"``, the smaller of the BCa
  and the bias-extrapolated bounds read at a fifth of the error rate, measured on heterogeneous known-truth simulations where the plain
  percentile bootstrap undercovered: docs/gates/detection.md, "How good is the bound"); the worst group
  (or, for recall with ``per_class``, the worst group and class) is the gate's
  :class:`~pytest_dnnsafety.results.Measurement`. Before any replicate runs, a bootstrap whose work
  (replicates × records) exceeds :data:`~pytest_dnnsafety.engines.detection.bootstrap.WORK_LIMIT` is refused
  naming ``bootstrap=``; the replicates tick the gate's progress line.

Groups with fewer than ``min_images`` images make the gate inconclusive unless ``allow_small_groups``; a
group whose images hold no ground-truth object has no mAP or recall and always does; nothing assessable
at all is an error. Pure torch, no pytest import.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.data.tasks import BoxSet
from pytest_dnnsafety.engines.detection.bootstrap import (
    DEFAULT_METHOD,
    check_work,
    method_text,
)
from pytest_dnnsafety.engines.detection.matching import (
    COCO_IOU_THRESHOLDS,
    BoxMatchEngine,
)
from pytest_dnnsafety.errors import DataError, MetricError
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.runtime import threads

__all__ = ["COCO_RANGE", "QualityOptions", "is_coco_range", "match_detections", "match_plan", "worst_map",
           "worst_recall"]

#: ``iou=`` of COCO's mAP over its ten thresholds 0.50:0.05:0.95.
COCO_RANGE = "0.5:0.95"


@dataclass(frozen=True)
class QualityOptions:
    """The options of a detection gate (its marker keywords, checked at collection) and the ``marker`` the
    errors name; ``seed`` seeds each group's bootstrap."""

    marker: str
    seed: int
    iou: Any = COCO_RANGE
    by: Any = None
    confidence: float = 0.95
    bootstrap: int = 1000
    statistic: str = "bound"
    min_images: int = 30
    allow_small_groups: bool = False
    max_detections: int = 100
    score_threshold: float = 0.5
    per_class: bool = True
    method: str = DEFAULT_METHOD
    area: str = "all"

    @classmethod
    def of(cls, options: Mapping[str, Any], *, marker: str, seed: int) -> QualityOptions:
        """The record of a gate's ``options`` (keywords of other gates are left out)."""
        named = {"marker", "seed"}  # not marker keywords
        given = {f.name: options[f.name] for f in fields(cls) if f.name in options and f.name not in named}
        return cls(marker=marker, seed=int(seed), **given)

    def bound_text(self, lower: float) -> str:
        """How the compared number was read: the bootstrap bound (naming its method), or the estimate
        (statistic='estimate')."""
        kind = {"wide": "wide (min of BCa and bias-extrapolated, at 1 − α/5) bootstrap",
                "conservative": "conservative (min of BCa and bias-extrapolated) bootstrap", "bca": "BCa bootstrap",
                "extrapolated": "bias-extrapolated bootstrap", "percentile": "percentile bootstrap"}[self.method]
        bound = f"{self.confidence:.0%} {kind} lower bound {lower:.3f}"
        if self.statistic == "bound":
            return bound
        return f"the estimate is compared (statistic='estimate'); {bound}, not compared"

    def generator(self, group: int) -> torch.Generator:
        """The seeded generator of group ``group``'s bootstrap."""
        return torch.Generator().manual_seed((int(self.seed) * 1_000_003 + group) % (2**63))


# ------------------------------------------------------------------------------------- matching


def is_coco_range(iou: Any) -> bool:
    """Whether ``iou=`` names COCO's ten thresholds (``'0.5:0.95'``) rather than one."""
    return isinstance(iou, str) and iou.strip() == COCO_RANGE


def match_plan(iou: Any) -> tuple[tuple[float, ...] | None, list[int]]:
    """The IoU thresholds to match at (None: COCO's ten) and the columns of ``iou`` (``'0.5:0.95'``: all ten)
    among them. A single IoU that is one of COCO's ten is matched at all ten, so gates share one matching."""
    coco = COCO_IOU_THRESHOLDS.tolist()
    if is_coco_range(iou):
        return None, list(range(len(coco)))
    iou = float(iou)
    near = [i for i, t in enumerate(coco) if abs(t - iou) < 1e-9]
    return (None, near[:1]) if near else ((iou,), [0])


def match_detections(out: Any, thresholds: tuple[float, ...] | None, *, max_detections: int, batch_size: int,
                     shard: Any, marker: str, data: str) -> BoxMatchEngine:
    """This rank's detections (``out``, the :class:`~pytest_dnnsafety.engines.core.capture.ModelOutputs` of its
    ``shard``; None: the whole data) matched ``batch_size`` images at a time; the records carry the data's
    global image rows, so the ranks' engines merge into the single pass's. ``data``: the data fixture's name."""
    if out.detections is None:
        raise MetricError(f"{marker}: the model returned class scores, not detections, but the task is "
                          "'detection'. Fix: give a detector that returns one dict of boxes, scores and labels per "
                          "image (torchvision's format)")
    if not isinstance(out.labels, BoxSet):
        raise DataError(f"{marker}: the data (fixture {data!r}) has no boxes. Fix: give "
                        "detection data, an .npz with x, boxes, labels and offsets (or a DataLoader with "
                        "collate_fn=pytest_dnnsafety.detection_collate)")
    engine = BoxMatchEngine(COCO_IOU_THRESHOLDS if thresholds is None else list(thresholds),
                            max_detections=max_detections)
    first = 0 if shard is None else shard.rows[0]  # the global row of this rank's first image
    n = out.labels.n_images
    with threads.host_bound():  # slicing and matching: many small kernels, one thread (runtime.threads)
        for start in range(0, n, batch_size):
            stop = min(start + batch_size, n)
            engine.update(out.detections.images(start, stop), out.labels.images(start, stop), first + start)
    return engine


# ------------------------------------------------------------------------------------- groups


def _sort_groups(engine: BoxMatchEngine, groups: Any, opts: QualityOptions, what: str
                 ) -> tuple[list[tuple[str, Tensor]], list[str], list[str]]:
    """(assessable groups as (label, image mask), problems, small-group labels) — see the module docstring."""
    objects = engine.records()[4].cpu()  # each ground-truth object's image
    assessable, small, no_gt = [], [], []
    for label, mask, feasible in groups.masks():
        n = int(mask.sum())
        if n == 0 and not feasible:
            continue
        if n < opts.min_images:
            small.append(f"{label} ({n} images)")
        elif not bool(mask[objects].any()):
            no_gt.append(label)
        else:
            assessable.append((label, mask))
    problems = []
    if small and not opts.allow_small_groups:
        problems.append(f"{len(small)} group(s) have fewer than min_images={opts.min_images} images: "
                        + ", ".join(small[:10]) + (", …" if len(small) > 10 else "")
                        + ". Fix: add evaluation images for them, or accept them with allow_small_groups=True "
                          "(they are then left out of the gated value)")
    if no_gt:
        problems.append(f"{len(no_gt)} group(s) hold no ground-truth object, so their {what} is undefined: "
                        + ", ".join(no_gt[:10]) + ". Fix: add annotated images with objects for them")
    if not assessable:
        raise MetricError(f"{opts.marker}: no group of by={list(groups.by) or None} has min_images={opts.min_images} "
                          "images with at least one ground-truth object; nothing to assess"
                          + ("; " + "; ".join(problems) if problems else "")
                          + ". Fix: add annotated evaluation images or lower min_images")
    return assessable, problems, small


# ------------------------------------------------------------------------------------- the gates' readings

#: COCO's area ranges as the details name them.
AREA_TEXT = "small: area < 32², medium: 32² to 96², large: > 96² (COCO's annotation area; crowd regions ignored)"
NO_OBJECTS = "no objects in this range"


def _area_rows(engine: BoxMatchEngine, mask: Tensor, columns: list[int]) -> dict[str, Any]:
    """A group's mAP per COCO area range (point estimates): ``area_map`` (None and a note where the range holds no
    object) and ``coco_area_stats``, COCOeval's ``stats[3:6]`` as pycocotools prints them (−1: no object)."""
    if not engine.area_ranges:
        return {}
    maps = engine.area_maps(mask, columns)
    return {"area_map": {k: (None if math.isnan(v) else v) for k, v in maps.items()},
            "area_notes": {k: NO_OBJECTS for k, v in maps.items() if math.isnan(v)},
            "coco_area_stats": [-1.0 if math.isnan(v) else v for v in maps.values()]}


def _area_text(row: Mapping[str, Any]) -> str:
    if "area_map" not in row:
        return ""
    parts = [f"{k} {'—' if v is None else f'{v:.3f}'}" for k, v in row["area_map"].items()]
    notes = [k for k in row["area_map"] if row["area_map"][k] is None]
    return ("; its mAP by area: " + ", ".join(parts)
            + (f" ({', '.join(notes)}: {NO_OBJECTS})" if notes else ""))


def worst_map(engine: BoxMatchEngine, groups: Any, columns: list[int], opts: QualityOptions) -> Measurement:
    """The worst group's COCO mAP at the ``columns`` thresholds: its bootstrap lower bound (or its estimate, with
    statistic='estimate'), every group's mAP, AP per class and bounds in the details."""
    assessable, problems, small = _sort_groups(engine, groups, opts, "mAP")
    check_work(opts.marker, opts.bootstrap, engine.records()[0].numel() * len(columns) + engine.n_images,
               "the detections × IoU thresholds and images")
    rows, empty = [], []
    for g, (label, mask) in enumerate(assessable):
        res = engine.evaluate(mask, bootstrap=opts.bootstrap, confidence=opts.confidence,
                              generator=opts.generator(g), columns=columns, method=opts.method, area=opts.area)
        if math.isnan(res.map):  # area='small' etc.: no object of the group lies in the range
            empty.append(label)
            continue
        rows.append({"group": label, "map": res.map, "map50": res.map50, "lower": res.lower, "upper": res.upper,
                     "images": res.images, "objects": res.objects, "detections": res.detections,
                     "class_ap": {str(c): v for c, v in res.class_ap().items()}, **_area_rows(engine, mask, columns)})
    if empty:
        problems.append(f"{len(empty)} group(s) hold no object of area range {opts.area!r}, so their mAP there is "
                        f"undefined: {', '.join(empty[:10])}. Fix: add annotated images with such objects, or gate "
                        "another range")
    if not rows:
        raise MetricError(f"{opts.marker}: no group holds an object of area range {opts.area!r} ({AREA_TEXT}); "
                          "nothing to assess. Fix: gate area='all' or add images with such objects")
    key = "lower" if opts.statistic == "bound" else "map"
    worst = min(rows, key=lambda r: (r[key], r["map"]))
    iou = "@[.5:.95]" if is_coco_range(opts.iou) else f"@{float(opts.iou):g}"
    scope = "" if opts.area == "all" else f" (area range {opts.area})"
    detail = (f"worst group {worst['group']}: mAP{iou}{scope} {worst['map']:.3f}, {opts.bound_text(worst['lower'])} "
              f"({worst['images']} images, {worst['objects']} objects, {opts.bootstrap} replicates); "
              f"{len(rows)} group(s) assessed" + _area_text(worst))
    details = {"iou": str(opts.iou), "area": opts.area, "area_ranges": AREA_TEXT, "statistic": opts.statistic,
               "confidence": opts.confidence,
               "bootstrap": opts.bootstrap, "method": opts.method, "bound": method_text(opts.method),
               "bound_kind": "estimate", "by": list(groups.by), "max_detections": opts.max_detections, "min_images": opts.min_images,
               "worst_group": worst["group"], "small_groups": small, "map_groups": rows}
    bound = worst["lower"] if key == "lower" else None
    return Measurement(value=worst["map"], bound=bound, detail=detail, details=details,
                       inconclusive="; ".join(problems) or None)


def worst_recall(engine: BoxMatchEngine, groups: Any, columns: list[int], opts: QualityOptions) -> Measurement:
    """The worst (group, class) recall at the score threshold — or the worst group's, ``per_class=False``."""
    assessable, problems, small = _sort_groups(engine, groups, opts, "recall")
    check_work(opts.marker, opts.bootstrap, engine.n_images * (int(engine.records()[5].unique().numel()) + 2),
               "the images × (classes + 2)")
    rows, candidates = [], []
    for g, (label, mask) in enumerate(assessable):
        res = engine.recall(mask, score_threshold=float(opts.score_threshold), threshold_index=columns[0],
                            bootstrap=opts.bootstrap, confidence=opts.confidence, generator=opts.generator(g),
                            method=opts.method)
        classes = [{"class": c, "recall": float(res.recall[i]), "lower": float(res.lower[i]),
                    "objects": res.class_objects[i]} for i, c in enumerate(res.classes)]
        rows.append({"group": label, "recall": res.overall, "lower": res.overall_lower, "images": res.images,
                     "objects": res.objects, "classes": classes})
        if opts.per_class:
            candidates += [(label, f"class {c['class']}", c) for c in classes]
        else:
            candidates.append((label, "all classes", rows[-1]))
    key = "lower" if opts.statistic == "bound" else "recall"
    label, what, worst = min(candidates, key=lambda t: (t[2][key], t[2]["recall"]))
    detail = (f"worst {label}, {what}: recall {worst['recall']:.3f} at score ≥ {opts.score_threshold:g}, IoU ≥ "
              f"{float(opts.iou):g}, {opts.bound_text(worst['lower'])} ({worst['objects']} objects, "
              f"{opts.bootstrap} replicates); {len(rows)} group(s) assessed")
    details = {"iou": float(opts.iou), "score_threshold": opts.score_threshold, "per_class": opts.per_class,
               "statistic": opts.statistic, "confidence": opts.confidence, "bootstrap": opts.bootstrap,
               "method": opts.method, "bound": method_text(opts.method), "bound_kind": "estimate", "by": list(groups.by), "worst_group": label,
               "worst_class": what, "small_groups": small, "recall_groups": rows}
    bound = worst["lower"] if key == "lower" else None
    return Measurement(value=worst["recall"], bound=bound, detail=detail, details=details,
                       inconclusive="; ".join(problems) or None)
