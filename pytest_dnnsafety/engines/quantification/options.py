"""The option records of DeepQuant: the property, the search's budget, the certificate, the gated statistic.

:func:`~pytest_dnnsafety.engines.quantification.search.lipschitz_search` and
:func:`~pytest_dnnsafety.engines.quantification.dataset.quantify_safety` take their options grouped (frozen
dataclasses, each validated once when it is built, with the messages the keywords had):

* :class:`SafetyProperty` — what is quantified: the safety expression ``s`` (its ``label`` and margin
  ``ε``) over the ball ``B(x, d, p) ∩ clip``;
* :class:`SearchBudget` — the pattern search and its gradient-norm seeds: the poll method, iterations
  and starts, the mesh rules, the ascents, the rows per forward pass and per poll tensor;
* :class:`Certification` — the certified radius: the bound method (CROWN or IBP) and its bisection steps;
* :class:`SearchPlan` — which search runs (coordinate, gradient, certified only, or auto), its query budget per
  input and the attack's steps (:mod:`.scale`);
* :class:`GatedRadius` — what a data set's summary gates and keeps: the statistic, its quantile, the
  worst inputs listed and the PGD check.

Pure torch; no pytest import.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass
from typing import Any

from pytest_dnnsafety.data.checks import check_choice, check_count, check_positive
from pytest_dnnsafety.engines.perturb.adversarial import check_clip
from pytest_dnnsafety.engines.quantification.common import BOUND_METHODS, NORMS, SEARCHES, _check_expression, _real
from pytest_dnnsafety.errors import ConfigError

__all__ = ["SafetyProperty", "SearchBudget", "Certification", "GatedRadius", "SearchPlan", "STATISTICS",
           "SEARCH_MODES"]

#: What the ``min_safe_radius`` gate compares: the proved radius, or the search's estimate (asked for explicitly).
STATISTICS = ("certified", "estimate")
#: Which search estimates the safe radius (see :mod:`.scale`).
SEARCH_MODES = ("auto", "coordinate", "gradient", "certified")


def _set(record: Any, **values: Any) -> None:
    """Store the validated (normalised) ``values`` on a frozen record."""
    for name, value in values.items():
        object.__setattr__(record, name, value)


@dataclass(frozen=True)
class SafetyProperty:
    """The safety expression ``s`` (one of :data:`~.common.EXPRESSIONS`) and the ball it is quantified over.

    ``label``: the class of ``top_vs_label`` (required) or ``reachability`` (default: each input's
    top class); ``eps``: the required margin ε ≥ 0 (a probability, at most 1, except for
    ``uncertainty``: nats); ``d``: the ball's radius in input units; ``norm``: ``"linf"``,
    ``"l2"`` or ``"l1"``; ``clip``: the inputs' valid range (None: none).
    """

    expression: str = "top_vs_runner_up"
    _: KW_ONLY
    d: float
    label: int | None = None
    eps: float = 0.0
    norm: str = "linf"
    clip: tuple[float, float] | None = (0.0, 1.0)

    def __post_init__(self) -> None:
        expression, label, eps = _check_expression(self.expression, self.label, self.eps)
        _set(self, expression=expression, label=label, eps=eps,
             d=check_positive(self.d, "d", fix="give the ball's radius in input units, e.g. d=0.1 for inputs in "
                                               "[0, 1]."),
             norm=check_choice(self.norm, "norm", NORMS, "use 'linf', 'l2' or 'l1'."),
             clip=check_clip(self.clip))

    def settings(self) -> dict[str, Any]:
        """The property as plain values (for the results' ``settings``)."""
        return {"expression": self.expression, "label": self.label, "eps": self.eps, "d": self.d, "norm": self.norm,
                "clip": None if self.clip is None else [self.clip[0], self.clip[1]]}


@dataclass(frozen=True)
class SearchBudget:
    """The pattern search for ``Q`` and its gradient-norm seeds (see the package docstring).

    ``method``: ``"gps"`` or ``"mads"``; ``iterations``: the most polls per search; ``starts``:
    independent searches per input; ``expansion``/``contraction``/``mesh_tol``: the mesh rules;
    ``mesh_init``: the first mesh size as a fraction of ``d``; ``ascent_starts`` (0: none)
    gradient-norm ascents of ``ascent_steps`` steps each; ``max_batch``: rows per forward pass;
    ``max_elements``: the largest poll tensor built at once. :func:`quantify_safety`'s PGD check
    runs ``iterations`` steps with ``starts`` restarts.
    """

    method: str = "gps"
    iterations: int = 100
    starts: int = 2
    expansion: float = 1.3
    contraction: float = 0.8
    mesh_tol: float = 1e-5
    mesh_init: float = 1.0
    ascent_steps: int = 10
    ascent_starts: int = 4
    max_batch: int = 8192
    max_elements: int = 1 << 24

    def __post_init__(self) -> None:
        method = check_choice(self.method, "method", SEARCHES, "use 'gps' (coordinate polls) or 'mads' (random "
                                                                "orthogonal polls).")
        iterations = check_count(self.iterations, "iterations", 1)
        starts = check_count(self.starts, "starts", 1)
        if not _real(self.expansion) or not math.isfinite(self.expansion) or self.expansion < 1:
            raise ConfigError(f"expansion={self.expansion!r} is not a finite number ≥ 1. Fix: e.g. expansion=1.3.")
        if not _real(self.contraction) or not 0 < self.contraction < 1:
            raise ConfigError(f"contraction={self.contraction!r} is not in (0, 1). Fix: e.g. contraction=0.8.")
        _set(self, method=method, iterations=iterations, starts=starts, expansion=float(self.expansion),
             contraction=float(self.contraction),
             mesh_tol=check_positive(self.mesh_tol, "mesh_tol", fix="e.g. mesh_tol=1e-5."),
             mesh_init=check_positive(self.mesh_init, "mesh_init",
                                      fix="give the first mesh size as a fraction of d, e.g. 1.0."),
             max_batch=check_count(self.max_batch, "max_batch", 1),
             max_elements=check_count(self.max_elements, "max_elements", 1),
             ascent_steps=check_count(self.ascent_steps, "ascent_steps", 0),
             ascent_starts=check_count(self.ascent_starts, "ascent_starts", 0))

    def settings(self) -> dict[str, Any]:
        """The search's rules as plain values (for the results' ``settings``)."""
        return {"method": self.method, "iterations": self.iterations, "starts": self.starts,
                "expansion": self.expansion, "contraction": self.contraction, "mesh_tol": self.mesh_tol,
                "mesh_init": self.mesh_init, "ascent_steps": self.ascent_steps, "ascent_starts": self.ascent_starts}


@dataclass(frozen=True)
class Certification:
    """The certified radius (:func:`~.certified.certified_radius`): ``method`` ``"crown"`` or ``"ibp"``, and
    ``steps`` halvings of the bisection over ``[0, d]`` after a first test of ``d``."""

    method: str = "crown"
    steps: int = 10

    def __post_init__(self) -> None:
        _set(self, method=check_choice(self.method, "certified", BOUND_METHODS, "use 'crown', 'ibp' or None."),
             steps=check_count(self.steps, "steps", 0))


@dataclass(frozen=True)
class GatedRadius:
    """What :func:`~.dataset.quantify_safety` gates and keeps.

    ``statistic``: the ``"certified"`` radii (the default; needs a :class:`Certification`) or the
    ``"estimate"``; ``quantile``: the lower quantile of the per-input radii gated, in [0, 1] (0: the
    minimum); ``worst``: how many inputs with the smallest gated radius to keep (0: none);
    ``pgd_check``: run PGD on ``s`` inside each input's estimated radius and, when the certificate
    is gated, its certified radius.
    """

    statistic: str = "certified"
    quantile: float = 0.0
    worst: int = 5
    pgd_check: bool = True

    def __post_init__(self) -> None:
        if not _real(self.quantile) or not 0 <= self.quantile <= 1:
            raise ConfigError(f"quantile={self.quantile!r} is not in [0, 1]. Fix: 0 gates the minimum, 0.05 the 5% "
                              f"quantile.")
        _set(self, quantile=float(self.quantile), worst=check_count(self.worst, "worst", 0),
             statistic=check_choice(self.statistic, "statistic", STATISTICS,
                                    "use 'certified' (the proved radius, the default) or 'estimate' (the heuristic)."))


@dataclass(frozen=True)
class SearchPlan:
    """Which search estimates the radius (:mod:`.scale`): ``search`` one of :data:`SEARCH_MODES`; ``max_queries``:
    the most single-input forwards per input (a gradient step counts 3) — the chosen search's estimate above it is
    refused before any work; ``attack_steps``: the gradient steps of the minimum-norm attack (``"gradient"``) or of
    the PGD check (``"certified"``); ``auto_bound``: ``certified=True`` was given (not a named method), so the
    certificate uses CROWN for the coordinate search and IBP for the others."""

    search: str = "auto"
    max_queries: int = 2_000_000
    attack_steps: int = 10
    auto_bound: bool = False

    def __post_init__(self) -> None:
        _set(self, search=check_choice(self.search, "search", SEARCH_MODES,
                                       "use 'auto', 'coordinate', 'gradient' or 'certified'."),
             max_queries=check_count(self.max_queries, "max_queries", 1),
             attack_steps=check_count(self.attack_steps, "attack_steps", 0))
