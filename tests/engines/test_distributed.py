"""Engine.sync over a real 2-rank torch.distributed (gloo) group equals one process's result."""

from __future__ import annotations

import datetime
import json
import socket
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pytest_dnnsafety.engines import Engine, ScenarioCoverageEngine

CARDS = [4, 3, 5, 2, 3]
ROWS = 1001  # odd: the ranks get unequal halves

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2024)
    codes = torch.stack([torch.randint(0, c, (ROWS,), generator=gen) for c in CARDS], dim=1)
    feasible = torch.rand(ScenarioCoverageEngine(CARDS, k=3).total_cells, generator=gen) > 0.1
    return codes, feasible


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank: count its share of the rows, sync, write the synced payloads for the parent."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30)
    )
    try:
        codes, feasible = _data()
        share = codes.tensor_split(world)[rank]
        engine = ScenarioCoverageEngine(CARDS, k=3, min_count=2, feasible=feasible)
        engine.update(share)
        engine.sync()
        flags = _FlagEngine()
        flags.update(torch.tensor([float(rank + 1), -float(rank + 1), float(rank)]))
        flags.sync()
        result = {"scenario": engine.state_payload(), "flags": flags.state_payload()}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


class _FlagEngine(Engine):
    """Every reduce rule, to check the ops that sync maps them to."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__(device)
        self.add_state("total", torch.zeros(3), reduce="sum")
        self.add_state("high", torch.full((3,), -1e9), reduce="max")
        self.add_state("low", torch.full((3,), 1e9), reduce="min")
        self.add_state("any_positive", torch.zeros(3, dtype=torch.bool), reduce="or")
        self.add_state("all_positive", torch.ones(3, dtype=torch.bool), reduce="and")

    def update(self, x: torch.Tensor) -> None:
        self.total += x
        self.high = torch.maximum(self.high, x)
        self.low = torch.minimum(self.low, x)
        self.any_positive |= x > 0
        self.all_positive &= x > 0

    def compute(self) -> dict[str, list]:
        return {name: state.tolist() for name, state in self.states().items()}


def test_two_gloo_ranks_sync_to_the_single_process_result() -> None:
    world = 2
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_worker, args=(world, _free_port(), out_dir), nprocs=world, join=True)
        results = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world)]

    codes, feasible = _data()
    single = ScenarioCoverageEngine(CARDS, k=3, min_count=2, feasible=feasible)
    single.update(codes)
    expected = single.compute()
    for result in results:
        synced = ScenarioCoverageEngine.from_payload(result["scenario"])
        assert torch.equal(synced.counts, single.counts)
        out = synced.compute()
        assert int(out.covered) == int(expected.covered) and int(out.total) == int(expected.total)

    flags = [_FlagEngine.from_payload(result["flags"]).compute() for result in results]
    assert flags[0] == flags[1] == {
        "total": [3.0, -3.0, 1.0],
        "high": [2.0, -1.0, 1.0],
        "low": [1.0, -2.0, 0.0],
        "any_positive": [True, False, True],
        "all_positive": [True, False, False],
    }
