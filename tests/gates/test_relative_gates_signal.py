"""No green page for a broken model (issue #29 §2): every relative gate is inconclusive on a model without signal.

Known answers, evaluated in process on the session mechanism (:func:`pytest_dnnsafety.gates.evaluate`, one shared
cache per model) for every relative gate family — performance (degradation), neurons (pattern deviation),
inspection (confusion, bias), confusion (weighted), monitors (detection, selective risk) and interpretability
(occlusion) — on

* a chance-level classifier (a random function of the input: accuracy ≈ 1/4 on 4 balanced classes);
* a collapsed classifier (always class 0);
* a detector that detects nothing above the score 0.5;
* a multi-label model that predicts no class;

each gate inconclusive with the precondition's reason and numbers, no value; and a positive control: the same
gates on a model that is better than chance (a detector that finds its objects, a multi-label model that predicts)
are judged (passed or failed), never inconclusive for want of signal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from _blob_detector import BlobDetector, blob_data
from pytest_dnnsafety import Conditions, DetectionScore, Energy, ScenarioTable
from pytest_dnnsafety.data.tasks import DetectionData
from pytest_dnnsafety.gates import evaluate, parse_marker
from pytest_dnnsafety.settings import SETTINGS, Settings

N, K = 400, 4

CLASSIFIER_GATES: dict[str, tuple[str, dict[str, Any]]] = {
    "degradation": ("max_scenario_degradation", {"by": ["light"]}),
    "pattern": ("max_neuron_pattern_deviation", {"layer": "body.1"}),
    "confusion": ("max_class_confusion", {"layer": "body.1", "unpredicted": "exclude"}),
    "bias": ("max_class_bias", {"layer": "body.1", "unpredicted": "exclude"}),
    "weighted": ("max_weighted_confusion", {"severity": {"1": {"2": 3.0}}, "default": 0.0}),
    "monitor": ("min_monitor_detection", {"monitor": "energy", "faults": ["gaussian_noise"], "severity": 3,
                                          "clip": None}),
    "risk": ("max_monitor_selective_risk", {"monitor": "energy"}),
    "interpret": ("min_interpretation_precision", {"size": 2, "masks": "masks"}),
    "min_occsen": ("min_occlusion_sensitivity", {"size": 2, "masks": "masks"}),
    "max_occsen": ("max_occlusion_sensitivity", {"size": 2, "masks": "masks"}),
}
DETECTOR_GATES = {name: CLASSIFIER_GATES[name] for name in ("pattern", "monitor", "interpret", "min_occsen",
                                                             "max_occsen")}
DETECTOR_GATES["pattern"] = ("max_neuron_pattern_deviation", {"layer": "conv", "groups": 3})
for _name in ("interpret", "min_occsen", "max_occsen"):  # the boxes stand in for the masks
    DETECTOR_GATES[_name] = (CLASSIFIER_GATES[_name][0], {"size": 2})
DETECTOR_GATES["monitor"] = ("min_monitor_detection", {"monitor": "detection_score", "faults": ["gaussian_noise"],
                                                       "severity": 3})
DETECTOR_GATES["risk"] = ("max_monitor_selective_risk", {"monitor": "detection_score"})
MULTILABEL_GATES = {name: CLASSIFIER_GATES[name] for name in ("degradation", "pattern", "confusion", "bias")}


def _settings(root: Path) -> Settings:
    values = {SETTINGS["batch_size"].ini: "64", SETTINGS["device"].ini: "cpu", SETTINGS["seed"].ini: "3"}
    return Settings(cli={}, ini=values.get, env={}, ini_file=root / "pyproject.toml", invocation_dir=root)


def _evaluate(gates: dict[str, tuple[str, dict[str, Any]]], fx: dict[str, Any], root: Path,
              threshold: dict[str, float] | None = None) -> dict[str, Any]:
    cache: dict[str, Any] = {}
    out = {}
    for name, (marker, kwargs) in gates.items():
        spec = parse_marker(marker, ((threshold or {}).get(marker, 0.5),), kwargs, f"t.py::test_{name}")
        out[name] = evaluate(spec, {role: fx[role] for role in spec.fixtures if role in fx}, _settings(root),
                             f"t.py::test_{name}", cache)
    return out


# ------------------------------------------------------------------------------------- classifiers

def _images(n: int = N, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n, 1, 4, 4)`` images in [0, 1]: class c brightens quadrant c; balanced labels."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % K
    x = torch.rand(n, 1, 4, 4, generator=gen) * 0.3
    for c in range(K):
        r, col = divmod(c, 2)
        x[y == c, :, 2 * r:2 * r + 2, 2 * col:2 * col + 2] += 0.7
    return x, y


class Quadrants(nn.Module):
    """A classifier reading the quadrants' brightness (``mode="trained"``), a random function of the input
    (``"chance"``) or a constant (``"collapsed"``: always class 0). Layer ``body.1`` is a hidden ReLU layer."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        gen = torch.Generator().manual_seed(1)
        self.body = nn.Sequential(nn.Flatten(), nn.ReLU(), nn.Linear(16, K))
        self.register_buffer("w", torch.randn(16, K, generator=gen))
        with torch.no_grad():
            self.body[2].weight.zero_()
            for c in range(K):
                r, col = divmod(c, 2)
                self.body[2].weight[c].view(4, 4)[2 * r:2 * r + 2, 2 * col:2 * col + 2] = 3.0
            self.body[2].bias.fill_(-4.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.body(x)
        if self.mode == "chance":
            return 5 * torch.sin(1000 * x.flatten(1) @ self.w) + 0 * logits
        if self.mode == "collapsed":
            return torch.tensor([5.0, 0.0, 0.0, 0.0]).expand(x.shape[0], K) + 0 * logits
        return logits


def _classifier_fx(mode: str) -> dict[str, Any]:
    model = Quadrants(mode).eval()
    x, y = _images()
    table = ScenarioTable(Conditions({"light": ["day", "night"]}), [{"light": "day" if i % 3 else "night"}
                                                                     for i in range(N)])
    return {"model": model, "data": (x, y), "fit_data": _images(300, seed=5), "monitors": {"energy": Energy()},
            "scenarios": table, "masks": x[:, 0] > 0.5}


@pytest.mark.parametrize("mode", ["chance", "collapsed"])
def test_a_classifier_at_chance_makes_every_relative_gate_inconclusive(mode: str, tmp_path: Path) -> None:
    results = _evaluate(CLASSIFIER_GATES, _classifier_fx(mode), tmp_path)
    for name, result in results.items():
        assert result.status == "inconclusive", (name, result.summary)
        why = result.details["inconclusive"]
        assert why.startswith("no signal: the model's accuracy ") and "is not above chance 0.250" in why, why
        assert "95% Clopper–Pearson lower bound" in why and f"{K} classes, {N} inputs of fixture" in why, why
        assert "Fix: " in why and result.value is None, (name, result.summary)
        numbers = result.details["no_signal"]
        assert numbers["chance_accuracy"] == 0.25 and numbers["above_chance"] is False
        assert numbers["accuracy_lower_bound"] <= 0.25
        if mode == "collapsed":
            assert numbers["accuracy"] == 0.25 and numbers["predicted_classes"] == 1
            assert "it predicts 1 of 4 classes" in why


def test_a_classifier_better_than_chance_is_measured(tmp_path: Path) -> None:
    """Positive control: the trained quadrant reader gives a signal; every gate measures it."""
    results = _evaluate(CLASSIFIER_GATES, _classifier_fx("trained"), tmp_path)
    for name, result in results.items():
        assert "no_signal" not in result.details, (name, result.summary)
        if name != "bias":  # DeepInspect's own no-signal rule: four well-separated classes put no NAPVD below its cutoff
            assert result.status in ("passed", "failed"), (name, result.summary)
    assert results["degradation"].status == results["pattern"].status == "passed", results["degradation"].summary


# ------------------------------------------------------------------------------------- detectors


class Dim(BlobDetector):
    """The blob detector with a feature layer ``conv`` and every score scaled by ``factor`` (0.4: below 0.5)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor
        self.conv = nn.Conv2d(1, 3, 3)

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        self.conv(x)
        out = super().forward(x)
        return [{**d, "scores": d["scores"] * self.factor} for d in out]


def _detector_fx(factor: float) -> dict[str, Any]:
    return {"model": Dim(factor).eval(), "data": DetectionData.from_offsets(**blob_data(48)),
            "fit_data": DetectionData.from_offsets(**blob_data(48, seed=1)),
            "monitors": {"detection_score": DetectionScore()}}


def test_a_detector_without_a_detection_makes_every_relative_gate_inconclusive(tmp_path: Path) -> None:
    results = _evaluate(DETECTOR_GATES, _detector_fx(0.4), tmp_path)
    for name, result in results.items():
        assert result.status == "inconclusive", (name, result.summary)
        why = result.details["inconclusive"]
        assert why.startswith("no signal: the detector makes no detection with a score of at least 0.5 on any of "
                              "the 48 images of fixture"), why
        assert "the highest score 0.3" in why and "Fix: " in why
        assert result.details["no_signal"]["detections_above"] == 0


def test_a_detector_that_detects_is_measured(tmp_path: Path) -> None:
    results = _evaluate(DETECTOR_GATES, _detector_fx(1.0), tmp_path)
    for name, result in results.items():
        assert "no_signal" not in result.details, (name, result.summary)
        if name != "interpret":  # no occlusion of 2x2 pixels hides a blob: M_interpret is undefined (an error)
            assert result.status in ("passed", "failed"), (name, result.summary)


# ------------------------------------------------------------------------------------- multi-label


class MultiLabel(nn.Module):
    """Per-class logits from the quadrants (``offset`` -20: no class ever reaches 0.5)."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.net = Quadrants("trained")
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) + self.offset


