"""Occlusion interpretability of an object detector: M_interpret and M_OccSen per ground-truth object.

Cheng et al. 2018, §II-F/G, eq. (5), read for object detection as §II-F step 2 describes it: the
"probability of the correct class" of an object is its *matched score* — the highest score of a
detection of its class in its image whose IoU with its ground-truth box is at least ``iou``, else 0
(:func:`~pytest_dnnsafety.data.tasks.matched_scores`). Per ground-truth object
(not per image):

* the heat map ``h`` holds, per occluder position, the object's matched score on the image with
  that position occluded (the occluder grid, fill and chunking of
  :func:`~pytest_dnnsafety.engines.interpretability.occlusion.occlusion_maps`: all occluded copies of a batch's images
  go to the detector in chunks of at most ``max_batch`` images);
* ``P_hot = {h < ρ}``;
* ``P_occluding`` = positions whose occluder overlaps the object: by default its **ground-truth box**
  (the occluder's pixels ``[c, c + w) × [r, r + h)`` and the box ``(x1, x2) × (y1, y2)`` overlap with
  positive area) — box-level ground truth, coarser than the segmentation mask the paper assumes (a
  box also holds background, so a detector that looks at the object scores a little lower than with
  a mask); or, when masks are given as ``(M, H, W)``, one mask per object in the packed targets'
  order (rows ``offsets[i]:offsets[i + 1]`` are image ``i``'s objects);
* ``M_interpret = |hot ∩ occluding| / |hot|`` and ``M_OccSen = |hot ∩ occluding| / |occluding|``,
  with the classifier path's ``no_hot`` and ``empty_mask`` rules and aggregates
  (:class:`~pytest_dnnsafety.engines.interpretability.occlusion.OcclusionEngine`; its "inputs" are objects here).

**Objects missed on the clean image.** The object is always the ground-truth object and its class
(``target="predicted"`` and ``"label"`` read the same object: a detector's clean "prediction" of an
object *is* its matched score). An object whose clean matched score is already below ρ (the detector
misses it) is kept, as eq. (5) defines it: every position is hot, so its M_interpret is the share of
positions on its box (a detector whose boxes miss the object fails ``min_interpretation_precision``)
and its M_OccSen is 1 (it fails ``max_occlusion_sensitivity``). ``min_occlusion_sensitivity`` asks
that the object matter to its detection; a missed object has none, and counting its 1 would let a
detector that finds nothing pass, so :attr:`DetectorOcclusion.strict` is the same measurement with
the missed objects' hot sets emptied (M_OccSen 0) for that gate. Missed objects are counted
(``below_rho``) and reported. A detector that misses *every* object gives no signal: its gates are
inconclusive, as a classifier's whose probability is below ρ on every input
(:meth:`~pytest_dnnsafety.engines.interpretability.plan.OcclusionPlan.by_convention`). Pure torch; no pytest import.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.data.forms import known_length
from pytest_dnnsafety.errors import DataError
from pytest_dnnsafety.engines.core.guard import eval_mode
from pytest_dnnsafety.data.tasks import BoxSet
from pytest_dnnsafety.data.tasks import matched_scores
from pytest_dnnsafety.engines.core.detections import repeat_targets
from pytest_dnnsafety.engines.interpretability.occlusion import (MAX_ELEMENTS, WORST_INPUTS, OcclusionEngine, OcclusionResult, _check_options, _map, _pair,
                        _rows, check_masks, occluding_positions, occlusion_positions)
from pytest_dnnsafety.engines.core.runner import Batch, Runner

__all__ = ["DetectorOcclusion", "assess_detector_occlusion", "box_occluding_positions", "detector_occlusion_maps"]


@dataclass(frozen=True)
class DetectorOcclusion:
    """``result``: eq. (5) per object (missed objects every position hot); ``strict``: the same with the missed
    objects' hot sets emptied (their M_OccSen 0), read by ``min_occlusion_sensitivity``."""

    result: OcclusionResult
    strict: OcclusionResult


def box_occluding_positions(boxes: Tensor, size: Any, rows: Tensor, cols: Tensor) -> Tensor:
    """``(M, Ph·Pw)`` bool: the occluder at that position overlaps the box ``x1, y1, x2, y2`` with positive area."""
    (h, w) = _pair(size, "size")
    b = boxes.to(torch.float64)
    r, c = rows.to(b.device, torch.float64), cols.to(b.device, torch.float64)
    in_r = (r[None] < b[:, 3:4]) & (r[None] + h > b[:, 1:2])  # (M, Ph)
    in_c = (c[None] < b[:, 2:3]) & (c[None] + w > b[:, 0:1])  # (M, Pw)
    return (in_r[:, :, None] & in_c[:, None, :]).reshape(boxes.shape[0], -1)


