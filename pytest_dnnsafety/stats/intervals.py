"""Statistics of the reliability assessment — pmi and its upper bound (Zhao et al. 2021, eqs. 5–7, 13–14).

The probability of misclassification per input (pmi) is assembled from cells ``c_i`` of the
input (or latent) space, eq. (4)::

    λ = Σ_i Op_i · λ_i

where ``Op_i`` is the cell's operational-profile mass and ``λ_i`` its unastuteness (the
probability that a random input of the cell is misclassified). Both are estimated: ``Op_i`` by a
KDE with a bootstrap variance (:mod:`pytest_dnnsafety.engines.reliability.profile`), ``λ_i`` by Monte Carlo, ``k_i``
failures in ``n_i`` uniform samples (eqs. 13–14)::

    E[λ_i] = k_i / n_i,        V[λ_i] = s_i² / n_i = k_i (n_i − k_i) / (n_i² (n_i − 1))

Four ways of turning them into an upper bound are offered (:data:`METHODS`):

``"normal"`` — the paper's. Under independence (Assumption 1), eqs. (5)–(7)::

    E[λ]  = Σ_i E[Op_i] E[λ_i]
    V[λ]  = Σ_i E[λ_i]² V[Op_i] + E[Op_i]² V[λ_i] + V[λ_i] V[Op_i]
    Ub    = E[λ] + z_{1−α} √V[λ]

  It fails exactly where a safety case needs it: a cell with zero failures in ``n`` samples has
  sample variance ``s² = 0``, so it adds nothing to ``V[λ]`` although ``λ_i`` may be as large as
  about ``3.7/n`` at 97.5 % confidence. When most cells see no failure, ``V[λ]`` is built from the
  handful of cells that did, the CLT behind eq. (7) does not apply to that handful, and the bound
  under-covers (with no failure at all it collapses to ``Ub = E = 0``). The coverage simulation
  in ``tests/families/reliability/test_reliability.py`` measures this.

``"chernoff"`` — sound (a proof, not an approximation), recommended. With weights
  ``w_i = Op_i / n_i`` the estimate is ``Y = Σ_i w_i K_i``, ``K_i ~ Bin(n_i, λ_i)`` independent.
  For ``θ ≥ 0``, using ``log(1 − p(1 − e^{−s})) ≤ −p(1 − e^{−s})`` and that ``(1 − e^{−θw})/w``
  decreases in ``w``::

      E e^{−θY} = Π_i (1 − λ_i (1 − e^{−θ w_i}))^{n_i} ≤ exp(−(λ / w*) (1 − e^{−θ w*})),   w* = max_i w_i

  i.e. ``Y / w*`` has a lower-tail moment generating function dominated by that of
  ``Poisson(μ)``, ``μ = λ / w*``, *whatever* the split of ``λ`` over cells. Chernoff's bound
  then gives ``P(Y ≤ y) ≤ exp(−(μ − x − x ln(μ/x)))`` with ``x = y / w*``, and inverting it::

      Ub = w* · μ_α(x),    μ_α(x) = the root μ ≥ x of  μ − x − x ln(μ/x) = ln(1/α)

  holds with probability at least ``1 − α`` for every ``λ_i`` vector — including the case where
  every cell sees zero failures (then ``Ub = w* ln(1/α)``, exactly the exact Poisson/Clopper–Pearson
  zero-failure bound ``≈ 3.69 w*`` at 97.5 % when all ``w_i`` are equal). The price of a proof
  is ``w*``: cells with a large mass per sample dominate, hence the ``"proportional"``
  allocation of samples (``n_i ∝ Op_i`` makes all ``w_i`` equal, which minimises ``w*``). At
  moderate failure counts the bound is up to ~20 % above an exact Poisson bound; it is
  asymptotically tight.

``"clopper-pearson"`` — sound: each sampled cell gets an exact one-sided Clopper–Pearson upper
  bound at level ``1 − α/m`` (``m`` sampled cells), and by the union bound (Bonferroni) all ``m``
  hold together with probability ``≥ 1 − α``, so ``Σ Op_i U_i`` bounds ``λ``. Simple and exact but
  loose when ``m`` is large.

``"jeffreys"`` — Bayesian: ``λ_i ~ Beta(k_i + ½, n_i − k_i + ½)`` independently (the Jeffreys
  posterior), ``Op`` drawn from the bootstrap replicates; the ``1 − α`` quantile of ``Σ Op_i λ_i``
  over Monte Carlo draws is the bound (a credible bound). Each cell's prior adds half a
  pseudo-failure, so with many cells the posterior mean is biased upwards by about
  ``Σ_i Op_i / (2 (n_i + 1))``: empirically conservative when most cells see no failure, but with
  no frequentist guarantee (a single cell's one-sided Jeffreys bound under-covers for some ``λ``).

OP uncertainty. The bootstrap of Appendix A gives replicates ``Op^b``. ``"normal"`` uses their
per-cell variance in eq. (6). The sound methods split ``α`` (``alpha_op_share``): the ``λ`` part
is bounded at ``1 − α_λ`` for each replicate and the ``1 − α_op`` quantile over replicates is
taken (a bootstrap-percentile treatment of the KDE's sampling error — approximate, and blind to
the KDE's bias, like every KDE-based method). With no bootstrap the masses are taken as known.

Everything here is a pure function of tensors (float64) or numbers; scipy supplies the normal,
beta and root-finding routines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy import optimize, special
from torch import Tensor

from pytest_dnnsafety.errors import ConfigError, DataError

__all__ = [
    "METHODS",
    "Aggregate",
    "check_confidence",
    "normal_quantile",
    "binomial_moments",
    "aggregate_normal",
    "normal_upper",
    "clopper_pearson_upper",
    "clopper_pearson_lower",
    "clopper_pearson_interval",
    "jeffreys_upper",
    "poisson_chernoff_mu",
    "chernoff_upper",
    "stratified_chernoff_upper",
    "bonferroni_upper",
    "jeffreys_draws",
    "bootstrap_quantile",
    "LabelledErrorCheck",
    "labelled_error_check",
]

#: Names accepted by ``method=`` (see the module docstring).
METHODS: tuple[str, ...] = ("normal", "chernoff", "clopper-pearson", "jeffreys")


@dataclass(frozen=True)
class Aggregate:
    """``E[λ]``, ``V[λ]`` and the upper bound ``Ub`` at ``confidence`` (eqs. 5–7)."""

    E: float
    Var: float
    Ub: float
    confidence: float

    @property
    def std(self) -> float:
        """``√V[λ]`` (the column the paper's Table 1 labels "V")."""
        return math.sqrt(max(self.Var, 0.0))


def check_confidence(confidence: object, name: str = "confidence") -> float:
    """``confidence`` as a float strictly between 0 and 1, or a :class:`ConfigError` naming it."""
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float, np.floating, np.integer)):
        raise ConfigError(f"{name} must be a number strictly between 0 and 1 (e.g. 0.975), got {confidence!r}")
    value = float(confidence)
    if not (0.0 < value < 1.0) or math.isnan(value):
        raise ConfigError(
            f"{name} must lie strictly between 0 and 1, got {value!r}. Fix: give the confidence as a "
            f"probability, e.g. 0.975 for 97.5 %"
        )
    return value


