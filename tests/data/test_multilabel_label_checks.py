"""Multi-label label matrices (issue #29 §3): a matrix holding 0.5, NaN or 2 is refused as a multi-label matrix —
naming the value and its position, not as "integer class indices" — and ``task='single-label'`` on multi-label
data is refused naming the task setting and the fix, not with a raw size error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from _hostile import make_settings
from pytest_dnnsafety.data.forms import as_tensors
from pytest_dnnsafety.data.tasks import check_multilabel
from pytest_dnnsafety.errors import DataError
from pytest_dnnsafety.gates import builtin_registry, evaluate, parse_marker
from pytest_dnnsafety.scenarios import Conditions, ScenarioTable

GATES = dict(builtin_registry())
N = 60


def _matrix() -> torch.Tensor:
    return (torch.rand(N, 3, generator=torch.Generator().manual_seed(0)) > 0.5).long()


@pytest.mark.parametrize("value, shown", [(0.5, "0.5"), (float("nan"), "nan"), (2.0, "2"), (-1.0, "-1")])
def test_a_matrix_with_other_values_names_the_value_and_its_position(value: float, shown: str) -> None:
    y = _matrix().float()
    y[7, 2] = value
    with pytest.raises(DataError) as info:
        as_tensors((torch.zeros(N, 4), y), "fixture 'dataset'")
    text = str(info.value)
    assert text.startswith("fixture 'dataset': ")
    assert "multi-label" in text and "0/1" in text and "integer class indices" not in text
    assert f"{shown} at row 7, column 2" in text and "Fix:" in text


def test_an_integer_matrix_with_a_two_names_it() -> None:
    y = _matrix()
    y[3, 1] = 2
    with pytest.raises(DataError, match=r"2 at row 3, column 1"):
        check_multilabel(y, "data")


def test_boolean_and_float_0_1_matrices_are_accepted() -> None:
    y = _matrix()
    for labels in (y.bool(), y.float(), y.to(torch.uint8)):
        _, out = as_tensors((torch.zeros(N, 4), labels))
        assert out is not None and out.dtype == torch.int64 and torch.equal(out, y)


def test_single_label_class_indices_still_name_the_bad_value() -> None:
    y = torch.zeros(N)
    y[4] = 0.5
    with pytest.raises(DataError, match=r"integer class indices.*0\.5 at row 4"):
        as_tensors((torch.zeros(N, 4), y))


@pytest.mark.parametrize("marker, options", [
    ("min_scenario_accuracy", {"by": "lighting"}),
    ("max_scenario_degradation", {"by": "lighting"})])
def test_single_label_task_on_multi_label_data_names_the_setting(tmp_path: Path, marker: str, options: dict) -> None:
    table = ScenarioTable(Conditions({"lighting": ["day", "night"]}),
                          [{"lighting": "day" if i % 2 else "night"} for i in range(N)])
    fixtures = {"model": nn.Linear(4, 3).eval(), "data": (torch.rand(N, 4), _matrix()), "scenarios": table}
    spec = parse_marker(marker, (0.5,), {**options, "task": "single-label"}, "t.py::test", GATES)
    result = evaluate(spec, {role: fixtures[role] for role in spec.fixtures}, make_settings(tmp_path), "t.py::test",
                      {})
    assert result.status == "error"
    text = result.summary
    assert "size of tensor" not in text
    assert "task 'single-label'" in text and "(60, 3)" in text and "multi-label" in text and "Fix:" in text
