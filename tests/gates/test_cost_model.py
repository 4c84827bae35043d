"""The cost model (pytest_dnnsafety.gates.cost): the families' hooks, the estimate, the budget's refusal."""

from __future__ import annotations

import pytest
import torch

from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.gates import builtin_registry
from pytest_dnnsafety.gates.core import GateDef, GateDefinitionError
from pytest_dnnsafety.gates.cost import (BudgetError, Cost, Estimate, Workload, check_budget, estimate_for, one_pass,
                                         probe)
from pytest_dnnsafety.settings import Resolved

IMAGE = Workload(2, (3, 224, 224), 8)
DIGIT = Workload(100, (1, 8, 8), 256)


def _options(marker: str, **given: object) -> dict:
    gate = builtin_registry()[marker]
    options = {p.name: p.default for p in gate.params}
    options.update(given)
    return options


def _cost(marker: str, work: Workload, **given: object) -> Cost:
    gate = builtin_registry()[marker]
    return (gate.cost or one_pass)(_options(marker, **given), work)


def test_every_many_pass_family_has_a_hook() -> None:
    registry = builtin_registry()
    for marker in ("max_adversarial_confidence_loss", "min_robust_accuracy", "min_verified_robustness",
                   "min_safe_radius", "max_pmi_ub", "min_interpretation_precision", "min_occlusion_sensitivity",
                   "max_occlusion_sensitivity", "min_monitor_detection", "max_monitor_selective_risk", "max_monitor_overhead",
                   "min_detection_map", "min_detection_recall"):
        assert registry[marker].cost is not None, marker


def test_the_coordinate_search_at_224_is_hundreds_of_thousands_of_forwards() -> None:
    small = _cost("min_safe_radius", DIGIT, d=0.1, method="gps", search="coordinate")
    big = _cost("min_safe_radius", IMAGE, d=0.1, method="gps", search="coordinate", max_queries=10**12)
    assert big.forwards / IMAGE.n >= 2 * 3 * 224 * 224  # a GPS poll: 2n forwards
    assert big.forwards / IMAGE.n > 1000 * small.forwards / DIGIT.n
    assert "iterations" in big.knobs and "search='coordinate'" in big.what


def test_the_safe_radius_estimate_is_the_engines_own() -> None:
    """The gate's cost reads the engine's plan (one estimate, not two): the search 'auto' picks and its queries."""
    from pytest_dnnsafety.engines.quantification import SearchBudget, SearchPlan, plan_search

    auto = _cost("min_safe_radius", IMAGE, d=0.1)
    assert "search='gradient'" in auto.what  # 150,528 elements: never the coordinate search
    options = _options("min_safe_radius", d=0.1)
    _, queries, _ = plan_search(SearchPlan(attack_steps=options["attack_steps"]), 64,
                                SearchBudget(options["method"], options["iterations"], options["starts"],
                                             ascent_steps=options["ascent_steps"],
                                             ascent_starts=options["ascent_starts"]),
                                "crown", options["certified_steps"])
    assert _cost("min_safe_radius", DIGIT, d=0.1).forwards == pytest.approx(queries * DIGIT.n)


def test_a_search_over_max_queries_is_refused_by_the_estimate_not_the_clock() -> None:
    """Deterministic: the options' refusal comes before (and without) any probed time."""
    with pytest.raises(ConfigError, match="above max_queries=1,000; refused before any work"):
        estimate_for(builtin_registry()["min_safe_radius"].cost,
                     _options("min_safe_radius", d=0.1, search="coordinate", max_queries=1000), DIGIT, None)


def test_monitor_overhead_counts_its_timed_repeats() -> None:
    assert _cost("max_monitor_overhead", DIGIT, monitor="m", repeats=5).forwards == 8 * DIGIT.n
    assert _cost("max_monitor_overhead", DIGIT, monitor="m", repeats=1).forwards == 4 * DIGIT.n


