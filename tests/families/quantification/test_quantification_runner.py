"""quantify_safety through the engine runner and its SafeRadiusEngine (issue #20).

* a DataLoader over a map-style dataset that refuses slices and lists (read one item at a time)
  gives exactly what the tensors give;
* the per-input results and the worst inputs (a ``topk`` state, ties broken by the input index)
  do not depend on the batch size;
* the engine's states merge, round-trip through a JSON payload and keep the inputs' shape and dtype;
* under two gloo ranks, each rank on its :class:`~pytest_dnnsafety.runtime.torchrun.Shard` of the batches
  (tensors, and a DataLoader re-cut to the rank's rows), every rank gets the single-process result.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest
import torch
from _gloo import GLOO_AVAILABLE, run_on_gloo_ranks
from test_occlusion_runner import OneAtATime

from pytest_dnnsafety.runtime import torchrun as ranks
from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.quantification import (Certification, GatedRadius, SafeRadiusEngine, SafetyProperty,
                                                     SearchBudget, quantify_safety)
from pytest_dnnsafety.engines.quantification.engine import PER_INPUT

N = 12
#: the property, the search, the certificate and the gated statistic
OPTIONS = (SafetyProperty(d=0.2), SearchBudget("mads", iterations=6, starts=2), Certification(), GatedRadius(worst=4))


def _net() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).double().eval()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.rand(N, 4, dtype=torch.float64, generator=gen), torch.randint(0, 3, (N,), generator=gen)


def _plain(result: Any) -> dict[str, Any]:
    """Every field of a SafetyQuantification as JSON-able values (tensors as lists; NaN/inf as strings)."""
    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return plain(value.tolist())
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, float) and not math.isfinite(value):
            return repr(value)
        return value

    return {f.name: plain(getattr(result, f.name)) for f in dataclasses.fields(result)}


def test_a_loader_read_one_item_at_a_time_equals_the_tensors() -> None:
    x, y = _data()
    dataset = OneAtATime(x, y)
    streamed = quantify_safety(_net(), torch.utils.data.DataLoader(dataset, batch_size=5), *OPTIONS)
    assert dataset.reads == N
    assert _plain(streamed) == _plain(quantify_safety(_net(), (x, y), *OPTIONS, batch_size=5))
    assert streamed.worst and streamed.certified is not None


@pytest.mark.parametrize("batch_size", [1, 5])
def test_per_input_results_and_worst_inputs_do_not_depend_on_the_batch_size(batch_size: int) -> None:
    x, y = _data()
    whole = quantify_safety(_net(), (x, y), *OPTIONS, batch_size=N)
    split = quantify_safety(_net(), (x, y), *OPTIONS, batch_size=batch_size)
    for name in ("s", "q", "radius", "certified", "unsafe_distance", "pgd_distance", "q_ratio", "q_gradient"):
        torch.testing.assert_close(getattr(split, name), getattr(whole, name), rtol=0, atol=1e-12)
    for name in ("iterations", "evaluations", "converged", "applicable"):
        assert torch.equal(getattr(split, name), getattr(whole, name)), name
    assert [w["index"] for w in split.worst] == [w["index"] for w in whole.worst]
    assert split.value == whole.value


def test_tied_worst_inputs_are_the_first_ones() -> None:
    # four copies of one input: equal radii, so the worst inputs are the first, in index order
    x, _ = _data()
    same = x[:1].repeat(9, 1)
    result = quantify_safety(_net(), same, *OPTIONS, batch_size=4)
    assert [w["index"] for w in result.worst] == [0, 1, 2, 3]
    assert all(torch.equal(point[0], same[0]) for point in result.worst_points)


def _engine_over(lo: int, hi: int, values: dict[str, torch.Tensor], x: torch.Tensor) -> SafeRadiusEngine:
    engine = SafeRadiusEngine(worst=3, input_shape=(2, 3), dtype="float32")
    engine.update(lo, {k: v[lo:hi] for k, v in values.items()}, gated=values["certified"][lo:hi], x=x[lo:hi],
                  x_hat=x[lo:hi] + 1, s_hat=values["s"][lo:hi], dist=values["q"][lo:hi])
    return engine


def test_engine_merge_payload_and_the_worst_points() -> None:
    gen = torch.Generator().manual_seed(5)
    values = {name: (torch.rand(10, generator=gen, dtype=torch.float64) * 5).to(dtype) for name, dtype in
              PER_INPUT.items()}
    values["applicable"] = torch.arange(10) != 2
    x = torch.rand(10, 2, 3, generator=gen)
    whole = _engine_over(0, 10, values, x)
    halves = _engine_over(0, 4, values, x).merge(_engine_over(4, 10, values, x))
    back = Engine.from_payload(json.loads(json.dumps(whole.state_payload())))
    for other in (halves, back):
        for name in (*PER_INPUT, "worst_rows", "no_certificate", "no_pgd"):
            assert torch.equal(getattr(other, name), getattr(whole, name)), name
    rows = whole.compute()["worst_rows"]
    order = torch.where(values["applicable"], values["certified"], math.inf).argsort(stable=True)[:3]
    assert rows[:, 1].long().tolist() == order.tolist()
    points = whole.worst_points(rows)
    assert [tuple(p.shape) for p, _ in points] == [(2, 3)] * 3 and points[0][0].dtype == torch.float32
    assert all(torch.equal(p, x[i]) and torch.equal(h, x[i] + 1) for (p, h), i in zip(points, order.tolist()))
    missing = SafeRadiusEngine()
    missing.update(0, {**values, "certified": None, "pgd": None})
    out = missing.compute()
    assert out["no_certificate"] and out["no_pgd"] and out["n"] == 10 and out["worst_rows"] is None
    assert bool(out["certified"].isnan().all()) and bool(out["pgd"].isinf().all())


def _rank_quantify(rank: int, world: int) -> dict[str, Any]:
    x, y = _data()
    out: dict[str, Any] = {}
    loader = torch.utils.data.DataLoader(OneAtATime(x, y), batch_size=3)
    estimate = (*OPTIONS[:2], None, GatedRadius("estimate", quantile=0.5, worst=4))
    for name, data, batch_size, options in (("tensors", (x, y), 4, OPTIONS), ("loader", loader, 3, OPTIONS),
                                            ("estimate", (x, y), 4, estimate)):
        shard = ranks.batch_shard(data, batch_size)
        assert shard is not None and shard.world_size == world
        out[name] = _plain(quantify_safety(_net(), data, *options, batch_size=batch_size, shard=shard))
        out[name + "_rows"] = list(shard.rows)
        if rank == 0:  # the single-process values, in this process (no collective without a shard)
            out[name + "_single"] = _plain(quantify_safety(_net(), data, *options, batch_size=batch_size))
    return out


@pytest.mark.skipif(not GLOO_AVAILABLE, reason="torch.distributed with gloo is not available")
def test_two_gloo_ranks_on_their_shards_give_the_single_process_result() -> None:
    results = run_on_gloo_ranks(_rank_quantify, 2)
    assert results[1]["tensors_rows"][0] > 0  # the work was split
    for name in ("tensors", "loader", "estimate"):
        single = results[0][name + "_single"]
        assert single["n"] == N and single["worst"]
        for result in results:
            assert result[name] == single, name
