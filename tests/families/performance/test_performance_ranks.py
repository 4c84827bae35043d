"""The performance and detection gates under two gloo ranks give one process's status, value, bound and details.

The paths that gather or agree across ranks: per-class counts (the ranks agree on the number of classes), a
user ``metric=`` and precision/recall/F1 (every rank's rows gathered), a multi-label model's predicted sets
(the ranks agree on ``outputs='auto'``), and the detection matching (records all-gathered) grouped by scenario.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from _gloo import GLOO_AVAILABLE, run_on_gloo_ranks

from pytest_dnnsafety import Conditions, ScenarioTable
from pytest_dnnsafety.data.tasks import BoxSet, DetectionData
from _details import reproducible
from pytest_dnnsafety.gates import evaluate, parse_marker
from pytest_dnnsafety.settings import SETTINGS, Settings

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not GLOO_AVAILABLE, reason="torch.distributed with gloo is not available")]

N, BS = 103, 16  # 7 batches: rank 0 forwards batches 0..2 (rows 0..47), rank 1 batches 3..6 (rows 48..102)
BY = {"by": ["light"], "min_samples": 5}


def macro_hits(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    """A user metric that is not a sum over shards: the mean over classes of the share of rows right."""
    right = (predictions == labels).reshape(len(labels), -1).all(1).double()
    return float(right.mean()) if len(right) else 0.0


CLASSIFIER = [
    ("min_scenario_accuracy", (0.0,), {**BY, "per_class": True, "metric": macro_hits}),
    ("max_scenario_degradation", (1.0,), {**BY, "statistic": "bound"}),
    ("min_scenario_accuracy", (0.0,), {**BY, "score": "f1", "average": "macro", "replicates": 200}),
]
MULTI_LABEL = [
    ("min_scenario_accuracy", (0.0,), {**BY, "task": "multi-label"}),
    ("max_scenario_degradation", (1.0,), {**BY, "task": "multi-label", "score": "recall", "per_class": True,
                                          "replicates": 200}),
]
DETECTOR = [
    ("min_detection_map", (0.0,), {"by": "light", "min_images": 5, "bootstrap": 100}),
    ("min_detection_recall", (0.0,), {"by": "light", "min_images": 5, "bootstrap": 100, "per_class": False}),
]


class Detector(torch.nn.Module):
    """One box per image at the object's place, shifted by the image's first value (some miss), class 0."""

    def forward(self, x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        shift = x[:, 0].abs() * 4
        boxes = torch.tensor([4.0, 4.0, 20.0, 20.0]) + shift[:, None]
        return [{"boxes": boxes[i:i + 1], "scores": torch.sigmoid(x[i:i + 1, 1]),
                 "labels": torch.zeros(1, dtype=torch.int64)} for i in range(x.shape[0])]


def _table() -> ScenarioTable:
    return ScenarioTable(Conditions({"light": ["day", "night"]}), [{"light": "day" if i % 3 else "night"}
                                                                   for i in range(N)])


def _data() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(N, 6, generator=gen)
    targets = BoxSet(torch.tensor([[4.0, 4.0, 20.0, 20.0]] * N), torch.zeros(N, dtype=torch.int64),
                     torch.arange(N), N)
    return {"single": (x, torch.randint(0, 4, (N,), generator=gen)),
            "multi": (x, (torch.rand(N, 4, generator=gen) < 0.3).long()),
            "boxes": DetectionData(x, targets)}


def _evaluate_all(root: str) -> dict[str, Any]:
    settings = Settings(cli={}, ini={SETTINGS["batch_size"].ini: str(BS), SETTINGS["device"].ini: "cpu"}.get,
                        env={}, ini_file=Path(root) / "pyproject.toml", invocation_dir=Path(root))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 4))
    data, out, cache = _data(), {}, {}
    for name, model, gates in (("single", net, CLASSIFIER), ("multi", net, MULTI_LABEL),
                               ("boxes", Detector(), DETECTOR)):
        for i, (marker, args, kwargs) in enumerate(gates):
            spec = parse_marker(marker, args, kwargs, f"test_{name}_{i}")
            fx = {"model": model, "data": data[name], "scenarios": _table()}
            result = evaluate(spec, fx, settings, f"test_{name}_{i}", cache)
            out[f"{name} {i} {marker}"] = json.loads(json.dumps(
                [result.status, _num(result.value), _num(result.bound), reproducible(result.details)], default=str))
    return out


def _num(value: Any) -> Any:
    return "nan" if isinstance(value, float) and math.isnan(value) else value


def _rank(rank: int, world: int, root: str) -> dict[str, Any]:
    return _evaluate_all(root)


def test_two_gloo_ranks_give_the_single_process_readings(tmp_path: Path) -> None:
    single = _evaluate_all(str(tmp_path))
    assert {value[0] for value in single.values()} <= {"passed", "failed", "inconclusive"}, single
    assert single["single 0 min_scenario_accuracy"][3]["user_metric"]["name"] == "macro_hits"
    for rank, result in enumerate(run_on_gloo_ranks(_rank, 2, str(tmp_path))):
        for key, expected in single.items():
            assert result[key] == expected, (rank, key)
