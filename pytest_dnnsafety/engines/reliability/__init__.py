"""Reliability assessment engine — pmi and its upper bound (Zhao et al. 2021, eqs. 1–14, Table 1).

The pmi of eq. (1) is assembled from cells of the input (or latent) space, eq. (4)::

    λ = Σ_i Op_i · λ_i

* **Cells** — a grid of side ``ε`` over a box (low-dimensional inputs, or the latent space of a
  user encoder/decoder). ``r̂`` — half the smallest L∞ distance between labelled points of
  different classes (Remark 2, Assumption 2; :func:`r_separation`) — is reported, and ``ε ≥ r̂``
  raises a :class:`ReliabilityWarning` (and sets ``eps_exceeds_r``). ``eps="auto"`` takes the
  largest even split of the box with side strictly below ``eps_fraction · r̂`` (the paper's
  running example grids the unit square into 250 × 250 cells of side 0.004). ``box=None`` grids
  the data's range (operational and labelled points, unpadded; ``box="padded"`` adds three
  bandwidths per side); the box used is reported (``ReliabilityResult.box``).
* **Ball cells** (``cells="balls"``; Zhao et al. 2021, §IV: cells "or are norm balls around operational
  inputs", the paper's cells-as-norm-balls idea for high-dimensional inputs such as images,
  where no grid is possible): each operational input ``x_j`` (input space, flattened) is the
  centre of one cell ``B(x_j, ε)`` under ``norm`` (L∞ or L2). Op_j = 1/M (the empirical
  profile); cell types from the labelled points inside each closed ball, exactly as for grid
  cells. See :func:`assess_reliability` for the details.
* **Ball cells at image scale** — the Monte Carlo stream of images is cut into blocks of at most
  :data:`~pytest_dnnsafety.engines.reliability.sampler.BLOCK_ELEMS` values (256 samples of
  3×32×32, 4 of 3×224×224; up to 1,024 values per input the blocks, hence the samples, are those
  of earlier releases), ``batch_size="auto"`` starts from about 8 MiB of inputs on a CPU, and each
  batch computes its balls' corners from their centres (no table of ``balls × d`` corners). The
  centres and the labelled points may be ``DataLoader`` s
  (:mod:`~pytest_dnnsafety.engines.reliability.streamed`): read in passes (r̂ and the ball types
  by block nested loops), never held whole, with the numbers of the same data held.
* **Op_i** — KDE masses (:class:`~pytest_dnnsafety.engines.reliability.profile.OperationalProfile`): the paper's
  centre approximation (eq. 9; ``mass="centre"``, also spelt ``"center"``) or the exact box
  integral, normalised over the box, with a bootstrap variance over ``B`` refits (eq. 11,
  Appendix A). ``bootstrap_size="full"`` (default) is the standard bootstrap, ``N`` of ``N``
  points per refit: the variance of the masses actually used. ``"half"`` refits on ``N/2``
  points as the paper's reference implementation does; it estimates the variance of a KDE of
  half the data, about 2× larger (a KDE mass's variance scales as ``1/N``), and is there to
  reproduce the paper's figures.
* **Cell types** (§3.2): *normal* — labelled points inside agree, the cell's ground truth is
  their label (Assumption 4); *empty* — no labelled point, the label is the majority vote of the
  model on the cell's samples (Assumption 5; ties go to the lowest class); *cross-boundary* —
  labels disagree, ``λ_i = 1`` with no variance and no sampling.
* **λ_i** — Monte Carlo (eqs. 13–14): ``n_i`` inputs uniform in the cell (Assumption 6; decoded
  to input space when the cells are latent), ``λ̂_i = k_i/n_i``. Failure is any
  misclassification, or only a user-given set of critical confusions ``(true, predicted)``.
  Samples of many cells share one model batch; the stream of ``(cell, sample)`` pairs is cut
  into fixed blocks of :data:`BLOCK` samples, each with its own seeded generator, so results do
  not depend on the batch size or on how blocks are split over workers.
  Caveat: an empty cell's label is voted on its own samples, so its failure count is the
  minority count — biased low when the cell's unastuteness nears ½. The bounds hold for the
  labels as voted (Assumption 5), not for an unknown ground truth.
* **Adaptive allocation** (``allocation="adaptive"``, beyond the paper;
  :mod:`~pytest_dnnsafety.engines.reliability.allocation`) — a pilot stage, strata from the pilot
  only (cells with pilot failures / without), one weight ``Op_i/n_i`` per stratum chosen to
  minimise the predicted bound within ``query_budget`` (or to reach ``target_width``), fresh
  final samples from an independent seed stream, and the stratified Chernoff bound (each
  stratum at ``α_λ/G``) — sound for every failure-rate vector. On a two-moons random-forest
  stand-in (100 × 100 cells, ``tests/benchmarks/test_bench_allocation.py``) it reaches the bound
  of uniform allocation at 10,000 samples per cell with a tenth of the model queries.
* **Bounded memory** — beyond :data:`~pytest_dnnsafety.engines.reliability.planning.HELD_REPLICATES`
  bootstrap entries the replicate masses are streamed over cells (recomputed chunk by chunk from
  the KDE tables where the bound needs them) instead of held as a ``(B, C)`` matrix; a grid whose
  estimated memory exceeds 2 GiB (or 10⁹ queries) warns before planning with both figures.
* **A query cap** — a plan of more than ``max_queries`` Monte Carlo queries (default
  :data:`~pytest_dnnsafety.engines.reliability.allocation.DEFAULT_MAX_QUERIES`, 10⁹) is refused
  before it is sampled (:class:`~pytest_dnnsafety.engines.reliability.allocation.QueryCapError`,
  naming the planned queries and the time they would take): a uniform/proportional plan and an
  adaptive ``query_budget`` or pilot at planning, before any model query; an adaptive plan for
  ``target_width`` after the (cheap) pilot, at the rate the pilot measured.
* **Many cells** — cells are taken by descending OP mass up to ``mass_target`` and/or a budget
  of ``max_cells``; the unevaluated mass counts with ``λ = 1`` (``conservative_rest=True``) or,
  when the user asks otherwise, with the evaluated cells' average pmi (the paper's "empirical /
  average bound based on the first k cells"); the result says which.
* **Checks against the labelled data** (beyond the paper): (a) the model's error on the
  labelled points (by default a sample of the profile) must not have a Clopper–Pearson lower
  bound above ``Ub``; (b) the model's vote (Assumption 5) is tested on the cells whose labels are
  known. A failed check is a *contradiction* in the result; ``ε``/radius ``≥ r̂``, cross-boundary
  cells and labelled points outside the box are *violated assumptions* (the gate is
  inconclusive unless told to accept them). ``empty_cell_label="nearest"`` labels empty cells
  from the nearest labelled point instead of the model's vote.
* **Models** — a torch module, any callable returning logits/probabilities ``(B, K)`` or labels
  ``(B,)`` (tensors or numpy arrays), or a scikit-learn style estimator: ``predict_proba``
  (preferred) or ``predict`` is called on CPU numpy arrays ``(B, features)``
  (:class:`~pytest_dnnsafety.engines.reliability.model._ModelAdapter`).
* **Audit** — :meth:`ReliabilityResult.write_cells` writes the per-cell table (mass, variance,
  type, label, ``λ̂_i``, failures, samples, corners) as CSV or JSON lines; the ``max_pmi_ub``
  gate's ``cells_file=`` does it and names the file in the gate's details.
* **Aggregation** (:mod:`pytest_dnnsafety.stats.intervals`): ``"normal"`` (eqs. 5–7, the paper's),
  ``"chernoff"`` (sound for any number of zero-failure cells; default), ``"clopper-pearson"``
  (sound, Bonferroni over cells) and ``"jeffreys"`` (Bayesian Monte Carlo).

Measured on 2 shared CPU cores (``tests/benchmarks/test_bench_reliability.py``; best of
interleaved runs): the paper's 250 × 250 grid with a 2→32→32→2 MLP and 100 bootstrap refits
takes about 1 s at 100 samples per cell, 5 s at 1,000 and 45 s at 10,000 (6.25·10⁸ model
queries; the paper's prototype needs about 16 minutes). A per-cell loop in torch (one model call
per cell) is 3–8× slower at 100 samples per cell and 2–2.5× slower at 1,000; at 10,000 its single
calls are already large, cache-friendly batches and it is about 1.2–1.4× *faster* than the engine
on a CPU (the engine's per-sample bookkeeping: cell indices, histograms). Accelerators, where a
per-cell call is dominated by launch latency, were not measured.

Options: :class:`ReliabilityAssessor` takes one :class:`ReliabilityOptions` of five records
(:mod:`~pytest_dnnsafety.engines.reliability.options`: the cells, the OP masses, the sampling plan,
the bound, the labels); :func:`assess_reliability` takes their fields as keywords. The
``max_pmi_ub`` gate runs :func:`~pytest_dnnsafety.engines.reliability.ranks.assess_over_ranks`
(the sampling split over torchrun ranks).

The engine half follows :class:`~pytest_dnnsafety.engines.core.base.Engine`: :class:`CellTallyEngine`
holds one state — per-cell prediction histograms, reduce ``sum`` — so cells (or blocks of
samples) can be split over pytest-xdist workers or ``torch.distributed`` ranks and merged;
labels of empty cells and failure counts are derived from the merged histograms.

Typical use::

    result = assess_reliability(model, OperationalProfile(x_op), labelled=(x_train, y_train),
                                eps="auto", box=([0, 0], [1, 1]), samples_per_cell=1000)
    assert result.Ub <= 1e-2, result.summary()
"""

