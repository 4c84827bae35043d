"""Fault sets as lazy data: the evaluation data under a fault family, faulted batch by batch as it is read.

A :class:`FaultStream` is a ``DataLoader``: every data form the gates accept reads it (the
:class:`~pytest_dnnsafety.engines.core.runner.Runner`, the shared forward pass of
:class:`~pytest_dnnsafety.engines.core.capture.ActivationCache`, a :class:`~.view.MonitorView`), and nothing
holds the faulted data set: each batch of the source is read, faulted with
:func:`~.faults.apply_fault` and dropped after use. So a monitor gate over a ``DataLoader`` of a
data set larger than memory streams, and its peak memory does not grow with the data.

**Seeds.** Batch ``b`` is faulted with a generator seeded by SHA-256 of ``(seed, family, severity,
b)`` (never Python's salted ``hash``), where ``b`` is the *global* batch index: the same in every
run, process and torchrun rank. The draws therefore depend on the batch size (the source
``DataLoader``'s own, else the gate's ``dnnsafety_batch_size``), as for the robustness families: the
same data batched alike gives the same fault set, whatever its form (tensors or a loader).
Adversarial families (``fgsm``, ``pgd``) attack the model batch by batch on the model's device; the
attack's own forward passes are marked as not data (:func:`~pytest_dnnsafety.engines.core.guard.probing`), so a
pass that reads the stream while recording the model's layers records only the faulted inputs.

**Shards.** Over a map-style source (tensors, a ``TensorDataset``, an in-order ``DataLoader`` with a
plain batch sampler) the stream is a ``DataLoader`` over the source's rows whose ``collate_fn``
collates the source's batch and faults it, so a torchrun rank's loader (the runner's re-cut to its
rows) reads and faults only that rank's batches, with their global indices. Over a source that cannot
be indexed (an ``IterableDataset``, a custom batch sampler) the stream reads the source in order and
is evaluated whole on every rank (the values are the same, the work is not split).
Pure torch; no pytest import.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, TensorDataset, default_collate

from pytest_dnnsafety.data.forms import _split_batch, as_tensors, check_loader_order, iter_batches
from pytest_dnnsafety.errors import ConfigError
from pytest_dnnsafety.engines.core.guard import _PROBING, model_dtype_device
from pytest_dnnsafety.engines.monitors.faults import FAULT_GROUPS, apply_fault, check_severity

__all__ = ["FaultStream", "batch_fault_seed", "fault_stream"]


def batch_fault_seed(seed: int, family: str, severity: int, batch: int) -> int:
    """A 63-bit seed from ``(seed, family, severity, global batch index)`` by SHA-256 (stable everywhere)."""
    digest = hashlib.sha256(f"pytest-dnnsafety/faults:{seed}:{family}:{severity}:batch {batch}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


class _Fault:
    """Applies one fault to a batch with the batch's own generator (picklable: loader workers may run it)."""

    def __init__(self, family: str, severity: int, seed: int, clip: tuple[float, float] | None, model: Any,
                 device: torch.device, outputs: str) -> None:
        self.family, self.severity, self.seed, self.clip = family, severity, seed, clip
        self.adversarial = family in FAULT_GROUPS["adversarial"]
        self.model = model if self.adversarial else None
        self.device, self.outputs = device, outputs

    def __call__(self, index: int, x: Any, y: Any) -> tuple[Tensor, ...]:
        x = torch.as_tensor(x).detach()
        y = torch.as_tensor(y) if y is not None else None
        if not x.is_floating_point():
            x = x.float()
        if self.adversarial:  # the attack runs where the model is, on int64 labels
            target = model_dtype_device(self.model)[1] or self.device
            x = x.to(target)
            y = y.to(target).long() if y is not None else None
        generator = torch.Generator(device=x.device).manual_seed(
            batch_fault_seed(self.seed, self.family, self.severity, index))
        if not self.adversarial:
            return self._done(apply_fault(self.family, x, self.severity, generator=generator, clip=self.clip), y)
        # The attack's own forward passes are not data: a pass that reads this stream with forward hooks on
        # the model (the shared activation capture) must not record them (the hooks skip "probing" passes).
        token = _PROBING.set(True)
        try:
            with torch.enable_grad():
                out = apply_fault(self.family, x, self.severity, generator=generator, y=y, model=self.model,
                                  clip=self.clip, outputs=self.outputs)
        finally:
            _PROBING.reset(token)
        return self._done(out, y)

    @staticmethod
    def _done(out: Tensor, y: Tensor | None) -> tuple[Tensor, ...]:
        return (out.detach(),) if y is None else (out.detach(), y)


class _Rows(Dataset):
    """The source's rows; a batch of them is fetched at once (``__getitems__``) with its global row numbers."""

    def __init__(self, rows: Any, collate: Callable[[list[Any]], Any]) -> None:
        self.rows, self.collate = rows, collate

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[list[int], Any]:
        return self.__getitems__([index])

    def __getitems__(self, indices: list[int]) -> tuple[list[int], Any]:
        if isinstance(self.rows, TensorDataset) and self.collate is default_collate:  # one gather, not n items
            picked = torch.as_tensor(indices)
            return list(indices), [t[picked] for t in self.rows.tensors]
        fetch = getattr(self.rows, "__getitems__", None)
        items = fetch(list(indices)) if callable(fetch) else [self.rows[i] for i in indices]
        return list(indices), self.collate(items)


