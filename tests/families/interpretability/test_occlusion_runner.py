"""assess_occlusion through the engine runner (issue #20): streaming loaders, batch splits, torchrun shards.

* a DataLoader over a map-style dataset that refuses to be indexed with a slice or a list (it can
  only be read one item at a time, as a streaming dataset) gives exactly what the tensors give;
* the result (means, counts, extremes, the worst inputs and their maps) does not depend on the
  batch size: the means are sums of per-input values in data order, the worst inputs a ``topk``
  state with ties broken by the input index;
* under two gloo ranks, each rank on its :class:`~pytest_dnnsafety.runtime.torchrun.Shard` of the batches
  (tensors, and a DataLoader re-cut to the rank's rows), every rank gets the single-process result;
* the gate's result is memoised by ``GateContext.memo`` (one computation per model, data, masks).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from _gloo import GLOO_AVAILABLE, run_on_gloo_ranks
from test_occlusion import _dyadic_net

from _digits import digits_images
from pytest_dnnsafety.runtime import torchrun as ranks
from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.interpretability.occlusion import OcclusionEngine, assess_occlusion

N = 30
OPTIONS: dict[str, Any] = {"size": 2, "stride": 1, "rho": 0.5, "no_hot": "skip", "empty_mask": "skip"}


class OneAtATime(torch.utils.data.Dataset):
    """A map-style dataset that raises when indexed with anything but one integer (no bulk reads)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self.reads = 0

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, index: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(index, int):
            raise TypeError(f"OneAtATime: read one item at a time, not {type(index).__name__}")
        self.reads += 1
        return self.x[index], self.y[index]


def _data(n: int = N) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = digits_images(n)
    x = x.double()
    return x, y, x[:, 0] > 0.3


def _details(result: Any) -> dict[str, Any]:
    return json.loads(json.dumps(result.to_details()))


def test_a_loader_read_one_item_at_a_time_equals_the_tensors() -> None:
    x, y, masks = _data()
    net = _dyadic_net()
    dataset = OneAtATime(x, y)
    loader = torch.utils.data.DataLoader(dataset, batch_size=7)
    streamed = assess_occlusion(net, loader, masks, **OPTIONS)
    assert dataset.reads == N
    whole = assess_occlusion(net, (x, y), masks, batch_size=7, **OPTIONS)
    assert _details(streamed) == _details(whole)
    by_label = assess_occlusion(net, loader, masks, target="label", **OPTIONS)
    assert _details(by_label) == _details(assess_occlusion(net, (x, y), masks, target="label", **OPTIONS))


@pytest.mark.parametrize("batch_size", [1, 4, 11])
def test_the_result_does_not_depend_on_the_batch_size(batch_size: int) -> None:
    x, y, masks = _data()
    net = _dyadic_net()
    reference = _details(assess_occlusion(net, (x, y), masks, batch_size=N, **OPTIONS))
    assert reference["worst_inputs"] and len(reference["maps"]) == 2
    assert _details(assess_occlusion(net, (x, y), masks, batch_size=batch_size, **OPTIONS)) == reference


def test_tied_worst_inputs_are_the_first_ones() -> None:
    # every input identical: every value ties, so the kept inputs are the first five, in index order
    x, y, masks = _data(1)
    xs, ys, ms = x.repeat(12, 1, 1, 1), y.repeat(12), masks.repeat(12, 1, 1)
    result = assess_occlusion(_dyadic_net(), (xs, ys), ms, batch_size=5, **{**OPTIONS, "no_hot": "zero"})
    assert [row["index"] for row in result.worst_inputs] == [0, 1, 2, 3, 4]
    assert [m["index"] for m in result.maps] == [0, 0]


def test_engine_worst_rows_survive_a_payload_round_trip_and_a_merge() -> None:
    gen = torch.Generator().manual_seed(4)
    hot, occ = torch.rand(20, 9, generator=gen) < 0.3, torch.rand(20, 9, generator=gen) < 0.5
    maps, cls, p = torch.rand(20, 9, generator=gen, dtype=torch.float64), torch.arange(20) % 3, torch.rand(20)

    def run(lo: int, hi: int) -> OcclusionEngine:
        engine = OcclusionEngine("skip", "skip", worst=3, positions=9)
        engine.update(hot[lo:hi], occ[lo:hi], lo, maps=maps[lo:hi], cls=cls[lo:hi], p_clean=p[lo:hi])
        return engine

    whole, halves = run(0, 20), run(0, 8).merge(run(8, 20))
    back = Engine.from_payload(json.loads(json.dumps(whole.state_payload())))
    for other in (halves, back):
        for name in ("per_input", "lowest_interpret", "highest_occsen"):
            assert torch.equal(getattr(other, name).nan_to_num(7.0), getattr(whole, name).nan_to_num(7.0)), name
        assert other.compute() == whole.compute()
    with pytest.raises(ValueError, match="needs maps="):
        OcclusionEngine(worst=2, positions=9).update(hot, occ)


def _rank_occlusion(rank: int, world: int) -> dict[str, Any]:
    x, y, masks = _data()
    net = _dyadic_net()
    out: dict[str, Any] = {}
    loader = torch.utils.data.DataLoader(OneAtATime(x, y), batch_size=4)
    for name, data, batch_size in (("tensors", (x, y), 6), ("loader", loader, 4)):
        shard = ranks.batch_shard(data, batch_size)
        assert shard is not None and shard.world_size == world
        out[name] = _details(assess_occlusion(net, data, masks, batch_size=batch_size, shard=shard, **OPTIONS))
        out[name + "_rows"] = list(shard.rows)
    labelled = ranks.batch_shard((x, y), 6)
    out["label"] = _details(assess_occlusion(net, (x, y), masks, batch_size=6, shard=labelled, target="label",
                                             **OPTIONS))
    if rank == 0:  # the single-process values, in this process (no collective without a shard)
        out["single"] = _details(assess_occlusion(net, (x, y), masks, batch_size=6, **OPTIONS))
        out["single_label"] = _details(assess_occlusion(net, (x, y), masks, batch_size=6, target="label",
                                                        **OPTIONS))
    return out


@pytest.mark.skipif(not GLOO_AVAILABLE, reason="torch.distributed with gloo is not available")
def test_two_gloo_ranks_on_their_shards_give_the_single_process_result() -> None:
    results = run_on_gloo_ranks(_rank_occlusion, 2)
    single, single_label = results[0]["single"], results[0]["single_label"]
    assert single["n"] == N and single["worst_inputs"]
    assert results[0]["tensors_rows"][0] == 0 and 0 < results[1]["tensors_rows"][0] < N  # the work was split
    for result in results:
        assert result["tensors"] == single
        assert result["loader"] == single
        assert result["label"] == single_label
