"""Scenario k-projection coverage engine — M_scene (Cheng et al. 2018, §II-A, eq. (1)).

Operating conditions ``C_1..C_n`` are finite value domains, and a data set is a table of
scenarios (one value per condition, one row per sample). For every k-subset of conditions the
*k-projection table* has ``∏|C_i|`` cells; a cell is *occupied* when at least ``min_count``
rows carry its value combination. Eq. (1) of the paper (k = 2 there)::

    M_scene = (# cells occupied by the data set) / (# cells of all k-projection tables)

Restrictions (improvement over the paper's reference kit, whose printed coverage ignores
them): a cell that no possible scenario can reach (e.g. ``snow × summer``) cannot be covered
by any data, so a ``feasible`` mask takes such cells out of the denominator; they are
reported separately (see :mod:`pytest_dnnsafety.scenarios`, which derives the mask).

Layout of the single state ``counts`` (int64, reduce ``sum``): the k-subsets of conditions in
:func:`itertools.combinations` order, one after another; inside a subset ``(i, j, l)`` the
cell ``(v_i, v_j, v_l)`` sits at ``v_i·|C_j|·|C_l| + v_j·|C_l| + v_l`` (mixed radix, first
condition most significant, i.e. :func:`itertools.product` order).

Counting on the CPU (from :data:`GROUP_MIN_INDICES` rows × subsets per update): the conditions
are gathered into groups with small joint tables that together contain every k-subset, one pass
over the rows per group (int16 mixed-radix keys, one ``bincount``), and the k-subsets are summed out
of the joint tables (:mod:`pytest_dnnsafety.engines.coverage.counting`), on one thread
(:func:`~pytest_dnnsafety.runtime.threads.host_bound`). Elsewhere (accelerators, small updates): one
vectorised pass per row chunk, ``index = codes @ W + offsets`` (an ``n × S`` radix-weight matrix,
S = number of subsets), then one ``torch.bincount`` over the chunk's ``rows × S`` indices
(``index_add_`` off the CPU, where ``bincount`` would sync to the host). The matrix product runs in
float64, exact for every index below 2**53 and immune to the reduced-precision (TF32/bf16) float32
matmul modes; indices then travel as int32. Both count exactly the same.
Measured on 2 shared CPU cores, 10^6 rows × 10 conditions of 2–12 values: see
``tests/benchmarks/test_bench_scenario.py`` and the "Speed" paragraph of ``docs/gates/coverage.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.base import Engine
from pytest_dnnsafety.engines.core.projection import ProjectionLayout
from pytest_dnnsafety.engines.coverage.counting import column_major, count_projections, plan_for
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.runtime import threads

__all__ = ["MAX_CELLS", "ScenarioCoverageEngine", "ScenarioCoverageOutput", "check_projection_cells",
           "projection_cells"]

#: Upper bound on the number of cells over all k-projection tables (the ``counts`` state is
#: int64, so this bounds it at 256 MiB). Checked from the domain sizes before anything is allocated
#: (:func:`check_projection_cells`), by the engine and by the scenario table's feasibility.
MAX_CELLS = 1 << 25


def projection_cells(cardinalities: Sequence[int], k: int) -> int:
    """Cells over all k-projection tables: the sum over the k-subsets of the product of their domain sizes.

    The elementary symmetric polynomial ``e_k`` of the sizes, in ``n·k`` steps (no loop over the subsets).
    """
    sums = [1] + [0] * k
    for card in cardinalities:
        for j in range(k, 0, -1):
            sums[j] += sums[j - 1] * int(card)
    return sums[k]


def check_projection_cells(cardinalities: Sequence[int], k: int, names: Sequence[str] | None = None,
                           cap: int = MAX_CELLS, why: str = "") -> int:
    """The k-projection cell count, or :class:`ConfigError` when it exceeds ``cap`` (:data:`MAX_CELLS`).

    The message names k, the count, the largest domains, the cap and the fixes (a smaller k, with its
    count; coarser domains; ``where=`` to narrow them).
    """
    cards = tuple(int(card) for card in cardinalities)
    cells = projection_cells(cards, k)
    if cells <= cap:
        return cells
    labels = tuple(names) if names is not None else tuple(f"condition {i}" for i in range(len(cards)))
    largest = sorted(range(len(cards)), key=lambda i: -cards[i])[:k]
    shown = " × ".join(f"{labels[i]} {cards[i]}" for i in sorted(largest))
    smaller = next((f"a smaller k (k={j} gives {projection_cells(cards, j):,} cells)" for j in range(k - 1, 0, -1)
                    if projection_cells(cards, j) <= cap), "")
    fixes = ", ".join(part for part in (smaller, "coarser domains (merge the values of the largest conditions)",
                                        "or where= to narrow the domains to the values of interest") if part)
    raise ConfigError(
        f"k={k} over {len(cards)} conditions gives {cells:,} projection cells (the sum over the k-subsets of their "
        f"domain sizes' product; the largest: {shown}), more than the cap of {cap:,} cells{why}; refused before "
        f"allocating them (one count per cell alone: {cells * 8 / 2**30:,.1f} GiB). Fix: {fixes}"
    )

#: Target number of ``rows × subsets`` indices per chunk on the CPU (cache-sized; measured
#: fastest between 2**19 and 2**21 on a 2-core machine) and on accelerators.
_CPU_CHUNK_ELEMS = 1 << 20
_ACCEL_CHUNK_ELEMS = 1 << 24
#: Hard bound on indices per chunk (float64 + int32 each: about 400 MiB at most).
_MAX_CHUNK_ELEMS = 1 << 25
#: When an update on the CPU counts by condition groups (:mod:`.counting`) instead of one index per row
#: and subset: from ``2**20`` ``rows × subsets`` indices, or from ``2**17`` with at least 100 rows per
#: subset; below, the one-shot matrix product and bincount costs less than the groups' fixed work (a few
#: kernels per group and one small sum, about 20 µs, per subset). Measured crossover on 2 CPU cores:
#: 0.1–0.4 M indices at k = 1–2, about 1 M at k = 3.
GROUP_MIN_INDICES = 1 << 17
GROUP_ALWAYS_INDICES = 1 << 20
GROUP_MIN_ROWS_PER_SUBSET = 100


@dataclass(frozen=True)
class ScenarioCoverageOutput:
    """What :meth:`ScenarioCoverageEngine.compute` returns (tensors on the engine's device).

    ``value`` is ``covered / total`` where ``covered`` counts occupied feasible cells and ``total``
    feasible cells; ``occupied_infeasible`` counts cells the data reached although they are
    declared infeasible (the data contradicts the restrictions).
    """

    layout: ProjectionLayout
    min_count: int
    counts: Tensor
    occupied: Tensor
    feasible: Tensor
    covered_per_subset: Tensor
    total_per_subset: Tensor
    infeasible_per_subset: Tensor
    occupied_infeasible_per_subset: Tensor
    covered: Tensor
    total: Tensor
    value: Tensor

    @property
    def uncovered(self) -> Tensor:
        """Boolean mask of the feasible cells that are not occupied (the holes)."""
        return self.feasible & ~self.occupied


def _segment_sums(mask: Tensor, offsets: Tensor) -> Tensor:
    """Per-subset sums of a flat boolean mask (subsets are contiguous in the flat layout)."""
    csum = torch.cat([mask.new_zeros(1, dtype=torch.int64), mask.to(torch.int64).cumsum(0)])
    return csum[offsets[1:]] - csum[offsets[:-1]]


def _weight_matrix(layout: ProjectionLayout, device: torch.device) -> Tensor:
    """:meth:`ProjectionLayout.weight_matrix` in float64, by one scatter (not one assignment per entry)."""
    weights = torch.zeros(len(layout.cardinalities), layout.n_subsets, dtype=torch.float64)
    columns = torch.arange(layout.n_subsets).repeat_interleave(layout.k)
    strides = torch.tensor(layout.strides, dtype=torch.float64).reshape(-1)
    weights[layout.subset_tensor().reshape(-1), columns] = strides
    return weights.to(device)


class ScenarioCoverageEngine(Engine):
    """Scenario k-projection coverage M_scene (Cheng et al. 2018, §II-A, eq. (1)).

    Args:
        cardinalities: ``|C_i|`` for each condition, in condition order.
        k: size of the condition subsets (the paper uses k = 2); any 1 ≤ k ≤ n whose tables
            total at most :data:`MAX_CELLS` cells.
        min_count: rows a cell needs to count as occupied.
        feasible: optional boolean mask over all cells (flat layout, see the module docstring);
            infeasible cells leave the denominator and are reported separately. This improves
            on the paper's reference kit, whose printed coverage ignores domain restrictions.
        device: where the states live and counting happens (default CPU).
        names: optional condition names, used in error messages.

    State: ``counts`` (int64, one entry per cell, reduce ``sum``).
    """

    def __init__(
        self,
        cardinalities: Sequence[int],
        k: int = 2,
        min_count: int = 1,
        feasible: Tensor | None = None,
        device: torch.device | str | None = None,
        *,
        names: Sequence[str] | None = None,
    ) -> None:
        super().__init__(device)
        cards = tuple(cardinalities)
        if not cards:
            raise ConfigError("scenario coverage needs at least one condition; cardinalities is empty")
        for i, card in enumerate(cards):
            if isinstance(card, bool) or not isinstance(card, int) or card < 1:
                raise ConfigError(f"cardinality of condition {i} must be a positive int, got {card!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(cards):
            raise ConfigError(f"k must be an int between 1 and the number of conditions ({len(cards)}), got {k!r}")
        if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
            raise ConfigError(f"min_count must be a positive int, got {min_count!r}")
        if names is not None:
            names = tuple(str(name) for name in names)
            if len(names) != len(cards):
                raise ConfigError(f"names has {len(names)} entries but there are {len(cards)} cardinalities")
        check_projection_cells(cards, k, names)
        self.cardinalities: tuple[int, ...] = cards
        self.k = k
        self.min_count = min_count
        self.names: tuple[str, ...] | None = names
        self.layout = ProjectionLayout(cards, k)
        total = self.layout.total
        with threads.sized(total):  # small kernels: one thread (see runtime.threads)
            if feasible is None:
                mask = torch.ones(total, dtype=torch.bool)
            else:
                if not isinstance(feasible, Tensor) or feasible.dtype != torch.bool or feasible.shape != (total,):
                    shown = tuple(feasible.shape) if isinstance(feasible, Tensor) else type(feasible).__name__
                    raise ConfigError(f"feasible must be a bool tensor of shape ({total},), got {shown}")
                mask = feasible.detach().to("cpu", copy=True)
            self.n_feasible = int(mask.sum())
            self._feasible = mask.to(self.device)
            self._card_tensor = torch.tensor(cards, dtype=torch.int64, device=self.device)
            self._offsets_all = torch.tensor(self.layout.offsets, dtype=torch.int64, device=self.device)
            #: the float64 radix weights and offsets of the matrix-product path: on an accelerator built with the
            #: paths (outside the update loop), on the CPU at their first use
            self._weights_f: Tensor | None = None
            self._offsets_f: Tensor | None = None
            self._index_dtype = torch.int32 if total < 2**31 else torch.int64
            self._set_paths()
            self.add_state("counts", torch.zeros(total, dtype=torch.int64), reduce="sum")

    # ------------------------------------------------------------------ configuration
    def _set_paths(self) -> None:
        on_cpu = self.device.type == "cpu"
        #: bincount on the CPU; index_add_ elsewhere (CUDA bincount syncs to read the maximum).
        self._use_bincount = on_cpu
        #: float64 matmul where supported (CPU, CUDA); exact integer gather otherwise (e.g. MPS).
        self._use_float_index = self.device.type in ("cpu", "cuda")
        #: condition groups and int16 keys (:mod:`.counting`) for large updates on the CPU
        self._use_groups = on_cpu
        if not on_cpu and self._use_float_index:  # built here, outside any update loop (a host-to-device copy)
            self._weights_f = _weight_matrix(self.layout, self.device)
            self._offsets_f = self.layout.offsets_tensor(torch.float64, self.device)
        elems = _CPU_CHUNK_ELEMS if on_cpu else _ACCEL_CHUNK_ELEMS
        # bincount materialises `total` bins per chunk: keep chunks at least twice that big.
        elems = min(max(elems, 2 * self.layout.total), _MAX_CHUNK_ELEMS)
        self.chunk_rows = max(1, elems // self.layout.n_subsets)

    def _move_buffers(self, device: torch.device) -> None:
        self._feasible = self._feasible.to(device)
        self._card_tensor = self._card_tensor.to(device)
        self._offsets_all = self._offsets_all.to(device)
        self._weights_f = self._offsets_f = None
        self._set_paths()

    @property
    def feasible(self) -> Tensor:
        """Boolean mask of feasible cells (flat layout)."""
        return self._feasible

    @property
    def total_cells(self) -> int:
        return self.layout.total

    def config(self) -> dict[str, Any]:
        """Cardinalities, k, min_count, names and the infeasible cells' flat indices."""
        infeasible = torch.nonzero(~self._feasible.cpu()).reshape(-1).tolist()
        return {
            "cardinalities": list(self.cardinalities),
            "k": self.k,
            "min_count": self.min_count,
            "infeasible": [int(i) for i in infeasible],
            "names": None if self.names is None else list(self.names),
        }

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], device: torch.device | str | None = None
    ) -> ScenarioCoverageEngine:
        layout_total = ProjectionLayout(tuple(int(c) for c in config["cardinalities"]), int(config["k"])).total
        feasible = torch.ones(layout_total, dtype=torch.bool)
        infeasible = [int(i) for i in config.get("infeasible", [])]
        if infeasible:
            if min(infeasible) < 0 or max(infeasible) >= layout_total:
                raise ValueError(f"infeasible cell indices must lie in 0..{layout_total - 1}")
            feasible[torch.tensor(infeasible, dtype=torch.int64)] = False
        return cls(
            [int(c) for c in config["cardinalities"]],
            k=int(config["k"]),
            min_count=int(config.get("min_count", 1)),
            feasible=feasible,
            device=device,
            names=config.get("names"),
        )

    # ------------------------------------------------------------------ update / compute
    def _condition_label(self, col: int) -> str:
        return f"condition {self.names[col]!r} (column {col})" if self.names else f"condition column {col}"

    def _check_codes(self, codes: Tensor) -> None:
        """One reduction and one host sync per call; the slow search runs only on bad input."""
        low, high = torch.aminmax(codes, dim=0)
        bad = (low < 0) | (high >= self._card_tensor)
        if not bool(bad.any()):
            return
        col = int(torch.nonzero(bad)[0, 0])
        column = codes[:, col]
        wrong = (column < 0) | (column >= self.cardinalities[col])
        row = int(torch.nonzero(wrong)[0, 0])
        raise DataError(
            f"scenario codes: {self._condition_label(col)} has value {int(column[row])} at row {row}, "
            f"outside 0..{self.cardinalities[col] - 1} (the domain has {self.cardinalities[col]} values); "
            f"encode values by their position in the condition's domain"
        )

    def update(self, codes: Tensor, *, validate: bool = True) -> None:
        """Count the scenarios of ``codes`` (integer tensor N × n, value = position in the domain).

        With ``validate`` (default) one range check per call costs one host sync; pass
        ``validate=False`` for trusted codes in a device loop (out-of-range codes then corrupt
        the counts or raise inside ``bincount``).
        """
        if not isinstance(codes, Tensor):
            raise DataError(f"scenario codes must be a torch.Tensor, got {type(codes).__name__}")
        if codes.dtype == torch.bool or codes.dtype.is_floating_point or codes.dtype.is_complex:
            raise DataError(f"scenario codes must be an integer tensor (positions in the domains), got {codes.dtype}")
        n = len(self.cardinalities)
        if codes.ndim != 2 or codes.shape[1] != n:
            raise DataError(
                f"scenario codes must have shape (rows, {n}) — one column per condition — got {tuple(codes.shape)}"
            )
        if codes.shape[0] == 0:
            return
        codes = codes.to(self.device, non_blocking=self.device.type != "cpu")  # a D2H copy must block
        if self.device.type != "cpu":
            self._update_indices(codes, validate)
            return
        with threads.host_bound():  # serial bincounts and small kernels (see runtime.threads)
            if self._by_groups(codes.shape[0]):
                self._update_groups(codes, validate)
            else:
                self._update_indices(codes, validate)

    def _update_indices(self, codes: Tensor, validate: bool) -> None:
        """One index per row and subset, one ``bincount`` (or ``index_add_``) per chunk of rows."""
        if validate:
            self._check_codes(codes)
        total = self.layout.total
        for start in range(0, codes.shape[0], self.chunk_rows):
            index = self._chunk_indices(codes[start : start + self.chunk_rows]).reshape(-1)
            if self._use_bincount:
                self.counts += torch.bincount(index, minlength=total)
            else:
                self.counts.index_add_(0, index, torch.ones_like(index, dtype=torch.int64))

    def _by_groups(self, rows: int) -> bool:
        subsets = self.layout.n_subsets
        indices = rows * subsets
        return self._use_groups and (indices >= GROUP_ALWAYS_INDICES or (
            indices >= GROUP_MIN_INDICES and rows >= GROUP_MIN_ROWS_PER_SUBSET * subsets))

    def _update_groups(self, codes: Tensor, validate: bool) -> None:
        """The CPU path of :meth:`update` (see :mod:`.counting`): validated, narrowed once, counted by groups.

        Validation: one pass over all codes for their overall range (which also proves the narrowing to
        the keys' dtype exact), and a per-condition maximum over the narrowed columns only when some
        condition has fewer values than the overall maximum; the exact search runs only on bad input.
        """
        plan = plan_for(self.cardinalities, self.k, codes.shape[0])
        if validate:
            low, high = (int(v) for v in torch.aminmax(codes))
            if low < 0 or high >= max(self.cardinalities):
                self._check_codes(codes)
        columns = column_major(codes, plan.dtype)
        if validate and high >= min(self.cardinalities) and bool((columns.amax(dim=1) >= self._card_tensor).any()):
            self._check_codes(codes)
        count_projections(columns, self.layout, plan, self.counts)

    def _chunk_indices(self, chunk: Tensor) -> Tensor:
        if self._use_float_index:
            if self._weights_f is None or self._offsets_f is None:
                self._weights_f = _weight_matrix(self.layout, self.device)
                self._offsets_f = self.layout.offsets_tensor(torch.float64, self.device)
            index = torch.addmm(self._offsets_f, chunk.to(torch.float64), self._weights_f)
            return index.to(self._index_dtype)
        return self.layout.cell_indices(chunk).to(self._index_dtype)

    def compute(self) -> ScenarioCoverageOutput:
        """Occupied/feasible masks, per-subset and overall coverage (covered feasible / feasible cells).

        Raises :class:`MetricError` when no cell is feasible (the restrictions exclude everything).
        """
        if self.n_feasible == 0:
            raise MetricError(
                f"scenario coverage is undefined: all {self.layout.total} k={self.k} projection cells are "
                f"infeasible; the restrictions exclude every scenario — relax them"
            )
        with threads.sized(self.layout.total):  # kernels over the cells, usually far fewer than 2**18
            return self._compute()

    def _compute(self) -> ScenarioCoverageOutput:
        counts = self.counts
        occupied = counts >= self.min_count
        feasible = self._feasible
        offsets = self._offsets_all
        covered_per = _segment_sums(occupied & feasible, offsets)
        total_per = _segment_sums(feasible, offsets)
        infeasible_per = _segment_sums(~feasible, offsets)
        occ_infeasible_per = _segment_sums(occupied & ~feasible, offsets)
        covered = covered_per.sum()
        total = total_per.sum()
        return ScenarioCoverageOutput(
            layout=self.layout,
            min_count=self.min_count,
            counts=counts.clone(),
            occupied=occupied,
            feasible=feasible.clone(),
            covered_per_subset=covered_per,
            total_per_subset=total_per,
            infeasible_per_subset=infeasible_per,
            occupied_infeasible_per_subset=occ_infeasible_per,
            covered=covered,
            total=total,
            value=covered.to(torch.float64) / total.to(torch.float64),
        )
