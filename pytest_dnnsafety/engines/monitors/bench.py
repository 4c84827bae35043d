"""The monitor benchmark of one gate's fixtures: its monitors fitted, their scores, the fault sets, the errors.

:class:`MonitorBench` reads the fixture values of a monitor gate by role (``model``, ``data``, the
in-distribution ``fit_data``, the ``monitors`` bank: a mapping name → monitor, and optionally ``novel``
class data) and runs on a :class:`~.session.MonitorSession`, so everything it computes is memoised per
session, keyed by the fixture objects: three gates on one monitor fit it once
(:meth:`MonitorBench.fitted`) and score each data set once (:meth:`MonitorBench.scores`), and every
forward pass goes through the shared activation cache, capturing every layer the bank's monitors read
(:attr:`MonitorBench.layers`). ``roles`` names each role's fixture and ``marker`` the gate, for the
errors.

Under torchrun the scoring of the evaluation and fault data is sharded by batches (each rank forwards its
share; the per-input scores and errors are all-gathered, so every rank computes the single-process
values). Pure torch; no pytest import.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pytest_dnnsafety.engines.core.capture import activations_from
from pytest_dnnsafety.engines.core.states import all_gather_rows
from pytest_dnnsafety.engines.monitors.base import Monitor, as_monitor, fit_monitor
from pytest_dnnsafety.engines.monitors.faults import NOVEL, SEVERITY_FREE, check_severity, expand_faults
from pytest_dnnsafety.engines.monitors.session import MonitorSession
from pytest_dnnsafety.engines.monitors.view import MonitorView
from pytest_dnnsafety.errors import ConfigError, DataError
from pytest_dnnsafety.files.provenance import monitor_state_digest
from pytest_dnnsafety.runtime import torchrun as ranks

__all__ = ["FaultSet", "MonitorBench", "set_name"]

#: One fault set of a benchmark: (family, severity or None for a severity-free family or novel data, data).
FaultSet = tuple[str, int | None, Any]


def set_name(family: str, severity: int | None) -> str:
    """A fault set's name in summaries and tables: the family, with its severity when it has one."""
    return family if severity is None else f"{family} s{severity}"


