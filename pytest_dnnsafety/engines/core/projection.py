"""The k-projection layout of a set of categorical conditions: every k-subset of the conditions and its cells.

Shared by scenario coverage (:mod:`pytest_dnnsafety.engines.coverage`), per-scenario performance
groups (:mod:`pytest_dnnsafety.engines.performance`) and the scenario table's feasibility and
proposals (:mod:`pytest_dnnsafety.scenarios`). Pure torch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import Tensor


__all__ = ["ProjectionLayout"]


@dataclass(frozen=True)
class ProjectionLayout:
    """Where each k-projection cell lives in the flat ``counts`` vector.

    ``subsets`` are the k-subsets of condition indices in :func:`itertools.combinations` order,
    ``sizes[s]`` the number of cells of subset ``s``, ``offsets[s]`` its first flat index
    (``offsets[-1]`` is the total), ``strides[s][j]`` the mixed-radix weight of its j-th condition.
    """

    cardinalities: tuple[int, ...]
    k: int
    subsets: tuple[tuple[int, ...], ...] = field(init=False)
    sizes: tuple[int, ...] = field(init=False)
    offsets: tuple[int, ...] = field(init=False)
    strides: tuple[tuple[int, ...], ...] = field(init=False)

    def __post_init__(self) -> None:
        cards = self.cardinalities
        subsets = tuple(itertools.combinations(range(len(cards)), self.k))
        sizes, strides, offsets = [], [], [0]
        for subset in subsets:
            stride, weights = 1, []
            for cond in reversed(subset):
                weights.append(stride)
                stride *= cards[cond]
            strides.append(tuple(reversed(weights)))
            sizes.append(stride)
            offsets.append(offsets[-1] + stride)
        object.__setattr__(self, "subsets", subsets)
        object.__setattr__(self, "sizes", tuple(sizes))
        object.__setattr__(self, "offsets", tuple(offsets))
        object.__setattr__(self, "strides", tuple(strides))

    @property
    def total(self) -> int:
        """Number of cells over all k-projection tables."""
        return self.offsets[-1]

    @property
    def n_subsets(self) -> int:
        return len(self.subsets)

    def weight_matrix(self, dtype: torch.dtype = torch.int64, device: torch.device | None = None) -> Tensor:
        """``W`` (n × S): ``codes @ W + offsets`` is each row's flat cell index in every subset."""
        weights = torch.zeros(len(self.cardinalities), len(self.subsets), dtype=dtype)
        for s, (subset, strides) in enumerate(zip(self.subsets, self.strides)):
            for cond, stride in zip(subset, strides):
                weights[cond, s] = stride
        return weights.to(device) if device is not None else weights

    def offsets_tensor(self, dtype: torch.dtype = torch.int64, device: torch.device | None = None) -> Tensor:
        """Start index of each subset's table (length S)."""
        return torch.tensor(self.offsets[:-1], dtype=dtype, device=device)

    def cell_indices(self, codes: Tensor) -> Tensor:
        """Flat cell index (rows × S, int64) of every row of ``codes`` in every subset (exact)."""
        gathered = codes.to(torch.int64)[:, self.subset_tensor(codes.device)]  # (N, S, k)
        strides = torch.tensor(self.strides, dtype=torch.int64, device=codes.device).reshape(len(self.subsets), -1)
        return (gathered * strides).sum(-1) + self.offsets_tensor(device=codes.device)

    def subset_tensor(self, device: torch.device | None = None) -> Tensor:
        """The subsets as an (S × k) int64 tensor of condition indices."""
        return torch.tensor(self.subsets, dtype=torch.int64, device=device).reshape(len(self.subsets), self.k)

    def decode(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """Flat cell indices → (subset index per cell, values (M × k) of the subset's conditions)."""
        flat = flat.to(torch.int64)
        ends = torch.tensor(self.offsets[1:], dtype=torch.int64, device=flat.device)
        subset_ids = torch.searchsorted(ends, flat, right=True)
        local = flat - self.offsets_tensor(device=flat.device)[subset_ids]
        strides = torch.tensor(self.strides, dtype=torch.int64, device=flat.device).reshape(len(self.subsets), -1)
        cards = torch.tensor(self.cardinalities, dtype=torch.int64, device=flat.device)
        radices = cards[self.subset_tensor(flat.device)]
        values = (local[:, None] // strides[subset_ids]) % radices[subset_ids]
        return subset_ids, values

    def subset_cells(self, s: int) -> Tensor:
        """All cells of subset ``s`` as values (size × k), in mixed-radix order."""
        local = torch.arange(self.sizes[s], dtype=torch.int64)
        strides = torch.tensor(self.strides[s], dtype=torch.int64)
        radices = torch.tensor([self.cardinalities[c] for c in self.subsets[s]], dtype=torch.int64)
        return (local[:, None] // strides) % radices
