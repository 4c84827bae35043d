"""torchrun sharding: which rank this process is, which part of the work is its own, and agreement.

``torchrun --nproc-per-node N -m pytest ...`` starts N copies of the same pytest run. Each copy
collects the same tests and runs them in the same order; the plugin then splits the expensive part
of some gates across the copies (*ranks*) and all-reduces the engines' states
(:meth:`~pytest_dnnsafety.engines.core.base.Engine.sync`), so every rank reaches the same value. A gate
says so in its definition (:attr:`GateDef.shards <pytest_dnnsafety.gates.GateDef.shards>`), e.g.:

* neuron gates (``min_neuron_k_activation``, ``max_neuron_pattern_deviation``) and
  scenario-performance gates (``min_scenario_accuracy``, ``max_scenario_degradation``): each rank
  runs the forward pass on its contiguous share of the evaluation data (:func:`batch_shard`);
* ``max_pmi_ub``: each rank samples its contiguous share of the Monte Carlo blocks
  (``ReliabilityAssessor.sample(model, rank=, world_size=)``).

Every other gate runs whole on every rank (same seed, same numbers). Only rank 0 writes the
terminal summary, the evidence JSON, the HTML report, the baseline, the GitHub job summary and the
JUnit file.

**Exactness.** Shards are cut at the *batch boundaries of the single-process run* (whole batches
of ``dnnsafety_batch_size``, or of the DataLoader's own batch size), so each rank calls the model on
exactly the batches one process would call it on, and the states are counts, coverage flags and
histograms whose reductions (sum, or, max) are exact in any order. The sharded values are therefore
*identical* to one process's, not merely close — a data-parallel evaluation that re-batches the
shards (as ``DistributedSampler`` does, padding the last rank with repeated samples) would change
both the batches and, with padding, the counts.

**Agreement.** All ranks must take part in every collective in the same order, or they wait for
each other forever. The plugin therefore exchanges, for each gated test, whether the test body
passed on every rank (before any gate runs) and, after each gate, its verdict
(:func:`gather`); a sharded gate that fails on one rank before its collective (a NaN in that rank's
shard) tells the others through :func:`together`, so all ranks raise. Ranks that still disagree
(a gate whose value depends on the rank) turn the gate into an ``error`` on every rank, naming the
ranks and their values, so every rank exits with the same code. What cannot be caught is a rank
that stops calling collectives (it crashed, or ``-x`` stopped it after a non-gated test failed only
there): the others then time out after ``DNNSAFETY_TORCHRUN_TIMEOUT`` seconds (default 600) when the
plugin created the process group.

torch is imported only when the torchrun environment is present (or torch is already loaded): a
project that never uses torchrun pays nothing.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from pytest_dnnsafety.errors import ConfigError, MetricError
from pytest_dnnsafety.results import GateResult

__all__ = ["agree_on_verdict", "merged", "Shard", "launched", "active", "rank", "world_size", "local_rank", "is_main",
           "backend", "ensure_group", "close", "shard", "batch_shard", "gather", "together", "describe", "TIMEOUT_ENV"]

#: Environment variables torchrun sets in every process it starts.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: Seconds a collective waits for the other ranks (process groups the plugin creates).
TIMEOUT_ENV = "DNNSAFETY_TORCHRUN_TIMEOUT"
_DEFAULT_TIMEOUT = 600.0

_T = TypeVar("_T")
_created = False  # whether this module initialised the process group (and so destroys it)


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def launched() -> bool:
    """Whether torchrun (or a launcher setting its variables) started this process in a group of ≥ 2.

    Read from the environment only (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``); imports nothing.
    """
    if any(name not in os.environ for name in TORCHRUN_ENV):
        return False
    world = _env_int("WORLD_SIZE")
    return world is not None and world > 1


def _initialised() -> Any:
    """``torch.distributed`` when a process group is initialised (by anyone), else None.

    Imports torch only when it is loaded already or torchrun started this process."""
    if "torch" not in sys.modules and not launched():
        return None
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def world_size() -> int:
    """Ranks of this run: the initialised process group's size, else torchrun's ``WORLD_SIZE``, else 1."""
    dist = _initialised()
    if dist is not None:
        return int(dist.get_world_size())
    return int(os.environ["WORLD_SIZE"]) if launched() else 1


def rank() -> int:
    """This process's rank (0 when not distributed)."""
    dist = _initialised()
    if dist is not None:
        return int(dist.get_rank())
    return _env_int("RANK") or 0 if launched() else 0