def normal_quantile(p: float) -> float:
    """``z_p`` with ``P(Z ≤ z_p) = p`` for a standard normal ``Z`` (eq. 7's ``z_{1−α}``)."""
    p = check_confidence(p, "p")
    return float(special.ndtri(p))


def _as_f64(value: Tensor | Sequence[float] | np.ndarray | float, name: str) -> Tensor:
    if isinstance(value, Tensor):
        tensor = value.detach().to(torch.float64)
    else:
        tensor = torch.as_tensor(np.asarray(value, dtype=np.float64))
    return tensor.reshape(-1) if tensor.ndim == 0 else tensor


def _counts(failures: Tensor | Sequence[int] | np.ndarray, trials: Tensor | Sequence[int] | np.ndarray | int
            ) -> tuple[Tensor, Tensor]:
    k = _as_f64(failures, "failures")
    n = _as_f64(trials, "trials")
    k, n = torch.broadcast_tensors(k, n)
    if bool((n < 1).any()):
        raise DataError("trials must be at least 1 for every cell; a cell with no samples has no estimate")
    if bool(((k < 0) | (k > n)).any()):
        raise DataError("failures must lie between 0 and trials for every cell")
    return k, n


def binomial_moments(failures: Tensor | Sequence[int], trials: Tensor | Sequence[int] | int) -> tuple[Tensor, Tensor]:
    """Eqs. (13)–(14): ``E[λ_i] = k/n`` and ``V[λ_i] = s²/n = k(n − k) / (n²(n − 1))``.

    ``s²`` is the unbiased sample variance of the 0/1 outcomes. With ``n = 1`` it is undefined;
    the Bernoulli maximum ``1/4`` is used then. Note that ``k = 0`` (and ``k = n``) give
    ``V = 0``: the source of the paper method's over-confidence (see the module docstring).
    """
    k, n = _counts(failures, trials)
    mean = k / n
    var = torch.where(n > 1, k * (n - k) / (n * n * (n - 1).clamp_min(1)), torch.full_like(n, 0.25))
    return mean, var


