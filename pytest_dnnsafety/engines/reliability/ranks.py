"""The reliability assessment as the ``max_pmi_ub`` gate runs it: labelled data as given, over torchrun ranks.

Part of :mod:`pytest_dnnsafety.engines.reliability`.

* :func:`labelled_points` — the labelled data the assessment reads. Grid cells need every labelled
  point on every rank (``r̂`` is the smallest distance between differently labelled points, and each
  cell's type and label come from the labelled points inside it), so the data are read whole and
  never sharded: only their inputs ``x`` and labels ``y`` are kept (one tensor pair; a float
  ``TensorDataset``'s own tensors as they are, a ``DataLoader`` read once into it). Ball cells
  (``cells="balls"``) stream a ``DataLoader`` instead, never held whole
  (:mod:`~pytest_dnnsafety.engines.reliability.streamed`).
* :func:`assess_over_ranks` — :func:`~pytest_dnnsafety.engines.reliability.api.assess_reliability` with the
  Monte Carlo — the bulk of the work — divided over the ranks: each rank samples its contiguous
  share of the blocks (blocks are seeded by index, so the split changes no sample), the per-cell
  tallies are all-reduced (``sum``) and every rank aggregates the same counts: the single-process
  result. Only rank 0 writes the per-cell table.

Pure torch; no pytest import.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pytest_dnnsafety.engines.reliability.options import ReliabilityOptions
from pytest_dnnsafety.engines.reliability.result import ReliabilityResult
from pytest_dnnsafety.errors import MetricError

__all__ = ["labelled_points", "assess_over_ranks"]


def labelled_points(data: Any, cells: str, fixture: str, *, stream: bool = False) -> Any:
    """The labelled data of ``fixture`` (its name, for the messages) as the assessment reads them.

    ``cells="balls"`` and a ``DataLoader``: the loader itself (streamed); otherwise ``(x, y)`` tensors
    (:func:`~pytest_dnnsafety.data.forms.as_tensors`). ``stream`` (a latent profile, ``latent=``) keeps a
    ``DataLoader`` for grid cells too: the assessor encodes it a batch at a time. Data without labels are a
    :class:`MetricError`.
    """
    from torch.utils.data import DataLoader

    from pytest_dnnsafety.data.forms import as_tensors

    if (cells == "balls" or stream) and isinstance(data, DataLoader):
        labelled: Any = data  # streamed by the engine: read in passes, never held whole
    else:  # whole, not sharded: r-separation and the cell labels need every labelled point
        labelled = as_tensors(data, f"labelled data (fixture {fixture!r})")
    if isinstance(labelled, tuple) and labelled[1] is None:
        raise MetricError(f"fixture {fixture!r} has no labels; the pmi needs labelled points "
                          "for r-separation and cell labels. Fix: provide (x, y)")
    return labelled


def assess_over_ranks(model: Any, profile: Any, labelled: Any, options: ReliabilityOptions, *,
                      cells_file: Path | None = None, cap_source: str = "") -> ReliabilityResult:
    """:func:`~pytest_dnnsafety.engines.reliability.api.assess_reliability` of ``model``, its sampling split over
    the torchrun ranks (one process: all of it), the result the same on every rank.

    ``options``: the assessment's option records. Every rank runs the (deterministic) pilot of
    ``allocation="adaptive"`` in full: it is counted once, as one process would. ``cells_file``: where
    rank 0 writes the per-cell table (every rank reports the path). A plan above ``max_queries`` is
    refused before it is sampled, the :class:`~.allocation.QueryCapError` naming ``cap_source`` (where
    the cap was set).
    """
    from pytest_dnnsafety.engines.reliability.allocation import QueryCapError
    from pytest_dnnsafety.engines.reliability.assessment import ReliabilityAssessor
    from pytest_dnnsafety.runtime import torchrun as ranks

    started = time.perf_counter()
    world = ranks.world_size()
    try:  # a plan above the cap is refused before it is sampled
        assessor = ReliabilityAssessor(profile, labelled, options)
        engine = ranks.together(lambda: assessor.sample(model, rank=ranks.rank(), world_size=world),
                                sharded=world > 1)
    except QueryCapError as exc:
        raise exc.with_source(cap_source) from None
    queries = assessor.queries
    if world > 1:
        engine.sync()  # per-cell class tallies: sum
        # Every rank ran the (deterministic) pilot in full: count it once, as one process would.
        pilot = int(getattr(assessor, "queries_pilot", 0) or 0)
        queries = sum(ranks.gather(int(queries))) - (world - 1) * pilot
    result = assessor.finish(engine, model_queries=queries)
    result = replace(result, seconds=time.perf_counter() - started)
    if cells_file is not None:
        path = cells_file
        if ranks.is_main():  # one writer under torchrun; every rank reports the same path
            path = result.write_cells(path)
        result = replace(result, cells_file=str(path))
    return result
