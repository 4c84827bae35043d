"""ScenarioGroups: the rows of a scenario table grouped by ``by=`` conditions, as the performance and detection gates
group them — the same layout as the performance engine's, labels, masks, feasibility, and the checks against the data.
"""

from __future__ import annotations

import pytest
import torch

from pytest_dnnsafety.engines.performance.scenario import ScenarioPerformanceEngine
from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.scenarios import Conditions, ScenarioTable
from pytest_dnnsafety.scenarios.groups import ScenarioGroups, by_names

DOMAINS = {"lighting": ["day", "dusk", "night"], "noise": ["low", "high"]}
FIXTURES = {"scenarios": "scenario_table", "data": "dataset"}


def _table(restrictions: tuple = ()) -> ScenarioTable:
    rows = [{"lighting": light, "noise": noise} for light in ("day", "night", "day", "dusk") for noise in ("low",)]
    rows += [{"lighting": "day", "noise": "high"}]
    return ScenarioTable(Conditions(DOMAINS, list(restrictions)), rows)


def test_by_names_takes_a_name_a_list_or_none() -> None:
    assert by_names({"by": "lighting"}) == ["lighting"]
    assert by_names({"by": ("lighting", "noise")}) == ["lighting", "noise"]
    assert by_names({"by": None}) == []


def test_the_groups_are_the_performance_engines_layout() -> None:
    table = _table()
    groups = ScenarioGroups.of(table, ["noise", "lighting"], n_rows=len(table), fixtures=FIXTURES)
    engine = ScenarioPerformanceEngine.from_table(table, ["noise", "lighting"])
    assert torch.equal(groups.index, engine.group_index(table)) and groups.index.device.type == "cpu"
    assert groups.by == ("noise", "lighting") and groups.n_groups == 6
    assert groups.label(0) == "noise=low × lighting=day" and groups.key(5) == {"noise": "high", "lighting": "night"}
    masks = list(groups.masks())
    assert [label for label, _, _ in masks][:3] == ["noise=low × lighting=day", "noise=low × lighting=dusk",
                                                    "noise=low × lighting=night"]
    assert [int(mask.sum()) for _, mask, _ in masks] == [2, 1, 1, 1, 0, 0]
    assert all(feasible for _, _, feasible in masks)


def test_restricted_groups_are_infeasible() -> None:
    table = _table(({"lighting": "night", "noise": "high"},))
    groups = ScenarioGroups.of(table, ["lighting", "noise"], n_rows=len(table), fixtures=FIXTURES)
    infeasible = [label for label, _, feasible in groups.masks() if not feasible]
    assert infeasible == ["lighting=night × noise=high"]


def test_without_by_all_rows_are_one_group_and_the_table_is_not_read() -> None:
    groups = ScenarioGroups.of(None, [], n_rows=4, fixtures=FIXTURES)
    assert [(label, mask.tolist(), feasible) for label, mask, feasible in groups.masks()] == [
        ("all", [True] * 4, True)]
    groups.check_rows(99)  # no table: nothing to check against


def test_an_unknown_condition_is_the_error_before_the_data_is_counted() -> None:
    class Unreadable:
        def __len__(self) -> int:
            raise AssertionError("the data was read before `by` was resolved")

    with pytest.raises(ConfigError, match="unknown condition.*'season'.*lighting, noise"):
        ScenarioGroups.of(_table(), ["season"], data=Unreadable(), fixtures=FIXTURES)


def test_rows_that_differ_from_the_data_name_both_fixtures() -> None:
    table = _table()
    with pytest.raises(MetricError, match=r"5 rows but the data has 7 samples \(fixtures 'scenario_table' and "
                                          r"'dataset'\)"):
        ScenarioGroups.of(table, ["lighting"], n_rows=7, fixtures=FIXTURES)
    groups = ScenarioGroups.of(table, ["lighting"], data=torch.zeros(5, 3), fixtures=FIXTURES)  # counted: 5
    with pytest.raises(MetricError, match="1 row\\(s\\) describe no sample"):
        groups.check_rows(4)