def normal_upper(E: float, Var: float, confidence: float) -> float:
    """Eq. (7): ``Ub_{1−α} = E + z_{1−α} √Var``."""
    confidence = check_confidence(confidence)
    return float(E + normal_quantile(confidence) * math.sqrt(max(Var, 0.0)))


def aggregate_normal(op_mean: Tensor | Sequence[float], op_var: Tensor | Sequence[float],
                     lam_mean: Tensor | Sequence[float], lam_var: Tensor | Sequence[float],
                     confidence: float = 0.975) -> Aggregate:
    """The paper's aggregation under Assumption 1 (independence), eqs. (5)–(7)::

        E[λ] = Σ_i E[Op_i] E[λ_i]
        V[λ] = Σ_i E[λ_i]² V[Op_i] + E[Op_i]² V[λ_i] + V[λ_i] V[Op_i]
        Ub   = E[λ] + z_{1−α} √V[λ]

    All four inputs are per-cell vectors of the same length.
    """
    confidence = check_confidence(confidence)
    m, v = _as_f64(op_mean, "op_mean"), _as_f64(op_var, "op_var")
    lm, lv = _as_f64(lam_mean, "lam_mean"), _as_f64(lam_var, "lam_var")
    if not (m.shape == v.shape == lm.shape == lv.shape):
        raise DataError(
            f"op_mean, op_var, lam_mean, lam_var must have one entry per cell; got shapes "
            f"{tuple(m.shape)}, {tuple(v.shape)}, {tuple(lm.shape)}, {tuple(lv.shape)}"
        )
    E = float((m * lm).sum())
    Var = float((lm * lm * v + m * m * lv + lv * v).sum())
    return Aggregate(E=E, Var=Var, Ub=normal_upper(E, Var, confidence), confidence=confidence)


# ---------------------------------------------------------------------- exact binomial bounds
def clopper_pearson_upper(failures: Tensor | Sequence[int], trials: Tensor | Sequence[int] | int,
                          confidence: float = 0.975) -> Tensor:
    """Exact one-sided upper bound on a binomial proportion (Clopper & Pearson 1934).

    ``U = Beta⁻¹(confidence; k + 1, n − k)`` for ``k < n`` and ``U = 1`` for ``k = n``;
    ``P(λ ≤ U) ≥ confidence`` for every ``λ``. With ``k = 0``: ``U = 1 − (1 − confidence)^{1/n}``.
    """
    confidence = check_confidence(confidence)
    k, n = _counts(failures, trials)
    kn, nn = k.numpy(), n.numpy()
    with np.errstate(all="ignore"):
        upper = np.where(kn < nn, special.betaincinv(kn + 1.0, np.maximum(nn - kn, 1e-300), confidence), 1.0)
    return torch.from_numpy(np.asarray(upper, dtype=np.float64))


