"""Ball cells from data read batch by batch: centres and labelled points from ``DataLoader`` s, never held whole.

Part of :mod:`pytest_dnnsafety.engines.reliability` (ball cells: Zhao et al. 2021, §IV; ``r̂``:
Remark 2). With ``cells="balls"`` the operational inputs (the balls' centres) and the labelled
points may each be a ``DataLoader`` read in index order (``shuffle=False``; batches ``x`` or
``(x, y)``). They are then read in passes, and what is kept is per input a few numbers:

* **one scan** of each loader: the number of inputs, their shape, the labels (labelled data),
  finiteness, the ``clip`` check (naming the first input outside) and the per-value range of the
  centres (for ``radius="auto"``'s cap and the sampling dtype);
* **r̂** (the r-separation, Remark 2) by a block nested loop: the labelled data are cut into
  blocks of at most :data:`STREAM_ELEMS` values (256 MiB of float32; 445 images of 3×224×224,
  21,845 of 3×32×32), and each block is compared with every later batch of a fresh pass — about
  ``N / block`` passes over the labelled loader, ``N² / (2·block)`` inputs read in all;
* **ball types** (and, for ``empty_cell_label="nearest"``, each ball's nearest labelled point) by
  the same nested loop, blocks of centres against passes over the labelled loader:
  ``M / block`` passes; per ball only the classes present in it (``M × K`` booleans), the nearest
  label and its distance are kept;
* **the model on the labelled points**: one pass, one model call per loader batch;
* **Monte Carlo sampling** (:class:`CentreWindow`): the sampler needs the centres of the balls a
  model batch touches, in ball order, so the centre loader is read once more in order, holding
  the centres from the oldest ball still needed to the last batch read (a model batch plus a
  loader batch). An adaptive allocation's stages, and each stage's first batch on a rank of a
  sharded run, start a new pass.

The numbers are those of the same data held as tensors (same ``r̂``, types, samples and bound;
the nearest-label rule uses exact Euclidean distances here, ties to the first, where the held
path ranks float32 distances: the two can differ only between near-equidistant labelled points).
The cell table (:meth:`ReliabilityResult.write_cells`) lists no ball corners (``lower``/``upper`` have
no columns): the ``flat`` index names the operational input.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pytest_dnnsafety.data.forms import _split_batch, check_loader_order
from pytest_dnnsafety.engines.reliability.cells import EMPTY, _ball_distances, ball_types
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.engines.reliability.latent import OperationalInputs
from pytest_dnnsafety.engines.reliability.profile import OperationalProfile

#: The most input values held at once in a block of the nested passes (256 MiB of float32).
STREAM_ELEMS = 1 << 26


def is_streamed(data: Any) -> bool:
    """Whether ball-cell data are read batch by batch (a ``DataLoader``, or :class:`OperationalInputs`: e.g. a
    ``.npy`` file of images read a slice at a time) rather than held."""
    return isinstance(data, (torch.utils.data.DataLoader, OperationalInputs))


class RowSource:
    """Inputs (flattened, float64) and optionally labels read from a ``DataLoader`` in passes, in index order.

    :meth:`scan` is the first pass; :meth:`batches` re-reads the loader, checking that each pass
    yields as many inputs as the first (a one-shot iterable cannot be streamed twice).
    """

    def __init__(self, loader: Any, what: str, device: torch.device, *, labelled: bool) -> None:
        if isinstance(loader, torch.utils.data.DataLoader):
            check_loader_order(loader, what)
        elif isinstance(loader, OperationalInputs) and isinstance(loader.source, torch.utils.data.DataLoader):
            check_loader_order(loader.source, what)
        self.loader, self.what, self.device, self.labelled = loader, what, device, labelled
        self.n = 0
        self.dim = 0
        self.input_shape: tuple[int, ...] = ()
        self.labels: Tensor | None = None
        self.passes = 0

    def _raw(self) -> Iterator[tuple[Tensor, Tensor | None]]:
        if isinstance(self.loader, OperationalInputs):  # unlabelled inputs read a batch (or file slice) at a time
            for x in self.loader.batches():
                yield (x[:, None] if x.ndim == 1 else x), None
            return
        if not is_streamed(self.loader):  # held data beside a streamed set: ``(x, y)`` read in slices
            x_all, y_all = self.loader
            x_all = x_all.detach() if isinstance(x_all, Tensor) else torch.as_tensor(np.asarray(x_all))
            if x_all.ndim == 1:
                x_all = x_all[:, None]
            if y_all is not None:
                y_all = y_all.detach() if isinstance(y_all, Tensor) else torch.as_tensor(np.asarray(y_all))
            step = max(1, STREAM_ELEMS // 16 // max(1, int(x_all[0].numel()) if len(x_all) else 1))
            for start in range(0, int(x_all.shape[0]), step):
                yield x_all[start : start + step], None if y_all is None else y_all[start : start + step]
            return
        for batch in self.loader:
            bx, by = _split_batch(batch)
            x = bx.detach() if isinstance(bx, Tensor) else torch.as_tensor(bx)
            y = None if by is None else (by.detach() if isinstance(by, Tensor) else torch.as_tensor(by))
            if x.ndim == 0 or x.dtype == torch.bool or x.dtype.is_complex:
                raise DataError(f"{self.what}: batches must hold real-valued inputs (B, ...), got {tuple(x.shape)} "
                                f"of dtype {x.dtype}")
            yield x, y

    def scan(self, clip: tuple[float, float] | None = None) -> tuple[Tensor, Tensor]:
        """First pass: size, shape, labels, finiteness, ``clip``; returns per-value ``(min, max)`` (float64)."""
        labels, low, high = [], None, None
        bad = torch.zeros((), dtype=torch.int64, device=self.device)
        first_out = None
        for x, y in self._raw():
            if not self.n:
                self.input_shape = tuple(x.shape[1:]) if x.ndim > 1 else (1,)
                self.dim = int(x[0].numel()) if x.ndim > 1 else 1
            flat = x.reshape(x.shape[0], -1).to(self.device, torch.float64)
            if flat.shape[1] != self.dim:
                raise DataError(f"{self.what}: inputs of {flat.shape[1]} values after inputs of {self.dim}")
            if self.labelled:
                if y is None:
                    raise DataError(f"{self.what}: the DataLoader yields inputs without labels; the pmi needs (x, y) "
                                    "batches for r-separation and cell labels")
                if y.dtype.is_floating_point or y.dtype == torch.bool:
                    raise DataError(f"labels must be integer class indices, got dtype {y.dtype}")
                labels.append(y.reshape(-1).to(self.device, torch.int64))
            bad += (~torch.isfinite(flat)).sum()
            b_low, b_high = flat.amin(0), flat.amax(0)
            low = b_low if low is None else torch.minimum(low, b_low)
            high = b_high if high is None else torch.maximum(high, b_high)
            if clip is not None and first_out is None:  # the first input outside, as an index (no sync per batch)
                out = ((flat < clip[0]) | (flat > clip[1])).any(1)
                first_out = torch.where(out.any(), self.n + out.to(torch.int8).argmax(), -1)
            elif clip is not None:
                out = ((flat < clip[0]) | (flat > clip[1])).any(1)
                first_out = torch.where((first_out < 0) & out.any(), self.n + out.to(torch.int8).argmax(), first_out)
            self.n += int(flat.shape[0])
        self.passes = 1
        if not self.n or low is None or high is None:
            raise DataError(f"{self.what}: the DataLoader yielded no inputs. Fix: give it a non-empty dataset")
        if int(bad):
            raise DataError(f"{self.what}: {int(bad)} NaN/inf value(s). Fix: clean the inputs")
        if self.labelled:
            self.labels = torch.cat(labels)
            if self.labels.shape[0] != self.n:
                raise DataError(f"{self.what}: {self.n} inputs but {self.labels.shape[0]} labels")
            if self.labels.numel() and int(self.labels.min()) < 0:
                raise DataError(f"labels must be non-negative class indices, found {int(self.labels.min())}. Fix: map "
                                f"the labels to 0..K-1 in the order of the model's outputs")
        if first_out is not None and int(first_out) >= 0:
            assert clip is not None
            raise DataError(f"operational input {int(first_out)} lies outside clip=({clip[0]:g}, {clip[1]:g}). Fix: "
                            f"widen clip to the inputs' valid range or rescale the data")
        return low, high

    def batches(self) -> Iterator[tuple[int, Tensor, Tensor]]:
        """A new pass: ``(start, inputs (b, dim) float64 on the device, raw inputs as the loader gave them)``."""
        self.passes += 1
        start = 0
        for x, _ in self._raw():
            flat = x.reshape(x.shape[0], -1).to(self.device, torch.float64)
            if start + flat.shape[0] > self.n or flat.shape[1] != self.dim:
                break
            yield start, flat, x
            start += int(flat.shape[0])
        if start != self.n:
            raise DataError(f"{self.what}: a later pass over the DataLoader read {start} inputs, the first {self.n}. "
                            f"Fix: ball cells read the loader several times; give a re-iterable DataLoader over a "
                            f"fixed dataset (shuffle=False)")

    def blocks(self, rows: Tensor | None = None) -> Iterator[tuple[Tensor, Tensor]]:
        """A new pass in blocks of at most :data:`STREAM_ELEMS` values: ``(row indices, inputs)``.

        ``rows`` (sorted) keeps only those inputs (e.g. the balls of a ``max_balls`` subsample). One
        buffer is filled and yielded again and again: a block is valid until the next is asked for
        (the nested loops use it only inside their loop body), so a pass holds one block, not two.
        """
        limit = max(1, STREAM_ELEMS // max(1, self.dim))
        total = self.n if rows is None else int(rows.numel())
        size = max(1, min(limit, total))
        buf = torch.empty(size, self.dim, dtype=torch.float64, device=self.device)
        idx_buf = torch.empty(size, dtype=torch.int64)
        count = 0
        for start, flat, _ in self.batches():
            idx = torch.arange(start, start + flat.shape[0])
            if rows is not None:
                keep = torch.isin(idx, rows)
                idx, flat = idx[keep], flat[keep.to(flat.device)]
            while idx.numel():
                take = min(size - count, int(idx.numel()))
                buf[count : count + take] = flat[:take]
                idx_buf[count : count + take] = idx[:take]
                idx, flat = idx[take:], flat[take:]
                count += take
                if count == size:
                    yield idx_buf, buf
                    count = 0
        if count:
            yield idx_buf[:count], buf[:count]


def streamed_r_separation(source: RowSource, norm: str) -> float:
    """``r̂`` of streamed labelled data: half the smallest distance under ``norm`` between differently labelled inputs.

    Block nested loop: each held block against the batches of a fresh pass from the block's
    first row on (pairs inside a block and with later rows; earlier rows met it as their block).
    """
    assert source.labels is not None
    labels = source.labels.to(source.device)
    best = torch.full((), float("inf"), dtype=torch.float64, device=source.device)
    if torch.unique(labels).numel() < 2:
        return float("inf")
    for idx, block in source.blocks():
        first = int(idx[0])
        y_block = labels[idx.to(labels.device)]
        for start, flat, _ in source.batches():
            if start + flat.shape[0] <= first:
                continue
            dist = _ball_distances(block, flat, norm)
            differ = y_block[:, None] != labels[start : start + flat.shape[0]][None, :]
            best = torch.minimum(best, torch.where(differ, dist, torch.inf).min())
    return float(best) / 2.0


def streamed_ball_types(centres: RowSource, rows: Tensor, labelled: RowSource, radius: float, norm: str,
                        nearest: bool) -> tuple[Tensor, Tensor | None]:
    """Per ball (centre rows ``rows``): the classes with a labelled point in the closed ball ``(m, K)`` bool, and
    with ``nearest`` the label of the nearest labelled point (Euclidean, ties to the first) — centre blocks
    against passes over the labelled data."""
    assert labelled.labels is not None
    labels = labelled.labels.to(centres.device)
    k = int(labels.max()) + 1
    m = int(rows.numel())
    present = torch.zeros(m, k, dtype=torch.bool, device=centres.device)
    near = torch.full((m,), -1, dtype=torch.int64, device=centres.device) if nearest else None
    pos = 0
    for _, block in centres.blocks(rows):
        c = int(block.shape[0])
        hits = torch.zeros(c, k, dtype=torch.float64, device=centres.device)
        best = torch.full((c,), float("inf"), dtype=torch.float64, device=centres.device)
        best_label = torch.full((c,), -1, dtype=torch.int64, device=centres.device)
        for start, flat, _ in labelled.batches():
            y = labels[start : start + flat.shape[0]]
            onehot = torch.nn.functional.one_hot(y, k).to(torch.float64)
            hits += (_ball_distances(block, flat, norm) <= radius).to(torch.float64) @ onehot
            if near is not None:
                dist = _ball_distances(block, flat, "l2")
                value, arg = dist.min(1)
                better = value < best  # strict: ties keep the earlier point
                best = torch.where(better, value, best)
                best_label = torch.where(better, y[arg], best_label)
        present[pos : pos + c] = hits > 0
        if near is not None:
            near[pos : pos + c] = best_label
        pos += c
    return present, near


class CentreWindow:
    """The centres of sampled balls ``lo..hi-1``, read from the centre loader in order (a sliding window).

    ``rows`` maps sampled balls to loader rows (increasing). Requests must move forward; a request
    before the window (a new stage, another rank's start) begins a new pass.
    """

    def __init__(self, source: RowSource, rows: Tensor) -> None:
        self.source, self.rows = source, rows.cpu()
        self._reset()

    def _reset(self) -> None:
        self._iter: Iterator[tuple[int, Tensor, Tensor]] | None = None
        self._start = 0  # loader row of self._held[0]
        self._held = torch.empty(0, self.source.dim, dtype=torch.float64, device=self.source.device)

    def __call__(self, lo: int, hi: int) -> Tensor:
        want = self.rows[lo:hi]
        first, last = int(want[0]), int(want[-1])
        if self._iter is None or first < self._start:
            self._reset()
            self._iter = self.source.batches()
        # invariant: the pass has read rows [0, self._start + len(self._held)); self._held starts at self._start
        if first > self._start:  # drop the rows before the oldest needed
            drop = min(first - self._start, int(self._held.shape[0]))
            self._held, self._start = self._held[drop:], self._start + drop
        while self._start + int(self._held.shape[0]) <= last:
            start, flat, _ = next(self._iter)
            if self._held.shape[0]:
                self._held = torch.cat([self._held, flat])
            elif start + flat.shape[0] <= first:  # before the window: skipped
                self._start = start + int(flat.shape[0])
            else:
                cut = max(0, first - start)
                self._held, self._start = flat[cut:], start + cut
        return self._held[(want - self._start).to(self._held.device)]


class StreamedBalls:
    """``cells="balls"`` planned from streamed data (a mixin of
    :class:`~pytest_dnnsafety.engines.reliability.ReliabilityAssessor`; see the module docstring)."""

    def _init_balls_streamed(self, profile: Any, labelled: Any, *, radius: Any, eps_fraction: Any,
                             max_balls: Any, clip: Any, device: torch.device | str | None) -> None:
        from pytest_dnnsafety.engines.reliability.sampler import ball_rows

        # ---- centres: the operational inputs, a DataLoader (or held beside a streamed labelled set)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.profile = None
        if isinstance(profile, OperationalProfile):
            self.profile = profile
            self.device = profile.device if device is None else torch.device(device)
            raw = getattr(profile, "inputs", None)
            if raw is None and profile.latent:
                raise ConfigError("cells='balls' centres the balls on the raw operational inputs, but this profile "
                                  "holds only their encodings. Fix: pass the raw operational inputs as profile")
            profile = (profile.points if raw is None else raw, None)
        elif not is_streamed(profile):
            profile = (profile, None)
        self.clip = None if clip is None else self._check_clip(clip)
        centres = RowSource(profile, "operational inputs", self.device, labelled=False)
        low, high = centres.scan(self.clip)
        n_all, d = centres.n, centres.dim
        self.n_operational = n_all
        flat = ball_rows(n_all, max_balls, self.seed)
        m = int(flat.shape[0])
        input_shape = centres.input_shape
        # ---- labelled points: labels kept (small), inputs re-read per pass; r̂ by the block nested loop
        lab = None
        if labelled is not None:
            if not is_streamed(labelled) and (not isinstance(labelled, (tuple, list)) or len(labelled) != 2):
                raise DataError("labelled must be a pair (inputs, labels) or a DataLoader of (x, y) batches")
            lab = RowSource(labelled, "labelled data", self.device, labelled=True)
            lab.scan()
            if lab.dim != d:
                raise DataError(f"labelled inputs have {lab.dim} values each, the operational inputs {d}")
            if len(lab.input_shape) > 1 and len(input_shape) == 1:
                input_shape = lab.input_shape
            self.r_hat = streamed_r_separation(lab, self.norm)
        else:
            self.r_hat = float("nan")
        self._lab_source, self._z_lab, self._x_lab_raw = lab, None, None
        self._y_lab = None if lab is None else lab.labels
        span = None
        if self._needs_span(radius):
            span = (torch.full((d,), self.clip[1] - self.clip[0], dtype=torch.float64) if self.clip is not None
                    else (high - low).cpu())
        value = self._ball_radius(radius, eps_fraction, span)
        op = self._ball_op(m, flat)
        # ---- types (and nearest labels): centre blocks against passes over the labelled data
        types = torch.full((m,), EMPTY, dtype=torch.int64, device=self.device)
        labels = torch.full((m,), -1, dtype=torch.int64, device=self.device)
        nearest = self.empty_cell_label == "nearest"
        if nearest and lab is None:
            raise ConfigError("empty_cell_label='nearest' labels empty cells from the labelled points; none were "
                              "given. Fix: pass labelled=(x, y) or use empty_cell_label='model'")
        if lab is not None:
            present, near = streamed_ball_types(centres, flat, lab, value, self.norm, nearest)
            types, labels = ball_types(present)
            if near is not None:
                labels = torch.where(types == EMPTY, near, labels)
        self._types, self._labels = types, labels
        # ---- samples: the sampler reads the centres it needs through a window over the centre loader
        self._allocate(op, types)
        self._centres = None
        self._centre_source = centres
        self._window = CentreWindow(centres, flat[self._sampled])
        self._centre_absmax = float(torch.maximum(low.abs(), high.abs()).max())
        self._sample_dim = d
        self._input_shape = input_shape
