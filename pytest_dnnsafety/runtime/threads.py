"""torch's intra-op CPU threads for each test process: steady speed on shared machines.

torch starts one intra-op thread per core it sees. That is right on an idle machine and badly
wrong on a shared one: OpenMP's threads meet at a barrier after every parallel loop, so when one of
them is descheduled because another process holds its core, every other thread spins until it
comes back. The engines' loops are many short parallel regions, so one competing CPU-bound process
on two cores made the reliability assessment (40 × 40 cells, 1,000 samples each) about 7× slower
with torch's default 2 threads than with 1 (4.4 s vs 0.65 s on a loaded 2-core machine;
``tests/benchmarks/test_bench_contention.py`` measures 1.5–4× on its smaller grid, depending on
the other load), and ``pytest -n auto`` —
N workers, each starting N threads — oversubscribes the cores by construction.

Policy (:func:`plan`), first match wins:

1. the plugin's ``threads`` setting, run-wide (CLI ``--dnnsafety-threads`` > env
   ``DNNSAFETY_THREADS`` > ini ``dnnsafety_threads``; no marker keyword: the thread pool is one per
   process). An integer is used up to the usable cores (below); an explicit ``auto`` asks for
   rule 3 even when ``OMP_NUM_THREADS`` is set.
2. ``OMP_NUM_THREADS``, then ``MKL_NUM_THREADS``, when set to a positive integer: the variables
   users already set for every OpenMP program, used up to the usable cores. (torch reads them at
   import but caps them at its core count — ``OMP_NUM_THREADS=3`` gives 2 threads on 2 cores — so
   the plugin sets the value itself and the header never shows a count torch does not use.)

A count from rule 1 or 2 above the usable cores is capped at them, and the header says so
(``threads=2 (from OMP_NUM_THREADS: 100000 capped at the 2 usable cores)``): more threads than
cores only spin at OpenMP's barriers, and ``torch.set_num_threads(100000)`` ends the process in a
segmentation fault when OpenMP fails to start that many threads.
3. ``auto``: ``max(1, min(cores // processes, cores - busy))`` where

   * ``cores`` are the usable cores: this process's CPU affinity, capped by a cgroup CPU quota
     (``/sys/fs/cgroup/cpu.max``, or cgroup v1's ``cpu.cfs_quota_us``) — a container limited to
     2 CPUs on a 64-core host gets 2, not the 64 that ``os.cpu_count()`` (and torch) see;
   * ``processes`` is the number of test processes sharing them: pytest-xdist's worker count
     (``workerinput["workercount"]``; on the controller ``-n``) times torchrun's
     ``LOCAL_WORLD_SIZE``;
   * ``busy`` are the cores that *other* processes keep busy, measured once per process (for the
     run header, or at the first gate's set-up; outside every gate's timing) over
     :data:`LOAD_WINDOW` seconds from the per-core counters in ``/proc/stat`` (Linux), minus this
     process's own CPU time, rounded to whole cores (a core counts when others use more than half
     of it). This is the rule that fixes the single-process case above: the worker count alone
     would still give 2 threads on 2 cores with a competitor holding one of them. The asymmetry
     favours giving threads up: 1 thread instead of 2 on a machine that turns quiet costs the
     reliability assessment 1.6×, 2 threads beside a competitor cost it 7×. The 1-minute load
     average (:func:`os.getloadavg`) would be the portable alternative, but it lags by a minute and
     counts this run's own collection work; where ``/proc/stat`` is missing (macOS, Windows) the
     load rule is skipped. Measured once, the count stays fixed for the process, so every gate of
     a run reduces in the same order; a competitor that starts later in the run is not seen (set
     ``threads`` where that matters). The cost: :data:`LOAD_WINDOW` seconds once per process, also
     in a run without gates when its header is shown (never a torch import there).

Where the thread count is set: torch is imported lazily, and a project that never collects a gate
must not pay for it. :func:`apply` is called by the session when collection finished in a process
that will run gates (the single process, or each xdist worker) — after the user's ``conftest.py``
imported what it needs, before any fixture or gate does torch work — so the fixtures (model
loading, the user's own set-up) and the gates run with the same count. The controller of an xdist
run never imports torch for it; its header shows the count planned for each worker.

``torch.set_num_interop_threads`` is not touched: the engines use no inter-op parallelism
(``torch.jit.fork``), and it can only be called before any parallel work started, which in a
user's ``conftest.py`` may already have happened.

A fixed count (``threads = 1``) gives the same floating-point summation order on every machine;
``auto`` adapts to the machine, so sums reduced in parallel may differ in their last bits between
machines with different counts (counts, verdicts and integer metrics do not).
"""

