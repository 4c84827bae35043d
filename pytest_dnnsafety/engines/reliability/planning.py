"""Planning a reliability assessment: OP masses and cell selection on the grid, ball cells, cell types.

Part of :mod:`pytest_dnnsafety.engines.reliability`: :class:`CellPlanner` holds the planning steps
of :class:`~pytest_dnnsafety.engines.reliability.ReliabilityAssessor` (a mixin).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pytest_dnnsafety.engines.reliability.allocation import check_query_cap
from pytest_dnnsafety.engines.reliability.cells import (
    _CHUNK_ELEMS,
    CROSS,
    EMPTY,
    MAX_GRID_CELLS,
    NORMAL,
    NORMS,
    Grid,
    ReliabilityWarning,
    _ball_distances,
    _float_tuple,
    ball_types,
    nearest_labels,
    r_separation,
)
from pytest_dnnsafety.engines.reliability.sampler import ball_rows
from pytest_dnnsafety.engines.reliability.streamed import is_streamed
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.engines.reliability.profile import OperationalProfile, as_tensor_2d

#: Largest bootstrap matrix ``B × C`` (replicates × evaluated cells) held in memory (float64: 256 MiB);
#: beyond it the replicate masses are streamed over cells: per-cell variances, the per-replicate
#: rest and the bounds' per-replicate sums are accumulated chunk by chunk, so the peak memory no
#: longer grows with ``B · C`` (about 1.6 GB per million cells at ``B = 100`` otherwise).
HELD_REPLICATES = 1 << 25

#: ``radius="auto"`` for ball cells is capped at this fraction of the operational data's diameter
#: under the norm (of the ``clip`` range when given): ``min(eps_fraction · r̂, 0.1 · diameter)``.
AUTO_RADIUS_CAP = 0.1


def _labels_tensor(raw_y: Any, n: int, device: torch.device) -> Tensor:
    """Labels of ``n`` labelled inputs as a non-negative int64 vector (or a :class:`DataError`)."""
    y_lab = torch.as_tensor(raw_y.detach() if isinstance(raw_y, Tensor) else np.asarray(raw_y))
    y_lab = y_lab.reshape(-1).to(device)
    if y_lab.dtype.is_floating_point or y_lab.dtype == torch.bool:
        raise DataError(f"labels must be integer class indices, got dtype {y_lab.dtype}")
    if y_lab.shape[0] != n:
        raise DataError(f"labelled: {n} inputs but {y_lab.shape[0]} labels")
    if y_lab.numel() and int(y_lab.min()) < 0:
        raise DataError(f"labels must be non-negative class indices, found {int(y_lab.min())}. Fix: map the labels "
                        f"to 0..K-1 in the order of the model's outputs")
    return y_lab.to(torch.int64)


def _raw_tensor(x: Any) -> Tensor:
    """Labelled inputs as a tensor in their own shape (the model's input shape), for querying the model."""
    tensor = x.detach() if isinstance(x, Tensor) else torch.as_tensor(np.asarray(x))
    if tensor.ndim == 1:
        tensor = tensor[:, None]
    return tensor



class CellPlanner:
    """The planning half of :class:`~pytest_dnnsafety.engines.reliability.ReliabilityAssessor` (a mixin)."""

    # ------------------------------------------------------------------ ball cells
    def _init_balls(self, profile: Any, labelled: tuple[Any, Any] | None, *, radius: Any, eps: Any,
                    eps_fraction: Any, box: Any, bandwidth: Any, max_balls: Any, clip: Any,
                    device: torch.device | str | None) -> None:
        """Plan ``cells="balls"``: centres, radius, empirical OP, ball types and the sample corners."""
        if not (isinstance(eps, str) and eps == "auto"):
            raise ConfigError("eps is the grid's cell side; with cells='balls' give radius= (the ball radius) instead")
        if box is not None:
            raise ConfigError("box bounds the grid; cells='balls' needs none (give clip=(lo, hi) for the valid input "
                              "range)")
        if bandwidth is not None:
            raise ConfigError("bandwidth is a KDE setting; cells='balls' uses the empirical operational profile and "
                              "fits no KDE. Fix: drop bandwidth")
        if self.mass_target < 1.0 or self.max_cells is not None:
            raise ConfigError("mass_target/max_cells pick grid cells by OP mass, but every ball carries the same mass "
                              "1/M. Fix: use max_balls to evaluate a seeded subsample of the operational inputs")
        if is_streamed(profile) or is_streamed(labelled):  # read batch by batch, never held whole
            self._init_balls_streamed(profile, labelled, radius=radius, eps_fraction=eps_fraction,
                                      max_balls=max_balls, clip=clip, device=device)
            return
        # ---- centres: the raw operational inputs (input space)
        if isinstance(profile, OperationalProfile):
            # a latent profile keeps its raw inputs (profile.inputs): the balls live in input space
            self.device = profile.device if device is None else torch.device(device)
            raw_inputs = getattr(profile, "inputs", None)
            if raw_inputs is None:
                if profile.latent:
                    raise ConfigError(
                        "cells='balls' centres the balls on the raw operational inputs, but this profile holds only "
                        "their encodings. Fix: pass the raw operational inputs (N, *input_shape) as profile"
                    )
                raw_inputs = profile.points
            centres_all = as_tensor_2d(raw_inputs, "operational inputs", device=self.device, flatten=True)
            input_shape = tuple(raw_inputs.shape[1:]) if raw_inputs.ndim > 2 else tuple(profile.input_shape)
            if math.prod(input_shape) != centres_all.shape[1]:
                input_shape = (int(centres_all.shape[1]),)
        else:
            self.device = torch.device("cpu") if device is None else torch.device(device)
            shape = tuple(profile.shape) if isinstance(profile, (Tensor, np.ndarray)) else None
            centres_all = as_tensor_2d(profile, "operational data", device=self.device, flatten=True)
            if shape is None:
                shape = (centres_all.shape[0], *np.asarray(profile).shape[1:])
            input_shape = tuple(shape[1:]) if len(shape) > 1 else (1,)
        self.profile = profile if isinstance(profile, OperationalProfile) else None
        n_all, d = int(centres_all.shape[0]), int(centres_all.shape[1])
        self.n_operational = n_all
        flat = ball_rows(n_all, max_balls, self.seed)
        centres = centres_all[flat.to(self.device)]
        m = int(flat.shape[0])
        # ---- valid input range
        if clip is not None:
            lo_c, hi_c = self._check_clip(clip)
            outside = ((centres_all < lo_c) | (centres_all > hi_c)).any(1)
            if bool(outside.any()):
                row = int(torch.nonzero(outside)[0, 0])
                raise DataError(f"operational input {row} lies outside clip=({lo_c:g}, {hi_c:g}). Fix: widen clip to "
                                f"the inputs' valid range or rescale the data")
            self.clip = (lo_c, hi_c)
        # ---- labelled points (input space, flattened) and r̂ under the norm
        if labelled is not None:
            if not isinstance(labelled, (tuple, list)) or len(labelled) != 2:
                raise DataError("labelled must be a pair (inputs, labels)")
            self._x_lab_raw = _raw_tensor(labelled[0])
            z_lab = as_tensor_2d(labelled[0], "labelled inputs", device=self.device, flatten=True)
            if z_lab.shape[1] != d:
                raise DataError(f"labelled inputs have {z_lab.shape[1]} values each, the operational inputs {d}")
            if self._x_lab_raw.ndim > 2 and len(input_shape) == 1:
                # the model's input shape: the labelled inputs' when the operational data came flat
                input_shape = tuple(self._x_lab_raw.shape[1:])
            y_lab = _labels_tensor(labelled[1], z_lab.shape[0], self.device)
            self.r_hat = r_separation(z_lab, y_lab, norm=self.norm)
        else:
            z_lab, y_lab = None, None
            self.r_hat = float("nan")
        self._z_lab, self._y_lab = z_lab, y_lab
        span = None
        if self._needs_span(radius):  # radius="auto": capped by the data's (or clip's) diameter
            span = (torch.full((d,), hi_c - lo_c, dtype=torch.float64) if self.clip is not None
                    else (centres_all.max(0).values - centres_all.min(0).values).cpu())
        value = self._ball_radius(radius, eps_fraction, span)
        op = self._ball_op(m, flat)
        # ---- types: labelled points inside each (closed) ball, chunked distance matrices
        types = torch.full((m,), EMPTY, dtype=torch.int64, device=self.device)
        labels = torch.full((m,), -1, dtype=torch.int64, device=self.device)
        if z_lab is not None and y_lab is not None and y_lab.numel():
            n_lab = int(z_lab.shape[0])
            onehot = torch.nn.functional.one_hot(y_lab, int(y_lab.max()) + 1).to(torch.float64)
            chunk = max(1, min(_CHUNK_ELEMS // n_lab, 4 * _CHUNK_ELEMS // (n_lab * d)))
            for start in range(0, m, chunk):
                stop = min(m, start + chunk)
                inside = (_ball_distances(centres[start:stop], z_lab, self.norm) <= value).to(torch.float64)
                present = (inside @ onehot) > 0  # (c, K): classes with a labelled point in the ball
                types[start:stop], labels[start:stop] = ball_types(present)
        if self.empty_cell_label == "nearest":
            labels = self._label_empty_by_nearest(types, labels, centres)
        self._types, self._labels = types, labels
        # ---- samples
        self._allocate(op, types)
        # the sampler computes each batch's ball corners from the centres it touches (no cells × d table)
        self._centres = centres
        self._centre_absmax = float(centres.abs().max()) if centres.numel() else 0.0
        self._sample_dim = d
        self._input_shape = input_shape

    @staticmethod
    def _check_clip(clip: Any) -> tuple[float, float]:
        if not isinstance(clip, (tuple, list)) or len(clip) != 2:
            raise ConfigError(f"clip must be a pair (lo, hi) of the valid input range, e.g. (0, 1), got {clip!r}")
        lo_c, hi_c = _float_tuple(clip, 2, "clip")
        if not lo_c < hi_c:
            raise ConfigError(f"clip: lo {lo_c} must be below hi {hi_c}")
        return lo_c, hi_c

    @staticmethod
    def _needs_span(radius: Any) -> bool:
        return radius is None or (isinstance(radius, str) and radius == "auto")

    def _ball_radius(self, radius: Any, eps_fraction: Any, span: Tensor | None) -> float:
        """The ball radius: given, or ``min(eps_fraction · r̂, cap)`` below r̂ (``span``: the range per value)."""
        if radius is None or (isinstance(radius, str) and radius == "auto"):
            if not math.isfinite(self.r_hat):
                raise ConfigError(
                    "radius='auto' (the default for cells='balls') takes r̂ under the chosen norm, which needs "
                    "labelled points of at least two classes. Fix: pass labelled=(x, y) or give radius (e.g. 0.05)"
                )
            if self.r_hat <= 0:
                raise ConfigError("r̂ is 0: two labelled points of different classes coincide; give radius")
            if isinstance(eps_fraction, bool) or not isinstance(eps_fraction, (int, float)) or eps_fraction <= 0:
                raise ConfigError(f"eps_fraction must be a positive number, got {eps_fraction!r}")
            assert span is not None
            diameter = float(span.max()) if self.norm == "linf" else float(span.norm())
            cap = AUTO_RADIUS_CAP * diameter if diameter > 0 else math.inf
            value = min(math.nextafter(float(eps_fraction) * self.r_hat, 0.0), cap)
        else:
            if isinstance(radius, bool) or not isinstance(radius, (int, float, np.floating)) \
                    or not math.isfinite(float(radius)) or float(radius) <= 0:
                raise ConfigError(f"radius must be a positive finite number or 'auto', got {radius!r}")
            value = float(radius)
        self.radius = value
        self.eps_exceeds_r = bool(math.isfinite(self.r_hat) and value >= self.r_hat)
        if self.eps_exceeds_r:
            warnings.warn(
                f"ball radius {value:.6g} ≥ r̂={self.r_hat:.6g} ({NORMS[self.norm]}): balls may contain inputs of "
                f"different ground-truth classes (Assumption 4). Use radius='auto' or a smaller radius",
                ReliabilityWarning,
                stacklevel=4,
            )
        return value

    def _ball_op(self, m: int, flat: Tensor) -> Tensor:
        """Empirical OP ``1/M`` per ball and its multinomial (bootstrap) uncertainty; sets the mass fields."""
        op = torch.full((m,), 1.0 / m, dtype=torch.float64)
        if self.bootstrap >= 2:
            gen = torch.Generator().manual_seed(int(self.seed))
            idx = torch.randint(0, m, (self.bootstrap, m), generator=gen)
            weights = torch.zeros(self.bootstrap, m, dtype=torch.float64)
            weights.scatter_add_(1, idx, torch.ones(self.bootstrap, m, dtype=torch.float64))
            reps: Tensor | None = weights / m
            rest_reps: Tensor | None = torch.zeros(self.bootstrap, dtype=torch.float64)
            op_var = torch.full((m,), (1.0 / m) * (1.0 - 1.0 / m) / m, dtype=torch.float64)
        else:
            reps, rest_reps, op_var = None, None, torch.zeros(m, dtype=torch.float64)
        self.rest, self.mass_evaluated, self.labelled_outside_box = 0.0, 1.0, 0
        self._flat, self._op, self._op_var, self._reps, self._rest_reps = flat, op, op_var, reps, rest_reps
        return op

    def _label_empty_by_nearest(self, types: Tensor, labels: Tensor, centres: Tensor,
                                empty: Tensor | None = None) -> Tensor:
        """``empty_cell_label="nearest"``: empty cells take the label of the labelled point nearest their centre.

        ``centres`` are all cells' centres, or (with ``empty``, their indices) only the empty cells'.
        """
        if self._z_lab is None or self._y_lab is None or not self._y_lab.numel():
            raise ConfigError("empty_cell_label='nearest' labels empty cells from the labelled points; none were "
                              "given. Fix: pass labelled=(x, y) or use empty_cell_label='model'")
        if empty is None:
            empty = torch.nonzero(types == EMPTY).reshape(-1)
            centres = centres[empty.to(centres.device)]
        labels = labels.clone()
        labels[empty.to(labels.device)] = nearest_labels(centres, self._z_lab, self._y_lab).to(labels.device)
        return labels

    def _allocate(self, op: Tensor, types: Tensor) -> None:
        """Samples per sampled (non-cross) cell: ``samples_per_cell`` each, the same budget spread ∝ ``Op_i``, or
        (``allocation="adaptive"``) the pilot's ``n₀`` per cell — the final stage is planned from the pilot
        (:meth:`~pytest_dnnsafety.engines.reliability.sampler.MonteCarloSampler._plan_final`)."""
        sampled = torch.nonzero(types != CROSS).reshape(-1).cpu()
        self._sampled = sampled
        n_s = sampled.numel()
        self._per_cell: int | None = None  # every cell the same n: the sampler's fast path
        self._stream_seed = self.seed  # block generators of the (only, or final) stage
        self._strata: Tensor | None = None
        self.queries_pilot = 0
        self.allocation_plan: dict[str, Any] | None = None
        if self.allocation == "uniform" or n_s == 0:
            trials = torch.full((n_s,), self.samples_per_cell, dtype=torch.int64)
            self._per_cell = self.samples_per_cell
        elif self.allocation == "adaptive":
            if self.query_budget is None and self.target_width is None:  # the documented default: the uniform budget
                self.query_budget = max(2, self.samples_per_cell) * n_s
            budget = self.query_budget
            if self.pilot_samples is not None:
                n0 = self.pilot_samples
            elif budget is not None:
                n0 = max(1, int(self.pilot_fraction * budget) // n_s)
            else:
                n0 = max(1, round(self.pilot_fraction * self.samples_per_cell))
            if budget is not None and budget < (n0 + 1) * n_s:
                raise ConfigError(
                    f"query_budget={budget:,} cannot pay a pilot of {n0} samples per cell and one final sample in "
                    f"each of the {n_s:,} sampled cells ({(n0 + 1) * n_s:,} queries). Fix: query_budget ≥ "
                    f"{(n0 + 1) * n_s:,}, fewer pilot_samples, or fewer cells (mass_target/max_cells, a larger eps)"
                )
            if budget is not None:
                check_query_cap(budget, self.max_queries, f"query_budget={budget:,}",
                                f"a query_budget of at most {self.max_queries:,}")
            check_query_cap(n0 * n_s, self.max_queries, f"the adaptive pilot ({n0:,} samples in each of {n_s:,} "
                            f"cells)", "fewer pilot_samples (or a smaller pilot_fraction), or fewer cells "
                            "(mass_target, max_cells, a larger eps)")
            self._pilot_n = n0
            trials = torch.full((n_s,), n0, dtype=torch.int64)
            self._per_cell = n0
            self._labels_planned = self._labels.clone()
        else:
            budget = self.samples_per_cell * n_s
            op_s = op.cpu()[sampled]
            total = float(op_s.sum())
            share_s = op_s / total if total > 0 else torch.full_like(op_s, 1.0 / n_s)
            trials = torch.round(share_s * budget).to(torch.int64).clamp_min(1)
        if self.allocation != "adaptive":
            check_query_cap(int(trials.sum()), self.max_queries,
                            f"allocation={self.allocation!r} ({self.samples_per_cell:,} samples per cell × {n_s:,} "
                            f"cells)", "fewer samples_per_cell, fewer cells (mass_target, max_cells, a larger eps), "
                            "or allocation='adaptive' with a query_budget")
        self._trials = trials
        self._ends = torch.cumsum(trials, 0)

    def _estimate_cost(self) -> tuple[float, int]:
        """Peak memory (bytes, roughly) and Monte Carlo queries of planning and assessing this grid.

        The bootstrap's replicate masses ``(B, C)`` float64 of the ``C`` evaluated cells dominate
        while they are held (up to :data:`HELD_REPLICATES` entries; streamed beyond), then about 24
        float64-sized values per cell (masses, variances, types, labels, sample
        counts, the per-cell table with its corners, the engine's histograms) and the mass scan.
        """
        cells = self.grid.n_cells if self.max_cells is None else min(self.grid.n_cells, self.max_cells)
        reps = self.bootstrap * cells * 8 * (2 if self.bootstrap >= 2 else 0)  # the matrix and one temporary
        if self.profile.bandwidth is not None and self.bootstrap * cells > HELD_REPLICATES:
            reps = 4 * _CHUNK_ELEMS * 8  # streamed over cells: a few chunks at a time
        per_cell = cells * 8 * (24 + 2 * self.grid.dim)
        if self.allocation == "adaptive" and self.query_budget is not None:
            queries = self.query_budget
        else:
            queries = self.samples_per_cell * cells
        return float(reps + per_cell + 4 * self.grid.n_cells * 8), int(queries)

    def _warn_cost(self, limit: float = 2 * 2**30) -> None:
        """A :class:`ReliabilityWarning` with the estimated memory and model queries when a grid is large."""
        memory, queries = self._estimate_cost()
        if memory <= limit and queries <= 10**9:
            return
        cells = self.grid.n_cells if self.max_cells is None else min(self.grid.n_cells, self.max_cells)
        warnings.warn(
            f"the grid {' × '.join(map(str, self.grid.shape))} evaluates up to {cells:,} cells: planning and "
            f"assessing it will take about {memory / 2**30:.1f} GiB of memory (bootstrap={self.bootstrap} replicate "
            f"masses or the per-cell tables dominate) and {queries:.3g} model queries (about {queries / 5e6 / 60:.0f} min at "
            f"5·10⁶ queries/s). Fix: fewer bootstrap refits (bootstrap=20), fewer cells (max_cells, mass_target, a "
            f"larger eps), or allocation='adaptive' with a query_budget",
            ReliabilityWarning,
            stacklevel=4,
        )

    def _centre_rows(self, lo: int, hi: int) -> Tensor:
        """Centres ``(hi - lo, d)`` of the sampled balls ``lo..hi-1`` (in sampling order)."""
        if self._centres is None:  # streamed: a window over the centre loader
            return self._window(lo, hi)
        return self._centres[self._sampled[lo:hi].to(self._centres.device)]

    def _to_input(self, z: Tensor) -> Tensor:
        """Sampled points ``(B, d)`` → model inputs (decoded for latent grids, reshaped for balls)."""
        if self.cell_kind == "balls":
            return z.reshape(z.shape[0], *self._input_shape)
        return self.profile.decode(z)


    # ------------------------------------------------------------------ planning
    def _mass_tables(self) -> list[Tensor] | None:
        if self.profile.bandwidth is None:
            if self.mass == "exact":
                self.profile._require_diagonal("mass='exact'")
            return None
        edges = [self.grid.edges(k, self.profile.device) for k in range(self.grid.dim)]
        return self.profile.axis_factors(edges, self.mass)

    def _replicate_chunks(self) -> Iterable[tuple[int, Tensor]]:
        """Replicate masses ``(B, c)`` of the evaluated cells, chunk by chunk (only when not held; see
        :data:`HELD_REPLICATES`): ``W_b · Π_k F_k[:, i_k] / N`` over the replicate's box total (and, with
        ``conservative_rest=False``, over its evaluated total), exactly as the held matrix."""
        assert self._streamed is not None
        st = self._streamed
        tables, weights, flat = st["tables"], st["weights"], st["flat"]
        div = (st["totals"] * st["scale"])[:, None] * self.profile.n
        chunk = max(1, _CHUNK_ELEMS // max(1, self.profile.n, self.bootstrap))
        for start in range(0, int(flat.shape[0]), chunk):
            prod = self._product(tables, flat[start : start + chunk])  # (N, c)
            yield start, (weights @ prod) / div

    def _product(self, tables: list[Tensor], flat: Tensor) -> Tensor:
        """``Π_k F_k[:, i_k]`` for the cells ``flat``: ``(N, C)``."""
        idx = self.grid.unravel(flat.to(tables[0].device))
        prod = tables[0][:, idx[:, 0]]
        for k in range(1, len(tables)):
            prod = prod * tables[k][:, idx[:, k]]
        return prod

    def _iter_point_masses(self, tables: list[Tensor] | None) -> Iterable[tuple[int, Tensor]]:
        """Unnormalised point masses of all grid cells, in flat order, chunk by chunk.

        With per-axis tables ``F_k`` (diagonal kernels) the masses of a block of rows of the
        first ``d − 1`` axes are one matrix product: ``(Π_{k<d} F_k[:, i_k])ᵀ F_d / N``.
        """
        grid, n = self.grid, self.profile.n
        n_cells = grid.n_cells
        dev = self.profile.device
        if tables is None:
            chunk = max(1, _CHUNK_ELEMS // max(1, n * grid.dim))
            for start in range(0, n_cells, chunk):
                flat = torch.arange(start, min(n_cells, start + chunk), device=dev)
                lo, hi = grid.bounds(flat)
                yield start, self.profile.centre_mass(lo, hi)
            return
        if grid.dim == 1:
            yield 0, tables[0].mean(0)
            return
        last = tables[-1]
        n_last = grid.shape[-1]
        outer = n_cells // n_last
        outer_grid = Grid(grid.lower[:-1], grid.upper[:-1], grid.eps[:-1])
        rows = max(1, _CHUNK_ELEMS // max(1, n + n_last))
        for r0 in range(0, outer, rows):
            r1 = min(outer, r0 + rows)
            idx = outer_grid.unravel(torch.arange(r0, r1, device=dev))
            prod = tables[0][:, idx[:, 0]]
            for k in range(1, grid.dim - 1):
                prod = prod * tables[k][:, idx[:, k]]
            yield r0 * n_last, (prod.T @ last).reshape(-1) / n

    def _plan(self) -> None:
        grid, profile = self.grid, self.profile
        tables = self._mass_tables()
        self._tables = tables
        # ---- point masses, selection by descending mass
        keep = self.max_cells if self.grid.n_cells > MAX_GRID_CELLS else None
        box_total = 0.0
        best_mass = torch.empty(0, dtype=torch.float64, device=profile.device)
        best_flat = torch.empty(0, dtype=torch.int64, device=profile.device)
        mass_parts: list[Tensor] = []
        flat_parts: list[Tensor] = []
        for start, masses in self._iter_point_masses(tables):
            box_total += float(masses.sum())
            flat = torch.arange(start, start + masses.shape[0], device=profile.device)
            if keep is not None:
                if masses.shape[0] > keep:
                    top = torch.topk(masses, keep)
                    masses, flat = top.values, flat[top.indices]
                best_mass = torch.cat([best_mass, masses])
                best_flat = torch.cat([best_flat, flat])
                if best_mass.shape[0] > keep:
                    top = torch.topk(best_mass, keep)
                    best_mass, best_flat = top.values, best_flat[top.indices]
            else:
                mass_parts.append(masses)
                flat_parts.append(flat)
        if keep is None:
            best_mass, best_flat = torch.cat(mass_parts), torch.cat(flat_parts)
        if tables is not None:
            per_kernel_total = torch.stack([t.sum(1) for t in tables]).prod(0)  # (N,) box mass of each kernel
            box_total = float(per_kernel_total.mean())
        else:
            per_kernel_total = None
        if box_total <= 0:
            raise MetricError(
                f"the operational profile puts no mass in the box {grid.lower}–{grid.upper}. Fix: choose a box "
                f"that covers the operational data"
            )
        self.box_mass = box_total
        order = torch.argsort(best_mass, descending=True, stable=True)
        best_mass, best_flat = best_mass[order], best_flat[order]
        norm = box_total if self.normalize else 1.0
        share = best_mass / norm
        count = best_mass.shape[0]
        if self.mass_target < 1.0:
            csum = torch.cumsum(share, 0)
            count = min(count, int(torch.searchsorted(csum, torch.tensor(self.mass_target * (1 - 1e-12),
                                                                          dtype=torch.float64,
                                                                          device=csum.device))) + 1)
        if self.max_cells is not None:
            count = min(count, self.max_cells)
        flat = best_flat[:count]
        op = share[:count]
        # ---- bootstrap replicates of the selected cells (Appendix A), normalised per replicate
        reps: Tensor | None = None
        rest_reps: Tensor | None = None
        self._streamed: dict[str, Any] | None = None
        self._op_alloc: Tensor | None = None  # streamed: each cell's largest replicate mass
        if self.bootstrap >= 2:
            weights = profile.bootstrap_weights(self.bootstrap, self.seed, getattr(self, "bootstrap_size", "full"))
            if tables is not None and self.bootstrap * count > HELD_REPLICATES:
                # too many cells to hold (B, C): per-cell and per-replicate figures chunk by chunk now,
                # the replicate masses recomputed chunk by chunk where the bound needs them (finish)
                assert per_kernel_total is not None
                totals = weights @ per_kernel_total / profile.n if self.normalize else \
                    torch.ones(self.bootstrap, dtype=torch.float64, device=profile.device)
                self._streamed = {"tables": tables, "weights": weights, "totals": totals, "flat": flat,
                                  "scale": torch.ones_like(totals)}
                op_var = torch.empty_like(op)
                alloc = torch.empty_like(op)
                mass = torch.zeros_like(totals)
                for start, chunk in self._replicate_chunks():
                    op_var[start : start + chunk.shape[1]] = chunk.var(0, unbiased=True)
                    alloc[start : start + chunk.shape[1]] = chunk.max(0).values
                    mass += chunk.sum(1)
                rest_reps = (1.0 - mass).clamp_min(0.0)
                if not self.conservative_rest:  # replicate b's masses over its own evaluated total
                    self._streamed["scale"] = mass
                    alloc = alloc / float(mass.min())
                self._op_alloc = alloc
            elif tables is not None:
                assert per_kernel_total is not None
                totals = weights @ per_kernel_total / profile.n  # (B,)
                reps = torch.empty(self.bootstrap, count, dtype=torch.float64, device=profile.device)
                if grid.dim == 2 and 4 * count >= grid.n_cells and grid.n_cells <= MAX_GRID_CELLS:
                    # all refits of a 2-D grid: (A_1ᵀ diag(W_b) A_2) / N, a batched matrix product
                    a1t, a2 = tables[0].T, tables[1]
                    per = max(1, _CHUNK_ELEMS // max(1, a1t.numel()))
                    for b0 in range(0, self.bootstrap, per):
                        w = weights[b0 : b0 + per]
                        full = torch.matmul(a1t[None, :, :] * w[:, None, :], a2) / profile.n
                        reps[b0 : b0 + per] = full.reshape(w.shape[0], -1)[:, flat]
                else:
                    chunk = max(1, _CHUNK_ELEMS // max(1, profile.n))
                    for start in range(0, count, chunk):
                        prod = self._product(tables, flat[start : start + chunk])  # (N, c)
                        reps[:, start : start + chunk] = weights @ prod / profile.n
            else:
                totals = torch.zeros(self.bootstrap, dtype=torch.float64, device=profile.device)
                chunk = max(1, _CHUNK_ELEMS // max(1, profile.n * grid.dim))
                for start in range(0, grid.n_cells, chunk):
                    cells = torch.arange(start, min(grid.n_cells, start + chunk), device=profile.device)
                    lo, hi = grid.bounds(cells)
                    totals += profile.centre_mass(lo, hi, weights).sum(1)
                lo, hi = grid.bounds(flat)
                reps = profile.centre_mass(lo, hi, weights)
            if reps is not None:
                if self.normalize:
                    reps = reps / totals[:, None]
                rest_reps = (1.0 - reps.sum(1)).clamp_min(0.0)
        if self._streamed is None:
            op_var = reps.var(0, unbiased=True) if reps is not None else torch.zeros_like(op)
        rest = max(0.0, 1.0 - float(op.sum()))
        if not self.conservative_rest:
            scale = float(op.sum())
            if scale <= 0:
                raise MetricError("the evaluated cells carry no OP mass, so their average pmi is undefined; "
                                  "Fix: raise mass_target/max_cells or use conservative_rest=True")
            op, op_var = op / scale, op_var / scale**2
            if reps is not None:
                reps = reps / reps.sum(1, keepdim=True)
                rest_reps = torch.zeros(reps.shape[0], dtype=torch.float64, device=reps.device)
            elif self._streamed is not None:
                rest_reps = torch.zeros(self.bootstrap, dtype=torch.float64, device=op.device)
        self.mass_evaluated = float(share[:count].sum())
        self.rest = rest
        self._flat, self._op, self._op_var, self._reps, self._rest_reps = flat, op, op_var, reps, rest_reps
        # ---- cell types from the labelled points
        types = torch.full((count,), EMPTY, dtype=torch.int64, device=profile.device)
        labels = torch.full((count,), -1, dtype=torch.int64, device=profile.device)
        self.labelled_outside_box = 0
        if self._z_lab is not None and self._y_lab is not None and self._y_lab.numel():
            where = grid.locate(self._z_lab)
            inside = where >= 0
            self.labelled_outside_box = int((~inside).sum())
            k_lab = int(self._y_lab.max()) + 1
            key = torch.unique(where[inside] * k_lab + self._y_lab[inside])  # sorted
            key_cell, key_label = key // k_lab, key % k_lab
            cells_u, distinct = torch.unique_consecutive(key_cell, return_counts=True)
            first = torch.cumsum(distinct, 0) - distinct
            first_label = key_label[first]
            pos = torch.searchsorted(cells_u, flat).clamp_max(max(cells_u.numel() - 1, 0))
            found = cells_u.numel() > 0
            if found:
                hit = cells_u[pos] == flat
                types = torch.where(hit, torch.where(distinct[pos] > 1, CROSS, NORMAL), types)
                labels = torch.where(hit & (distinct[pos] == 1), first_label[pos], labels)
        if self.empty_cell_label == "nearest":
            empty = torch.nonzero(types == EMPTY).reshape(-1)
            centres = grid.centres(flat[empty]) if empty.numel() else torch.zeros(0, grid.dim, dtype=torch.float64)
            labels = self._label_empty_by_nearest(types, labels, centres, empty)
        self._types, self._labels = types, labels
        # ---- sample allocation over the sampled (non-cross) cells
        self._allocate(op, types)
        lo, hi = grid.bounds(flat[self._sampled.to(flat.device)].to(profile.device))
        self._sample_lower, self._sample_width = lo, hi - lo
        self._sample_dim = grid.dim
