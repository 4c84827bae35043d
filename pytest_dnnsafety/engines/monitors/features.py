"""Feature-based runtime monitors: outside-the-box, neuron activation patterns, Mahalanobis (Ferreira et al.; docs: gates/monitors.md).

All three read per-neuron features of one hidden layer from the session's shared pass
(:meth:`MonitorView.features`: an (N, c) matrix; a conv layer's channel reduced by its spatial ``max`` or
``mean``), learn a per-class description of the ID features at fit and score an input against the
description of its *predicted* class (at run time there are no labels). Fit inputs are assigned to classes by
``by``: ``"auto"`` (default) = their labels when the data has labels, else the model's predictions (recorded as
``fitted_by`` in :meth:`Monitor.config`); ``"label"`` insists on labels (:class:`DataError` without);
``"prediction"`` uses the predictions.

A predicted class the fit data never had has no description: outside-the-box scores it :data:`UNSEEN_SCORE`
(finite, above any distance), activation patterns ``c + 1`` (above any Hamming distance), Mahalanobis leaves
it out of the minimum. Everything is batched (no loops over inputs, neurons or classes) and runs on the
features' device. Pure torch; no pytest import.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from pytest_dnnsafety.engines.core.capture import REDUCTIONS
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.data.checks import check_choice, check_count, check_positive
from pytest_dnnsafety.engines.monitors.base import BY_CHOICES, Monitor, MonitorView, fit_classes, n_classes

__all__ = ["OutsideTheBox", "ActivationPatterns", "Mahalanobis", "ClassGaussianStats", "UNSEEN_SCORE",
           "kmeans_by_class", "pack_patterns", "unpack_patterns", "hamming_distances"]

#: Outside-the-box score of an input whose predicted class has no box (no fit input of that class).
UNSEEN_SCORE = 1e30

#: Elements per intermediate tensor of the chunked (inputs × boxes/patterns) computations.
_CHUNK = 1 << 22


def _rows_per_chunk(per_row: int) -> int:
    return max(1, _CHUNK // max(1, per_row))


class _FeatureMonitor(Monitor):
    """Common arguments of the feature monitors: ``layer``, ``reduce``, ``by``."""

    def __init__(self, layer: str, *, reduce: str, by: str, **kw: Any) -> None:
        super().__init__(**kw)
        if not isinstance(layer, str) or not layer:
            raise ConfigError(f"layer={layer!r} must be a module name of the model (as in model.named_modules(), "
                              f"e.g. 'features.3'). Fix: name the hidden layer whose features the monitor reads.")
        self.layer = layer
        self.reduce = check_choice(reduce, "reduce", REDUCTIONS)
        self.by = check_choice(by, "by", BY_CHOICES)
        self.fitted_by: str | None = None
        self.num_classes: int | None = None

    def layers(self) -> tuple[str, ...]:
        return (self.layer,)

    def _features(self, view: MonitorView) -> Tensor:
        return view.features(self.layer, self.reduce)

    def _fit_data(self, view: MonitorView) -> tuple[Tensor, Tensor, int]:
        feats = self._features(view)
        classes, self.fitted_by = fit_classes(view, self.by, f"monitor {self.name!r}")
        classes = classes.to(feats.device)
        k = n_classes(view, classes)
        self.num_classes = k
        return feats, classes, k

    def _config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layer": self.layer, "reduce": self.reduce, "by": self.by}
        if self.fitted_by is not None:
            out["fitted_by"] = self.fitted_by
        return out

    def _check_same_shape(self, other: Monitor, mine: Tensor, theirs: Tensor, what: str) -> None:
        if mine.shape != theirs.shape:
            raise ConfigError(f"cannot merge monitor {self.name!r}: its {what} has shape {tuple(mine.shape)} here and "
                              f"{tuple(theirs.shape)} there (a different layer width or number of classes). Fix: "
                              f"fit both on the same model and layer.")


# ----------------------------------------------------------------------------- outside the box


def _sample_rows(weights: Tensor, u: Tensor) -> Tensor:
    """Per row of ``weights`` (R, n) one index drawn with probability ∝ weight, by inverse CDF at ``u`` (R,)."""
    cdf = weights.cumsum(dim=1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max(weights.shape[1] - 1)


def _sq_dist(x: Tensor, centers: Tensor) -> Tensor:
    """Batched squared Euclidean distances ``(B, n, c) × (B, M, c) -> (B, n, M)``."""
    xx = (x * x).sum(-1, keepdim=True)
    cc = (centers * centers).sum(-1).unsqueeze(1)
    return torch.baddbmm(xx + cc, x, centers.transpose(1, 2), alpha=-2.0).clamp_min_(0.0)


def kmeans_by_class(features: Tensor, classes: Tensor, num_classes: int, clusters: int, generator: torch.Generator,
                    max_iter: int = 100) -> Tensor:
    """k-means with k-means++ seeding (Arthur & Vassilvitskii 2007) inside every class, all classes at once.

    The classes' points are padded into one ``(K, n_max, c)`` tensor with a mask, so seeding (inverse-CDF
    draws from the D² distribution, uniforms from the CPU ``generator``: the same draws on every device) and
    the Lloyd iterations (assignment by batched distances, centres by batched one-hot matrix products) run for
    every class in the same kernels. An empty cluster keeps its centre (and gets no box). Stops when no
    assignment changes (one host read per iteration) or after ``max_iter`` iterations. Returns the cluster
    (0..clusters-1) of every input.
    """
    device, n, c = features.device, features.shape[0], features.shape[1]
    x = features.to(torch.float64)
    order = torch.argsort(classes, stable=True)
    counts = torch.bincount(classes, minlength=num_classes)
    n_max = int(counts.max())
    offsets = counts.cumsum(0) - counts
    cls_sorted = classes[order]
    pos = torch.arange(n, device=device) - offsets[cls_sorted]
    pts = torch.zeros(num_classes, n_max, c, dtype=torch.float64, device=device)
    pts[cls_sorted, pos] = x[order]
    mask = torch.zeros(num_classes, n_max, dtype=torch.bool, device=device)
    mask[cls_sorted, pos] = True
    maskf = mask.to(torch.float64)
    rows = torch.arange(num_classes, device=device)

    u = torch.rand(num_classes, clusters, generator=generator, dtype=torch.float64).to(device)
    first = pts[rows, _sample_rows(maskf, u[:, 0])]
    centers = [first]
    d2 = ((pts - first.unsqueeze(1)) ** 2).sum(-1) * maskf
    for m in range(1, clusters):
        weights = torch.where((d2.sum(1) > 0).unsqueeze(1), d2, maskf)  # all points on centres: uniform
        nxt = pts[rows, _sample_rows(weights, u[:, m])]
        centers.append(nxt)
        d2 = torch.minimum(d2, ((pts - nxt.unsqueeze(1)) ** 2).sum(-1) * maskf)
    cent = torch.stack(centers, dim=1)  # (K, M, c)

    assign = _sq_dist(pts, cent).argmin(-1)
    for _ in range(max_iter):
        onehot = F.one_hot(assign, clusters).to(torch.float64) * maskf.unsqueeze(-1)  # (K, n_max, M)
        size = onehot.sum(1)  # (K, M)
        sums = torch.bmm(onehot.transpose(1, 2), pts)  # (K, M, c)
        cent = torch.where((size > 0).unsqueeze(-1), sums / size.clamp_min(1.0).unsqueeze(-1), cent)
        new = _sq_dist(pts, cent).argmin(-1)
        if torch.equal(new[mask], assign[mask]):
            break
        assign = new
    out = torch.empty(n, dtype=torch.int64, device=device)
    out[order] = assign[cls_sorted, pos]
    return out


class OutsideTheBox(_FeatureMonitor):
    """Outside-the-box abstraction monitor (Henzinger, Lukina & Schilling, ECAI 2020, §3–4).

    Fit: per class, the fit inputs' features of ``layer`` are split into ``clusters`` groups by k-means (one
    group when ``clusters=1``); each group gives an axis-aligned box ``[lo, hi]`` (its per-neuron min and max),
    enlarged by ``τ = enlarge`` of its width on both sides: ``[lo − τ·w, hi + τ·w]``, ``w = hi − lo``.

    Score (the paper's monitor is binary; the score makes it calibratable and rankable) of an input with
    features ``f`` and predicted class ``ŷ``::

        score(f) = min over boxes B of ŷ  of  max_j  max(lo_j − f_j, f_j − hi_j, 0) / max(hi_j − lo_j, δ_j)

    i.e. the L∞ distance outside the nearest box, each neuron measured in widths of the (enlarged) box;
    ``δ_j = max(10⁻³·R_j, 10⁻⁶)`` with ``R_j`` the neuron's range over all fit inputs keeps a box that is flat in
    neuron j (constant over the class, e.g. a dead ReLU) from dividing by zero. ``score = 0`` exactly inside (or on
    the border of) a box, so the paper's rule "alarm when outside every box of the predicted class" is
    ``alarm = score > 0``: ``rule="box"`` fixes the threshold at 0 (and fits on all rows); the default
    ``rule="calibrated"`` calibrates it on ID data like every monitor (it is 0 whenever at least ``accept`` of
    the calibration inputs lie in a box). A predicted class without boxes scores :data:`UNSEEN_SCORE`.

    Where we differ from the paper: the k-means is batched over all classes at once (seeded k-means++, see
    :func:`kmeans_by_class`) and ``clusters`` is given rather than chosen by the paper's threshold heuristic.
    Boxes of ``clusters=1`` merge across workers (min of ``lo``, max of ``hi``: exactly the boxes of one fit);
    k-means boxes do not (two fits' clusters are different partitions), :class:`ConfigError`.
    """

    kind = "outside_the_box"
    RULES = ("calibrated", "box")

    def __init__(self, layer: str, clusters: int = 1, enlarge: float = 0.0, reduce: str = "max", by: str = "auto",
                 rule: str = "calibrated", max_iter: int = 100, **kw: Any) -> None:
        super().__init__(layer, reduce=reduce, by=by, **kw)
        self.clusters = check_count(clusters, "clusters", 1, "pass the number of k-means clusters per class, "
                                                             "e.g. clusters=1 (one box per class).")
        self.enlarge = check_positive(enlarge, "enlarge", allow_zero=True,
                                      fix="pass the box enlargement factor τ >= 0, e.g. enlarge=0.0 or 0.1.")
        self.rule = check_choice(rule, "rule", self.RULES)
        self.max_iter = check_count(max_iter, "max_iter", 1, "pass max_iter >= 1, e.g. 100.")
        self.lo: Tensor | None = None  # (K, M, c) raw box lower corners (+inf for an empty box)
        self.hi: Tensor | None = None  # (K, M, c) raw upper corners (-inf for an empty box)
        self.valid: Tensor | None = None  # (K, M) bool
        self.span_lo: Tensor | None = None  # (c,) per-neuron min over all fit inputs
        self.span_hi: Tensor | None = None  # (c,)

    def fixed_threshold(self) -> float | None:
        return 0.0 if self.rule == "box" else None

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "clusters": self.clusters, "enlarge": self.enlarge, "rule": self.rule,
                "max_iter": self.max_iter}

    def _fit(self, view: MonitorView, generator: torch.Generator) -> None:
        feats, classes, k = self._fit_data(view)
        m, c = self.clusters, feats.shape[1]
        if m == 1:
            cluster = torch.zeros_like(classes)
        else:
            cluster = kmeans_by_class(feats, classes, k, m, generator, self.max_iter)
        group = (classes * m + cluster).unsqueeze(1).expand(-1, c)
        lo = torch.full((k * m, c), float("inf"), device=feats.device).scatter_reduce(0, group, feats, "amin")
        hi = torch.full((k * m, c), float("-inf"), device=feats.device).scatter_reduce(0, group, feats, "amax")
        self.lo, self.hi = lo.reshape(k, m, c), hi.reshape(k, m, c)
        self.valid = (torch.bincount(group[:, 0], minlength=k * m) > 0).reshape(k, m)
        self.span_lo, self.span_hi = feats.amin(0), feats.amax(0)

    def boxes(self) -> tuple[Tensor, Tensor, Tensor]:
        """The enlarged boxes ``(lo, hi, valid)``: ``(K, M, c)``, ``(K, M, c)``, ``(K, M)`` (empty: 0, 0, False)."""
        assert self.lo is not None and self.hi is not None and self.valid is not None
        valid = self.valid.unsqueeze(-1)
        lo = torch.where(valid, self.lo, torch.zeros_like(self.lo))
        hi = torch.where(valid, self.hi, torch.zeros_like(self.hi))
        width = hi - lo
        return lo - self.enlarge * width, hi + self.enlarge * width, self.valid

    def _score(self, view: MonitorView) -> Tensor:
        assert self.span_lo is not None and self.span_hi is not None
        feats = self._features(view)
        pred = view.predictions().to(feats.device)
        lo, hi, valid = self.boxes()
        k, m, c = lo.shape
        if feats.shape[1] != c:
            raise DataError(f"monitor {self.name!r}: layer {self.layer!r} has {feats.shape[1]} neurons here but "
                            f"{c} at fit. Fix: score with the model the monitor was fitted on.")
        floor = torch.clamp_min(1e-3 * (self.span_hi - self.span_lo), 1e-6)
        den = torch.maximum(hi - lo, floor)  # (K, M, c)
        known = (pred >= 0) & (pred < k)
        cls = pred.clamp(0, k - 1)
        parts = []
        step = _rows_per_chunk(m * c)
        for start in range(0, feats.shape[0], step):
            f = feats[start:start + step].unsqueeze(1)  # (n, 1, c)
            p = cls[start:start + step]
            outside = torch.maximum(lo[p] - f, f - hi[p]).clamp_min_(0.0).div_(den[p]).amax(-1)  # (n, M)
            outside = outside.masked_fill(~valid[p], float("inf")).amin(-1)
            parts.append(outside)
        score = torch.cat(parts) if parts else feats.new_zeros(0)
        return torch.where(known & torch.isfinite(score), score, torch.full_like(score, UNSEEN_SCORE))

    def _state_tensors(self) -> Iterable[Tensor]:
        return [t for t in (self.lo, self.hi, self.valid, self.span_lo, self.span_hi) if t is not None]

    def _merge(self, other: Monitor) -> None:
        assert isinstance(other, OutsideTheBox)
        assert self.lo is not None and other.lo is not None
        if self.clusters > 1:
            raise ConfigError(
                f"cannot merge monitor {self.name!r}: its boxes come from k-means (clusters={self.clusters}), and two "
                f"fits' clusters are different partitions of the data, so no combination of their boxes is the boxes "
                f"of one fit on all of it. Fix: fit the monitor on all in-distribution data in one process, or use "
                f"clusters=1 (one box per class, which merges exactly).")
        self._check_same_shape(other, self.lo, other.lo, "boxes")
        dev = self.lo.device
        self.lo = torch.minimum(self.lo, other.lo.to(dev))
        self.hi = torch.maximum(self.hi, other.hi.to(dev))  # type: ignore[arg-type]
        self.valid = self.valid | other.valid.to(dev)  # type: ignore[operator,union-attr]
        self.span_lo = torch.minimum(self.span_lo, other.span_lo.to(dev))  # type: ignore[arg-type,union-attr]
        self.span_hi = torch.maximum(self.span_hi, other.span_hi.to(dev))  # type: ignore[arg-type,union-attr]


# ----------------------------------------------------------------------------- activation patterns

_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def pack_patterns(bits: Tensor) -> Tensor:
    """``(N, c)`` bool -> ``(N, ⌈c/8⌉)`` uint8, neuron j at bit ``7 − j mod 8`` of byte ``j // 8`` (numpy.packbits)."""
    n, c = bits.shape
    pad = (-c) % 8
    b = F.pad(bits.to(torch.uint8), (0, pad)).reshape(n, -1, 8)
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=bits.device)
    return (b * weights).sum(-1).to(torch.uint8)


def unpack_patterns(packed: Tensor, n_neurons: int) -> Tensor:
    """Inverse of :func:`pack_patterns`: ``(N, ⌈c/8⌉)`` uint8 -> ``(N, c)`` bool."""
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.uint8)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(packed.shape[0], -1)[:, :n_neurons].bool()


