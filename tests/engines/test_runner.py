"""The engine runner (``engines/runner.py``): the one batch loop every family measures through.

Batches from every accepted data form carry their global index and first row; a DataLoader over
a map-style dataset is read item by item through the loader (never indexed with a slice), and
under a torchrun :class:`~pytest_dnnsafety.runtime.torchrun.Shard` only this rank's items are loaded; the
deferred checks (NaN inputs, non-integer labels, a step's own flags, the forward guard) raise after
the loop naming the first bad batch; labels are required, optional or ignored; progress ticks
count the inputs; and ``run`` on two gloo ranks gives the single-process engine state.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from _gloo import GLOO_AVAILABLE, run_on_gloo_ranks

from pytest_dnnsafety.runtime import progress
from pytest_dnnsafety.runtime import torchrun as ranks
from pytest_dnnsafety.engines import Engine
from pytest_dnnsafety.engines.core.runner import Batch, Runner
from pytest_dnnsafety.errors import DataError, MetricError
from pytest_dnnsafety.runtime.torchrun import Shard

N, BS = 23, 5  # 5 batches: 4 of 5 rows and one of 3


def _x(n: int = N) -> torch.Tensor:
    return torch.arange(n * 2, dtype=torch.float32).reshape(n, 2)


def _y(n: int = N) -> torch.Tensor:
    return torch.arange(n) % 3


class Items(torch.utils.data.Dataset):
    """A map-style dataset that must be read one item at a time (a streaming source); counts its reads."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        self.x, self.y, self.reads = x, y, []

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, index: Any) -> Any:
        if not isinstance(index, int):
            raise TypeError(f"Items is read one item at a time, got {type(index).__name__} {index!r}")
        self.reads.append(index)
        return self.x[index] if self.y is None else (self.x[index], self.y[index])


def _loader(dataset: Any, batch_size: int = BS) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)


def _collect(runner: Runner, data: Any) -> list[Batch]:
    return list(runner.batches(data))


FORMS = {
    "tensor": lambda: _x(),
    "pair": lambda: (_x(), _y()),
    "dict": lambda: {"x": _x(), "y": _y()},
    "tensordataset": lambda: torch.utils.data.TensorDataset(_x(), _y()),
    "dataloader": lambda: _loader(torch.utils.data.TensorDataset(_x(), _y())),
    "map_dataset_loader": lambda: _loader(Items(_x(), _y())),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_batches_from_every_data_form(form: str) -> None:
    runner = Runner("test", batch_size=BS)
    batches = _collect(runner, FORMS[form]())
    assert [b.index for b in batches] == [0, 1, 2, 3, 4]
    assert [b.start for b in batches] == [0, 5, 10, 15, 20] and [b.n for b in batches] == [5, 5, 5, 5, 3]
    assert torch.equal(torch.cat([b.x for b in batches]), _x())
    assert all(b.x.dtype == torch.float32 for b in batches)
    assert torch.equal(torch.cat([b.rows for b in batches]), torch.arange(N))
    if form == "tensor":
        assert all(b.y is None for b in batches) and runner.labelled is False
    else:
        assert torch.equal(torch.cat([b.y for b in batches]), _y()) and batches[0].y.dtype == torch.int64
        assert runner.labelled is True
    assert (runner.n_batches, runner.n_inputs) == (5, N)
    runner.check()


def test_integer_inputs_become_float_and_integral_float_labels_int64() -> None:
    loader = _loader(torch.utils.data.TensorDataset(torch.arange(6, dtype=torch.uint8).reshape(3, 2),
                                                    torch.tensor([0.0, 2.0, 1.0])), batch_size=2)
    runner = Runner("test")
    batches = _collect(runner, loader)
    runner.check()
    assert batches[0].x.dtype == torch.float32 and batches[0].y.dtype == torch.int64
    assert torch.cat([b.y for b in batches]).tolist() == [0, 2, 1]


def test_a_map_style_dataset_is_read_item_by_item_once() -> None:
    items = Items(_x(), _y())
    runner = Runner("test")
    _collect(runner, _loader(items))
    runner.check()
    assert items.reads == list(range(N))  # one read per item, in order, never a slice or a list


def test_the_loaders_own_batch_size_wins() -> None:
    runner = Runner("test", batch_size=100)
    assert [b.n for b in _collect(runner, _loader(torch.utils.data.TensorDataset(_x()), batch_size=7))] == [7, 7, 7, 2]


def test_a_shuffling_loader_is_refused() -> None:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_x()), batch_size=BS, shuffle=True)
    with pytest.raises(DataError, match="the DataLoader shuffles"):
        _collect(Runner("test"), loader)


