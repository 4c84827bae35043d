"""The one batch loop: every engine family measures through a :class:`Runner`.

A family supplies only its per-batch *step*; the runner owns everything around it:

* **batches** from any accepted data form (tensors, ``(x, y)``, dicts, ``TensorDataset``,
  ``DataLoader``) without materialising the data set: tensors are sliced, a ``DataLoader`` is
  iterated as it is (its own batch size wins; it must read in order, see
  :func:`pytest_dnnsafety.data.forms.iter_batches`), so a loader over a data set larger than memory
  streams through;
* **device copies**: inputs go to the model's device (``device`` for a model without
  parameters), asynchronously towards an accelerator, cast to floating point; labels to int64;
* **deferred checks**: inputs that hold NaN/inf, non-integer labels and every check a step adds
  with :meth:`Runner.flag` are kept as on-device counters (count and first bad batch) and read
  once after the loop, so nothing syncs to the host per batch; the same for
  :meth:`Runner.observe_range` (running min/max, e.g. of the inputs against a clip range);
* **the forward guard**: :meth:`Runner.guard` hands out
  :class:`~pytest_dnnsafety.engines.core.guard.ForwardGuard` objects that :meth:`Runner.finish` checks;
* **progress ticks** (host-side row counts, no sync);
* **torchrun sharding**: with a :class:`~pytest_dnnsafety.runtime.torchrun.Shard` the runner forwards only
  this rank's batches (a ``DataLoader`` over a map-style dataset is re-cut to the rank's rows, so
  the other ranks' batches are never loaded), with their *global* batch index and first row, so
  per-batch seeds and per-input indices equal the single-process run's; after the loop the ranks
  agree that every shard succeeded (:func:`pytest_dnnsafety.runtime.torchrun.together`) and the engines'
  states are all-reduced (:meth:`~pytest_dnnsafety.engines.core.base.Engine.sync`).

Typical use::

    runner = Runner("adversarial confidence", model=model, device=device, batch_size=bs, shard=shard)
    guard = runner.guard("adversarial confidence: model on clean inputs")

    def step(batch):
        out = guard(model, batch.x)
        engine.update(out, batch.y)

    runner.run(data, step, engine)      # loop, checks, agreement, sync

This module imports nothing from pytest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from pytest_dnnsafety.runtime import allocator
from pytest_dnnsafety.runtime import progress
from pytest_dnnsafety.data.forms import check_loader_order, iter_batches, known_length
from pytest_dnnsafety.errors import DataError, MetricError
from pytest_dnnsafety.data.tasks import BoxSet, bad_boxes
from pytest_dnnsafety.engines.core import budget as _budget  # noqa: F401 - its import warms the memory probe

__all__ = ["Batch", "Runner", "model_device"]

_NONE = 2**62  # "no bad batch yet" (min-reduced)

Labels = Literal["optional", "required", "ignored"]


@dataclass(frozen=True)
class Batch:
    """One batch of a pass: its global position and its tensors on the runner's device.

    ``index``: the batch's index in the whole (unsharded) pass; ``start``: the data row of its first
    input; ``x``: floating-point inputs; ``y``: int64 labels, or None (unlabelled data, or labels
    ``"ignored"``).
    """

    index: int
    start: int
    x: Tensor
    y: Tensor | None

    @property
    def n(self) -> int:
        return int(self.x.shape[0])

    @property
    def rows(self) -> Tensor:
        """The global data row of each input, on the batch's device (``arange(start, start + n)``)."""
        return torch.arange(self.start, self.start + self.n, device=self.x.device)


def model_device(model: Any, fallback: torch.device | str = "cpu") -> torch.device:
    """The device of the model's first parameter or buffer, else ``fallback``."""
    if isinstance(model, torch.nn.Module):
        for tensor in (*model.parameters(), *model.buffers()):
            return tensor.device
    return torch.device(fallback)