def detector_occlusion_maps(model: Any, x: Tensor, targets: BoxSet, *, size: Any, fill: float | str,
                            rows: Tensor, cols: Tensor, iou: float, max_batch: int, guard: Any,
                            clean_guard: Any) -> tuple[Tensor, Tensor]:
    """Heat maps ``(M, Ph·Pw)`` (float64) of the batch's ``M`` objects and their clean matched scores ``(M,)``.

    The ``N·P`` occluded copies of the batch's images go to the detector in chunks (one forward per chunk).
    """
    n, height, width = x.shape[0], x.shape[-2], x.shape[-1]
    (h, w) = _pair(size, "size")
    pw, npos = cols.shape[0], rows.shape[0] * cols.shape[0]
    m = len(targets)
    heat = torch.zeros((m, npos), dtype=torch.float64, device=x.device)
    with torch.no_grad():
        p_clean = matched_scores(clean_guard(model, x), targets, iou).to(torch.float64)
        if m == 0:
            return heat, p_clean
        fills = (x.mean(dim=(-2, -1), keepdim=True) if fill == "mean"
                 else torch.full((n,) + (1,) * (x.ndim - 1), float(fill), dtype=x.dtype, device=x.device))
        ar_h, ar_w = torch.arange(height, device=x.device), torch.arange(width, device=x.device)
        chunk = max(1, min(max_batch, MAX_ELEMENTS // max(1, x[0].numel())))
        for start in range(0, n * npos, chunk):
            k = torch.arange(start, min(start + chunk, n * npos), device=x.device)
            b, p = k // npos, k % npos
            r, c = rows[p // pw], cols[p % pw]
            in_r = (ar_h[None] >= r[:, None]) & (ar_h[None] < r[:, None] + h)
            in_c = (ar_w[None] >= c[:, None]) & (ar_w[None] < c[:, None] + w)
            box = (in_r[:, :, None] & in_c[:, None, :]).reshape((k.shape[0],) + (1,) * (x.ndim - 3) + (height, width))
            dets = guard(model, torch.where(box, fills[b], x[b]))
            copies, obj = repeat_targets(targets, b)
            scores = matched_scores(dets, copies, iou).to(torch.float64)
            heat[obj, p[copies.image]] = scores
    return heat, p_clean


def _object_masks(masks: Any, n_objects: int | None) -> Tensor | None:
    """Per-object masks ``(M, H, W)`` bool, or None for the boxes (masks not given)."""
    if masks is None:
        return None
    m = check_masks(masks, "occlusion (detection): per-object masks")
    if n_objects is not None and m.shape[0] != n_objects:
        raise DataError(f"occlusion (detection): {m.shape[0]} masks for {n_objects} ground-truth objects. Fix: give "
                        "one mask (M, H, W) per object, in the packed targets' order (image i's objects are rows "
                        "offsets[i]:offsets[i+1]), or give no masks to use the objects' boxes.")
    return m


def assess_detector_occlusion(model: Any, data: Any, masks: Any = None, *, size: Any, stride: Any = 1,
                              fill: float | str = 0.0, rho: float = 0.5, target: str = "predicted",
                              no_hot: str = "skip", empty_mask: str = "error", iou: float = 0.5,
                              batch_size: int = 256, max_batch: int = 4096, device: torch.device | str = "cpu",
                              shard: Any = None) -> DetectorOcclusion:
    """M_interpret and M_OccSen (eq. 5) of a detector, per ground-truth object of detection ``data``.

    ``data``: detection data (images and packed targets: :class:`~pytest_dnnsafety.data.tasks.DetectionData`, or a
    ``DataLoader`` with :func:`~pytest_dnnsafety.data.tasks.detection_collate`). ``masks``: None (each object's box)
    or ``(M, H, W)`` booleans, one per object. See the module docstring for the rules.
    """
    _check_options(rho, fill, target, "auto", batch_size)
    targets = getattr(data, "targets", None)
    m_all = _object_masks(masks, len(targets) if isinstance(targets, BoxSet) else None)
    # each image's first object row in the whole data (host tensor): the objects' indices and masks under a shard
    starts = targets.offsets() if isinstance(targets, BoxSet) else None
    if starts is None and shard is not None and m_all is not None:
        raise DataError("occlusion (detection): per-object masks under torchrun need the data as DetectionData (an "
                        ".npz with x, boxes, labels and offsets), so that each rank knows its objects' rows.")
    runner = Runner("occlusion (detection)", model=model, device=device, batch_size=batch_size, shard=shard,
                    labels="required")
    dev = runner.device
    acc = torch.device("cpu") if dev.type == "mps" else dev
    clean_guard = runner.guard("occlusion: detector on clean images", task="detection")
    guard = runner.guard("occlusion: detector on occluded images", task="detection")
    state: dict[str, Any] = {"grid": None, "objects": 0}
    engines: dict[str, OcclusionEngine] = {}

    def step(batch: Batch) -> None:
        x, t = batch.x, batch.y
        if not isinstance(t, BoxSet):
            raise DataError("occlusion (detection): the data hold no ground-truth boxes. Fix: give detection data "
                            "(an .npz with x, boxes, labels and offsets, or a DataLoader with detection_collate).")
        if x.ndim < 3:
            raise DataError(f"occlusion (detection): the images must be (N, C, H, W), got {tuple(x.shape)}.")
        if state["grid"] is None:
            rows, cols = occlusion_positions(x.shape[-2], x.shape[-1], size, stride)
            state["grid"] = (rows.to(dev), cols.to(dev))
            p = int(rows.shape[0] * cols.shape[0])
            engines["result"] = OcclusionEngine(no_hot, empty_mask, worst=WORST_INPUTS, positions=p, device=acc)
            engines["strict"] = OcclusionEngine(no_hot, empty_mask, device=acc)
        rows, cols = state["grid"]
        heat, p_clean = detector_occlusion_maps(model, x, t, size=size, fill=fill, rows=rows, cols=cols, iou=iou,
                                                max_batch=max_batch, guard=guard, clean_guard=clean_guard)
        clean_guard.targets(t, batch.index)  # target labels beyond the detector's declared classes: flagged
        first = int(starts[batch.start]) if starts is not None else state["objects"]
        state["objects"] += len(t)
        if m_all is None:
            occ = box_occluding_positions(t.boxes, size, rows, cols)
        else:
            if tuple(m_all.shape[1:]) != tuple(x.shape[-2:]):
                raise DataError(f"occlusion (detection): masks of size {tuple(m_all.shape[1:])} for images of size "
                                f"{tuple(x.shape[-2:])}. Fix: give masks of the images' height and width.")
            occ = occluding_positions(m_all[first:first + len(t)].to(dev), size, stride, positions=(rows, cols))
        hot, missed = heat < rho, p_clean < rho
        engines["result"].update(hot, occ, start=first, below_rho=missed, maps=heat, cls=t.labels, p_clean=p_clean)
        engines["strict"].update(hot & ~missed[:, None], occ, start=first, below_rho=missed)

    with eval_mode(model):
        runner.run(data, step, lambda: engines.get("result"), lambda: engines.get("strict"))
    if m_all is not None and shard is None and state["objects"] != m_all.shape[0]:
        raise DataError(f"occlusion (detection): {m_all.shape[0]} masks for {state['objects']} ground-truth objects. "
                        "Fix: give one mask (M, H, W) per object, in the packed targets' order.")
    if known_length(data) is not None and state["grid"] is None:
        raise DataError("occlusion (detection): no images were read. Fix: give data with at least one image.")
    rows, cols = state["grid"]
    grid = (int(rows.shape[0]), int(cols.shape[0]))
    setup = {"size": list(_pair(size, "size")), "stride": list(_pair(stride, "stride")), "fill": fill,
             "rho": float(rho), "target": target, "no_hot": no_hot, "empty_mask": empty_mask, "positions": list(grid),
             "task": "detection", "iou": float(iou), "units": "ground-truth objects",
             "occluding": "per-object masks" if m_all is not None else "ground-truth boxes"}
    engine = engines["result"]
    maps_out = (_map(engine.lowest_interpret, "m_interpret", "lowest M_interpret", grid, float(rho))
                + _map(engine.highest_occsen, "m_occsen", "highest M_OccSen", grid, float(rho)))
    result = replace(engine.compute(), setup=setup, worst_inputs=tuple(_rows(engine.lowest_interpret)),
                     maps=tuple(maps_out))
    strict = replace(engines["strict"].compute(), setup={**setup, "missed_objects": "M_OccSen 0 (no detection)"})
    return DetectorOcclusion(result, strict)