def clopper_pearson_lower(failures: Tensor | Sequence[int], trials: Tensor | Sequence[int] | int,
                          confidence: float = 0.975) -> Tensor:
    """Exact one-sided lower bound: ``Beta⁻¹(1 − confidence; k, n − k + 1)`` (0 when ``k = 0``)."""
    confidence = check_confidence(confidence)
    k, n = _counts(failures, trials)
    kn, nn = k.numpy(), n.numpy()
    with np.errstate(all="ignore"):
        lower = np.where(kn > 0, special.betaincinv(np.maximum(kn, 1e-300), nn - kn + 1.0, 1.0 - confidence), 0.0)
    return torch.from_numpy(np.asarray(lower, dtype=np.float64))


def clopper_pearson_interval(failures: Tensor | Sequence[int], trials: Tensor | Sequence[int] | int,
                             confidence: float = 0.95) -> tuple[Tensor, Tensor]:
    """Exact two-sided interval: each side at ``(1 + confidence)/2``."""
    confidence = check_confidence(confidence)
    side = (1.0 + confidence) / 2.0
    return clopper_pearson_lower(failures, trials, side), clopper_pearson_upper(failures, trials, side)


def jeffreys_upper(failures: Tensor | Sequence[int], trials: Tensor | Sequence[int] | int,
                   confidence: float = 0.975) -> Tensor:
    """Upper ``confidence`` quantile of the Jeffreys posterior ``Beta(k + ½, n − k + ½)``.

    A credible bound, not an exact confidence bound: for ``k = 0`` it is about ``χ²_{1;c}/(2n)``
    (``2.5/n`` at 97.5 %), below the exact ``3.69/n``.
    """
    confidence = check_confidence(confidence)
    k, n = _counts(failures, trials)
    return torch.from_numpy(np.asarray(special.betaincinv(k.numpy() + 0.5, n.numpy() - k.numpy() + 0.5, confidence),
                                       dtype=np.float64))


# ---------------------------------------------------------------------- sound weighted-sum bounds
def poisson_chernoff_mu(x: float, confidence: float) -> float:
    """The root ``μ ≥ x`` of ``μ − x − x·ln(μ/x) = ln(1/α)``, ``α = 1 − confidence`` (``μ = ln(1/α)`` at ``x = 0``).

    ``exp(−(μ − x − x ln(μ/x)))`` is Chernoff's bound on ``P(X ≤ x)`` for ``X ~ Poisson(μ)``
    (and for anything whose lower-tail moment generating function it dominates).
    """
    confidence = check_confidence(confidence)
    if not math.isfinite(x) or x < 0:
        raise DataError(f"poisson_chernoff_mu: x must be a finite number ≥ 0, got {x!r}")
    level = -math.log1p(-confidence)
    if x == 0.0:
        return level

    def gap(mu: float) -> float:
        return mu - x - x * math.log(mu / x) - level

    hi = x + level + math.sqrt(2.0 * x * level) + 1.0
    while gap(hi) < 0:
        hi = x + 2.0 * (hi - x)
    return float(optimize.brentq(gap, x, hi, xtol=1e-12 * max(1.0, x), rtol=1e-13, maxiter=200))