class _Collate:
    """``collate_fn`` of a :class:`FaultStream`: the source batch of rows ``r0..``, faulted as batch ``r0 // size``."""

    def __init__(self, fault: _Fault, batch_size: int) -> None:
        self.fault, self.batch_size = fault, batch_size

    def __call__(self, fetched: Any) -> tuple[Tensor, ...]:
        if isinstance(fetched, list):  # items one by one (a fetcher that ignores __getitems__): join them
            rows = [r for part, _ in fetched for r in part]
            parts = [_split_batch(batch) for _, batch in fetched]
            x = torch.cat([torch.as_tensor(px) for px, _ in parts])
            y = torch.cat([torch.as_tensor(py) for _, py in parts]) if all(py is not None for _, py in parts) else None
        else:
            rows, batch = fetched
            x, y = _split_batch(batch)
        return self.fault(rows[0] // self.batch_size, x, y)


class _Sequential(IterableDataset):
    """A source that cannot be indexed, read in order and faulted batch by batch."""

    def __init__(self, source: Any, batch_size: int, fault: _Fault) -> None:
        self.source, self.batch_size, self.fault = source, batch_size, fault

    def __iter__(self) -> Any:
        for index, (x, y) in enumerate(iter_batches(self.source, self.batch_size)):
            yield self.fault(index, x, y)


class FaultStream(DataLoader):
    """The evaluation data ``source`` under fault ``family`` at ``severity``, faulted per batch as it is read.

    A ``DataLoader`` (see the module docstring); ``family``, ``severity``, ``seed``, ``clip`` and ``source``
    say what it is. Iterating it yields ``(x', y)`` (``(x',)`` for unlabelled data), labels passed through.
    """

    family: str
    severity: int
    seed: int
    clip: tuple[float, float] | None
    source: Any

    def materialise(self) -> TensorDataset:
        """The whole fault set as a ``TensorDataset`` on the host (the ``fault_data`` fixture's form)."""
        xs, ys = [], []
        for x, y in iter_batches(self, 1):
            xs.append(x.detach().cpu())
            if y is not None:
                ys.append(y.detach().cpu())
        x_all = torch.cat(xs)
        return TensorDataset(x_all, torch.cat(ys)) if ys and len(ys) == len(xs) else TensorDataset(x_all)


def _indexable(data: Any, batch_size: int) -> tuple[Any, Callable[[list[Any]], Any], int, dict[str, Any]] | None:
    """``(rows, collate, batch size, loader options)`` of a source whose rows can be fetched by index, else None."""
    if isinstance(data, DataLoader):
        if (isinstance(data.dataset, IterableDataset) or not data.batch_size
                or type(data.batch_sampler) is not BatchSampler):
            return None
        check_loader_order(data, "data")
        options = {"drop_last": data.drop_last, "num_workers": data.num_workers, "timeout": data.timeout,
                   "worker_init_fn": data.worker_init_fn, "pin_memory": data.pin_memory}
        if data.num_workers:
            options.update(prefetch_factor=data.prefetch_factor, persistent_workers=data.persistent_workers)
        return data.dataset, data.collate_fn, int(data.batch_size), options
    x, y = as_tensors(data, "the in-distribution evaluation data")
    rows = TensorDataset(x, y) if y is not None else TensorDataset(x)
    return rows, default_collate, int(batch_size), {}


def fault_stream(data: Any, family: str, severity: int, *, seed: int, model: Any = None, batch_size: int = 256,
                 device: torch.device | str = "cpu", clip: tuple[float, float] | None = (0.0, 1.0),
                 outputs: str = "logits") -> FaultStream:
    """``data`` under fault ``family`` at ``severity`` as a lazy :class:`FaultStream` (nothing is faulted yet).

    ``batch_size`` batches tensor sources (a ``DataLoader`` keeps its own); ``model`` (and ``outputs``:
    ``"logits"`` or ``"probabilities"``) for the adversarial families, which run on the model's device
    (``device`` for a model without parameters). Errors in the fault (a spatial family on non-images, an
    input outside ``clip``) surface when the stream is read, naming the batch's problem.
    """
    families = [f for group in FAULT_GROUPS.values() for f in group]
    if family not in families:
        raise ConfigError(f"fault_stream: {family!r} is not a fault family. Fix: name one of {', '.join(families)}.")
    (severity,) = check_severity(severity)
    fault = _Fault(family, severity, int(seed), clip, model, torch.device(device), outputs)
    source = _indexable(data, batch_size)
    if source is None:
        stream = FaultStream(_Sequential(data, batch_size, fault), batch_size=None)
    else:
        rows, collate, size, options = source
        if fault.adversarial:  # the attack runs the model: in this process, on its device
            options = {"drop_last": options.get("drop_last", False)}
        stream = FaultStream(_Rows(rows, collate), batch_size=size, shuffle=False,
                             collate_fn=_Collate(fault, size), **options)
    stream.family, stream.severity, stream.seed, stream.clip, stream.source = family, severity, int(seed), clip, data
    return stream
