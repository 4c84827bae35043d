"""Runtime-monitor state over a real 2-rank torch.distributed (gloo) group equals one process's result.

Each rank fits the Mahalanobis sufficient statistics on its half of the features and counts its
half of the detections; after ``sync`` both ranks hold exactly the single-process state.
"""

from __future__ import annotations

import pytest
import torch

from _gloo import GLOO_AVAILABLE, run_on_gloo_ranks
from pytest_dnnsafety.engines.monitors import ClassGaussianStats, DetectionEngine

pytestmark = [pytest.mark.skipif(not GLOO_AVAILABLE, reason="torch.distributed with gloo is not available"),
              pytest.mark.slow]

ROWS = 301  # odd: the ranks get unequal halves


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    feats = torch.randn(ROWS, 6, generator=gen, dtype=torch.float64)
    classes = torch.randint(0, 4, (ROWS,), generator=gen)
    alarm = torch.rand(ROWS, generator=gen) < 0.3
    is_ood = torch.rand(ROWS, generator=gen) < 0.5
    return feats, classes, alarm, is_ood


def _rank(rank: int, world: int) -> dict:
    feats, classes, alarm, is_ood = _data()
    stats = ClassGaussianStats(4, 6)
    stats.update(feats.tensor_split(world)[rank], classes.tensor_split(world)[rank])
    stats.sync()
    detection = DetectionEngine()
    detection.update(alarm.tensor_split(world)[rank], is_ood.tensor_split(world)[rank])
    detection.sync()
    return {"stats": stats.state_payload(), "detection": detection.compute().to_dict()}


def test_two_gloo_ranks_fit_the_single_process_monitor_state() -> None:
    feats, classes, alarm, is_ood = _data()
    whole = ClassGaussianStats(4, 6)
    whole.update(feats, classes)
    single = DetectionEngine()
    single.update(alarm, is_ood)
    results = run_on_gloo_ranks(_rank, 2)
    for result in results:
        synced = ClassGaussianStats.from_payload(result["stats"])
        for name, tensor in whole.states().items():
            assert torch.allclose(synced.states()[name], tensor, rtol=0, atol=1e-9), name
        assert result["detection"] == single.compute().to_dict()
