"""Row states of the engine base: ``cat`` (per-input rows) and ``topk`` (the k best rows).

Besides the element-wise reduce rules (``sum``, ``max``, ``min``, ``or``, ``and``), an
:class:`~pytest_dnnsafety.engines.core.base.Engine` can hold *row states*: a tensor of shape
``(n, *row_shape)`` whose rows accumulate along dim 0.

* ``"cat"`` keeps every row appended, in arrival order (torchmetrics' list states). Appends are
  kept as a list of chunks and concatenated lazily, when the state is read, so many small
  appends cost one copy, not one per batch. Merge concatenates (this engine's rows, then the
  other's); ``sync`` all-gathers the ranks' rows and concatenates them in rank order.
* ``topk(k, key)`` keeps at most ``k`` rows of shape ``(m, d)``, ordered by column ``key``,
  largest first (or smallest first with ``largest=False``). Ties are broken by the column
  ``tie_break``, ascending, when one is given (e.g. a global input index: then the kept rows
  and their order do not depend on the batch split or the merge order); without one, tied
  rows stay in arrival order (merge: this engine's rows before the other's). NaN keys rank as
  the largest values. Every append prunes to ``k`` on the engine's device (a stable sort; the
  sizes are known from the shapes, so nothing syncs to the host), so merging partial states
  gives exactly the rows that one pass over all the inputs keeps.

This module imports nothing from pytest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["TopK", "topk", "prune_topk", "check_row_default", "check_rows", "all_gather_rows"]


@dataclass(frozen=True)
class TopK:
    """The reduce rule of a ``topk`` state (build it with :func:`topk`)."""

    k: int
    key: int
    largest: bool = True
    tie_break: int | None = None

    def __str__(self) -> str:
        extra = "" if self.largest else ", largest=False"
        extra += "" if self.tie_break is None else f", tie_break={self.tie_break}"
        return f"topk(k={self.k}, key={self.key}{extra})"


def topk(k: int, key: int, *, largest: bool = True, tie_break: int | None = None) -> TopK:
    """The reduce rule "keep the ``k`` rows with the largest (or smallest) column ``key``".

    ``tie_break`` names a column (ascending) that orders rows with equal keys; without one,
    tied rows are kept in arrival order. Pass the result as ``reduce`` to ``add_state``.
    Rows share one dtype: keep index columns exact (``float64`` or an integer dtype; ``float32``
    is exact only up to 2**24).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"topk: k must be an integer >= 1, got {k!r}")
    for label, column in (("key", key), ("tie_break", tie_break)):
        if column is None and label == "tie_break":
            continue
        if isinstance(column, bool) or not isinstance(column, int) or column < 0:
            raise ValueError(f"topk: {label} must be a column index >= 0, got {column!r}")
    if tie_break is not None and tie_break == key:
        raise ValueError(f"topk: tie_break must be a column other than key ({key}), got {tie_break}")
    if not isinstance(largest, bool):
        raise ValueError(f"topk: largest must be True or False, got {largest!r}")
    return TopK(k=k, key=key, largest=largest, tie_break=tie_break)


def check_row_default(name: str, default: Tensor, rule: str | TopK) -> None:
    """Check the default of a row state: ``(0, *row_shape)`` for cat, ``(0, d)`` for topk."""
    if default.dim() < 1 or default.shape[0] != 0:
        raise ValueError(
            f"state {name!r}: a {rule} state's default must be an empty tensor of shape (0, *row_shape), "
            f"got shape {tuple(default.shape)}; use e.g. torch.zeros(0, 3)"
        )
    if isinstance(rule, TopK):
        if default.dim() != 2:
            raise ValueError(
                f"state {name!r}: a topk state holds rows of shape (m, d); its default must have shape (0, d), "
                f"got {tuple(default.shape)}"
            )
        width = int(default.shape[1])
        for label, column in (("key", rule.key), ("tie_break", rule.tie_break)):
            if column is not None and not 0 <= column < width:
                raise ValueError(f"state {name!r}: {rule} {label} column {column} is out of range for rows of {width}")
        if default.dtype.is_complex:
            raise ValueError(f"state {name!r}: a topk state cannot rank complex values ({default.dtype})")


def check_rows(name: str, rows: Tensor, default: Tensor) -> None:
    """Raise ``ValueError`` naming the state when ``rows`` is not ``(n, *row_shape)``."""
    if not isinstance(rows, Tensor):
        raise TypeError(f"state {name!r}: rows must be a torch.Tensor, got {type(rows).__name__}")
    if rows.dim() != default.dim() or rows.shape[1:] != default.shape[1:]:
        raise ValueError(
            f"state {name!r}: rows must have shape (n, {', '.join(str(s) for s in default.shape[1:])}), "
            f"got {tuple(rows.shape)}"
        )


def _sort_column(column: Tensor) -> Tensor:
    # torch.sort does not take bool tensors everywhere; 0/1 bytes sort the same way.
    return column.to(torch.uint8) if column.dtype == torch.bool else column


def prune_topk(rows: Tensor, rule: TopK) -> Tensor:
    """The first ``min(k, n)`` rows of ``rows`` in the rule's order (stable, on the device)."""
    order = torch.arange(rows.shape[0], device=rows.device)
    if rule.tie_break is not None:
        order = torch.sort(_sort_column(rows[:, rule.tie_break]), stable=True).indices
    keys = _sort_column(rows[order, rule.key])
    order = order[torch.sort(keys, descending=rule.largest, stable=True).indices]
    return rows[order[: rule.k]]


def all_gather_rows(rows: Tensor, group: Any = None) -> Tensor:
    """Every rank's ``rows`` (of possibly different lengths), concatenated in rank order.

    Gathers the lengths first (one host sync), pads to the longest, all-gathers and trims.
    """
    dist = torch.distributed
    world = dist.get_world_size(group)
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    lengths = [int(c.item()) for c in counts]
    longest = max(lengths)
    is_bool = rows.dtype == torch.bool
    buffer = rows.to(torch.uint8) if is_bool else rows
    padded = buffer.new_zeros((longest, *rows.shape[1:]))
    padded[: rows.shape[0]] = buffer
    if padded.numel() == 0:
        gathered = [padded[:0] for _ in range(world)]
    else:
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded.contiguous(), group=group)
    joined = torch.cat([part[:length] for part, length in zip(gathered, lengths)])
    return joined.to(torch.bool) if is_bool else joined