def local_rank() -> int:
    """This process's rank on its machine (torchrun's ``LOCAL_RANK``; the GPU it uses), 0 when unset."""
    return _env_int("LOCAL_RANK") or 0


def active() -> bool:
    """Whether this run is split over two or more ranks."""
    return world_size() > 1


def is_main() -> bool:
    """Whether this process writes the reports: rank 0, or the only process."""
    return rank() == 0


def backend() -> str | None:
    """The process group's backend (``gloo``, ``nccl``), or None when not distributed."""
    dist = _initialised()
    return str(dist.get_backend()) if dist is not None else None


def _timeout() -> float:
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return _DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{TIMEOUT_ENV}={text!r}: give the seconds a collective may wait for the other ranks, a "
                          f"positive number, e.g. {TIMEOUT_ENV}=1800")
    return value


def select_device(device: str | None) -> None:
    """Under torchrun with a CUDA device, make ``cuda`` mean this rank's GPU (``LOCAL_RANK``).

    Called before the model fixture loads, so ``dnnsafety_device=cuda`` (or ``auto`` on a GPU
    machine) puts each rank's model on its own GPU, the one NCCL uses for this rank.
    """
    if not launched() or not device or not (device == "auto" or device.startswith("cuda")):
        return
    import torch

    if torch.cuda.is_available() and ":" not in device:
        torch.cuda.set_device(local_rank() % max(1, torch.cuda.device_count()))


def ensure_group(device: str | None = None) -> bool:
    """Initialise the process group if torchrun started this process and nobody did yet; True when distributed.

    Backend ``nccl`` when ``device`` resolves to CUDA (each rank on its ``LOCAL_RANK`` GPU), else
    ``gloo``; rendezvous through torchrun's ``MASTER_ADDR``/``MASTER_PORT`` (``env://``); collectives
    time out after ``DNNSAFETY_TORCHRUN_TIMEOUT`` seconds. A group the user initialised is used as it is.
    """
    global _created
    if _initialised() is not None:
        return world_size() > 1
    if not launched():
        return False
    import datetime

    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError("torchrun started this run but this torch build has no torch.distributed. Fix: install a "
                          "torch build with distributed support, or run pytest without torchrun")
    cuda = bool(device) and (str(device).startswith("cuda") or (device == "auto" and torch.cuda.is_available()))
    name = "nccl" if cuda and dist.is_nccl_available() else "gloo"
    if name == "nccl":
        select_device(str(device))
    dist.init_process_group(name, init_method="env://", timeout=datetime.timedelta(seconds=_timeout()))
    _created = True
    return int(dist.get_world_size()) > 1


def close() -> None:
    """Destroy the process group if :func:`ensure_group` created it (end of the run)."""
    global _created
    if not _created:
        return
    _created = False
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def describe() -> dict[str, Any]:
    """``{"world_size": n, "backend": "gloo" | "nccl" | None}`` for the evidence."""
    return {"world_size": world_size(), "backend": backend()}


# ------------------------------------------------------------------------------------------- shards


