"""Known answers on bad inputs for the gates of issue #22: every multi-label and detection gate errors on NaN
outputs, a shuffled DataLoader and a misaligned scenario table, refuses labels that do not fit the model, and
fails a model that is plainly wrong — never a pass. Gates are evaluated directly (no pytest subprocess)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _hostile import make_settings
from pytest_dnnsafety.gates import builtin_registry, evaluate, parse_marker
from pytest_dnnsafety.scenarios import Conditions, ScenarioTable
from pytest_dnnsafety.data.tasks import BoxSet, DetectionData, detection_collate

GATES = dict(builtin_registry())
N = 60
BOX = (2.0, 2.0, 10.0, 10.0)


def _table(n: int = N) -> ScenarioTable:
    return ScenarioTable(Conditions({"lighting": ["day", "night"]}),
                         [{"lighting": "day" if i % 2 else "night"} for i in range(n)])


def _run(tmp_path: Path, marker: str, options: dict[str, Any], fixtures: dict[str, Any]) -> Any:
    gate = GATES[marker]
    threshold = 0.5 if gate.op == ">=" else 0.3
    spec = parse_marker(marker, (threshold,), options, "t.py::test", GATES)
    return evaluate(spec, {role: fixtures[role] for role in spec.fixtures}, make_settings(tmp_path), "t.py::test", {})


# ------------------------------------------------------------------------------------- detection


class Detector(nn.Module):
    """One box per image at ``BOX``, class 1, scored from the image; ``mode`` makes it wrong."""

    def __init__(self, mode: str = "good") -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        score = torch.sigmoid(self.conv(x).mean(dim=(1, 2, 3)) + 3.0)
        box = torch.tensor([BOX])
        if self.mode == "nan":
            box = box * float("nan")
        label = torch.tensor([2 if self.mode == "wrong_class" else 1])
        return [{"boxes": box, "scores": score[i:i + 1], "labels": label} for i in range(x.shape[0])]


def _boxes(n: int = N) -> DetectionData:
    gen = torch.Generator().manual_seed(0)
    return DetectionData(torch.rand(n, 1, 16, 16, generator=gen),
                         BoxSet(torch.tensor([BOX]).repeat(n, 1), torch.ones(n, dtype=torch.int64), torch.arange(n), n))


DETECTION_GATES = [("min_detection_map", {"by": "lighting", "min_images": 10, "bootstrap": 100}),
                   ("min_detection_recall", {"by": "lighting", "min_images": 10, "bootstrap": 100})]


@pytest.mark.parametrize("marker, options", DETECTION_GATES)
def test_detection_gates_on_bad_inputs(tmp_path: Path, marker: str, options: dict[str, Any]) -> None:
    good = {"model": Detector().eval(), "data": _boxes(), "scenarios": _table()}
    assert _run(tmp_path, marker, options, good).status == "passed"
    nan = _run(tmp_path, marker, options, {**good, "model": Detector("nan").eval()})
    assert nan.status == "error" and "NaN/inf" in nan.summary
    wrong = _run(tmp_path, marker, options, {**good, "model": Detector("wrong_class").eval()})
    assert wrong.status == "failed" and wrong.value == 0.0
    shuffled = torch.utils.data.DataLoader(_boxes(), batch_size=8, shuffle=True, collate_fn=detection_collate)
    result = _run(tmp_path, marker, options, {**good, "data": shuffled})
    assert result.status == "error" and "shuffle" in result.summary
    result = _run(tmp_path, marker, options, {**good, "scenarios": _table(N - 1)})
    assert result.status == "error" and str(N - 1) in result.summary


def test_detector_occlusion_and_robustness_gates_error_on_nan_boxes(tmp_path: Path) -> None:
    data = _boxes(8)
    for marker, options in [("min_interpretation_precision", {"size": 4, "stride": 4}),
                            ("max_adversarial_confidence_loss", {"eps": 0.05, "families": ["gaussian_noise"]}),
                            ("min_robust_accuracy", {"eps": 0.05, "families": ["gaussian_noise"]})]:
        result = _run(tmp_path, marker, options, {"model": Detector("nan").eval(), "data": data, "masks": None})
        assert result.status == "error" and "NaN/inf" in result.summary, (marker, result.summary)


# ------------------------------------------------------------------------------------- multi-label


class Reader(nn.Module):
    """Four logits per input; ``mode="nan"`` returns NaN on a marked input, ``"opposite"`` flips every decision,
    ``"pair"`` predicts classes 0 and 1 together."""

    def __init__(self, mode: str = "good") -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(4, 8), nn.ReLU())
        self.head = nn.Linear(8, 4)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = (x.flatten(1) - 0.5) * 20 + 0.0 * self.head(self.body(x))  # reads the labels encoded in x
        if self.mode == "opposite":
            logits = -logits
        if self.mode == "pair":  # classes 0 and 1 always predicted together
            both = torch.maximum(logits[:, 0], logits[:, 1])
            logits = torch.cat([both[:, None], both[:, None], logits[:, 2:]], dim=1)
        if self.mode == "nan" and bool((x[:, 0, 0] > 2).any()):
            logits = logits * float("nan")
        return logits


def _multilabel(n: int = N, bad_row: bool = False) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1)
    y = (torch.rand(n, 4, generator=gen) < 0.4).long()
    x = y.float().reshape(n, 1, 4) + 0.05 * torch.rand(n, 1, 4, generator=gen)
    if bad_row:
        x[-1, 0, 0] = 3.0  # the NaN reader's trigger, in the last batch
    return torch.utils.data.TensorDataset(x, y)


MULTI_GATES = [("min_scenario_accuracy", {"by": "lighting", "score": "f1", "average": "macro", "min_samples": 10},
                "opposite"),
               ("max_class_confusion", {"layer": "body.2", "statistic": "type2", "min_support": 5}, "pair")]


@pytest.mark.parametrize("marker, options, wrong", MULTI_GATES)
def test_multilabel_gates_on_bad_inputs(tmp_path: Path, marker: str, options: dict[str, Any], wrong: str) -> None:
    good = {"model": Reader().eval(), "data": _multilabel(), "scenarios": _table()}
    assert _run(tmp_path, marker, options, good).status == "passed"
    failed = _run(tmp_path, marker, options, {**good, "model": Reader(wrong).eval()})
    assert failed.status == "failed", failed.summary
    nan = _run(tmp_path, marker, options, {**good, "model": Reader("nan").eval(), "data": _multilabel(bad_row=True)})
    assert nan.status == "error" and "NaN/inf" in nan.summary
    five = torch.utils.data.TensorDataset(_multilabel().tensors[0], torch.cat([_multilabel().tensors[1]] * 2, 1)[:, :5])
    result = _run(tmp_path, marker, options, {**good, "data": five})
    assert result.status == "error" and "5" in result.summary, result.summary
    shuffled = torch.utils.data.DataLoader(_multilabel(), batch_size=8, shuffle=True)
    result = _run(tmp_path, marker, options, {**good, "data": shuffled})
    assert result.status == "error" and "shuffle" in result.summary


def test_type2_without_a_supported_pair_is_inconclusive(tmp_path: Path) -> None:
    result = _run(tmp_path, "max_class_confusion", {"layer": "body.2", "statistic": "type2", "min_support": 10**6},
                  {"model": Reader().eval(), "data": _multilabel()})
    assert result.status == "inconclusive", result.summary
