"""Conditions, ScenarioTable and CoverageResult (scenario k-projection coverage, Cheng et al. 2018, §II-A)."""

from __future__ import annotations

import itertools
import json
import textwrap
from collections import Counter
from fractions import Fraction
from pathlib import Path

import hypothesis
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import pytest_dnnsafety.scenarios as scenarios_module
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.scenarios import Conditions, CoverageResult, ScenarioTable

FIG2 = {
    "weather": ["sunny", "cloudy", "rainy"],
    "road": ["stone", "mud", "tarmac"],
    "orientation": ["straight", "curvy"],
}
FIG2_ROWS = [
    {"weather": "sunny", "road": "stone", "orientation": "straight"},
    {"weather": "rainy", "road": "tarmac", "orientation": "curvy"},
]
LIGHT = {"lighting": ["bright", "normal", "dim", "night"], "noise": ["none", "low", "high"], "lens": ["clean", "dirty"]}
LIGHT_RESTRICTIONS = [{"lighting": ["bright", "normal"], "noise": "high"}]


# ---------------------------------------------------------------------- brute-force reference
def _values(spec: object) -> list[str]:
    return [spec] if isinstance(spec, str) else list(spec)  # type: ignore[arg-type]


def violates(scenario: dict[str, str], restrictions: list[dict]) -> bool:
    return any(all(scenario[c] in _values(v) for c, v in r.items()) for r in restrictions)


def brute_force(domains: dict, restrictions: list[dict], rows: list[dict], k: int, min_count: int) -> dict:
    """M_scene with itertools and sets: feasibility over all full scenarios, no shortcuts."""
    names = list(domains)
    full = [dict(zip(names, combo)) for combo in itertools.product(*domains.values())]
    feasible_full = [s for s in full if not violates(s, restrictions)]
    covered = total = 0
    uncovered, infeasible = [], []
    for subset in itertools.combinations(names, k):
        reachable = {tuple(s[c] for c in subset) for s in feasible_full}
        counts = Counter(tuple(row[c] for c in subset) for row in rows)
        for cell in itertools.product(*(domains[c] for c in subset)):
            as_dict = dict(zip(subset, cell))
            if cell not in reachable:
                infeasible.append(as_dict)
                continue
            total += 1
            if counts[cell] >= min_count:
                covered += 1
            else:
                uncovered.append(as_dict)
    return {"covered": covered, "total": total, "uncovered": uncovered, "infeasible": infeasible}


def sufficient_infeasible(domains: dict, restrictions: list[dict], k: int) -> list[dict]:
    """The fallback's infeasible cells: a restriction lying inside the subset matches the cell."""
    names = list(domains)
    out = []
    for subset in itertools.combinations(names, k):
        for cell in itertools.product(*(domains[c] for c in subset)):
            as_dict = dict(zip(subset, cell))
            if any(set(r) <= set(subset) and all(as_dict[c] in _values(v) for c, v in r.items()) for r in restrictions):
                out.append(as_dict)
    return out


@st.composite
def problems(draw: st.DrawFn, max_conditions: int = 5, max_card: int = 3, max_rows: int = 16) -> dict:
    n = draw(st.integers(1, max_conditions))
    names = [f"c{i}" for i in range(n)]
    domains = {name: [f"{name}v{j}" for j in range(draw(st.integers(1, max_card)))] for name in names}
    restrictions = []
    for _ in range(draw(st.integers(0, 4))):
        conds = draw(st.lists(st.sampled_from(names), min_size=1, max_size=min(3, n), unique=True))
        restrictions.append(
            {c: draw(st.lists(st.sampled_from(domains[c]), min_size=1, max_size=2, unique=True)) for c in conds}
        )
    row = st.fixed_dictionaries({name: st.sampled_from(domains[name]) for name in names})
    rows = draw(st.lists(row, max_size=max_rows))
    return {
        "domains": domains,
        "restrictions": restrictions,
        "rows": rows,
        "k": draw(st.integers(1, min(3, n))),
        "min_count": draw(st.integers(1, 3)),
    }


def table_of(problem: dict) -> ScenarioTable:
    return ScenarioTable(Conditions(problem["domains"], problem["restrictions"]), problem["rows"])


# ---------------------------------------------------------------------- the paper's example
def test_fig2_reproduces_6_of_21_then_9_of_21() -> None:
    table = ScenarioTable(Conditions(FIG2), FIG2_ROWS)
    first = table.coverage(k=2)
    assert Fraction(first.covered, first.total) == Fraction(2 + 2 + 2, 9 + 6 + 6)
    assert (first.covered, first.total, first.infeasible) == (6, 21, 0)
    assert [(s.conditions, s.covered, s.total) for s in first.per_subset] == [
        (("weather", "road"), 2, 9),
        (("weather", "orientation"), 2, 6),
        (("road", "orientation"), 2, 6),
    ]
    second = table.with_rows([{"weather": "cloudy", "road": "mud", "orientation": "curvy"}]).coverage(k=2)
    assert Fraction(second.covered, second.total) == Fraction(3 + 3 + 3, 9 + 6 + 6)
    assert len(table) == 2  # with_rows returns a copy


