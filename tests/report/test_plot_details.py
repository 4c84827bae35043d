"""Details for plots (issue #8): scenario ``pair_grids``, neuron ``per_neuron_coverage``, pmi ``cells_plot``.

Each is checked against a small brute-force reference, for its size bounds and for being JSON-able.
"""

from __future__ import annotations

import itertools
import json
import math
import warnings

import pytest
import torch

from pytest_dnnsafety.engines.neurons.kactivation import PER_NEURON_PLOT_LIMIT, NeuronKActivationEngine
from pytest_dnnsafety.engines.reliability import ReliabilityWarning, assess_reliability
from pytest_dnnsafety.engines.reliability.result import CELLS_PLOT_LIMIT
from pytest_dnnsafety.scenarios import Conditions, ScenarioTable
from pytest_dnnsafety.scenarios.result import PAIR_GRID_MAX_PAIRS, PAIR_GRID_MAX_VALUES

# ====================================================================== scenario pair grids
DOMAINS = {
    "weather": ["sunny", "cloudy", "rainy", "snow"],
    "light": ["day", "dusk", "night"],
    "road": ["dry", "wet"],
    "traffic": ["low", "high"],
}
RESTRICTIONS = [
    {"weather": "snow", "road": "dry"},  # a pair restriction: (snow, dry) is infeasible
    {"light": "night", "traffic": "high", "road": "wet"},  # 3-way: no pair is infeasible by itself
    {"weather": "sunny", "light": "night"},
]


def _random_rows(conditions: Conditions, n: int, seed: int) -> list[dict[str, str]]:
    gen = torch.Generator().manual_seed(seed)
    rows = []
    while len(rows) < n:
        row = {name: values[int(torch.randint(len(values), (1,), generator=gen))]
               for name, values in conditions.domains.items()}
        if conditions.is_feasible(row):
            rows.append(row)
    return rows


def _brute_pair_grids(conditions: Conditions, rows: list[dict[str, str]], domains: dict | None = None) -> list[dict]:
    """Counts per value pair; -1 where no feasible full scenario (over ``domains``) has the pair."""
    names = conditions.names
    domains = dict(conditions.domains) if domains is None else domains
    full = [dict(zip(names, combo)) for combo in itertools.product(*(domains[n] for n in names))]
    feasible = [s for s in full if conditions.is_feasible(s)]
    grids = []
    for a, b in itertools.combinations(names, 2):
        counts = []
        for va in domains[a]:
            line = []
            for vb in domains[b]:
                if not any(s[a] == va and s[b] == vb for s in feasible):
                    line.append(-1)
                else:
                    line.append(sum(1 for r in rows if r[a] == va and r[b] == vb))
            counts.append(line)
        grids.append({"conditions": [a, b], "values": [list(domains[a]), list(domains[b])], "counts": counts})
    return grids


def test_pair_grids_match_a_brute_force_count() -> None:
    conditions = Conditions(DOMAINS, RESTRICTIONS)
    rows = _random_rows(conditions, 60, seed=1)
    details = ScenarioTable(conditions, rows).coverage(k=2).to_details()
    assert details["pair_grids"] == _brute_pair_grids(conditions, rows)
    assert len(details["pair_grids"]) == math.comb(len(DOMAINS), 2)
    snow_dry = details["pair_grids"][1]  # (weather, road)
    assert snow_dry["conditions"] == ["weather", "road"] and snow_dry["counts"][3][0] == -1
    json.dumps(details)


@pytest.mark.parametrize("k", [1, 3])
def test_pair_grids_do_not_depend_on_k(k: int) -> None:
    conditions = Conditions(DOMAINS, RESTRICTIONS)
    rows = _random_rows(conditions, 25, seed=2)
    table = ScenarioTable(conditions, rows)
    assert table.coverage(k=k).to_details()["pair_grids"] == _brute_pair_grids(conditions, rows)