def test_attacks_scale_with_steps_and_occlusion_with_positions() -> None:
    assert _cost("min_robust_accuracy", DIGIT, eps=0.1, steps=100).forwards > \
        5 * _cost("min_robust_accuracy", DIGIT, eps=0.1, steps=10).forwards
    fine = _cost("min_occlusion_sensitivity", IMAGE, size=16, stride=1)
    coarse = _cost("min_occlusion_sensitivity", IMAGE, size=16, stride=16)
    assert fine.forwards / IMAGE.n == 1 + 209 * 209 and coarse.forwards / IMAGE.n == 1 + 14 * 14
    assert _cost("min_verified_robustness", IMAGE, eps=0.01, method="crown").forwards > \
        _cost("min_verified_robustness", IMAGE, eps=0.01, method="ibp").forwards


def test_budget_refusal_names_estimate_budget_source_and_knobs() -> None:
    estimate = Estimate(Cost(1e6, 5.0, "many forwards", ("steps",)), 1e-3, 4)
    assert estimate.seconds == pytest.approx(1005.0)
    budget = Resolved("max_seconds", 60.0, "marker @pytest.mark.g(max_seconds=...)")
    with pytest.raises(BudgetError) as info:
        check_budget(estimate, "g", budget, None, 500)
    text = str(info.value)
    assert isinstance(info.value, ConfigError)
    for part in ("estimated 16.8 min", "1,000,000 forwards", "max_seconds=60", "sample=N", "500 inputs", "steps=",
                 "max_seconds=1508", "Fix:"):
        assert part in text, part
    assert info.value.details["cost_estimate"]["estimated_seconds"] == pytest.approx(1005.0)
    check_budget(estimate, "g", Resolved("max_seconds", 0.0, "default"), None, 500)  # 0: no limit
    check_budget(estimate, "g", Resolved("max_seconds", None, "marker"), None, 500)
    check_budget(estimate, "g", Resolved("max_seconds", 2000.0, "default"), None, 500)


def test_a_broken_cost_hook_is_a_definition_error_naming_the_gate() -> None:
    with pytest.raises(GateDefinitionError, match="gate 'g'.*raised ZeroDivisionError"):
        estimate_for(lambda options, work: 1 / 0, {}, DIGIT, 1e-3, marker="g")
    with pytest.raises(GateDefinitionError, match="not a Cost"):
        estimate_for(lambda options, work: 3.0, {}, DIGIT, 1e-3, marker="g")
    gate = builtin_registry()["min_robust_accuracy"]
    bad = GateDef(**{**{f: getattr(gate, f) for f in gate.__dataclass_fields__}, "cost": 3})
    assert any("cost must be None or callable" in p for p in bad.problems())


def test_probe_times_a_forward_and_gives_the_input_shape() -> None:
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 2))
    found = probe(model, (torch.rand(10, 3, 2, 2), torch.zeros(10, dtype=torch.long)), "cpu")
    assert found is not None
    per, inputs, shape, example = found
    assert per > 0 and inputs == 4 and shape == (3, 2, 2) and example.shape == (4, 3, 2, 2)
    assert probe(lambda x: 1 / 0, torch.rand(3, 2), "cpu") is None  # the gate itself names a broken model


def test_the_bound_estimate_reads_the_unstable_neurons_of_the_probed_inputs() -> None:
    """With the probe's inputs, verified robustness asks the engine (IBP's unstable neurons): full CROWN at a wide
    ball costs more than at a tiny one (its max-pooling keeps a floor), and far more than CROWN-IBP; without them,
    the rough figure."""
    from _digits import digits_cnn, digits_images

    model, (x, _) = digits_cnn(), digits_images(4)
    work = Workload(4, tuple(x.shape[1:]), 256, model, x)
    wide = _cost("min_verified_robustness", work, eps=0.1, method="crown")
    tiny = _cost("min_verified_robustness", work, eps=1e-6, method="crown")
    cheap = _cost("min_verified_robustness", work, eps=0.1, method="crown-ibp")
    assert wide.forwards > 1.5 * tiny.forwards and wide.forwards > 10 * cheap.forwards
    assert "bound passes" in wide.what
    rough = _cost("min_verified_robustness", Workload(4, tuple(x.shape[1:])), eps=0.1, method="crown")
    assert "rough" in rough.what
