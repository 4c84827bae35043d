"""Operating conditions, scenario tables and scenario k-projection coverage (user-facing).

Scenario coverage M_scene follows Cheng et al. 2018, §II-A, eq. (1): for every k-subset of
operating conditions, the share of value combinations (cells) that the evaluation data
reaches. This module adds what users need around the ratio:

* :class:`Conditions` — each condition's full value domain (unseen values still count) and
  *restrictions*, conjunctions of values that cannot occur together (e.g. bright light with
  high noise). Cells that no possible scenario reaches leave the denominator and are reported
  separately; the paper's reference kit ignores them in its printed coverage.
* :class:`ScenarioTable` — one row per evaluation sample, read from CSV or built in code.
* :class:`CoverageResult` — the value, per-subset ratios, *all* uncovered cells, the
  infeasible cells and a few proposed new scenarios (greedy, AETG-style) that close the most
  holes.
* :meth:`ScenarioTable.strategy` — a hypothesis strategy drawing feasible scenarios,
  uncovered cells first.

Counting is done by :class:`~pytest_dnnsafety.engines.coverage.scenario.ScenarioCoverageEngine`.
"""

from __future__ import annotations

# The public names of the scenarios layer (the submodules hold one concept each). ``EXACT_FEASIBILITY_LIMIT`` is
# read from here at run time, so setting ``pytest_dnnsafety.scenarios.EXACT_FEASIBILITY_LIMIT`` takes effect.
from pytest_dnnsafety.scenarios.conditions import (
    EXACT_FEASIBILITY_LIMIT,
    Conditions,
    Where,
)
from pytest_dnnsafety.scenarios.proposals import (
    scenario_strategy,
)
from pytest_dnnsafety.scenarios.result import (
    CoverageResult,
    SubsetCoverage,
    pair_grids,
)
from pytest_dnnsafety.scenarios.table import (
    ScenarioTable,
    check_rows_match,
    count_samples,
)

__all__ = [
    "EXACT_FEASIBILITY_LIMIT",
    "Conditions",
    "CoverageResult",
    "ScenarioTable",
    "SubsetCoverage",
    "Where",
    "pair_grids",
    "scenario_strategy",
    "check_rows_match",
    "count_samples",
]

