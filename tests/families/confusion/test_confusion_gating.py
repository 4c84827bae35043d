"""The weighted-confusion gate's steps on hand-made passes: where the severity matrix comes from, one pass counted
with the errors that name the marker, the data fixture and the matrix's source, and the reading the gate reports.
"""

from __future__ import annotations

import pytest
import torch

from pytest_dnnsafety.engines.confusion.gating import (
    ConfusionOptions,
    count_confusion,
    weighted_confusion,
)
from pytest_dnnsafety.engines.core.capture import ModelOutputs
from pytest_dnnsafety.errors import ConfigError, DataError

OPTIONS = {"severity": None, "classes": None, "default": 1.0, "confidence": 0.95, "gate_on": "bound",
           "method": "kl", "top": 10}


def _options(fixture: object = None, **options: object) -> ConfusionOptions:
    return ConfusionOptions.of({**OPTIONS, **options}, lambda: fixture, fixture_name="severity_matrix",
                               marker="max_weighted_confusion", data="dataset", base_dir=None)


def _pass(labels: list[int] | None, predictions: list[int], k: int = 3) -> ModelOutputs:
    p = torch.tensor(predictions)
    return ModelOutputs(p, torch.ones(len(p)), None if labels is None else torch.tensor(labels), k)


def test_the_severity_comes_from_the_marker_a_file_or_the_fixture() -> None:
    def unread() -> None:
        raise AssertionError("the fixture is read only without severity=")

    given = ConfusionOptions.of({**OPTIONS, "severity": {"1": {"2": 10.0}}}, unread, fixture_name="severity_matrix",
                                marker="m", data="d", base_dir=None)
    assert given.origin == "marker severity=" and given.severity == {"1": {"2": 10.0}}
    assert _options(severity="sev.toml").origin == "file sev.toml"
    fixture = _options(fixture=[[0, 1], [1, 0]], classes=("a", "b"))
    assert fixture.origin == "fixture 'severity_matrix'" and fixture.severity == [[0, 1], [1, 0]]
    assert fixture.classes == ["a", "b"]


def test_the_expected_severity_per_input_and_its_bound() -> None:
    opts = _options(severity={"1": {"2": 10.0}})
    labels = [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    engine = count_confusion(_pass(labels, [1, 2] + labels[2:]), opts)  # 0 -> 1 weighs 1, 1 -> 2 weighs 10
    m = weighted_confusion(engine, opts)
    assert m.value == pytest.approx(11 / 10) and m.bound > m.value
    assert m.details["severity_source"] == "marker severity=" and m.details["gate_on"] == "bound"
    assert m.details["severity"][1][2] == 10.0
    assert weighted_confusion(engine, _options(severity={"1": {"2": 10.0}}, gate_on="value")).bound is None


def test_bad_passes_and_a_matrix_that_weighs_nothing_are_errors() -> None:
    with pytest.raises(DataError, match="fixture 'dataset' has no labels"):
        count_confusion(_pass(None, [0, 1]), _options(severity={"1": {"2": 1.0}}))
    with pytest.raises(ConfigError, match="max_weighted_confusion: classes= names 2 classes but the model has 3"):
        count_confusion(_pass([0, 1], [0, 1]), _options(severity={"1": {"2": 1.0}}, classes=("a", "b")))
    with pytest.raises(ConfigError, match="the severity matrix of fixture 'severity_matrix' weighs every "
                                          "misclassification 0"):
        count_confusion(_pass([0, 1], [0, 1]), _options(fixture=torch.zeros(3, 3)))
