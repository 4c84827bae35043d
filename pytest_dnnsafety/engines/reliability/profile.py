"""The operational profile: a Gaussian KDE in torch (Zhao et al. 2021, eqs. 8–12 and Appendix A).

Given unlabelled operational data ``X_1..X_N`` (in input space, or mapped to a latent space by a
user ``encoder``), the OP density is the kernel density estimate of eq. (8) with Gaussian
kernels of covariance ``H``::

    Op̂(x) = (1/N) Σ_j φ_H(x − X_j)

``H`` is diagonal (``H = diag(h_1², …, h_d²)``, one bandwidth per dimension) unless
``full_covariance=True``. Bandwidths by rule follow :class:`scipy.stats.gaussian_kde`'s
conventions: ``H = factor² · Σ̂`` with ``Σ̂`` the unbiased data covariance (its diagonal when
``H`` is diagonal) and ``factor = N^{−1/(d+4)}`` (Scott) or ``(N (d + 2)/4)^{−1/(d+4)}``
(Silverman). A given bandwidth is the kernel's standard deviation ``h`` (the paper's ``h = 0.2``),
a scalar or one per dimension.

Cell masses (the pooled OP of a box cell, eq. 3):

* ``"centre"`` — the paper's approximation, eq. (9): ``Op̂_i = Op̂(x_{c_i}) · v_c``;
* ``"exact"`` — the exact integral of the KDE over the box, which for diagonal Gaussian kernels
  is a product of normal CDF differences per kernel, averaged over kernels::

      ∫_{[a,b]} Op̂ = (1/N) Σ_j Π_k [Φ((b_k − X_jk)/h_k) − Φ((a_k − X_jk)/h_k)]

Both are normalised over the evaluated domain by the caller (:mod:`pytest_dnnsafety.engines.reliability`).

Variance of the masses (eq. 11 / Appendix A): ``B`` bootstrap refits — the data resampled with
replacement, the KDE refit with the bandwidth held at its full-data value — and the sample
variance of the refitted masses. A refit is a reweighting of the kernels by the resampling
counts ``W_bj`` (``Op̂^b = (1/N) Σ_j W_bj φ_H(· − X_j)``), so all ``B`` refits of many cells are
one matrix product.

Two resample sizes (``size=`` of :meth:`OperationalProfile.bootstrap_weights`, ``bootstrap_size=``
of :func:`~pytest_dnnsafety.engines.reliability.assess_reliability`):

* ``"full"`` (default) — the standard (Efron) bootstrap: each refit draws ``N`` of the ``N``
  points. Its variance estimates the variance of the masses of the ``N``-point KDE, the masses
  the assessment actually uses, so it is the default.
* ``"half"`` — an m-out-of-n bootstrap with ``m = ⌊N/2⌋``: each refit draws ``N/2`` points, the
  counts scaled by ``N/m`` so a refit's kernel weights still sum to ``N`` (masses stay on the
  same scale and normalised). This is what the paper's reference implementation does (refits on
  half-size resamples, ``B = 100``). It estimates the variance of a KDE fitted on ``N/2`` points;
  a KDE cell mass is a mean over kernels, so its variance scales as ``1/N`` and the half-size
  refits over-state ``V[Op_i]`` of the ``N``-point KDE by about 2× (measured: median ratio over
  cells ≈ 2, ``tests/families/reliability/test_profile.py``). Offered to reproduce the paper's figures, not because it
  is more accurate; it is more conservative.

Latent spaces: ``encoder`` maps inputs ``(N, …)`` to ``(N, d)`` and ``decoder`` maps back; the
KDE and the cells live in the latent space, while the model is queried on decoded inputs.
:class:`PCA` is a ready-made pair (``decode`` = inverse PCA).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, DataError

__all__ = ["OperationalProfile", "PCA", "BANDWIDTH_RULES", "BOOTSTRAP_SIZES", "MASS_METHODS", "as_tensor_2d",
           "canonical_mass"]

#: Bandwidth rules (scipy.stats.gaussian_kde's names).
BANDWIDTH_RULES: tuple[str, ...] = ("scott", "silverman")

#: Bootstrap resample sizes (:meth:`OperationalProfile.bootstrap_weights`): ``"full"`` — the standard
#: bootstrap, N of N points per refit (default); ``"half"`` — the paper's N/2-point refits.
BOOTSTRAP_SIZES: tuple[str, ...] = ("full", "half")

#: Kernel × point elements per chunk when evaluating densities/masses (memory bound).
_CHUNK_ELEMS = 1 << 22

_SQRT2 = math.sqrt(2.0)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


#: Cell-mass methods: ``"exact"`` (box integral) and ``"centre"`` (the paper's eq. 9); ``"center"``
#: is accepted as a spelling of ``"centre"`` (:func:`canonical_mass`).
MASS_METHODS: tuple[str, ...] = ("exact", "centre")
_MASS_SPELLINGS = {"exact": "exact", "centre": "centre", "center": "centre"}


def canonical_mass(method: Any, what: str = "mass") -> str:
    """``method`` as ``"exact"`` or ``"centre"`` (``"center"`` is the same method), else a :class:`ConfigError`."""
    if isinstance(method, str) and method in _MASS_SPELLINGS:
        return _MASS_SPELLINGS[method]
    raise ConfigError(f"{what} must be 'exact' or 'centre' (the exact box integral, or the paper's eq. 9 centre "
                      f"approximation; also spelt 'center'), got {method!r}")


def as_tensor_2d(data: Any, what: str, *, dtype: torch.dtype = torch.float64,
                 device: torch.device | None = None, flatten: bool = True) -> Tensor:
    """``data`` (tensor, array or nested sequence) as a finite ``(N, d)`` tensor, or a :class:`DataError`.

    With ``flatten`` trailing dimensions are flattened (``(N, 8, 8)`` → ``(N, 64)``); a 1-D input
    is one column.
    """
    if data is None:
        raise DataError(f"{what} is missing (None). Fix: pass a tensor or array of shape (N, d)")
    try:
        tensor = data.detach() if isinstance(data, Tensor) else torch.as_tensor(np.asarray(data))
    except (TypeError, ValueError) as exc:
        raise DataError(f"{what} cannot be turned into a tensor: {exc}") from None
    if tensor.dtype == torch.bool or tensor.dtype.is_complex:
        raise DataError(f"{what} must hold real numbers, got dtype {tensor.dtype}")
    tensor = tensor.to(device=device, dtype=dtype)
    if tensor.ndim == 0:
        raise DataError(f"{what} must have shape (N, d), got a scalar")
    if tensor.ndim == 1:
        tensor = tensor[:, None]
    elif tensor.ndim > 2:
        if not flatten:
            raise DataError(f"{what} must have shape (N, d), got {tuple(tensor.shape)}")
        tensor = tensor.reshape(tensor.shape[0], -1)
    if tensor.shape[0] == 0 or tensor.shape[1] == 0:
        raise DataError(
            f"{what} is empty (shape {tuple(tensor.shape)}). Fix: give at least one point with at least one coordinate"
        )
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        bad = torch.nonzero(~finite)[0].tolist()
        raise DataError(
            f"{what} holds a non-finite value ({float(tensor[bad[0], bad[1]])}) at row {bad[0]}, column {bad[1]}. "
            f"Fix: drop or impute NaN/inf rows before building the profile"
        )
    return tensor


def _trailing_shape(data: Any, width: int) -> tuple[int, ...]:
    """The shape of one input of ``data`` (``(width,)`` for 1-D or 2-D data, or when unknown)."""
    shape = tuple(data.shape) if isinstance(data, (Tensor, np.ndarray)) else tuple(np.shape(data))
    trailing = tuple(int(v) for v in shape[1:])
    if len(trailing) > 1 and math.prod(trailing) == width:
        return trailing
    return (width,)


def _column_variance(points: Tensor) -> Tensor:
    """The unbiased variance of each column of ``points`` ``(N, d)``, a block of columns at a time (no ``(N, d)``
    temporary beyond :data:`_CHUNK_ELEMS` values)."""
    step = max(1, _CHUNK_ELEMS // max(1, int(points.shape[0])))
    return torch.cat([points[:, k : k + step].var(0, unbiased=True) for k in range(0, int(points.shape[1]), step)])


def _ndtr(x: Tensor) -> Tensor:
    """``Φ(x) = erfc(−x/√2)/2``, accurate far into the lower tail (``torch.special.ndtr`` is 0 below about −8.3)."""
    return 0.5 * torch.special.erfc(-x / _SQRT2)


def _ndtr_diff(lo: Tensor, hi: Tensor) -> Tensor:
    """``Φ(hi) − Φ(lo)`` for ``lo ≤ hi`` without cancellation in either tail."""
    upper_tail = lo > 0
    return torch.where(upper_tail, _ndtr(-lo) - _ndtr(-hi), _ndtr(hi) - _ndtr(lo))


class OperationalProfile:
    """A Gaussian KDE of operational data (eq. 8), with cell masses (eq. 9 and exact) and bootstrap (App. A).

    Args:
        data: unlabelled operational inputs ``(N, …)`` in input space (``(N, d)`` when there is
            no encoder; trailing dimensions are flattened).
        bandwidth: ``"scott"`` (default) or ``"silverman"`` (scipy's rules), a positive number
            (the kernels' standard deviation in every dimension) or one positive number per
            dimension. With ``full_covariance=True`` a rule gives scipy's full kernel covariance
            and a ``(d, d)`` positive definite matrix may be given.
        encoder: maps inputs ``(M, …)`` to latent points ``(M, d)``; the KDE is fitted on
            ``encoder(data)``. ``decoder`` maps latent points back to model inputs.
        full_covariance: use scipy's full kernel covariance ``factor² Σ̂`` (density and the
            centre approximation only; exact box masses need diagonal kernels).
        device: where the kernels live (default CPU). Computations are float64.

    Raises:
        DataError: empty data or non-finite values (named by row and column).
        ConfigError: a bad bandwidth (unknown rule, non-positive, wrong length, or a rule on data
            that is constant in some dimension).
    """

    def __init__(
        self,
        data: Any,
        bandwidth: str | float | Sequence[float] | Tensor = "scott",
        *,
        encoder: Callable[[Tensor], Any] | None = None,
        decoder: Callable[[Tensor], Any] | None = None,
        full_covariance: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.encoder = encoder
        self.decoder = decoder
        self.full_covariance = bool(full_covariance)
        raw = as_tensor_2d(data, "operational data", device=self.device, flatten=encoder is None) \
            if encoder is None else self._raw_input(data)
        self._input_shape: tuple[int, ...] | None = None
        if encoder is None:
            # the shape of one input as given (images stay images: (N, 1, 8, 8) → (1, 8, 8))
            self._input_shape = _trailing_shape(data, raw.shape[1])
            points = raw
        else:
            self._input_shape = tuple(raw.shape[1:])
            points = self.encode(raw)
        self.points: Tensor = points
        #: The raw operational inputs ``(N, …)`` (input space, as given). Without an encoder they
        #: are :attr:`points` reshaped; with one they are kept beside the encodings, so ball cells
        #: (``cells="balls"``) can be centred on them while grid cells use the latent KDE.
        self.inputs: Tensor = raw if encoder is not None else raw.reshape(raw.shape[0], *self._input_shape)
        self.n, self.dim = int(points.shape[0]), int(points.shape[1])
        self._bandwidth_spec = bandwidth
        self.factor: float | None = None
        self.bandwidth: Tensor | None
        self._set_bandwidth(bandwidth)

    # ------------------------------------------------------------------ construction helpers
    def _raw_input(self, data: Any) -> Tensor:
        if data is None:
            raise DataError("operational data is missing (None). Fix: pass the unlabelled operational inputs")
        tensor = data.detach() if isinstance(data, Tensor) else torch.as_tensor(np.asarray(data))
        if tensor.ndim == 0 or tensor.shape[0] == 0 or tensor.numel() == 0:
            raise DataError(
                f"operational data is empty (shape {tuple(tensor.shape)}). Fix: give at least one operational input"
            )
        if tensor.dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
            bad = torch.nonzero(~torch.isfinite(tensor.reshape(tensor.shape[0], -1)))[0].tolist()
            raise DataError(
                f"operational data holds a non-finite value at row {bad[0]} (flattened column {bad[1]}). "
                f"Fix: drop or impute NaN/inf rows before building the profile"
            )
        return tensor.to(self.device)

    def _set_bandwidth(self, bandwidth: Any) -> None:
        n, d = self.n, self.dim
        if isinstance(bandwidth, str):
            rule = bandwidth.lower()
            if rule not in BANDWIDTH_RULES:
                raise ConfigError(
                    f"bandwidth {bandwidth!r} is not a known rule; use one of {list(BANDWIDTH_RULES)}, "
                    f"a positive number or one positive number per dimension ({d})"
                )
            if n < 2:
                raise ConfigError(
                    f"bandwidth rule {rule!r} needs at least 2 operational points to estimate their spread; "
                    f"got {n}. Fix: give more data or a numeric bandwidth"
                )
            self.factor = n ** (-1.0 / (d + 4)) if rule == "scott" else (n * (d + 2) / 4.0) ** (-1.0 / (d + 4))
            if self.full_covariance:
                centred = self.points - self.points.mean(0, keepdim=True)
                cov = centred.T @ centred / (n - 1) * self.factor**2
                self._set_full(cov, f"rule {rule!r}")
                return
            # diagonal kernels need the per-dimension variances only: never the (d, d) covariance, which
            # for a 3x224x224 image is 150,528² float64 values (181 GB)
            std = _column_variance(self.points).sqrt()
            flat = torch.nonzero(std <= 0).reshape(-1).tolist()
            if flat:
                raise ConfigError(
                    f"bandwidth rule {rule!r} gives 0 in dimension(s) {flat}: the operational data are constant "
                    f"there. Fix: give a numeric bandwidth, or drop the constant dimension(s)"
                )
            self._set_diagonal(std * self.factor)
            return
        if isinstance(bandwidth, bool):
            raise ConfigError(f"bandwidth must be a rule name or positive number(s), got {bandwidth!r}")
        try:
            value = bandwidth.detach().to("cpu", torch.float64) if isinstance(bandwidth, Tensor) \
                else torch.as_tensor(np.asarray(bandwidth, dtype=np.float64))
        except (TypeError, ValueError):
            raise ConfigError(
                f"bandwidth must be 'scott', 'silverman', a positive number or one positive number per dimension; "
                f"got {bandwidth!r}"
            ) from None
        if self.full_covariance and value.ndim == 2:
            if tuple(value.shape) != (d, d):
                raise ConfigError(f"a bandwidth matrix must be ({d}, {d}), got {tuple(value.shape)}")
            self._set_full(value.to(self.device), "the given matrix")
            return
        if value.ndim == 0:
            value = value.expand(d).clone()
        if value.ndim != 1 or value.shape[0] != d:
            raise ConfigError(
                f"bandwidth must be a scalar or have one entry per dimension ({d}); got shape {tuple(value.shape)}"
            )
        if not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
            raise ConfigError(f"bandwidth values must be finite and > 0, got {value.tolist()}")
        value = value.to(self.device)
        if self.full_covariance:
            self._set_full(torch.diag(value * value), "the given bandwidth")
        else:
            self._set_diagonal(value)

    def _set_diagonal(self, h: Tensor) -> None:
        self.bandwidth = h.to(self.device, torch.float64)
        # diagonal kernels keep their d bandwidths only: the (d, d) matrices are made on request
        # (:attr:`covariance`), never at fit time (150,528² float64 values for a 3x224x224 image)
        self._full_cov: Tensor | None = None
        self._chol: Tensor | None = None
        self._log_norm = float(torch.log(self.bandwidth).sum()) + self.dim * _LOG_SQRT_2PI

    def _set_full(self, cov: Tensor, what: str) -> None:
        cov = cov.to(self.device, torch.float64)
        cov = (cov + cov.T) / 2
        chol, info = torch.linalg.cholesky_ex(cov)
        if int(info) != 0:
            raise ConfigError(
                f"the kernel covariance from {what} is not positive definite (the data may be collinear). "
                f"Fix: use full_covariance=False, or give a bandwidth"
            )
        self.bandwidth = None
        self._full_cov = cov
        self._chol = chol
        self._log_norm = float(torch.log(chol.diagonal()).sum()) + self.dim * _LOG_SQRT_2PI

    def with_bandwidth(self, bandwidth: str | float | Sequence[float] | Tensor) -> OperationalProfile:
        """The same data, encoder and decoder with another bandwidth."""
        clone = object.__new__(OperationalProfile)
        clone.__dict__.update(self.__dict__)
        clone._bandwidth_spec = bandwidth
        clone.factor = None
        clone._set_bandwidth(bandwidth)
        return clone

    @property
    def covariance(self) -> Tensor:
        """The kernel covariance ``H`` ``(d, d)``: ``diag(h²)`` for diagonal kernels (made on request)."""
        if self._full_cov is not None:
            return self._full_cov
        assert self.bandwidth is not None
        return torch.diag(self.bandwidth**2)

    # ------------------------------------------------------------------ spaces
    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one model input (what :meth:`decode` returns per point)."""
        return self._input_shape or (self.dim,)

    @property
    def latent(self) -> bool:
        """Whether the profile lives in a latent space (an encoder was given)."""
        return self.encoder is not None

    def encode(self, x: Any) -> Tensor:
        """Inputs ``(M, …)`` → profile-space points ``(M, d)`` (float64, on the profile's device)."""
        if self.encoder is None:
            return as_tensor_2d(x, "inputs", device=self.device)
        tensor = x.detach() if isinstance(x, Tensor) else torch.as_tensor(np.asarray(x))
        with torch.no_grad():
            z = self.encoder(tensor.to(self.device))
        z = as_tensor_2d(z, "encoder output", device=self.device, flatten=False)
        if hasattr(self, "dim") and z.shape[1] != self.dim:
            raise DataError(f"encoder returned {z.shape[1]} latent dimensions, but the profile has {self.dim}")
        return z

    def decode(self, z: Tensor) -> Tensor:
        """Profile-space points ``(M, d)`` → model inputs ``(M, *input_shape)``.

        Without a decoder the points are reshaped to the inputs' shape (a no-op for ``(N, d)`` data).
        """
        if self.decoder is None:
            if self.encoder is None and self.input_shape != (z.shape[-1],) and \
                    math.prod(self.input_shape) == z.shape[-1]:
                return z.reshape(z.shape[0], *self.input_shape)
            return z
        with torch.no_grad():
            x = self.decoder(z)
        if not isinstance(x, Tensor):
            x = torch.as_tensor(np.asarray(x), device=z.device)
        return x

    # ------------------------------------------------------------------ density
    def _check_points(self, points: Any, what: str = "points") -> Tensor:
        pts = as_tensor_2d(points, what, device=self.device, flatten=False)
        if pts.shape[1] != self.dim:
            raise DataError(f"{what} have {pts.shape[1]} coordinates but the profile has {self.dim} dimensions")
        return pts

    def _chunk(self, per_item: int) -> int:
        return max(1, _CHUNK_ELEMS // max(1, per_item))

    def log_kernels(self, points: Tensor) -> Tensor:
        """``log φ_H(points_m − X_j)`` as an ``(M, N)`` matrix (``points`` already validated)."""
        if self.bandwidth is not None:
            diff = (points[:, None, :] - self.points[None, :, :]) / self.bandwidth
        else:
            rel = (points[:, None, :] - self.points[None, :, :]).reshape(-1, self.dim)
            diff = torch.linalg.solve_triangular(self._chol, rel.T, upper=False).T.reshape(
                points.shape[0], self.n, self.dim)
        return -0.5 * (diff * diff).sum(-1) - self._log_norm

    def density(self, points: Any, weights: Tensor | None = None) -> Tensor:
        """``Op̂(points)`` (eq. 8), ``(M,)`` float64; ``weights`` ``(B, N)`` give ``(B, M)`` refits."""
        pts = self._check_points(points)
        chunk = self._chunk(self.n * self.dim)
        outs = []
        for start in range(0, pts.shape[0], chunk):
            kern = self.log_kernels(pts[start : start + chunk]).exp()  # (c, N)
            outs.append(kern.mean(1) if weights is None else (weights @ kern.T) / self.n)
        return torch.cat(outs, dim=-1)

    # ------------------------------------------------------------------ cell masses
    def _require_diagonal(self, what: str) -> Tensor:
        if self.bandwidth is None:
            raise ConfigError(
                f"{what} needs diagonal kernels (a product of 1-D normal CDFs); this profile has a full kernel "
                f"covariance. Fix: use mass='centre', or build the profile with full_covariance=False"
            )
        return self.bandwidth

    def _check_boxes(self, lower: Any, upper: Any) -> tuple[Tensor, Tensor]:
        lo = self._check_points(lower, "lower corners")
        hi = self._check_points(upper, "upper corners")
        if lo.shape != hi.shape:
            raise DataError(f"lower corners {tuple(lo.shape)} and upper corners {tuple(hi.shape)} differ in shape")
        if bool((hi < lo).any()):
            raise DataError("every upper corner must be ≥ its lower corner")
        return lo, hi

    def box_factors(self, lower: Tensor, upper: Tensor) -> Tensor:
        """Per kernel and box, per dimension ``Φ((b − X_j)/h) − Φ((a − X_j)/h)``: ``(M, N, d)``."""
        h = self._require_diagonal("exact box masses")
        a = (lower[:, None, :] - self.points[None, :, :]) / h
        b = (upper[:, None, :] - self.points[None, :, :]) / h
        return _ndtr_diff(a, b)

    def box_mass(self, lower: Any, upper: Any, weights: Tensor | None = None) -> Tensor:
        """Exact KDE mass of boxes ``[lower, upper]`` (product of normal CDF differences, averaged over kernels).

        ``lower``/``upper`` are ``(M, d)``; returns ``(M,)``, or ``(B, M)`` for bootstrap weights ``(B, N)``.
        """
        lo, hi = self._check_boxes(lower, upper)
        self._require_diagonal("exact box masses")
        chunk = self._chunk(self.n * self.dim)
        outs = []
        for start in range(0, lo.shape[0], chunk):
            per_kernel = self.box_factors(lo[start : start + chunk], hi[start : start + chunk]).prod(-1)  # (c, N)
            outs.append(per_kernel.mean(1) if weights is None else (weights @ per_kernel.T) / self.n)
        return torch.cat(outs, dim=-1)

    def centre_mass(self, lower: Any, upper: Any, weights: Tensor | None = None) -> Tensor:
        """The paper's eq. (9): ``Op̂(centre) · volume`` of boxes ``[lower, upper]``."""
        lo, hi = self._check_boxes(lower, upper)
        volume = (hi - lo).prod(-1)
        return self.density((lo + hi) / 2, weights) * volume

    def cell_mass(self, lower: Any, upper: Any, method: str = "exact", weights: Tensor | None = None) -> Tensor:
        """Unnormalised cell masses by ``method`` ``"exact"`` or ``"centre"`` (eq. 9; ``"center"`` also works)."""
        if canonical_mass(method, "mass method") == "exact":
            return self.box_mass(lower, upper, weights)
        return self.centre_mass(lower, upper, weights)

    def axis_factors(self, edges: Sequence[Tensor], method: str = "exact") -> list[Tensor]:
        """For an axis-aligned grid with cell ``edges`` per dimension: per dimension an ``(N, n_k)`` table.

        The (unnormalised) mass of cell ``(i_1, …, i_d)`` is ``(1/N) Σ_j Π_k F_k[j, i_k]`` — the
        exact CDF differences (``"exact"``) or ``φ_h(centre − X_j)·width`` (``"centre"``, eq. 9).
        Diagonal kernels only.
        """
        h = self._require_diagonal("grid cell masses")
        if len(edges) != self.dim:
            raise DataError(f"edges must give one edge vector per dimension ({self.dim}), got {len(edges)}")
        method = canonical_mass(method, "mass method")
        tables = []
        for k, e in enumerate(edges):
            e = e.to(self.device, torch.float64)
            x = self.points[:, k : k + 1]
            if method == "exact":
                z = (e[None, :] - x) / h[k]
                tables.append(_ndtr_diff(z[:, :-1], z[:, 1:]))
            else:  # "centre"
                centre = (e[1:] + e[:-1]) / 2
                width = e[1:] - e[:-1]
                z = (centre[None, :] - x) / h[k]
                tables.append(torch.exp(-0.5 * z * z - _LOG_SQRT_2PI) / h[k] * width[None, :])
        return tables

    # ------------------------------------------------------------------ bootstrap (Appendix A)
    def bootstrap_weights(self, replicates: int, seed: int = 0, size: str = "full") -> Tensor:
        """Resampling weights ``W`` ``(B, N)`` (float64): how often each point is drawn in refit ``b``.

        ``size="full"`` (the standard bootstrap): ``N`` draws of ``N``, ``W_bj`` the counts.
        ``size="half"`` (the paper's reference implementation, an m-out-of-n bootstrap):
        ``m = max(1, ⌊N/2⌋)`` draws, ``W_bj = (N/m) · count_bj`` so each row still sums to ``N``
        and ``(1/N) Σ_j W_bj φ_H(· − X_j)`` is the KDE of the ``m`` drawn points. It over-states the
        variance of the ``N``-point KDE's masses by about ``N/m ≈ 2`` (see the module docstring).
        Same ``seed`` and ``size``, same weights.
        """
        if isinstance(replicates, bool) or not isinstance(replicates, int) or replicates < 0:
            raise ConfigError(f"bootstrap must be a non-negative int (number of KDE refits), got {replicates!r}")
        draws = self._bootstrap_draws(size)
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        idx = torch.randint(0, self.n, (replicates, draws), generator=gen)
        counts = torch.zeros(replicates, self.n, dtype=torch.float64)
        counts.scatter_add_(1, idx, torch.ones(replicates, draws, dtype=torch.float64))
        if draws != self.n:
            counts *= self.n / draws
        return counts.to(self.device)

    def _bootstrap_draws(self, size: Any) -> int:
        """Points drawn per refit for ``size`` (``"full"``: N, ``"half"``: max(1, ⌊N/2⌋)), or a ConfigError."""
        if size not in BOOTSTRAP_SIZES:
            raise ConfigError(
                f"bootstrap_size must be one of {list(BOOTSTRAP_SIZES)} ('full': the standard bootstrap, N of N "
                f"points per refit; 'half': the paper's N/2-point refits, about 2x the variance), got {size!r}"
            )
        return self.n if size == "full" else max(1, self.n // 2)

    def bootstrap_masses(self, lower: Any, upper: Any, replicates: int = 100, seed: int = 0,
                         method: str = "exact", size: str = "full") -> Tensor:
        """Masses of the boxes under ``replicates`` KDE refits (Appendix A): ``(B, M)``; ``size`` as for
        :meth:`bootstrap_weights`."""
        return self.cell_mass(lower, upper, method, self.bootstrap_weights(replicates, seed, size))

    def mass_moments(self, lower: Any, upper: Any, replicates: int = 100, seed: int = 0,
                     method: str = "exact", size: str = "full") -> tuple[Tensor, Tensor]:
        """``E[Op_i]`` (the full-data estimate, eqs. 10/12) and ``V[Op_i] = σ̂²_B`` (eq. 11, App. A), unnormalised.

        ``size``: ``"full"`` (standard bootstrap) or ``"half"`` (the paper's half-size refits, ≈ 2× the
        variance); see :meth:`bootstrap_weights`.
        """
        mean = self.cell_mass(lower, upper, method)
        if replicates < 2:
            self._bootstrap_draws(size)
            return mean, torch.zeros_like(mean)
        reps = self.bootstrap_masses(lower, upper, replicates, seed, method, size)
        return mean, reps.var(0, unbiased=True)

    def __repr__(self) -> str:
        bw = "full" if self.bandwidth is None else [round(float(v), 6) for v in self.bandwidth]
        return (f"OperationalProfile(n={self.n}, dim={self.dim}, bandwidth={bw}, "
                f"latent={self.latent}, device={str(self.device)!r})")


class PCA:
    """Principal component analysis as an encoder/decoder pair (a latent space for the profile).

    ``fit(x)`` flattens ``x`` ``(N, …)``, centres it and keeps the first ``n_components`` right
    singular vectors of the centred data (``torch.linalg.svd``), signs fixed so that each
    component's largest-magnitude loading is positive. ``encode(x) = (x − mean) Vᵀ``,
    ``decode(z) = z V + mean`` reshaped to the fitted input shape (the inverse PCA).
    """

    def __init__(self, n_components: int, dtype: torch.dtype = torch.float32) -> None:
        if isinstance(n_components, bool) or not isinstance(n_components, int) or n_components < 1:
            raise ConfigError(f"PCA n_components must be a positive int, got {n_components!r}")
        self.n_components = n_components
        self.dtype = dtype
        self.mean: Tensor | None = None
        self.components: Tensor | None = None
        self.explained_variance: Tensor | None = None
        self.input_shape: tuple[int, ...] | None = None

    def fit(self, x: Any) -> PCA:
        """Fit on ``x`` ``(N, …)``; returns ``self``."""
        data = as_tensor_2d(x, "PCA data", dtype=torch.float64)
        raw_shape = tuple(x.shape[1:]) if hasattr(x, "shape") and len(x.shape) > 1 else (data.shape[1],)
        n, features = data.shape
        if self.n_components > min(n, features):
            raise ConfigError(
                f"PCA n_components={self.n_components} exceeds min(samples, features) = {min(n, features)}"
            )
        mean = data.mean(0)
        _, s, vh = torch.linalg.svd(data - mean, full_matrices=False)
        comps = vh[: self.n_components]
        signs = torch.sign(comps.gather(1, comps.abs().argmax(1, keepdim=True)))
        signs[signs == 0] = 1
        self.components = (comps * signs).to(self.dtype)
        self.mean = mean.to(self.dtype)
        self.explained_variance = (s[: self.n_components] ** 2 / max(n - 1, 1)).to(self.dtype)
        self.input_shape = raw_shape
        return self

    def _fitted(self) -> tuple[Tensor, Tensor]:
        if self.mean is None or self.components is None:
            raise ConfigError("PCA is not fitted; call fit(x) first")
        return self.mean, self.components

    def encode(self, x: Any) -> Tensor:
        """Inputs ``(M, …)`` → latent ``(M, n_components)``."""
        mean, comps = self._fitted()
        tensor = x if isinstance(x, Tensor) else torch.as_tensor(np.asarray(x))
        flat = tensor.reshape(tensor.shape[0], -1).to(comps.device, comps.dtype)
        if flat.shape[1] != comps.shape[1]:
            raise DataError(f"PCA.encode: inputs have {flat.shape[1]} features, the PCA was fitted on {comps.shape[1]}")
        return (flat - mean) @ comps.T

    def decode(self, z: Tensor) -> Tensor:
        """Latent ``(M, n_components)`` → inputs ``(M, *input_shape)`` (inverse PCA), in ``z``'s dtype and device."""
        mean, comps = self._fitted()
        comps = comps.to(z.device, z.dtype)
        flat = z @ comps + mean.to(z.device, z.dtype)
        return flat.reshape(z.shape[0], *(self.input_shape or (comps.shape[1],)))

    def to(self, device: torch.device | str) -> PCA:
        """Move the fitted mean and components to ``device``."""
        mean, comps = self._fitted()
        self.mean, self.components = mean.to(device), comps.to(device)
        return self