def shard(n: int, rank_: int | None = None, world: int | None = None) -> range:
    """This rank's contiguous share ``[r·n//w, (r+1)·n//w)`` of ``n`` items (all of them when not distributed).

    Deterministic; the shares of ranks 0..w-1 are disjoint, in order, and cover ``0..n-1``; their
    sizes differ by at most one.
    """
    r = rank() if rank_ is None else rank_
    w = world_size() if world is None else world
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"shard(n={n!r}): n must be a non-negative int")
    if not (isinstance(w, int) and w >= 1 and isinstance(r, int) and 0 <= r < w):
        raise ConfigError(f"shard: rank {r!r} must lie in 0..world_size-1 (world_size {w!r})")
    return range(r * n // w, (r + 1) * n // w)


@dataclass(frozen=True)
class Shard:
    """One rank's share of an evaluation data set, in whole batches of the single-process run.

    ``batches``: the batch indices (``start``, ``stop``) this rank forwards; ``rows``: the data rows
    they hold (``slice(start, stop)``; scenario table rows are sliced alike); ``n_rows``: rows of
    the whole data set.
    """

    rank: int
    world_size: int
    batches: tuple[int, int]
    rows: tuple[int, int]
    n_rows: int

    @property
    def row_slice(self) -> slice:
        return slice(*self.rows)

    @property
    def n_local(self) -> int:
        return self.rows[1] - self.rows[0]


def batch_shard(data: Any, batch_size: int) -> Shard | None:
    """This rank's :class:`Shard` of ``data`` batched by ``batch_size``, or None to evaluate it whole.

    None when not distributed, when the number of rows is unknown without reading the data (an
    unsized DataLoader), when a DataLoader has no fixed batch size (a custom batch sampler), or
    when there are fewer batches than ranks (a rank would have nothing to forward). Then every rank
    evaluates all of the data and no state is all-reduced: the values stay right, only the work is
    not split. The decision depends only on ``data`` and ``batch_size``, so all ranks make the same.
    """
    w = world_size()
    if w < 2:
        return None
    from pytest_dnnsafety.data.forms import known_length

    n = known_length(data)
    if not n:
        return None
    import torch

    if isinstance(data, torch.utils.data.DataLoader):
        step = data.batch_size
        if not step or data.batch_sampler is None or type(data.batch_sampler) is not torch.utils.data.BatchSampler:
            return None
    else:
        step = int(batch_size)
    n_batches = -(-n // step)
    if n_batches < w:
        return None
    r = rank()
    mine = shard(n_batches, r, w)
    rows = (mine.start * step, min(n, mine.stop * step))
    return Shard(rank=r, world_size=w, batches=(mine.start, mine.stop), rows=rows, n_rows=n)


# ------------------------------------------------------------------------------------ collectives


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (a small picklable value), in rank order; ``[obj]`` when not distributed."""
    ensure_group()
    dist = _initialised()
    if dist is None or dist.get_world_size() < 2:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def together(work: Callable[[], _T], sharded: bool = True) -> _T:
    """Run this rank's part of a sharded computation, then make sure every rank's part succeeded.

    Every rank calls this at the same point. ``work()`` runs locally; then the ranks exchange
    whether it raised (one :func:`gather`). If this rank's part raised, its exception propagates;
    if another rank's did, a :class:`MetricError` names that rank and its error. Either way no rank
    goes on to the state all-reduce that the others would never join. With ``sharded=False`` (the
    data are evaluated whole on every rank) it is just ``work()``.
    """
    if not sharded:
        return work()
    error: BaseException | None = None
    try:
        value = work()
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks were told
        error = exc
    told = gather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    failed = [(r, text) for r, text in enumerate(told) if text is not None]
    if failed:
        r, text = failed[0]
        raise MetricError(f"rank {r} of {len(told)} failed on its shard: {text}. Every rank stops this gate (the "
                          f"state all-reduce needs them all); fix that rank's error")
    return value


def merged(work: Callable[[], _T], shard: Any) -> _T:
    """An engine filled by ``work()`` on this rank's ``shard`` (see :func:`together`), its states all-reduced.

    ``shard`` is :func:`batch_shard`'s answer: ``None`` means every rank evaluated the data whole,
    and the engine is returned as filled (no collective).
    """
    engine = together(work, sharded=shard is not None)
    if shard is not None:
        engine.sync()
    return engine


# ---------------------------------------------------------------------------------- verdict agreement


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def agree_on_verdict(result: GateResult, timed: bool = False) -> None:
    """torchrun: all ranks compare this gate's (status, value, bound); if they differ it is an error on every rank.

    Sharded gates all-reduce their states, the others run whole with the same seed, so the ranks
    should agree exactly; a gate that does not (its value depends on the rank, a nondeterministic
    kernel) must not pass on one rank and fail on another: every rank makes it the same ``error``,
    naming each rank's verdict, so they all exit with the same code. A ``timed`` gate (its definition
    says :attr:`~pytest_dnnsafety.gates.GateDef.timed`: a wall-clock measurement, which no two
    processes repeat) takes rank 0's result on every rank instead.
    """
    if timed:
        first = gather(result.to_dict())[0]
        if not is_main():
            vars(result).update(vars(GateResult.from_dict(first)))
        return
    mine = (result.marker, result.status, result.value, result.bound)
    seen = gather(mine)
    if all(len(other) == len(mine) and all(_same(a, b) for a, b in zip(other, mine)) for other in seen):
        return
    shown = "; ".join(f"rank {r}: {status} value {value!r} bound {bound!r}"
                      for r, (_, status, value, bound) in enumerate(seen))
    result.details["ranks"] = [{"rank": r, "status": status, "value": value, "bound": bound}
                               for r, (_, status, value, bound) in enumerate(seen)]
    result.details["reason"] = "ranks disagree"
    result.status, result.passed = "error", False
    result.summary = (f"{result.marker}: error: the {len(seen)} torchrun ranks disagree ({shown}). Fix: make the "
                      "gate's measurement independent of the rank (same data, same seed on every rank)")