def test_summary_lists_first_holes_in_stable_order() -> None:
    result = ScenarioTable(Conditions(FIG2), FIG2_ROWS).coverage()
    assert result.summary() == (
        "0.286 (k=2, 6/21 cells; uncovered: weather=sunny × road=mud, weather=sunny × road=tarmac, "
        "weather=cloudy × road=stone, …)"
    )
    assert result.summary(max_cells=20).endswith("road=mud × orientation=curvy, road=tarmac × orientation=straight)")
    assert "…" not in result.summary(max_cells=20)
    assert len(result.uncovered) == 15
    assert result.detail(max_cells=1) == "k=2, 6/21 cells; uncovered: weather=sunny × road=mud, …"
    assert result.detail(max_cells=0) == "k=2, 6/21 cells; 15 uncovered"


def test_summary_mentions_infeasible_cells_and_where() -> None:
    table = ScenarioTable(Conditions(LIGHT, LIGHT_RESTRICTIONS), [])
    text = table.coverage(k=2).summary()
    assert text.startswith("0.000 (k=2, 0/24 cells, 2 infeasible excluded; uncovered: lighting=bright × noise=none")
    scoped = table.coverage(k=2, where={"lighting": ["dim", "night"]}, min_count=2).summary()
    assert scoped.startswith("0.000 (k=2, min_count=2, where lighting=dim|night, 0/")


def test_full_coverage_summary_has_no_hole_list() -> None:
    rows = [dict(zip(FIG2, combo)) for combo in itertools.product(*FIG2.values())]
    result = ScenarioTable(Conditions(FIG2), rows).coverage(k=3)
    assert result.value == 1.0 and result.uncovered == [] and result.proposals == []
    assert result.summary() == "1.000 (k=3, 18/18 cells)"


# ---------------------------------------------------------------------- reference equality
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_coverage_equals_brute_force_reference(problem: dict) -> None:
    expected = brute_force(problem["domains"], problem["restrictions"], problem["rows"], problem["k"], problem["min_count"])
    table = table_of(problem)
    if expected["total"] == 0:
        with pytest.raises(MetricError, match="infeasible"):
            table.coverage(k=problem["k"], min_count=problem["min_count"], propose=0)
        return
    result = table.coverage(k=problem["k"], min_count=problem["min_count"], propose=0, allow_infeasible_rows=True)
    assert result.feasibility_exact
    assert (result.covered, result.total) == (expected["covered"], expected["total"])
    assert result.value == expected["covered"] / expected["total"]
    assert result.uncovered == expected["uncovered"]
    assert result.infeasible_cells == expected["infeasible"]
    assert result.infeasible == len(expected["infeasible"])
    assert sum(s.total for s in result.per_subset) == result.total
    impossible = [i for i, r in enumerate(problem["rows"]) if violates(r, problem["restrictions"])]
    assert result.infeasible_rows == len(impossible)
    assert [e["row"] for e in result.infeasible_row_examples] == impossible[:5]
    if impossible:  # by default a row the restrictions call impossible is refused, never counted
        with pytest.raises(DataError, match=rf"^{len(impossible)} scenario row\(s\) break a declared restriction"):
            table.coverage(k=problem["k"], min_count=problem["min_count"], propose=0)


def test_larger_random_tables_equal_reference_for_k_1_to_3() -> None:
    gen = torch.Generator().manual_seed(11)
    for trial in range(6):
        n = 6
        cards = torch.randint(2, 6, (n,), generator=gen).tolist()
        domains = {f"c{i}": [f"v{j}" for j in range(card)] for i, card in enumerate(cards)}
        names = list(domains)
        restrictions = [
            {names[1]: domains[names[1]][:1], names[3]: domains[names[3]][:2]},
            {names[0]: domains[names[0]][-1], names[2]: domains[names[2]][0], names[4]: domains[names[4]][:2]},
        ]
        rows = [
            {name: domains[name][int(torch.randint(0, len(domains[name]), (1,), generator=gen))] for name in names}
            for _ in range(60)
        ]
        table = ScenarioTable(Conditions(domains, restrictions), rows)
        for k in (1, 2, 3):
            min_count = 1 + trial % 3
            expected = brute_force(domains, restrictions, rows, k, min_count)
            result = table.coverage(k=k, min_count=min_count, propose=0, allow_infeasible_rows=True)
            assert (result.covered, result.total) == (expected["covered"], expected["total"])
            assert result.uncovered == expected["uncovered"]
            assert result.infeasible_cells == expected["infeasible"]


