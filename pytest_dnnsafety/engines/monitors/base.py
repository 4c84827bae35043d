"""Runtime safety monitors: the common protocol, fitting, calibration and user monitors.

A *runtime monitor* watches a trained classifier in operation and raises an alarm on inputs it
should not be trusted with (out-of-distribution inputs, faults, attacks); on an alarm the system
rejects the model's decision (Ferreira et al.; docs: gates/monitors.md). Every monitor here follows one protocol
(:class:`Monitor`):

1. ``fit`` on in-distribution (ID) training data only (the monitor never sees an OOD input);
2. ``score`` per input, **higher = more likely out-of-distribution**;
3. a threshold ``calibrate``-d on held-out ID data, so that at least ``accept`` (default 95%) of
   the ID calibration inputs are accepted;
4. ``alarm = score > threshold``.

:func:`fit_monitor` does 1–3 in one call: it splits the ID data (seeded) into fit rows and
calibration rows, fits on the former and calibrates on the latter.

Monitors read the model through a :class:`~.view.MonitorView`: the model's outputs and the per-neuron
features of hidden layers come from the session's
:class:`~pytest_dnnsafety.engines.core.capture.ActivationCache`, so every monitor of a session (and every
neuron gate) on the same model and data shares one forward pass. Monitors that need more than one
plain pass (ODIN's input perturbation, an autoencoder, a user monitor) read the inputs batch by batch
through the view's runner (:meth:`~.view.MonitorView.each`). A sharded view (torchrun) is scored on
this rank's batches and :meth:`Monitor.score` all-gathers the per-input scores.

The calibration rule (the ``⌈accept·n⌉``-th smallest calibration score) is the standard
split-conformal quantile without the ``(n+1)`` correction: on fresh ID data the accepted share is
``accept`` up to sampling error (exactly ``⌈accept·n⌉/(n+1)`` in expectation for continuous
scores). Pure torch; no pytest import.
"""

from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from pytest_dnnsafety.engines.core.capture import ActivationCache
from pytest_dnnsafety.data.forms import known_length
from pytest_dnnsafety.errors import ConfigError, DataError, MetricError
from pytest_dnnsafety.data.checks import check_share
from pytest_dnnsafety.engines.monitors.view import MonitorView

__all__ = [
    "Monitor",
    "fit_monitor",
    "CustomMonitor",
    "as_monitor",
    "BY_CHOICES",
]

#: How feature monitors assign fit inputs to classes: ``"auto"`` = the labels when the data has them, else the
#: model's predictions; ``"label"`` = the labels (unlabelled fit data is a :class:`DataError`); ``"prediction"``.
BY_CHOICES = ("auto", "label", "prediction")


# ----------------------------------------------------------------------------- the protocol


