"""Tensor kernels of DeepInspect (Tian et al., ICSE 2020): activity, NAPVD, avg_bias, AUCEC.

The definitions, their exactness and the measured costs are documented in
:mod:`pytest_dnnsafety.engines.inspection.deepinspect`, which re-exports every public name here; this module
holds the computations so that the engine module stays readable. Pure torch, no pytest import.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, MetricError

__all__ = [
    "InspectionError", "check_threshold", "scaled_activity", "layer_activity", "pack_active", "unpack_active",
    "napvd_matrix", "class_bias", "aucec", "DEFAULT_THRESHOLD", "DISTANCE_FLOOR",
]

#: The paper's activation threshold on the min–max scaled layer output.
DEFAULT_THRESHOLD = 0.5
#: Triplets need D_ik, D_jk above this (the authors' t2).
DISTANCE_FLOOR = 1e-5
#: Elements of one chunk of the triplet computation (selected (i, k) entries × K').
_TRIPLET_CHUNK = 1 << 22
_BITS = (7, 6, 5, 4, 3, 2, 1, 0)  # np.packbits order: the first unit is the most significant bit


class InspectionError(MetricError):
    """A DeepInspect metric cannot be computed on this model and data (e.g. fewer than three classes)."""


# ----------------------------------------------------------------------------- activity
def check_threshold(threshold: Any, name: str = "threshold") -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold < 1:
        raise ConfigError(f"{name}={threshold!r}: the activation threshold applies to the min–max scaled layer "
                          f"output, so it must lie strictly between 0 and 1. Fix: e.g. {name}=0.5 (the paper's "
                          "default).")
    return float(threshold)


def scaled_activity(mean: Tensor, lo: Tensor, hi: Tensor, threshold: float = DEFAULT_THRESHOLD, *,
                    reduce: str = "mean") -> Tensor:
    """Bool ``(N, c)``: unit ``c`` of input ``i`` active after min–max scaling the input's layer output.

    ``mean``, ``lo``, ``hi``: per-input, per-channel mean, min and max of the layer output ``(N, c)``.
    Active iff ``(v − min_all)/(max_all − min_all) > threshold`` with ``v = mean`` (``reduce="mean"``,
    the authors' code) or ``v = max`` (``reduce="max"``); never for a constant output. Computed in float64.
    """
    t = check_threshold(threshold)
    if reduce not in ("mean", "max"):
        raise ConfigError(f"reduce={reduce!r}: use 'mean' (the paper: the mean of the channel's scaled values) "
                          "or 'max'. Fix: reduce='mean'.")
    lo_all = lo.to(torch.float64).amin(dim=1, keepdim=True)
    hi_all = hi.to(torch.float64).amax(dim=1, keepdim=True)
    span = hi_all - lo_all
    value = (mean if reduce == "mean" else hi).to(torch.float64)
    flat = span > 0
    scaled = (value - lo_all) / torch.where(flat, span, torch.ones_like(span))
    return (scaled > t) & flat


def layer_activity(acts: Any, threshold: float = DEFAULT_THRESHOLD, *, reduce: str = "mean") -> Tensor:
    """:func:`scaled_activity` of a :class:`~pytest_dnnsafety.engines.core.capture.LayerActivations` (needs its ``min``)."""
    if getattr(acts, "min", None) is None:
        raise MetricError(f"layer {getattr(acts, 'layer', '?')!r}: the activations carry no per-channel min, which "
                          "the min–max scaling of DeepInspect needs. Fix: capture them with "
                          "pytest_dnnsafety.engines.core.capture.capture (it records max, mean and min).")
    return scaled_activity(acts.mean, acts.min, acts.max, threshold, reduce=reduce)


def pack_active(active: Tensor) -> Tensor:
    """Bit-pack a bool ``(N, n)`` tensor into uint8 ``(N, ⌈n/8⌉)`` (``np.packbits`` layout, on its device)."""
    n = active.shape[1]
    pad = (-n) % 8
    bits = torch.nn.functional.pad(active.to(torch.uint8), (0, pad)).reshape(active.shape[0], -1, 8)
    weights = torch.tensor([1 << b for b in _BITS], dtype=torch.uint8, device=active.device)
    return (bits * weights).sum(dim=-1, dtype=torch.uint8)


def unpack_active(packed: Tensor, n_neurons: int) -> Tensor:
    """Bool ``(N, n_neurons)`` from :func:`pack_active`'s (or ``np.packbits(..., axis=1)``'s) uint8 layout."""
    shifts = torch.tensor(_BITS, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(packed.shape[0], -1)[:, :n_neurons].bool()


# ----------------------------------------------------------------------------- NAPVD and bias
def _pop_std(x: Tensor) -> Tensor:
    return x.std(correction=0) if x.numel() > 1 else torch.zeros((), dtype=x.dtype, device=x.device)


def napvd_matrix(active_counts: Tensor, class_counts: Tensor) -> Tensor:
    """The K×K NAPVD matrix of classes with ``class_counts > 0`` (float64, zero diagonal).

    ``active_counts`` (units × K) integer counts of active units by class, ``class_counts`` (K,) the
    inputs per class (all positive). Matrix products only; see the module doc for exactness.
    """
    a = active_counts.to(torch.float64)
    c = class_counts.to(torch.int64)
    n = a.shape[0]
    top = torch.topk(c, min(2, c.numel())).values.tolist()
    c1, c2 = (top + [0])[:2] if len(top) == 1 else top
    gram = a.T @ a  # exact: integer entries below 2**53
    if n * c1 * c1 < 2 ** 53 and 2 * n * (c1 * c2) ** 2 < 2 ** 62:
        g = gram.round().to(torch.int64)
        diag = g.diagonal()
        ca, cb = c[:, None], c[None, :]
        off = ~torch.eye(c.numel(), dtype=torch.bool, device=c.device)  # the diagonal (0) could overflow int64
        zero = torch.zeros((), dtype=torch.int64, device=c.device)
        sq_b, sq_a, cross = (torch.where(off, m, zero) for m in (cb * cb, ca * ca, 2 * ca * cb))
        num = sq_b * diag[:, None] + sq_a * diag[None, :] - cross * g
        ssq = num.to(torch.float64) / (ca * cb).to(torch.float64).square()
    else:  # counts too large for exact integers: float Gram of p, clamped (≈1e-8 near 0)
        p = a / c.to(torch.float64)
        gp = p.T @ p
        dp = gp.diagonal()
        ssq = (dp[:, None] + dp[None, :] - 2 * gp).clamp_min(0.0)
    ind = (active_counts > 0).to(torch.float64)
    inter = ind.T @ ind
    size = inter.diagonal()
    union = size[:, None] + size[None, :] - inter
    out = torch.where(union > 0, torch.sqrt(ssq) / torch.sqrt(union.clamp_min(1.0)), torch.zeros_like(ssq))
    upper = torch.triu(out, 1)
    return upper + upper.T  # exactly symmetric, zero diagonal


def _union_sum(select: Tensor, term: Any, chunk_elements: int) -> Tensor:
    """``S[i, j] = Σ_{k : select[i,k] or select[j,k]} term(i, j, k)`` for all pairs, without a K³ tensor.

    ``select`` is symmetric and ``term`` symmetric in (i, j). By inclusion–exclusion,
    ``S = T + Tᵀ − U`` with ``T[i, j] = Σ_{k ∈ select_i} term`` and ``U[i, j] = Σ_{k ∈ select_i ∩ select_j} term``;
    both are sums over the selected (i, k) only, each giving a row ``term(i, ·, k)`` over all j:
    the work is (selected entries) × K instead of K³. ``term(rows, cols)`` returns ``(m, K)``.
    """
    k = select.shape[0]
    t = torch.zeros(select.shape, dtype=torch.float64, device=select.device)
    u = torch.zeros_like(t)
    rows, cols = torch.nonzero(select, as_tuple=True)
    step = max(1, chunk_elements // k)
    for start in range(0, int(rows.numel()), step):
        i, c = rows[start:start + step], cols[start:start + step]
        vals = term(i, c)
        rows_i = i[:, None].expand(-1, k)  # scatter_add_: one kernel (index_add_ on 2-D loops per index on the CPU)
        t.scatter_add_(0, rows_i, vals)
        u.scatter_add_(0, rows_i, vals * select[c])  # select[j, c] = select[c, j]
    return t + t.T - u


def class_bias(dist: Tensor, link: Tensor | None = None, type1: Tensor | None = None, *,
               chunk_elements: int = _TRIPLET_CHUNK) -> tuple[Tensor, Tensor | None]:
    """``avg_bias`` (K×K) of a NAPVD matrix, and ``avg_cd`` (K×K) when ``type1`` is given.

    ``link`` (K×K bool, symmetric): triplet (i, j, k) counts only if ``link[i,k] | link[j,k]``
    (the label filter); None: no such filter. A triplet contributes to ``avg_bias`` only when
    ``D_ik`` or ``D_jk`` is below the cutoff, so the sum runs over the (i, k) below it
    (:func:`_union_sum`: selected entries × K work, in chunks of ``chunk_elements``), and ``avg_cd``
    over the linked (i, k) (all far ones without a link). The matrices are mirrored from ``i < j``.
    """
    k = dist.shape[0]
    if k < 3:
        raise InspectionError(f"avg_bias needs at least three classes (a pair and a third class); got {k}. Fix: "
                              "use data on which three or more classes are predicted.")
    cutoff = dist.mean() - _pop_std(dist.reshape(-1))
    far = dist > DISTANCE_FLOOR
    zero = torch.zeros((), dtype=torch.float64, device=dist.device)

    def allowed(i: Tensor, c: Tensor) -> Tensor:  # (m, K): far_ik (selected) & far_jk [& (link_ik | link_jk)]
        ok = far[c]
        if link is not None:
            ok = ok & (link[i, c][:, None] | link[c])
        return ok

    def bias_term(i: Tensor, c: Tensor) -> Tensor:
        d_ik = dist[i, c][:, None]
        d_jk = dist[c]  # D_jk = D_kj
        return torch.where(allowed(i, c), (d_ik / (d_ik + d_jk) - 0.5).abs(), zero)

    avg = _union_sum((dist < cutoff) & far, bias_term, chunk_elements)
    upper = torch.triu(avg, 1) / (k - 2)  # pairs i < j, as the authors; mirrored so the matrix is exactly symmetric
    avg = upper + upper.T
    if type1 is None:
        return avg, None
    sym = type1 + type1.T

    def cd_term(i: Tensor, c: Tensor) -> Tensor:
        return torch.where(allowed(i, c), (sym[i, c][:, None] - sym[c]).abs(), zero)

    cd = _union_sum(far & link if link is not None else far, cd_term, chunk_elements)
    upper = torch.triu(cd, 1) / (k - 2)
    return avg, upper + upper.T


def aucec(scores: Tensor, truth: Tensor, *, descending: bool = False) -> float | None:
    """Area under the cost-effectiveness curve of ranking ``scores`` against the bool ``truth`` (module doc).

    ``descending=False``: smallest score inspected first (NAPVD); True: largest first (avg_bias).
    None when there is no ground-truth pair.
    """
    scores, truth = scores.detach().to("cpu", torch.float64), truth.detach().to("cpu", torch.bool)
    total, found = int(scores.numel()), int(truth.sum())
    if total == 0 or found == 0:
        return None
    key = -scores if descending else scores
    order = torch.sort(key, stable=True).indices
    keys, hits = key[order], truth[order].to(torch.float64)
    _, counts = torch.unique_consecutive(keys, return_counts=True)
    ends = torch.cumsum(counts, 0)
    x = torch.cat([torch.zeros(1, dtype=torch.float64), ends.to(torch.float64) / total])
    y = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(hits, 0)[ends - 1] / found])
    return float(((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2).sum())


def _bias_no_signal(dist: Tensor, pair_bias: Tensor, label_filter: bool) -> str | None:
    """Why every avg_bias is 0 for want of evidence, or None when some triplet gave a bias.

    A triplet enters avg_bias (eqs. 3–4) only when ``D_ik`` or ``D_jk`` lies below the cutoff
    (mean − std of the NAPVD matrix): with no entry below it (random activations, the authors' CIFAR-10
    model at thresholds 0.25 and 0.5) every avg_bias is 0 and the "worst" pair is arbitrary. That is
    no evidence, not no bias: the gates make it inconclusive.
    """
    if bool((pair_bias > 0).any()):
        return None
    cutoff = float(dist.mean() - _pop_std(dist.reshape(-1)))
    off = ~torch.eye(dist.shape[0], dtype=torch.bool, device=dist.device)
    smallest = float(dist[off].min())
    below = int(((dist < cutoff) & (dist > DISTANCE_FLOOR) & off).sum()) // 2
    if below == 0:
        why = (f"no pair of predicted classes has a NAPVD below the bias cutoff (mean − std of the NAPVD matrix, "
               f"{cutoff:.4g}; the smallest NAPVD is {smallest:.4g}), so no triplet enters avg_bias (Tian et al. "
               "2020, eqs. 3–4)")
    else:
        filters = " and the label filter (a third class the model confused with one of the pair)" if label_filter \
            else ""
        why = (f"{below} pair(s) of classes have a NAPVD below the bias cutoff {cutoff:.4g}, but no triplet through "
               f"them passes the distance floor {DISTANCE_FLOOR:g}{filters}")
    return (f"{why}: every avg_bias is 0 for want of evidence, not for want of bias, and no pair is the worst. "
            "Fix: gate bias on a layer where the classes separate (e.g. a later layer) or on more data, or try "
            "label_filter=False or another activation_threshold; max_class_confusion measures the same layer "
            "without a cutoff")
