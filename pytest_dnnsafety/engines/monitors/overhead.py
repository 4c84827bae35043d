"""Monitor overhead: the monitor's time per input relative to the model's (Ferreira et al.'s
safety-monitor benchmark measures time and memory overhead beside detection). Pure torch; no pytest import.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pytest_dnnsafety.errors import DataError
from pytest_dnnsafety.engines.core.guard import eval_mode
from pytest_dnnsafety.data.checks import check_count
from pytest_dnnsafety.engines.monitors.base import Monitor, MonitorView, as_monitor

__all__ = ["Overhead", "measure_overhead"]


@dataclass
class Overhead:
    """Time the monitor adds per input, against the model's own time per input, and its fitted state's memory."""

    monitor_s_per_input: float
    model_s_per_input: float
    ratio: float
    state_bytes: int
    repeats: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Any, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def measure_overhead(monitor: Monitor, view: MonitorView, *, repeats: int = 5,
                     monitor_view: MonitorView | None = None) -> Overhead:
    """The fastest wall time (``time.perf_counter``, CUDA-synchronised) of the model and of the monitor on ``view``.

    Model time: forward passes over the view's batches (its runner) under ``no_grad`` in eval mode. Monitor time: the
    monitor's :meth:`Monitor.score` on the view once the shared forward outputs and features are cached, i.e.
    what the monitor adds in deployment (output and feature monitors only their arithmetic; ODIN its extra
    forward+backward+forward; an autoencoder its own pass; a user monitor its whole score). One warm-up run of
    each is not timed; then ``repeats`` runs of each, interleaved, and the fastest of each is kept: other work on a
    shared machine only ever adds time (a monitor of 0.1 ms preempted once for a 10 ms scheduler slice would read
    100 times its cost), so the minimum is each one's own cost. ``ratio = monitor / model``. ``monitor_view``
    (default ``view``): the view the monitor is timed on, e.g. a torchrun rank's shard whose shared pass is
    cached already (both times are per input).
    """
    repeats = check_count(repeats, "repeats", 1, "pass repeats >= 1, e.g. 5.")
    monitor = as_monitor(monitor)
    n = view.n_inputs
    if n == 0:
        raise DataError("measure_overhead: the view has no inputs. Fix: measure on a non-empty data set.")
    device = view.model_device
    scored = view if monitor_view is None else monitor_view

    def run_model() -> None:
        runner = view.runner("monitor overhead: the model alone")
        with eval_mode(view.model), torch.no_grad():
            for batch in view.each(runner):
                view.model(batch.x)
        runner.check()

    def run_monitor() -> None:
        monitor.score(scored)

    run_model()  # warm-ups, not timed (the monitor's fills its cache: the shared pass is the model's, not the monitor's)
    run_monitor()
    model_times, monitor_times = [], []
    for _ in range(repeats):  # interleaved: a busy spell on a shared machine slows both alike, not one of them
        model_times.append(_timed(run_model, device))
        monitor_times.append(_timed(run_monitor, device))
    model_s = min(model_times) / n
    monitor_s = min(monitor_times) / scored.n_inputs
    ratio = monitor_s / model_s if model_s > 0 else math.inf
    return Overhead(monitor_s_per_input=monitor_s, model_s_per_input=model_s, ratio=ratio,
                    state_bytes=monitor.state_bytes(), repeats=repeats)