# ------------------------------------------------------------------------------ a torchrun shard
def _shard(rank: int, data: Any, batch_size: int = BS) -> Shard:
    """Rank ``rank`` of 2's shard, as :func:`ranks.batch_shard` cuts it (without a process group)."""
    step = data.batch_size if isinstance(data, torch.utils.data.DataLoader) else batch_size
    n_batches = -(-N // step)
    mine = ranks.shard(n_batches, rank, 2)
    return Shard(rank=rank, world_size=2, batches=(mine.start, mine.stop),
                 rows=(mine.start * step, min(N, mine.stop * step)), n_rows=N)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_shard_yields_its_batches_with_their_global_index_and_start(form: str) -> None:
    seen = []
    for rank in (0, 1):
        data = FORMS[form]()
        shard = _shard(rank, data)
        runner = Runner("test", batch_size=BS, shard=shard)
        batches = _collect(runner, data)
        runner.check()
        assert batches[0].index == shard.batches[0] and batches[0].start == shard.rows[0]
        assert runner.n_inputs == shard.n_local
        seen += [(b.index, b.start, b.n) for b in batches]
        assert torch.equal(torch.cat([b.x for b in batches]), _x()[shard.row_slice])
    assert seen == [(0, 0, 5), (1, 5, 5), (2, 10, 5), (3, 15, 5), (4, 20, 3)]  # ranks 0 and 1 together: the whole


def test_a_dataloader_shard_loads_only_its_own_items() -> None:
    for rank, expected in ((0, range(0, 10)), (1, range(10, N))):
        items = Items(_x(), _y())
        loader = _loader(items)
        shard = _shard(rank, loader)
        runner = Runner("test", shard=shard)
        batches = _collect(runner, loader)
        runner.check()
        assert items.reads == list(expected)  # the other rank's items are never read
        assert [b.index for b in batches] == list(range(*shard.batches))


def test_an_iterable_dataset_shard_skips_the_other_ranks_batches() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(_x())

    loader = torch.utils.data.DataLoader(Stream(), batch_size=BS)
    shard = Shard(rank=1, world_size=2, batches=(2, 5), rows=(10, N), n_rows=N)
    batches = _collect(Runner("test", shard=shard), loader)
    assert [(b.index, b.start) for b in batches] == [(2, 10), (3, 15), (4, 20)]
    assert torch.equal(torch.cat([b.x for b in batches]), _x()[10:])


# ------------------------------------------------------------------------------ deferred checks
def test_nan_inputs_are_flagged_after_the_loop_naming_the_first_bad_batch() -> None:
    x = _x()
    x[12, 0] = float("nan")  # batch 2
    x[21, 1] = float("inf")  # batch 4
    runner = Runner("my pass", batch_size=BS)
    batches = _collect(runner, _loader(torch.utils.data.TensorDataset(x)))  # the loop itself does not raise
    assert len(batches) == 5
    with pytest.raises(DataError, match=r"^my pass: the inputs hold NaN/inf in 2 batch\(es\), the first being "
                                        r"batch 2\. Fix: clean or impute"):
        runner.check()


def test_a_steps_own_flag_names_its_count_and_first_batch() -> None:
    runner = Runner("my pass", batch_size=BS)

    def step(batch: Batch) -> None:
        runner.flag("big", batch.x > 30, batch, "my pass: {count} batch(es) too big, the first being batch {first}")

    with pytest.raises(MetricError, match=r"^my pass: 2 batch\(es\) too big, the first being batch 3$"):
        runner.run(_x(), step)  # rows 15.. hold values above 30: batches 3 and 4


def test_the_input_check_can_be_turned_off() -> None:
    x = _x()
    x[0, 0] = float("nan")
    runner = Runner("test", check_inputs=False)
    _collect(runner, _loader(torch.utils.data.TensorDataset(x)))
    runner.check()


def test_the_guard_is_checked_by_the_runner() -> None:
    def model(x: torch.Tensor) -> torch.Tensor:
        return torch.where(x[:, :1] > 40, torch.full((x.shape[0], 3), float("nan")), torch.zeros(x.shape[0], 3))

    runner = Runner("my pass", batch_size=BS)
    guard = runner.guard("my pass: model")
    with pytest.raises(MetricError, match=r"^my pass: model: the model's outputs hold NaN/inf in 2 of 23 inputs; the "
                                          r"first bad batch is batch 4"):
        runner.run(_x(), lambda batch: guard(model, batch.x))


def test_observed_ranges() -> None:
    runner = Runner("test", batch_size=BS)
    assert runner.range("x") is None
    runner.run(_x(), lambda batch: runner.observe_range("x", batch.x))
    assert runner.range("x") == (0.0, float(2 * N - 1))


# ------------------------------------------------------------------------------ labels
def test_required_labels_refuse_unlabelled_data() -> None:
    with pytest.raises(DataError, match=r"^test: the data have no labels \(batch 0\)\. Fix: give labelled data"):
        _collect(Runner("test", labels="required"), _x())


def test_ignored_labels_are_dropped() -> None:
    runner = Runner("test", labels="ignored", batch_size=BS)
    assert all(b.y is None for b in _collect(runner, (_x(), _y())))


def test_non_integer_float_labels_are_a_data_error_naming_the_first_bad_batch() -> None:
    y = _y().to(torch.float32)
    y[7] = 0.5  # batch 1
    runner = Runner("test", batch_size=BS)
    _collect(runner, _loader(torch.utils.data.TensorDataset(_x(), y)))
    with pytest.raises(DataError, match=r"^test: the labels are not integer class indices in 1 batch\(es\), the "
                                        r"first being batch 1"):
        runner.check()


def test_labels_of_the_wrong_length_are_refused() -> None:
    def collate(rows):
        x = torch.stack([r[0] for r in rows])
        return x, torch.zeros(x.shape[0] + 1, dtype=torch.long)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_x(), _y()), batch_size=BS, collate_fn=collate)
    with pytest.raises(DataError, match=r"batch 0 has 5 inputs but labels of shape \(6,\)"):
        _collect(Runner("test"), loader)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="batch_size=0 is not a positive integer"):
        Runner("test", batch_size=0)
    with pytest.raises(ValueError, match="labels='maybe'"):
        Runner("test", labels="maybe")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ empty data, progress
