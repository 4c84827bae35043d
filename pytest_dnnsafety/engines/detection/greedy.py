"""COCO's greedy box matching of one batch, every (image, class) cell and IoU threshold at once.

pycocotools' ``evaluateImg`` matches, per image and class, the detections sorted by score (stable, at most
``max_detections``) one after the other: each takes the still unmatched ground-truth box of its cell with the
highest IoU at least ``t`` (``min(t, 1 − 1e-10)``; among equal IoUs the later box), separately for every
threshold ``t``. The loop below runs once per detection *rank* over every cell that has a detection of that
rank, so its cost is the batch's detections × objects per cell × thresholds, not a padded block per rank:

* cells are keyed ``image · 2³² + label`` (one int64 key: two sorts, no ``unique``); each detection finds its
  cell's objects by ``searchsorted`` in the objects' sorted keys, and detections of a cell without objects are
  never matched (no work);
* the cells that have both are ordered by their detection count, descending, so the detections of rank ``r``
  are the first ``n_r`` cells — one contiguous slice of the detections laid out by (rank, cell), no mask;
* a cell's objects are padded in *reverse* annotation order, so ``max``'s first maximum is pycocotools' last
  of equal IoUs;
* the IoU of one rank's detections with their cells' objects is computed in the step
  (:func:`~pytest_dnnsafety.data.boxes.paired_iou`, the same bits as everywhere), never a detections × objects
  block; a batch whose padded cells × objects × thresholds exceed :data:`MATCH_CHUNK_ELEMENTS` is matched in
  spans of consecutive cells (:func:`cell_spans`).

With ``ranges`` (COCO's crowd regions and area ranges) the same loop runs over range × threshold columns and takes,
per step, the best free regular object, else the best free ignore object (:func:`_greedy_ignore`).

A few small host reads per batch size the loop (the active detections, the number of cells, the histogram of
detections per cell and the largest cell's object count; the histogram again per span of a crowded batch). Pure torch, device-agnostic, no pytest import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.data import tasks
from pytest_dnnsafety.data.tasks import BoxSet

__all__ = ["MATCH_CHUNK_ELEMENTS", "cell_spans", "match_batch"]

#: Padded cells × objects × thresholds of one span of the matching: 64 MiB of float64 per step.
MATCH_CHUNK_ELEMENTS = 1 << 23
_SHIFT = 1 << 32  # cell key: image · 2³² + (label + 2³¹); labels in [−2³¹, 2³¹)
_OFFSET = 1 << 31


def _stable_order(key: Tensor) -> Tensor:
    return torch.sort(key, stable=True).indices


def cell_spans(d_count: list[int], g_count: list[int], width: int,
               limit: int = MATCH_CHUNK_ELEMENTS) -> list[tuple[int, int, int, int]]:
    """Consecutive cells ``(c0, c1, ranks, objects)`` whose padded step ``(c1 - c0) × objects × width`` stays within
    ``limit`` (a cell larger than that alone is a span of its own): a huge cell is matched without padding every
    other cell of the batch to its size."""
    spans, c0, sd, sg = [], 0, 0, 0
    for c, (nd, ng) in enumerate(zip(d_count, g_count)):
        wider = max(sg, ng)
        if c > c0 and (c - c0 + 1) * wider * width > limit:
            spans.append((c0, c, sd, sg))
            c0, sd, sg = c, nd, ng
        else:
            sd, sg = max(sd, nd), wider
    spans.append((c0, len(g_count), sd, sg))
    return spans


def match_batch(dets: BoxSet, gts: BoxSet, thr: Tensor, max_det: int,
                limit: int = MATCH_CHUNK_ELEMENTS, ranges: Tensor | None = None) -> tuple[Tensor, ...]:
    """The detections kept (at most ``max_det`` per cell) in (image, class, score descending) order — score (float64),
    label, image — and their ``(D, T)`` matched bits (see the module docstring).

    With ``ranges`` (``(A, 2)`` float64 area ranges ``[lo, hi]``), COCO's ignore rules too: crowd objects
    (``gts.crowd``) and objects whose area (``gts.area``, else the box's) lies outside a range are "ignore" objects
    of that range; a detection takes a regular object when one is free at ``t``, else the best ignore object (a
    crowd region, overlap = intersection / the detection's area, may take any number of detections) and is then
    ignored; an unmatched detection whose own area lies outside the range is ignored too. Returns matched and
    ignored bits ``(D, A, T)`` after the score, label and image."""
    if ranges is not None:
        return _match_ranges(dets, gts, thr, max_det, limit, ranges)
    dev, T = gts.device, thr.numel()
    score = dets.scores.to(torch.float64)
    d_key = dets.image * _SHIFT + (dets.labels + _OFFSET)
    order = _stable_order(-score)  # score descending, ties in the model's order
    order = order[_stable_order(d_key[order])]  # (cell, -score)
    d_key, score = d_key[order], score[order]
    d_img, d_lab, d_box = dets.image[order], dets.labels[order], dets.boxes[order]
    D = d_key.numel()
    d_rank = torch.arange(D, device=dev) - torch.searchsorted(d_key, d_key)  # rank within the cell
    if D and max_det < D:
        kept = d_rank < max_det
        d_key, score, d_img, d_lab, d_box, d_rank = (t[kept] for t in (d_key, score, d_img, d_lab, d_box, d_rank))
    matched = torch.zeros(d_key.numel(), T, dtype=torch.bool, device=dev)
    if d_key.numel() == 0 or len(gts) == 0:
        return score, d_lab, d_img, matched
    g_key = gts.image * _SHIFT + (gts.labels + _OFFSET)
    g_order = _stable_order(g_key)  # (cell), annotation order within
    g_key, g_box = g_key[g_order], gts.boxes[g_order]
    g_lo = torch.searchsorted(g_key, d_key)
    g_n = torch.searchsorted(g_key, d_key, right=True) - g_lo
    act = torch.nonzero(g_n > 0).squeeze(1)  # detections of cells with objects (ranks 0.. of each, contiguous)
    a_rank, a_lo, a_n = d_rank[act], g_lo[act], g_n[act]
    a_cell = torch.cumsum((a_rank == 0).to(torch.int64), 0) - 1  # active cells numbered in key order
    eff = thr.to(dev, torch.float64).clamp_max(1 - 1e-10)  # pycocotools: min(t, 1 - 1e-10)
    width = max(T, 4)
    # one read: the number of active cells and the largest cell's objects (whether the batch fits one span)
    C, pg = (int(v) for v in torch.stack([(a_rank == 0).sum(), torch.cat([a_n, a_n.new_zeros(1)]).amax()]).tolist())
    if C == 0:
        return score, d_lab, d_img, matched
    if C * pg * width <= limit:
        hits = _greedy(d_box[act], a_rank, a_cell, a_lo, a_n, g_box, eff, max_det)
    else:  # a crowded batch: spans of consecutive cells, each padded to its own largest cell
        first = torch.nonzero(a_rank == 0).squeeze(1)
        counts = torch.bincount(a_cell, minlength=C).tolist()
        spans = cell_spans(counts, a_n[first].tolist(), width, limit)
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        hits = torch.zeros(act.numel(), T, dtype=torch.bool, device=dev)
        for c0, c1, _, _ in spans:
            r0, r1 = starts[c0], starts[c1]
            hits[r0:r1] = _greedy(d_box[act[r0:r1]], a_rank[r0:r1], a_cell[r0:r1] - c0, a_lo[r0:r1], a_n[r0:r1],
                                  g_box, eff, max_det)
    matched[act] = hits
    return score, d_lab, d_img, matched


def _greedy(d_box: Tensor, rank: Tensor, cell: Tensor, g_lo: Tensor, g_n: Tensor, g_box: Tensor, eff: Tensor,
            max_det: int, g_ig: Tensor | None = None, g_crowd: Tensor | None = None) -> Any:
    """Matched bits ``(n, T)`` of ``n`` detections of cells ``0 .. C − 1`` that all hold objects (rows in cell
    order, ranks ``0 ..`` within each), their cells' objects rows ``g_lo .. g_lo + g_n`` of ``g_box``.

    With ``g_ig`` (``(G, A)``: object ignored in area range ``a``) and ``g_crowd`` (``(G,)``): COCO's ignore rules
    over ``A × T`` columns (range-major); returns the matched and the ignored bits, each ``(n, A·T)``."""
    dev, T, n = d_box.device, eff.numel(), rank.numel()
    nd = torch.bincount(cell)  # detections per cell
    C = nd.numel()
    hist = torch.bincount(nd, minlength=max_det + 1)[: max_det + 1]  # cells with exactly k detections
    first = torch.searchsorted(cell, torch.arange(C, device=dev))  # each cell's first detection
    sizes = g_n[first]
    stats = torch.cat([hist, torch.cat([sizes, sizes.new_zeros(1)]).amax().reshape(1)]).tolist()  # the one read
    hist, pg = stats[:-1], stats[-1]
    pos = torch.empty(C, dtype=torch.int64, device=dev)
    pos[_stable_order(-nd)] = torch.arange(C, device=dev)  # cells by detection count, descending
    d_pos = pos[cell]
    layout = _stable_order(rank * C + d_pos)  # (rank, cell position): rank r is the first n_r positions
    boxes = d_box[layout].to(torch.float64)
    slots = torch.arange(pg, device=dev)
    lo, cnt = g_lo[first][_stable_order(-nd)], sizes[_stable_order(-nd)]
    g_idx = lo[:, None] + cnt[:, None] - 1 - slots  # objects in reverse order: max's first is the later box
    valid = slots < cnt[:, None]  # (C, pg)
    g_cells = g_box[g_idx.clamp_min(0).clamp_max(g_box.shape[0] - 1)].to(torch.float64)  # (C, pg, 4)
    none = torch.tensor(-2.0, dtype=torch.float64, device=dev)
    if g_ig is not None and g_crowd is not None:
        return _greedy_ignore(boxes, layout, hist, g_idx.clamp_min(0).clamp_max(g_box.shape[0] - 1), valid, g_cells,
                              eff, g_ig, g_crowd, n, none)
    taken = torch.zeros(C, T, pg, dtype=torch.bool, device=dev)
    out = torch.zeros(n, T, dtype=torch.bool, device=dev)
    eff3 = eff[None, :, None]
    done = 0  # cells with at most r detections
    off = 0
    for r in range(len(hist)):
        done += hist[r]
        k = C - done  # cells with a detection of rank r: the first k positions
        if k <= 0:
            break
        iou = tasks.paired_iou(boxes[off:off + k, None, :], g_cells[:k])  # (k, pg)
        iou = torch.where(valid[:k], iou, -1.0)[:, None, :]  # (k, 1, pg)
        ok = (iou >= eff3) & ~taken[:k]
        best, pick = torch.where(ok, iou, none).max(-1)  # (k, T): the first maximum = the later of equal IoUs
        hit = best > -1.0
        taken[:k] |= (slots == pick[..., None]) & hit[..., None]
        out[off:off + k] = hit
        off += k
    res = torch.empty_like(out)
    res[layout] = out
    return res


def _greedy_ignore(boxes: Tensor, layout: Tensor, hist: list[int], g_at: Tensor, valid: Tensor, g_cells: Tensor,
                   eff: Tensor, g_ig: Tensor, g_crowd: Tensor, n: int, none: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`_greedy`'s loop with COCO's ignore objects, every area range and threshold at once (``W = A·T``
    columns): per step the best free regular object, else the best free ignore object (crowd ones are never used
    up), the later of equal IoUs in each (objects padded in reverse order: ``max``'s first maximum).

    One exact ``max`` picks both: an IoU in ``[0, 1]`` read as the int64 of its float64 bits keeps its order, and a
    regular object's key adds ``2⁶²`` (above every such bit pattern), so any regular candidate beats every ignore
    one and equal IoUs stay equal."""
    dev = boxes.device
    C, pg = valid.shape
    A, T = g_ig.shape[1], eff.numel()
    W = A * T
    crowd = g_crowd[g_at] & valid  # (C, pg)
    some_crowd = bool(crowd.any())  # one read: the crowd overlap only where there are crowd regions
    ig = g_ig[g_at].permute(0, 2, 1)[:, :, None, :].expand(C, A, T, pg).reshape(C, W, pg)  # (C, W, pg)
    bonus = (~ig).to(torch.int64) << 62  # regular objects first
    stays = crowd[:, None, :]  # a crowd region stays free once taken
    free = valid[:, None, :].expand(C, W, pg).clone()  # padding is never a candidate
    eff3 = eff.repeat(A)[None, :, None]
    slots = torch.arange(pg, device=dev)
    hit_reg = torch.zeros(n, W, dtype=torch.bool, device=dev)
    hit_ign = torch.zeros(n, W, dtype=torch.bool, device=dev)
    regular = 1 << 62
    done = off = 0
    for r in range(len(hist)):
        done += hist[r]
        k = C - done
        if k <= 0:
            break
        iou = tasks.paired_iou(boxes[off:off + k, None, :], g_cells[:k], crowd[:k] if some_crowd else None)
        ok = (iou[:, None, :] >= eff3) & free[:k]  # (k, W, pg)
        best, pick = torch.where(ok, iou.view(torch.int64)[:, None, :] + bonus[:k], -1).max(-1)  # (k, W)
        hit = best >= 0
        reg = best >= regular
        free[:k] &= ~((slots == pick[..., None]) & hit[..., None]) | stays[:k]
        hit_reg[off:off + k], hit_ign[off:off + k] = reg, hit & ~reg
        off += k
    out_reg, out_ign = torch.empty_like(hit_reg), torch.empty_like(hit_ign)
    out_reg[layout], out_ign[layout] = hit_reg, hit_ign
    return out_reg, out_ign


def _match_ranges(dets: BoxSet, gts: BoxSet, thr: Tensor, max_det: int, limit: int,
                  ranges: Tensor) -> tuple[Tensor, ...]:
    """:func:`match_batch` with COCO's crowd and area-range ignore rules (see there)."""
    dev, T, A = gts.device, thr.numel(), int(ranges.shape[0])
    score = dets.scores.to(torch.float64)
    d_key = dets.image * _SHIFT + (dets.labels + _OFFSET)
    order = _stable_order(-score)
    order = order[_stable_order(d_key[order])]
    d_key, score = d_key[order], score[order]
    d_img, d_lab, d_box = dets.image[order], dets.labels[order], dets.boxes[order]
    d_rank = torch.arange(d_key.numel(), device=dev) - torch.searchsorted(d_key, d_key)
    if d_key.numel() and max_det < d_key.numel():
        kept = d_rank < max_det
        d_key, score, d_img, d_lab, d_box, d_rank = (t[kept] for t in (d_key, score, d_img, d_lab, d_box, d_rank))
    D = d_key.numel()
    lo, hi = ranges[:, 0].to(dev, torch.float64), ranges[:, 1].to(dev, torch.float64)
    b = d_box.to(torch.float64)
    d_area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    outside = (d_area[:, None] < lo) | (d_area[:, None] > hi)  # (D, A): an unmatched detection there is ignored
    matched = torch.zeros(D, A * T, dtype=torch.bool, device=dev)
    ignored = torch.zeros(D, A * T, dtype=torch.bool, device=dev)
    if D and len(gts):
        g_key = gts.image * _SHIFT + (gts.labels + _OFFSET)
        g_order = _stable_order(g_key)
        g_key, g_box = g_key[g_order], gts.boxes[g_order]
        crowd = (gts.crowd if gts.crowd is not None else torch.zeros(len(gts), dtype=torch.bool, device=dev))[g_order]
        area = gts.box_area()[g_order]
        g_ig = crowd[:, None] | (area[:, None] < lo) | (area[:, None] > hi)  # (G, A)
        g_lo = torch.searchsorted(g_key, d_key)
        g_n = torch.searchsorted(g_key, d_key, right=True) - g_lo
        act = torch.nonzero(g_n > 0).squeeze(1)
        a_rank, a_lo, a_n = d_rank[act], g_lo[act], g_n[act]
        a_cell = torch.cumsum((a_rank == 0).to(torch.int64), 0) - 1
        eff = thr.to(dev, torch.float64).clamp_max(1 - 1e-10)
        width = max(A * T, 4)
        C, pg = (int(v) for v in torch.stack([(a_rank == 0).sum(), torch.cat([a_n, a_n.new_zeros(1)]).amax()]).tolist())
        if C:
            first = torch.nonzero(a_rank == 0).squeeze(1)
            counts = torch.bincount(a_cell, minlength=C).tolist() if C * pg * width > limit else [0] * C
            spans = cell_spans(counts, a_n[first].tolist(), width, limit) if C * pg * width > limit \
                else [(0, C, 0, 0)]
            starts = [0]
            for c in counts:
                starts.append(starts[-1] + c)
            for c0, c1, _, _ in spans:
                r0, r1 = (starts[c0], starts[c1]) if len(spans) > 1 else (0, act.numel())
                reg, ign = _greedy(d_box[act[r0:r1]], a_rank[r0:r1], a_cell[r0:r1] - c0, a_lo[r0:r1], a_n[r0:r1],
                                   g_box, eff, max_det, g_ig, crowd)
                matched[act[r0:r1]], ignored[act[r0:r1]] = reg, ign
    matched, ignored = matched.reshape(D, A, T), ignored.reshape(D, A, T)
    ignored |= ~matched & ~ignored & outside[:, :, None]
    return score, d_lab, d_img, matched, ignored
