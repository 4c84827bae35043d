"""Cells of the reliability assessment: cell types, the grid, r̂ (r-separation), ball-cell distances.

Part of :mod:`pytest_dnnsafety.engines.reliability` (Zhao et al. 2021, §3.2, Remark 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.engines.reliability.profile import as_tensor_2d

#: Cell type codes (index into :data:`CELL_TYPES`).
NORMAL, EMPTY, CROSS = 0, 1, 2
CELL_TYPES: tuple[str, ...] = ("normal", "empty", "cross-boundary")

#: Largest grid whose cell masses are all held at once (float64: 128 MiB); bigger grids need
#: ``max_cells`` and are scanned in chunks keeping the top ``max_cells``.
MAX_GRID_CELLS = 1 << 24

#: Largest grid that is scanned at all (in chunks, keeping the top ``max_cells``).
MAX_SCAN_CELLS = 1 << 30

_CHUNK_ELEMS = 1 << 22


class ReliabilityWarning(UserWarning):
    """A reliability assessment ran with a setting its assumptions advise against (e.g. ``ε ≥ r̂``)."""


# ====================================================================== grid
def _float_tuple(value: Any, dim: int | None, what: str) -> tuple[float, ...]:
    try:
        arr = np.asarray(value.detach().cpu() if isinstance(value, Tensor) else value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a number or a sequence of numbers, got {value!r}") from None
    if dim is not None:
        if arr.size == 1:
            arr = np.repeat(arr, dim)
        if arr.size != dim:
            raise ConfigError(f"{what} must have one entry per dimension ({dim}), got {arr.size}")
    if not np.all(np.isfinite(arr)):
        raise ConfigError(f"{what} must be finite, got {arr.tolist()}")
    return tuple(float(v) for v in arr)


@dataclass(frozen=True)
class Grid:
    """Axis-aligned grid of cells of side ``eps`` over the box ``[lower, upper]``.

    Cells are indexed row-major (the last dimension fastest). When a width is not a multiple of
    ``eps`` the last cell of that dimension is clipped to the box, so the cells tile the box
    exactly.
    """

    lower: tuple[float, ...]
    upper: tuple[float, ...]
    eps: tuple[float, ...]
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        shape = []
        for lo, hi, e in zip(self.lower, self.upper, self.eps):
            ratio = (hi - lo) / e
            shape.append(max(1, math.ceil(ratio - 1e-9 * max(1.0, ratio))))
        object.__setattr__(self, "shape", tuple(shape))

    @classmethod
    def build(cls, lower: Any, upper: Any, eps: Any) -> Grid:
        """Validated construction: ``lower < upper`` and ``0 < eps ≤ upper − lower`` in every dimension."""
        lo = _float_tuple(lower, None, "box lower corner")
        hi = _float_tuple(upper, len(lo), "box upper corner")
        e = _float_tuple(eps, len(lo), "eps")
        for k, (a, b, s) in enumerate(zip(lo, hi, e)):
            if not a < b:
                raise ConfigError(f"box: lower {a} must be below upper {b} in dimension {k}")
            if s <= 0:
                raise ConfigError(f"eps must be > 0, got {s} in dimension {k}")
            if s > (b - a) * (1 + 1e-12):
                raise ConfigError(
                    f"eps={s:g} is larger than the box in dimension {k} (width {b - a:g}). Fix: choose eps ≤ "
                    f"{b - a:g}, e.g. eps='auto' (a fraction of r̂), or widen the box"
                )
        return cls(lo, hi, e)

    @property
    def dim(self) -> int:
        return len(self.lower)

    @property
    def n_cells(self) -> int:
        return math.prod(self.shape)

    def edges(self, k: int, device: torch.device | str | None = None) -> Tensor:
        """Cell edges of dimension ``k`` (``shape[k] + 1`` values, the last clipped to the box)."""
        n = self.shape[k]
        e = self.lower[k] + torch.arange(n + 1, dtype=torch.float64, device=device) * self.eps[k]
        e[-1] = self.upper[k]
        return e.clamp_max(self.upper[k])

    def unravel(self, flat: Tensor) -> Tensor:
        """Flat indices ``(C,)`` → multi-indices ``(C, d)``."""
        idx = torch.empty(flat.shape[0], self.dim, dtype=torch.int64, device=flat.device)
        rem = flat.to(torch.int64)
        for k in range(self.dim - 1, -1, -1):
            idx[:, k] = rem % self.shape[k]
            rem = rem // self.shape[k]
        return idx

    def bounds(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """Lower and upper corners ``(C, d)`` (float64) of the cells ``flat``."""
        idx = self.unravel(flat).to(torch.float64)
        lo_t = torch.tensor(self.lower, dtype=torch.float64, device=flat.device)
        hi_t = torch.tensor(self.upper, dtype=torch.float64, device=flat.device)
        eps_t = torch.tensor(self.eps, dtype=torch.float64, device=flat.device)
        lo = lo_t + idx * eps_t
        hi = torch.minimum(lo + eps_t, hi_t)
        last = self.unravel(flat) == torch.tensor(self.shape, device=flat.device) - 1
        hi = torch.where(last, hi_t.expand_as(hi), hi)
        return lo, hi

    def centres(self, flat: Tensor) -> Tensor:
        lo, hi = self.bounds(flat)
        return (lo + hi) / 2

    def locate(self, points: Tensor) -> Tensor:
        """Flat index of the cell holding each point ``(M, d)``; ``-1`` for points outside the box."""
        lo_t = torch.tensor(self.lower, dtype=torch.float64, device=points.device)
        hi_t = torch.tensor(self.upper, dtype=torch.float64, device=points.device)
        eps_t = torch.tensor(self.eps, dtype=torch.float64, device=points.device)
        pts = points.to(torch.float64)
        inside = ((pts >= lo_t) & (pts <= hi_t)).all(1)
        idx = torch.floor((pts - lo_t) / eps_t).to(torch.int64)
        shape_t = torch.tensor(self.shape, dtype=torch.int64, device=points.device)
        idx = torch.minimum(idx.clamp_min(0), shape_t - 1)
        flat = torch.zeros(points.shape[0], dtype=torch.int64, device=points.device)
        for k in range(self.dim):
            flat = flat * self.shape[k] + idx[:, k]
        return torch.where(inside, flat, torch.full_like(flat, -1))


# ====================================================================== r-separation
def closest_opposite_pair(x: Any, y: Any, *, device: torch.device | str | None = None,
                          chunk_elems: int = _CHUNK_ELEMS, norm: str = "linf") -> tuple[float, int, int]:
    """``(r̂, i, j)``: half the smallest L∞ (or, with ``norm="l2"``, L2) distance between points of different
    classes, and the pair.

    Exact and vectorised: for each class ``c`` its points are compared with the points of the
    classes after ``c`` in row chunks (``O(N²)`` work in total, ``chunk_elems`` distances at a
    time). Returns ``(inf, -1, -1)`` when fewer than two classes are present.
    """
    norm = _check_norm(norm)
    pts = as_tensor_2d(x, "labelled points", device=None if device is None else torch.device(device), flatten=True)
    labels = torch.as_tensor(y.detach() if isinstance(y, Tensor) else np.asarray(y)).reshape(-1).to(pts.device)
    if labels.shape[0] != pts.shape[0]:
        raise DataError(f"labelled points: {pts.shape[0]} inputs but {labels.shape[0]} labels")
    classes = torch.unique(labels)
    best, bi, bj = math.inf, -1, -1
    if classes.numel() < 2:
        return best, bi, bj
    order = torch.argsort(labels, stable=True)
    sorted_labels = labels[order]
    for c in classes[:-1].tolist():
        rows = order[sorted_labels == c]
        cols = order[sorted_labels > c]
        xc = pts[cols]
        chunk = max(1, chunk_elems // max(1, cols.numel()))
        for start in range(0, rows.numel(), chunk):
            r = rows[start : start + chunk]
            if norm == "l2" or pts.shape[1] > 8:  # exact either way; cdist is much faster in many dimensions
                dist = _ball_distances(pts[r], xc, norm)
            else:
                dist = (pts[r, None, 0] - xc[None, :, 0]).abs()
                for k in range(1, pts.shape[1]):
                    dist = torch.maximum(dist, (pts[r, None, k] - xc[None, :, k]).abs())
            flat = int(torch.argmin(dist))
            value = float(dist.reshape(-1)[flat])
            if value < best:
                best, bi, bj = value, int(r[flat // xc.shape[0]]), int(cols[flat % xc.shape[0]])
    return best / 2.0, bi, bj


def r_separation(x: Any, y: Any, *, device: torch.device | str | None = None, norm: str = "linf") -> float:
    """``r̂`` — half the smallest L∞ (or L2) distance between two labelled points of different classes (Remark 2).

    ``inf`` when all labels are equal.
    """
    return closest_opposite_pair(x, y, device=device, norm=norm)[0]


#: Norms of ball cells (``cells="balls"``) and how reports write them.
NORMS: dict[str, str] = {"linf": "L∞", "l2": "L2"}


def _check_norm(norm: Any) -> str:
    if norm not in NORMS:
        raise ConfigError(f"norm must be one of {list(NORMS)} (L∞ or Euclidean balls), got {norm!r}")
    return str(norm)


def _ball_distances(centres: Tensor, points: Tensor, norm: str) -> Tensor:
    """Exact distances ``(c, L)`` between ``centres`` ``(c, d)`` and ``points`` ``(L, d)`` under ``norm``."""
    if norm == "l2":
        return torch.cdist(centres, points, p=2.0, compute_mode="donot_use_mm_for_euclid_dist")
    return torch.cdist(centres, points, p=math.inf)


def nearest_labels(points: Tensor, lab_points: Tensor, lab_labels: Tensor, *,
                   chunk_elems: int = _CHUNK_ELEMS) -> Tensor:
    """Label of the nearest labelled point (Euclidean; ties → the first) for each of ``points`` ``(C, d)``.

    ``empty_cell_label="nearest"``: an empty cell's (ball's) label is that of the labelled point
    nearest to its centre, instead of the model's own vote (Assumption 5). Batched: one matrix
    product ``‖b‖² − 2a·b`` per row chunk of at most ``chunk_elems`` distances, then ``argmin``;
    no Python loop over points.
    """
    out = torch.empty(points.shape[0], dtype=torch.int64, device=lab_labels.device)
    if points.shape[0] == 0:
        return out
    # argmin_j ‖a − b_j‖² = argmin_j (‖b_j‖² − 2 a·b_j): one addmm per chunk; float32 after centring
    # on the labelled points' mean (only near-ties, equally justified labels, can flip)
    centre = lab_points.to(points.device, torch.float64).mean(0, keepdim=True)
    lab = (lab_points.to(points.device, torch.float64) - centre).to(torch.float32)
    lab_t = lab.T.contiguous()
    lab_sq = (lab * lab).sum(1)
    labels = lab_labels.to(points.device)
    chunk = max(1, chunk_elems // max(1, lab.shape[0]))
    for start in range(0, points.shape[0], chunk):
        block = (points[start : start + chunk].to(torch.float64) - centre).to(torch.float32)
        nearest = torch.addmm(lab_sq, block, lab_t, alpha=-2.0).argmin(1)
        out[start : start + chunk] = labels[nearest].to(out.device)
    return out


def ball_types(present: Tensor) -> tuple[Tensor, Tensor]:
    """Types and labels of balls from the classes present in each ``(c, K)`` (bool): one class — normal, its
    label; several — cross-boundary; none — empty (label -1, voted or nearest later)."""
    distinct = present.sum(1)
    types = torch.where(distinct > 1, CROSS, torch.where(distinct == 1, NORMAL, EMPTY))
    return types, torch.where(distinct == 1, present.to(torch.int8).argmax(1), -1)
