"""The gates of the shared forward pass under two gloo ranks: each rank forwards its share, the values are exact.

Neuron coverage, the pattern deviation, weighted confusion, DeepInspect confusion and bias (also on
a label-returning model, whose number of classes the ranks agree on) and the scenario accuracy:
evaluated on two gloo ranks, each gate's status, value, bound and details equal one process's, and
each rank's one shared pass forwarded only its own rows. A NaN in one rank's shard makes the gate an
error on both ranks (none waits in the all-reduce).
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
from pytest_dnnsafety.runtime import torchrun as ranks
from _details import reproducible
from pytest_dnnsafety.settings import SETTINGS, Settings
from pytest_dnnsafety.gates import evaluate, parse_marker

pytestmark = pytest.mark.skipif(not GLOO_AVAILABLE, reason="torch.distributed with gloo is not available")

N, BS = 103, 16  # 7 batches: rank 0 forwards batches 0..2 (rows 0..47), rank 1 batches 3..6 (rows 48..102)

GATES = [
    ("min_neuron_k_activation", (0.1,), {"layer": "1", "k": 3, "activation_threshold": 0.8}),
    ("max_neuron_pattern_deviation", (0.9,), {"layer": "1", "groups": 10, "activation_threshold": 0.5}),
    ("max_neuron_pattern_deviation", (0.9,), {"layer": "1", "groups": 10, "where": {"light": "day"}}),
    ("max_weighted_confusion", (5.0,), {"severity": {"0": {"1": 3.0}}}),
    ("max_class_confusion", (0.99,), {"layer": "1", "unpredicted": "exclude"}),
    ("max_class_confusion", (0.99,), {"layer": "1", "statistic": "share", "unpredicted": "exclude"}),
    ("max_class_bias", (0.45,), {"layer": "1", "unpredicted": "exclude"}),
    ("min_scenario_accuracy", (0.0,), {"by": ["light"], "min_samples": 5, "allow_small_groups": True}),
]


class Decide(torch.nn.Module):
    """A classifier that returns its decision (class indices), not scores."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).argmax(dim=1)


def _model(labels_only: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 4))
    return Decide(net) if labels_only else net


def _data(nan_row: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(N, 6, generator=gen), torch.randint(0, 4, (N,), generator=gen)
    if nan_row is not None:
        x[nan_row, 0] = float("nan")
    return x, y


def _table() -> ScenarioTable:
    conditions = Conditions({"light": ["day", "night"]})
    return ScenarioTable(conditions, [{"light": "day" if i % 3 else "night"} for i in range(N)])


def _settings(root: Path) -> Settings:
    values = {SETTINGS["batch_size"].ini: str(BS), SETTINGS["device"].ini: "cpu"}
    return Settings(cli={}, ini=values.get, env={}, ini_file=root / "pyproject.toml", invocation_dir=root)


def _evaluate_all(root: str, nan_row: int | None = None) -> dict[str, Any]:
    settings = _settings(Path(root))
    out: dict[str, Any] = {}
    for labels_only in (False, True):
        model, data, table = _model(labels_only), _data(nan_row), _table()
        if nan_row is not None:  # a loader: tensors are checked whole when read, a loader batch by batch
            data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data), batch_size=BS)
        layer = "net.1" if labels_only else "1"
        cache: dict[str, Any] = {"layer_plan": {("model", "dataset"): (layer,)}}  # what the session collects
        for i, (marker, args, kwargs) in enumerate(GATES):
            if labels_only and marker not in ("max_class_confusion", "max_class_bias", "max_weighted_confusion"):
                continue
            if labels_only:  # the same layer inside the wrapper; the decisions carry no class count
                kwargs = {**kwargs, **({"layer": "net.1"} if "layer" in kwargs else {})}
                if marker == "max_weighted_confusion":
                    kwargs.update(severity={"a": {"b": 3.0}}, classes=list("abcd"))
            spec = parse_marker(marker, args, kwargs, f"test_{i}")
            fx = {"model": model, "data": data, "scenarios": table}
            result = evaluate(spec, fx, settings, f"test_{i}", cache)
            details = {k: v for k, v in reproducible(result.details).items() if k not in ("traceback",)}
            out[f"{labels_only} {i} {marker}"] = json.loads(json.dumps(
                [result.status, _num(result.value), _num(result.bound), details], default=str))
        passes = cache["activations"]
        rows = {len(v.predictions) for v in passes._outputs.values()}
        out[f"{labels_only} passes"] = [passes.forward_passes, sorted(rows)]
    return out


def _num(value: Any) -> Any:
    return "nan" if isinstance(value, float) and math.isnan(value) else value


def _rank(rank: int, world: int, root: str) -> dict[str, Any]:
    assert ranks.batch_shard(_data()[0], BS).rows == ((0, 48) if rank == 0 else (48, N))
    return {"clean": _evaluate_all(root), "nan": _evaluate_all(root, nan_row=60)}  # row 60: rank 1's shard


def test_two_gloo_ranks_give_the_single_process_values(tmp_path: Path) -> None:
    results = run_on_gloo_ranks(_rank, 2, str(tmp_path))
    single = _evaluate_all(str(tmp_path))
    statuses = {key: value[0] for key, value in single.items() if "passes" not in key}
    assert set(statuses.values()) <= {"passed", "failed", "inconclusive"}, single  # real measurements, no errors
    assert single["False passes"] == [1, [N]]  # one pass shared by every gate
    for rank, result in enumerate(results):
        clean = result["clean"]
        for key, expected in single.items():
            if "passes" in key:
                continue
            assert clean[key] == expected, (rank, key)
        # one shared pass per rank, over this rank's rows only
        assert clean["False passes"] == [1, [48 if rank == 0 else N - 48]]
        assert clean["True passes"] == [1, [48 if rank == 0 else N - 48]]
        for key, value in result["nan"].items():
            if "passes" in key:
                # one pass per rank, not retried by the other gates: rank 0's succeeded, rank 1's failed
                assert value == ([1, [48]] if rank == 0 else [1, []]), (rank, key)
                continue
            status, details = value[0], value[3]
            assert status == "error", (rank, key)
            if rank == 0:  # told by rank 1, whose shard holds the NaN
                assert "rank 1 of 2 failed on its shard" in details["error"], key
            else:
                assert "the inputs hold NaN/inf in 1 batch(es), the first being batch 3" in details["error"], key