def test_infeasibility_is_exact_through_a_chain_of_restrictions() -> None:
    """No single restriction excludes a=a0 × c=c0, yet every full scenario with both is impossible."""
    domains = {"a": ["a0", "a1"], "b": ["b0", "b1"], "c": ["c0", "c1"]}
    restrictions = [{"a": "a0", "b": "b0"}, {"b": "b1", "c": "c0"}]
    result = ScenarioTable(Conditions(domains, restrictions), []).coverage(k=2, propose=0)
    assert {"a": "a0", "c": "c0"} in result.infeasible_cells
    assert result.infeasible_cells == brute_force(domains, restrictions, [], 2, 1)["infeasible"]


@settings(max_examples=60, deadline=None)
@given(problems())
def test_fallback_feasibility_is_the_sufficient_check_and_flagged(problem: dict) -> None:
    conditions = Conditions(problem["domains"], problem["restrictions"])
    original = scenarios_module.EXACT_FEASIBILITY_LIMIT
    scenarios_module.EXACT_FEASIBILITY_LIMIT = 0
    try:
        mask, exact = conditions.cell_feasibility(problem["k"])
    finally:
        scenarios_module.EXACT_FEASIBILITY_LIMIT = original
    assert exact is (not problem["restrictions"])
    table = ScenarioTable(conditions, problem["rows"])
    expected = sufficient_infeasible(problem["domains"], problem["restrictions"], problem["k"])
    result_cells = [c for c, ok in zip(_all_cells(problem["domains"], problem["k"]), mask.tolist()) if not ok]
    assert result_cells == expected
    exact_mask, is_exact = Conditions(problem["domains"], problem["restrictions"]).cell_feasibility(problem["k"])
    assert is_exact and bool((exact_mask <= mask).all())  # the fallback never drops a feasible cell
    assert len(table) == len(problem["rows"])


def _all_cells(domains: dict, k: int) -> list[dict]:
    return [
        dict(zip(subset, cell))
        for subset in itertools.combinations(list(domains), k)
        for cell in itertools.product(*(domains[c] for c in subset))
    ]


def test_fallback_is_reported_in_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scenarios_module, "EXACT_FEASIBILITY_LIMIT", 1)
    result = ScenarioTable(Conditions(LIGHT, LIGHT_RESTRICTIONS), []).coverage()
    assert result.feasibility_exact is False
    assert "feasibility approximate" in result.summary()
    assert result.to_details()["feasibility_exact"] is False


def test_fallback_proposals_and_strategy_stay_feasible(monkeypatch: pytest.MonkeyPatch) -> None:
    """With approximate feasibility a listed hole may be impossible (a=x × c=p here); nothing infeasible leaks."""
    monkeypatch.setattr(scenarios_module, "EXACT_FEASIBILITY_LIMIT", 1)
    conditions = Conditions(
        {"a": ["x", "y", "z"], "b": ["u", "v"], "c": ["p", "q"]}, [{"a": "x", "b": "u"}, {"b": "v", "c": "p"}]
    )
    table = ScenarioTable(conditions, [])
    result = table.coverage(propose=8)
    assert {"a": "x", "c": "p"} in result.uncovered  # the sufficient check cannot see the chain
    assert result.proposals and all(conditions.is_feasible(p) for p in result.proposals)
    strategy = table.strategy(k=2)
    for target in ({"a": "x", "b": "v"}, {"a": "z", "c": "p"}):
        found = hypothesis.find(strategy, lambda s, t=target: all(s[c] == v for c, v in t.items()))
        assert conditions.is_feasible(found)