def test_empty_data_is_a_data_error() -> None:
    runner = Runner("my pass")
    with pytest.raises(DataError, match=r"^my pass: no inputs: the data set is empty"):
        runner.run(_loader(torch.utils.data.TensorDataset(torch.zeros(0, 2))), lambda batch: None)
    with pytest.raises(DataError, match="no samples"):  # tensors are refused when read
        Runner("my pass").run(torch.zeros(0, 2), lambda batch: None)


def test_progress_ticks_count_the_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks: list[tuple[int, int, str]] = []
    monkeypatch.setattr(progress, "tick", lambda done, total, unit="": ticks.append((done, total, unit)))
    Runner("test", batch_size=10, unit="images").run(_x(), lambda batch: None)
    assert ticks == [(10, N, "images"), (20, N, "images"), (N, N, "images")]
    ticks.clear()
    Runner("test", batch_size=BS, shard=_shard(1, _x())).run_local(_x(), lambda batch: None)  # the rank's share is its total
    assert ticks == [(5, 13, "inputs"), (10, 13, "inputs"), (13, 13, "inputs")]


def test_the_model_device_wins() -> None:
    model = torch.nn.Linear(2, 3)
    assert Runner("test", model=model, device="meta").device == torch.device("cpu")
    assert Runner("test", model=lambda x: x, device="cpu").device == torch.device("cpu")


# ------------------------------------------------------------------------------ two gloo ranks
class _Sum(Engine):
    """Row count, sum of the inputs and a per-label histogram: sum states."""

    def __init__(self) -> None:
        super().__init__()
        self.add_state("n", torch.zeros((), dtype=torch.int64), "sum")
        self.add_state("total", torch.zeros((), dtype=torch.float64), "sum")
        self.add_state("hist", torch.zeros(3, dtype=torch.int64), "sum")
        self.add_state("largest_row", torch.zeros((), dtype=torch.int64), "max")

    def update(self, batch: Batch) -> None:
        self.n += batch.n
        self.total += batch.x.sum(dtype=torch.float64)
        self.hist += torch.bincount(batch.y, minlength=3)
        self.largest_row = torch.maximum(self.largest_row, batch.rows.max())

    def compute(self) -> dict[str, Any]:
        return {"n": int(self.n), "total": float(self.total), "hist": self.hist.tolist(),
                "largest_row": int(self.largest_row)}


def _pass(data: Any, shard: Shard | None) -> dict[str, Any]:
    engine = _Sum()
    runner = Runner("sum", batch_size=BS, shard=shard)
    starts: list[int] = []

    def step(batch: Batch) -> None:
        starts.append(batch.start)
        engine.update(batch)

    runner.run(data, step, engine)
    return {**engine.compute(), "starts": starts}


def _rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for form in ("pair", "map_dataset_loader"):
        data = FORMS[form]()
        shard = ranks.batch_shard(data, BS)
        out[form] = _pass(data, shard)
        out[form]["shard"] = None if shard is None else list(shard.rows)
    bad = _x()
    bad[17, 0] = float("nan")  # rank 1's rows only (10..22)
    try:
        _pass(_loader(torch.utils.data.TensorDataset(bad, _y())), ranks.batch_shard(bad, BS))
    except Exception as exc:  # noqa: BLE001 - reported back to the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.skipif(not GLOO_AVAILABLE, reason="torch.distributed with gloo is not available")
def test_two_gloo_ranks_run_their_shards_and_sync_to_the_single_process_state() -> None:
    results = run_on_gloo_ranks(_rank, 2)
    for form in ("pair", "map_dataset_loader"):
        single = json.loads(json.dumps(_pass(FORMS[form](), None)))
        assert results[0][form]["shard"] == [0, 10] and results[1][form]["shard"] == [10, N]
        assert results[0][form]["starts"] == [0, 5] and results[1][form]["starts"] == [10, 15, 20]
        for result in results:
            synced = {k: v for k, v in result[form].items() if k not in ("starts", "shard")}
            assert synced == {k: v for k, v in single.items() if k != "starts"}
    # a NaN in rank 1's shard: rank 1 raises its own error, rank 0 is told (no rank waits in the all-reduce)
    assert results[1]["error"].startswith("DataError: sum: the inputs hold NaN/inf in 1 batch(es), the first being "
                                          "batch 3")
    assert results[0]["error"].startswith("MetricError: rank 1 of 2 failed on its shard: DataError: sum: the inputs "
                                          "hold NaN/inf")
