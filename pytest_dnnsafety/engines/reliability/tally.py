"""The cell tally engine: per-cell prediction histograms of the Monte Carlo samples (mergeable state).

Part of :mod:`pytest_dnnsafety.engines.reliability`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.errors import ConfigError


class CellTallyEngine(Engine):
    """Per-cell prediction histograms of the Monte Carlo samples (the λ_i evidence, eqs. 13–14).

    Args:
        n_cells: number of sampled cells (in the assessor's order).
        num_classes: number of classes ``K``.
        device: where the state lives.

    State: ``counts`` (``n_cells × K``, int64, reduce ``sum``): how often the model predicted
    each class on each cell's samples. Labels of empty cells (majority vote) and failure counts
    are derived from it after all partial engines are merged.
    """

    def __init__(self, n_cells: int, num_classes: int, device: torch.device | str | None = None) -> None:
        super().__init__(device)
        if isinstance(n_cells, bool) or not isinstance(n_cells, int) or n_cells < 0:
            raise ConfigError(f"n_cells must be a non-negative int, got {n_cells!r}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ConfigError(f"num_classes must be an int ≥ 2, got {num_classes!r}")
        self.n_cells = n_cells
        self.num_classes = num_classes
        self.add_state("counts", torch.zeros(n_cells, num_classes, dtype=torch.int64), reduce="sum")

    def config(self) -> dict[str, Any]:
        return {"n_cells": self.n_cells, "num_classes": self.num_classes}

    def update(self, cells: Tensor, predictions: Tensor, *, cell_range: tuple[int, int] | None = None) -> None:
        """Count ``predictions`` (``(B,)`` class indices) against ``cells`` (``(B,)`` indices into the sampled cells).

        ``cell_range=(lo, hi)`` promises ``lo ≤ cells < hi``: only that slice of the histogram is
        touched (the assessor's batches cover contiguous cells). No host sync.
        """
        cells = cells.to(self.device, torch.int64)
        lo, hi = (0, self.n_cells) if cell_range is None else cell_range
        self.update_local(cells - lo if lo else cells, predictions, lo, hi)

    def update_local(self, local: Tensor, predictions: Tensor, lo: int, hi: int) -> None:
        """:meth:`update` with cell indices ``local`` relative to ``lo`` (``0 ≤ local < hi − lo``)."""
        k = self.num_classes
        preds = predictions.to(self.device, torch.int64)
        key = local.to(self.device, torch.int64) * k + preds
        if self.device.type == "cpu":
            part = torch.bincount(key, minlength=(hi - lo) * k)
            self.counts[lo:hi] += part.reshape(hi - lo, k)
        else:
            self.counts[lo:hi].view(-1).index_add_(0, key, torch.ones_like(key))

    def compute(self) -> Tensor:
        """The merged histograms (a copy)."""
        return self.counts.clone()