class _Flag:
    __slots__ = ("message", "count", "first")

    def __init__(self, message: str, device: torch.device) -> None:
        self.message = message
        self.count = torch.zeros((), dtype=torch.int64, device=device)
        self.first = torch.full((), _NONE, dtype=torch.int64, device=device)


class Runner:
    """One pass's batch loop (see the module docstring).

    ``what`` names the pass in messages. ``labels``: ``"required"`` (an unlabelled batch is a
    :class:`DataError`), ``"optional"`` or ``"ignored"`` (labels are dropped; e.g. a monitor's
    unlabelled reference). ``shard``: this rank's share of the batches (``None``: all of them).
    ``unit``: what :func:`pytest_dnnsafety.runtime.progress.tick` counts. ``task``: the labels' form is checked
    for it (``single-label``: ``(n,)`` class indices; ``multi-label``: ``(n, classes)`` 0/1; ``detection``:
    boxes per image), one check for every family instead of one per step; ``None``: any form.
    """

    def __init__(self, what: str, *, model: Any = None, device: torch.device | str = "cpu", batch_size: int = 256,
                 labels: Labels = "optional", shard: Any = None, unit: str = "inputs",
                 check_inputs: bool = True, task: str | None = None) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"{what}: batch_size={batch_size!r} is not a positive integer")
        if labels not in ("optional", "required", "ignored"):
            raise ValueError(f"{what}: labels={labels!r} is not one of 'optional', 'required', 'ignored'")
        self.what = what
        self.batch_size = batch_size
        self.labels = labels
        self.shard = shard
        self.unit = unit
        self.check_inputs = check_inputs
        self.task = task
        self.device = model_device(model, device)
        self.guards: list[Any] = []
        self._flags: dict[str, _Flag] = {}
        self._ranges: dict[str, list[Tensor]] = {}
        self.n_batches = 0
        self.n_inputs = 0
        self.labelled: bool | None = None

    # ------------------------------------------------------------------ services for steps
    def guard(self, what: str | None = None, **kwargs: Any) -> Any:
        """A :class:`~pytest_dnnsafety.engines.core.guard.ForwardGuard` that :meth:`finish` checks."""
        from pytest_dnnsafety.engines.core.guard import ForwardGuard

        guard = ForwardGuard(what or f"{self.what}: model on the inputs", **kwargs)
        self.guards.append(guard)
        return guard

    def flag(self, name: str, bad: Tensor, batch: Batch | int, message: str) -> None:
        """Record, without a host sync, whether this batch is bad by check ``name``.

        ``bad``: a boolean tensor (any shape; the batch is bad when any element is true).
        ``message``: the error raised by :meth:`finish` when some batch was bad, with the fields
        ``{count}`` (bad batches) and ``{first}`` (the first bad batch's global index).
        """
        index = batch.index if isinstance(batch, Batch) else int(batch)
        entry = self._flags.get(name)
        hit = bad.any() if bad.dim() else bad
        if entry is None:
            entry = self._flags[name] = _Flag(message, hit.device)
        hit = hit.to(entry.count.device)
        entry.count += hit.to(torch.int64)
        entry.first = torch.where(hit, torch.minimum(entry.first, torch.full_like(entry.first, index)), entry.first)

    def observe_range(self, name: str, values: Tensor) -> None:
        """Keep the running min and max of ``values`` (on the device), read by :meth:`range`."""
        lo, hi = values.detach().amin().to(torch.float64), values.detach().amax().to(torch.float64)
        current = self._ranges.get(name)
        self._ranges[name] = [lo, hi] if current is None else [torch.minimum(current[0], lo.to(current[0].device)),
                                                                torch.maximum(current[1], hi.to(current[1].device))]

    def range(self, name: str) -> tuple[float, float] | None:
        """The (min, max) seen by :meth:`observe_range` under ``name`` (one host sync), or None."""
        current = self._ranges.get(name)
        if current is None:
            return None
        lo, hi = torch.stack(current).tolist()
        return float(lo), float(hi)

    # ------------------------------------------------------------------ the loop
    def batches(self, data: Any) -> Iterator[Batch]:
        """This rank's batches of ``data`` on the runner's device (see the module docstring)."""
        total = self.shard.n_local if self.shard is not None else (known_length(data) or 0)
        first, stop = (0, None) if self.shard is None else self.shard.batches
        source, index, start = _source(data, self.batch_size, self.shard), first, 0
        if self.shard is not None:
            start = self.shard.rows[0]
        accel = self.device.type != "cpu"
        for x, y in source:
            if stop is not None and index >= stop:
                break
            n = int(x.shape[0])
            x = x.to(self.device, non_blocking=accel)
            if not x.is_floating_point():
                x = x.to(torch.float32)
            if self.check_inputs and x.numel():
                lo, hi = torch.aminmax(x)  # one fused pass (NaN propagates, ±inf shows), no bool copy of the batch
                self.flag("inputs", ~(torch.isfinite(lo) & torch.isfinite(hi)), index,
                          f"{self.what}: the inputs hold NaN/inf in {{count}} batch(es), the first being batch "
                          "{first}. Fix: clean or impute the inputs before evaluating.")
            y = self._labels(y, n, index)
            batch = Batch(index=index, start=start, x=x, y=y)
            yield batch
            index += 1
            start += n
            self.n_batches += 1
            self.n_inputs += n
            if self.n_batches % allocator.EVERY == 0:  # freed batches back to the system (no device sync)
                allocator.release()
            progress.tick(self.n_inputs, total, self.unit)

    def _labels(self, y: Any, n: int, index: int) -> Tensor | None:
        if self.labels == "ignored":
            return None
        if y is None:
            if self.labels == "required":
                raise DataError(f"{self.what}: the data have no labels (batch {index}). Fix: give labelled data "
                                f"(x, y).")
            self.labelled = False
            return None
        if self.task is not None and (isinstance(y, BoxSet) != (self.task == "detection")
                                      or (not isinstance(y, BoxSet)
                                          and torch.as_tensor(y).dim() != (2 if self.task == "multi-label" else 1))):
            form = ("boxes per image" if isinstance(y, BoxSet)
                    else f"labels of shape {tuple(torch.as_tensor(y).shape)}")
            expected = {"single-label": "one class index per input, shape (n,)",
                        "multi-label": "a (n, classes) 0/1 matrix",
                        "detection": "boxes and labels per image"}[self.task]
            raise DataError(f"{self.what}: batch {index} has {form} for {n} inputs; the task is {self.task!r}, "
                            f"which needs {expected}. Fix: give labels of that form, or set dnnsafety_task (marker "
                            f"keyword task=) to the data's task.")
        if isinstance(y, BoxSet):  # detection targets: packed boxes of the batch's images
            if y.n_images != n:
                raise DataError(f"{self.what}: batch {index} has {n} images but targets for {y.n_images}. Fix: give "
                                f"one target dict per image.")
            if self.labelled is None:
                self.labelled = True
            y = y.to(self.device, non_blocking=self.device.type != "cpu")
            self.flag("boxes", bad_boxes(y), index,
                      f"{self.what}: the target boxes are not finite, have x2 < x1 or y2 < y1, or a negative class in "
                      "{count} batch(es), the first being batch {first}. Fix: give boxes as x1, y1, x2, y2 pixels "
                      "and class indices >= 0.")
            return y  # type: ignore[return-value]
        y = torch.as_tensor(y)
        if y.dim() == 0 or y.shape[0] != n:
            raise DataError(f"{self.what}: batch {index} has {n} inputs but labels of shape {tuple(y.shape)}. Fix: "
                            f"give one label per input.")
        if self.labelled is None:
            self.labelled = True
        y = y.to(self.device, non_blocking=self.device.type != "cpu")
        if y.is_floating_point():
            self.flag("labels", ~torch.isfinite(y) | (y != y.round()), index,
                      f"{self.what}: the labels are not integer class indices in {{count}} batch(es), the first "
                      "being batch {first}. Fix: give class indices (0, 1, ...) as labels.")
            y = torch.nan_to_num(y)
        if y.dim() == 2:  # multi-label: a (batch, classes) 0/1 matrix
            self.flag("labels", (y != 0) & (y != 1), index,
                      f"{self.what}: the multi-label labels are not 0/1 in {{count}} batch(es), the first being batch "
                      "{first}. Fix: give a (N, classes) matrix of 0 and 1.")
        return y.to(torch.int64)

    def check(self) -> None:
        """Raise on an empty pass, on a bad flag and on a guard's NaN/inf (one host sync)."""
        if self.n_batches == 0:
            raise DataError(f"{self.what}: no inputs: the data set is empty. Fix: provide evaluation data with at "
                            f"least one sample.")
        if self._flags:
            values = torch.stack([torch.stack([f.count.cpu(), f.first.cpu()]) for f in self._flags.values()]).tolist()
            for (name, entry), (count, first) in zip(self._flags.items(), values):
                if count:
                    error = DataError if name in ("inputs", "labels", "boxes") else MetricError
                    raise error(entry.message.format(count=count, first=first))
        for guard in self.guards:
            guard.check()

    def run(self, data: Any, step: Callable[[Batch], None], *engines: Any) -> None:
        """``step`` on every batch, then :meth:`check`; sharded: agreement and the engines' ``sync``.

        Without a shard it is the loop and the checks. With one, every rank runs its share and the
        checks inside :func:`pytest_dnnsafety.runtime.torchrun.together` (a rank that fails tells the others,
        so none waits in a collective), then every engine is all-reduced. An engine the step builds
        on its first batch (it needs the class count or the input shape) is given as a function
        returning it, called after the loop.
        """
        if self.shard is None:
            self.run_local(data, step)
            return
        from pytest_dnnsafety.runtime import torchrun as ranks

        ranks.together(lambda: self.run_local(data, step))
        for engine in engines:
            (engine() if callable(engine) else engine).sync()

    def run_local(self, data: Any, step: Callable[[Batch], None]) -> None:
        """``step`` on this rank's batches, then :meth:`check`: no agreement between the ranks, no ``sync``.

        For a pass whose per-rank results the caller merges itself (the shared activation pass:
        every gate reading it agrees and all-reduces its own engine, see
        :func:`pytest_dnnsafety.runtime.torchrun.merged`).
        """
        for batch in self.batches(data):
            step(batch)
        self.check()


