"""Data in any accepted form, as tensors: ``(x, y)``, ``x``, a dict, a ``TensorDataset`` or a ``DataLoader``.

:func:`as_tensors` normalises and checks (shapes agree, inputs finite, labels integer);
:func:`iter_batches` yields batches without materialising a loader; :func:`known_length` counts
samples without reading them. A ``DataLoader`` that does not read its dataset in index order (a
random or reordering sampler) is refused everywhere: gates link data rows to scenario rows by
position, and the same data must give the same numbers every time. Every complete pass over a
``DataLoader`` is fingerprinted on the way (:mod:`pytest_dnnsafety.data.fingerprint`). File formats are read
in :mod:`pytest_dnnsafety.files.loading`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from pytest_dnnsafety.errors import DataError
from pytest_dnnsafety.data.fingerprint import digest_stream
from pytest_dnnsafety.data.tasks import (BoxSet, DetectionData, as_boxset, check_multilabel, is_detection_output,
                                         label_problem)

__all__ = ["as_tensors", "check_loader_order", "detection_source", "iter_batches", "known_length"]


def check_loader_order(loader: torch.utils.data.DataLoader, what: str) -> None:
    """Refuse a DataLoader that does not read its dataset in index order.

    Gates link data row i to scenario row i, so a shuffling sampler (``shuffle=True``,
    ``RandomSampler``, ``SubsetRandomSampler``, ``WeightedRandomSampler``) or a batch sampler that
    reorders would silently misalign them. A loader over an ``IterableDataset`` has no sampler: it
    is accepted, and its order is the dataset's (the user's responsibility).
    """
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return
    batch_sampler = loader.batch_sampler
    sampler = loader.sampler if batch_sampler is None else getattr(batch_sampler, "sampler", batch_sampler)
    if isinstance(sampler, torch.utils.data.SequentialSampler):
        return
    name = type(sampler).__name__
    verb = "shuffles" if "Random" in name else "does not read its dataset in order"
    raise DataError(
        f"{what}: the DataLoader {verb} ({name}): gates link data rows to scenario rows by position and "
        "must see the same order every time. Fix: use shuffle=False (or pass the tensors / a TensorDataset)."
    )


def as_tensors(data: Any, what: str = "data") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normalise ``(x, y)``, ``x``, a dict, a TensorDataset or a DataLoader into tensors.

    Checks shape agreement and finiteness; ``y`` may be missing (unlabelled data). A DataLoader
    must read in order (see :func:`check_loader_order`).
    """
    x: Any
    y: Any = None
    data = detection_source(data, what)
    if isinstance(data, DetectionData):
        return data.x if data.x.is_floating_point() else data.x.float(), data.targets  # type: ignore[return-value]
    if isinstance(data, torch.utils.data.DataLoader):
        check_loader_order(data, what)
        xs, ys = [], []
        for bx, by in digest_stream(data, _loader_batches(data)):  # the streamed bytes fingerprinted on the way
            xs.append(bx)
            if by is not None:
                ys.append(by)
        if not xs:
            raise DataError(f"{what}: the DataLoader yielded no batches. Fix: give it a non-empty dataset.")
        x = torch.cat(xs)
        if ys and isinstance(ys[0], BoxSet):
            return (x if x.is_floating_point() else x.float()), BoxSet.cat(ys)  # type: ignore[return-value]
        y = torch.cat(ys) if ys else None
    elif isinstance(data, torch.utils.data.TensorDataset):
        x = data.tensors[0]
        y = data.tensors[1] if len(data.tensors) > 1 else None
    elif isinstance(data, Mapping):
        if "x" not in data:
            raise DataError(f"{what}: a dict of arrays needs key 'x' (and 'y' for labels); got {sorted(data)}.")
        x, y = data["x"], data.get("y")
    elif isinstance(data, (tuple, list)) and len(data) in (1, 2) and not _is_scalar_list(data):
        x = data[0]
        y = data[1] if len(data) == 2 else None
    else:
        x = data
    x = _to_tensor(x, what, "x")
    y = _to_tensor(y, what, "y") if y is not None else None
    if x.ndim == 0 or x.shape[0] == 0:
        raise DataError(f"{what}: no samples (x has shape {tuple(x.shape)}). Fix: provide a non-empty data set.")
    if not torch.is_floating_point(x):
        x = x.float()
    bad = 0
    if x.numel():  # one fused min/max pass (NaN propagates, ±inf shows): no bool copy of the data, one host read
        lo, hi = torch.aminmax(x)
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
            bad = int((~torch.isfinite(x)).sum())
    if bad:
        raise DataError(
            f"{what}: x holds {bad} NaN/inf value(s). Fix: clean or impute the inputs before evaluating."
        )
    if y is not None:
        if y.shape[0] != x.shape[0]:
            raise DataError(
                f"{what}: x has {x.shape[0]} samples but y has {y.shape[0]} labels. Fix: align inputs and labels."
            )
        if y.ndim == 2:  # multi-label: a (N, classes) 0/1 matrix (booleans, floats 0.0/1.0 accepted)
            check_multilabel(y, what)
        problem = label_problem(y)
        if problem is not None:
            raise DataError(f"{what}: {problem}.")
        y = y.long()
    return x, y


