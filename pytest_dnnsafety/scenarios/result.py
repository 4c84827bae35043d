"""Results of scenario coverage: :class:`CoverageResult` and :class:`SubsetCoverage`.

Part of :mod:`pytest_dnnsafety.scenarios`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from pytest_dnnsafety.scenarios.conditions import Conditions

#: ``pair_grids`` (the coverage details' per-pair count grids, for plots) are given only up to this
#: many pairs of conditions (10 conditions) and this many values per condition; beyond, the key is left out.
PAIR_GRID_MAX_PAIRS = 45
PAIR_GRID_MAX_VALUES = 40


def _format_where(where: Mapping[str, Sequence[str]] | None) -> str:
    if not where:
        return ""
    return ", ".join(f"{name}={'|'.join(values)}" for name, values in where.items())


def pair_grids_shown(cardinalities: Sequence[int]) -> bool:
    """Whether pair grids are kept: at most :data:`PAIR_GRID_MAX_PAIRS` pairs and
    :data:`PAIR_GRID_MAX_VALUES` values in every domain."""
    n = len(cardinalities)
    return n * (n - 1) // 2 <= PAIR_GRID_MAX_PAIRS and all(card <= PAIR_GRID_MAX_VALUES for card in cardinalities)


def pair_grids_from_counts(conditions: Conditions, flat: Tensor) -> list[dict[str, Any]]:
    """The pair grids (see :func:`pair_grids`) from the row counts of every k = 2 cell, laid out as
    :class:`ProjectionLayout` ``(cards, 2)`` lays them out; infeasible cells become ``-1``."""
    cards = conditions.cardinalities
    feasible, _ = conditions.cell_feasibility(2)
    values = torch.where(feasible, flat.to("cpu", torch.int64), torch.full_like(flat, -1, device="cpu",
                                                                                dtype=torch.int64)).tolist()
    names, domains = conditions.names, conditions.domains
    grids = []
    offset = 0
    for a, b in itertools.combinations(range(len(cards)), 2):
        ca, cb = cards[a], cards[b]
        grids.append({
            "conditions": [names[a], names[b]],
            "values": [list(domains[names[a]]), list(domains[names[b]])],
            "counts": [values[offset + i * cb : offset + (i + 1) * cb] for i in range(ca)],
        })
        offset += ca * cb
    return grids


def pair_grids(conditions: Conditions, codes: Tensor) -> list[dict[str, Any]] | None:
    """Row counts of every pair of conditions (for plots), or None when there are too many pairs or values.

    One entry per pair ``(a, b)`` in :func:`itertools.combinations` order:
    ``{"conditions": [a, b], "values": [[values of a], [values of b]], "counts": [[int]]}``, where
    ``counts[i][j]`` is the number of rows of ``codes`` with ``a = values[0][i]`` and
    ``b = values[1][j]``, and ``-1`` marks a cell that the restrictions make infeasible. One
    ``bincount`` per pair; ``None`` beyond :data:`PAIR_GRID_MAX_PAIRS` pairs or
    :data:`PAIR_GRID_MAX_VALUES` values in a domain. (``ScenarioTable.coverage`` sums the same grids
    out of its k-projection counts instead of counting the rows again.)
    """
    cards = conditions.cardinalities
    if not pair_grids_shown(cards):
        return None
    codes = codes.to("cpu", torch.int64)
    flat = [torch.bincount(codes[:, a] * cards[b] + codes[:, b], minlength=cards[a] * cards[b])
            for a, b in itertools.combinations(range(len(cards)), 2)]
    return pair_grids_from_counts(conditions, torch.cat(flat)) if flat else []


@dataclass(frozen=True)
class SubsetCoverage:
    """Coverage of one k-subset of conditions (one projection table)."""

    conditions: tuple[str, ...]
    covered: int
    total: int
    infeasible: int
    value: float

    def to_details(self) -> dict[str, object]:
        return {
            "conditions": list(self.conditions),
            "covered": self.covered,
            "total": self.total,
            "infeasible": self.infeasible,
            "value": self.value,
        }


@dataclass(frozen=True)
class CoverageResult:
    """Scenario k-projection coverage with its holes (Cheng et al. 2018, §II-A, eq. (1)).

    ``value = covered / total`` over feasible cells; ``infeasible`` cells are excluded and listed
    in ``infeasible_cells``; ``uncovered`` lists every feasible cell below ``min_count`` rows, in
    subset order then mixed-radix order; ``proposals`` are full feasible scenarios that close
    holes (``proposal_closes[i]`` holes closed by the i-th, given the ones before it);
    ``infeasible_rows`` counts data rows that the restrictions declare impossible.
    """

    value: float
    covered: int
    total: int
    infeasible: int
    k: int
    min_count: int
    n_rows: int
    where: dict[str, tuple[str, ...]] | None
    feasibility_exact: bool
    per_subset: list[SubsetCoverage]
    uncovered: list[dict[str, str]]
    infeasible_cells: list[dict[str, str]]
    proposals: list[dict[str, str]]
    proposal_closes: list[int]
    infeasible_rows: int = 0
    infeasible_row_examples: list[dict[str, Any]] = field(default_factory=list)
    #: per pair of conditions, the rows in scope per value pair (−1: infeasible); see :func:`pair_grids`
    pair_grids: list[dict[str, Any]] | None = None

    def detail(self, max_cells: int = 3) -> str:
        """The facts behind the value: ``k=2, 15/21 cells; uncovered: weather=cloudy × road=mud, …``.

        Lists the first ``max_cells`` uncovered cells (condition=value pairs joined by ' × ',
        '…' when more remain) and mentions excluded infeasible cells and approximate feasibility.
        """
        facts = [f"k={self.k}"]
        if self.min_count != 1:
            facts.append(f"min_count={self.min_count}")
        if self.where:
            facts.append(f"where {_format_where(self.where)}")
        facts.append(f"{self.covered}/{self.total} cells")
        if self.infeasible:
            facts.append(f"{self.infeasible} infeasible excluded")
        if not self.feasibility_exact:
            facts.append("feasibility approximate")
        text = ", ".join(facts)
        if self.uncovered and max_cells > 0:
            shown = [" × ".join(f"{c}={v}" for c, v in cell.items()) for cell in self.uncovered[:max_cells]]
            more = ", …" if len(self.uncovered) > max_cells else ""
            text += f"; uncovered: {', '.join(shown)}{more}"
        elif self.uncovered:
            text += f"; {len(self.uncovered)} uncovered"
        return text

    def summary(self, max_cells: int = 3) -> str:
        """One line: ``0.714 (k=2, 15/21 cells; uncovered: weather=cloudy × road=mud, …)``."""
        return f"{self.value:.3f} ({self.detail(max_cells)})"

    def to_details(self, max_cells: int | None = None) -> dict[str, object]:
        """JSON-able details (plain str/int/float/bool/list/dict); ``max_cells`` caps the cell lists."""

        def capped(cells: list[dict[str, str]]) -> list[dict[str, str]]:
            chosen = cells if max_cells is None else cells[:max_cells]
            return [dict(cell) for cell in chosen]

        details: dict[str, object] = {
            "metric": "scene_coverage",
            "value": self.value,
            "covered": self.covered,
            "total": self.total,
            "infeasible": self.infeasible,
            "k": self.k,
            "min_count": self.min_count,
            "n_rows": self.n_rows,
            "where": None if self.where is None else {c: list(v) for c, v in self.where.items()},
            "feasibility_exact": self.feasibility_exact,
            "infeasible_rows": self.infeasible_rows,
            "infeasible_row_examples": [
                {**e, "values": dict(e["values"])} for e in self.infeasible_row_examples
            ],
            "per_subset": [s.to_details() for s in self.per_subset],
            "n_uncovered": len(self.uncovered),
            "uncovered": capped(self.uncovered),
            "n_infeasible_cells": len(self.infeasible_cells),
            "infeasible_cells": capped(self.infeasible_cells),
            "proposals": [
                {"scenario": dict(p), "closes": c} for p, c in zip(self.proposals, self.proposal_closes)
            ],
        }
        if self.pair_grids is not None:  # for plots; left out when there are too many pairs or values
            details["pair_grids"] = [
                {"conditions": list(g["conditions"]), "values": [list(v) for v in g["values"]],
                 "counts": [list(row) for row in g["counts"]]}
                for g in self.pair_grids
            ]
        return details
