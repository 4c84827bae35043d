"""A seeded subsample of evaluation data (``sample=N``): which rows, and the data restricted to them.

:func:`choose` picks ``n`` of ``total`` row indices with a seeded generator, proportionally per group
when each row has a group key (a scenario table's row: the same conditions, the same group; largest
remainders, so the counts add up to ``n``), and returns them in ascending order — the subsample keeps
the data's order, so row *i* of the subsample still matches row *i* of a table restricted the same way.
The same ``(total, n, seed, groups)`` always gives the same indices. :func:`take` restricts any data
form the gates read (tensors, ``(x, y)``, dicts, ``TensorDataset``, a map-style ``DataLoader``,
detection data) to those rows without reading the rest; :func:`digest` names the indices in evidence.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pytest_dnnsafety.errors import DataError

__all__ = ["Subsample", "choose", "digest", "take"]


@dataclass(frozen=True)
class Subsample:
    """The chosen rows (ascending) of ``total``, the seed, and the per-group counts when stratified."""

    indices: tuple[int, ...]
    total: int
    seed: int
    #: group key -> (rows chosen, rows in the data); empty when not stratified
    groups: Mapping[Hashable, tuple[int, int]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.indices)

    def to_details(self, stratified_by: str | None = None) -> dict[str, Any]:
        """Plain JSON for the evidence: N, the data's size, the seed, the indices' digest, the stratification."""
        out: dict[str, Any] = {"n": self.n, "of": self.total, "seed": self.seed, "indices_sha256": digest(self.indices),
                               "stratified_by": stratified_by if self.groups else None}
        if self.groups:
            out["groups"] = len(self.groups)
            out["groups_sampled"] = sum(1 for chosen, _ in self.groups.values() if chosen)
        return out


def digest(indices: Sequence[int]) -> str:
    """SHA-256 of the indices as little-endian int64: the same subsample, the same digest."""
    return hashlib.sha256(np.asarray(indices, dtype="<i8").tobytes()).hexdigest()


def choose(total: int, n: int, seed: int, groups: Sequence[Hashable] | None = None) -> Subsample:
    """``n`` of ``total`` rows, seeded; proportional per group (``groups[i]``: row i's key) when given.

    Each group gets ``floor(n * size / total)`` rows, the rest going to the largest remainders (ties
    by first appearance), and within a group the rows are a seeded uniform choice. ``n`` must be in
    ``[1, total]`` (the caller names the setting in its error).
    """
    if not 1 <= n <= total:
        raise ValueError(f"n={n} must be in [1, {total}]")
    rng = np.random.default_rng(seed)
    if groups is None:
        picked = np.sort(rng.permutation(total)[:n])
        return Subsample(tuple(int(i) for i in picked), total, seed)
    if len(groups) != total:
        raise ValueError(f"{len(groups)} group keys for {total} rows")
    members: dict[Hashable, list[int]] = {}
    for i, key in enumerate(groups):
        members.setdefault(key, []).append(i)
    keys = list(members)
    exact = [n * len(members[key]) / total for key in keys]
    counts = [int(share) for share in exact]
    order = sorted(range(len(keys)), key=lambda j: (-(exact[j] - counts[j]), j))
    for j in order[: n - sum(counts)]:
        counts[j] += 1
    chosen: list[int] = []
    for key, count in zip(keys, counts):
        rows = members[key]
        if count:
            chosen += [rows[int(k)] for k in rng.permutation(len(rows))[:count]]
    table = {key: (count, len(members[key])) for key, count in zip(keys, counts)}
    return Subsample(tuple(sorted(chosen)), total, seed, table)


def take(data: Any, indices: Sequence[int], what: str = "data") -> Any:
    """``data`` restricted to the rows ``indices`` (ascending), in the same form where it can be.

    A ``DataLoader`` over a map-style dataset becomes one over a ``Subset`` with the same batch size,
    collate function and workers (in order); a loader over an ``IterableDataset`` cannot be
    subsampled without reading it all and is refused (a :class:`DataError` naming the fix).
    """
    from pytest_dnnsafety.data.tasks import BoxSet, DetectionData

    index = torch.as_tensor(list(indices), dtype=torch.int64)
    if isinstance(data, torch.utils.data.DataLoader):
        if isinstance(data.dataset, torch.utils.data.IterableDataset):
            raise DataError(f"{what}: a DataLoader over an IterableDataset ({type(data.dataset).__name__}) has no "
                            "rows to pick, so sample= cannot subsample it. Fix: give a map-style dataset (with "
                            "__getitem__ and __len__), or drop sample= and shorten the stream yourself.")
        return torch.utils.data.DataLoader(
            torch.utils.data.Subset(data.dataset, list(indices)), batch_size=data.batch_size, shuffle=False,
            collate_fn=data.collate_fn, num_workers=data.num_workers, pin_memory=data.pin_memory,
            drop_last=data.drop_last, timeout=data.timeout, worker_init_fn=data.worker_init_fn,
            prefetch_factor=data.prefetch_factor if data.num_workers else None,
            persistent_workers=data.persistent_workers)
    if isinstance(data, DetectionData) and callable(getattr(data, "rows", None)):  # lazy (COCO) data: stays lazy
        return data.rows(list(indices))
    if isinstance(data, DetectionData):
        targets = BoxSet.cat([data.targets.images(i, i + 1) for i in indices])
        return DetectionData(data.x[index], targets)
    if isinstance(data, torch.utils.data.TensorDataset):
        return torch.utils.data.TensorDataset(*(t[index] for t in data.tensors))
    if isinstance(data, Mapping):
        rows = _rows(data.get("x"))
        return {key: _rows_of(value, index, rows) for key, value in data.items()}
    if isinstance(data, tuple) and len(data) in (1, 2):
        return tuple(_rows_of(value, index, _rows(data[0])) for value in data)
    if isinstance(data, list) and len(data) in (1, 2) and hasattr(data[0], "shape"):
        return [_rows_of(value, index, _rows(data[0])) for value in data]
    if hasattr(data, "shape"):
        return _rows_of(data, index, _rows(data))
    if isinstance(data, torch.utils.data.Dataset) and hasattr(data, "__len__"):
        return torch.utils.data.Subset(data, list(indices))
    raise DataError(f"{what}: sample= cannot subsample a {type(data).__name__}. Fix: give tensors, (x, y), a dict, a "
                    "TensorDataset or a DataLoader over a map-style dataset, or drop sample=.")


def _rows(value: Any) -> int | None:
    shape = getattr(value, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) else None


def _rows_of(value: Any, index: torch.Tensor, rows: int | None) -> Any:
    """``value[index]`` for an array or tensor with one row per input; anything else as it is."""
    if rows is None or _rows(value) != rows:
        return value
    if isinstance(value, torch.Tensor):
        return value[index.to(value.device)]
    if isinstance(value, np.ndarray):
        return value[index.numpy()]
    return value
