"""``unpredicted="exclude"`` cannot turn a collapsed model green (issue #29 §2).

A model that predicts 2 of its 10 classes is a broken model; before, ``max_class_confusion(unpredicted="exclude")``
— the fix the plugin's own error suggests — measured the one remaining pair and passed, and a baseline called the
collapse "improved". Now excluding more than half of the classes is inconclusive (naming how many of how many,
which ones, and the fix), and the gates declare the excluded set (``details["comparable_set"]``) so that a
baseline comparison flags a change of it as a regression.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import GateProject
from _digits_project import digits_project, gates_of, write_digits_files
from pytest_dnnsafety.engines.core.capture import ActivationCache
from pytest_dnnsafety.engines.inspection.plan import InspectionPlan
from pytest_dnnsafety.report.baseline import compare
from pytest_dnnsafety.report.evidence import build_evidence
from pytest_dnnsafety.results import GateResult

OPTIONS: dict[str, Any] = {"layer": "1", "activation_threshold": 0.5, "reduce": "mean", "statistic": "confusion",
                           "rule": "std", "top_share": 0.01, "classes": None, "unpredicted": "exclude", "top": 10,
                           "min_support": 1, "decision_threshold": None, "outputs": None, "label_filter": True}


def _model_and_data(k: int = 10, predicted: int = 2, n: int = 200) -> tuple[torch.nn.Module, tuple[Any, Any]]:
    """An identity network with ``k`` outputs whose inputs are predicted as classes ``0..predicted-1`` only."""
    model = torch.nn.Sequential(torch.nn.Linear(k, k), torch.nn.ReLU(), torch.nn.Linear(k, k)).eval()
    for layer in (model[0], model[2]):
        torch.nn.init.eye_(layer.weight)
        torch.nn.init.zeros_(layer.bias)
    gen = torch.Generator().manual_seed(0)
    truth = torch.arange(n) % k
    seen = truth % predicted  # a collapsed model: every input lands on one of the first classes
    x = torch.rand(n, k, generator=gen) + 3 * torch.nn.functional.one_hot(seen, k)
    return model, (x, truth)


def _reader(model: Any, data: Any) -> Any:
    cache = ActivationCache()
    return lambda shard: (cache.get(model, data, ["1"], batch_size=64, device="cpu", shard=shard)["1"],
                          cache.outputs(model, data, batch_size=64, device="cpu", shard=shard))


def _reports(predicted: int, **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    model, data = _model_and_data(predicted=predicted)
    plan = InspectionPlan.for_task("single-label", "max_class_confusion", "dataset", {**OPTIONS, **options})
    res, truth = plan.inspect(model, _reader(model, data), None, bias=False)
    confusion = plan.confusion_report(res, truth, model)
    bias_plan = InspectionPlan.for_task("single-label", "max_class_bias", "dataset", {**OPTIONS, **options})
    res, _ = bias_plan.inspect(model, _reader(model, data), None, bias=True)
    return confusion, bias_plan.bias_report(res, model)


@pytest.mark.parametrize("statistic", ["confusion", "share", "type1"])
def test_excluding_most_classes_is_inconclusive_naming_them(statistic: str) -> None:
    confusion, bias = _reports(2, statistic=statistic)
    for report, marker in ((confusion, "max_class_confusion"), (bias, "max_class_bias")):
        why = report.get("inconclusive")
        assert why, report.get("detail")
        assert why.startswith(f"{marker}: unpredicted='exclude' left out 8 of 10 classes")
        assert "2, 3, 4, 5, 6, 7, 8, 9" in why and "fixture 'dataset'" in why and "Fix:" in why
        assert report["details"]["comparable_set"] == {
            "what": "classes never predicted (excluded)", "items": ["2", "3", "4", "5", "6", "7", "8", "9"]}


def test_excluding_half_the_classes_or_fewer_is_measured() -> None:
    confusion, _ = _reports(5)
    assert not confusion.get("inconclusive") and confusion["value"] == confusion["value"]  # a number
    assert confusion["details"]["comparable_set"]["items"] == ["5", "6", "7", "8", "9"]
    confusion, _ = _reports(10)
    assert confusion["details"]["comparable_set"] == {"what": "classes never predicted (excluded)", "items": []}


def _result(report: dict[str, Any], nodeid: str = "t.py::test_c") -> GateResult:
    value = report["value"]
    return GateResult(nodeid=nodeid, marker="max_class_confusion", metric="m", threshold=0.99, op="<=",
                      status="passed" if value <= 0.99 else "failed", value=value, bound=None,
                      passed=value <= 0.99, summary="s", details=report["details"],
                      inputs={"model": {"digest": "sha256:" + "1" * 64}, "data": {"digest": "sha256:" + "2" * 64}})


def test_a_changed_excluded_set_is_a_regression_never_an_improvement() -> None:
    healthy, _ = _reports(10)
    fewer, _ = _reports(6)  # 4 of 10 classes never predicted: measured, but on other pairs
    stored = json.loads(json.dumps(build_evidence([_result(healthy)], {"seed": 1})["gates"][0]))
    now = _result(fewer)
    now.value = healthy["value"] - 0.2  # even a "better" number on fewer classes is not an improvement
    for limit in (None, 0.5):
        result = compare(now, stored, limit)
        assert result["status"] == "regressed", result
        assert "classes never predicted (excluded) changed" in result["message"]
        assert "6, 7, 8, 9" in result["message"]
        assert result["comparable_set"] == {"what": "classes never predicted (excluded)", "baseline": [],
                                            "current": ["6", "7", "8", "9"]}
    assert compare(_result(healthy), stored, 0.0)["status"] == "ok"


# ------------------------------------------------------------------------------------- end to end

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
GATE = "max_class_confusion(0.95, layer='classifier.0', classes={names!r}, unpredicted='exclude', max_rise=0.5)"

#: the trained digits CNN with the outputs of ``dead`` never winning (their bias is -1000)
DEAD_CONFTEST = """
    import pytest
    import torch
    import netdef

    DEAD = {dead!r}


    @pytest.fixture(scope="session")
    def model():
        net = netdef.trained()
        with torch.no_grad():
            for k in DEAD:
                net.classifier[2].bias[k] = -1000.0
        return net
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("digits")
    write_digits_files(root)
    return root