class Monitor(abc.ABC):
    """fit on ID data only -> score per input (higher = more likely out-of-distribution) -> alarm = score > threshold.

    Args:
        accept: in (0, 1), the share of ID calibration inputs the calibrated threshold accepts (default 0.95).
        calibration_share: in (0, 1), the share of the fit data :func:`fit_monitor` holds out (seeded) to
            calibrate the threshold (default 0.2).
        name: how reports name the monitor (default: the class's ``kind``, e.g. ``"energy"``).

    Subclasses implement ``_fit(view, generator)`` and ``_score(view) -> (N,) tensor``, and may override
    ``_config()`` (JSON-able configuration), ``_state_tensors()`` (the fitted state, for
    :meth:`state_bytes`), ``_merge(other)``, ``layers()`` and ``fixed_threshold()`` (a rule-based
    threshold that replaces calibration, e.g. the papers' own rules).
    """

    kind: ClassVar[str] = "monitor"

    def __init__(self, *, accept: float = 0.95, calibration_share: float = 0.2, name: str | None = None) -> None:
        self.accept = check_share(accept, "accept", "the share of in-distribution inputs the monitor must accept, "
                                                     "e.g. accept=0.95.")
        self.calibration_share = check_share(
            calibration_share, "calibration_share",
            "the share of the in-distribution fit data held out to calibrate the threshold, e.g. 0.2.")
        if name is None:
            name = self.kind
        if not isinstance(name, str) or not name.strip():
            raise ConfigError(f"name={name!r} must be a non-empty string. Fix: name the monitor, e.g. name='energy'.")
        self.name: str = name
        self.threshold: float | None = None
        self.fitted: bool = False
        #: JSON-able facts of the last :func:`fit_monitor` (seed, rows used); {} before.
        self.fit_info: dict[str, Any] = {}

    # -- hooks

    @abc.abstractmethod
    def _fit(self, view: MonitorView, generator: torch.Generator) -> None:
        """Learn the monitor's state from the ID view."""

    @abc.abstractmethod
    def _score(self, view: MonitorView) -> Tensor:
        """``(N,)`` scores, higher = more likely OOD."""

    def _config(self) -> dict[str, Any]:
        return {}

    def _state_tensors(self) -> Iterable[Tensor]:
        return ()

    def _merge(self, other: Monitor) -> None:
        """Fold ``other``'s fitted state into this one (default: nothing to merge)."""

    def layers(self) -> tuple[str, ...]:
        """The layers the monitor reads (for the cache's plan); () if none."""
        return ()

    def fixed_threshold(self) -> float | None:
        """A rule-based threshold that replaces calibration (None: calibrate on ID data)."""
        return None

    # -- the protocol

    def fit(self, view: MonitorView, *, generator: torch.Generator | None = None) -> Monitor:
        """Fit on the ID ``view`` (all its rows); ``generator`` seeds any randomness (k-means). Returns ``self``."""
        if not isinstance(view, MonitorView):
            raise ConfigError(f"{self.name}: fit needs a MonitorView, got {type(view).__name__}. Fix: use "
                              f"fit_monitor(monitor, model, data) or monitor.fit(MonitorView(model, data)).")
        self._fit(view, generator if generator is not None else torch.Generator().manual_seed(0))
        self.fitted = True
        return self

    def score(self, view: MonitorView) -> Tensor:
        """``(N,)`` float32 scores, higher = more likely OOD; NaN/inf is a :class:`MetricError` naming the monitor."""
        if not self.fitted:
            raise ConfigError(f"monitor {self.name!r} is not fitted. Fix: call fit_monitor(monitor, model, id_data) "
                              f"(or monitor.fit(view)) before score.")
        if view.shard is None or not view.gather:
            return self._check_scores(self._score(view), view.n_inputs, view.first_row)
        from pytest_dnnsafety.runtime import torchrun as ranks
        from pytest_dnnsafety.engines.core.states import all_gather_rows

        # Each rank scores its shard (the single-process batches); the ranks agree that all succeeded,
        # then every rank gathers all scores, in row order (the shards are contiguous, in rank order).
        local = ranks.together(lambda: self._check_scores(self._score(view), view.n_inputs, view.first_row))
        return all_gather_rows(local)

    def _check_scores(self, scores: Any, n: int, offset: int = 0) -> Tensor:
        scores = self._as_scores(scores, n)
        bad = ~torch.isfinite(scores)
        count = int(bad.sum())
        if count:
            first = int(torch.nonzero(bad)[0]) + offset
            raise MetricError(
                f"monitor {self.name!r} returned NaN/inf scores for {count} of {n} inputs (the first is input "
                f"{first}): an alarm decided on them would be meaningless. Fix: make the monitor's score finite "
                f"for every input (check for divisions by zero, log(0) and empty statistics in its fit).")
        return scores

    def _as_scores(self, scores: Any, n: int) -> Tensor:
        """``scores`` as a (n,) float32 tensor (shape and dtype checked on the host; finiteness not)."""
        if not isinstance(scores, Tensor):
            try:
                scores = torch.as_tensor(scores)
            except Exception as exc:
                raise MetricError(f"monitor {self.name!r} returned {type(scores).__name__}, not scores. Fix: return "
                                  f"a (N,) tensor or array of numbers, one per input.") from exc
        scores = scores.detach()
        if scores.ndim != 1 or scores.shape[0] != n:
            raise MetricError(f"monitor {self.name!r} returned scores of shape {tuple(scores.shape)} for {n} inputs. "
                              f"Fix: return one score per input, shape ({n},).")
        if scores.is_complex() or scores.dtype == torch.bool:
            raise MetricError(f"monitor {self.name!r} returned {scores.dtype} scores. Fix: return real numbers.")
        return scores.to(torch.float32)

    def calibrate(self, scores: Tensor) -> float:
        """Set and return the threshold: the smallest ``t`` among ``scores`` with ``share(scores <= t) >= accept``.

        That is the ``⌈accept·n⌉``-th smallest ID calibration score, so at least ``accept`` of the calibration
        inputs are accepted (ties may accept more). A monitor with a :meth:`fixed_threshold` (a paper's own rule)
        returns that instead.
        """
        fixed = self.fixed_threshold()
        if fixed is not None:
            self.threshold = float(fixed)
            return self.threshold
        scores = torch.as_tensor(scores).detach().reshape(-1).to(torch.float64)
        n = int(scores.numel())
        if n == 0:
            raise DataError(f"{self.name}: no calibration scores. Fix: calibrate on at least one in-distribution "
                            f"input (fit_monitor holds out calibration_share of the fit data).")
        if not bool(torch.isfinite(scores).all()):
            raise MetricError(f"{self.name}: the calibration scores hold NaN/inf. Fix: calibrate on the monitor's "
                              f"finite scores of in-distribution inputs.")
        k = max(1, math.ceil(round(self.accept * n, 9)))
        self.threshold = float(torch.sort(scores).values[k - 1])
        return self.threshold

    def alarm(self, scores: Tensor) -> Tensor:
        """``(N,)`` bool: ``scores > threshold``."""
        if self.threshold is None:
            raise ConfigError(f"monitor {self.name!r} has no threshold. Fix: fit it with fit_monitor (which "
                              f"calibrates) or call monitor.calibrate(id_scores) first.")
        return torch.as_tensor(scores) > self.threshold

    def config(self) -> dict[str, Any]:
        """JSON-able configuration (kind, name, accept, calibration_share and the monitor's own parameters)."""
        return {"kind": self.kind, "name": self.name, "accept": self.accept,
                "calibration_share": self.calibration_share, **self._config()}

    def state_bytes(self) -> int:
        """Memory of the fitted state (the tensors' ``nbytes``)."""
        return int(sum(t.numel() * t.element_size() for t in self._state_tensors()))

    def merge(self, other: Monitor) -> Monitor:
        """Fold ``other``'s fitted state (same class and configuration) into this monitor and return ``self``.

        For monitors fitted on disjoint parts of the ID data (workers): the merged state is the state of one fit on
        all of it. The threshold is reset to None: calibrate again on the pooled calibration scores.
        """
        if type(other) is not type(self):
            raise ConfigError(f"cannot merge {type(other).__name__} into {type(self).__name__} {self.name!r}. "
                              f"Fix: merge monitors of the same kind.")
        if not (self.fitted and other.fitted):
            raise ConfigError(f"cannot merge monitor {self.name!r}: both monitors must be fitted. Fix: fit both "
                              f"first.")
        mine, theirs = self.config(), other.config()
        for key in sorted(set(mine) | set(theirs)):
            if mine.get(key) != theirs.get(key):
                raise ConfigError(f"cannot merge monitor {self.name!r}: {key!r} differs ({mine.get(key)!r} vs "
                                  f"{theirs.get(key)!r}). Fix: build both with the same configuration.")
        self._merge(other)
        self.threshold = None
        if self.fit_info and other.fit_info:
            self.fit_info = {**self.fit_info, "n_fit": self.fit_info.get("n_fit", 0) + other.fit_info.get("n_fit", 0),
                             "merged": True}
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, fitted={self.fitted}, threshold={self.threshold})"