def chernoff_upper(op: Tensor | Sequence[float], failures: Tensor | Sequence[int],
                   trials: Tensor | Sequence[int] | int, confidence: float = 0.975) -> float:
    """Sound upper bound on ``Σ_i Op_i λ_i`` from ``K_i ~ Bin(n_i, λ_i)`` (module docstring, ``"chernoff"``).

    ``w_i = Op_i / n_i``, ``w* = max w_i``, ``x = Σ w_i k_i / w*``; the bound is
    ``min(Σ Op_i, w* · μ_α(x))`` with :func:`poisson_chernoff_mu`. Valid with probability
    ``≥ confidence`` for every vector of ``λ_i``, whatever the number of failures.
    """
    confidence = check_confidence(confidence)
    k, n = _counts(failures, trials)
    o = _as_f64(op, "op")
    if o.shape != k.shape:
        raise DataError(f"op has {tuple(o.shape)} entries but failures/trials {tuple(k.shape)}; give one per cell")
    if bool((o < 0).any()):
        raise DataError("op masses must be non-negative")
    total = float(o.sum())
    if o.numel() == 0 or total == 0.0:
        return 0.0
    w = o / n
    w_star = float(w.max())
    x = float((w * k).sum()) / w_star
    return min(total, w_star * poisson_chernoff_mu(x, confidence))


def stratified_chernoff_upper(op: Tensor | Sequence[float], failures: Tensor | Sequence[int],
                              trials: Tensor | Sequence[int] | int, strata: Tensor | Sequence[int],
                              confidence: float = 0.975) -> float:
    """Sound upper bound on ``Σ_i Op_i λ_i``: :func:`chernoff_upper` per stratum at ``α/G``, summed (Bonferroni).

    ``strata[i]`` names cell ``i``'s stratum (any integers); ``G`` is the number of distinct strata
    with positive mass. Each stratum ``g`` gets its own ``w*_g = max_{i∈g} Op_i/n_i`` and the
    bound ``U_g = min(Σ_{i∈g} Op_i, w*_g · μ_{α/G}(x_g))``; ``Σ_g U_g`` holds with probability
    ``≥ 1 − α`` for every vector of ``λ_i`` (each ``U_g`` fails with probability ``≤ α/G``, and the
    union bound needs no independence between strata).

    Why (beyond the paper): one Chernoff bound over all cells charges every cell the largest
    weight ``w*`` (all failure mass might sit on the heaviest-weight cell), so sampling a cell
    more finely than the coarsest one buys nothing. Strata decouple the weights: cells shown by a
    pilot stage to be failure-free can be sampled coarsely (their stratum costs about
    ``w*_g · ln(G/α)``), the failure-carrying ones finely, for a fraction of the queries of one
    uniform allocation. The strata must not depend on the counts ``failures`` bounded here (in
    :mod:`~pytest_dnnsafety.engines.reliability` they come from an independent pilot stage).
    """
    confidence = check_confidence(confidence)
    k, n = _counts(failures, trials)
    o = _as_f64(op, "op")
    g = torch.as_tensor(strata).reshape(-1).to(torch.int64)
    if o.shape != k.shape or g.shape != k.shape:
        raise DataError(f"op has {tuple(o.shape)} entries, strata {tuple(g.shape)}, failures/trials "
                        f"{tuple(k.shape)}; give one of each per cell")
    if bool((o < 0).any()):
        raise DataError("op masses must be non-negative")
    if o.numel() == 0 or float(o.sum()) == 0.0:
        return 0.0
    keys, inverse = torch.unique(g, return_inverse=True)
    n_g = int(keys.numel())
    w = o / n
    mass = torch.zeros(n_g, dtype=torch.float64).index_add_(0, inverse, o)
    w_star = torch.zeros(n_g, dtype=torch.float64).scatter_reduce_(0, inverse, w, reduce="amax")
    wk = torch.zeros(n_g, dtype=torch.float64).index_add_(0, inverse, w * k)
    live = mass > 0
    groups = int(live.sum())
    alpha = (1.0 - confidence) / groups
    total = 0.0
    for m_g, ws_g, wk_g in zip(mass[live].tolist(), w_star[live].tolist(), wk[live].tolist()):  # G is a handful
        total += min(m_g, ws_g * poisson_chernoff_mu(wk_g / ws_g, 1.0 - alpha))
    return total


