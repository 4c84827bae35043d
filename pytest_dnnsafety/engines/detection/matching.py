"""Detection quality: COCO mean average precision and recall per scenario group, with bootstrap bounds.

The protocol is COCO's bounding-box evaluation (Lin et al. 2014, "Microsoft COCO: Common Objects in
Context"), reproduced as pycocotools' ``COCOeval`` computes it, crowd regions and area ranges included, so
the numbers equal pycocotools' to floating-point rounding:

* **ignore rules**: a crowd object (``iscrowd``, :attr:`~pytest_dnnsafety.data.tasks.BoxSet.crowd`) is an "ignore"
  object, and so is, in area range ``small`` (area < 32²), ``medium`` (32²–96²) or ``large`` (> 96²), an object
  whose area (COCO's annotation ``area``, else the box's) lies outside it (:data:`AREA_RANGES`, bounds inclusive). A
  detection takes a regular object when one is free at ``t``; only if none is, the best ignore object (a crowd
  region's overlap is the intersection over the *detection's* area, and it may take any number of detections),
  and is then ignored: neither a true nor a false positive. An unmatched detection whose box area lies outside
  the range is ignored too. Every range is matched in the same pass
  (:func:`~pytest_dnnsafety.engines.detection.greedy.match_batch` with ``ranges``);
  :meth:`BoxMatchEngine.area_maps` reads COCOeval's ``stats[3:6]`` (NaN where a range holds no object, where
  COCOeval prints −1);

* **matching** (``evaluateImg``), per image and class: the detections sorted by score, descending,
  with a stable sort, at most ``max_detections`` of them (pycocotools caps per image *and class*);
  each detection in turn takes the still unmatched ground-truth box of its image and class with the
  highest IoU (:func:`~pytest_dnnsafety.data.boxes.box_iou`'s, per cell: :func:`cell_iou`) at least ``t``
  (among equal IoUs the later box, as pycocotools' loop does), separately for every IoU threshold
  ``t`` (COCO: 0.50:0.05:0.95);
* **AP per class** (``accumulate``): all images' detections of the class sorted by score with a
  stable sort (ties keep image order), cumulative true and false positives, precision made
  monotone from the right, read at 101 recall points (``searchsorted`` side ``left``; past the
  last recall it is 0) and averaged; classes without ground truth are left out of the mean;
  mAP@[.5:.95] is the mean over classes and thresholds, mAP@.5 the mean at ``t = 0.5``.

Streaming: :meth:`BoxMatchEngine.update` matches one batch (:mod:`~pytest_dnnsafety.engines.detection.greedy`: one
vectorised step per detection rank, over only the (image, class) cells that have a detection of that rank and
objects, every threshold at once) and keeps only, per detection, its score, class, image and one bit per
threshold (matched or not), plus each ground-truth object's image and class — never the images. Detections are
ragged, so matching a batch reads small things to the host (the number of cells, their detection-count
histogram and the largest cell's objects), which size the loop. The matching and the point estimate run on one
torch thread (:func:`~pytest_dnnsafety.runtime.threads.host_bound`: many small kernels, which more threads only
slow down on a busy machine), and so do the mAP bootstrap's per-class scans; recall's bootstrap (matrix products)
keeps the process's count.
:meth:`BoxMatchEngine.evaluate` (mAP) and :meth:`BoxMatchEngine.recall` then evaluate any set of
images (a scenario group) from those records.

**Bootstrap bounds.** The detections and objects of one image are dependent (one dark frame loses
all its pedestrians together), so objects are not independent trials and a binomial bound over
objects would be too narrow. The images are the independent units: a replicate resamples the group's
images with replacement (multinomial weights, from a seeded ``torch.Generator``: the same seed gives
the same numbers) and recomputes mAP from the kept records with *weighted* cumulative sums (an image
drawn twice counts twice, exactly as if its detections were duplicated next to each other), for a
chunk of replicates at once with matrix operations; no replicate repeats the matching. The same weighted
evaluation gives a grouped jackknife (rows leaving out a group of images) and random half-subsets (0/1
weights), from which :func:`~pytest_dnnsafety.engines.detection.bootstrap.bootstrap_lower` reads the lower bound
by ``method``: BCa, a bias-extrapolated bound, their minimum (``"conservative"``), that minimum read at a
fifth of the error rate (``"wide"``, the default) or the plain percentile, which undercovers mAP because sample AP is biased upwards on finite samples (see that module and
docs/gates/detection.md, "How good is the bound"). The upper end is the ``confidence`` percentile. None of these
is an exact (guaranteed-coverage) bound; their coverage is measured on known-truth simulations. A replicate
whose images hold no ground truth at all has no mAP and counts as 0 (conservative). Each chunk of replicates
ticks the gate's progress line (:func:`pytest_dnnsafety.runtime.progress.tick`, host ints, no sync).

Pure torch, no pytest import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.data.boxes import paired_iou
from pytest_dnnsafety.data.tasks import BoxSet
from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.detection.bootstrap import (
    DEFAULT_METHOD,
    HALF_SUBSETS,
    bootstrap_lower,
    half_weights,
    jackknife_groups,
    jackknife_weights,
)
from pytest_dnnsafety.engines.detection.greedy import (
    MATCH_CHUNK_ELEMENTS,
    cell_spans,
    match_batch,
)
from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.runtime import allocator, progress, threads

__all__ = ["AREA_RANGES", "COCO_IOU_THRESHOLDS", "RECALL_POINTS", "BoxMatchEngine", "GroupMAP", "GroupRecall",
           "average_precision"]


def _linspace(start: float, stop: float, num: int) -> Tensor:
    """numpy's ``linspace`` bit for bit (``i * step + start``, the last point ``stop``): what pycocotools uses."""
    out = torch.arange(num, dtype=torch.float64) * ((stop - start) / (num - 1)) + start
    out[-1] = stop
    return out