# ----------------------------------------------------------------------------- class assignment (feature monitors)


def fit_classes(view: MonitorView, by: str, monitor: str) -> tuple[Tensor, str]:
    """The class of every fit input and how it was chosen (``"label"`` or ``"prediction"``), see :data:`BY_CHOICES`."""
    if by in ("auto", "label"):
        labels = view.labels()
        if labels is not None:
            return labels, "label"
        if by == "label":
            raise DataError(
                f"{monitor}: by='label' needs labelled fit data, but the data has no labels. Fix: pass (x, y) as "
                f"the in-distribution data, or by='prediction' (or 'auto') to use the model's predicted classes.")
    return view.predictions(), "prediction"


def n_classes(view: MonitorView, classes: Tensor) -> int:
    """Classes of the model's output (its columns), else 1 + the largest class seen (a label-returning model)."""
    k = view.outputs().num_classes
    if classes.numel() == 0:
        return int(k) if k is not None else 1
    lowest, seen = int(classes.min()), int(classes.max()) + 1
    if lowest < 0:
        raise DataError(f"class indices must be >= 0; the fit data has class {lowest}. Fix: use labels 0..K-1.")
    if k is not None and seen > k:
        raise DataError(f"the fit data has class {seen - 1} but the model outputs {k} classes. Fix: use labels "
                        f"0..{k - 1}.")
    return int(k) if k is not None else seen


