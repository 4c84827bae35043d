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


# ------------------------------------------------------------------ sharded scoring of the evaluation data

N_EVAL, BATCH = 75, 8  # 10 batches, the last one short: rank 0 gets batches 0-4, rank 1 batches 5-9


def _scoring_setup() -> tuple:
    from _streaming import StreamingImages, TINY, stream_net
    from pytest_dnnsafety.engines.monitors import ODIN, Autoencoder, Energy, Mahalanobis, fit_monitor

    torch.manual_seed(0)
    model = stream_net(TINY)
    fit = torch.utils.data.DataLoader(StreamingImages(40, seed=1, shape=TINY), batch_size=BATCH)
    monitors = {"energy": Energy(), "odin": ODIN(temperature=10.0, epsilon=0.01),
                "maha": Mahalanobis(layer="classifier.1"),
                "ae": Autoencoder(torch.nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False))}
    fitted = {name: fit_monitor(m, model, fit, seed=0, batch_size=BATCH) for name, m in monitors.items()}
    return model, fitted, (lambda: StreamingImages(N_EVAL, shape=TINY))


def _scores(model, fitted, make_data, shard_of) -> dict:
    from pytest_dnnsafety.engines.core.capture import ActivationCache
    from pytest_dnnsafety.engines.monitors import MonitorView, fault_stream

    out, loads = {}, {}
    for name, monitor in fitted.items():
        for kind in ("clean", "pgd"):
            images = make_data()
            data = torch.utils.data.DataLoader(images, batch_size=BATCH)
            if kind == "pgd":
                data = fault_stream(data, "pgd", 3, seed=4, model=model, batch_size=BATCH)
            view = MonitorView(model, data, batch_size=BATCH, cache=ActivationCache(), plan=monitor.layers(),
                               shard=shard_of(data))
            out[f"{name} {kind}"] = monitor.score(view).tolist()
            loads[f"{name} {kind}"] = images.loaded
    return {"scores": out, "loads": loads}


def _scoring_rank(rank: int, world: int) -> dict:
    from pytest_dnnsafety.runtime import torchrun as ranks

    model, fitted, make_data = _scoring_setup()
    result = _scores(model, fitted, make_data, lambda data: ranks.batch_shard(data, BATCH))
    result["shard"] = list(ranks.batch_shard(torch.utils.data.DataLoader(make_data(), batch_size=BATCH), BATCH).rows)
    return result


def test_two_gloo_ranks_score_their_shards_and_gather_the_single_process_scores() -> None:
    model, fitted, make_data = _scoring_setup()
    single = _scores(model, fitted, make_data, lambda data: None)
    results = run_on_gloo_ranks(_scoring_rank, 2)
    assert [r["shard"] for r in results] == [[0, 40], [40, 75]]
    for result in results:
        assert result["scores"].keys() == single["scores"].keys()
        for key, want in single["scores"].items():
            assert result["scores"][key] == want, key  # bit-identical: the same batches, gathered in row order
    # ODIN and the autoencoder read the inputs through the view's runner: a rank loads only its own batches
    for key in ("odin clean", "ae clean"):
        assert [r["loads"][key] for r in results] == [40, 35], key