def test_restrictions_in_independent_groups_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of restricted conditions are enumerated separately, so only a big *group* falls back."""
    monkeypatch.setattr(scenarios_module, "EXACT_FEASIBILITY_LIMIT", 9)
    domains = {name: ["0", "1", "2"] for name in "abcd"}
    restrictions = [{"a": "0", "b": "0"}, {"c": "1", "d": ["1", "2"]}]
    result = ScenarioTable(Conditions(domains, restrictions), []).coverage(k=2, propose=0)
    assert result.feasibility_exact
    assert result.infeasible_cells == brute_force(domains, restrictions, [], 2, 1)["infeasible"]


def test_restrictions_excluding_everything_are_a_metric_error() -> None:
    conditions = Conditions({"a": ["x", "y"], "b": ["u"]}, [{"a": ["x", "y"]}])
    with pytest.raises(MetricError, match="every k=2 cell infeasible; relax the restrictions"):
        ScenarioTable(conditions, []).coverage()


def test_where_selecting_only_infeasible_scenarios_is_a_metric_error() -> None:
    conditions = Conditions({"a": ["x", "y"], "b": ["u", "v"]}, [{"a": "x", "b": ["u", "v"]}])
    with pytest.raises(MetricError, match=r"where a=x is undefined.*widen where"):
        ScenarioTable(conditions, []).coverage(where={"a": "x"})


# ---------------------------------------------------------------------- where / select
def test_where_filters_rows_and_narrows_domains() -> None:
    rows = [
        {"lighting": "night", "noise": "none", "lens": "clean"},
        {"lighting": "night", "noise": "high", "lens": "dirty"},
        {"lighting": "bright", "noise": "low", "lens": "clean"},
    ]
    table = ScenarioTable(Conditions(LIGHT, LIGHT_RESTRICTIONS), rows)
    result = table.coverage(k=2, where={"lighting": "night"})
    narrowed = {**LIGHT, "lighting": ["night"]}
    expected = brute_force(narrowed, [], rows[:2], 2, 1)  # the restriction cannot match at night
    assert (result.covered, result.total, result.n_rows) == (expected["covered"], expected["total"], 2)
    assert result.uncovered == expected["uncovered"]
    assert result.where == {"lighting": ("night",)}
    selected = table.select({"lighting": ["bright", "night"]})
    assert selected.conditions.domains["lighting"] == ("bright", "night")
    assert selected.conditions.restrictions == ({"lighting": ("bright",), "noise": ("high",)},)
    assert list(selected.rows()) == [rows[0], rows[1], rows[2]]
    via_where = table.coverage(where={"lighting": ["night", "bright"]}, propose=0)
    via_select = selected.coverage(propose=0)
    assert (via_where.covered, via_where.total, via_where.uncovered) == (
        via_select.covered,
        via_select.total,
        via_select.uncovered,
    )


def test_where_with_no_matching_rows_gives_zero_not_an_error() -> None:
    table = ScenarioTable(Conditions(LIGHT), [{"lighting": "dim", "noise": "low", "lens": "clean"}])
    result = table.coverage(where={"lighting": "night"})
    assert result.value == 0.0 and result.n_rows == 0 and len(result.uncovered) == result.total


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ({"lightning": "night"}, "where: unknown condition 'lightning'; use one of lighting, noise, lens"),
        ({"lighting": "midnight"}, r"where, condition 'lighting': value 'midnight' is not in its domain"),
        ({"lighting": []}, "empty value list"),
        ({}, "non-empty mapping"),
    ],
)
def test_bad_where_is_a_data_error(where: dict, message: str) -> None:
    with pytest.raises(DataError, match=message):
        ScenarioTable(Conditions(LIGHT), []).coverage(where=where)


def test_bad_k_and_propose_are_config_errors() -> None:
    table = ScenarioTable(Conditions(FIG2), FIG2_ROWS)
    with pytest.raises(ConfigError, match="k must be an int between 1 and the number of conditions"):
        table.coverage(k=4)
    with pytest.raises(ConfigError, match="propose must be a non-negative int"):
        table.coverage(propose=-1)


# ---------------------------------------------------------------------- results
def test_to_details_is_json_able_and_complete() -> None:
    table = ScenarioTable(Conditions(LIGHT, LIGHT_RESTRICTIONS), [{"lighting": "bright", "noise": "high", "lens": "clean"}])
    result = table.coverage(k=2, propose=3, allow_infeasible_rows=True)
    details = result.to_details()
    assert json.loads(json.dumps(details, allow_nan=False)) == details
    assert details["infeasible_rows"] == 1 and details["n_infeasible_cells"] == 2
    assert details["infeasible_row_examples"] == [
        {"row": 0, "line": None, "restriction": 1, "values": {"lighting": "bright", "noise": "high"}}]
    assert details["uncovered"] == result.uncovered
    assert [p["closes"] for p in details["proposals"]] == result.proposal_closes
    assert len(result.to_details(max_cells=2)["uncovered"]) == 2
    assert isinstance(result, CoverageResult)


def test_conditions_accept_numbers_and_compare_by_content() -> None:
    a = Conditions({"speed": [30, 50, 70.5]}, [{"speed": 30}])
    assert a.domains["speed"] == ("30", "50", "70.5")
    assert a == Conditions({"speed": ["30", "50", "70.5"]}, [{"speed": ["30"]}])
    assert a != Conditions({"speed": ["30", "50", "70.5"]})
    assert a.is_feasible({"speed": 50}) and not a.is_feasible({"speed": "30"})
    assert "Conditions(speed=['30', '50', '70.5'], 1 restriction(s))" == repr(a)


def test_feasible_mask_matches_is_feasible() -> None:
    conditions = Conditions(LIGHT, LIGHT_RESTRICTIONS)
    combos = list(itertools.product(*LIGHT.values()))
    codes = torch.tensor([conditions.encode(dict(zip(LIGHT, c))) for c in combos])
    mask = conditions.feasible_mask(codes)
    assert mask.tolist() == [conditions.is_feasible(dict(zip(LIGHT, c))) for c in combos]
    assert int((~mask).sum()) == 2 * 2  # bright/normal × high × clean/dirty


def test_rows_and_codes_round_trip() -> None:
    table = ScenarioTable(Conditions(FIG2), FIG2_ROWS)
    assert table.codes.dtype == torch.int64 and table.codes.tolist() == [[0, 0, 0], [2, 2, 1]]
    assert list(table.rows()) == FIG2_ROWS
    again = ScenarioTable(table.conditions, table.codes)
    assert list(again.with_rows(table).rows()) == FIG2_ROWS * 2


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"weather": "sunny", "road": "stone"}], "row 0: missing condition 'orientation'"),
        (
            [FIG2_ROWS[0], {**FIG2_ROWS[0], "season": "summer"}],
            "row 1: unknown condition 'season'; declare its domain in the conditions file",
        ),
        ([{**FIG2_ROWS[0], "road": "gravel"}], r"row 0: condition 'road' has value 'gravel' outside its domain"),
        (torch.tensor([[0, 0, 2]]), r"row 0, condition 'orientation': code 2 is outside 0\.\.1"),
        (torch.tensor([[0.0, 0.0, 0.0]]), "integer tensor"),
    ],
)
def test_bad_rows_are_data_errors(rows, message: str) -> None:
    with pytest.raises(DataError, match=message):
        ScenarioTable(Conditions(FIG2), rows)


# ---------------------------------------------------------------------- proposals
def test_fig2_first_proposal_closes_three_holes_like_the_paper() -> None:
    result = ScenarioTable(Conditions(FIG2), FIG2_ROWS).coverage(propose=1)
    assert result.proposal_closes == [3]  # e.g. (cloudy, mud, curvy) raises 6/21 to 9/21
    assert ScenarioTable(Conditions(FIG2), FIG2_ROWS).with_rows(result.proposals).coverage().covered == 9


def test_proposals_are_deterministic_for_a_seed() -> None:
    table = ScenarioTable(Conditions(LIGHT, LIGHT_RESTRICTIONS), [])
    assert table.coverage(propose=4, seed=7).proposals == table.coverage(propose=4, seed=7).proposals


def test_proposals_complete_fig2_to_full_coverage() -> None:
    table = ScenarioTable(Conditions(FIG2), FIG2_ROWS)
    result = table.coverage(propose=20)
    assert table.with_rows(result.proposals).coverage().value == 1.0
    assert sum(result.proposal_closes) == 15
    assert len(result.proposals) <= 9 - 2 + 1  # weather × road alone needs 7 more rows; greedy stays close


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.integers(1, 4), st.integers(0, 3))
def test_proposals_are_feasible_and_close_what_they_claim(problem: dict, propose: int, seed: int) -> None:
    table = table_of(problem)
    k, min_count = problem["k"], problem["min_count"]
    assume(brute_force(problem["domains"], problem["restrictions"], [], k, 1)["total"] > 0)
    result = table.coverage(k=k, min_count=min_count, propose=propose, seed=seed, allow_infeasible_rows=True)
    assert len(result.proposals) == len(result.proposal_closes) <= propose
    covered = result.covered
    for i, proposal in enumerate(result.proposals):
        assert table.conditions.is_feasible(proposal)
        after = table.with_rows(result.proposals[: i + 1]).coverage(k=k, min_count=min_count, propose=0,
                                                                     allow_infeasible_rows=True)
        assert after.covered - covered == result.proposal_closes[i] >= 0
        covered = after.covered
    if min_count == 1 and result.uncovered:
        assert result.proposals and result.proposal_closes[0] >= 1  # holes remain → strictly better


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_complete_extends_exactly_the_feasible_cells(problem: dict) -> None:
    """The completion behind proposals and the strategy finds a feasible scenario for every feasible cell."""
    conditions = Conditions(problem["domains"], problem["restrictions"])
    k, names = problem["k"], list(problem["domains"])
    cells = _all_cells(problem["domains"], k)
    partial = torch.full((len(cells), len(names)), -1, dtype=torch.int64)
    for r, cell in enumerate(cells):
        for name, value in cell.items():
            partial[r, names.index(name)] = problem["domains"][name].index(value)
    completed, found = conditions._complete(partial, torch.Generator().manual_seed(0))
    infeasible = brute_force(problem["domains"], problem["restrictions"], [], k, 1)["infeasible"]
    for r, cell in enumerate(cells):
        assert bool(found[r]) is (cell not in infeasible)
        if found[r]:
            scenario = conditions.decode(completed[r])
            assert conditions.is_feasible(scenario) and all(scenario[c] == v for c, v in cell.items())


# ---------------------------------------------------------------------- hypothesis strategy
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems(), data=st.data())
def test_strategy_always_yields_feasible_scenarios(problem: dict, data: st.DataObject) -> None:
    table = table_of(problem)
    assume(brute_force(problem["domains"], problem["restrictions"], [], problem["k"], 1)["total"] > 0)
    strategy = table.strategy(k=problem["k"])
    for _ in range(3):
        scenario = data.draw(strategy)
        assert list(scenario) == list(problem["domains"])
        assert not violates(scenario, problem["restrictions"])


def test_strategy_shrinks_to_the_first_uncovered_cell() -> None:
    table = ScenarioTable(Conditions(FIG2), FIG2_ROWS)
    first = table.coverage().uncovered[0]
    minimal = hypothesis.find(table.strategy(k=2), lambda scenario: True)
    assert {c: minimal[c] for c in first} == first


def test_strategy_on_a_fully_covered_table_draws_plain_feasible_scenarios() -> None:
    conditions = Conditions({"a": ["x", "y"], "b": ["u", "v"]}, [{"a": "x", "b": "u"}])
    rows = [{"a": "x", "b": "v"}, {"a": "y", "b": "u"}, {"a": "y", "b": "v"}]
    strategy = ScenarioTable(conditions, rows).strategy(k=2)
    seen = {tuple(hypothesis.find(strategy, lambda s, t=t: (s["a"], s["b"]) == t).values()) for t in
            [("x", "v"), ("y", "u"), ("y", "v")]}
    assert seen == {("x", "v"), ("y", "u"), ("y", "v")}


_HEAVY = ScenarioTable(
    Conditions(
        {"lighting": ["bright", "normal", "dim", "night"], "noise": ["none", "low", "high"], "lens": ["a", "b", "c"]},
        [
            {"lighting": ["bright", "normal"], "noise": "high"},
            {"lighting": "night", "lens": ["a", "b"]},
            {"noise": "none", "lens": "c"},
        ],
    ),
    [{"lighting": "dim", "noise": "low", "lens": "a"}],
)


@given(_HEAVY.strategy(k=2))
def test_strategy_in_a_plain_given_raises_no_health_check(scenario: dict) -> None:
    assert _HEAVY.conditions.is_feasible(scenario)


# ---------------------------------------------------------------------- files
def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_toml_with_restrictions_is_read(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "conditions.toml",
        """\
        [conditions]
        lighting = ["bright", "normal", "dim", "night"]
        noise = ["none", "low", "high"]
        [[restrictions]]
        lighting = ["bright", "normal"]
        noise = "high"
        """,
    )
    conditions = Conditions.from_toml(path)
    assert conditions.names == ("lighting", "noise")
    assert conditions.restrictions == ({"lighting": ("bright", "normal"), "noise": ("high",)},)
    assert conditions.source == f"conditions file {str(path)!r}"


def test_csv_is_read_in_any_column_order_with_blank_lines(tmp_path: Path) -> None:
    conditions = Conditions(FIG2)
    path = write(tmp_path, "s.csv", "orientation,weather,road\nstraight,sunny,stone\n\n curvy , rainy,tarmac\n")
    table = ScenarioTable.from_csv(path, conditions)
    assert list(table.rows()) == FIG2_ROWS
    header_only = ScenarioTable.from_csv(write(tmp_path, "h.csv", "weather,road,orientation\n"), conditions)
    assert len(header_only) == 0 and header_only.coverage().value == 0.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[meta]\nx = 1\n', r"has no \[conditions\] table; declare each condition's domain"),
        ('[conditions\nweather = ["sunny"]\n', "is not valid TOML: .*; fix the syntax"),
        ('[conditions]\nweather = []\n', "condition 'weather' has an empty domain; list at least one value"),
        ('[conditions]\nweather = ["sunny", "rainy", "sunny"]\n', "condition 'weather' lists value 'sunny' twice"),
        ('[conditions]\nweather = "sunny"\n', "condition 'weather' must list its values as an array"),
        ('[conditions]\nweather = [true]\n', "value True must be a string .*; quote it"),
        (
            '[conditions]\nweather = ["sunny"]\n[[restrictions]]\nseason = "winter"\n',
            r"restriction #1 names unknown condition 'season'; declare it under \[conditions\]",
        ),
        (
            '[conditions]\nweather = ["sunny"]\n[[restrictions]]\nweather = "snowy"\n',
            r"restriction #1, condition 'weather': value 'snowy' is not in its domain \['sunny'\]",
        ),
        (
            '[conditions]\nweather = ["sunny"]\n[[restriction]]\nweather = "sunny"\n',
            r"unknown top-level key\(s\) \['restriction'\]; only \[conditions\] and \[\[restrictions\]\]",
        ),
        ('[conditions]\nweather = ["sunny"]\nrestrictions = 3\n', "condition 'restrictions' must list its values"),
        ('[conditions]\nweather = ["sunny"]\n[restrictions]\nweather = "sunny"\n', "must be an array of tables"),
    ],
    ids=[
        "missing_conditions_table",
        "bad_toml_syntax",
        "empty_domain",
        "duplicate_value",
        "domain_not_an_array",
        "boolean_value",
        "restriction_unknown_condition",
        "restriction_unknown_value",
        "misspelt_restrictions_table",
        "scalar_under_conditions",
        "restrictions_not_an_array",
    ],
)
def test_toml_errors_name_the_file_the_problem_and_the_fix(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, "conditions.toml", text)
    with pytest.raises(DataError, match=message) as info:
        Conditions.from_toml(path)
    assert f"conditions file {str(path)!r}" in str(info.value)


def test_toml_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"conditions file '.*nope\.toml' does not exist"):
        Conditions.from_toml(tmp_path / "nope.toml")


def _csv_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, "scenarios.csv", text)
    with pytest.raises(DataError) as info:
        ScenarioTable.from_csv(path, Conditions(FIG2))
    message = str(info.value)
    assert f"scenario file {str(path)!r}" in message
    return message


def test_csv_value_outside_domain_names_line_column_and_value(tmp_path: Path) -> None:
    message = _csv_error(tmp_path, "weather,road,orientation\nsunny,stone,straight\n\nrainy,gravel,curvy\n")
    assert "line 4, column 2 ('road'): value 'gravel' is not in the domain ['stone', 'mud', 'tarmac']" in message
    assert "add it to the conditions file" in message


def test_csv_unknown_column_says_declare_its_domain(tmp_path: Path) -> None:
    message = _csv_error(tmp_path, "weather,road,orientation,season\nsunny,stone,straight,summer\n")
    assert "line 1, column 4: unknown condition 'season'; declare its domain in the conditions file" in message


def test_csv_missing_condition_column_names_it(tmp_path: Path) -> None:
    message = _csv_error(tmp_path, "weather,road\nsunny,stone\n")
    assert "line 1: missing column(s) for condition(s) 'orientation'; add one column per condition" in message


def test_csv_empty_file_names_the_expected_header(tmp_path: Path) -> None:
    message = _csv_error(tmp_path, "\n\n")
    assert "is empty; expected a header line with the condition names (weather,road,orientation)" in message


def test_csv_ragged_row_names_its_line_and_field_counts(tmp_path: Path) -> None:
    message = _csv_error(tmp_path, "weather,road,orientation\nsunny,stone,straight\nrainy,mud\n")
    assert "line 3: 2 field(s) but the header has 3" in message


def test_csv_duplicate_column_names_both_positions(tmp_path: Path) -> None:
    message = _csv_error(tmp_path, "weather,road,weather,orientation\n")
    assert "column 3: condition 'weather' appears twice in the header (also column 1)" in message


def test_csv_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"scenario file '.*absent\.csv' does not exist"):
        ScenarioTable.from_csv(tmp_path / "absent.csv", Conditions(FIG2))


# ---------------------------------------------------------------------- rows that break a restriction
SEASONS = {"weather": ["sunny", "rainy", "snow"], "season": ["winter", "summer"], "road": ["stone", "mud"]}
NO_SNOW_IN_SUMMER = """\
[conditions]
weather = ["sunny", "rainy", "snow"]
season = ["winter", "summer"]
road = ["stone", "mud"]