from __future__ import annotations

# The public names of the family's engine package (the submodules hold one concept each).
from pytest_dnnsafety.engines.reliability.allocation import DEFAULT_MAX_QUERIES, QueryCapError
from pytest_dnnsafety.engines.reliability.api import assess_reliability
from pytest_dnnsafety.engines.reliability.assessment import ReliabilityAssessor
from pytest_dnnsafety.engines.reliability.cells import (
    CELL_TYPES,
    CROSS,
    EMPTY,
    MAX_GRID_CELLS,
    MAX_SCAN_CELLS,
    NORMAL,
    NORMS,
    Grid,
    ReliabilityWarning,
    closest_opposite_pair,
    nearest_labels,
    r_separation,
)
from pytest_dnnsafety.engines.reliability.options import (
    EMPTY_CELL_LABELS,
    BoundOptions,
    CellOptions,
    LabelOptions,
    MassOptions,
    ReliabilityOptions,
    SamplingPlan,
)
from pytest_dnnsafety.engines.reliability.planning import (
    AUTO_RADIUS_CAP,
)
from pytest_dnnsafety.engines.reliability.result import (
    CellTable,
    MethodBound,
    ReliabilityResult,
)
from pytest_dnnsafety.engines.reliability.sampler import BLOCK, BLOCK_ELEMS, block_size
from pytest_dnnsafety.engines.reliability.tally import CellTallyEngine

__all__ = [
    "BLOCK",
    "BLOCK_ELEMS",
    "CELL_TYPES",
    "DEFAULT_MAX_QUERIES",
    "EMPTY",
    "EMPTY_CELL_LABELS",
    "CROSS",
    "NORMAL",
    "MAX_GRID_CELLS",
    "MAX_SCAN_CELLS",
    "AUTO_RADIUS_CAP",
    "NORMS",
    "Grid",
    "CellTallyEngine",
    "CellTable",
    "MethodBound",
    "QueryCapError",
    "ReliabilityAssessor",
    "ReliabilityOptions",
    "CellOptions",
    "MassOptions",
    "SamplingPlan",
    "BoundOptions",
    "LabelOptions",
    "ReliabilityResult",
    "ReliabilityWarning",
    "assess_reliability",
    "block_size",
    "closest_opposite_pair",
    "nearest_labels",
    "r_separation",
]