def iter_batches(data: Any, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """Yield ``(x, y)`` batches (``y`` may be None) from any accepted data form.

    A ``DataLoader`` is iterated as it is (its own batch size wins) and must read in order (see
    :func:`check_loader_order`; a loader over an ``IterableDataset`` yields the dataset's own
    order); tensors, arrays, ``(x, y)`` pairs, dicts and ``TensorDataset`` are sliced into
    ``batch_size`` rows.
    """
    data = detection_source(data, "data")
    if isinstance(data, torch.utils.data.DataLoader):
        check_loader_order(data, "data")
        yield from digest_stream(data, _loader_batches(data))  # a complete pass records its digest on the loader
        return
    if isinstance(data, DetectionData):
        for start in range(0, len(data), batch_size):
            yield data.batch(start, min(start + batch_size, len(data)))  # type: ignore[misc]
        return
    x, y = as_tensors(data)
    for start in range(0, x.shape[0], batch_size):
        yield x[start:start + batch_size], (y[start:start + batch_size] if y is not None else None)


def _loader_batches(loader: torch.utils.data.DataLoader) -> Iterator[tuple[torch.Tensor, Any]]:
    """A loader's batches as ``(x, y)`` tensors (``y`` a tensor, a box set or None), as they come out of it."""
    for batch in loader:
        bx, by = _split_batch(batch)
        yield torch.as_tensor(bx), (by if by is None or isinstance(by, BoxSet) else torch.as_tensor(by))


def known_length(data: Any) -> int | None:
    """The number of samples in ``data`` when it is known without reading the data, else None.

    ``TensorDataset`` and any sized dataset: ``len``; a tensor or array: ``shape[0]``; ``(x, y)``
    or ``{"x": ...}``: rows of ``x``; a ``DataLoader``: the length of its sampler, less a dropped
    last batch. Never iterates (a loader may be one-shot) and never raises.
    """
    try:
        if isinstance(data, torch.utils.data.DataLoader):
            n = len(data.sampler) if data.batch_sampler is not None else len(data.dataset)  # type: ignore[arg-type]
            if data.drop_last and data.batch_size:
                n -= n % data.batch_size
            return int(n)
        if isinstance(data, torch.utils.data.TensorDataset):
            return int(data.tensors[0].shape[0])
        if isinstance(data, DetectionData):
            return len(data)
        if isinstance(data, Mapping) and "x" in data:
            data = data["x"]
        elif isinstance(data, (tuple, list)) and len(data) in (1, 2) and hasattr(data[0], "shape"):
            data = data[0]
        shape = getattr(data, "shape", None)
        if shape is not None and len(shape) > 0:
            return int(shape[0])
        if isinstance(data, torch.utils.data.Dataset) and hasattr(data, "__len__"):
            return int(len(data))  # type: ignore[arg-type]
    except Exception:  # an unsized sampler or dataset: unknown
        return None
    return None


def _is_scalar_list(data: Sequence[Any]) -> bool:
    return all(isinstance(item, (int, float)) for item in data)


def _split_batch(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)):
        x, y = batch[0], (batch[1] if len(batch) > 1 else None)
    elif isinstance(batch, Mapping):
        x, y = batch["x"], batch.get("y")
    else:
        return batch, None
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):  # torchvision: a list of images
        x = torch.stack(list(x))
    if y is not None and is_detection_output(y) and not isinstance(y, BoxSet):
        y = as_boxset(list(y), len(y), "detection targets")
    return x, y


def detection_source(data: Any, what: str) -> Any:
    """A dict with detection keys (``x``, ``boxes``, ``labels``, ``offsets``) as :class:`DetectionData`; else ``data``."""
    if isinstance(data, Mapping) and "boxes" in data and "x" in data:
        missing = [key for key in ("labels", "offsets") if key not in data]
        if missing:
            raise DataError(f"{what}: detection data need keys x, boxes, labels and offsets; {missing} missing. Fix: "
                            "save offsets (N + 1,) so that image i's objects are rows offsets[i]:offsets[i+1].")
        return DetectionData.from_offsets(data["x"], data["boxes"], data["labels"], data["offsets"], what)
    return data


def _to_tensor(value: Any, what: str, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    try:
        return torch.as_tensor(value)
    except Exception as exc:
        raise DataError(f"{what}: {name} cannot be turned into a tensor: {exc}") from exc