def test_pair_grids_count_only_the_rows_where() -> None:
    conditions = Conditions(DOMAINS, RESTRICTIONS)
    rows = _random_rows(conditions, 80, seed=3)
    where = {"weather": ["cloudy", "rainy"], "traffic": "low"}
    details = ScenarioTable(conditions, rows).coverage(where=where).to_details()
    narrowed = {**DOMAINS, "weather": ["cloudy", "rainy"], "traffic": ["low"]}
    kept = [r for r in rows if r["weather"] in ("cloudy", "rainy") and r["traffic"] == "low"]
    assert details["pair_grids"] == _brute_pair_grids(conditions, kept, narrowed)


def test_pair_grids_without_rows_and_with_one_condition() -> None:
    conditions = Conditions(DOMAINS, RESTRICTIONS)
    grids = ScenarioTable(conditions, []).coverage().to_details()["pair_grids"]
    assert grids == _brute_pair_grids(conditions, [])
    single = ScenarioTable(Conditions({"a": ["x", "y"]}), [{"a": "x"}]).coverage(k=1).to_details()
    assert single["pair_grids"] == []


def test_pair_grids_are_left_out_beyond_the_bounds() -> None:
    many = {f"c{i}": ["a", "b"] for i in range(11)}  # 55 pairs
    assert math.comb(11, 2) > PAIR_GRID_MAX_PAIRS
    details = ScenarioTable(Conditions(many), [dict.fromkeys(many, "a")]).coverage().to_details()
    assert "pair_grids" not in details
    ten = {f"c{i}": ["a", "b"] for i in range(10)}  # 45 pairs: still given
    assert len(ScenarioTable(Conditions(ten), []).coverage().to_details()["pair_grids"]) == 45
    wide = {"a": [f"v{i}" for i in range(PAIR_GRID_MAX_VALUES + 1)], "b": ["x", "y"]}
    details = ScenarioTable(Conditions(wide), [{"a": "v0", "b": "x"}]).coverage().to_details()
    assert "pair_grids" not in details


# ====================================================================== neuron per-neuron coverage
def _brute_per_neuron(on: torch.Tensor, k: int) -> list[float]:
    n, c = on.shape
    patterns = {tuple(row) for row in on.int().tolist()}
    occupied = [0] * c
    for tup in itertools.combinations(range(c), k):
        for states in itertools.product((0, 1), repeat=k):
            hit = any(all(p[t] == s for t, s in zip(tup, states)) for p in patterns)
            if hit:
                for t in tup:
                    occupied[t] += 1
    per_total = math.comb(c - 1, k - 1) * 2**k
    return [o / per_total for o in occupied]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_per_neuron_coverage_matches_a_brute_force_count(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    acts = torch.randn(12, 7, generator=gen)
    acts[:, 2] = acts[:, 2].abs() + 0.1  # always on: its "off" patterns are never seen
    acts[:, 5] = -1.0  # always off
    engine = NeuronKActivationEngine(7, k=k)
    engine.update(acts)
    details = engine.compute().to_details()
    assert details["per_neuron_coverage"] == pytest.approx(_brute_per_neuron(acts > 0, k), abs=1e-12)
    json.dumps(details)


def test_per_neuron_coverage_k1_is_the_share_of_two_states() -> None:
    acts = torch.tensor([[1.0, -1.0, 0.0], [2.0, 1.0, 0.0]])
    engine = NeuronKActivationEngine(3, k=1)
    engine.update(acts)
    assert engine.compute().to_details()["per_neuron_coverage"] == [0.5, 1.0, 0.5]


def test_per_neuron_coverage_is_left_out_for_wide_layers() -> None:
    engine = NeuronKActivationEngine(PER_NEURON_PLOT_LIMIT + 1, k=1)
    engine.update(torch.randn(3, PER_NEURON_PLOT_LIMIT + 1, generator=torch.Generator().manual_seed(0)))
    assert "per_neuron_coverage" not in engine.compute().to_details()
    engine = NeuronKActivationEngine(PER_NEURON_PLOT_LIMIT, k=1)
    engine.update(torch.randn(3, PER_NEURON_PLOT_LIMIT, generator=torch.Generator().manual_seed(0)))
    assert len(engine.compute().to_details()["per_neuron_coverage"]) == PER_NEURON_PLOT_LIMIT


# ====================================================================== pmi cells plot
def _model(x: torch.Tensor) -> torch.Tensor:
    """Class 1 right of x₁ = 0.6 (the truth, from the labelled points, is x₁ ≥ 0.5)."""
    return (x[:, 0] >= 0.6).long()


def _assess(n_side: int, **options):
    gen = torch.Generator().manual_seed(0)
    op = torch.rand(400, 2, generator=gen, dtype=torch.float64) * 0.8 + 0.1
    x_lab = torch.rand(300, 2, generator=gen, dtype=torch.float64)
    y_lab = (x_lab[:, 0] >= 0.5).long()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReliabilityWarning)
        return assess_reliability(_model, op, (x_lab, y_lab), eps=1.0 / n_side, box=([0, 0], [1, 1]),
                                  samples_per_cell=8, bootstrap=0, **options)