def _popcount8(v: Tensor) -> Tensor:
    """Set bits of every uint8 (SWAR: three shift/mask/add steps, no lookup table)."""
    v = v - ((v >> 1) & 0x55)
    v = (v & 0x33) + ((v >> 2) & 0x33)
    return (v + (v >> 4)) & 0x0F


def hamming_distances(a: Tensor, b: Tensor) -> Tensor:
    """``(n, B) × (P, B)`` packed uint8 patterns -> ``(n, P)`` int32 Hamming distances (popcount of XOR)."""
    return _popcount8(a.unsqueeze(1) ^ b.unsqueeze(0)).sum(-1, dtype=torch.int32)


class ActivationPatterns(_FeatureMonitor):
    """Neuron activation pattern (NAP) monitor (Cheng, Nührenberg & Yasuoka, DATE 2019, §III–IV).

    A neuron of ``layer`` is *on* for an input when its feature is ``> 0`` (for a conv channel: its spatial
    ``max`` by default, i.e. "fires somewhere"); the input's pattern is the bit vector of its c neurons. Fit
    stores, per class, the set of patterns of the class's fit inputs: bit-packed (8 neurons a byte, uint8) and
    de-duplicated (``torch.unique`` over (class, bytes) rows). Score of an input: the Hamming distance from its
    pattern to the nearest stored pattern of its predicted class (``c + 1`` for a class without patterns),
    computed for a chunk of inputs against a chunk of stored patterns at once as one matrix product,
    ``H(a, b) = |a| + |b| − 2·a·b`` on 0/1 vectors (exact in float32 for c < 2^24; ~20× faster than XOR + popcount on
    the packed bytes, :func:`hamming_distances`, which gives the same integers), then a masked min over the
    patterns of the predicted class — no per-input loops and no BDDs.

    The paper's rule accepts an input whose pattern lies within Hamming distance γ = ``tolerance`` of a stored
    pattern: ``rule="tolerance"`` gives exactly that (threshold fixed at γ, fitted on all rows); the default
    ``rule="calibrated"`` calibrates the threshold on ID data like every monitor (the paper grew γ by hand until
    ID inputs stopped alarming; calibration makes that choice on held-out ID data). Pattern sets merge across
    workers by union (exactly the set of one fit on all data).
    """

    kind = "activation_patterns"
    RULES = ("calibrated", "tolerance")

    def __init__(self, layer: str, tolerance: int = 0, reduce: str = "max", by: str = "auto",
                 rule: str = "calibrated", **kw: Any) -> None:
        super().__init__(layer, reduce=reduce, by=by, **kw)
        self.tolerance = check_count(tolerance, "tolerance", 0, "pass the Hamming tolerance γ as an integer >= 0.")
        self.rule = check_choice(rule, "rule", self.RULES)
        self.patterns: Tensor | None = None  # (P, ⌈c/8⌉) uint8
        self.pattern_class: Tensor | None = None  # (P,) int64
        self.n_neurons: int | None = None

    def fixed_threshold(self) -> float | None:
        return float(self.tolerance) if self.rule == "tolerance" else None

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "tolerance": self.tolerance, "rule": self.rule}

    def _fit(self, view: MonitorView, generator: torch.Generator) -> None:
        feats, classes, _ = self._fit_data(view)
        self.n_neurons = int(feats.shape[1])
        if self.n_neurons >= 1 << 24:
            raise DataError(f"monitor {self.name!r}: layer {self.layer!r} has {self.n_neurons} neurons; Hamming "
                            f"distances are exact only below 2^24 neurons. Fix: monitor a narrower layer.")
        self._store(classes, pack_patterns(feats > 0))

    def _store(self, classes: Tensor, packed: Tensor) -> None:
        rows = torch.unique(torch.cat([classes.unsqueeze(1), packed.to(torch.int64)], dim=1), dim=0)
        self.pattern_class = rows[:, 0].contiguous()
        self.patterns = rows[:, 1:].to(torch.uint8).contiguous()

    def _score(self, view: MonitorView) -> Tensor:
        assert self.patterns is not None and self.pattern_class is not None and self.n_neurons is not None
        feats = self._features(view)
        c = self.n_neurons
        if feats.shape[1] != c:
            raise DataError(f"monitor {self.name!r}: layer {self.layer!r} has {feats.shape[1]} neurons here but "
                            f"{c} at fit. Fix: score with the model the monitor was fitted on.")
        bits = (feats > 0).to(torch.float32)  # (N, c) of 0/1
        ones = bits.sum(1, keepdim=True)
        pred = view.predictions().to(feats.device).unsqueeze(1)
        patterns, owner = self.patterns.to(feats.device), self.pattern_class.to(feats.device)
        best = torch.full((bits.shape[0],), float(c + 1), device=feats.device)
        p_step = _rows_per_chunk(c)
        for ps in range(0, patterns.shape[0], p_step):
            stored = unpack_patterns(patterns[ps:ps + p_step], c).to(torch.float32)  # (p, c)
            stored_ones, own = stored.sum(1).unsqueeze(0), owner[ps:ps + p_step].unsqueeze(0)
            n_step = _rows_per_chunk(stored.shape[0])
            for ns in range(0, bits.shape[0], n_step):
                # Hamming(a, b) = |a| + |b| − 2·a·b for 0/1 vectors: exact in float32 (integers < 2^24)
                dist = torch.addmm(ones[ns:ns + n_step] + stored_ones, bits[ns:ns + n_step], stored.T, alpha=-2.0)
                dist = dist.masked_fill_(own != pred[ns:ns + n_step], float(c + 1)).amin(1)
                best[ns:ns + n_step] = torch.minimum(best[ns:ns + n_step], dist)
        return best

    def _state_tensors(self) -> Iterable[Tensor]:
        return [t for t in (self.patterns, self.pattern_class) if t is not None]

    def _merge(self, other: Monitor) -> None:
        assert isinstance(other, ActivationPatterns)
        assert self.patterns is not None and other.patterns is not None
        assert self.pattern_class is not None and other.pattern_class is not None
        if self.n_neurons != other.n_neurons:
            raise ConfigError(f"cannot merge monitor {self.name!r}: layer {self.layer!r} has {self.n_neurons} neurons "
                              f"here and {other.n_neurons} there. Fix: fit both on the same model.")
        dev = self.patterns.device
        self._store(torch.cat([self.pattern_class, other.pattern_class.to(dev)]),
                    torch.cat([self.patterns, other.patterns.to(dev)]))