def _source(data: Any, batch_size: int, shard: Any) -> Iterator[tuple[Tensor, Any]]:
    """``(x, y)`` batches of ``data``; with a shard, starting at its first batch without loading the others."""
    if shard is not None and isinstance(data, torch.utils.data.DataLoader):
        sub = _rank_loader(data, shard)
        if sub is not None:
            return iter_batches(sub, batch_size)
        return _skip(iter_batches(data, batch_size), shard.batches[0])
    if shard is not None:
        return _skip(iter_batches(data, batch_size), shard.batches[0])
    return iter_batches(data, batch_size)


def _skip(batches: Iterator[tuple[Tensor, Any]], count: int) -> Iterator[tuple[Tensor, Any]]:
    for index, batch in enumerate(batches):
        if index >= count:
            yield batch


def _rank_loader(loader: torch.utils.data.DataLoader, shard: Any) -> torch.utils.data.DataLoader | None:
    """The same loader over this rank's rows only (same batches, collate, workers), or None if it cannot be cut."""
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return None
    check_loader_order(loader, "data")
    rows = torch.utils.data.Subset(loader.dataset, range(*shard.rows))
    return torch.utils.data.DataLoader(
        rows, batch_size=loader.batch_size, shuffle=False, num_workers=loader.num_workers,
        collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, drop_last=loader.drop_last,
        timeout=loader.timeout, worker_init_fn=loader.worker_init_fn, generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
        persistent_workers=loader.persistent_workers if loader.num_workers else False)
