"""Occlusion interpretability: M_interpret and M_OccSen (Cheng et al. 2018, §II-F/G, eq. (5); docs: gates/interpretability.md).

An occluder of ``size`` pixels (``h × w``) slides over each image with ``stride``; the occluded
pixels take ``fill`` (a number, or ``"mean"``: the image's own per-channel mean). The positions
are the top-left corners ``0, s, 2s, …`` plus, when that misses the border, one last position
flush with it; with ``stride <= size`` the occluders cover every pixel. The *heat map* holds, per position, the
model's probability of the **original class** on the occluded image: the class the model
predicts on the clean image (``target="predicted"``, the paper's "originally classified
object"), or the true label (``target="label"``, for data whose clean errors should count).

* ``P_hot`` = positions whose value is below ``ρ`` (``0 < ρ < 1``);
* ``P_occluding`` = positions whose occluder overlaps the object's segmentation mask (box sums
  of the mask's integral image: all positions at once);
* ``M_interpret = |P_hot ∩ P_occluding| / |P_hot|`` (eq. 5: the share of the model's sensitive
  positions that lie on the object; high is good) and
  ``M_OccSen = |P_hot ∩ P_occluding| / |P_occluding|`` (the share of the object whose occlusion
  breaks the prediction; the paper reads a high value as fragility to partial occlusion).
  Paper example (Fig. 3b): 9 hot, 30 occluding, 5 in both → 5/9 and 5/30.

Empty cases, defined explicitly:

* **No hot position** (the prediction survives every occlusion): ``M_interpret`` is 0/0.
  ``no_hot="skip"`` (default) leaves such inputs out of the M_interpret aggregate (they are
  counted and reported; if every input is left out the metric is undefined and
  :meth:`OcclusionEngine.compute` raises). Counting them as 1.0 (``"one"``: "nothing
  misleading") would let a model that ignores the object entirely pass: a model reading only
  an empty corner of a digit never reacts to occlusion, so every input would score 1.0.
  ``"zero"`` counts them as 0.0 (the most conservative reading). ``M_OccSen`` is defined
  (``0/|P_occluding| = 0``: no part of the object is fragile).
* **No occluding position**: the grid covers the image, so this happens exactly when the mask
  is empty, i.e. the segmentation ground truth the metric assumes is missing. ``empty_mask=
  "error"`` (default) fails naming the first such input (a silent skip would hide a broken
  mask file); ``"skip"`` leaves those inputs out of both metrics and reports their number.
* **Clean probability already below ρ**: every position is hot, occluded or not (the paper
  assumes a confident detection). Kept, as eq. (5) defines it, and counted (``below_rho``), so a
  low value can be traced to unconfident inputs.

:class:`OcclusionEngine` keeps counts, minima, maxima, the per-input values (16 bytes per input,
for means that do not depend on the batch split) and the worst inputs (``topk`` states, ties
broken by the input index); it merges across workers and all-reduces across torchrun ranks.
:func:`assess_occlusion` runs a model, data and masks through it, batch by batch through the
:class:`~pytest_dnnsafety.engines.core.runner.Runner` (a ``DataLoader`` streams; only the masks, one
boolean per pixel, are held whole). Pure torch; no pytest import; no Python loop over positions
(the occluded copies of a batch go to the model in chunks: the chunking of one batch's queries, not
a pass over the data). A chunk holds as many images as the working-memory budget allows
(:func:`~pytest_dnnsafety.engines.core.budget.chunk_size`: the model's measured bytes per input and
the ``dnnsafety_max_memory`` budget, 1 GiB by default), at most ``max_batch`` when it is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.data.forms import known_length
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.engines.core.guard import ForwardGuard, eval_mode
from pytest_dnnsafety.engines.core.base import Engine, topk
from pytest_dnnsafety.engines.core.budget import chunk_size
from pytest_dnnsafety.engines.core.runner import Batch, Runner
from pytest_dnnsafety.engines.perturb.adversarial import OUTPUTS, detect_outputs, log_probs

__all__ = [
    "NO_HOT", "EMPTY_MASK", "TARGETS", "OcclusionEngine", "OcclusionResult", "assess_occlusion", "check_masks",
    "occlusion_positions", "occluding_positions", "occlusion_maps", "interpretation_counts",
]

NO_HOT = ("skip", "one", "zero")
EMPTY_MASK = ("error", "skip")
TARGETS = ("predicted", "label")
#: Inputs listed as the worst in the details; maps kept for the plot.
WORST_INPUTS = 5
#: The leading columns of a worst-input row of :class:`OcclusionEngine` (the heat map and the occluding set follow).
ROW_COLUMNS = ("key", "index", "class", "p_clean", "hot", "occluding", "both", "m_interpret", "m_occsen")
#: At most this many input elements per forward pass of occluded copies (~128 MB of float32), whatever the budget.
MAX_ELEMENTS = 2**25
_NONE = torch.iinfo(torch.int64).max


# ----------------------------------------------------------------------------- geometry


def _pair(value: Any, name: str) -> tuple[int, int]:
    items = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(items) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in items):
        raise ConfigError(f"occlusion: {name}={value!r} is not a positive integer or a pair (h, w) of them. Fix: e.g. "
                          f"{name}=3 or {name}=(2, 4).")
    return items  # type: ignore[return-value]


def occlusion_positions(height: int, width: int, size: Any, stride: Any = 1) -> tuple[Tensor, Tensor]:
    """Top-left rows ``(Ph,)`` and columns ``(Pw,)`` of the occluder; position ``i·Pw + j`` is ``(rows[i], cols[j])``.

    Starts ``0, s, 2s, …`` and, when the last one leaves the border uncovered, one flush with it.
    An occluder larger than the image, or a stride larger than the occluder (pixels that are never
    occluded), is a :class:`ConfigError`.
    """
    (h, w), (sh, sw) = _pair(size, "size"), _pair(stride, "stride")
    if h > height or w > width:
        raise ConfigError(f"occlusion: the occluder {h}x{w} is larger than the images ({height}x{width}). Fix: give "
                          f"size= at most ({height}, {width}).")
    if sh > h or sw > w:
        raise ConfigError(f"occlusion: stride {sh}x{sw} is larger than the occluder {h}x{w}: the pixels between two "
                          f"positions would never be occluded. Fix: give stride= at most size=.")

    def starts(extent: int, k: int, s: int) -> Tensor:
        out = torch.arange(0, extent - k + 1, s, dtype=torch.int64)
        if int(out[-1]) != extent - k:
            out = torch.cat([out, torch.tensor([extent - k])])
        return out

    return starts(height, h, sh), starts(width, w, sw)


def _device_positions(height: int, width: int, size: Any, stride: Any, device: torch.device,
                      positions: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """:func:`occlusion_positions` on ``device``: ``positions`` when given (built once by a caller's loop), else
    built on the host and copied asynchronously."""
    if positions is None:
        positions = occlusion_positions(height, width, size, stride)
    # towards an accelerator: asynchronous copies (no wait in a device loop); a device-to-host copy stays blocking
    non_blocking = device.type != "cpu"
    return positions[0].to(device, non_blocking=non_blocking), positions[1].to(device, non_blocking=non_blocking)


def occluding_positions(masks: Tensor, size: Any, stride: Any = 1, *,
                        positions: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """``(N, Ph·Pw)`` bool: the occluder at that position covers at least one mask pixel.

    ``masks``: ``(N, H, W)`` bool. One integral image per mask; every position's box sum at once.
    ``positions``: the occluder's ``(rows, cols)`` from :func:`occlusion_positions` for these
    masks' size, ``size`` and ``stride``, ideally already on the masks' device (a loop builds them
    once); built here when None.
    """
    n, height, width = masks.shape
    (h, w) = _pair(size, "size")
    rows, cols = _device_positions(height, width, size, stride, masks.device, positions)
    s = torch.zeros((n, height + 1, width + 1), dtype=torch.int64, device=masks.device)
    s[:, 1:, 1:] = masks.to(torch.int64).cumsum(1).cumsum(2)
    top, bottom = s[:, rows], s[:, rows + h]  # (N, Ph, W+1)
    box = bottom[:, :, cols + w] - top[:, :, cols + w] - bottom[:, :, cols] + top[:, :, cols]
    return (box > 0).reshape(n, -1)


# ----------------------------------------------------------------------------- heat maps


def _probabilities(out: Tensor, outputs: str, cls: Tensor) -> Tensor:
    return log_probs(out.to(torch.float64), outputs).gather(1, cls.reshape(-1, 1)).squeeze(1).exp()


def occlusion_maps(model: Any, x: Tensor, *, size: Any, stride: Any = 1, fill: float | str = 0.0,
                   target: Tensor | None = None, outputs: str = "auto", max_batch: int | None = None,
                   guard: ForwardGuard | None = None, clean_guard: ForwardGuard | None = None,
                   positions: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor, str]:
    """Heat maps ``(N, Ph·Pw)`` (float64) of images ``x`` ``(N, …, H, W)``, the class used ``(N,)``, ``p_clean`` and
    what the outputs are (``"logits"`` or ``"probabilities"``, detected when ``outputs="auto"``).

    The value at a position is the probability of ``target`` (default: the clean prediction) on
    the image with that position occluded. All ``N·P`` occluded copies go to the model in
    chunks sized from the working-memory budget (see the module docstring; at most ``max_batch``
    images when given, and at most :data:`MAX_ELEMENTS` input values),
    through ``guard``; call ``guard.check()`` after the loop. ``positions``: the occluder's
    ``(rows, cols)`` as from :func:`occlusion_positions` (ideally on ``x``'s device, built once
    outside a batch loop); built here when None.
    """
    if not isinstance(x, Tensor) or x.ndim < 3:
        raise DataError(f"occlusion: the images must be a tensor (N, C, H, W) or (N, H, W), got {type(x).__name__} "
                        f"{tuple(getattr(x, 'shape', ()))}.")
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
        raise ConfigError(f"occlusion: max_batch={max_batch!r} is not a positive integer (or None: from the memory "
                          "budget).")
    guard = guard or ForwardGuard("occlusion: model on occluded images")
    clean_guard = clean_guard or ForwardGuard("occlusion: model on clean images")
    n, height, width = x.shape[0], x.shape[-2], x.shape[-1]
    (h, w) = _pair(size, "size")
    rows, cols = _device_positions(height, width, size, stride, x.device, positions)
    pw, npos = cols.shape[0], rows.shape[0] * cols.shape[0]
    with torch.no_grad():
        out = clean_guard(model, x)
        resolved = detect_outputs(out) if outputs == "auto" else outputs
        cls = out.argmax(dim=1) if target is None else target.to(out.device, torch.int64)
        cls = cls.clamp(0, out.shape[1] - 1)
        p_clean = _probabilities(out, resolved, cls)
        if isinstance(fill, str) and fill != "mean":
            raise ConfigError(f"occlusion: fill={fill!r} is neither a number nor 'mean'.")
        fills = (x.mean(dim=(-2, -1), keepdim=True) if fill == "mean"  # per image and channel
                 else torch.full((n,) + (1,) * (x.ndim - 1), float(fill), dtype=x.dtype, device=x.device))
        ar_h, ar_w = torch.arange(height, device=x.device), torch.arange(width, device=x.device)
        # the occluded copies, the box masks and the chunk's probabilities beside the model's own working memory
        cap = MAX_ELEMENTS // max(1, x[0].numel()) if max_batch is None else min(max_batch, MAX_ELEMENTS //
                                                                                 max(1, x[0].numel()))
        chunk = chunk_size(model, x, extra=3 * x[0].numel() * x.element_size() + height * width, cap=max(1, cap))
        values = []
        for start in range(0, n * npos, chunk):
            k = torch.arange(start, min(start + chunk, n * npos), device=x.device)
            b, p = k // npos, k % npos
            r, c = rows[p // pw], cols[p % pw]
            in_r = (ar_h[None] >= r[:, None]) & (ar_h[None] < r[:, None] + h)  # (K, H)
            in_c = (ar_w[None] >= c[:, None]) & (ar_w[None] < c[:, None] + w)  # (K, W)
            box = (in_r[:, :, None] & in_c[:, None, :]).reshape((k.shape[0],) + (1,) * (x.ndim - 3) + (height, width))
            occluded = torch.where(box, fills[b], x[b])
            values.append(_probabilities(guard(model, occluded), resolved, cls[b]))
    return torch.cat(values).reshape(n, npos), cls, p_clean, resolved


def interpretation_counts(hot: Tensor, occluding: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per input ``|P_hot|``, ``|P_occluding|``, ``|P_hot ∩ P_occluding|`` from ``(N, P)`` bool sets (int64)."""
    if hot.shape != occluding.shape or hot.ndim != 2:
        raise ValueError(f"hot and occluding must both be (N, P); got {tuple(hot.shape)} and {tuple(occluding.shape)}")
    hot, occluding = hot.to(torch.bool), occluding.to(torch.bool)
    return hot.sum(1), occluding.sum(1), (hot & occluding).sum(1)


def _per_input(n_hot: Tensor, n_occ: Tensor, n_both: Tensor, no_hot: str) -> tuple[Tensor, Tensor]:
    """Per-input M_interpret and M_OccSen (float64; NaN where left out, see the module docstring)."""
    both, empty_hot = n_both.to(torch.float64), {"skip": math.nan, "one": 1.0, "zero": 0.0}[no_hot]
    interpret = torch.where(n_hot > 0, both / n_hot.clamp_min(1), empty_hot)
    return (torch.where(n_occ > 0, interpret, math.nan),
            torch.where(n_occ > 0, both / n_occ.clamp_min(1), math.nan))


# ----------------------------------------------------------------------------- engine


@dataclass(frozen=True)
class OcclusionResult:
    """M_interpret and M_OccSen over ``n`` inputs: means, minima, maxima and the left-out counts.

    ``n_interpret`` / ``n_occsen``: inputs in each aggregate; ``no_hot``: inputs without a hot
    position; ``empty_masks``: inputs whose mask is empty (only with ``empty_mask="skip"``);
    ``hot_total``/``occluding_total``/``both_total``: the pooled set sizes. A metric with no
    input in its aggregate is NaN. ``worst_inputs`` and ``maps`` are filled by
    :func:`assess_occlusion`.
    """

    n: int
    n_interpret: int
    n_occsen: int
    no_hot: int
    empty_masks: int
    interpret_mean: float
    interpret_min: float
    interpret_max: float
    occsen_mean: float
    occsen_min: float
    occsen_max: float
    hot_total: int
    occluding_total: int
    both_total: int
    below_rho: int = 0
    setup: dict[str, Any] | None = None
    worst_inputs: tuple[dict[str, Any], ...] = ()
    maps: tuple[dict[str, Any], ...] = ()

    def value(self, metric: str, aggregate: str = "mean") -> float:
        """``metric`` ("interpret" or "occsen") aggregated by "mean", "min" or "max"; MetricError when undefined."""
        if metric not in ("interpret", "occsen") or aggregate not in ("mean", "min", "max"):
            raise ValueError(f"unknown metric/aggregate {metric!r}/{aggregate!r}")
        count = self.n_interpret if metric == "interpret" else self.n_occsen
        if count == 0:
            why = (f"none of the {self.n} inputs has a hot position (no occlusion drops the original class's "
                   f"probability below ρ) and no_hot='skip' leaves them out" if metric == "interpret"
                   else f"all {self.n} inputs have empty masks")
            raise MetricError(f"occlusion: M_{metric} is undefined: {why}. Fix: raise rho=, use a larger occluder "
                              f"(size=), or choose no_hot='one'/'zero' to count such inputs.")
        return float(getattr(self, f"{metric}_{aggregate}"))

    def detail(self) -> str:
        """``M_interpret mean 0.994 (min 0.649, max 1.000, n=247), M_OccSen mean …; 53 of 300 without hot positions``."""
        parts = [f"{label} mean {getattr(self, k + '_mean'):.3f} (min {getattr(self, k + '_min'):.3f}, max "
                 f"{getattr(self, k + '_max'):.3f}, n={count})" if count else f"{label} undefined (n=0)"
                 for label, k, count in (("M_interpret", "interpret", self.n_interpret),
                                         ("M_OccSen", "occsen", self.n_occsen))]
        extra = f"; {self.no_hot} of {self.n} inputs without hot positions"
        extra += f", {self.below_rho} already below ρ unoccluded (every position hot)" if self.below_rho else ""
        extra += f", {self.empty_masks} with empty masks (left out)" if self.empty_masks else ""
        return ", ".join(parts) + extra

    def to_details(self) -> dict[str, object]:
        """JSON-able details (NaN as the string 'nan')."""
        out: dict[str, object] = {"metric": "occlusion_interpretability", **(self.setup or {})}
        out.update({k: int(getattr(self, k)) for k in ("n", "n_interpret", "n_occsen", "hot_total", "occluding_total",
                                                        "both_total", "below_rho")})
        out.update(n_no_hot=int(self.no_hot), n_empty_masks=int(self.empty_masks))
        out.update({f"{m}_{a}": _json_float(getattr(self, f"{m}_{a}")) for m in ("interpret", "occsen")
                    for a in ("mean", "min", "max")})
        out["worst_inputs"] = [{k: _json_float(v) if isinstance(v, float) else v for k, v in item.items()}
                               for item in self.worst_inputs]
        out["maps"] = [dict(item) for item in self.maps]
        return out


def _json_float(value: float) -> float | str:
    value = float(value)
    return value if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))