# ----------------------------------------------------------------------------- Mahalanobis


class ClassGaussianStats(Engine):
    """Sufficient statistics of class-conditional Gaussians with a tied covariance (all states reduce ``sum``).

    ``count`` (K,) int64, ``sums`` (K, c) float64 and ``outer`` (c, c) float64 (Σ f fᵀ over all inputs), so
    partial fits merge (:meth:`merge`) and sync over ``torch.distributed`` exactly (up to float64 rounding).
    """

    def __init__(self, num_classes: int, n_features: int, device: torch.device | str | None = None) -> None:
        super().__init__(device)
        self.num_classes = check_count(num_classes, "num_classes", 1)
        self.n_features = check_count(n_features, "n_features", 1)
        self.add_state("count", torch.zeros(self.num_classes, dtype=torch.int64), reduce="sum")
        self.add_state("sums", torch.zeros(self.num_classes, self.n_features, dtype=torch.float64), reduce="sum")
        self.add_state("outer", torch.zeros(self.n_features, self.n_features, dtype=torch.float64), reduce="sum")

    def config(self) -> dict[str, Any]:
        return {"num_classes": self.num_classes, "n_features": self.n_features}

    @classmethod
    def from_config(cls, config: Mapping[str, Any], device: torch.device | str | None = None) -> ClassGaussianStats:
        return cls(int(config["num_classes"]), int(config["n_features"]), device=device)

    def update(self, features: Tensor, classes: Tensor) -> None:  # type: ignore[override]
        f = features.to(self.device, torch.float64)
        cls = classes.to(self.device, torch.int64)
        self.count.index_add_(0, cls, torch.ones_like(cls))
        self.sums.index_add_(0, cls, f)
        self.outer += f.T @ f

    def compute(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(means (K, c), tied covariance (c, c), seen (K,) bool)``; cov = (1/n) Σ_k Σ_{i∈k} (f−μ_k)(f−μ_k)ᵀ."""
        count = self.count.to(torch.float64)
        seen = self.count > 0
        means = self.sums / count.clamp_min(1.0).unsqueeze(1)
        n = count.sum().clamp_min(1.0)
        between = (self.sums.T * (1.0 / count.clamp_min(1.0))) @ self.sums  # Σ_k s_k s_kᵀ / n_k
        cov = (self.outer - between) / n
        return means, (cov + cov.T) / 2, seen


class Mahalanobis(_FeatureMonitor):
    """Mahalanobis-distance monitor (Lee, Lee, Lee & Shin, NeurIPS 2018, §2, eqs. (1)–(2)).

    Fit: class means ``μ_k`` and one tied covariance ``Σ = (1/N) Σ_k Σ_{i: y_i = k} (f_i − μ_k)(f_i − μ_k)ᵀ`` of
    the layer's features (``reduce="mean"``: the paper's global average pooling of a conv layer), from the
    sufficient statistics in :class:`ClassGaussianStats` (float64 sums, outer products and counts; merge and
    sync exactly). Score::

        score(f) = min_k (f − μ_k)ᵀ P (f − μ_k),   P = pinv(Σ + ρ·(tr Σ / c)·I),  ρ = ridge (default 1e-6)

    over the classes seen at fit (the paper's confidence score M(x) is its negative). Singular covariances are
    common (dead ReLUs, more neurons than fit inputs): the ridge, relative to the mean variance (or absolute
    ρ when every feature is constant), gives a direction without any ID variance a huge but finite precision —
    an input that moves along it is far away, which is what an OOD monitor wants (a plain pseudo-inverse would
    ignore that direction). ``ridge=0`` gives the plain pseudo-inverse (eigenvalues ≤ c·ε₆₄·λ_max dropped).
    Batched: ``P = W Wᵀ`` from one ``eigh``; the distances are ``‖(f − μ_k) W‖²`` for all inputs and classes by
    matrix products.

    Not reproduced from the paper: the input pre-processing (an ODIN-like gradient step) and the logistic
    regression over several layers' scores; use one layer per monitor.
    """

    kind = "mahalanobis"

    def __init__(self, layer: str, reduce: str = "mean", by: str = "auto", ridge: float = 1e-6, **kw: Any) -> None:
        super().__init__(layer, reduce=reduce, by=by, **kw)
        self.ridge = check_positive(ridge, "ridge", allow_zero=True,
                                    fix="pass the relative ridge ρ >= 0 added to the covariance, e.g. 1e-6.")
        self.stats: ClassGaussianStats | None = None
        self.whiten: Tensor | None = None  # (c, r) float32: P = W Wᵀ
        self.center: Tensor | None = None  # (c,) float32: the fit features' mean (for numerically stable products)
        self.means_w: Tensor | None = None  # (K, r) float32: (μ_k − center) W
        self.seen: Tensor | None = None  # (K,) bool

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "ridge": self.ridge}

    def _fit(self, view: MonitorView, generator: torch.Generator) -> None:
        feats, classes, k = self._fit_data(view)
        self.stats = ClassGaussianStats(k, int(feats.shape[1]), device=feats.device)
        self.stats.update(feats, classes)
        self._finish()

    def precision(self) -> Tensor:
        """``P`` (c, c) float64, the (ridged) pseudo-inverse of the tied covariance."""
        assert self.whiten is not None
        w = self.whiten.to(torch.float64)
        return w @ w.T

    def _finish(self) -> None:
        assert self.stats is not None
        means, cov, seen = self.stats.compute()
        c = cov.shape[0]
        scale = torch.diagonal(cov).sum() / c
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        reg = cov + self.ridge * scale * torch.eye(c, dtype=cov.dtype, device=cov.device)
        lam, vec = torch.linalg.eigh(reg)
        keep = lam > lam.amax().clamp_min(0.0) * c * torch.finfo(torch.float64).eps
        keep &= lam > 0
        whiten = vec[:, keep] * lam[keep].rsqrt()
        count = self.stats.count.to(torch.float64)
        center = self.stats.sums.sum(0) / count.sum().clamp_min(1.0)
        self.whiten = whiten.to(torch.float32)
        self.center = center.to(torch.float32)
        self.means_w = ((means - center) @ whiten).to(torch.float32)
        self.seen = seen

    def _score(self, view: MonitorView) -> Tensor:
        assert self.whiten is not None and self.center is not None and self.means_w is not None
        assert self.seen is not None
        feats = self._features(view)
        if feats.shape[1] != self.whiten.shape[0]:
            raise DataError(f"monitor {self.name!r}: layer {self.layer!r} has {feats.shape[1]} neurons here but "
                            f"{self.whiten.shape[0]} at fit. Fix: score with the model the monitor was fitted on.")
        dev = feats.device
        z = (feats.to(torch.float32) - self.center.to(dev)) @ self.whiten.to(dev)  # (N, r)
        mw = self.means_w.to(dev)
        d = ((z * z).sum(1, keepdim=True) - 2.0 * (z @ mw.T) + (mw * mw).sum(1).unsqueeze(0)).clamp_min_(0.0)
        d = d.masked_fill(~self.seen.to(dev).unsqueeze(0), float("inf"))
        return d.amin(1)

    def _state_tensors(self) -> Iterable[Tensor]:
        states = list(self.stats.states().values()) if self.stats is not None else []
        return states + [t for t in (self.whiten, self.center, self.means_w, self.seen) if t is not None]

    def _merge(self, other: Monitor) -> None:
        assert isinstance(other, Mahalanobis)
        assert self.stats is not None and other.stats is not None
        try:
            self.stats.merge(other.stats)
        except ValueError as exc:
            raise ConfigError(f"cannot merge monitor {self.name!r}: {exc}. Fix: fit both on the same model and "
                              f"layer (same number of classes and neurons).") from exc
        self._finish()