def _brute_cells_plot(result, limit: int) -> dict:
    t = result.cells
    names = {0: "normal", 1: "empty", 2: "cross_boundary"}
    rows = []
    for i in range(t.op.shape[0]):
        rate = 1.0 if int(t.cell_type[i]) == 2 else int(t.failures[i]) / int(t.trials[i])
        rows.append((float(t.op[i]), i, rate, names[int(t.cell_type[i])]))
    rows.sort(key=lambda r: (-r[0], r[1]))
    rows = rows[:limit]
    return {"mass": [r[0] for r in rows], "failure_rate": [r[2] for r in rows], "type": [r[3] for r in rows]}


def test_cells_plot_matches_the_cell_table() -> None:
    result = _assess(7)  # x₁ = 0.5 inside a column of cells: cross-boundary cells
    plot = result.to_details()["cells_plot"]
    assert plot == _brute_cells_plot(result, CELLS_PLOT_LIMIT)
    assert len(plot["mass"]) == result.cells_evaluated == 49
    assert plot["mass"] == sorted(plot["mass"], reverse=True)
    assert set(plot["type"]) <= {"normal", "empty", "cross_boundary"} and "cross_boundary" in plot["type"]
    assert any(0 < r < 1 for r in plot["failure_rate"])  # cells straddling x₁ = 0.6 fail in part
    json.dumps(result.to_details())


def test_cells_plot_keeps_the_cells_of_largest_mass() -> None:
    result = _assess(50)  # 2,500 cells
    plot = result.to_details()["cells_plot"]
    assert result.cells_evaluated > CELLS_PLOT_LIMIT
    assert len(plot["mass"]) == CELLS_PLOT_LIMIT
    assert plot == _brute_cells_plot(result, CELLS_PLOT_LIMIT)
    assert plot["mass"][-1] >= float(torch.sort(result.cells.op, descending=True).values[CELLS_PLOT_LIMIT])


def test_cells_plot_for_balls() -> None:
    gen = torch.Generator().manual_seed(1)
    op = torch.rand(50, 2, generator=gen, dtype=torch.float64)
    x_lab = torch.rand(200, 2, generator=gen, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReliabilityWarning)
        result = assess_reliability(_model, op, (x_lab, (x_lab[:, 0] >= 0.5).long()), cells="balls", radius=0.03,
                                    samples_per_cell=8, bootstrap=0)
    plot = result.to_details()["cells_plot"]
    assert plot == _brute_cells_plot(result, CELLS_PLOT_LIMIT)
    assert plot["mass"] == [pytest.approx(1 / 50)] * 50