# ----------------------------------------------------------------------------- fitting


def fit_monitor(monitor: Any, model: Any, data: Any, *, seed: int = 0, batch_size: int = 256,
                device: torch.device | str = "cpu", cache: ActivationCache | None = None,
                plan: Iterable[str] = ()) -> Monitor:
    """Fit ``monitor`` in place on the ID ``data`` and calibrate its threshold; returns it.

    The rows of ``data`` are split by a ``torch.Generator`` seeded with ``seed``: ``round(calibration_share·n)``
    calibration rows, the rest fit rows (both at least 2). The monitor is fitted on the fit rows (the same
    generator then seeds its own randomness, e.g. k-means) and its threshold calibrated on its scores of the
    calibration rows. A monitor with a rule-based :meth:`Monitor.fixed_threshold` is fitted on all rows.
    ``monitor`` may also be a user object with ``fit(model, x, y)`` and ``score(model, x)`` (see
    :func:`as_monitor`); the wrapper is returned then. Outputs and features come from ``cache`` (a private
    :class:`~pytest_dnnsafety.engines.core.capture.ActivationCache` when None): fitting costs one forward pass, which also
    captures the layers of ``plan`` (e.g. every layer the session's monitors read) besides the monitor's own.
    """
    monitor = as_monitor(monitor)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ConfigError(f"seed={seed!r} must be an integer. Fix: pass seed=0 (or any int).")
    view = MonitorView(model, data, batch_size=batch_size, device=device, cache=cache,
                       plan=dict.fromkeys([*monitor.layers(), *plan]))
    n = known_length(data)
    if n == 0:
        raise DataError(f"fit_monitor({monitor.name!r}): the in-distribution data is empty (0 inputs). Fix: pass the "
                        f"model's in-distribution training data (at least 4 inputs) as `data`.")
    n = view.n_inputs  # unknown length (an iterable loader): the shared pass counts it
    gen = torch.Generator().manual_seed(int(seed))
    fixed = monitor.fixed_threshold() is not None
    n_cal = 0 if fixed else round(monitor.calibration_share * n)
    n_fit = n - n_cal
    if n_fit < 2 or (not fixed and n_cal < 2):
        need = 2 if fixed else max(4, math.ceil(2 / min(monitor.calibration_share, 1 - monitor.calibration_share)))
        raise DataError(
            f"fit_monitor({monitor.name!r}): the in-distribution data has {n} input(s), which gives {n_fit} fit and "
            f"{n_cal} calibration row(s) at calibration_share={monitor.calibration_share}; both need at least 2. "
            f"Fix: pass more in-distribution data (at least {need} inputs) or change calibration_share.")
    order = torch.randperm(n, generator=gen)
    cal_rows = torch.sort(order[:n_cal]).values
    fit_rows = torch.sort(order[n_cal:]).values
    fit_view = view if n_fit == n else view.subset(fit_rows)
    monitor.fit(fit_view, generator=gen)
    if fixed:
        monitor.calibrate(torch.empty(0))
    else:
        monitor.calibrate(monitor.score(view.subset(cal_rows)))
    monitor.fit_info = {"seed": int(seed), "n_inputs": n, "n_fit": n_fit, "n_calibration": n_cal,
                        "threshold_rule": "fixed" if fixed else "calibrated"}
    return monitor