def bonferroni_upper(op: Tensor | Sequence[float], failures: Tensor | Sequence[int],
                     trials: Tensor | Sequence[int] | int, confidence: float = 0.975) -> float:
    """Sound upper bound ``Σ_i Op_i · U_i`` with per-cell Clopper–Pearson bounds at ``1 − α/m`` (union bound)."""
    confidence = check_confidence(confidence)
    k, n = _counts(failures, trials)
    o = _as_f64(op, "op")
    if o.shape != k.shape:
        raise DataError(f"op has {tuple(o.shape)} entries but failures/trials {tuple(k.shape)}; give one per cell")
    m = k.numel()
    if m == 0:
        return 0.0
    per_cell = 1.0 - (1.0 - confidence) / m
    return float((o * clopper_pearson_upper(k, n, per_cell)).sum())


#: Shapes from which a Gamma variate is drawn by the Wilson–Hilferty cube (relative quantile
#: error below 1e-4 there); smaller shapes use torch's exact Gamma sampler, ½ uses ``Z²/2``.
_WILSON_HILFERTY_SHAPE = 50.0


def _gamma_draws(shape: Tensor, size: int) -> Tensor:
    """``size`` draws of independent ``Gamma(shape_i, 1)`` per entry: ``(size, C)`` float64 (global RNG).

    Normal variates are drawn in float32 (four times faster on CPUs; ample for quantiles).
    """
    out = torch.empty(size, shape.numel(), dtype=torch.float64, device=shape.device)
    half = shape == 0.5
    big = shape >= _WILSON_HILFERTY_SHAPE
    other = ~(half | big)
    if bool(half.any()):
        idx = torch.nonzero(half).reshape(-1)
        z = torch.randn(size, idx.numel(), dtype=torch.float32, device=shape.device).to(torch.float64)
        out[:, idx] = 0.5 * z * z  # Gamma(½, 1) = χ²₁ / 2, exactly
    if bool(big.any()):
        idx = torch.nonzero(big).reshape(-1)
        k = shape[idx]
        z = torch.randn(size, idx.numel(), dtype=torch.float32, device=shape.device).to(torch.float64)
        c = 1.0 / (9.0 * k)
        out[:, idx] = k * (1.0 - c + z * c.sqrt()).clamp_min(0.0) ** 3
    if bool(other.any()):
        idx = torch.nonzero(other).reshape(-1)
        k = shape[idx]
        out[:, idx] = torch.distributions.Gamma(k, torch.ones_like(k)).sample((size,))
    return out


