"""Progress ticks of the long loops (issue #8): the reliability Monte Carlo and the activation capture."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from pytest_dnnsafety.runtime import progress
from pytest_dnnsafety.engines.core.capture import capture
from pytest_dnnsafety.engines.reliability import BLOCK, ReliabilityAssessor, ReliabilityOptions, ReliabilityWarning


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, str]]:
    seen: list[tuple[int, int, str]] = []

    def record(done: int, total: int, unit: str = "") -> None:
        assert type(done) is int and type(total) is int  # host ints, no tensors
        seen.append((done, total, unit))

    monkeypatch.setattr(progress, "tick", record)
    return seen


def _assessor(**options) -> ReliabilityAssessor:
    gen = torch.Generator().manual_seed(0)
    op = torch.rand(300, 2, generator=gen, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReliabilityWarning)
        return ReliabilityAssessor(op, options=ReliabilityOptions.of(eps=0.05, box=([0, 0], [1, 1]), samples_per_cell=50,
                                                                     bootstrap=0, **options))


def _model(x: torch.Tensor) -> torch.Tensor:
    return (x[:, 0] >= 0.5).long()


def test_reliability_ticks_once_per_batch_in_queries(ticks: list) -> None:
    assessor = _assessor(batch_size=2 * BLOCK)  # 400 cells × 50 = 20,000 queries: 5 blocks, 3 batches
    assessor.sample(_model)
    total = assessor.total_samples
    assert total == 20_000 and assessor.queries == total
    assert ticks == [(2 * BLOCK, total, "queries"), (4 * BLOCK, total, "queries"), (total, total, "queries")]


def test_reliability_ticks_count_this_ranks_share(ticks: list) -> None:
    assessor = _assessor(batch_size=BLOCK)
    assessor.sample(_model, rank=1, world_size=2)  # blocks 2..4 of 5
    share = assessor.total_samples - 2 * BLOCK
    assert [t[0] for t in ticks] == [BLOCK, 2 * BLOCK, share] and {t[1] for t in ticks} == {share}


def test_reliability_ticks_with_auto_batches_end_at_the_total(ticks: list) -> None:
    assessor = _assessor()
    result = assessor.finish(assessor.sample(_model), model_queries=assessor.queries)
    assert ticks and ticks[-1] == (result.model_queries, result.model_queries, "queries")
    assert [t[0] for t in ticks] == sorted(t[0] for t in ticks)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.lin(x)))


def test_capture_ticks_once_per_batch_in_inputs(ticks: list) -> None:
    x = torch.randn(25, 3, generator=torch.Generator().manual_seed(0))
    capture(_Net(), (x, torch.zeros(25, dtype=torch.long)), ["lin"], batch_size=10)
    assert ticks == [(10, 25, "inputs"), (20, 25, "inputs"), (25, 25, "inputs")]


def test_capture_ticks_with_a_loader_and_unknown_lengths(ticks: list) -> None:
    x = torch.randn(25, 3, generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=8)
    capture(_Net(), loader, ["lin"])
    assert ticks == [(8, 25, "inputs"), (16, 25, "inputs"), (24, 25, "inputs"), (25, 25, "inputs")]

    class Stream(torch.utils.data.IterableDataset):  # no length: the total is unknown (0)
        def __iter__(self):
            return iter(x)

    ticks.clear()
    capture(_Net(), torch.utils.data.DataLoader(Stream(), batch_size=10), ["lin"])
    assert ticks == [(10, 0, "inputs"), (20, 0, "inputs"), (25, 0, "inputs")]


def test_progress_lines_from_a_real_reporter() -> None:
    """End to end with the progress module's reporter (a fake clock makes every tick show)."""
    lines: list[str] = []
    clock = iter(float(i) for i in range(0, 1000, 10))
    with progress.active("pmi", lines.append, tty=False, min_seconds=0, interval=0, clock=lambda: next(clock)):
        _assessor(batch_size=2 * BLOCK).sample(_model)
    assert lines[0].startswith("pmi: 41% 8192/20000 queries")
    assert any("100% 20000/20000 queries" in line for line in lines)