# ----------------------------------------------------------------------------- user monitors


class CustomMonitor(Monitor):
    """Adapter for a user object with ``fit(model, x, y)`` and ``score(model, x) -> (N,) scores`` (higher = more OOD).

    ``fit`` gets all fit inputs at once (``y`` None for unlabelled data); ``score`` is called per batch of the
    view (inputs on the model's device) and its results are concatenated. Scores may be a tensor, an array or a
    list; NaN/inf is a :class:`MetricError` naming the monitor. Optional: ``name`` (attribute), ``state_bytes()``
    and ``merge(other)`` on the user object. The whole ``score`` counts as the monitor's overhead.
    """

    kind = "custom"

    def __init__(self, obj: Any, *, accept: float = 0.95, calibration_share: float = 0.2,
                 name: str | None = None) -> None:
        if not (callable(getattr(obj, "fit", None)) and callable(getattr(obj, "score", None))) or isinstance(obj, type):
            raise ConfigError(_NOT_A_MONITOR.format(kind=type(obj).__name__))
        if name is None:
            own = getattr(obj, "name", None)
            name = own if isinstance(own, str) and own.strip() else type(obj).__name__
        super().__init__(accept=accept, calibration_share=calibration_share, name=name)
        self.obj = obj

    def _fit(self, view: MonitorView, generator: torch.Generator) -> None:
        x = view.inputs()  # the user's fit(model, x, y) takes the fit inputs at once (the fit data only)
        labels = view.labels()
        try:
            self.obj.fit(view.model, x, labels)
        except Exception as exc:
            raise MetricError(f"monitor {self.name!r}: its fit(model, x, y) raised {type(exc).__name__}: {exc}. Fix: "
                              f"make fit accept the model, the inputs (N, ...) and the labels (N,) or None.") from exc

    def _score(self, view: MonitorView) -> Tensor:
        runner = view.runner(f"monitor {self.name!r}")
        parts = []
        for batch in view.each(runner):
            try:
                s = self.obj.score(view.model, batch.x)
            except Exception as exc:
                raise MetricError(f"monitor {self.name!r}: its score(model, x) raised {type(exc).__name__}: {exc}. "
                                  f"Fix: return one score per input of the batch.") from exc
            parts.append(self._as_scores(s, batch.n).to(batch.x.device))
        runner.check()
        return torch.cat(parts)

    def _config(self) -> dict[str, Any]:
        cls = type(self.obj)
        return {"class": f"{cls.__module__}.{cls.__qualname__}"}

    def state_bytes(self) -> int:
        own = getattr(self.obj, "state_bytes", None)
        if callable(own):
            return int(own())
        return int(sum(v.numel() * v.element_size() for v in vars(self.obj).values() if isinstance(v, Tensor))) \
            if hasattr(self.obj, "__dict__") else 0

    def _merge(self, other: Monitor) -> None:
        merge = getattr(self.obj, "merge", None)
        if not callable(merge):
            raise ConfigError(f"monitor {self.name!r} cannot merge: its {type(self.obj).__name__} has no "
                              f"merge(other) method. Fix: add one, or fit the monitor on all data in one process.")
        assert isinstance(other, CustomMonitor)
        merge(other.obj)


_NOT_A_MONITOR = (
    "a {kind} is not a monitor. Fix: pass a Monitor (MSP(), Energy(), ODIN(), OutsideTheBox(layer), "
    "ActivationPatterns(layer), Mahalanobis(layer), Autoencoder(module)) or an object (an instance, not a class) "
    "with methods fit(model, x, y) and score(model, x) -> (N,) scores, higher = more out-of-distribution."
)


def as_monitor(obj: Any) -> Monitor:
    """A :class:`Monitor` as it is; an object with ``fit``/``score`` wrapped in :class:`CustomMonitor`; else error."""
    if isinstance(obj, Monitor):
        return obj
    if isinstance(obj, type) and issubclass(obj, Monitor):
        raise ConfigError(f"{obj.__name__} is a class. Fix: pass an instance, e.g. {obj.__name__}(...).")
    return CustomMonitor(obj)