#: pycocotools' ``iouThrs``: 0.50, 0.55, …, 0.95.
COCO_IOU_THRESHOLDS = _linspace(0.5, 0.95, 10)
#: COCO's area ranges (pycocotools' ``areaRng``, ``[lo, hi]`` inclusive): an object whose area lies outside is an
#: "ignore" object of the range, and so is an unmatched detection whose box area does.
AREA_RANGES = {"all": (0.0, 1e5 ** 2), "small": (0.0, 32.0 ** 2), "medium": (32.0 ** 2, 96.0 ** 2),
               "large": (96.0 ** 2, 1e5 ** 2)}
_RANGES = torch.tensor(list(AREA_RANGES.values()), dtype=torch.float64)
#: pycocotools' ``recThrs``: 0.00, 0.01, …, 1.00.
RECALL_POINTS = _linspace(0.0, 1.0, 101)
_EPS = 2.220446049250313e-16  # np.spacing(1)
#: The float64 values of one bootstrap chunk's working set (32 MiB): replicates × (the largest class's detections ×
#: thresholds × AP_LIVE_TENSORS + images × (classes + 2)); the bootstrap's memory is one such block whatever the
#: number of images, its freed blocks given back to the system after each chunk.
BOOTSTRAP_CHUNK_ELEMENTS = 1 << 22


def _check_thresholds(iou_thresholds: Any) -> Tensor:
    thr = torch.as_tensor(iou_thresholds, dtype=torch.float64).reshape(-1)
    if thr.numel() == 0 or not bool(((thr > 0) & (thr <= 1)).all()):
        raise ConfigError(f"IoU thresholds must be a non-empty list of numbers in (0, 1], got {iou_thresholds!r}")
    return thr


