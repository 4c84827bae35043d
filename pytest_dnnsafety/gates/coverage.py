"""Built-in gate family: scenario coverage (``min_scene_coverage``), engine :mod:`..scenarios`.

A family module is a pytest plugin: it registers its gates through the
``pytest_dnnsafety_register_gates`` hook, exactly as a user's ``conftest.py`` or an installed plugin
does. Built-in families are listed in :data:`pytest_dnnsafety.gates.BUILTIN_FAMILIES`.
"""

from __future__ import annotations

from typing import Any, Mapping

from pytest_dnnsafety.errors import MetricError
from pytest_dnnsafety.gates.hookspecs import hookimpl
from pytest_dnnsafety.gates.family import Family
from pytest_dnnsafety.report.plots import plot_pair_grids
from pytest_dnnsafety.results import Measurement
from pytest_dnnsafety.settings import TASK_NAMES
from pytest_dnnsafety.gates.core import GateContext, GateDef, GateRegistry, GateSpec, Param
from pytest_dnnsafety.gates.checks import check_where, in_range

__all__ = ["K", "MIN_SCENE_COVERAGE", "pytest_dnnsafety_register_gates"]

#: ``k`` of a k-way coverage (shared with the neuron family).
K = Param("k", (int,), 2, in_range(1, 3), "use k = 1, 2 or 3")


def _measure_scene_coverage(spec: GateSpec, fx: Mapping[str, Any], ctx: GateContext) -> Measurement:
    """Scenario k-projection coverage (Cheng et al. 2018, §II-A, eq. 1), via ScenarioTable.coverage."""
    from pytest_dnnsafety.scenarios import ScenarioTable

    table = fx["scenarios"]
    if not isinstance(table, ScenarioTable):
        raise MetricError(
            f"fixture {spec.fixtures['scenarios']!r} returned {type(table).__name__}, not a ScenarioTable. "
            "Fix: return pytest_dnnsafety.ScenarioTable(Conditions(domains, restrictions), rows)"
        )
    data = fx.get("data")  # present when the data is configured, overridden or named by keyword
    if data is not None:
        from pytest_dnnsafety.scenarios import check_rows_match, count_samples

        check_rows_match(table, count_samples(data), table_fixture=spec.fixtures["scenarios"],
                         data_fixture=spec.fixtures["data"])
    opts = spec.options
    res = table.coverage(k=opts["k"], min_count=opts["min_count"], where=opts["where"], seed=ctx.seed)
    return Measurement(value=res.value, detail=res.detail(), details=res.to_details())


MIN_SCENE_COVERAGE = GateDef(
    marker="min_scene_coverage",
    metric="scenario k-projection coverage",
    op=">=",
    threshold_range=(0.0, 1.0),
    params=(
        K,
        Param("min_count", (int,), 1, in_range(1, 10**9),
              "use a positive integer: a cell counts as covered with at least min_count rows"),
        Param("where", (dict, type(None)), None, check_where,
              "use a dict of condition -> value or list of values, e.g. where={'lighting': 'night'}"),
    ),
    fixtures={"scenarios": "scenario_table", "data": "dataset"},
    optional={"data": "data"},
    measure=_measure_scene_coverage,
    tasks=TASK_NAMES,  # reads no class scores: any model whose layers it can read
    doc="fail unless the scenario table covers at least `threshold` of all feasible k-way "
        "combinations of operating-condition values (Cheng et al. 2018, eq. 1)",
)


#: The coverage family, declared once: its gates, its docs title and the plots of their details.
FAMILY = Family("coverage", "Scenario coverage", (MIN_SCENE_COVERAGE,), plots={"pair_grids": plot_pair_grids}, order=10)


@hookimpl(tryfirst=True)  # built-ins first: a later duplicate names them as the first source
def pytest_dnnsafety_register_gates(registry: GateRegistry) -> None:
    registry.add_family(FAMILY)