class MonitorBench:
    """The monitor benchmark of one gate's fixtures ``fx`` (by role) on ``session`` (see the module docstring)."""

    def __init__(self, session: MonitorSession, fx: Mapping[str, Any], *, roles: Mapping[str, str],
                 marker: str) -> None:
        self.session, self.fx, self.roles, self.marker = session, fx, roles, marker

    @property
    def layers(self) -> tuple[str, ...]:
        """Every layer the monitors of the bank read: one pass per data set captures them all."""
        bank = self.fx["monitors"]
        layers: dict[str, None] = {}
        for monitor in bank.values() if isinstance(bank, Mapping) else ():
            if isinstance(monitor, Monitor):
                layers.update(dict.fromkeys(monitor.layers()))
        return tuple(layers)

    def view(self, data: Any, plan: Sequence[str], *, shard: Any = None, gather: bool = True) -> MonitorView:
        """A :class:`~.view.MonitorView` of the gate's model on ``data`` through the session's shared pass."""
        s = self.session
        return MonitorView(self.fx["model"], data, batch_size=s.batch_size, device=s.device, cache=s.activations,
                           plan=plan, shard=shard, gather=gather)

    # ------------------------------------------------------------------------------ monitors

    def monitor(self, name: str) -> Monitor:
        """The bank's monitor ``name`` as configured (a ConfigError naming the fix when the bank has none)."""
        bank = self.fx["monitors"]
        role = self.roles["monitors"]
        if not isinstance(bank, Mapping):
            raise ConfigError(f"{self.marker}: fixture {role!r} returned {type(bank).__name__}; it must return a "
                              "mapping name -> monitor. Fix: return e.g. {'energy': Energy(), 'oob': "
                              "OutsideTheBox(layer=...)}.")
        if name not in bank:
            raise ConfigError(f"{self.marker}: monitor={name!r} is not in fixture {role!r} (it has "
                              f"{', '.join(map(repr, bank)) or 'none'}). Fix: name one of them, or add {name!r} to "
                              f"the {role!r} fixture in conftest.py, e.g. return {{**defaults, {name!r}: "
                              "Mahalanobis(layer='...')}.")
        try:
            return as_monitor(bank[name])
        except ConfigError as exc:
            raise ConfigError(f"{self.marker}: monitor {name!r} of fixture {role!r}: {exc}") from None

    def fitted(self, name: str) -> tuple[Monitor, tuple[Any, ...]]:
        """The monitor ``name`` fitted on the fit data, once per session: (fitted copy, the objects it was fitted
        from, which key its scores)."""
        monitor = self.monitor(name)
        self.check_like("fit_data")
        fx, s = self.fx, self.session
        objects = (fx["monitors"], fx["model"], fx["fit_data"])

        def fit() -> Monitor:
            fitted = copy.deepcopy(monitor)  # the fixture's monitor stays as configured
            fitted.name = name  # reported under the name the gates use
            self._check_fit_labels(name)
            return fit_monitor(fitted, fx["model"], fx["fit_data"], seed=s.seed, batch_size=s.batch_size,
                               device=s.device, cache=s.activations, plan=self.layers)

        return s.memo("fitted monitor", objects, (name, s.seed), fit), objects

    def _check_fit_labels(self, name: str) -> None:
        """DataError when the fit data's labels are classes the model cannot output (the pass is the fit's own)."""
        s = self.session
        if not isinstance(self.fx["model"], torch.nn.Module) or not s.variant.labels_are_classes:
            return
        out = s.activations.outputs(self.fx["model"], self.fx["fit_data"], batch_size=s.batch_size, device=s.device,
                                    plan=self.layers)
        out.check_labels(self.roles["fit_data"], what=f"fitting monitor {name!r}")

    def scores(self, monitor: Monitor, key: tuple[Any, ...], data: Any) -> torch.Tensor:
        """The fitted monitor's scores on ``data``, once per session: one forward pass shared through the activation
        cache, and under torchrun on this rank's batches only (every rank then holds all the scores)."""
        s = self.session

        def score() -> torch.Tensor:
            return monitor.score(self.view(data, (*monitor.layers(), *self.layers), shard=s.shard(data)))

        return s.memo("monitor scores", (*key, data), (monitor.name, s.seed), score)

    def about(self, name: str, monitor: Monitor) -> dict[str, Any]:
        """What the gate evaluated: the monitor's configuration, its fitted state's fingerprint and threshold."""
        return {"monitor": name, "monitor_config": monitor.config(), "monitor_threshold": monitor.threshold,
                "monitor_state": monitor_state_digest(monitor), "fit_data": self.roles["fit_data"],
                **(activations_from(self.fx["model"]) if monitor.layers() else {})}

    # ------------------------------------------------------------------------------ data

    def check_like(self, role: str) -> None:
        """Inputs of the ``role`` data have the per-sample shape of the evaluation data (e.g. OOD data).

        Compares the first batch of each (one batch read per data set and session, not the data set)."""
        first, ref = self.session.first_facts(self.fx[role]), self.session.first_facts(self.fx["data"])
        if first is None:
            raise DataError(f"{self.marker}: fixture {self.roles[role]!r} is empty. Fix: give at least one input.")
        shape, ref_shape = first[0], (ref[0] if ref is not None else first[0])
        if shape != ref_shape:
            raise DataError(f"{self.marker}: fixture {self.roles[role]!r} has inputs of shape {shape}, "
                            f"but {self.roles['data']!r} has {ref_shape}. Fix: give inputs of the shape "
                            "the model takes (same preprocessing as the evaluation data).")

    def sets(self, faults: Any, severity: Any, clip: Any) -> list[FaultSet]:
        """The fault sets of the marker's ``faults``, ``severity`` and ``clip``, in a stable order."""
        families = expand_faults(faults)
        severities = check_severity(severity)
        out: list[FaultSet] = []
        for family in families:
            if family == NOVEL:
                if "novel" not in self.fx:
                    raise ConfigError(
                        f"{self.marker}: faults= includes 'novel', but no novel-class data is configured. Fix: set "
                        "dnnsafety_ood_data (inputs of classes the model never saw), define an `ood_data` fixture, "
                        "or name one with novel=\"my_fixture\".")
                self.check_like("novel")
                out.append((NOVEL, None, self.fx["novel"]))
                continue
            for level in severities[:1] if family in SEVERITY_FREE else severities:
                data = self.session.stream(self.fx["data"], family, level, model=self.fx["model"], clip=clip,
                                           role=self.roles["data"], plan=self.layers)
                out.append((family, None if family in SEVERITY_FREE else level, data))
        return out

    def errors(self, data: Any, family: str | None, source: Any = None) -> torch.Tensor:
        """Per input of ``data``: is the model's decision wrong? (Always, on inputs that have no right answer.)

        From the shared pass (under torchrun this rank's shard, then all-gathered: every rank holds every
        input's). ``family``: the fault set's (None: the evaluation data); ``source``: the evaluation data."""
        s = self.session
        shard = s.shard(data)

        def local() -> torch.Tensor:
            out = s.activations.outputs(self.fx["model"], data, batch_size=s.batch_size, device=s.device, shard=shard)
            return s.variant.wrong(out, family, source, shard, self.roles["data"])

        wrong = ranks.together(local, sharded=shard is not None)
        return wrong if shard is None else all_gather_rows(wrong)