class BoxMatchEngine(Engine):
    """Per-detection match records of a detector over a data set (see the module docstring).

    ``iou_thresholds``: the thresholds matched at (default COCO's ten); ``max_detections``: the
    detections kept per image and class (by score; COCO 100). The records are ``cat`` states and the
    image count a ``max`` state, so engines of disjoint image ranges (pytest-xdist workers, torchrun
    ranks) merge and all-reduce into the single pass's records; :meth:`records` orders them by image
    (stably), so the result does not depend on the order the parts were merged in.
    """

    def __init__(self, iou_thresholds: Any = COCO_IOU_THRESHOLDS, max_detections: int = 100,
                 device: torch.device | str | None = None, area_ranges: bool = True) -> None:
        super().__init__(device)
        if isinstance(max_detections, bool) or not isinstance(max_detections, int) or max_detections < 1:
            raise ConfigError(f"max_detections must be a positive int, got {max_detections!r}")
        self.thresholds = _check_thresholds(iou_thresholds)
        self.max_detections = max_detections
        self.area_ranges = bool(area_ranges)
        T = self.thresholds.numel()
        int64 = torch.int64
        self.add_state("det_score", torch.zeros(0, dtype=torch.float64), "cat")
        self.add_state("det_class", torch.zeros(0, dtype=int64), "cat")
        self.add_state("det_image", torch.zeros(0, dtype=int64), "cat")
        self.add_state("det_matched", torch.zeros(0, T, dtype=torch.bool), "cat")
        self.add_state("gt_image", torch.zeros(0, dtype=int64), "cat")
        self.add_state("gt_class", torch.zeros(0, dtype=int64), "cat")
        # COCO's ignore rules (crowd regions, area ranges): the detections ignored at each threshold (range all),
        # matched / ignored per small, medium, large range, and each object's crowd flag and area
        self.add_state("det_ignored", torch.zeros(0, T, dtype=torch.bool), "cat")
        self.add_state("det_range_matched", torch.zeros(0, 3, T, dtype=torch.bool), "cat")
        self.add_state("det_range_ignored", torch.zeros(0, 3, T, dtype=torch.bool), "cat")
        self.add_state("gt_crowd", torch.zeros(0, dtype=torch.bool), "cat")
        self.add_state("gt_area", torch.zeros(0, dtype=torch.float64), "cat")
        self.add_state("image_count", torch.zeros((), dtype=int64), "max")
        self._next = 0  # the default start of the next batch (host side, no sync)

    def config(self) -> dict[str, Any]:
        return {"iou_thresholds": self.thresholds.tolist(), "max_detections": self.max_detections,
                "area_ranges": self.area_ranges}

    def reset(self) -> None:
        super().reset()
        self._next = 0

    @property
    def n_images(self) -> int:
        """Images seen (the largest image index + 1 over every part merged in; one host read)."""
        return int(self.image_count)

    # ------------------------------------------------------------------ matching
    def update(self, detections: BoxSet, targets: BoxSet, start: int | None = None) -> None:
        """Match one batch: ``detections`` (with scores) and ``targets`` of the same ``n_images`` images,
        whose first image is data row ``start`` (default: right after the previous batch). No host sync
        beyond the two small reads that size the matching (see the module docstring)."""
        if detections.scores is None:
            raise MetricError("detection matching needs detections with scores")
        if detections.n_images != targets.n_images:
            raise MetricError(f"{detections.n_images} images of detections but {targets.n_images} of targets")
        start = self._next if start is None else int(start)
        self._next = start + targets.n_images
        dev = targets.device
        dets = detections.to(dev)
        T = self.thresholds.numel()
        with threads.host_bound():  # many small kernels driven from Python: one thread (runtime.threads)
            if self.area_ranges or targets.crowd is not None:  # COCO's ignore rules: every range at once
                ranges = _RANGES if self.area_ranges else _RANGES[:1]
                score, label, image, both, ignored = match_batch(dets, targets, self.thresholds.to(dev),
                                                                 self.max_detections, MATCH_CHUNK_ELEMENTS, ranges)
                matched, ign = both[:, 0], ignored[:, 0]
                if self.area_ranges:
                    self.append_state("det_range_matched", both[:, 1:])
                    self.append_state("det_range_ignored", ignored[:, 1:])
            else:
                score, label, image, matched = _match(dets, targets, self.thresholds.to(dev), self.max_detections)
                ign = torch.zeros(matched.shape[0], T, dtype=torch.bool, device=dev)
        self.append_state("det_ignored", ign)
        self.append_state("gt_crowd", targets.crowd if targets.crowd is not None
                          else torch.zeros(len(targets), dtype=torch.bool, device=dev))
        self.append_state("gt_area", targets.box_area())
        self.append_state("det_score", score)
        self.append_state("det_class", label)
        self.append_state("det_image", image + start)
        self.append_state("det_matched", matched)
        self.append_state("gt_image", targets.image + start)
        self.append_state("gt_class", targets.labels)
        self.image_count = torch.maximum(self.image_count, torch.tensor(start + targets.n_images,
                                                                        device=self.image_count.device))

    def records(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """All batches' records, detections ordered by image (stably): detection score, class, image,
        matched ``(D, T)``; object image, class (the objects COCO counts: crowd regions left out)."""
        score, label, image, matched, _, gimage, glabel = self._records("all")
        return score, label, image, matched, gimage, glabel

    def _records(self, area: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor, Tensor]:
        """:meth:`records` of area range ``area``, with the detections counted ``(D, T)`` (None: all of them)."""
        if area not in AREA_RANGES:
            raise ConfigError(f"area must be one of {list(AREA_RANGES)}, got {area!r}")
        image = self.det_image
        order = torch.sort(image, stable=True).indices
        if area == "all":
            matched, ignored = self.det_matched, self.det_ignored
        elif not self.area_ranges:
            raise ConfigError(f"area={area!r}: this matching did not record COCO's area ranges (area_ranges=False)")
        else:
            j = list(AREA_RANGES).index(area) - 1
            matched, ignored = self.det_range_matched[:, j], self.det_range_ignored[:, j]
        counted = ~ignored[order] if bool(ignored.any()) else None
        keep = ~self.gt_crowd
        if self.area_ranges or area != "all":
            lo, hi = AREA_RANGES[area]
            keep = keep & (self.gt_area >= lo) & (self.gt_area <= hi)
        return (self.det_score[order], self.det_class[order], image[order], matched[order], counted,
                self.gt_image[keep], self.gt_class[keep])

    def area_maps(self, images: Tensor | None = None, columns: Sequence[int] | None = None) -> dict[str, float]:
        """COCO's mAP of the small, medium and large area ranges of ``images`` (``stats[3:6]``; NaN where the
        range holds no object): :meth:`evaluate` with ``area=`` each (no bootstrap), the records sorted once."""
        if not self.area_ranges:
            raise ConfigError("area_maps: this matching did not record COCO's area ranges (area_ranges=False)")
        names = list(AREA_RANGES)[1:]
        with threads.host_bound():
            cols = list(range(self.thresholds.numel())) if columns is None else [int(c) for c in columns]
            rows = torch.sort(self.det_image, stable=True).indices  # the records' order, then the kept images
            keep = self._image_mask(images)
            gimage, glabel, garea, gcrowd = self.gt_image, self.gt_class, self.gt_area, self.gt_crowd
            if images is not None:
                rows = rows[keep[self.det_image[rows].cpu()].to(rows.device)]
                gt_in = keep[gimage.cpu()].to(gimage.device)
                gimage, glabel, garea, gcrowd = gimage[gt_in], glabel[gt_in], garea[gt_in], gcrowd[gt_in]
            score, label, image = self.det_score[rows], self.det_class[rows], self.det_image[rows]
            members = torch.nonzero(keep).reshape(-1)
            local = torch.full((self.n_images,), -1, dtype=torch.int64)
            local[members] = torch.arange(members.numel())
            image, gimage = local[image.cpu()].to(score.device), local[gimage.cpu()].to(score.device)
            n_img = int(members.numel())
            classes = torch.unique(torch.cat([label, glabel]).cpu())  # a class without objects in a range: NaN
            K = int(classes.numel())
            cls = torch.searchsorted(classes, label.cpu()).to(score.device)
            gcls = torch.searchsorted(classes, glabel.cpu()).to(score.device)
            order = _class_score_order(cls, score)
            cls, image, rows = cls[order], image[order], rows[order]
            matched, counted = self.det_range_matched[rows], ~self.det_range_ignored[rows]  # (D, 3, T): one gather
            if cols != list(range(self.thresholds.numel())):
                matched, counted = matched[:, :, cols], counted[:, :, cols]
            bounds = torch.searchsorted(cls.cpu(), torch.arange(K + 1)).tolist()
            ones = torch.ones(1, n_img, dtype=torch.float64, device=score.device)
            out = {}
            for j, name in enumerate(names):
                lo, hi = AREA_RANGES[name]
                kept = ~gcrowd & (garea >= lo) & (garea <= hi)
                gt_counts = torch.zeros(n_img, max(K, 1), dtype=torch.float64, device=score.device)
                gt_counts.index_put_((gimage[kept], gcls[kept]), torch.ones_like(gimage[kept], dtype=torch.float64),
                                     accumulate=True)
                out[name] = _mean_map(average_precision(matched[:, j], image, bounds, gt_counts, ones,
                                                        counted[:, j])[0])
        return out

    def compute(self) -> "GroupMAP":
        """mAP of every image seen (no bootstrap): :meth:`evaluate` with its defaults."""
        return self.evaluate()

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, images: Tensor | None = None, *, bootstrap: int = 0, confidence: float = 0.95,
                 generator: torch.Generator | None = None, columns: Sequence[int] | None = None,
                 method: str = DEFAULT_METHOD, area: str = "all") -> "GroupMAP":
        """mAP (and per-class AP) of the images ``images`` (a bool mask or indices; default all), with a
        bootstrap over those images when ``bootstrap`` > 0 whose lower bound is read by ``method``
        (:data:`~pytest_dnnsafety.engines.detection.bootstrap.BOUND_METHODS`; see the module docstring).
        ``columns``: the thresholds (indices into ``thresholds``) averaged over (default all; each
        threshold's matching is independent of the others, so a subset is that subset's mAP). ``area``: COCO's area
        range (:data:`AREA_RANGES`; objects and unmatched detections outside it are ignored, as crowd regions are)."""
        with threads.host_bound():  # the point estimate: sorts and small per-class kernels, one thread
            score, label, image, matched, counted, gimage, glabel = self._records(area)
            columns = list(range(self.thresholds.numel())) if columns is None else [int(c) for c in columns]
            matched = matched[:, columns]
            counted = None if counted is None else counted[:, columns]
            keep = self._image_mask(images)
            det_in, gt_in = keep[image.cpu()].to(score.device), keep[gimage.cpu()].to(gimage.device)
            score, label, image, matched = score[det_in], label[det_in], image[det_in], matched[det_in]
            counted = None if counted is None else counted[det_in]
            gimage, glabel = gimage[gt_in], glabel[gt_in]
            members = torch.nonzero(keep).reshape(-1)
            local = torch.full((self.n_images,), -1, dtype=torch.int64)
            local[members] = torch.arange(members.numel())
            image, gimage = local[image.cpu()].to(score.device), local[gimage.cpu()].to(score.device)
            n_img = int(members.numel())
            classes = torch.unique(torch.cat([label, glabel]).cpu())
            K = int(classes.numel())
            cls = torch.searchsorted(classes, label.cpu()).to(score.device)
            gcls = torch.searchsorted(classes, glabel.cpu()).to(score.device)
            gt_counts = torch.zeros(n_img, max(K, 1), dtype=torch.float64, device=score.device)
            gt_counts.index_put_((gimage, gcls), torch.ones_like(gimage, dtype=torch.float64), accumulate=True)
            order = _class_score_order(cls, score)
            cls, score, image, matched = cls[order], score[order], image[order], matched[order]
            counted = None if counted is None else counted[order]
            bounds = torch.searchsorted(cls.cpu(), torch.arange(K + 1)).tolist()
            ones = torch.ones(1, n_img, dtype=torch.float64, device=score.device)
            ap = average_precision(matched, image, bounds, gt_counts, ones, counted)[0]  # (K, T), NaN without GT
            point = _mean_map(ap)
        lower = upper = replicates = jackknife = halves = None
        if bootstrap:
            gen = generator if generator is not None else torch.Generator().manual_seed(0)
            chunk = _replicates_per_chunk(bounds, matched.shape[1], n_img, K)
            # one thread too: per class a few scans (cumulative sums, running maxima, searches) over a chunk, whose
            # parallel regions wait at OpenMP's barrier on a busy machine (measured 5-30x slower on 2 threads there)
            with threads.host_bound():
                maps, jks, subs = [], [], []
                for first in range(0, bootstrap, chunk):
                    b = min(chunk, bootstrap - first)
                    weights = _multinomial_weights(b, n_img, gen).to(score.device)
                    maps.append(_mean_map(average_precision(matched, image, bounds, gt_counts, weights, counted),
                                          fill=0.0))
                    progress.tick(first + b, bootstrap, "bootstrap replicates")
                    allocator.release()  # the chunk's freed blocks back to the system: the peak stays one chunk
                groups = jackknife_groups(n_img)  # the jackknife's and half-subsets' weights, a chunk at a time too
                for first in range(0, groups, chunk):
                    rows = range(first, min(first + chunk, groups))
                    jks.append(_mean_map(average_precision(matched, image, bounds, gt_counts,
                                                           jackknife_weights(n_img, rows=rows).to(score.device),
                                                           counted),
                                         fill=0.0))
                for first in range(0, HALF_SUBSETS, chunk):
                    half = half_weights(n_img, gen, count=min(chunk, HALF_SUBSETS - first)).to(score.device)
                    subs.append(_mean_map(average_precision(matched, image, bounds, gt_counts, half, counted),
                                          fill=0.0))
                    allocator.release()
                replicates = torch.cat(maps).cpu()
                jackknife = torch.cat(jks).cpu()
                halves = torch.cat(subs).cpu()
                lower = float(bootstrap_lower(replicates, point, confidence, method, jackknife, halves))
                upper = _percentiles(replicates, confidence)[1]
        return GroupMAP(images=n_img, objects=int(gimage.numel()), detections=int(score.numel()),
                        classes=classes.tolist(), ap=ap.cpu(), map=point,
                        map50=_mean_map(ap[:, :1]) if ap.numel() else math.nan,
                        lower=lower, upper=upper, replicates=replicates, jackknife=jackknife, method=method,
                        halves=halves,
                        thresholds=self.thresholds[columns].tolist())

    def recall(self, images: Tensor | None = None, *, score_threshold: float = 0.5, threshold_index: int = 0,
               bootstrap: int = 0, confidence: float = 0.95, generator: torch.Generator | None = None,
               method: str = DEFAULT_METHOD) -> "GroupRecall":
        """Per-class recall of the images ``images``: objects matched (at ``thresholds[threshold_index]``) by a
        detection with score ≥ ``score_threshold``, over the objects; bootstrap over images as :meth:`evaluate`, in
        chunks of replicates (the exact delete-one jackknife of each ratio gives BCa's acceleration)."""
        with threads.host_bound():  # the per-class counts: sorts and small kernels, one thread
            score, label, image, matched, gimage, glabel = self.records()
            keep = self._image_mask(images)
            members = torch.nonzero(keep).reshape(-1)
            local = torch.full((self.n_images,), -1, dtype=torch.int64)
            local[members] = torch.arange(members.numel())
            n_img = int(members.numel())
            hit_row = (score >= score_threshold) & matched[:, threshold_index]
            det_in = keep[image.cpu()].to(score.device) & hit_row
            gt_in = keep[gimage.cpu()].to(gimage.device)
            classes = torch.unique(glabel[gt_in].cpu())
            K = int(classes.numel())
            hits = torch.zeros(n_img, max(K, 1), dtype=torch.float64)
            objects = torch.zeros(n_img, max(K, 1), dtype=torch.float64)
            lab, gl = label[det_in].cpu(), glabel[gt_in].cpu()
            known = torch.isin(lab, classes)  # a matched detection's class always has objects; defensive
            hits.index_put_((local[image[det_in].cpu()][known], torch.searchsorted(classes, lab[known])),
                            torch.ones(int(known.sum()), dtype=torch.float64), accumulate=True)
            objects.index_put_((local[gimage[gt_in].cpu()], torch.searchsorted(classes, gl)),
                               torch.ones(gl.numel(), dtype=torch.float64), accumulate=True)
            per_class = hits.sum(0)[:K] / objects.sum(0)[:K]
            overall = float(hits.sum() / objects.sum()) if K else math.nan
        lower = overall_lower = replicates = None
        if bootstrap and K:
            gen = generator if generator is not None else torch.Generator().manual_seed(0)
            hits, objects = hits[:, :K], objects[:, :K]
            chunk = max(1, BOOTSTRAP_CHUNK_ELEMENTS // max(1, n_img * (K + 1)))
            parts = []
            for first in range(0, bootstrap, chunk):
                weights = _multinomial_weights(min(chunk, bootstrap - first), n_img, gen)
                parts.append(torch.stack([weights @ hits, weights @ objects]))  # (2, b, K)
                progress.tick(first + parts[-1].shape[1], bootstrap, "bootstrap replicates")
            h, o = torch.cat(parts, 1)
            rep = torch.where(o > 0, h / o.clamp_min(1), torch.zeros_like(h))  # a class drawn away: 0
            overall_rep = h.sum(1) / o.sum(1).clamp_min(1)
            # delete-one jackknife, exact and cheap for a ratio of sums: (H − h_i) / (O − o_i)
            H, O = hits.sum(0), objects.sum(0)
            jk = torch.where(O - objects > 0, (H - hits) / (O - objects).clamp_min(1), torch.zeros_like(hits))
            jk_all = (H.sum() - hits.sum(1)) / (O.sum() - objects.sum(1)).clamp_min(1)
            hh, ho = [], []  # half-subsets a chunk at a time: (count, n) weights stay within the block
            for first in range(0, HALF_SUBSETS, chunk):
                half = half_weights(n_img, gen, count=min(chunk, HALF_SUBSETS - first))
                hh.append(half @ hits)
                ho.append(half @ objects)
            hh, ho = torch.cat(hh), torch.cat(ho)
            sub = torch.where(ho > 0, hh / ho.clamp_min(1), torch.zeros_like(hh))
            sub_all = hh.sum(1) / ho.sum(1).clamp_min(1)
            lower = bootstrap_lower(rep, per_class, confidence, method, jk, sub)
            overall_lower = float(bootstrap_lower(overall_rep, overall, confidence, method, jk_all, sub_all))
            replicates = (rep, overall_rep, jk, jk_all, sub, sub_all)
        return GroupRecall(images=n_img, objects=int(objects.sum()), classes=classes.tolist(),
                           recall=per_class, class_objects=objects.sum(0)[:K].long().tolist(), overall=overall,
                           lower=lower, overall_lower=overall_lower, method=method, replicates=replicates)

    def _image_mask(self, images: Tensor | None) -> Tensor:
        keep = torch.ones(self.n_images, dtype=torch.bool)
        if images is not None:
            images = torch.as_tensor(images).cpu()
            if images.dtype == torch.bool:
                keep = images.reshape(-1)[: self.n_images].clone()
            else:
                keep = torch.zeros(self.n_images, dtype=torch.bool)
                keep[images.long()] = True
        return keep


@dataclass(frozen=True)
class GroupMAP:
    """COCO mAP of one set of images: point estimates, per-class AP ``(K, T)`` and bootstrap bounds."""

    images: int
    objects: int
    detections: int
    classes: list[int]
    ap: Tensor  # (K, T) AP per class and IoU threshold, NaN for a class without ground truth
    map: float  # mean over classes with ground truth and thresholds; NaN when no class has any
    map50: float  # the same at the first threshold
    lower: float | None  # the bootstrap lower bound read by ``method``
    upper: float | None  # the ``confidence`` percentile of the replicates
    replicates: Tensor | None  # (B,) bootstrap mAPs
    thresholds: list[float]
    jackknife: Tensor | None = None  # (G,) grouped-jackknife mAPs (BCa's acceleration)
    halves: Tensor | None = None  # (H,) mAPs of random half-subsets of the images (the bias extrapolation)
    method: str = DEFAULT_METHOD

    def class_ap(self) -> dict[int, float | None]:
        """Each class's AP averaged over the thresholds (None: no ground truth)."""
        means = self.ap.mean(1) if self.ap.numel() else torch.zeros(0)
        return {c: (None if math.isnan(v) else v) for c, v in zip(self.classes, means.tolist())}


@dataclass(frozen=True)
class GroupRecall:
    """Per-class recall at a score threshold of one set of images (bounds from the bootstrap)."""

    images: int
    objects: int
    classes: list[int]
    recall: Tensor  # (K,)
    class_objects: list[int]
    overall: float
    lower: Tensor | None  # (K,)
    overall_lower: float | None
    method: str = DEFAULT_METHOD
    #: (per-class replicates (B, K), overall (B,), per-class delete-one jackknife (n, K), overall (n,), per-class
    #: half-subsets (H, K), overall (H,))
    replicates: tuple[Tensor, ...] | None = None


# ------------------------------------------------------------------------------------- matching kernels


def _stable_order(key: Tensor) -> Tensor:
    return torch.sort(key, stable=True).indices


def _match(dets: BoxSet, gts: BoxSet, thr: Tensor, max_det: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """COCO's greedy matching of one batch, every (image, class) cell at once; one step per detection rank
    (:func:`~pytest_dnnsafety.engines.detection.greedy.match_batch`, in spans of :data:`MATCH_CHUNK_ELEMENTS`)."""
    return match_batch(dets, gts, thr, max_det, MATCH_CHUNK_ELEMENTS)


def _cell_spans(d_count: list[int], g_count: list[int], width: int) -> list[tuple[int, int, int, int]]:
    """:func:`~pytest_dnnsafety.engines.detection.greedy.cell_spans` within :data:`MATCH_CHUNK_ELEMENTS`."""
    return cell_spans(d_count, g_count, width, MATCH_CHUNK_ELEMENTS)


def cell_iou(a: Tensor, b: Tensor) -> Tensor:
    """:func:`~pytest_dnnsafety.data.boxes.box_iou` batched over a leading dimension: ``(C, P, 4)`` × ``(C, Q, 4)`` →
    ``(C, P, Q)`` (the same kernel, :func:`~pytest_dnnsafety.data.boxes.paired_iou`, so the same bits), without the
    ``(D, M)`` matrix of every detection against every object of the batch."""
    return paired_iou(a[:, :, None, :], b[:, None, :, :])


# ------------------------------------------------------------------------------------- accumulation


def _class_score_order(cls: Tensor, score: Tensor) -> Tensor:
    """Class, then score descending; ties keep the record order (images ascending, as pycocotools)."""
    order = _stable_order(-score)
    return order[_stable_order(cls[order])]


def average_precision(matched: Tensor, image: Tensor, bounds: Sequence[int], gt_counts: Tensor,
                      weights: Tensor, counted: Tensor | None = None) -> Tensor:
    """AP per replicate, class and threshold, ``(B, K, T)`` (NaN where a class has no ground truth).

    ``matched`` ``(D, T)`` and ``image`` ``(D,)`` are the records sorted by class then score
    (class ``k`` is rows ``bounds[k]:bounds[k + 1]``); ``gt_counts`` ``(n_images, K)``; ``weights``
    ``(B, n_images)`` the number of times each image is counted (1: the data as it is); ``counted`` ``(D, T)``:
    the detections that are true or false positives (None: all; COCO's ignored ones are neither).
    """
    B, T = weights.shape[0], matched.shape[1]
    K = len(bounds) - 1
    npig = weights @ gt_counts[:, :K]  # (B, K)
    out = torch.full((B, K, T), math.nan, dtype=torch.float64, device=weights.device)
    points = RECALL_POINTS.to(weights.device)
    for k in range(K):  # classes are few; each is one set of matrix operations over replicates and thresholds
        lo, hi = bounds[k], bounds[k + 1]
        n_pos = npig[:, k]  # (B,)
        if hi == lo:
            out[:, k] = torch.where(n_pos > 0, 0.0, math.nan)[:, None].expand(B, T)
            continue
        n = hi - lo
        w = weights[:, image[lo:hi]]  # (B, n)
        # Laid out (B, T, n) from the start, so cumulative sums, the envelope and the search run along the last
        # dimension, and at most :data:`AP_LIVE_TENSORS` (B, T, n) float64 tensors are alive at once.
        tp = w[:, None, :] * matched[lo:hi].T.to(torch.float64).contiguous()[None]  # (B, T, n), contiguous
        tp = tp.cumsum_(-1)  # integer sums, exact in float64
        if counted is None:
            seen = w.cumsum(-1)[:, None, :].add_(_EPS)  # (B, 1, n): the (weighted) detections so far, + eps as COCO
        else:  # (B, T, n): the true and false positives so far (ignored detections are neither)
            seen = (w[:, None, :] * counted[lo:hi].T.to(torch.float64)[None]).cumsum_(-1).add_(_EPS)
        rc = tp / n_pos[:, None, None].clamp_min(1)
        pr = tp.div_(seen).flip(-1)  # tp is precision now; flipped (a copy): the envelope is a running maximum
        del tp
        env = pr.cummax(-1).values  # precision made monotone from the right, in flipped order
        del pr
        idx = torch.searchsorted(rc, points.expand(B, T, -1).contiguous(), side="left")  # (B, T, R)
        del rc
        q = torch.where(idx < n, env.gather(-1, (n - 1 - idx).clamp_min(0)),
                        torch.zeros((), dtype=env.dtype, device=env.device))
        out[:, k] = torch.where(n_pos[:, None] > 0, q.mean(-1), torch.full_like(q[..., 0], math.nan))
    return out


#: The most ``(B, T, n)`` float64 tensors :func:`average_precision` holds at once for a class of ``n`` detections.
AP_LIVE_TENSORS = 4


def _replicates_per_chunk(bounds: Sequence[int], thresholds: int, n_img: int, classes: int) -> int:
    """Replicates evaluated together so that :func:`average_precision`'s working set (its largest class's
    :data:`AP_LIVE_TENSORS` tensors, and the chunk's weights over the images) stays within
    :data:`BOOTSTRAP_CHUNK_ELEMENTS` float64 values whatever the number of images."""
    largest = max((hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])), default=0)
    per_row = max(1, largest * thresholds * AP_LIVE_TENSORS + n_img * (max(classes, 1) + 2))
    return max(1, BOOTSTRAP_CHUNK_ELEMENTS // per_row)


def _mean_map(ap: Tensor, fill: float = math.nan) -> Any:
    """Mean over classes with ground truth and thresholds: a float for ``(K, T)``, ``(B,)`` for ``(B, K, T)``."""
    if ap.dim() == 2:
        valid = ~torch.isnan(ap)
        return float(ap[valid].mean()) if bool(valid.any()) else fill
    valid = ~torch.isnan(ap)
    total = torch.where(valid, ap, torch.zeros_like(ap)).sum((1, 2))
    count = valid.sum((1, 2))
    return torch.where(count > 0, total / count.clamp_min(1), torch.full_like(total, fill))


def _multinomial_weights(b: int, n: int, generator: torch.Generator) -> Tensor:
    """``(b, n)`` float64 counts: each row ``n`` draws with replacement from ``n`` images (on the host, seeded)."""
    if n == 0:
        return torch.zeros(b, 0, dtype=torch.float64)
    draws = torch.randint(0, n, (b, n), generator=generator)
    counts = torch.zeros(b, n, dtype=torch.float64)
    counts.scatter_add_(1, draws, torch.ones(b, n, dtype=torch.float64))
    return counts


def _percentiles(values: Tensor, confidence: float) -> tuple[float, float]:
    """The one-sided ``1 − confidence`` (lower) and ``confidence`` (upper) percentiles, conservative sides."""
    values = values.to(torch.float64).cpu()
    lo = torch.quantile(values, 1.0 - confidence, interpolation="lower")
    hi = torch.quantile(values, confidence, interpolation="higher")
    return float(lo), float(hi)