[[restrictions]]
weather = "rainy"
road = "mud"

[[restrictions]]
weather = "snow"
season = "summer"
"""


def test_rows_breaking_a_restriction_are_refused_listing_row_line_values_and_total(tmp_path: Path) -> None:
    conditions = Conditions.from_toml(write(tmp_path, "c.toml", NO_SNOW_IN_SUMMER))
    good = ["sunny,winter,stone", "rainy,winter,stone", "snow,winter,mud"]
    bad = ["snow,summer,stone", "rainy,summer,mud"] * 4  # 8 impossible rows
    body = [good[0], "", good[1], *bad[:3], good[2], *bad[3:]]  # a blank line: CSV lines != row indices
    path = write(tmp_path, "s.csv", "weather,season,road\n" + "\n".join(body) + "\n")
    table = ScenarioTable.from_csv(path, conditions)
    with pytest.raises(DataError) as info:
        table.coverage(k=2)
    message = str(info.value)
    assert message.splitlines()[0].startswith("8 scenario row(s) break a declared restriction: "
                                              "row 2 (CSV line 5): weather=snow × season=summer (restriction #2); "
                                              "row 3 (CSV line 6): weather=rainy × road=mud (restriction #1); ")
    assert "(first 5 of 8 shown)" in message and "Rows are 0-based sample indices" in message
    assert "row 8 (CSV line 11)" not in message and message.count("(CSV line") == 5
    assert "Fix: correct those rows in scenario file" in message
    assert info.value.details["infeasible_rows"] == 8  # type: ignore[attr-defined]
    examples = info.value.details["infeasible_row_examples"]  # type: ignore[attr-defined]
    assert [(e["row"], e["line"]) for e in examples] == [(2, 5), (3, 6), (4, 7), (6, 9), (7, 10)]
    assert examples[0]["values"] == {"weather": "snow", "season": "summer"}
    counted = table.coverage(k=2, allow_infeasible_rows=True)  # opting in counts them and lists the first 5
    assert counted.infeasible_rows == 8 and counted.to_details()["infeasible_row_examples"] == examples


def test_rows_breaking_a_restriction_outside_where_do_not_stop_that_scope() -> None:
    conditions = Conditions(SEASONS, [{"weather": "snow", "season": "summer"}])
    rows = [{"weather": "snow", "season": "summer", "road": "stone"},
            {"weather": "sunny", "season": "winter", "road": "mud"}]
    table = ScenarioTable(conditions, rows)
    assert table.coverage(k=2, where={"weather": "sunny"}).n_rows == 1
    with pytest.raises(DataError, match=r"^1 scenario row\(s\) \(among the rows selected by where\) break .*row 0: "):
        table.coverage(k=2, where={"season": "summer"})


def test_strategy_still_works_on_a_table_with_an_impossible_row() -> None:
    conditions = Conditions(SEASONS, [{"weather": "snow", "season": "summer"}])
    table = ScenarioTable(conditions, [{"weather": "snow", "season": "summer", "road": "stone"}])
    example = hypothesis.find(table.strategy(k=2), lambda scenario: True)
    assert conditions.is_feasible(example)


def test_row_count_check_names_both_counts_the_direction_and_the_fix() -> None:
    from pytest_dnnsafety.scenarios import check_rows_match

    table = ScenarioTable(Conditions(FIG2), FIG2_ROWS * 3)
    check_rows_match(table, 6)
    with pytest.raises(MetricError) as longer:
        check_rows_match(table, 2, data_fixture="eval_data")
    assert str(longer.value).startswith("the scenario table has 6 rows but the data has 2 samples (fixtures "
                                        "'scenario_table' and 'eval_data'): 4 row(s) describe no sample; ")
    with pytest.raises(MetricError, match=r"^the scenario table has 6 rows but the data has 9 samples .*: 3 sample"
                                          r"\(s\) have no scenario row; .* Fix: give the scenario file"):
        check_rows_match(table, 9)


@pytest.mark.parametrize(
    "make",
    [
        lambda x, y: torch.utils.data.TensorDataset(x, y),
        lambda x, y: torch.utils.data.TensorDataset(x),
        lambda x, y: x,
        lambda x, y: x.numpy(),
        lambda x, y: (x, y),
        lambda x, y: {"x": x, "y": y},
        lambda x, y: torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4),
    ],
    ids=["tensordataset", "unlabelled_tensordataset", "tensor", "ndarray", "pair", "dict", "dataloader"],
)
def test_count_samples_reads_the_row_count_of_every_data_form(make) -> None:
    from pytest_dnnsafety.scenarios import count_samples

    x, y = torch.rand(11, 1, 8, 8), torch.randint(0, 3, (11,))
    assert count_samples(make(x, y)) == 11


def test_count_samples_does_not_iterate_a_sized_dataloader() -> None:
    from pytest_dnnsafety.scenarios import count_samples

    class Counting(torch.utils.data.Dataset):
        reads = 0

        def __len__(self) -> int:
            return 13

        def __getitem__(self, i: int) -> torch.Tensor:
            Counting.reads += 1
            return torch.zeros(1, 8, 8)

    assert count_samples(torch.utils.data.DataLoader(Counting(), batch_size=4)) == 13 and Counting.reads == 0
    assert count_samples(torch.utils.data.DataLoader(Counting(), batch_size=4, drop_last=True)) == 12
    assert Counting.reads == 0
