"""Reliability assessment engine — pmi and its upper bound (Zhao et al. 2021, eqs. 1–14, Table 1).

The pmi of eq. (1) is assembled from cells of the input (or latent) space, eq. (4)::

    λ = Σ_i Op_i · λ_i

* **Cells** — a grid of side ``ε`` over a box (low-dimensional inputs, or the latent space of a
  user encoder/decoder). ``r̂`` — half the smallest L∞ distance between labelled points of
  different classes (Remark 2, Assumption 2; :func:`r_separation`) — is reported, and ``ε ≥ r̂``
  raises a :class:`ReliabilityWarning` (and sets ``eps_exceeds_r``). ``eps="auto"`` takes the
  largest even split of the box with side strictly below ``eps_fraction · r̂`` (the paper's
  running example: ``r̂ = 0.004013`` → 250 × 250 cells of side 0.004).
* **Ball cells** (``cells="balls"``; METRICS.md §8 "or are norm balls around operational
  inputs", the paper's cells-as-norm-balls idea for high-dimensional inputs such as images,
  where no grid is possible): each operational input ``x_j`` (input space, flattened) is the
  centre of one cell ``B(x_j, ε)`` under ``norm`` (L∞ or L2). Op_j = 1/M (the empirical
  profile); cell types from the labelled points inside each closed ball, exactly as for grid
  cells. See :func:`assess_reliability` for the details.
* **Op_i** — KDE masses (:class:`~pytest_dnnsafety.profile.OperationalProfile`): the paper's
  centre approximation (eq. 9) or the exact box integral, normalised over the box, with a
  bootstrap variance over ``B`` refits (eq. 11, Appendix A).
* **Cell types** (§3.2): *normal* — labelled points inside agree, the cell's ground truth is
  their label (Assumption 4); *empty* — no labelled point, the label is the majority vote of the
  model on the cell's samples (Assumption 5; ties go to the lowest class); *cross-boundary* —
  labels disagree, ``λ_i = 1`` with no variance and no sampling.
* **λ_i** — Monte Carlo (eqs. 13–14): ``n_i`` inputs uniform in the cell (Assumption 6; decoded
  to input space when the cells are latent), ``λ̂_i = k_i/n_i``. Failure is any
  misclassification, or only a user-given set of critical confusions ``(true, predicted)``.
  Samples of many cells share one model batch; the stream of ``(cell, sample)`` pairs is cut
  into fixed blocks of :data:`BLOCK` samples, each with its own seeded generator, so results do
  not depend on the batch size or on how blocks are split over workers.
  Caveat: an empty cell's label is voted on its own samples, so its failure count is the
  minority count — biased low when the cell's unastuteness nears ½. The bounds hold for the
  labels as voted (Assumption 5), not for an unknown ground truth.
* **Many cells** — cells are taken by descending OP mass up to ``mass_target`` and/or a budget
  of ``max_cells``; the unevaluated mass counts with ``λ = 1`` (``conservative_rest=True``) or,
  when the user asks otherwise, with the evaluated cells' average pmi (the paper's "empirical /
  average bound based on the first k cells"); the result says which.
* **Checks against the labelled data** (beyond the paper): (a) the model's error on the
  labelled points (by default a sample of the profile) must not have a Clopper–Pearson lower
  bound above ``Ub``; (b) the model's vote (Assumption 5) is tested on the cells whose labels are
  known. A failed check is a *contradiction* in the result; ``ε``/radius ``≥ r̂``, cross-boundary
  cells and labelled points outside the box are *violated assumptions* (the gate is
  inconclusive unless told to accept them). ``empty_cell_label="nearest"`` labels empty cells
  from the nearest labelled point instead of the model's vote.
* **Aggregation** (:mod:`pytest_dnnsafety.stats`): ``"normal"`` (eqs. 5–7, the paper's),
  ``"chernoff"`` (sound for any number of zero-failure cells; default), ``"clopper-pearson"``
  (sound, Bonferroni over cells) and ``"jeffreys"`` (Bayesian Monte Carlo).

Measured on 2 shared CPU cores (``tests/benchmarks/test_bench_reliability.py``; best of
interleaved runs): the paper's 250 × 250 grid with a 2→32→32→2 MLP and 100 bootstrap refits
takes about 1 s at 100 samples per cell, 5 s at 1,000 and 45 s at 10,000 (6.25·10⁸ model
queries; the paper's prototype needs about 16 minutes). A per-cell loop in torch (one model call
per cell) is 3–8× slower at 100 samples per cell and 2–2.5× slower at 1,000; at 10,000 its single
calls are already large, cache-friendly batches and it is about 1.2–1.4× *faster* than the engine
on a CPU (the engine's per-sample bookkeeping: cell indices, histograms). Accelerators, where a
per-cell call is dominated by launch latency, were not measured.

The engine half follows :class:`~pytest_dnnsafety.engines.base.Engine`: :class:`CellTallyEngine`
holds one state — per-cell prediction histograms, reduce ``sum`` — so cells (or blocks of
samples) can be split over pytest-xdist workers or ``torch.distributed`` ranks and merged;
labels of empty cells and failure counts are derived from the merged histograms.

Typical use::

    result = assess_reliability(model, OperationalProfile(x_op), labelled=(x_train, y_train),
                                eps="auto", box=([0, 0], [1, 1]), samples_per_cell=1000)
    assert result.Ub <= 1e-2, result.summary()
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pytest_dnnsafety import stats
from pytest_dnnsafety.engines.base import Engine
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.outputs import ForwardGuard
from pytest_dnnsafety.profile import OperationalProfile, as_tensor_2d

__all__ = [
    "BLOCK",
    "CELL_TYPES",
    "EMPTY",
    "EMPTY_CELL_LABELS",
    "CROSS",
    "NORMAL",
    "MAX_GRID_CELLS",
    "MAX_SCAN_CELLS",
    "AUTO_RADIUS_CAP",
    "NORMS",
    "Grid",
    "CellTallyEngine",
    "CellTable",
    "MethodBound",
    "ReliabilityAssessor",
    "ReliabilityResult",
    "ReliabilityWarning",
    "assess_reliability",
    "closest_opposite_pair",
    "nearest_labels",
    "r_separation",
]

#: How empty cells (no labelled point inside) get their label (``empty_cell_label=``): the model's
#: majority vote on the cell's samples (the paper's Assumption 5) or the label of the nearest
#: labelled point (Euclidean, in the profile's space).
EMPTY_CELL_LABELS: tuple[str, ...] = ("model", "nearest")

#: Cell type codes (index into :data:`CELL_TYPES`).
NORMAL, EMPTY, CROSS = 0, 1, 2
CELL_TYPES: tuple[str, ...] = ("normal", "empty", "cross-boundary")

#: Largest grid whose cell masses are all held at once (float64: 128 MiB); bigger grids need
#: ``max_cells`` and are scanned in chunks keeping the top ``max_cells``.
MAX_GRID_CELLS = 1 << 24

#: Largest grid that is scanned at all (in chunks, keeping the top ``max_cells``).
MAX_SCAN_CELLS = 1 << 30

#: Samples per random block: each block of the (cell, sample) stream has its own generator.
BLOCK = 4096

#: ``radius="auto"`` for ball cells is capped at this fraction of the operational data's diameter
#: under the norm (of the ``clip`` range when given): ``min(eps_fraction · r̂, 0.1 · diameter)``.
AUTO_RADIUS_CAP = 0.1

_MIX = 0x9E3779B97F4A7C15
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

    ``inf`` when all labels are equal. The paper's running example reports ``r̂ = 0.004013``.
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


# ====================================================================== engine
class CellTallyEngine(Engine):
    """Per-cell prediction histograms of the Monte Carlo samples (the λ_i evidence, eqs. 13–14).

    Args:
        n_cells: number of sampled cells (in the assessor's order).
        num_classes: number of classes ``K``.
        device: where the state lives.

    State: ``counts`` (``n_cells × K``, int64, reduce ``sum``): how often the model predicted
    each class on each cell's samples. Labels of empty cells (majority vote) and failure counts
    are derived from it after all partial engines are merged.
    """

    def __init__(self, n_cells: int, num_classes: int, device: torch.device | str | None = None) -> None:
        super().__init__(device)
        if isinstance(n_cells, bool) or not isinstance(n_cells, int) or n_cells < 0:
            raise ConfigError(f"n_cells must be a non-negative int, got {n_cells!r}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ConfigError(f"num_classes must be an int ≥ 2, got {num_classes!r}")
        self.n_cells = n_cells
        self.num_classes = num_classes
        self.add_state("counts", torch.zeros(n_cells, num_classes, dtype=torch.int64), reduce="sum")

    def config(self) -> dict[str, Any]:
        return {"n_cells": self.n_cells, "num_classes": self.num_classes}

    def update(self, cells: Tensor, predictions: Tensor, *, cell_range: tuple[int, int] | None = None) -> None:
        """Count ``predictions`` (``(B,)`` class indices) against ``cells`` (``(B,)`` indices into the sampled cells).

        ``cell_range=(lo, hi)`` promises ``lo ≤ cells < hi``: only that slice of the histogram is
        touched (the assessor's batches cover contiguous cells). No host sync.
        """
        cells = cells.to(self.device, torch.int64)
        lo, hi = (0, self.n_cells) if cell_range is None else cell_range
        self.update_local(cells - lo if lo else cells, predictions, lo, hi)

    def update_local(self, local: Tensor, predictions: Tensor, lo: int, hi: int) -> None:
        """:meth:`update` with cell indices ``local`` relative to ``lo`` (``0 ≤ local < hi − lo``)."""
        k = self.num_classes
        preds = predictions.to(self.device, torch.int64)
        key = local.to(self.device, torch.int64) * k + preds
        if self.device.type == "cpu":
            part = torch.bincount(key, minlength=(hi - lo) * k)
            self.counts[lo:hi] += part.reshape(hi - lo, k)
        else:
            self.counts[lo:hi].view(-1).index_add_(0, key, torch.ones_like(key))

    def compute(self) -> Tensor:
        """The merged histograms (a copy)."""
        return self.counts.clone()


# ====================================================================== results
@dataclass(frozen=True)
class MethodBound:
    """One aggregation method's ``E``, ``Var`` and ``Ub`` at ``confidence``."""

    method: str
    E: float
    Var: float
    Ub: float
    confidence: float

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "E": self.E, "Var": self.Var, "Ub": self.Ub, "confidence": self.confidence}


@dataclass(frozen=True, eq=False)
class CellTable:
    """Per evaluated cell (in descending OP order): grid index, corners, OP mass and variance, type, label, counts.

    ``failures``/``trials`` are 0 for cross-boundary cells (not sampled; ``λ_i = 1``).
    """

    flat: Tensor
    lower: Tensor
    upper: Tensor
    op: Tensor
    op_var: Tensor
    cell_type: Tensor
    label: Tensor
    failures: Tensor
    trials: Tensor

    @property
    def unastuteness(self) -> Tensor:
        """``λ̂_i`` (eq. 13), 1 for cross-boundary cells."""
        lam = self.failures.to(torch.float64) / self.trials.clamp_min(1).to(torch.float64)
        return torch.where(self.cell_type == CROSS, torch.ones_like(lam), lam)


def _num(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class ReliabilityResult:
    """What :func:`assess_reliability` returns: the pmi estimate, its bound and how it was obtained.

    ``E``, ``Var`` and ``Ub`` are the chosen ``method``'s: for ``"normal"``, ``"chernoff"`` and
    ``"clopper-pearson"`` ``E``/``Var`` are the point estimate and eq. (6)'s variance (the bound
    is the method's); for ``"jeffreys"`` the posterior mean and variance. ``alternatives`` holds
    the other methods asked for with ``compare_methods``. ``cells`` has the per-cell evidence.

    Ball cells (``cell_kind == "balls"``, :func:`assess_reliability` with ``cells="balls"``): the
    grid fields say so — ``grid_shape == ()``, ``eps == (radius,)``, ``cells_total`` is the number
    of operational inputs (one possible ball each), ``cells_evaluated`` the number of balls,
    ``mass_evaluated == 1`` (the balls carry the whole empirical profile), ``bandwidth`` is
    ``None`` (no KDE); ``norm`` (``"linf"``/``"l2"``) and ``clip`` describe the balls. The cell
    table's ``flat`` holds each ball's centre index into the operational data and
    ``lower``/``upper`` its bounding box (clipped; for L∞ balls the ball itself).
    """

    E: float
    Var: float
    Ub: float
    confidence: float
    method: str
    r_hat: float
    eps: tuple[float, ...]
    eps_exceeds_r: bool
    grid_shape: tuple[int, ...]
    cells_total: int
    cells_evaluated: int
    cells_normal: int
    cells_empty: int
    cells_cross: int
    mass_evaluated: float
    mass_rest: float
    conservative_rest: bool
    mass_method: str
    bootstrap: int
    bandwidth: tuple[float, ...] | None
    samples_per_cell: int
    allocation: str
    acu: float
    model_queries: int
    seconds: float
    failure_set: tuple[tuple[int, int], ...] | None = None
    latent: bool = False
    labelled_outside_box: int = 0
    alternatives: Mapping[str, MethodBound] = field(default_factory=dict)
    cell_kind: str = "grid"
    norm: str | None = None
    clip: tuple[float, float] | None = None
    empty_cell_label: str = "model"
    labelled_from_profile: bool = True
    labelled_queries: int = 0
    violations: tuple[str, ...] = ()
    violations_accepted: bool = False
    contradictions: tuple[str, ...] = ()
    labelled_check: Mapping[str, Any] | None = None
    vote_check: Mapping[str, Any] | None = None
    cells: CellTable | None = field(default=None, repr=False, compare=False)

    @property
    def std(self) -> float:
        """``√Var`` (the paper's Table 1 column "V")."""
        return math.sqrt(max(self.Var, 0.0))

    @property
    def balls(self) -> bool:
        """Whether the cells are norm balls around operational inputs (``cells="balls"``)."""
        return self.cell_kind == "balls"

    def _ball_words(self) -> str:
        """E.g. ``"balls 270 (L∞ radius 0.05)"`` (with the population when subsampled, and the clip range)."""
        of = "" if self.cells_evaluated == self.cells_total else f" of {self.cells_total} operational inputs"
        clip = "" if self.clip is None else f", clipped to [{self.clip[0]:g}, {self.clip[1]:g}]"
        return (f"balls {self.cells_evaluated}{of} ({NORMS.get(self.norm or '', self.norm)} radius "
                f"{self.eps[0]:.6g}{clip})")

    @property
    def empty_label_words(self) -> str:
        """How empty cells got their labels, in words."""
        return ("the model's majority vote (Assumption 5)" if self.empty_cell_label == "model"
                else "the nearest labelled point")

    def checks_summary(self) -> list[str]:
        """Lines on the labelled-data checks, violated assumptions and contradictions (for :meth:`summary`)."""
        lines = [f"  empty {'balls' if self.balls else 'cells'} labelled by {self.empty_label_words}"]
        lc = self.labelled_check
        if lc is not None:
            state = ("checked" if lc.get("applied") else
                     "not checked (labelled_from_profile=False: not a sample of the profile)")
            lines.append(f"  labelled points: {lc['errors']:,} of {lc['n']:,} misclassified (error ≥ {lc['lower']:.4g} "
                         f"at {lc['confidence'] * 100:g}%), against Ub {lc['bound']:.4g}: {state}")
        vc = self.vote_check
        if vc is not None:
            lines.append(f"  Assumption 5 where labels are known: the model's vote disagrees in {vc['vote_disagrees']:,} "
                         f"of {vc['cells_with_labels']:,} labelled {'balls' if self.balls else 'cells'}")
        for v in self.violations:
            lines.append(f"  VIOLATED ASSUMPTION{' (accepted by the user)' if self.violations_accepted else ''}: {v}")
        for c in self.contradictions:
            lines.append(f"  CONTRADICTION: {c}")
        return lines

    def detail(self) -> str:
        """One line: the bound, r̂ and ε, cells by type, OP mass evaluated, queries and time."""
        r = "n/a" if not math.isfinite(self.r_hat) else f"{self.r_hat:.6g}"
        types = f"(normal {self.cells_normal}, empty {self.cells_empty}, cross {self.cells_cross})"
        if self.balls:
            warn = " (radius ≥ r̂!)" if self.eps_exceeds_r else ""
            return (
                f"pmi E={self.E:.4e} Ub{self.confidence * 100:g}%={self.Ub:.4e} [{self.method}]; "
                f"r̂={r}{warn}; {self._ball_words()} {types}, empirical OP 1/{self.cells_evaluated} each; "
                f"empty balls labelled by {self.empty_label_words}; "
                f"{self.model_queries:,} model queries in {self.seconds:.1f} s"
            )
        eps = f"{self.eps[0]:.6g}" if len(set(self.eps)) == 1 else "(" + ", ".join(f"{e:.4g}" for e in self.eps) + ")"
        warn = " (ε ≥ r̂!)" if self.eps_exceeds_r else ""
        return (
            f"pmi E={self.E:.4e} Ub{self.confidence * 100:g}%={self.Ub:.4e} [{self.method}]; "
            f"r̂={r} ε={eps}{warn}; cells {self.cells_evaluated}/{self.cells_total} "
            f"{types}; "
            f"OP mass evaluated {self.mass_evaluated:.4f}"
            f"{' (rest λ=1)' if self.conservative_rest else ' (rest at average pmi)'}; "
            f"empty cells labelled by {self.empty_label_words}; "
            f"{self.model_queries:,} model queries in {self.seconds:.1f} s"
        )

    def summary(self) -> str:
        """A multi-line report (the paper's Table 1 columns and the settings)."""
        lines = [
            f"reliability assessment ({self.method}, confidence {self.confidence:g})",
            f"  E[λ] = {self.E:.6g}   sd = {self.std:.6g}   Ub = {self.Ub:.6g}   ACU = {self.acu:.6g}",
        ]
        for name, alt in self.alternatives.items():
            lines.append(f"  {name:>16}: E = {alt.E:.6g}   Ub = {alt.Ub:.6g}")
        r = "n/a (fewer than two labelled classes)" if not math.isfinite(self.r_hat) else f"{self.r_hat:.6g}"
        if self.balls:
            lines += [
                f"  r̂ = {r} ({NORMS.get(self.norm or '', self.norm)}, input space)   radius = {self.eps[0]:.6g}"
                + ("   WARNING: radius ≥ r̂ (balls may straddle the ground-truth boundary)"
                   if self.eps_exceeds_r else ""),
                f"  {self._ball_words()}: normal {self.cells_normal}, empty {self.cells_empty}, "
                f"cross-boundary {self.cells_cross}",
                f"  OP: empirical, 1/{self.cells_evaluated} per ball; "
                + (f"multinomial bootstrap B = {self.bootstrap}" if self.bootstrap else "masses taken as known"),
                f"  samples per ball {self.samples_per_cell} ({self.allocation}); failure = "
                + ("any misclassification" if self.failure_set is None else f"confusions {list(self.failure_set)}"),
                f"  {self.model_queries:,} model queries in {self.seconds:.2f} s"
                f" ({self.model_queries / max(self.seconds, 1e-9):,.0f} /s)",
                *self.checks_summary(),
            ]
            return "\n".join(lines)
        lines += [
            f"  r̂ = {r}   ε = {', '.join(f'{e:.6g}' for e in self.eps)}"
            + ("   WARNING: ε ≥ r̂ (cells may straddle the ground-truth boundary)" if self.eps_exceeds_r else ""),
            f"  grid {' × '.join(map(str, self.grid_shape))} = {self.cells_total} cells"
            f"{' (latent space)' if self.latent else ''}; evaluated {self.cells_evaluated}: "
            f"normal {self.cells_normal}, empty {self.cells_empty}, cross-boundary {self.cells_cross}",
            f"  OP mass evaluated {self.mass_evaluated:.6g}; rest {self.mass_rest:.6g} counted "
            + ("with λ = 1 (conservative)" if self.conservative_rest else "at the evaluated cells' average pmi"),
            f"  OP masses: {self.mass_method}, bootstrap B = {self.bootstrap}, bandwidth "
            + ("full covariance" if self.bandwidth is None else ", ".join(f"{h:.4g}" for h in self.bandwidth)),
            f"  samples per cell {self.samples_per_cell} ({self.allocation}); failure = "
            + ("any misclassification" if self.failure_set is None else f"confusions {list(self.failure_set)}"),
            f"  {self.model_queries:,} model queries in {self.seconds:.2f} s"
            f" ({self.model_queries / max(self.seconds, 1e-9):,.0f} /s)",
            *self.checks_summary(),
        ]
        return "\n".join(lines)

    def to_details(self) -> dict[str, Any]:
        """Plain JSON-able values (non-finite numbers become ``None``)."""
        return {
            "E": self.E,
            "Var": self.Var,
            "std": self.std,
            "Ub": self.Ub,
            "confidence": self.confidence,
            "method": self.method,
            "r_hat": _num(self.r_hat),
            "eps": list(self.eps),
            "eps_exceeds_r": self.eps_exceeds_r,
            "grid_shape": list(self.grid_shape),
            "cells_total": self.cells_total,
            "cells_evaluated": self.cells_evaluated,
            "cells": {"normal": self.cells_normal, "empty": self.cells_empty, "cross_boundary": self.cells_cross},
            "mass_evaluated": self.mass_evaluated,
            "mass_rest": self.mass_rest,
            "rest": "lambda=1 (conservative)" if self.conservative_rest else "average pmi of evaluated cells",
            "mass_method": self.mass_method,
            "bootstrap": self.bootstrap,
            "bandwidth": None if self.bandwidth is None else list(self.bandwidth),
            "samples_per_cell": self.samples_per_cell,
            "allocation": self.allocation,
            "acu": self.acu,
            "failure_set": None if self.failure_set is None else [list(p) for p in self.failure_set],
            "latent": self.latent,
            "labelled_outside_box": self.labelled_outside_box,
            "model_queries": self.model_queries,
            "seconds": self.seconds,
            "alternatives": {name: alt.to_dict() for name, alt in self.alternatives.items()},
            "cell_kind": self.cell_kind,
            "norm": self.norm,
            "radius": self.eps[0] if self.balls else None,
            "clip": None if self.clip is None else list(self.clip),
            "empty_cell_label": self.empty_cell_label,
            "labelled_from_profile": self.labelled_from_profile,
            "labelled_queries": self.labelled_queries,
            "labelled_check": None if self.labelled_check is None else dict(self.labelled_check),
            "vote_check": None if self.vote_check is None else dict(self.vote_check),
            "violations": list(self.violations),
            "violations_accepted": self.violations_accepted,
            "contradictions": list(self.contradictions),
        }


# ====================================================================== model adapter
class _CheckedModel(torch.nn.Module):
    """The user's model with its output validated and made a tensor (for :class:`ForwardGuard`).

    A module, so :class:`ForwardGuard` still sees the wrapped model's parameters (its error hints
    name their dtype and device); named after the wrapped model's type by :func:`_checked`.
    """

    def __init__(self, model: Callable[[Tensor], Any], adapter: _ModelAdapter) -> None:
        super().__init__()
        if isinstance(model, torch.nn.Module):
            self.inner = model
        else:
            self._callable = model
        self._adapter = adapter

    def forward(self, x: Tensor) -> Tensor:
        model = self.inner if hasattr(self, "inner") else self._callable
        return self._adapter.validate(model(x), x)


def _checked(model: Callable[[Tensor], Any], adapter: _ModelAdapter) -> _CheckedModel:
    kind = type(type(model).__name__, (_CheckedModel,), {"__doc__": _CheckedModel.__doc__})
    return kind(model, adapter)


class _ModelAdapter:
    """Calls a model (torch module or any callable) and turns its output into class indices ``(B,)``.

    Accepted outputs: logits or probabilities ``(B, K)`` with ``K ≥ 2`` (arg-max), or integer
    labels ``(B,)``. Anything else is a :class:`MetricError` naming the shape. Every call goes
    through a :class:`~pytest_dnnsafety.outputs.ForwardGuard`: an exception in the model becomes
    a :class:`MetricError` naming the batch, and NaN/inf outputs are tracked on the device (no
    host sync per batch); :meth:`check` raises after the loop, naming the first bad batch — a
    model whose logits are NaN would otherwise "predict" class 0 everywhere.
    """

    def __init__(self, model: Callable[[Tensor], Any], num_classes: int | None,
                 what: str = "max_pmi_ub: model on cell samples") -> None:
        if not callable(model):
            raise ConfigError(f"model must be a torch module or a callable, got {type(model).__name__}")
        self.model = model
        self.num_classes = num_classes
        self.outputs_labels = False
        self.guard = ForwardGuard(what, labels_ok=True)
        self._checked = _checked(model, self)

    def __call__(self, x: Tensor) -> Tensor:
        return self.to_labels(self.raw(x))

    def raw(self, x: Tensor) -> Tensor:
        """The model's validated output tensor for ``x`` (guarded: exceptions named, NaN/inf tracked)."""
        with torch.inference_mode():
            return self.guard(self._checked, x)

    def check(self) -> None:
        """Raise a :class:`MetricError` if any output so far held NaN/inf (one host sync)."""
        self.guard.check()

    def convert(self, out: Any, x: Tensor) -> Tensor:
        """The model's output ``out`` for inputs ``x`` as class indices ``(B,)`` (or a :class:`MetricError`)."""
        return self.to_labels(self.validate(out, x))

    @staticmethod
    def to_labels(out: Tensor) -> Tensor:
        if out.ndim == 1:
            return out.to(torch.int64)
        if out.shape[1] == 2:  # the same as argmax (ties → class 0), 5× faster on CPUs
            return (out[:, 1] > out[:, 0]).to(torch.int64)
        return out.argmax(1)

    def validate(self, out: Any, x: Tensor) -> Tensor:
        """``out`` as a tensor of logits/probabilities ``(B, K ≥ 2)`` or integer labels ``(B,)``, else a MetricError."""
        if not isinstance(out, Tensor):
            try:
                out = torch.as_tensor(np.asarray(out), device=x.device)
            except (TypeError, ValueError):
                raise MetricError(
                    f"the model returned {type(out).__name__}; it must return logits or probabilities of shape "
                    f"(batch, classes) or labels of shape (batch,)"
                ) from None
        batch = x.shape[0]
        if out.ndim == 2 and out.shape[0] == batch and out.shape[1] >= 2:
            if self.num_classes is not None and out.shape[1] != self.num_classes:
                raise MetricError(
                    f"the model returned {out.shape[1]} class scores but num_classes={self.num_classes}"
                )
            return out
        if out.ndim == 1 and out.shape[0] == batch and not out.dtype.is_floating_point and not out.dtype.is_complex:
            self.outputs_labels = True
            return out
        hint = ""
        if out.ndim == 2 and out.shape[0] == batch and out.shape[1] == 1:
            hint = " A single score per input is ambiguous: return two-class logits (B, 2) or integer labels."
        elif out.ndim == 1 and out.shape[0] == batch:
            hint = " A 1-D output must hold integer class labels, not floating-point scores."
        raise MetricError(
            f"the model returned shape {tuple(out.shape)} (dtype {out.dtype}) for a batch of {batch} inputs of shape "
            f"{tuple(x.shape[1:])}; expected logits/probabilities ({batch}, K≥2) or integer labels ({batch},).{hint}"
        )


def _check_label_range(preds: Tensor, k: int) -> None:
    """Refuse labels outside ``0..k-1`` (one host sync: call it outside batch loops)."""
    _check_label_bounds(int(preds.min()), int(preds.max()), k)


def _check_label_bounds(lo: int, hi: int, k: int) -> None:
    if lo < 0 or hi >= k:
        raise MetricError(
            f"the model predicted label {hi if hi >= k else lo}, outside 0..{k - 1}. Fix: pass num_classes "
            f"(the number of classes the model can predict)"
        )


# ====================================================================== the assessor
def _mix(seed: int, block: int) -> int:
    return (int(seed) * 1_000_003 + (block + 1) * _MIX) % (2**63 - 1)


def _labels_tensor(raw_y: Any, n: int, device: torch.device) -> Tensor:
    """Labels of ``n`` labelled inputs as a non-negative int64 vector (or a :class:`DataError`)."""
    y_lab = torch.as_tensor(raw_y.detach() if isinstance(raw_y, Tensor) else np.asarray(raw_y))
    y_lab = y_lab.reshape(-1).to(device)
    if y_lab.dtype.is_floating_point or y_lab.dtype == torch.bool:
        raise DataError(f"labels must be integer class indices, got dtype {y_lab.dtype}")
    if y_lab.shape[0] != n:
        raise DataError(f"labelled: {n} inputs but {y_lab.shape[0]} labels")
    if y_lab.numel() and int(y_lab.min()) < 0:
        raise DataError(f"labels must be non-negative class indices, found {int(y_lab.min())}. Fix: map the labels "
                        f"to 0..K-1 in the order of the model's outputs")
    return y_lab.to(torch.int64)


def _raw_tensor(x: Any) -> Tensor:
    """Labelled inputs as a tensor in their own shape (the model's input shape), for querying the model."""
    tensor = x.detach() if isinstance(x, Tensor) else torch.as_tensor(np.asarray(x))
    if tensor.ndim == 1:
        tensor = tensor[:, None]
    return tensor


def _check_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < minimum:
        raise ConfigError(f"{name} must be an int ≥ {minimum}, got {value!r}")
    return int(value)


class ReliabilityAssessor:
    """Plans, samples and aggregates one reliability assessment (the steps of :func:`assess_reliability`).

    Construction does the model-independent work: the grid (or, with ``cells="balls"``, the
    balls around the operational inputs), ``r̂``, the OP masses and their bootstrap, the cell
    selection and types. Then :meth:`sample` runs the model (possibly a
    share of the blocks per worker: ``rank``/``world_size``) into a :class:`CellTallyEngine`,
    and :meth:`finish` turns the (merged) engine into a :class:`ReliabilityResult`.
    :meth:`assess` does both. Parameters (and their documentation): see :func:`assess_reliability`.
    """

    def __init__(
        self,
        profile: OperationalProfile | Any,
        labelled: tuple[Any, Any] | None = None,
        *,
        eps: float | Sequence[float] | str = "auto",
        eps_fraction: float = 1.0,
        box: tuple[Any, Any] | None = None,
        samples_per_cell: int = 1000,
        allocation: str = "uniform",
        bootstrap: int = 100,
        bandwidth: Any = None,
        mass: str = "exact",
        normalize: bool = True,
        mass_target: float = 1.0,
        max_cells: int | None = None,
        conservative_rest: bool = True,
        num_classes: int | None = None,
        failures: Iterable[tuple[int, int]] | None = None,
        method: str = "chernoff",
        compare_methods: Sequence[str] = (),
        confidence: float = 0.975,
        alpha_op_share: float = 0.5,
        posterior_draws: int = 1000,
        seed: int = 0,
        device: torch.device | str | None = None,
        batch_size: int | str = "auto",
        input_dtype: torch.dtype = torch.float32,
        cells: str = "grid",
        radius: float | str | None = None,
        norm: str = "linf",
        max_balls: int | None = None,
        clip: tuple[float, float] | None = None,
        empty_cell_label: str = "model",
        labelled_from_profile: bool = True,
        accept_violated_assumptions: bool = False,
    ) -> None:
        started = time.perf_counter()
        if empty_cell_label not in EMPTY_CELL_LABELS:
            raise ConfigError(f"empty_cell_label must be one of {list(EMPTY_CELL_LABELS)} (the model's majority vote, "
                              f"the paper's Assumption 5; or the label of the nearest labelled point), got "
                              f"{empty_cell_label!r}")
        self.empty_cell_label = str(empty_cell_label)
        for name, flag in (("labelled_from_profile", labelled_from_profile),
                           ("accept_violated_assumptions", accept_violated_assumptions)):
            if not isinstance(flag, (bool, np.bool_)):
                raise ConfigError(f"{name} must be True or False, got {flag!r}")
        self.labelled_from_profile = bool(labelled_from_profile)
        self.accept_violated_assumptions = bool(accept_violated_assumptions)
        self._x_lab_raw: Tensor | None = None
        self._lab_pred = None
        self.labelled_queries = 0
        self.confidence = stats.check_confidence(confidence)
        self.method = self._check_method(method, "method")
        self.compare_methods = tuple(dict.fromkeys(self._check_method(m, "compare_methods") for m in compare_methods
                                                   if m != self.method))
        self.samples_per_cell = _check_int(samples_per_cell, "samples_per_cell", 1)
        if allocation not in ("uniform", "proportional"):
            raise ConfigError(f"allocation must be 'uniform' or 'proportional', got {allocation!r}")
        self.allocation = allocation
        self.bootstrap = _check_int(bootstrap, "bootstrap", 0)
        if self.bootstrap == 1:
            raise ConfigError("bootstrap must be 0 (OP masses taken as known) or at least 2 refits, got 1")
        if mass not in ("exact", "centre"):
            raise ConfigError(f"mass must be 'exact' (box integral) or 'centre' (the paper's eq. 9), got {mass!r}")
        self.mass = mass
        self.normalize = bool(normalize)
        if isinstance(mass_target, bool) or not isinstance(mass_target, (int, float)) or not 0 < mass_target <= 1:
            raise ConfigError(f"mass_target must be a number in (0, 1], got {mass_target!r}")
        self.mass_target = float(mass_target)
        self.max_cells = None if max_cells is None else _check_int(max_cells, "max_cells", 1)
        self.conservative_rest = bool(conservative_rest)
        self.num_classes = None if num_classes is None else _check_int(num_classes, "num_classes", 2)
        self.failure_pairs = None if failures is None else self._check_failures(failures)
        if isinstance(alpha_op_share, bool) or not isinstance(alpha_op_share, (int, float)) \
                or not 0 < alpha_op_share < 1:
            raise ConfigError(f"alpha_op_share must lie strictly between 0 and 1, got {alpha_op_share!r}")
        self.alpha_op_share = float(alpha_op_share)
        self.posterior_draws = _check_int(posterior_draws, "posterior_draws", 1)
        self.seed = _check_int(seed, "seed", 0)
        if isinstance(batch_size, str):
            if batch_size != "auto":
                raise ConfigError(f"batch_size must be a positive int or 'auto', got {batch_size!r}")
        else:
            batch_size = _check_int(batch_size, "batch_size", 1)
        self.batch_size = batch_size
        self.input_dtype = input_dtype
        if cells not in ("grid", "balls"):
            raise ConfigError(f"cells must be 'grid' (cells of side eps over a box) or 'balls' (norm balls around the "
                              f"operational inputs, for high-dimensional inputs such as images), got {cells!r}")
        self.cell_kind = str(cells)
        self.norm = _check_norm(norm)
        self.clip: tuple[float, float] | None = None
        self.radius: float | None = None
        if cells == "balls":
            self._init_balls(profile, labelled, radius=radius, eps=eps, eps_fraction=eps_fraction, box=box,
                             bandwidth=bandwidth, max_balls=max_balls, clip=clip, device=device)
            self.plan_seconds = time.perf_counter() - started
            return
        for name, value in (("radius", radius), ("max_balls", max_balls), ("clip", clip)):
            if value is not None:
                raise ConfigError(f"{name} applies to cells='balls' only; grid cells are set by eps, box and max_cells")
        if norm != "linf":
            raise ConfigError(f"norm={norm!r} applies to cells='balls' only; grid cells are L∞ boxes")

        # ---------------------------------------------------------------- profile
        if not isinstance(profile, OperationalProfile):
            profile = OperationalProfile(profile, "scott" if bandwidth is None else bandwidth, device=device)
        elif bandwidth is not None:
            profile = profile.with_bandwidth(bandwidth)
        self.profile = profile
        self.device = profile.device if device is None else torch.device(device)

        # ---------------------------------------------------------------- labelled points, r̂
        if labelled is not None:
            if not isinstance(labelled, (tuple, list)) or len(labelled) != 2:
                raise DataError("labelled must be a pair (inputs, labels)")
            self._x_lab_raw = _raw_tensor(labelled[0])
            z_lab = profile.encode(labelled[0])
            y_lab = _labels_tensor(labelled[1], z_lab.shape[0], profile.device)
            self.r_hat = r_separation(z_lab, y_lab)
        else:
            z_lab, y_lab = None, None
            self.r_hat = float("nan")
        self._z_lab, self._y_lab = z_lab, y_lab

        # ---------------------------------------------------------------- box and grid
        if box is None:
            pad = 3.0 * (profile.bandwidth if profile.bandwidth is not None else profile.covariance.diagonal().sqrt())
            pts = profile.points if z_lab is None else torch.cat([profile.points, z_lab])
            lower, upper = (pts.min(0).values - pad).tolist(), (pts.max(0).values + pad).tolist()
        else:
            if not isinstance(box, (tuple, list)) or len(box) != 2:
                raise ConfigError("box must be a pair (lower corner, upper corner)")
            lower = _float_tuple(box[0], profile.dim, "box lower corner")
            upper = _float_tuple(box[1], profile.dim, "box upper corner")
        if isinstance(eps, str):
            if eps != "auto":
                raise ConfigError(f"eps must be a positive number, one per dimension, or 'auto', got {eps!r}")
            if not math.isfinite(self.r_hat):
                raise ConfigError(
                    "eps='auto' takes a fraction of r̂, which needs labelled points of at least two classes; "
                    "Fix: pass labelled=(x, y) or give eps"
                )
            if isinstance(eps_fraction, bool) or not isinstance(eps_fraction, (int, float)) or eps_fraction <= 0:
                raise ConfigError(f"eps_fraction must be a positive number, got {eps_fraction!r}")
            target = float(eps_fraction) * self.r_hat
            if target <= 0:
                raise ConfigError("r̂ is 0: two labelled points of different classes coincide; give eps")
            eps = [(hi - lo) / (math.floor((hi - lo) / target) + 1) for lo, hi in zip(lower, upper)]
        self.grid = Grid.build(lower, upper, _float_tuple(eps, profile.dim, "eps"))
        self.eps_exceeds_r = bool(math.isfinite(self.r_hat) and max(self.grid.eps) >= self.r_hat)
        if self.eps_exceeds_r:
            warnings.warn(
                f"cell side eps={max(self.grid.eps):.6g} ≥ r̂={self.r_hat:.6g}: cells may contain inputs of different "
                f"ground-truth classes (Assumption 4). Use eps='auto' or a smaller eps",
                ReliabilityWarning,
                stacklevel=2,
            )
        if self.grid.n_cells > MAX_SCAN_CELLS:
            raise ConfigError(
                f"the grid has {self.grid.n_cells:.3g} cells (shape {self.grid.shape}); ranking them by OP mass means "
                f"scanning them all, and more than {MAX_SCAN_CELLS:.3g} is out of reach. Fix: a larger eps, a smaller "
                f"box, or fewer latent dimensions"
            )
        if self.grid.n_cells > MAX_GRID_CELLS and self.max_cells is None:
            raise ConfigError(
                f"the grid has {self.grid.n_cells:,} cells (shape {self.grid.shape}), more than {MAX_GRID_CELLS:,} "
                f"can be ranked at once. Fix: give max_cells (a budget of top-OP cells), a larger eps or a smaller box"
            )

        self._plan()
        self.plan_seconds = time.perf_counter() - started

    # ------------------------------------------------------------------ ball cells
    def _init_balls(self, profile: Any, labelled: tuple[Any, Any] | None, *, radius: Any, eps: Any,
                    eps_fraction: Any, box: Any, bandwidth: Any, max_balls: Any, clip: Any,
                    device: torch.device | str | None) -> None:
        """Plan ``cells="balls"``: centres, radius, empirical OP, ball types and the sample corners."""
        if not (isinstance(eps, str) and eps == "auto"):
            raise ConfigError("eps is the grid's cell side; with cells='balls' give radius= (the ball radius) instead")
        if box is not None:
            raise ConfigError("box bounds the grid; cells='balls' needs none (give clip=(lo, hi) for the valid input "
                              "range)")
        if bandwidth is not None:
            raise ConfigError("bandwidth is a KDE setting; cells='balls' uses the empirical operational profile and "
                              "fits no KDE. Fix: drop bandwidth")
        if self.mass_target < 1.0 or self.max_cells is not None:
            raise ConfigError("mass_target/max_cells pick grid cells by OP mass, but every ball carries the same mass "
                              "1/M. Fix: use max_balls to evaluate a seeded subsample of the operational inputs")
        # ---- centres: the raw operational inputs (input space)
        if isinstance(profile, OperationalProfile):
            # a latent profile keeps its raw inputs (profile.inputs): the balls live in input space
            self.device = profile.device if device is None else torch.device(device)
            raw_inputs = getattr(profile, "inputs", None)
            if raw_inputs is None:
                if profile.latent:
                    raise ConfigError(
                        "cells='balls' centres the balls on the raw operational inputs, but this profile holds only "
                        "their encodings. Fix: pass the raw operational inputs (N, *input_shape) as profile"
                    )
                raw_inputs = profile.points
            centres_all = as_tensor_2d(raw_inputs, "operational inputs", device=self.device, flatten=True)
            input_shape = tuple(raw_inputs.shape[1:]) if raw_inputs.ndim > 2 else tuple(profile.input_shape)
            if math.prod(input_shape) != centres_all.shape[1]:
                input_shape = (int(centres_all.shape[1]),)
        else:
            self.device = torch.device("cpu") if device is None else torch.device(device)
            shape = tuple(profile.shape) if isinstance(profile, (Tensor, np.ndarray)) else None
            centres_all = as_tensor_2d(profile, "operational data", device=self.device, flatten=True)
            if shape is None:
                shape = (centres_all.shape[0], *np.asarray(profile).shape[1:])
            input_shape = tuple(shape[1:]) if len(shape) > 1 else (1,)
        self.profile = profile if isinstance(profile, OperationalProfile) else None
        n_all, d = int(centres_all.shape[0]), int(centres_all.shape[1])
        self.n_operational = n_all
        if max_balls is not None and _check_int(max_balls, "max_balls", 1) < n_all:
            gen = torch.Generator().manual_seed(_mix(self.seed, -2))
            flat = torch.randperm(n_all, generator=gen)[: int(max_balls)].sort().values
        else:
            flat = torch.arange(n_all)
        centres = centres_all[flat.to(self.device)]
        m = int(flat.shape[0])
        # ---- valid input range
        if clip is not None:
            if not isinstance(clip, (tuple, list)) or len(clip) != 2:
                raise ConfigError(f"clip must be a pair (lo, hi) of the valid input range, e.g. (0, 1), got {clip!r}")
            lo_c, hi_c = _float_tuple(clip, 2, "clip")
            if not lo_c < hi_c:
                raise ConfigError(f"clip: lo {lo_c} must be below hi {hi_c}")
            outside = ((centres_all < lo_c) | (centres_all > hi_c)).any(1)
            if bool(outside.any()):
                row = int(torch.nonzero(outside)[0, 0])
                raise DataError(f"operational input {row} lies outside clip=({lo_c:g}, {hi_c:g}). Fix: widen clip to "
                                f"the inputs' valid range or rescale the data")
            self.clip = (lo_c, hi_c)
        # ---- labelled points (input space, flattened) and r̂ under the norm
        if labelled is not None:
            if not isinstance(labelled, (tuple, list)) or len(labelled) != 2:
                raise DataError("labelled must be a pair (inputs, labels)")
            self._x_lab_raw = _raw_tensor(labelled[0])
            z_lab = as_tensor_2d(labelled[0], "labelled inputs", device=self.device, flatten=True)
            if z_lab.shape[1] != d:
                raise DataError(f"labelled inputs have {z_lab.shape[1]} values each, the operational inputs {d}")
            if self._x_lab_raw.ndim > 2 and len(input_shape) == 1:
                # the model's input shape: the labelled inputs' when the operational data came flat
                input_shape = tuple(self._x_lab_raw.shape[1:])
            y_lab = _labels_tensor(labelled[1], z_lab.shape[0], self.device)
            self.r_hat = r_separation(z_lab, y_lab, norm=self.norm)
        else:
            z_lab, y_lab = None, None
            self.r_hat = float("nan")
        self._z_lab, self._y_lab = z_lab, y_lab
        # ---- radius
        if radius is None or (isinstance(radius, str) and radius == "auto"):
            if not math.isfinite(self.r_hat):
                raise ConfigError(
                    "radius='auto' (the default for cells='balls') takes r̂ under the chosen norm, which needs "
                    "labelled points of at least two classes. Fix: pass labelled=(x, y) or give radius (e.g. 0.05)"
                )
            if self.r_hat <= 0:
                raise ConfigError("r̂ is 0: two labelled points of different classes coincide; give radius")
            if isinstance(eps_fraction, bool) or not isinstance(eps_fraction, (int, float)) or eps_fraction <= 0:
                raise ConfigError(f"eps_fraction must be a positive number, got {eps_fraction!r}")
            span = (torch.full((d,), hi_c - lo_c, dtype=torch.float64) if self.clip is not None
                    else (centres_all.max(0).values - centres_all.min(0).values).cpu())
            diameter = float(span.max()) if self.norm == "linf" else float(span.norm())
            cap = AUTO_RADIUS_CAP * diameter if diameter > 0 else math.inf
            value = min(math.nextafter(float(eps_fraction) * self.r_hat, 0.0), cap)
        else:
            if isinstance(radius, bool) or not isinstance(radius, (int, float, np.floating)) \
                    or not math.isfinite(float(radius)) or float(radius) <= 0:
                raise ConfigError(f"radius must be a positive finite number or 'auto', got {radius!r}")
            value = float(radius)
        self.radius = value
        self.eps_exceeds_r = bool(math.isfinite(self.r_hat) and value >= self.r_hat)
        if self.eps_exceeds_r:
            warnings.warn(
                f"ball radius {value:.6g} ≥ r̂={self.r_hat:.6g} ({NORMS[self.norm]}): balls may contain inputs of "
                f"different ground-truth classes (Assumption 4). Use radius='auto' or a smaller radius",
                ReliabilityWarning,
                stacklevel=3,
            )
        # ---- empirical OP: 1/M per ball; multinomial (bootstrap) uncertainty
        op = torch.full((m,), 1.0 / m, dtype=torch.float64)
        if self.bootstrap >= 2:
            gen = torch.Generator().manual_seed(int(self.seed))
            idx = torch.randint(0, m, (self.bootstrap, m), generator=gen)
            weights = torch.zeros(self.bootstrap, m, dtype=torch.float64)
            weights.scatter_add_(1, idx, torch.ones(self.bootstrap, m, dtype=torch.float64))
            reps: Tensor | None = weights / m
            rest_reps: Tensor | None = torch.zeros(self.bootstrap, dtype=torch.float64)
            op_var = torch.full((m,), (1.0 / m) * (1.0 - 1.0 / m) / m, dtype=torch.float64)
        else:
            reps, rest_reps, op_var = None, None, torch.zeros(m, dtype=torch.float64)
        self.rest, self.mass_evaluated, self.labelled_outside_box = 0.0, 1.0, 0
        self._flat, self._op, self._op_var, self._reps, self._rest_reps = flat, op, op_var, reps, rest_reps
        # ---- types: labelled points inside each (closed) ball, chunked distance matrices
        types = torch.full((m,), EMPTY, dtype=torch.int64, device=self.device)
        labels = torch.full((m,), -1, dtype=torch.int64, device=self.device)
        if z_lab is not None and y_lab is not None and y_lab.numel():
            n_lab = int(z_lab.shape[0])
            onehot = torch.nn.functional.one_hot(y_lab, int(y_lab.max()) + 1).to(torch.float64)
            chunk = max(1, min(_CHUNK_ELEMS // n_lab, 4 * _CHUNK_ELEMS // (n_lab * d)))
            for start in range(0, m, chunk):
                stop = min(m, start + chunk)
                inside = (_ball_distances(centres[start:stop], z_lab, self.norm) <= value).to(torch.float64)
                present = (inside @ onehot) > 0  # (c, K): classes with a labelled point in the ball
                distinct = present.sum(1)
                types[start:stop] = torch.where(distinct > 1, CROSS, torch.where(distinct == 1, NORMAL, EMPTY))
                labels[start:stop] = torch.where(distinct == 1, present.to(torch.int8).argmax(1), -1)
        if self.empty_cell_label == "nearest":
            labels = self._label_empty_by_nearest(types, labels, centres)
        self._types, self._labels = types, labels
        # ---- samples
        self._allocate(op, types)
        c = centres[self._sampled.to(self.device)]
        if self.norm == "linf":  # the ball (∩ clip) is a box: uniform in it, exactly
            lo, hi = c - value, c + value
            if self.clip is not None:
                lo, hi = lo.clamp_min(self.clip[0]), hi.clamp_max(self.clip[1])
            self._sample_lower, self._sample_width = lo, hi - lo
        else:  # L2: centre, zero width (samples are centre + radius · direction)
            self._sample_lower, self._sample_width = c, torch.zeros_like(c)
        self._centres = centres
        self._sample_dim = d
        self._input_shape = input_shape

    def _label_empty_by_nearest(self, types: Tensor, labels: Tensor, centres: Tensor,
                                empty: Tensor | None = None) -> Tensor:
        """``empty_cell_label="nearest"``: empty cells take the label of the labelled point nearest their centre.

        ``centres`` are all cells' centres, or (with ``empty``, their indices) only the empty cells'.
        """
        if self._z_lab is None or self._y_lab is None or not self._y_lab.numel():
            raise ConfigError("empty_cell_label='nearest' labels empty cells from the labelled points; none were "
                              "given. Fix: pass labelled=(x, y) or use empty_cell_label='model'")
        if empty is None:
            empty = torch.nonzero(types == EMPTY).reshape(-1)
            centres = centres[empty.to(centres.device)]
        labels = labels.clone()
        labels[empty.to(labels.device)] = nearest_labels(centres, self._z_lab, self._y_lab).to(labels.device)
        return labels

    def _allocate(self, op: Tensor, types: Tensor) -> None:
        """Samples per sampled (non-cross) cell: ``samples_per_cell`` each, or the same budget spread ∝ ``Op_i``."""
        sampled = torch.nonzero(types != CROSS).reshape(-1).cpu()
        self._sampled = sampled
        n_s = sampled.numel()
        if self.allocation == "uniform" or n_s == 0:
            trials = torch.full((n_s,), self.samples_per_cell, dtype=torch.int64)
        else:
            budget = self.samples_per_cell * n_s
            op_s = op.cpu()[sampled]
            total = float(op_s.sum())
            share_s = op_s / total if total > 0 else torch.full_like(op_s, 1.0 / n_s)
            trials = torch.round(share_s * budget).to(torch.int64).clamp_min(1)
        self._trials = trials
        self._ends = torch.cumsum(trials, 0)

    def _to_input(self, z: Tensor) -> Tensor:
        """Sampled points ``(B, d)`` → model inputs (decoded for latent grids, reshaped for balls)."""
        if self.cell_kind == "balls":
            return z.reshape(z.shape[0], *self._input_shape)
        return self.profile.decode(z)

    # ------------------------------------------------------------------ validation helpers
    @staticmethod
    def _check_method(method: Any, name: str) -> str:
        if method not in stats.METHODS:
            raise ConfigError(f"{name}: unknown method {method!r}; use one of {list(stats.METHODS)}")
        return str(method)

    @staticmethod
    def _check_failures(failures: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        pairs = []
        for pair in failures:
            try:
                true, pred = (int(v) for v in pair)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"failures must be (true, predicted) class pairs, e.g. [(0, 1)] for red→green; got {pair!r}"
                ) from None
            if true < 0 or pred < 0 or true == pred:
                raise ConfigError(f"failure pair {pair!r}: classes must be distinct non-negative indices")
            pairs.append((true, pred))
        if not pairs:
            raise ConfigError("failures is empty; give at least one (true, predicted) pair, or None for any error")
        return tuple(sorted(set(pairs)))

    # ------------------------------------------------------------------ planning
    def _mass_tables(self) -> list[Tensor] | None:
        if self.profile.bandwidth is None:
            if self.mass == "exact":
                self.profile._require_diagonal("mass='exact'")
            return None
        edges = [self.grid.edges(k, self.profile.device) for k in range(self.grid.dim)]
        return self.profile.axis_factors(edges, self.mass)

    def _product(self, tables: list[Tensor], flat: Tensor) -> Tensor:
        """``Π_k F_k[:, i_k]`` for the cells ``flat``: ``(N, C)``."""
        idx = self.grid.unravel(flat.to(tables[0].device))
        prod = tables[0][:, idx[:, 0]]
        for k in range(1, len(tables)):
            prod = prod * tables[k][:, idx[:, k]]
        return prod

    def _iter_point_masses(self, tables: list[Tensor] | None) -> Iterable[tuple[int, Tensor]]:
        """Unnormalised point masses of all grid cells, in flat order, chunk by chunk.

        With per-axis tables ``F_k`` (diagonal kernels) the masses of a block of rows of the
        first ``d − 1`` axes are one matrix product: ``(Π_{k<d} F_k[:, i_k])ᵀ F_d / N``.
        """
        grid, n = self.grid, self.profile.n
        n_cells = grid.n_cells
        dev = self.profile.device
        if tables is None:
            chunk = max(1, _CHUNK_ELEMS // max(1, n * grid.dim))
            for start in range(0, n_cells, chunk):
                flat = torch.arange(start, min(n_cells, start + chunk), device=dev)
                lo, hi = grid.bounds(flat)
                yield start, self.profile.centre_mass(lo, hi)
            return
        if grid.dim == 1:
            yield 0, tables[0].mean(0)
            return
        last = tables[-1]
        n_last = grid.shape[-1]
        outer = n_cells // n_last
        outer_grid = Grid(grid.lower[:-1], grid.upper[:-1], grid.eps[:-1])
        rows = max(1, _CHUNK_ELEMS // max(1, n + n_last))
        for r0 in range(0, outer, rows):
            r1 = min(outer, r0 + rows)
            idx = outer_grid.unravel(torch.arange(r0, r1, device=dev))
            prod = tables[0][:, idx[:, 0]]
            for k in range(1, grid.dim - 1):
                prod = prod * tables[k][:, idx[:, k]]
            yield r0 * n_last, (prod.T @ last).reshape(-1) / n

    def _plan(self) -> None:
        grid, profile = self.grid, self.profile
        tables = self._mass_tables()
        self._tables = tables
        # ---- point masses, selection by descending mass
        keep = self.max_cells if self.grid.n_cells > MAX_GRID_CELLS else None
        box_total = 0.0
        best_mass = torch.empty(0, dtype=torch.float64, device=profile.device)
        best_flat = torch.empty(0, dtype=torch.int64, device=profile.device)
        mass_parts: list[Tensor] = []
        flat_parts: list[Tensor] = []
        for start, masses in self._iter_point_masses(tables):
            box_total += float(masses.sum())
            flat = torch.arange(start, start + masses.shape[0], device=profile.device)
            if keep is not None:
                if masses.shape[0] > keep:
                    top = torch.topk(masses, keep)
                    masses, flat = top.values, flat[top.indices]
                best_mass = torch.cat([best_mass, masses])
                best_flat = torch.cat([best_flat, flat])
                if best_mass.shape[0] > keep:
                    top = torch.topk(best_mass, keep)
                    best_mass, best_flat = top.values, best_flat[top.indices]
            else:
                mass_parts.append(masses)
                flat_parts.append(flat)
        if keep is None:
            best_mass, best_flat = torch.cat(mass_parts), torch.cat(flat_parts)
        if tables is not None:
            per_kernel_total = torch.stack([t.sum(1) for t in tables]).prod(0)  # (N,) box mass of each kernel
            box_total = float(per_kernel_total.mean())
        else:
            per_kernel_total = None
        if box_total <= 0:
            raise MetricError(
                f"the operational profile puts no mass in the box {grid.lower}–{grid.upper}. Fix: choose a box "
                f"that covers the operational data"
            )
        self.box_mass = box_total
        order = torch.argsort(best_mass, descending=True, stable=True)
        best_mass, best_flat = best_mass[order], best_flat[order]
        norm = box_total if self.normalize else 1.0
        share = best_mass / norm
        count = best_mass.shape[0]
        if self.mass_target < 1.0:
            csum = torch.cumsum(share, 0)
            count = min(count, int(torch.searchsorted(csum, torch.tensor(self.mass_target * (1 - 1e-12),
                                                                          dtype=torch.float64,
                                                                          device=csum.device))) + 1)
        if self.max_cells is not None:
            count = min(count, self.max_cells)
        flat = best_flat[:count]
        op = share[:count]
        # ---- bootstrap replicates of the selected cells (Appendix A), normalised per replicate
        reps: Tensor | None = None
        rest_reps: Tensor | None = None
        if self.bootstrap >= 2:
            weights = profile.bootstrap_weights(self.bootstrap, self.seed)
            if tables is not None:
                assert per_kernel_total is not None
                totals = weights @ per_kernel_total / profile.n  # (B,)
                reps = torch.empty(self.bootstrap, count, dtype=torch.float64, device=profile.device)
                if grid.dim == 2 and 4 * count >= grid.n_cells and grid.n_cells <= MAX_GRID_CELLS:
                    # all refits of a 2-D grid: (A_1ᵀ diag(W_b) A_2) / N, a batched matrix product
                    a1t, a2 = tables[0].T, tables[1]
                    per = max(1, _CHUNK_ELEMS // max(1, a1t.numel()))
                    for b0 in range(0, self.bootstrap, per):
                        w = weights[b0 : b0 + per]
                        full = torch.matmul(a1t[None, :, :] * w[:, None, :], a2) / profile.n
                        reps[b0 : b0 + per] = full.reshape(w.shape[0], -1)[:, flat]
                else:
                    chunk = max(1, _CHUNK_ELEMS // max(1, profile.n))
                    for start in range(0, count, chunk):
                        prod = self._product(tables, flat[start : start + chunk])  # (N, c)
                        reps[:, start : start + chunk] = weights @ prod / profile.n
            else:
                totals = torch.zeros(self.bootstrap, dtype=torch.float64, device=profile.device)
                chunk = max(1, _CHUNK_ELEMS // max(1, profile.n * grid.dim))
                for start in range(0, grid.n_cells, chunk):
                    cells = torch.arange(start, min(grid.n_cells, start + chunk), device=profile.device)
                    lo, hi = grid.bounds(cells)
                    totals += profile.centre_mass(lo, hi, weights).sum(1)
                lo, hi = grid.bounds(flat)
                reps = profile.centre_mass(lo, hi, weights)
            if self.normalize:
                reps = reps / totals[:, None]
            rest_reps = (1.0 - reps.sum(1)).clamp_min(0.0)
        op_var = reps.var(0, unbiased=True) if reps is not None else torch.zeros_like(op)
        rest = max(0.0, 1.0 - float(op.sum()))
        if not self.conservative_rest:
            scale = float(op.sum())
            if scale <= 0:
                raise MetricError("the evaluated cells carry no OP mass, so their average pmi is undefined; "
                                  "Fix: raise mass_target/max_cells or use conservative_rest=True")
            op, op_var = op / scale, op_var / scale**2
            if reps is not None:
                reps = reps / reps.sum(1, keepdim=True)
                rest_reps = torch.zeros(reps.shape[0], dtype=torch.float64, device=reps.device)
        self.mass_evaluated = float(share[:count].sum())
        self.rest = rest
        self._flat, self._op, self._op_var, self._reps, self._rest_reps = flat, op, op_var, reps, rest_reps
        # ---- cell types from the labelled points
        types = torch.full((count,), EMPTY, dtype=torch.int64, device=profile.device)
        labels = torch.full((count,), -1, dtype=torch.int64, device=profile.device)
        self.labelled_outside_box = 0
        if self._z_lab is not None and self._y_lab is not None and self._y_lab.numel():
            where = grid.locate(self._z_lab)
            inside = where >= 0
            self.labelled_outside_box = int((~inside).sum())
            k_lab = int(self._y_lab.max()) + 1
            key = torch.unique(where[inside] * k_lab + self._y_lab[inside])  # sorted
            key_cell, key_label = key // k_lab, key % k_lab
            cells_u, distinct = torch.unique_consecutive(key_cell, return_counts=True)
            first = torch.cumsum(distinct, 0) - distinct
            first_label = key_label[first]
            pos = torch.searchsorted(cells_u, flat).clamp_max(max(cells_u.numel() - 1, 0))
            found = cells_u.numel() > 0
            if found:
                hit = cells_u[pos] == flat
                types = torch.where(hit, torch.where(distinct[pos] > 1, CROSS, NORMAL), types)
                labels = torch.where(hit & (distinct[pos] == 1), first_label[pos], labels)
        if self.empty_cell_label == "nearest":
            empty = torch.nonzero(types == EMPTY).reshape(-1)
            centres = grid.centres(flat[empty]) if empty.numel() else torch.zeros(0, grid.dim, dtype=torch.float64)
            labels = self._label_empty_by_nearest(types, labels, centres, empty)
        self._types, self._labels = types, labels
        # ---- sample allocation over the sampled (non-cross) cells
        self._allocate(op, types)
        lo, hi = grid.bounds(flat[self._sampled.to(flat.device)].to(profile.device))
        self._sample_lower, self._sample_width = lo, hi - lo
        self._sample_dim = grid.dim

    # ------------------------------------------------------------------ sampling
    @property
    def n_sampled_cells(self) -> int:
        return int(self._sampled.numel())

    @property
    def total_samples(self) -> int:
        return int(self._ends[-1]) if self._ends.numel() else 0

    def new_engine(self, num_classes: int) -> CellTallyEngine:
        """An empty :class:`CellTallyEngine` sized for this plan."""
        return CellTallyEngine(self.n_sampled_cells, num_classes, device=self.device)

    def _sample_dtype(self) -> torch.dtype:
        if self.cell_kind == "balls":
            assert self.radius is not None
            span = float(self._centres.abs().max()) + self.radius if self._centres.numel() else 1.0
            return torch.float64 if span / self.radius > 2**16 else torch.float32
        span = max(max(abs(v) for v in self.grid.lower), max(abs(v) for v in self.grid.upper))
        return torch.float64 if span / min(self.grid.eps) > 2**16 else torch.float32

    def _batch_inputs(self, first: int, last: int, dtype: torch.dtype, corners: Tensor
                      ) -> tuple[Tensor, Tensor, tuple[int, int]]:
        """Cells (relative to the touched range), latent inputs and the touched cell range ``[lo, hi)`` of blocks
        ``first..last - 1``.

        Each block draws its uniforms from its own generator seeded by ``(seed, block)``, so a
        sample does not depend on which batch or worker processes its block.
        """
        start, stop = first * BLOCK, min(self.total_samples, last * BLOCK)
        d = self._sample_dim
        l2 = self.cell_kind == "balls" and self.norm == "l2"
        u = torch.empty(stop - start, d, dtype=dtype, device=self.device)
        rad = torch.empty(stop - start, 1, dtype=dtype, device=self.device) if l2 else None
        gen = self._generator
        for block in range(first, last):
            lo = block * BLOCK - start
            hi = min(stop - start, lo + BLOCK)
            gen.manual_seed(_mix(self.seed, block))
            if rad is not None:  # L2 ball: Gaussian direction, then the radius quantile
                torch.randn(hi - lo, d, generator=gen, dtype=dtype, device=self.device, out=u[lo:hi])
                torch.rand(hi - lo, 1, generator=gen, dtype=dtype, device=self.device, out=rad[lo:hi])
            else:
                torch.rand(hi - lo, d, generator=gen, dtype=dtype, device=self.device, out=u[lo:hi])
        # the cells the batch touches and how many of its samples fall in each (the first and last
        # cell may be cut by the batch edges); corners and cell indices are expanded by repetition
        if self.allocation == "uniform":
            n = self.samples_per_cell
            lo, hi = start // n, (stop - 1) // n + 1
            cell_starts = torch.arange(lo, hi, dtype=torch.int64) * n
            cell_ends = cell_starts + n
        else:
            ends = self._ends
            lo = int(torch.searchsorted(ends, torch.tensor(start), right=True))
            hi = int(torch.searchsorted(ends, torch.tensor(stop - 1), right=True)) + 1
            cell_ends = ends[lo:hi]
            cell_starts = cell_ends - self._trials[lo:hi]
        reps = (cell_ends.clamp_max(stop) - cell_starts.clamp_min(start)).to(self.device)
        count = stop - start
        local = torch.arange(hi - lo, device=self.device).repeat_interleave(reps, output_size=count)
        picked = corners[lo:hi].repeat_interleave(reps, dim=0, output_size=count)  # (B, 2d): lower | width
        if rad is not None:  # uniform in the L2 ball: centre + ε · U^{1/d} · g/‖g‖
            assert self.radius is not None
            scale = rad.pow_(1.0 / d).mul_(self.radius).div_(torch.linalg.vector_norm(u, dim=1, keepdim=True)
                                                             .clamp_min(torch.finfo(dtype).tiny))
            z = u.mul_(scale).add_(picked[:, :d])
        else:
            z = u.mul_(picked[:, d:]).add_(picked[:, :d])
        if self.clip is not None:  # exact for L∞ (the sampled box is already clipped; guards rounding)
            z = z.clamp_(self.clip[0], self.clip[1])
        return local, z, (lo, hi)

    def _run_blocks(self, adapter: _ModelAdapter, engine: CellTallyEngine, first: int, last: int,
                    dtype: torch.dtype, corners: Tensor) -> int:
        local, z, cell_range = self._batch_inputs(first, last, dtype, corners)
        x = self._to_input(z)
        if x.dtype != self.input_dtype:
            x = x.to(self.input_dtype)
        preds = adapter(x)
        if adapter.outputs_labels:
            # Label range: extremes kept on the device and checked once after the loop (no host sync
            # per batch); clamped meanwhile so the tally stays in range (a bad run raises anyway).
            lo, hi = preds.min().reshape(1), preds.max().reshape(1)
            self._label_extremes = (torch.cat([lo, hi]) if self._label_extremes is None else
                                    torch.stack([torch.minimum(self._label_extremes[0], lo[0]),
                                                 torch.maximum(self._label_extremes[1], hi[0])]))
            preds = preds.clamp(0, engine.num_classes - 1)
        engine.update_local(local, preds, *cell_range)
        return int(local.shape[0])

    def _probe(self, adapter: _ModelAdapter) -> int:
        """One small model call on the first sampled cell's centre: validates the output, returns ``K``."""
        z = (self._sample_lower[:1] + self._sample_width[:1] / 2).to(self._sample_dtype()).expand(2, -1)
        x = self._to_input(z.contiguous())
        x = x.to(self.input_dtype)
        raw = adapter.raw(x)
        preds = adapter.to_labels(raw)
        if self.num_classes is not None:
            k = self.num_classes
        elif isinstance(raw, Tensor) and raw.ndim == 2:
            k = int(raw.shape[1])
        else:
            k = max(2, int(preds.max()) + 1)
            if self._y_lab is not None and self._y_lab.numel():
                k = max(k, int(self._y_lab.max()) + 1)
            if self.failure_pairs is not None:
                k = max(k, 1 + max(max(p) for p in self.failure_pairs))
        if self._y_lab is not None and self._y_lab.numel() and int(self._y_lab.max()) >= k:
            raise DataError(f"labelled data holds class {int(self._y_lab.max())} but the model has {k} classes. Fix: "
                            f"labels must index the model's outputs (0..{k - 1}); check that the data belong to this "
                            f"model and its class order")
        if self.failure_pairs is not None and max(max(p) for p in self.failure_pairs) >= k:
            raise ConfigError(f"failures name class {max(max(p) for p in self.failure_pairs)}, "
                              f"but the model has {k} classes")
        if adapter.outputs_labels:
            _check_label_range(preds, k)
        return k

    def sample(self, model: Callable[[Tensor], Any], engine: CellTallyEngine | None = None, *,
               rank: int = 0, world_size: int = 1) -> CellTallyEngine:
        """Run the Monte Carlo of this worker's share of blocks into ``engine`` (a new one when ``None``).

        Blocks ``[rank·nb/world_size, (rank+1)·nb/world_size)`` are this worker's; merging the
        engines of all ranks gives exactly the single-process result.
        """
        world_size = _check_int(world_size, "world_size", 1)
        rank = _check_int(rank, "rank", 0)
        if rank >= world_size:
            raise ConfigError(f"rank {rank} must be below world_size {world_size}")
        self.queries = 0
        self._label_extremes: Tensor | None = None
        self._predict_labelled(model)
        adapter = _ModelAdapter(model, self.num_classes)
        # One model, one number of classes: the Monte Carlo queries must return as many class scores
        # as the queries on the labelled points did (a guard per phase would accept a change between them).
        adapter.guard.num_classes = self._labelled_classes
        if self.n_sampled_cells == 0:
            return engine if engine is not None else self.new_engine(self.num_classes or 2)
        k = self._probe(adapter)
        if engine is None:
            engine = self.new_engine(k)
        elif engine.n_cells != self.n_sampled_cells or engine.num_classes != k:
            raise ConfigError(
                f"engine is sized {engine.n_cells} cells × {engine.num_classes} classes, the plan needs "
                f"{self.n_sampled_cells} × {k}"
            )
        engine.to(self.device)
        dtype = self._sample_dtype()
        corners = torch.cat([self._sample_lower, self._sample_width], 1).to(self.device, dtype)
        self._ends_dev = self._ends.to(self.device)
        self._generator = torch.Generator(device=self.device)
        n_blocks = -(-self.total_samples // BLOCK)
        first, last = rank * n_blocks // world_size, (rank + 1) * n_blocks // world_size
        block = first
        per_batch = self._initial_blocks() if self.batch_size == "auto" else max(1, self.batch_size // BLOCK)
        if self.batch_size == "auto":
            block, per_batch = self._autotune(adapter, engine, block, last, dtype, corners)
        self.blocks_per_batch = per_batch
        while block < last:
            stop = min(last, block + per_batch)
            self.queries += self._run_blocks(adapter, engine, block, stop, dtype, corners)
            block = stop
        adapter.check()  # NaN/inf logits: one host sync after the loop, naming the first bad batch
        if self._label_extremes is not None:
            lo, hi = self._label_extremes.tolist()
            _check_label_bounds(int(lo), int(hi), engine.num_classes)
        return engine

    def _predict_labelled(self, model: Callable[[Tensor], Any]) -> None:
        """The model's predictions on the labelled inputs (for the labelled-data checks of :meth:`finish`).

        The inputs go to the model as given (input space, their own shape), in batches, guarded
        like the Monte Carlo queries (NaN/inf outputs raise, naming the first bad batch).
        """
        self._lab_pred: Tensor | None = None
        self._labelled_classes: int | None = None
        if self._x_lab_raw is None or self._y_lab is None or not self._y_lab.numel():
            return
        adapter = _ModelAdapter(model, self.num_classes, what="max_pmi_ub: model on the labelled points")
        x_all = self._x_lab_raw
        step = self.batch_size if isinstance(self.batch_size, int) else 4 * BLOCK
        preds = []
        for start in range(0, int(x_all.shape[0]), step):
            x = x_all[start : start + step].to(self.device, self.input_dtype)
            preds.append(adapter(x))
        adapter.check()
        self._labelled_classes = adapter.guard.num_classes
        pred = torch.cat(preds).to(torch.int64)
        self.labelled_queries = int(pred.shape[0])
        if adapter.outputs_labels and pred.numel():
            lo, hi = int(pred.min()), int(pred.max())
            k = self.num_classes if self.num_classes is not None else max(hi, int(self._y_lab.max())) + 1
            _check_label_bounds(lo, hi, max(k, 2))
        self._lab_pred = pred.cpu()

    def _initial_blocks(self) -> int:
        return 2 if self.device.type == "cpu" else 64

    def _autotune(self, adapter: _ModelAdapter, engine: CellTallyEngine, block: int, last: int,
                  dtype: torch.dtype, corners: Tensor) -> tuple[int, int]:
        """Time real batches of the stream at a few sizes and keep the fastest (results do not depend on it)."""
        # CPU: small multiples of BLOCK (a tiny MLP is fastest at 12k–16k inputs, while activations fit
        # the caches); accelerators: large batches
        candidates = [1, 2, 3, 4, 6, 8] if self.device.type == "cpu" else [16, 64, 256]
        if last - block < 4 * sum(candidates):
            return block, self._initial_blocks()
        rates = {}
        for per_batch in candidates:
            elapsed = math.inf
            for _ in range(2):
                sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
                sync()
                t0 = time.perf_counter()
                self.queries += self._run_blocks(adapter, engine, block, block + per_batch, dtype, corners)
                sync()
                elapsed = min(elapsed, time.perf_counter() - t0)
                block += per_batch
            rates[per_batch] = per_batch / max(elapsed, 1e-9)
        return block, max(rates, key=lambda b: rates[b])

    # ------------------------------------------------------------------ aggregation
    def _failure_matrix(self, k: int) -> Tensor:
        if self.failure_pairs is None:
            return ~torch.eye(k, dtype=torch.bool)
        fm = torch.zeros(k, k, dtype=torch.bool)
        for true, pred in self.failure_pairs:
            fm[true, pred] = True
        return fm

    def finish(self, engine: CellTallyEngine | None, *, model_queries: int | None = None,
               seconds: float | None = None) -> ReliabilityResult:
        """Aggregate the (merged) engine into a :class:`ReliabilityResult` by :attr:`method` (and the comparisons)."""
        started = time.perf_counter()
        n_s = self.n_sampled_cells
        count = int(self._flat.shape[0])
        sampled = self._sampled.cpu()
        types = self._types.cpu()
        labels = self._labels.cpu().clone()
        failures_all = torch.zeros(count, dtype=torch.int64)
        trials_all = torch.zeros(count, dtype=torch.int64)
        if n_s:
            if engine is None:
                raise ConfigError("finish() needs the engine filled by sample()")
            counts = engine.compute().cpu()
            trials = counts.sum(1)
            if not torch.equal(trials, self._trials):
                short = int(torch.nonzero(trials != self._trials)[0, 0])
                raise MetricError(
                    f"sampled cell {short} has {int(trials[short])} samples, the plan gives "
                    f"{int(self._trials[short])}; merge the engines of every rank (and run each block once) before finish()"
                )
            k = counts.shape[1]
            fm = self._failure_matrix(k)
            cell_labels = labels[sampled]
            voted = counts.argmax(1)
            cell_labels = torch.where(cell_labels < 0, voted, cell_labels)
            labels[sampled] = cell_labels
            fails = (counts * fm[cell_labels].to(torch.int64)).sum(1)
            vote_fails = (counts * fm[voted].to(torch.int64)).sum(1)
            failures_all[sampled] = fails
            trials_all[sampled] = trials
        else:
            k = self.num_classes or 2
            fails = torch.zeros(0, dtype=torch.int64)
            trials = torch.zeros(0, dtype=torch.int64)
            voted = vote_fails = torch.zeros(0, dtype=torch.int64)

        op = self._op.cpu()
        op_var = self._op_var.cpu()
        reps = None if self._reps is None else self._reps.cpu()
        rest = self.rest if self.conservative_rest else 0.0
        rest_reps = None if self._rest_reps is None else self._rest_reps.cpu()
        cross = types == CROSS
        methods = (self.method, *self.compare_methods)
        bounds = {m: self._bound(m, op, op_var, reps, rest, rest_reps, cross, sampled, fails, trials)
                  for m in methods}
        main = bounds[self.method]
        checks = self._labelled_checks(main, op, types, sampled, fails, vote_fails, voted, trials, k)
        lam_hat = torch.where(cross, torch.ones(count, dtype=torch.float64),
                              failures_all.to(torch.float64) / trials_all.clamp_min(1).to(torch.float64))
        if self.cell_kind == "balls":
            assert self.radius is not None
            centres = self._centres.cpu()
            lo, hi = centres - self.radius, centres + self.radius
            if self.clip is not None:
                lo, hi = lo.clamp_min(self.clip[0]), hi.clamp_max(self.clip[1])
        else:
            lo, hi = self.grid.bounds(self._flat.cpu())
        table = CellTable(flat=self._flat.cpu(), lower=lo, upper=hi, op=op, op_var=op_var, cell_type=types,
                          label=labels, failures=failures_all, trials=trials_all)
        queries = getattr(self, "queries", 0) if model_queries is None else int(model_queries)
        elapsed = seconds if seconds is not None else self.plan_seconds + (time.perf_counter() - started)
        balls = self.cell_kind == "balls"
        if balls:
            assert self.radius is not None
            bw, eps, shape, total = None, (self.radius,), (), self.n_operational
        else:
            bw = None if self.profile.bandwidth is None else tuple(float(v) for v in self.profile.bandwidth)
            eps, shape, total = self.grid.eps, self.grid.shape, self.grid.n_cells
        return ReliabilityResult(
            E=main.E, Var=main.Var, Ub=main.Ub, confidence=self.confidence, method=self.method,
            r_hat=self.r_hat, eps=eps, eps_exceeds_r=self.eps_exceeds_r, grid_shape=shape,
            cells_total=total, cells_evaluated=count,
            cells_normal=int((types == NORMAL).sum()), cells_empty=int((types == EMPTY).sum()),
            cells_cross=int(cross.sum()), mass_evaluated=self.mass_evaluated,
            mass_rest=max(0.0, 1.0 - self.mass_evaluated), conservative_rest=self.conservative_rest,
            mass_method="empirical" if balls else self.mass, bootstrap=self.bootstrap, bandwidth=bw,
            samples_per_cell=self.samples_per_cell, allocation=self.allocation,
            acu=float(lam_hat.mean()) if count else float("nan"), model_queries=queries, seconds=float(elapsed),
            failure_set=self.failure_pairs, latent=False if balls else self.profile.latent,
            labelled_outside_box=self.labelled_outside_box,
            alternatives={m: b for m, b in bounds.items() if m != self.method}, cells=table,
            cell_kind=self.cell_kind, norm=self.norm if balls else None, clip=self.clip,
            empty_cell_label=self.empty_cell_label, labelled_from_profile=self.labelled_from_profile,
            labelled_queries=self.labelled_queries, **checks,
        )

    # ------------------------------------------------------------------ does the evidence hold together?
    def _violations(self, n_cross: int) -> list[str]:
        """The method's assumptions that the plan itself shows to be violated (each a sentence with numbers)."""
        balls = self.cell_kind == "balls"
        what = "ball" if balls else "cell"
        found = []
        if self.eps_exceeds_r:
            size = (f"ball radius {self.radius:.4g} ({NORMS[self.norm]})" if balls
                    else f"cell side ε = {max(self.grid.eps):.4g}")
            cross = (f"; {n_cross:,} {what}s hold labelled points of different classes (counted with λ = 1)"
                     if n_cross else "")
            found.append(
                f"{size} ≥ r̂ = {self.r_hat:.4g}: a {what} can hold inputs of two ground-truth classes, so "
                f"robustness within it does not mean correctness (Assumption 4, Remark 2){cross}. Fix: "
                f"{'radius' if balls else 'eps'}='auto' or a value below r̂"
            )
        elif n_cross:
            found.append(f"{n_cross:,} {what}s hold labelled points of different classes (Assumption 4; counted "
                         f"with λ = 1)")
        if not balls and self.labelled_outside_box:
            n_lab = int(self._y_lab.numel()) if self._y_lab is not None else 0
            found.append(
                f"{self.labelled_outside_box:,} of {n_lab:,} labelled points lie outside the box "
                f"{list(self.grid.lower)}–{list(self.grid.upper)}: the assessed domain misses part of the data "
                f"and no cell is checked against them. Fix: a box that covers the data (box=None takes their range)"
            )
        return found

    def _labelled_checks(self, main: MethodBound, op: Tensor, types: Tensor, sampled: Tensor, fails: Tensor,
                         vote_fails: Tensor, voted: Tensor, trials: Tensor, k: int) -> dict[str, Any]:
        """Hold the bound against the labelled data and list violated assumptions (see :func:`assess_reliability`).

        (a) The model's error on the labelled points — by default a sample of the operational
        profile — has an exact lower confidence bound (:func:`stats.labelled_error_check`); above
        ``Ub`` the two statements cannot both hold. (b) Assumption 5 tested where the ground truth is
        known: on the evaluated cells holding labelled points, the model's majority vote against
        their label; the OP-weighted amount by which the vote under-states the unastuteness there,
        carried over to the empty cells labelled by the vote, must not lift the estimate above ``Ub``.
        """
        balls = self.cell_kind == "balls"
        what = "balls" if balls else "cells"
        contradictions: list[str] = []
        n_cross = int((types == CROSS).sum())
        violations = self._violations(n_cross)
        empty = types == EMPTY
        empty_mass = float(op[empty].sum())
        n_empty = int(empty.sum())
        ub = main.Ub
        vote_words = (f"the labels of the {n_empty:,} empty {what} (OP mass {empty_mass:.3g}) came from the model's "
                      f"own majority vote (Assumption 5), which counts a region the model gets consistently wrong "
                      f"as correct")
        # ---- (a) the model's error on the labelled points
        labelled_check: dict[str, Any] | None = None
        if self._lab_pred is not None and self._y_lab is not None:
            y = self._y_lab.cpu()
            pred = self._lab_pred
            kk = max(k, int(y.max()) + 1, int(pred.max()) + 1 if pred.numel() else 0)
            fm = self._failure_matrix(kk)
            errors = int(fm[y, pred.clamp(0, kk - 1)].sum())
            check = stats.labelled_error_check(errors, int(y.numel()), ub, self.confidence)
            labelled_check = {**check.to_dict(), "applied": self.labelled_from_profile,
                              "labelled_from_profile": self.labelled_from_profile}
            if not self.labelled_from_profile:
                labelled_check["skipped"] = ("labelled_from_profile=False: the labelled points are not a sample of "
                                             "the operational profile, so their error rate does not bound the pmi")
            elif check.contradicts:
                cause = (vote_words if self.empty_cell_label == "model" and empty_mass > 0 else
                         "the assessment's premises fail for this model and data (cell labels, the cell size against "
                         "r̂, or the operational profile)")
                fix = ("Fix: empty_cell_label='nearest' (label empty cells from the nearest labelled point)"
                       if self.empty_cell_label == "model" and empty_mass > 0 else
                       "Fix: check the model and the assessment's settings")
                contradictions.append(
                    f"the model misclassifies {errors:,} of {check.n:,} labelled points (error {check.rate:.3g}, "
                    f"≥ {check.lower:.3g} at {self.confidence * 100:g}% by Clopper–Pearson) but the bound says "
                    f"pmi ≤ {ub:.3g}: {cause}. The labelled points are taken as a sample of the operational profile "
                    f"(if they are not, set labelled_from_profile=False). {fix}"
                )
        # ---- (b) Assumption 5 on the cells whose ground truth is known
        vote_check: dict[str, Any] | None = None
        normal_s = types[sampled] == NORMAL if sampled.numel() else torch.zeros(0, dtype=torch.bool)
        if bool(normal_s.any()):
            idx = sampled[normal_s]
            truth = self._labels.cpu()[idx]
            wrong = voted[normal_s] != truth
            t = trials[normal_s].clamp_min(1).to(torch.float64)
            gap = ((fails[normal_s] - vote_fails[normal_s]).to(torch.float64) / t).clamp_min(0.0)
            w = op[idx]
            normal_mass = float(w.sum())
            g = float((w * gap).sum()) / normal_mass if normal_mass > 0 else 0.0
            uses_vote = self.empty_cell_label == "model" and n_empty > 0
            implied = main.E + g * empty_mass if uses_vote else main.E
            vote_check = {
                "cells_with_labels": int(normal_s.sum()), "vote_disagrees": int(wrong.sum()),
                "mass_with_labels": normal_mass, "mass_vote_disagrees": float(w[wrong].sum()),
                "mean_understatement": g, "empty_mass_labelled_by_vote": empty_mass if uses_vote else 0.0,
                "implied_estimate": implied,
            }
            if uses_vote and int(wrong.sum()) and implied > ub:
                contradictions.append(
                    f"in {int(wrong.sum()):,} of {int(normal_s.sum()):,} evaluated {what} holding labelled points "
                    f"the model's majority vote disagrees with their label (OP mass {float(w[wrong].sum()):.3g} of "
                    f"{normal_mass:.3g}; the vote under-states their unastuteness by {g:.3g} on average). "
                    f"{vote_words[0].upper()}{vote_words[1:]}; if they behave like the labelled ones the estimate "
                    f"is about {implied:.3g}, above the bound {ub:.3g}. Fix: empty_cell_label='nearest'"
                )
        return {"violations": tuple(violations), "violations_accepted": self.accept_violated_assumptions,
                "contradictions": tuple(contradictions), "labelled_check": labelled_check, "vote_check": vote_check}

    def _bound(self, method: str, op: Tensor, op_var: Tensor, reps: Tensor | None, rest: float,
               rest_reps: Tensor | None, cross: Tensor, sampled: Tensor, fails: Tensor, trials: Tensor
               ) -> MethodBound:
        conf = self.confidence
        lam_mean = torch.ones_like(op)
        lam_var = torch.zeros_like(op)
        if sampled.numel():
            m, v = stats.binomial_moments(fails, trials)
            lam_mean[sampled], lam_var[sampled] = m, v
        normal = stats.aggregate_normal(op, op_var, lam_mean, lam_var, conf)
        rest_var = float(rest_reps.var(unbiased=True)) if (rest_reps is not None and self.conservative_rest) else 0.0
        E = normal.E + rest
        Var = normal.Var + rest_var
        if method == "normal":
            return MethodBound(method, E, Var, stats.normal_upper(E, Var, conf), conf)
        ops = op[None, :] if reps is None else reps
        rests = torch.tensor([rest]) if reps is None else (rest_reps if self.conservative_rest
                                                             else torch.zeros(reps.shape[0], dtype=torch.float64))
        assert rests is not None
        cross_mass = ops[:, cross].sum(1) + rests  # (B,) or (1,)
        if method == "jeffreys":
            draws = stats.jeffreys_draws(ops[:, sampled], fails, trials, self.posterior_draws, seed=self.seed,
                                         extra=cross_mass)
            ub = float(torch.quantile(draws, conf))
            return MethodBound(method, float(draws.mean()), float(draws.var()), min(1.0, ub), conf)
        alpha = 1.0 - conf
        if reps is None:
            conf_lam, level = conf, None
        else:
            alpha_op = self.alpha_op_share * alpha
            conf_lam, level = 1.0 - (alpha - alpha_op), 1.0 - alpha_op
        if not sampled.numel():
            values = cross_mass.tolist()
        elif method == "chernoff":
            values = [float(cross_mass[b]) + stats.chernoff_upper(ops[b, sampled], fails, trials, conf_lam)
                      for b in range(ops.shape[0])]
        else:  # clopper-pearson: the per-cell bounds (at 1 − α_λ/m) do not depend on the masses
            per_cell = stats.clopper_pearson_upper(fails, trials, 1.0 - (1.0 - conf_lam) / int(sampled.numel()))
            values = (ops[:, sampled] @ per_cell + cross_mass).tolist()
        ub = values[0] if level is None else stats.bootstrap_quantile(values, level)
        return MethodBound(method, E, Var, min(1.0, ub), conf)

    def assess(self, model: Callable[[Tensor], Any]) -> ReliabilityResult:
        """:meth:`sample` then :meth:`finish` in this process; ``seconds`` covers planning too."""
        started = time.perf_counter()
        engine = self.sample(model)
        result = self.finish(engine, model_queries=self.queries)
        return replace(result, seconds=self.plan_seconds + time.perf_counter() - started)


def assess_reliability(
    model: Callable[[Tensor], Any],
    profile: OperationalProfile | Any,
    labelled: tuple[Any, Any] | None = None,
    **options: Any,
) -> ReliabilityResult:
    """Assess the pmi of ``model`` under the operational profile (Zhao et al. 2021) and bound it.

    ``options`` are the keywords of :class:`ReliabilityAssessor` (the defaults are its own), all
    documented here; an unknown keyword raises ``TypeError``.

    Args:
        model: a torch module or any callable mapping inputs ``(B, *input_shape)`` (on ``device``,
            ``input_dtype``) to logits or probabilities ``(B, K)`` or integer labels ``(B,)``.
        profile: an :class:`~pytest_dnnsafety.profile.OperationalProfile`, or raw operational
            data ``(N, d)`` to build one from (with ``bandwidth``).
        labelled: ``(x, y)`` labelled inputs (input space; encoded when the profile is latent):
            they give ``r̂`` and the labels of normal/cross-boundary cells.
        eps: cell side (number, or one per dimension), or ``"auto"`` — the largest even split of
            the box with side below ``eps_fraction · r̂``.
        box: ``(lower, upper)`` corners of the gridded domain (profile space). Default: the data's
            range padded by three bandwidths.
        samples_per_cell: Monte Carlo samples ``n`` per cell (eqs. 13–14); with
            ``allocation="proportional"`` the same total budget is spread ``∝ Op_i`` (which
            minimises the ``"chernoff"`` bound's ``max Op_i/n_i``).
        bootstrap: KDE refits ``B`` for ``V[Op_i]`` (Appendix A); 0 takes the masses as known.
        bandwidth: KDE bandwidth (rule name, number or one per dimension); with an existing
            profile it refits the profile with this bandwidth.
        mass: ``"exact"`` box integrals or ``"centre"`` (the paper's eq. 9).
        normalize: normalise masses over the box (the evaluated domain); otherwise the KDE mass
            outside the box joins the unevaluated rest.
        mass_target, max_cells: take cells by descending OP mass until their share reaches
            ``mass_target`` and/or ``max_cells`` cells.
        conservative_rest: count the unevaluated mass with ``λ = 1`` (default); ``False`` assumes the
            evaluated cells' average pmi for it.
        num_classes: number of classes (needed only when the model returns labels and cannot
            predict every class).
        failures: ``[(true, predicted), …]`` critical confusions; default any misclassification.
        method: ``"chernoff"`` (sound; default), ``"normal"`` (the paper's eq. 7),
            ``"clopper-pearson"`` (sound, Bonferroni) or ``"jeffreys"`` (Bayesian); see
            :mod:`pytest_dnnsafety.stats`. ``compare_methods`` adds others to ``alternatives``.
        confidence: ``1 − α`` of the bound, strictly between 0 and 1 (the paper: 0.975).
        alpha_op_share: the share of ``α`` the sound methods spend on OP uncertainty (bootstrap).
        posterior_draws: Monte Carlo draws for ``"jeffreys"``.
        seed: seeds the bootstrap, the cell samples and the posterior draws.
        device: where sampling and model calls happen (default: the profile's device).
        batch_size: model batch (rounded to blocks of :data:`BLOCK` samples) or ``"auto"`` (timed
            on the first batches; results do not depend on it).
        input_dtype: dtype of the model inputs.
        cells: ``"grid"`` (default; the arguments above) or ``"balls"`` — norm-ball cells around
            the operational inputs (METRICS.md §8: "cells … are norm balls around operational
            inputs"; the paper's remedy for high-dimensional inputs such as images):

            * ``profile`` gives the centres: raw operational inputs ``(N, *input_shape)`` (images
              are fine: no KDE is fitted) or an :class:`OperationalProfile` *without* an encoder
              (its data are the inputs). A latent profile holds only encodings: a
              :class:`ConfigError` asks for the raw inputs. Each of the ``M`` centres ``x_j`` is
              the centre of one cell ``B(x_j, ε) = {x : ‖x − x_j‖ ≤ ε}`` in input space.
            * ``Op_j = 1/M`` — the empirical operational profile (no KDE). With ``bootstrap ≥ 2``
              the OP uncertainty is the bootstrap of the operational sample: replicate ``b``
              gives ball ``j`` the mass ``W_bj/M`` (``W_b`` multinomial resampling counts), and
              ``V[Op_j] = (1/M)(1 − 1/M)/M`` is that bootstrap's exact variance (the multinomial
              variance of an empirical mass), used in eq. (6) without Monte Carlo noise. Eq. (6)
              ignores the multinomial's negative covariances, so its ``Var`` over-states the
              bootstrap variance of ``Σ Op_j λ_j`` — conservative. The sound methods take the
              bound's quantile over the ``W_b/M`` replicates exactly as for KDE masses.
              ``bootstrap=0`` takes the masses ``1/M`` as known (``V[Op_j] = 0``). The estimate
              ``Σ_j λ_j/M`` is the mean unastuteness of the ε-ball around a random operational
              input.
            * Ball types: labelled points (input space, flattened) inside the closed ball decide
              normal (they agree; their label is the ground truth) or cross-boundary (they
              disagree; ``λ_j = 1``); otherwise the ball is empty and its label is the model's
              majority vote on its samples (Assumption 5). Distances are exact, in chunks.
            * ``λ_j`` by Monte Carlo: ``samples_per_cell`` inputs uniform in the ball — L∞:
              uniform in the box ``[x_j − ε, x_j + ε] ∩ clip`` (exactly uniform on the clipped
              ball); L2: ``x_j + ε·U^{1/d}·g/‖g‖`` with ``g`` Gaussian, then clamped to ``clip``
              (the projection puts the mass outside the valid range on its faces; not exactly
              uniform on the clipped ball). Block-seeded as for grid cells: results do not
              depend on ``batch_size``.
            * Aggregation, ``method`` and ``compare_methods`` are the grid's. ``eps``, ``box``,
              ``bandwidth``, ``mass_target`` and ``max_cells`` are grid settings and raise a
              :class:`ConfigError` with balls (``mass``, ``normalize``, ``conservative_rest``
              are ignored: every ball is evaluated, nothing is left over).
        radius: ball radius ``ε`` (input space, under ``norm``), or ``None``/``"auto"``:
            ``min(eps_fraction · r̂, 0.1 · D)`` just below, with ``r̂`` the r-separation of the
            labelled data in input space under ``norm`` (Remark 2: a ball of radius below ``r̂``
            cannot hold inputs of two classes) and ``D`` the diameter under ``norm`` of the
            operational data's bounding box (of the ``clip`` cube when given) — the cap
            (:data:`AUTO_RADIUS_CAP`) keeps balls local when the classes are far apart (for
            images ``r̂`` can be a large share of the pixel range). ``radius ≥ r̂`` warns
            (:class:`ReliabilityWarning`, ``eps_exceeds_r``).
        norm: ``"linf"`` (default) or ``"l2"`` — the balls' norm (and ``r̂``'s for ``"auto"``).
        max_balls: evaluate a seeded random subsample (without replacement, in data order) of
            ``max_balls`` operational inputs; it is itself an empirical profile
            (``Op_j = 1/max_balls``). Default: all.
        clip: ``(lo, hi)`` — the valid input range (e.g. ``(0, 1)`` for images); samples are kept
            in it as above and operational inputs outside it are a :class:`DataError`. Default
            ``None``: no clipping (the plugin cannot know the valid range).

        empty_cell_label: how an empty cell (ball) — no labelled point inside — gets its label:
            ``"model"`` (default, the paper's Assumption 5: the model's majority vote on the
            cell's samples; a region the model gets consistently wrong then counts as correct) or
            ``"nearest"`` (the label of the nearest labelled point to the cell's centre, Euclidean,
            in the profile's space; :func:`nearest_labels`). Reported in ``detail``/``summary``.
        labelled_from_profile: whether the labelled points are a sample of the operational profile
            (default ``True``). Then the model's error on them, ``k`` of ``n``, has an exact
            Clopper–Pearson lower bound at ``confidence``
            (:func:`~pytest_dnnsafety.stats.labelled_error_check`); above ``Ub`` the labelled data
            refute the bound and the result lists a *contradiction* (check (a)). ``False`` (e.g.
            a curated test set with another class or condition mix) skips check (a) but records
            its figures in ``labelled_check``. Check (b) always runs when empty cells take the
            model's vote: on the evaluated cells holding labelled points (where the ground truth
            is known), the OP-weighted amount ``g`` by which the vote under-states the
            unastuteness; if ``E + g · (OP mass of the empty cells) > Ub`` the vote-labelled empty
            cells cannot be trusted and a contradiction is listed.
        accept_violated_assumptions: recorded in the result (``violations_accepted``); the gate
            compares the bound despite the ``violations`` it lists (``ε``/radius ``≥ r̂``,
            cross-boundary cells, labelled points outside the box) instead of reporting it as
            inconclusive.

    Every model query (Monte Carlo samples, the labelled points) goes through a
    :class:`~pytest_dnnsafety.outputs.ForwardGuard`: NaN/inf outputs raise a :class:`MetricError`
    naming the first bad batch after the loop (no host sync per batch).

    Raises:
        ConfigError: a bad setting (named, with the fix), e.g. ``eps`` larger than the box or a
            confidence outside (0, 1).
        DataError: empty or non-finite data.
        MetricError: the model's output has the wrong shape, or the profile has no mass in the box.
    """
    started = time.perf_counter()
    assessor = ReliabilityAssessor(profile, labelled, **options)
    engine = assessor.sample(model)
    result = assessor.finish(engine, model_queries=assessor.queries)
    return replace(result, seconds=time.perf_counter() - started)
