"""The monitor benchmark's engine side: its results' report text, its task variants, its session's fault sets.

The gates (``test_monitor_gates.py``) run these end to end; here the paths a real benchmark rarely takes are
pinned on hand-made inputs: a detection metric undefined for a set, a monitor that rejects every input, the
placeholder of a rank that does not time, the classifier/detector dispatch, and the fault set memoised per
session.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pytest_dnnsafety.engines.core.capture import ActivationCache
from pytest_dnnsafety.engines.monitors.faults import NO_RIGHT_ANSWER, SEVERITY_FREE, fault_parameters
from pytest_dnnsafety.engines.monitors.gating import DetectionResult, OverheadResult, SelectiveRiskResult
from pytest_dnnsafety.engines.monitors.metrics import system_view
from pytest_dnnsafety.engines.monitors.session import MonitorSession
from pytest_dnnsafety.engines.monitors.stream import fault_stream
from pytest_dnnsafety.engines.monitors.variants import ClassifierVariant, DetectorVariant, for_task
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.gates.core import GateContext


def _row(family: str, severity: int | None, fp: int = 2, tn: int = 8) -> dict[str, Any]:
    return {"family": family, "severity": severity, "n_ood": 10, "fp": fp, "tn": tn}


def test_a_detection_metric_undefined_for_a_set_makes_the_result_inconclusive() -> None:
    result = DetectionResult("msp", "recall", "worst", [_row("gaussian_noise", 3), _row("novel", None)],
                             [0.5, float("nan")])
    assert math.isnan(result.value)
    assert result.inconclusive == "recall is undefined for novel"
    assert result.detail() == "recall undefined for novel"
    assert result.to_details() == {"faults": result.rows, "metric": "recall"}


def test_a_detection_result_names_the_worst_set_and_the_parameters_of_the_severities_it_read() -> None:
    rows = [_row("gaussian_noise", 2), _row("gaussian_noise", 4), _row("black_frame", None), _row("novel", None)]
    result = DetectionResult("msp", "mcc", "worst", rows, [0.4, 0.2, 0.9, 0.6], about={"monitor": "msp"})
    assert result.inconclusive is None and result.value == 0.2
    assert result.detail() == ("msp: worst gaussian_noise s4 mcc 0.200 over 4 fault set(s); in-distribution "
                               "alarms 2/10")
    details = result.to_details()
    assert details["worst"] == {"family": "gaussian_noise", "severity": 4, "mcc": 0.2}
    noise = fault_parameters("gaussian_noise")
    assert details["fault_parameters"] == {"gaussian_noise": {"2": noise[2], "4": noise[4]}, "black_frame": {}}
    assert (details["id_alarms"], details["id_inputs"]) == (2, 10) and "ranking" not in details
    mean = DetectionResult("msp", "mcc", "mean", rows, [0.4, 0.2, 0.9, 0.6])
    assert mean.value == pytest.approx(0.525)
    assert mean.detail() == "msp: mean mcc 0.525 over 4 fault set(s); worst gaussian_noise s4 mcc 0.200"


def test_a_monitor_that_rejects_every_input_has_no_selective_risk_and_no_bound() -> None:
    pooled = system_view(torch.ones(4, dtype=torch.bool), torch.tensor([True, False, False, True]))
    result = SelectiveRiskResult("all", pooled, {}, 0.95, "bound", {"monitor": "all"}, None)
    assert math.isnan(result.value) and result.gated_bound is None
    assert result.inconclusive is not None and "rejected every input" in result.inconclusive
    assert result.detail() == "all rejected all 4 inputs"
    assert "bound" not in result.to_details()
    accepted = system_view(torch.tensor([False, True, False, False]), torch.tensor([True, False, False, True]))
    gated = SelectiveRiskResult("m", accepted, {}, 0.95, "value", {}, 0.9)
    assert gated.value == accepted.selective_risk and gated.gated_bound is None and gated.inconclusive is None
    assert gated.to_details()["bound"] == 0.9


def test_a_rank_that_does_not_time_the_monitor_reports_a_placeholder() -> None:
    result = OverheadResult("maha", None)
    assert (result.value, result.detail(), result.to_details()) == (0.0, "maha: timed on rank 0", {"monitor": "maha"})


def test_the_task_picks_the_variant_and_inputs_without_a_right_answer_are_always_wrong() -> None:
    assert isinstance(for_task("detection"), DetectorVariant)
    assert isinstance(for_task("single-label"), ClassifierVariant)
    assert "black_frame" in SEVERITY_FREE and "novel" in NO_RIGHT_ANSWER
    out = SimpleNamespace(n_inputs=3, predictions=torch.tensor([0, 1, 2]), labels=None)
    variant = ClassifierVariant()
    assert variant.wrong(out, "novel", None, None, "dataset").tolist() == [True, True, True]
    with pytest.raises(DataError, match="fixture 'dataset' has no labels"):
        variant.wrong(out, None, None, None, "dataset")
    out.labels = torch.tensor([0, 2, 2])
    out.check_labels = lambda role: None
    assert variant.wrong(out, "gaussian_noise", None, None, "dataset").tolist() == [False, True, False]
    with pytest.raises(ConfigError, match="does not apply to a detector"):
        DetectorVariant().fault_source(torch.rand(2, 1, 4, 4), "pgd")


def test_a_sessions_fault_set_is_read_once_and_holds_the_streams_values() -> None:
    ctx = GateContext(settings=None, seed=3, device="cpu", batch_size=4)  # type: ignore[arg-type]
    session = MonitorSession(ctx.memo, ActivationCache(), seed=3, batch_size=4, device="cpu")
    x, y = torch.rand(10, 1, 6, 6), torch.arange(10) % 3
    data = (x, y)
    first = session.fault_set(data, "gaussian_noise", 2)
    assert session.fault_set(data, "gaussian_noise", 2) is first
    assert session.stream(data, "gaussian_noise", 2, model=None, clip=(0.0, 1.0), role="dataset") is \
        session.stream(data, "gaussian_noise", 2, model=None, clip=(0, 1), role="dataset")
    expected = fault_stream(data, "gaussian_noise", 2, seed=3, batch_size=4).materialise()
    torch.testing.assert_close(first.tensors[0], expected.tensors[0], rtol=0, atol=0)
    assert torch.equal(first.tensors[1], y)
    assert session.first_facts(data) == ((1, 6, 6), True)
    assert session.first_facts(x) == ((1, 6, 6), False)