class OcclusionEngine(Engine):
    """Counts, minima, maxima and per-input values of M_interpret and M_OccSen (see the module docstring).

    States: ``n``, ``n_interpret``, ``n_occsen``, ``no_hot``, ``empty_masks``, ``hot``,
    ``occluding``, ``both``, ``below_rho`` (int64 sums); ``interpret_min``/``occsen_min`` (min),
    ``interpret_max``/``occsen_max`` (max); ``first_empty`` (int64 min: the first input with an
    empty mask); ``per_input`` (``cat``, rows ``(M_interpret, M_OccSen)`` in float64, NaN where
    left out: 16 bytes per input, never the images), whose sums give the means, so the means do not
    depend on the batch split, the merge order or the torchrun shards. With ``worst=k`` (and the
    heat maps' ``positions``) two ``topk`` states keep the ``k`` inputs with the lowest M_interpret
    (``lowest_interpret``) and the highest M_OccSen (``highest_occsen``), ties broken by the input
    index, as rows ``(key, index, class, p_clean, |P_hot|, |P_occluding|, |P_hot ∩ P_occluding|,
    M_interpret, M_OccSen, heat map…, occluding set…)`` (float64; see :data:`ROW_COLUMNS`).
    """

    def __init__(self, no_hot: str = "skip", empty_mask: str = "error", worst: int = 0, positions: int = 0,
                 device: torch.device | str | None = None) -> None:
        super().__init__(device)
        if no_hot not in NO_HOT:
            raise ConfigError(f"occlusion: no_hot={no_hot!r} is not one of {list(NO_HOT)}.")
        if empty_mask not in EMPTY_MASK:
            raise ConfigError(f"occlusion: empty_mask={empty_mask!r} is not one of {list(EMPTY_MASK)}.")
        for name, value in (("worst", worst), ("positions", positions)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"occlusion: {name}={value!r} is not an integer >= 0.")
        self.no_hot_rule, self.empty_mask_rule, self.worst, self.positions = no_hot, empty_mask, worst, positions
        i64, f64 = torch.int64, torch.float64
        for name in ("n", "n_interpret", "n_occsen", "no_hot", "empty_masks", "hot", "occluding", "both", "below_rho"):
            self.add_state(name, torch.zeros((), dtype=i64), "sum")
        for metric in ("interpret", "occsen"):
            self.add_state(f"{metric}_min", torch.tensor(math.inf, dtype=f64), "min")
            self.add_state(f"{metric}_max", torch.tensor(-math.inf, dtype=f64), "max")
        self.add_state("first_empty", torch.tensor(_NONE, dtype=i64), "min")
        self.add_state("per_input", torch.zeros((0, 2), dtype=f64), "cat")
        if worst:
            width = len(ROW_COLUMNS) + 2 * positions
            self.add_state("lowest_interpret", torch.zeros((0, width), dtype=f64),
                           topk(worst, 0, largest=False, tie_break=1))
            self.add_state("highest_occsen", torch.zeros((0, width), dtype=f64), topk(worst, 0, tie_break=1))

    def config(self) -> dict[str, Any]:
        return {"no_hot": self.no_hot_rule, "empty_mask": self.empty_mask_rule, "worst": self.worst,
                "positions": self.positions}

    def update(self, hot: Tensor, occluding: Tensor, start: int = 0, below_rho: Tensor | None = None, *,
               maps: Tensor | None = None, cls: Tensor | None = None,
               p_clean: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Fold in ``(N, P)`` bool sets of inputs ``start…start+N-1``; returns per-input (M_interpret, M_OccSen).

        ``below_rho`` ``(N,)`` bool: the clean probability is already below ρ (counted only). With
        ``worst > 0``, ``maps`` ``(N, P)``, ``cls`` and ``p_clean`` ``(N,)`` feed the worst inputs'
        rows. No host synchronisation; NaN marks an input left out of an aggregate.
        """
        n_hot, n_occ, n_both = (t.to(self.device) for t in interpretation_counts(hot, occluding))
        interpret, occsen = _per_input(n_hot, n_occ, n_both, self.no_hot_rule)
        empty = n_occ == 0
        self.n = self.n + n_hot.shape[0]
        if below_rho is not None:
            self.below_rho = self.below_rho + below_rho.to(self.device, torch.bool).sum()
        self.empty_masks = self.empty_masks + empty.sum()
        self.no_hot = self.no_hot + ((n_hot == 0) & ~empty).sum()
        self.hot, self.occluding, self.both = self.hot + n_hot.sum(), self.occluding + n_occ.sum(), self.both + n_both.sum()
        if n_hot.numel() == 0:
            return interpret, occsen
        idx = torch.arange(start, start + n_hot.shape[0], device=self.device)
        self.first_empty = torch.minimum(self.first_empty, torch.where(empty, idx, _NONE).min())
        for metric, per in (("interpret", interpret), ("occsen", occsen)):
            ok = ~torch.isnan(per)
            setattr(self, f"n_{metric}", getattr(self, f"n_{metric}") + ok.sum())
            lo, hi = torch.where(ok, per, math.inf).min(), torch.where(ok, per, -math.inf).max()
            setattr(self, f"{metric}_min", torch.minimum(getattr(self, f"{metric}_min"), lo))
            setattr(self, f"{metric}_max", torch.maximum(getattr(self, f"{metric}_max"), hi))
        self.append_state("per_input", torch.stack([interpret, occsen], dim=1))
        if self.worst:
            if maps is None or cls is None or p_clean is None:
                raise ValueError("OcclusionEngine(worst>0).update needs maps=, cls= and p_clean= for the worst inputs")
            f64 = {"dtype": torch.float64, "device": self.device}
            rows = torch.cat([torch.stack([interpret, idx.to(**f64), cls.to(**f64), p_clean.to(**f64),
                                           n_hot.to(**f64), n_occ.to(**f64), n_both.to(**f64), interpret, occsen], 1),
                              maps.to(**f64), occluding.to(**f64)], dim=1)
            self.append_state("lowest_interpret", rows)  # NaN keys rank last: left-out inputs never win
            self.append_state("highest_occsen", torch.cat([torch.nan_to_num(occsen, nan=-math.inf)[:, None],
                                                           rows[:, 1:]], dim=1))
        return interpret, occsen

    def compute(self) -> OcclusionResult:
        """The aggregates (one host sync). Raises DataError for an empty mask under ``empty_mask="error"``."""
        n = int(self.n)
        if n == 0:
            raise MetricError("occlusion: no inputs were folded in. Fix: give the gate data with at least one image.")
        empty = int(self.empty_masks)
        if empty and self.empty_mask_rule == "error":
            raise DataError(f"occlusion: {empty} of {n} masks are empty (the first is input {int(self.first_empty)}): "
                            f"no occluder position overlaps the object, so M_OccSen is 0/0 and the input has no "
                            f"segmentation ground truth. Fix: correct the masks, or pass empty_mask='skip' to leave "
                            f"such inputs out.")
        per = self.per_input
        sums = torch.where(torch.isnan(per), 0.0, per).sum(dim=0).tolist()
        fields: dict[str, Any] = {}
        for metric, total in zip(("interpret", "occsen"), sums):
            count = fields[f"n_{metric}"] = int(getattr(self, f"n_{metric}"))
            fields[f"{metric}_mean"] = total / count if count else math.nan
            for agg in ("min", "max"):
                fields[f"{metric}_{agg}"] = float(getattr(self, f"{metric}_{agg}")) if count else math.nan
        return OcclusionResult(n=n, no_hot=int(self.no_hot), empty_masks=empty, hot_total=int(self.hot),
                               occluding_total=int(self.occluding), both_total=int(self.both),
                               below_rho=int(self.below_rho), **fields)


# ----------------------------------------------------------------------------- runner


def check_masks(masks: Any, what: str = "masks") -> Tensor:
    """Masks as a ``(N, H, W)`` bool tensor: from a tensor, array or ``{"masks": …}``, ``(N, H, W)`` or ``(N, 1, H, W)``.

    Values must be booleans or 0/1 (a soft mask is refused rather than thresholded silently).
    """
    if isinstance(masks, dict):
        if "masks" not in masks:
            raise DataError(f"{what}: a dict of arrays needs key 'masks'; got {sorted(masks)}.")
        masks = masks["masks"]
    try:
        m = masks.detach() if isinstance(masks, Tensor) else torch.as_tensor(masks)
    except Exception as exc:
        raise DataError(f"{what}: cannot be turned into a tensor ({type(masks).__name__}): {exc}") from exc
    if m.ndim == 4 and m.shape[1] == 1:
        m = m[:, 0]
    if m.ndim != 3 or m.shape[0] == 0:
        raise DataError(f"{what}: expected one boolean segmentation mask per input, shape (N, H, W) or (N, 1, H, W); "
                        f"got shape {tuple(m.shape)}.")
    if m.dtype != torch.bool:
        if m.is_complex() or not bool(((m == 0) | (m == 1)).all()):
            raise DataError(f"{what}: mask values must be booleans or 0/1; got dtype {str(m.dtype).replace('torch.', '')} "
                            f"with other values. Fix: binarise the masks, e.g. masks > 0.5.")
        m = m != 0
    return m


def _check_options(rho: Any, fill: Any, target: str, outputs: str, batch_size: Any) -> None:
    def real(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    problems = [f"rho={rho!r} is outside (0, 1) (the probability below which a position is hot, e.g. 0.5)"
                if not (real(rho) and 0 < rho < 1) else "",
                f"fill={fill!r} is neither a finite number nor 'mean'" if not (real(fill) or fill == "mean") else "",
                f"target={target!r} is not one of {list(TARGETS)}" if target not in TARGETS else "",
                f"outputs={outputs!r} is not one of {['auto', *OUTPUTS]}" if outputs not in ("auto", *OUTPUTS) else "",
                f"batch_size={batch_size!r} is not a positive integer"
                if not (real(batch_size) and isinstance(batch_size, int) and batch_size >= 1) else ""]
    if any(problems):
        raise ConfigError(f"occlusion: {next(p for p in problems if p)}.")


def _mismatch(images: str, m_shape: tuple[int, ...], why: str) -> DataError:
    return DataError(f"occlusion: the masks do not match the data: {why} ({images}, masks {m_shape}). Fix: give one "
                     f"mask (N, H, W) per input, in the data's order and spatial size.")


_INT_COLUMNS = frozenset({"index", "class", "hot", "occluding", "both"})


def _rows(top: Tensor) -> list[dict[str, Any]]:
    """The kept rows as dicts (rows whose M_interpret is NaN, i.e. left out, dropped)."""
    lists = top[:, 1:len(ROW_COLUMNS)].cpu().tolist()
    return [{name: int(v) if name in _INT_COLUMNS else v for name, v in zip(ROW_COLUMNS[1:], row)}
            for row in lists if not math.isnan(row[ROW_COLUMNS.index("m_interpret") - 1])]


def _map(top: Tensor, metric: str, why: str, shape: tuple[int, int], rho: float) -> list[dict[str, Any]]:
    """The first kept row's heat map, hot and occluding sets as nested lists (for a plot); none if it is left out."""
    if top.shape[0] == 0 or math.isnan(float(top[0, ROW_COLUMNS.index(metric)])):
        return []
    first, p = top[0].cpu(), shape[0] * shape[1]
    heat, occ = first[len(ROW_COLUMNS):len(ROW_COLUMNS) + p].reshape(shape), first[len(ROW_COLUMNS) + p:].reshape(shape)
    return [{"index": int(first[1]), "why": why, "rho": rho, "heatmap": [[round(v, 6) for v in r]
             for r in heat.tolist()], "hot": (heat < rho).to(torch.int64).tolist(),
             "occluding": occ.to(torch.int64).tolist()}]


def assess_occlusion(model: Any, data: Any, masks: Any, *, size: Any, stride: Any = 1, fill: float | str = 0.0,
                     rho: float = 0.5, target: str = "predicted", no_hot: str = "skip", empty_mask: str = "error",
                     outputs: str = "auto", batch_size: int = 256, max_batch: int | None = None,
                     device: torch.device | str = "cpu", shard: Any = None) -> OcclusionResult:
    """M_interpret and M_OccSen (eq. 5) of ``model`` on images ``data`` with segmentation ``masks`` aligned to them.

    ``masks``: ``(N, H, W)`` (or ``(N, 1, H, W)``) booleans, one per input of ``data`` (images
    ``(N, C, H, W)``), in the same order; a different count or spatial size is a
    :class:`DataError` naming both shapes. The model runs in eval mode (restored after) on its own
    device (``device`` for a model without parameters); every query goes through a
    :class:`ForwardGuard`. See the module docstring for ``target``, ``no_hot``, ``empty_mask``.
    The batches go through a :class:`~pytest_dnnsafety.engines.core.runner.Runner` (a ``DataLoader``
    streams); ``shard``: this torchrun rank's :class:`~pytest_dnnsafety.runtime.torchrun.Shard` of the data
    (the engine's states are then all-reduced: every rank gets the single-process result).
    """
    _check_options(rho, fill, target, outputs, batch_size)
    m_all = check_masks(masks)
    n_masks = m_all.shape[0]
    known = known_length(data)
    if known is not None and known != n_masks:
        raise _mismatch(f"{known} images", tuple(m_all.shape), f"{known} inputs but {n_masks} masks")
    rows, cols = occlusion_positions(m_all.shape[1], m_all.shape[2], size, stride)
    grid = (int(rows.shape[0]), int(cols.shape[0]))
    runner = Runner("occlusion", model=model, device=device, batch_size=batch_size, shard=shard,
                    labels="optional" if target == "label" else "ignored")
    dev = runner.device
    acc = torch.device("cpu") if dev.type == "mps" else dev
    engine = OcclusionEngine(no_hot, empty_mask, worst=WORST_INPUTS, positions=grid[0] * grid[1], device=acc)
    # the occluder positions on the model's device, once (not one host-to-device copy per batch)
    positions = (rows.to(dev, non_blocking=True), cols.to(dev, non_blocking=True))
    clean_guard = runner.guard("occlusion: model on clean images")
    guard = runner.guard("occlusion: model on occluded images")
    resolved = None if outputs == "auto" else outputs

    def step(batch: Batch) -> None:
        nonlocal resolved
        x, b = batch.x, batch.n
        if x.ndim < 3 or tuple(x.shape[-2:]) != tuple(m_all.shape[1:]):
            raise _mismatch(f"images {tuple(x.shape)}", tuple(m_all.shape), "the spatial sizes differ")
        if batch.start + b > n_masks:
            raise _mismatch(f"images ({batch.start + b}+, {', '.join(map(str, x.shape[1:]))})", tuple(m_all.shape),
                            f"more inputs than the {n_masks} masks")
        if target == "label":
            if batch.y is None:
                raise DataError("occlusion: target='label' needs labelled data (x, y). Fix: give labels or use "
                                "target='predicted'.")
            runner.observe_range("labels", batch.y)
        maps, cls, p_clean, resolved = occlusion_maps(
            model, x, size=size, stride=stride, fill=fill, target=batch.y, outputs=resolved or "auto",
            max_batch=max_batch, guard=guard, clean_guard=clean_guard, positions=positions)
        occ = occluding_positions(m_all[batch.start:batch.start + b].to(dev, non_blocking=dev.type != "cpu"), size,
                                  stride, positions=positions)
        engine.update(maps < rho, occ, start=batch.start, below_rho=p_clean < rho, maps=maps, cls=cls,
                      p_clean=p_clean)

    with eval_mode(model):
        runner.run(data, step, engine)
    done = runner.n_inputs if shard is None else int(engine.n)
    if done != n_masks:
        raise _mismatch(f"{done} images", tuple(m_all.shape), f"{done} inputs but {n_masks} masks")
    _check_label_range(runner, shard, clean_guard.num_classes or 0)
    result = engine.compute()
    setup = {"size": list(_pair(size, "size")), "stride": list(_pair(stride, "stride")), "fill": fill,
             "rho": float(rho), "target": target, "no_hot": no_hot, "empty_mask": empty_mask, "positions": list(grid)}
    maps_out = (_map(engine.lowest_interpret, "m_interpret", "lowest M_interpret", grid, float(rho))
                + _map(engine.highest_occsen, "m_occsen", "highest M_OccSen", grid, float(rho)))
    return OcclusionResult(**{**result.__dict__, "setup": setup, "worst_inputs": tuple(_rows(engine.lowest_interpret)),
                              "maps": tuple(maps_out)})


def _check_label_range(runner: Runner, shard: Any, classes: int) -> None:
    """``target="label"``: every label must be a class of the model (the ranks' ranges gathered under a shard)."""
    seen = runner.range("labels")
    if shard is not None:
        from pytest_dnnsafety.runtime import torchrun as ranks

        seen = [r for r in ranks.gather(seen) if r is not None]
        seen = (min(r[0] for r in seen), max(r[1] for r in seen)) if seen else None
    if seen is not None and (seen[0] < 0 or seen[1] >= classes):
        lo, hi = int(seen[0]), int(seen[1])
        raise DataError(f"occlusion: labels range over [{lo}, {hi}] but the model has {classes} classes. "
                        f"Fix: give class indices 0..{classes - 1}.")