def jeffreys_draws(op: Tensor, failures: Tensor, trials: Tensor, draws: int, *, seed: int = 0,
                   extra: Tensor | float = 0.0, chunk_elems: int = 1 << 22) -> Tensor:
    """Monte Carlo draws of ``Σ_i Op_i λ_i + extra`` with ``λ_i ~ Beta(k_i + ½, n_i − k_i + ½)`` (Jeffreys).

    ``op`` is one mass vector (``(C,)``) or bootstrap replicates (``(B, C)``; each draw picks a
    replicate uniformly); ``extra`` is a number or one value per replicate (``(B,)``) added to the
    matching draws (cells with known ``λ_i = 1`` and the conservatively counted rest). A Beta
    variate is ``G_a / (G_a + G_b)`` with independent Gamma variates (``Gamma(½) = Z²/2``
    exactly — the zero-failure cells —, the Wilson–Hilferty cube for shapes ≥ 50, torch's
    sampler otherwise). Draws are made in chunks of at most ``chunk_elems`` cell values,
    reproducibly from ``seed`` (the global RNG state is left untouched).
    """
    k, n = _counts(failures, trials)
    ops = op.detach().to(torch.float64)
    if ops.ndim == 1:
        ops = ops[None, :]
    if ops.shape[1] != k.numel():
        raise DataError(f"op has {ops.shape[1]} cells but failures/trials {k.numel()}")
    extras = torch.as_tensor(extra, dtype=torch.float64).reshape(-1)
    if extras.numel() not in (1, ops.shape[0]):
        raise DataError(f"extra must be a number or one value per replicate ({ops.shape[0]}), got {extras.numel()}")
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ConfigError(f"posterior draws must be an int ≥ 1, got {draws!r}")
    device = ops.device
    extras = extras.expand(ops.shape[0]).to(device)
    a = (k + 0.5).to(device)
    b = (n - k + 0.5).to(device)
    chunk = max(1, chunk_elems // max(1, k.numel()))
    out = torch.empty(draws, dtype=torch.float64, device=device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for start in range(0, draws, chunk):
            size = min(chunk, draws - start)
            ga = _gamma_draws(a, size)
            gb = _gamma_draws(b, size)
            pick = torch.randint(0, ops.shape[0], (size,), device=device)
            if k.numel():
                out[start : start + size] = (ops[pick] * (ga / (ga + gb))).sum(1) + extras[pick]
            else:
                out[start : start + size] = extras[pick]
    return out


def bootstrap_quantile(values: Tensor | Sequence[float], level: float) -> float:
    """The ``level`` quantile of ``values`` taken on the conservative side (the next order statistic up)."""
    v = _as_f64(values, "values")
    if v.numel() == 0:
        raise DataError("bootstrap_quantile needs at least one value")
    return float(np.quantile(v.cpu().numpy(), level, method="higher"))


# ---------------------------------------------------------------------- the bound against labelled data
@dataclass(frozen=True)
class LabelledErrorCheck:
    """The model's error on ``n`` labelled points held against a claimed upper bound on the pmi.

    ``lower`` is the exact one-sided Clopper–Pearson lower bound on the error probability at
    ``confidence``; ``p_value`` is the exact binomial tail ``P(K ≥ errors)`` for ``K ~ Bin(n, bound)``
    — the evidence against "pmi ≤ bound". ``contradicts`` ⇔ ``lower > bound`` ⇔ ``p_value < 1 −
    confidence``: at that level, the labelled data and the bound cannot both be right.
    """

    errors: int
    n: int
    rate: float
    lower: float
    bound: float
    confidence: float
    p_value: float
    contradicts: bool

    def to_dict(self) -> dict[str, float | int | bool]:
        return {"errors": self.errors, "n": self.n, "rate": self.rate, "lower": self.lower, "bound": self.bound,
                "confidence": self.confidence, "p_value": self.p_value, "contradicts": self.contradicts}


def labelled_error_check(errors: int, n: int, bound: float, confidence: float = 0.975) -> LabelledErrorCheck:
    """Do ``errors`` misclassifications in ``n`` labelled points contradict ``pmi ≤ bound``?

    If the labelled points are independent draws from the operational profile, the number of
    misclassified ones is ``Bin(n, pmi)``. The exact lower bound
    ``L = Beta⁻¹(1 − confidence; errors, n − errors + 1)`` (:func:`clopper_pearson_lower`) holds
    with probability ``≥ confidence``; ``L > bound`` therefore refutes the claimed bound at that
    level. The test is the same as the exact binomial test of ``H₀: pmi ≤ bound`` with the one-sided
    p-value ``P(Bin(n, bound) ≥ errors) = I_bound(errors, n − errors + 1)`` (regularised incomplete
    beta), rejected when below ``1 − confidence``.
    """
    confidence = check_confidence(confidence)
    if isinstance(errors, bool) or isinstance(n, bool) or int(errors) != errors or int(n) != n:
        raise DataError(f"errors and n must be integers, got {errors!r} and {n!r}")
    errors, n = int(errors), int(n)
    if n < 1 or not 0 <= errors <= n:
        raise DataError(f"need 0 ≤ errors ≤ n and n ≥ 1, got errors={errors}, n={n}")
    bound = float(bound)
    if math.isnan(bound):
        raise DataError("bound is NaN")
    lower = float(clopper_pearson_lower(errors, n, confidence)[0])
    b = min(max(bound, 0.0), 1.0)
    p_value = 1.0 if errors == 0 else float(special.betainc(errors, n - errors + 1, b))
    return LabelledErrorCheck(errors=errors, n=n, rate=errors / n, lower=lower, bound=bound, confidence=confidence,
                              p_value=p_value, contradicts=lower > bound)