@pytest.mark.slow
def test_a_collapsed_model_cannot_pass_through_exclude_or_a_baseline(gate_project: GateProject, files: Path) -> None:
    project = digits_project(gate_project, files, {"c": GATE.format(names=NAMES)}, DEAD_CONFTEST.format(dead=[]))
    project.run("--dnnsafety-save-baseline=base.json").assert_outcomes(passed=1)
    # 8 of 10 classes never predicted: inconclusive, whatever the baseline says
    project.write("conftest.py", DEAD_CONFTEST.format(dead=list(range(2, 10))))
    result = project.run("--dnnsafety-baseline=base.json", "--dnnsafety-json=evidence.json")
    result.assert_outcomes(failed=1)
    gate = gates_of(project)["c"]
    assert gate["status"] == "inconclusive"
    assert "left out 8 of 10 classes" in gate["details"]["inconclusive"]
    assert gate["baseline"]["status"] == "regressed"
    # 3 of 10 never predicted: measured, but against the baseline the excluded set changed: a regression
    project.write("conftest.py", DEAD_CONFTEST.format(dead=[2, 5, 8]))
    result = project.run("--dnnsafety-baseline=base.json", "--dnnsafety-json=evidence.json")
    result.assert_outcomes(failed=1)
    gate = gates_of(project)["c"]
    assert gate["status"] == "failed" and gate["baseline"]["status"] == "regressed"
    assert "two, five, eight" in gate["baseline"]["message"]
