"""The Monte Carlo sampler of the reliability assessment (eqs. 13–14): block-seeded cell samples, model batches.

Part of :mod:`pytest_dnnsafety.engines.reliability`: :class:`MonteCarloSampler` holds the sampling
steps of :class:`~pytest_dnnsafety.engines.reliability.ReliabilityAssessor` (a mixin; the plan it
samples is made by :class:`~pytest_dnnsafety.engines.reliability.planning.CellPlanner`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from pytest_dnnsafety.runtime import progress
from pytest_dnnsafety.engines.reliability.allocation import check_query_cap, plan_adaptive
from pytest_dnnsafety.data.checks import check_count
from pytest_dnnsafety.engines.reliability.cells import CROSS
from pytest_dnnsafety.engines.reliability.model import _check_label_bounds, _check_label_range, _ModelAdapter
from pytest_dnnsafety.engines.reliability.tally import CellTallyEngine
from pytest_dnnsafety.errors import ConfigError, DataError

#: Samples per random block: each block of the (cell, sample) stream has its own generator.
BLOCK = 4096

#: Ball cells in many dimensions (images) cut the stream into smaller blocks: at most this many input
#: values per block (a power of two of samples, at most :data:`BLOCK`; 4 MiB of float32) above 1,024
#: dimensions; up to 1,024 a block is :data:`BLOCK` samples, as for grids; a 3×32×32 image gets 256 samples per
#: block and a 3×224×224 image 4, so a model batch of images need not hold thousands of them (a CPU
#: runs a ResNet on 3×32×32 about twice as fast per image in batches of 256 as in batches of 2,048).
BLOCK_ELEMS = 1 << 20

#: ``batch_size="auto"`` for ball cells: the first model batch holds about this many input values
#: (8 MiB of float32 on a CPU; 16× that on an accelerator), in whole blocks — on a CPU 512 images of
#: 3×32×32 (two blocks), 12 of 3×224×224 (three blocks); the autotune then tries ½×, 2× and 4× that.
BALL_BATCH_ELEMS = 1 << 21

#: Ball cells: a batch touching at most this many cells (or at least :data:`SEGMENT_MIN` samples per
#: touched cell on average) shifts and scales its samples in place, one cell's slice at a time (no
#: gathered ``(B, d)`` copy of the corners); otherwise the touched corners are gathered to its rows.
SEGMENT_RUNS = 256
SEGMENT_MIN = 64


def ball_rows(n_all: int, max_balls: Any, seed: int) -> Tensor:
    """The sorted operational rows that get a ball: all ``n_all``, or ``max_balls`` of them drawn with ``seed``."""
    if max_balls is not None and check_count(max_balls, "max_balls", 1) < n_all:
        gen = torch.Generator().manual_seed(_mix(seed, -2))
        return torch.randperm(n_all, generator=gen)[: int(max_balls)].sort().values
    return torch.arange(n_all)


def block_size(cell_kind: str, dim: int) -> int:
    """Samples per random block: :data:`BLOCK`, or for ball cells of more than 1,024 values the largest power
    of two with ``block · dim ≤`` :data:`BLOCK_ELEMS` (at least 1, at most :data:`BLOCK`); up to 1,024 values
    per input the blocks, hence the samples, are those of earlier releases."""
    if cell_kind != "balls" or dim <= 1024:
        return BLOCK
    return min(BLOCK, 1 << max(0, (BLOCK_ELEMS // max(1, dim)).bit_length() - 1))

_MIX = 0x9E3779B97F4A7C15


def _mix(seed: int, block: int) -> int:
    return (int(seed) * 1_000_003 + (block + 1) * _MIX) % (2**63 - 1)


class MonteCarloSampler:
    """The Monte Carlo half of :class:`~pytest_dnnsafety.engines.reliability.ReliabilityAssessor` (a mixin)."""

    @property
    def n_sampled_cells(self) -> int:
        return int(self._sampled.numel())

    @property
    def total_samples(self) -> int:
        return int(self._ends[-1]) if self._ends.numel() else 0

    def new_engine(self, num_classes: int) -> CellTallyEngine:
        """An empty :class:`CellTallyEngine` sized for this plan."""
        return CellTallyEngine(self.n_sampled_cells, num_classes, device=self.device)

    @property
    def _block(self) -> int:
        values = self._model_values()  # a latent grid decodes to the model's inputs: blocks sized by those
        return block_size("balls", values) if values > 1024 else block_size(self.cell_kind, self._sample_dim)

    def _model_values(self) -> int:
        """Values per model input: the sampled dimension, or for a latent grid the decoded input's size."""
        profile = getattr(self, "profile", None)
        if self.cell_kind != "balls" and profile is not None and profile.latent:
            return max(self._sample_dim, math.prod(profile.input_shape))
        return self._sample_dim

    def _sample_dtype(self) -> torch.dtype:
        if self.cell_kind == "balls":
            assert self.radius is not None
            span = self._centre_absmax + self.radius
            return torch.float64 if span / self.radius > 2**16 else torch.float32
        span = max(max(abs(v) for v in self.grid.lower), max(abs(v) for v in self.grid.upper))
        return torch.float64 if span / min(self.grid.eps) > 2**16 else torch.float32

    def _batch_inputs(self, first: int, last: int, dtype: torch.dtype, corners: Tensor | None
                      ) -> tuple[Tensor, Tensor, tuple[int, int]]:
        """Cells (relative to the touched range), latent inputs and the touched cell range ``[lo, hi)`` of blocks
        ``first..last - 1``.

        Each block draws its uniforms from its own generator seeded by ``(seed, block)``, so a
        sample does not depend on which batch or worker processes its block. Grid cells take their
        corners from ``corners`` ``(C, 2d)``; ball cells compute theirs from the touched centres
        only (:meth:`_ball_corners`), so nothing of size ``cells × d`` is held.
        """
        size = self._block
        start, stop = first * size, min(self.total_samples, last * size)
        d = self._sample_dim
        l2 = self.cell_kind == "balls" and self.norm == "l2"
        u = torch.empty(stop - start, d, dtype=dtype, device=self.device)
        rad = torch.empty(stop - start, 1, dtype=dtype, device=self.device) if l2 else None
        gen = self._generator
        for block in range(first, last):
            lo = block * size - start
            hi = min(stop - start, lo + size)
            gen.manual_seed(_mix(self._stream_seed, block))
            if rad is not None:  # L2 ball: Gaussian direction, then the radius quantile
                torch.randn(hi - lo, d, generator=gen, dtype=dtype, device=self.device, out=u[lo:hi])
                torch.rand(hi - lo, 1, generator=gen, dtype=dtype, device=self.device, out=rad[lo:hi])
            else:
                torch.rand(hi - lo, d, generator=gen, dtype=dtype, device=self.device, out=u[lo:hi])
        # the cells the batch touches and how many of its samples fall in each (the first and last
        # cell may be cut by the batch edges); corners and cell indices are expanded by repetition
        if self._per_cell is not None:
            n = self._per_cell
            lo, hi = start // n, (stop - 1) // n + 1
            cell_starts = torch.arange(lo, hi, dtype=torch.int64) * n
            cell_ends = cell_starts + n
        else:
            ends = self._ends
            lo = int(torch.searchsorted(ends, torch.tensor(start), right=True))
            hi = int(torch.searchsorted(ends, torch.tensor(stop - 1), right=True)) + 1
            cell_ends = ends[lo:hi]
            cell_starts = cell_ends - self._trials[lo:hi]
        counts = cell_ends.clamp_max(stop) - cell_starts.clamp_min(start)  # host-built, per touched cell
        # an asynchronous copy (pageable source, consumed before the call returns)
        reps = counts.to(self.device, non_blocking=True)
        count = stop - start
        local = torch.arange(hi - lo, device=self.device).repeat_interleave(reps, output_size=count)
        if self.cell_kind == "balls":
            lower, width = self._ball_corners(lo, hi, dtype)  # (hi - lo, d) each
            if hi - lo <= SEGMENT_RUNS or count >= SEGMENT_MIN * (hi - lo):  # in place, slice by slice
                lower_rows = width_rows = None
            else:  # advanced indexing (CPU index_select is many times slower on wide rows)
                lower_rows, width_rows = lower[local], None if l2 else width[local]
        else:
            assert corners is not None
            picked = corners[lo:hi].repeat_interleave(reps, dim=0, output_size=count)  # (B, 2d): lower | width
            lower_rows, width_rows = picked[:, :d], picked[:, d:]
        if rad is not None:  # uniform in the L2 ball: centre + ε · U^{1/d} · g/‖g‖
            assert self.radius is not None
            scale = rad.pow_(1.0 / d).mul_(self.radius).div_(torch.linalg.vector_norm(u, dim=1, keepdim=True)
                                                             .clamp_min(torch.finfo(dtype).tiny))
            u.mul_(scale)
        if lower_rows is None:
            pos = 0
            for j, run in enumerate(counts.tolist()):  # host list: no device sync
                if rad is None:
                    u[pos : pos + run].mul_(width[j])
                u[pos : pos + run].add_(lower[j])
                pos += run
            z = u
        elif rad is not None:
            z = u.add_(lower_rows)
        else:
            z = u.mul_(width_rows).add_(lower_rows)
        if self.clip is not None:  # exact for L∞ (the sampled box is already clipped; guards rounding)
            z = z.clamp_(self.clip[0], self.clip[1])
        return local, z, (lo, hi)

    def _ball_corners(self, lo: int, hi: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Lower corners and widths ``(hi - lo, d)`` (sampling dtype, on the device) of sampled balls ``lo..hi-1``.

        L∞: the ball ∩ ``clip`` is the box ``[max(c − ε, lo), min(c + ε, hi)]``; L2: the centre and an
        empty ``(hi - lo, 0)`` width (samples are centre + radius · direction). Computed from the
        centres of these balls only, in the centres' dtype, then cast — the values a table of all
        corners held in earlier releases gave, bit for bit — and kept for the next batch (a ball's samples
        often span several).
        """
        assert self.radius is not None
        cached = getattr(self, "_corner_cache", None)  # a ball's samples often span several batches
        if cached is not None and cached[0] <= lo and hi <= cached[1] and cached[2] == dtype:
            return cached[3][lo - cached[0] : hi - cached[0]], cached[4][lo - cached[0] : hi - cached[0]]
        c = self._centre_rows(lo, hi)
        if self.norm == "linf":
            low, high = c - self.radius, c + self.radius
            if self.clip is not None:
                low, high = low.clamp_min(self.clip[0]), high.clamp_max(self.clip[1])
            lower, width = low.to(self.device, dtype), (high - low).to(self.device, dtype)
        else:  # L2: the width is unused (samples are centre + radius · direction)
            lower = c.to(self.device, dtype)
            width = lower[:, :0]
        self._corner_cache = (lo, hi, dtype, lower, width)
        return lower, width

    def _run_blocks(self, adapter: _ModelAdapter, engine: CellTallyEngine, first: int, last: int,
                    dtype: torch.dtype, corners: Tensor) -> int:
        local, z, cell_range = self._batch_inputs(first, last, dtype, corners)
        x = self._to_input(z)
        if x.dtype != self.input_dtype:
            x = x.to(self.input_dtype)
        preds = adapter(x)
        if adapter.outputs_labels:
            # Label range: extremes kept on the device and checked once after the loop (no host sync
            # per batch); clamped meanwhile so the tally stays in range (a bad run raises anyway).
            lo, hi = preds.min().reshape(1), preds.max().reshape(1)
            self._label_extremes = (torch.cat([lo, hi]) if self._label_extremes is None else
                                    torch.stack([torch.minimum(self._label_extremes[0], lo[0]),
                                                 torch.maximum(self._label_extremes[1], hi[0])]))
            preds = preds.clamp(0, engine.num_classes - 1)
        engine.update_local(local, preds, *cell_range)
        return int(local.shape[0])

    def _probe(self, adapter: _ModelAdapter) -> int:
        """One small model call on the first sampled cell's centre: validates the output, returns ``K``."""
        # on the sampling device, like the Monte Carlo batches (the plan's corners may live on the profile's
        # device, e.g. a CPU profile with device="cuda" and a CUDA model)
        if self.cell_kind == "balls":
            lower, width = self._ball_corners(0, 1, self._sample_dtype())
            z = (lower + width / 2 if self.norm == "linf" else lower).expand(2, -1)
        else:
            z = (self._sample_lower[:1] + self._sample_width[:1] / 2).to(self.device, self._sample_dtype())
            z = z.expand(2, -1)
        x = self._to_input(z.contiguous())
        x = x.to(self.input_dtype)
        raw = adapter.raw(x)
        preds = adapter.to_labels(raw)
        if self.num_classes is not None:
            k = self.num_classes
        elif isinstance(raw, Tensor) and raw.ndim == 2:
            k = int(raw.shape[1])
        else:
            k = max(2, int(preds.max()) + 1)
            if self._y_lab is not None and self._y_lab.numel():
                k = max(k, int(self._y_lab.max()) + 1)
            if self.failure_pairs is not None:
                k = max(k, 1 + max(max(p) for p in self.failure_pairs))
        if self._y_lab is not None and self._y_lab.numel() and int(self._y_lab.max()) >= k:
            raise DataError(f"labelled data holds class {int(self._y_lab.max())} but the model has {k} classes. Fix: "
                            f"labels must index the model's outputs (0..{k - 1}); check that the data belong to this "
                            f"model and its class order")
        if self.failure_pairs is not None and max(max(p) for p in self.failure_pairs) >= k:
            raise ConfigError(f"failures name class {max(max(p) for p in self.failure_pairs)}, "
                              f"but the model has {k} classes")
        if adapter.outputs_labels:
            _check_label_range(preds, k)
        return k

    def sample(self, model: Callable[[Tensor], Any], engine: CellTallyEngine | None = None, *,
               rank: int = 0, world_size: int = 1) -> CellTallyEngine:
        """Run the Monte Carlo of this worker's share of blocks into ``engine`` (a new one when ``None``).

        Blocks ``[rank·nb/world_size, (rank+1)·nb/world_size)`` are this worker's; merging the
        engines of all ranks gives exactly the single-process result. With ``allocation="adaptive"``
        every rank first runs the whole pilot (deterministic: the same plan everywhere, no
        communication; :attr:`queries_pilot`), then its share of the final stage's blocks; the engine
        holds the final stage only.
        """
        world_size = check_count(world_size, "world_size", 1)
        rank = check_count(rank, "rank", 0)
        if rank >= world_size:
            raise ConfigError(f"rank {rank} must be below world_size {world_size}")
        self.queries = 0
        self._tuned_blocks: int | None = None
        self._label_extremes: Tensor | None = None
        self._predict_labelled(model)
        adapter = _ModelAdapter(model, self.num_classes)
        # One model, one number of classes: the Monte Carlo queries must return as many class scores
        # as the queries on the labelled points did (a guard per phase would accept a change between them).
        adapter.guard.num_classes = self._labelled_classes
        if self.n_sampled_cells == 0:
            return engine if engine is not None else self.new_engine(self.num_classes or 2)
        k = self._probe(adapter)
        if engine is None:
            engine = self.new_engine(k)
        elif engine.n_cells != self.n_sampled_cells or engine.num_classes != k:
            raise ConfigError(
                f"engine is sized {engine.n_cells} cells × {engine.num_classes} classes, the plan needs "
                f"{self.n_sampled_cells} × {k}"
            )
        if self.allocation == "adaptive":
            self._pilot_and_plan(adapter, k)
        engine.to(self.device)
        self._run_stream(adapter, engine, rank, world_size)
        adapter.check()  # NaN/inf logits: one host sync after the loop, naming the first bad batch
        if self._label_extremes is not None:
            lo, hi = self._label_extremes.tolist()
            _check_label_bounds(int(lo), int(hi), engine.num_classes)
        return engine

    def _run_stream(self, adapter: _ModelAdapter, engine: CellTallyEngine, rank: int, world_size: int) -> None:
        """This rank's share of the current stage's blocks into ``engine`` (adds to :attr:`queries`)."""
        dtype = self._sample_dtype()
        corners = (None if self.cell_kind == "balls" else
                   torch.cat([self._sample_lower, self._sample_width], 1).to(self.device, dtype))
        self._ends_dev = self._ends.to(self.device)
        self._generator = torch.Generator(device=self.device)
        size = self._block
        n_blocks = -(-self.total_samples // size)
        first, last = rank * n_blocks // world_size, (rank + 1) * n_blocks // world_size
        block = first
        per_batch = self._initial_blocks() if self.batch_size == "auto" else max(1, self.batch_size // size)
        if self.batch_size == "auto" and self._tuned_blocks is not None:  # a later stage: the first one's choice
            per_batch = self._tuned_blocks
        elif self.batch_size == "auto":
            tuned, per_batch = self._autotune(adapter, engine, block, last, dtype, corners)
            if tuned != block:  # timed (a short stream keeps the initial size and does not count)
                self._tuned_blocks = per_batch
            block = tuned
        self.blocks_per_batch = per_batch
        done = self.queries
        total = done + max(0, min(self.total_samples, last * size) - first * size)  # this rank's model queries
        while block < last:
            stop = min(last, block + per_batch)
            self.queries += self._run_blocks(adapter, engine, block, stop, dtype, corners)
            block = stop
            progress.tick(self.queries, total, "queries")

    def _pilot_and_plan(self, adapter: _ModelAdapter, k: int) -> None:
        """``allocation="adaptive"``: the pilot stage (all of it, on every rank), then the final stage's plan.

        The pilot samples ``n₀`` per cell from the block stream seeded by ``_mix(seed, -3)`` (and a
        label round for contested empty cells from ``_mix(seed, -5)``); the final stage from
        ``_mix(seed, -4)``, independent of both (see
        :mod:`~pytest_dnnsafety.engines.reliability.allocation` for why that keeps the bound sound).
        """
        n_s = self.n_sampled_cells
        n0 = self._pilot_n
        self._per_cell = n0
        self._trials = torch.full((n_s,), n0, dtype=torch.int64)
        self._ends = torch.cumsum(self._trials, 0)
        self._stream_seed = _mix(self.seed, -3)
        self._labels = self._labels_planned.clone()
        pilot = self.new_engine(k).to(self.device)
        started = time.perf_counter()
        self._run_stream(adapter, pilot, 0, 1)
        counts = pilot.compute().cpu()
        # label round: empty cells whose pilot samples disagree get max(32, 16·n₀) more samples, so their
        # label (the vote, Assumption 5) is the model's majority, not a coin toss of a few pilot samples
        contested = (self._labels_planned.cpu()[self._sampled] < 0) & ((counts > 0).sum(1) > 1)
        extra_n = max(32, 16 * n0)
        if self.query_budget is not None:  # never at the cost of the final stage's one sample per cell
            extra_n = min(extra_n, (self.query_budget - (n0 + 1) * n_s) // max(1, int(contested.sum())))
        if bool(contested.any()) and extra_n > 0:
            check_query_cap(self.queries + extra_n * int(contested.sum()), self.max_queries,
                            f"the adaptive pilot with its label round ({extra_n:,} more samples in each of "
                            f"{int(contested.sum()):,} contested empty cells)",
                            "fewer pilot_samples, a query_budget, or empty_cell_label='nearest'",
                            rate=self.queries / max(time.perf_counter() - started, 1e-9))
            self._per_cell = None
            self._trials = torch.where(contested, extra_n, 0).to(torch.int64)
            self._ends = torch.cumsum(self._trials, 0)
            self._stream_seed = _mix(self.seed, -5)
            extra = self.new_engine(k).to(self.device)
            self._run_stream(adapter, extra, 0, 1)
            counts = counts + extra.compute().cpu()
        self.queries_pilot = self.queries
        self._pilot_rate = self.queries / max(time.perf_counter() - started, 1e-9)
        self._plan_final(counts)
        self._stream_seed = _mix(self.seed, -4)

    def _cross_mass(self) -> float:
        """OP mass counted with ``λ = 1`` without sampling: cross-boundary cells and (conservatively) the rest."""
        rest = self.rest if self.conservative_rest else 0.0
        return float(self._op[self._types == CROSS].sum()) + rest

    def _plan_final(self, pilot_counts: Tensor) -> None:
        """Strata, final-stage samples and the empty cells' labels (the pilot's vote) from the pilot's histograms."""
        sampled = self._sampled
        n_s = int(sampled.numel())
        k = pilot_counts.shape[1]
        labels = self._labels.cpu().clone()
        cell_labels = labels[sampled]
        cell_labels = torch.where(cell_labels < 0, pilot_counts.argmax(1), cell_labels)
        labels[sampled] = cell_labels
        self._labels = labels.to(self._labels.device)
        fm = self._failure_matrix(k)
        fails = (pilot_counts * fm[cell_labels].to(torch.int64)).sum(1)
        op = self._op.cpu()[sampled]
        streamed = getattr(self, "_op_alloc", None)
        if streamed is not None:
            alloc = streamed.cpu()[sampled].clamp_min(op)
        else:
            alloc = op if self._reps is None else self._reps.cpu()[:, sampled].max(0).values.clamp_min(op)
        alpha = 1.0 - self.confidence
        conf_lam = self.confidence if self._reps is None and streamed is None else 1.0 - (alpha - self.alpha_op_share * alpha)
        budget = None if self.query_budget is None else self.query_budget - self.queries_pilot
        if budget is not None and budget < n_s:
            raise ConfigError(f"query_budget={self.query_budget:,}: the pilot spent {self.queries_pilot:,} queries "
                              f"and {budget:,} are left for the {n_s:,} sampled cells (one each at least). Fix: "
                              f"query_budget ≥ {self.queries_pilot + n_s:,} or fewer pilot_samples")
        plan = plan_adaptive(alloc, op, fails, pilot_counts.sum(1), budget=budget, target_width=self.target_width,
                             confidence=conf_lam)
        if budget is None:  # a query_budget (checked against max_queries before the pilot) bounds the plan
            goal = f"target_width={self.target_width:g}"
            check_query_cap(self.queries_pilot + plan.queries, self.max_queries,
                            f"the adaptive plan for {goal} (pilot "
                            f"{self.queries_pilot:,} + final stage {plan.queries:,}; predicted width "
                            f"{plan.predicted_ub - plan.predicted_e:.3g}"
                            f"{'' if plan.target_reached else ', the target not reached even by the finest plan'})",
                            "a looser target_width, or a query_budget (the tightest bound within it)",
                            rate=getattr(self, "_pilot_rate", None))
        self._strata = plan.strata
        self._trials = plan.trials
        self._ends = torch.cumsum(plan.trials, 0)
        self._per_cell = None
        self.allocation_plan = {
            "pilot_samples_per_cell": int(self._pilot_n), "query_budget": self.query_budget,
            "target_width": self.target_width, "target_reached": plan.target_reached,
            "predicted_E": plan.predicted_e, "predicted_ub": plan.predicted_ub + float(self._cross_mass()),
            "strata": plan.groups,
        }

    def _predict_labelled(self, model: Callable[[Tensor], Any]) -> None:
        """The model's predictions on the labelled inputs (for the labelled-data checks of :meth:`finish`).

        The inputs go to the model as given (input space, their own shape), in batches, guarded
        like the Monte Carlo queries (NaN/inf outputs raise, naming the first bad batch).
        """
        self._lab_pred: Tensor | None = None
        self._labelled_classes: int | None = None
        source = self._lab_source
        if (self._x_lab_raw is None and source is None) or self._y_lab is None or not self._y_lab.numel():
            return
        adapter = _ModelAdapter(model, self.num_classes, what="max_pmi_ub: model on the labelled points")
        preds = []
        if source is not None:  # streamed: one model call per loader batch, in the loader's shape
            for _, _, raw in source.batches():
                preds.append(adapter(raw.to(self.device, self.input_dtype)))
        else:
            x_all = self._x_lab_raw
            per_input = max(1, math.prod(x_all.shape[1:]))
            step = (self.batch_size if isinstance(self.batch_size, int)
                    else max(1, min(4 * BLOCK, 4 * BLOCK_ELEMS // per_input)))
            for start in range(0, int(x_all.shape[0]), step):
                x = x_all[start : start + step].to(self.device, self.input_dtype)
                preds.append(adapter(x))
        adapter.check()
        self._labelled_classes = adapter.guard.num_classes
        pred = torch.cat(preds).to(torch.int64)
        self.labelled_queries = int(pred.shape[0])
        if adapter.outputs_labels and pred.numel():
            lo, hi = int(pred.min()), int(pred.max())
            k = self.num_classes if self.num_classes is not None else max(hi, int(self._y_lab.max())) + 1
            _check_label_bounds(lo, hi, max(k, 2))
        self._lab_pred = pred.cpu()

    def _initial_blocks(self) -> int:
        if self._block < BLOCK:  # images (balls, decoded latent samples): a batch of about BALL_BATCH_ELEMS values
            budget = BALL_BATCH_ELEMS * (1 if self.device.type == "cpu" else 16)
            return max(1, budget // (self._block * self._model_values()))
        return 2 if self.device.type == "cpu" else 64

    def _autotune(self, adapter: _ModelAdapter, engine: CellTallyEngine, block: int, last: int,
                  dtype: torch.dtype, corners: Tensor) -> tuple[int, int]:
        """Time real batches of the stream at a few sizes and keep the fastest (results do not depend on it)."""
        # CPU: small multiples of BLOCK (a tiny MLP is fastest at 12k–16k inputs, while activations fit
        # the caches); accelerators: large batches
        candidates = [1, 2, 3, 4, 6, 8] if self.device.type == "cpu" else [16, 64, 256]
        if self._block < BLOCK:  # images: around the memory-bounded first batch
            base = self._initial_blocks()
            candidates = [max(1, base // 2), base, 2 * base, 4 * base]
        if last - block < 4 * sum(candidates):
            return block, self._initial_blocks()
        rates = {}
        for per_batch in candidates:
            elapsed = math.inf
            for _ in range(2):
                sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
                sync()
                t0 = time.perf_counter()
                self.queries += self._run_blocks(adapter, engine, block, block + per_batch, dtype, corners)
                sync()
                elapsed = min(elapsed, time.perf_counter() - t0)
                block += per_batch
            rates[per_batch] = per_batch / max(elapsed, 1e-9)
        return block, max(rates, key=lambda b: rates[b])