from __future__ import annotations

import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

__all__ = ["HOST_BOUND_ELEMENTS", "LOAD_WINDOW", "ThreadPlan", "apply", "applied", "busy_cores", "host_bound",
           "kernel_policy", "plan", "sized", "usable_cores"]

#: Seconds over which :func:`busy_cores` watches the other processes' CPU use, once per process (the
#: run header's plan, or the first gate's): the cost of the load rule. At the kernel's 100 Hz
#: counters that is 5 ticks per core, enough to tell a busy core (> half) from an idle one.
LOAD_WINDOW = 0.05

#: Kernels of fewer elements than this are host-bound: a parallel region over them costs more in OpenMP's
#: fork and barrier (microseconds each, milliseconds when a competing process holds a core) than it saves.
#: :func:`sized` runs work whose largest kernel is below it on one thread.
HOST_BOUND_ELEMENTS = 1 << 18

#: Environment variables torch itself reads for its intra-op thread count, in torch's order.
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

#: (owner, plan) of the last :func:`apply` in this process; the owner is the run's Settings object, so a
#: later in-process run (pytester) does not see an earlier run's plan.
_APPLIED: "tuple[Any, ThreadPlan] | None" = None
#: :func:`busy_cores` as measured once in this process (``False``: not measured yet).
_BUSY: "float | None | bool" = False
#: Whether :func:`host_bound`/:func:`sized` change the thread count (:func:`kernel_policy` switches it; benchmarks
#: compare the engines with and without it).
_KERNEL_POLICY = True


@dataclass(frozen=True)
class ThreadPlan:
    """The intra-op thread count for one process and why."""

    threads: int
    #: where the count comes from: the setting's source, an environment variable, or "auto"
    source: str
    #: a short human explanation, shown in the run header
    reason: str
    cores: int | None = None
    processes: int = 1
    busy: int | None = None

    def header(self, *, per_worker: bool = False) -> str:
        """``threads=1 per worker (auto: 2 usable cores shared by 2 test processes)``."""
        return f"threads={self.threads}{' per worker' if per_worker else ''} ({self.reason})"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------- measurements


