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

# The submodules hold one concept each; this package re-exports every name of the former single
# module ``scenarios.py``, private helpers included. ``EXACT_FEASIBILITY_LIMIT`` is read from here
# at run time, so setting ``pytest_dnnsafety.scenarios.EXACT_FEASIBILITY_LIMIT`` still takes effect.
from pytest_dnnsafety.scenarios.conditions import (
    _ENUM_CHUNK,
    EXACT_FEASIBILITY_LIMIT,
    Conditions,
    Where,
    _as_value_list,
    _coerce_value,
    _prefix,
    _product_codes,
    _toml_module,
)
from pytest_dnnsafety.scenarios.proposals import (
    _GreedyBuilder,
    _propose,
    scenario_strategy,
)
from pytest_dnnsafety.scenarios.result import (
    CoverageResult,
    SubsetCoverage,
    _format_where,
    pair_grids,
)
from pytest_dnnsafety.scenarios.table import (
    ScenarioTable,
    _check_code_tensor,
    _format_violation,
    check_rows_match,
    count_samples,
)

__all__ = [
    "EXACT_FEASIBILITY_LIMIT",
    "Conditions",
    "CoverageResult",
    "ScenarioTable",
    "SubsetCoverage",
    "check_rows_match",
    "count_samples",
]