def _multilabel_fx(offset: float) -> dict[str, Any]:
    fx = _classifier_fx("trained")
    x, y = fx["data"]
    labels = torch.nn.functional.one_hot(y, K).float()
    labels[::5, (y[::5] + 1) % K] = 1.0  # some inputs hold two classes
    fx.update(model=MultiLabel(offset).eval(), data=(x, labels))
    return fx


def test_a_multilabel_model_predicting_nothing_makes_every_relative_gate_inconclusive(tmp_path: Path) -> None:
    gates = {name: (marker, {**kwargs, **({"layer": "net.body.1"} if "layer" in kwargs else {})})
             for name, (marker, kwargs) in MULTILABEL_GATES.items()}
    results = _evaluate(gates, _multilabel_fx(-20.0), tmp_path)
    for name, result in results.items():
        assert result.status == "inconclusive", (name, result.summary)
        why = result.details["inconclusive"]
        assert why.startswith(f"no signal: the multi-label model predicts no class on any of the {N} inputs"), why
        assert "its outputs read as logits, reaches its decision threshold 0.5" in why and "Fix: " in why
        assert result.details["no_signal"]["predicted_labels"] == 0
    control = _evaluate(gates, _multilabel_fx(0.0), tmp_path)
    for name, result in control.items():
        assert "no_signal" not in result.details, (name, result.summary)