def _cgroup_cpus(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPU quota of this process's cgroup in whole CPUs (rounded up), or None when unlimited/unknown."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # cgroup v2: "max 100000" or "200000 100000"
        if quota != "max":
            return max(1, math.ceil(int(quota) / int(period)))
        return None
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return max(1, math.ceil(quota_us / period_us)) if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def _affinity() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return None


def usable_cores() -> int:
    """This process's CPU affinity (``os.cpu_count()`` where unknown), capped by a cgroup CPU quota."""
    cpus = _affinity()
    cores = len(cpus) if cpus else (os.cpu_count() or 1)
    quota = _cgroup_cpus()
    return max(1, min(cores, quota) if quota else cores)


def _cpu_ticks(cpus: set[int] | None) -> tuple[int, int] | None:
    """(busy, total) jiffies summed over ``cpus`` (all when None) from ``/proc/stat``; None if unreadable."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        fields = [int(x) for x in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
        fields += [0] * (8 - len(fields))
        idle = fields[3] + fields[4]
        busy += sum(fields) - idle
        total += sum(fields)
    return (busy, total) if total else None


def busy_cores(window: float = LOAD_WINDOW) -> float | None:
    """Cores (of this process's affinity) kept busy by *other* processes over ``window`` seconds.

    From the per-core busy/total jiffies of ``/proc/stat`` before and after the window, minus this
    process's own CPU time (``os.times``); None where ``/proc/stat`` cannot be read (not Linux).
    """
    cpus = _affinity()
    first = _cpu_ticks(cpus)
    if first is None:
        return None
    own0, wall0 = os.times(), time.perf_counter()
    time.sleep(window)
    second = _cpu_ticks(cpus)
    own1, wall1 = os.times(), time.perf_counter()
    if second is None or second[1] <= first[1]:
        return None
    n_cpus = len(cpus) if cpus else (os.cpu_count() or 1)
    busy = (second[0] - first[0]) / (second[1] - first[1]) * n_cpus
    own = ((own1.user - own0.user) + (own1.system - own0.system)) / max(wall1 - wall0, 1e-9)
    return max(0.0, busy - own)


def _busy_once() -> float | None:
    """:func:`busy_cores`, measured once per process: a test process pays :data:`LOAD_WINDOW` once."""
    global _BUSY
    if _BUSY is False:
        _BUSY = busy_cores()
    return _BUSY  # type: ignore[return-value]


# ---------------------------------------------------------------------------------- policy


def _env_threads(env: Mapping[str, str]) -> tuple[str, int] | None:
    """The first of OMP_NUM_THREADS / MKL_NUM_THREADS set to a positive integer (``"4,2"``: nested, 4)."""
    for name in _THREAD_ENV:
        text = env.get(name, "").strip().split(",")[0].strip()
        if text.isdigit() and int(text) >= 1:
            return name, int(text)
    return None


def _processes(config: Any, env: Mapping[str, str]) -> tuple[int, str]:
    """How many test processes share the cores, and a description: xdist workers × torchrun local ranks."""
    workers = 1
    workerinput = getattr(config, "workerinput", None) if config is not None else None
    if isinstance(workerinput, Mapping):
        workers = int(workerinput.get("workercount", 1) or 1)
    elif config is not None:
        option = getattr(config, "option", None)
        numprocesses = getattr(option, "numprocesses", None)
        if getattr(option, "dist", "no") != "no" and isinstance(numprocesses, int) and numprocesses > 0:
            workers = numprocesses
    local = env.get("LOCAL_WORLD_SIZE", "").strip()
    ranks = int(local) if local.isdigit() and int(local) >= 1 else 1
    parts = [f"{workers} xdist workers"] if workers > 1 else []
    parts += [f"{ranks} torchrun local ranks"] if ranks > 1 else []
    return workers * ranks, " × ".join(parts)


def _capped(count: int, source: str, reason: str, cores: int | None) -> ThreadPlan:
    """A count the user gave, capped at the usable cores (the reason says so when it is)."""
    cores = usable_cores() if cores is None else int(cores)
    if count <= cores:
        return ThreadPlan(count, source, reason)
    return ThreadPlan(cores, source, f"{reason}: {count} capped at the {cores} usable core{'s' if cores != 1 else ''}",
                      cores=cores)


def plan(settings: Any, config: Any = None, *, env: Mapping[str, str] | None = None, cores: int | None = None,
         busy: float | None | bool = True, processes: int | None = None) -> ThreadPlan:
    """The thread count for this process (see the module docstring for the policy).

    ``settings`` are the run's :class:`~pytest_dnnsafety.settings.Settings` (its ``threads`` setting);
    ``config`` the pytest config (xdist worker count) or None; ``processes`` overrides the count of
    test processes sharing the cores. ``cores`` and ``busy`` override the
    measurements (tests); ``busy=True`` measures (:func:`busy_cores`, :data:`LOAD_WINDOW` seconds),
    ``busy=None`` skips the load rule. Pure apart from those measurements; no torch import.
    """
    env = os.environ if env is None else env
    resolved = settings.get("threads")
    if resolved.source != "default" and resolved.value != "auto":
        return _capped(int(resolved.value), resolved.source, f"from {resolved.source}", cores)
    if resolved.source == "default":
        found = _env_threads(env)
        if found is not None:
            name, count = found
            return _capped(count, f"environment variable {name}", f"from {name}", cores)
    cores = usable_cores() if cores is None else int(cores)
    if processes is None:
        processes, shared_by = _processes(config, env)
    else:
        processes, shared_by = max(1, int(processes)), f"{processes} test processes"
    share = max(1, cores // processes)
    others = _busy_once() if busy is True else busy
    taken = int(math.floor(others + 0.5)) if isinstance(others, (int, float)) else None
    threads = max(1, min(share, cores - taken)) if taken is not None else share
    reason = f"auto: {cores} usable core{'s' if cores != 1 else ''}"
    if processes > 1:
        reason += f" shared by {shared_by}"
    if taken:
        reason += f", {taken} busy with other processes"
    source = "auto" if resolved.source == "default" else f"auto ({resolved.source})"
    return ThreadPlan(threads, source, reason, cores=cores, processes=processes, busy=taken)


def apply(thread_plan: ThreadPlan, owner: Any = None) -> ThreadPlan:
    """Set torch's intra-op threads to the plan's count (once per process); returns the plan applied.

    Without torch installed nothing is set. The plan applied is what :func:`applied` (and the evidence's
    ``environment.threads``) report for the same ``owner`` (the run's Settings).
    """
    global _APPLIED
    try:
        import torch
    except ImportError:
        return thread_plan
    if torch.get_num_threads() != thread_plan.threads:
        torch.set_num_threads(thread_plan.threads)
    _APPLIED = (owner, thread_plan)
    return thread_plan


def applied(owner: Any = None) -> ThreadPlan | None:
    """The plan :func:`apply` last applied in this process for ``owner``, or None."""
    return _APPLIED[1] if _APPLIED is not None and _APPLIED[0] is owner else None


def torch_threads() -> int | None:
    """torch's current intra-op thread count if torch is already imported (never imports it)."""
    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else None


# ---------------------------------------------------------------------------------- per-engine kernels


@contextmanager
def kernel_policy(enabled: bool) -> Iterator[None]:
    """Switch :func:`host_bound` and :func:`sized` on or off inside the block (benchmarks and tests)."""
    global _KERNEL_POLICY
    before, _KERNEL_POLICY = _KERNEL_POLICY, bool(enabled)
    try:
        yield
    finally:
        _KERNEL_POLICY = before


@contextmanager
def host_bound() -> Iterator[None]:
    """Run the block on one intra-op thread, then restore the process's count.

    The second half of the thread policy (the first, :func:`plan`, sets the process's count once): an
    engine whose work is many small kernels driven from Python — box matching per image, the scenario
    table's column codes, per-image bookkeeping — gains nothing from more threads and loses most on a
    busy machine, where every parallel region waits at OpenMP's barrier for a thread whose core another
    process holds (measured 9–20× slower with 2 threads than with 1 under one competitor on 2 cores).
    Engines dominated by large GEMMs (CROWN, the layers' forward passes, Gram matrices) keep the
    process's count. Thread counts are process-wide in torch; the engines run one at a time per process.
    """
    if not _KERNEL_POLICY:
        yield
        return
    import torch

    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def sized(elements: int) -> Iterator[None]:
    """:func:`host_bound` when the block's largest kernel has fewer than :data:`HOST_BOUND_ELEMENTS` elements."""
    if elements < HOST_BOUND_ELEMENTS:
        with host_bound():
            yield
    else:
        yield
