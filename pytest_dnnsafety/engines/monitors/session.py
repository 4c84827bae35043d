"""The session a monitor benchmark runs in, and its fault sets: lazy, seeded, one object per session.

:class:`MonitorSession` holds what the caller's test session provides, as plain values: ``memo`` (a
per-session memo keyed by objects, compared by identity, and by plain values; e.g. a gate context's
``memo``), the session's shared :class:`~pytest_dnnsafety.engines.core.capture.ActivationCache`, the seed,
the batch size, the device and the model's task (its variant, :func:`~.variants.for_task`). On it:

* :meth:`MonitorSession.stream` — data under a fault family and severity as a lazy
  :class:`~.stream.FaultStream`, one object per (data, family, severity, seed, clip, model) for the
  session, so its forward pass and monitor scores are shared by every gate (and the ``fault_data``
  fixture) that asks for it;
* :meth:`MonitorSession.fault_set` — the same fault set read into memory once (the ``fault_data``
  fixture's form);
* :meth:`MonitorSession.outputs` — the model's outputs from the shared pass, their labels checked against
  its classes (under torchrun this rank's shard, the ranks agreeing on a failure);
* :meth:`MonitorSession.first_facts` — a data set's per-sample input shape and whether it is labelled,
  from its first batch (one batch read per data set and session, never the data set).

Nothing here holds the evaluation images: a fault set is faulted batch by batch as it is read (its
seeds depend on the batch size, see :mod:`.stream`). Pure torch; no pytest import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pytest_dnnsafety.data.forms import iter_batches
from pytest_dnnsafety.engines.core.capture import ActivationCache
from pytest_dnnsafety.engines.monitors.faults import FAULT_GROUPS
from pytest_dnnsafety.engines.monitors.stream import fault_stream
from pytest_dnnsafety.engines.monitors.variants import ClassifierVariant, DetectorVariant, for_task
from pytest_dnnsafety.errors import DataError
from pytest_dnnsafety.runtime import torchrun as ranks

__all__ = ["Memo", "MonitorSession"]

#: ``memo(name, objects, values, compute)``: ``compute()``'s result, once per session for these ``objects``
#: (compared by identity and kept alive) and ``values`` (hashable); an exception is memoised too.
Memo = Callable[[str, tuple[Any, ...], tuple[Any, ...], Callable[[], Any]], Any]


def _clip(value: Any) -> tuple[float, float] | None:
    return None if value is None else (float(value[0]), float(value[1]))


@dataclass(frozen=True)
class MonitorSession:
    """The session services of the monitor benchmark (see the module docstring)."""

    memo: Memo
    activations: ActivationCache
    seed: int
    batch_size: int
    device: str
    #: the model's task (``single-label``, ``detection``): which benchmark variant applies
    task: str = "single-label"

    @property
    def variant(self) -> ClassifierVariant | DetectorVariant:
        """The benchmark variant of the model's task."""
        return for_task(self.task)

    def shard(self, data: Any) -> Any:
        """This torchrun rank's shard of ``data`` batched by the batch size, or None to evaluate it whole."""
        return ranks.batch_shard(data, self.batch_size)

    def first_facts(self, data: Any) -> tuple[tuple[int, ...], bool] | None:
        """(per-sample input shape, labelled?) of ``data`` from its first batch (read once per session); None: empty."""
        def read() -> tuple[tuple[int, ...], bool] | None:
            for x, y in iter_batches(data, self.batch_size):
                return None if x.shape[0] == 0 else (tuple(x.shape[1:]), y is not None)
            return None

        return self.memo("monitor first batch", (data,), (self.batch_size,), read)

    def outputs(self, model: Any, data: Any, plan: Sequence[str], role: str, what: str = "") -> Any:
        """The model's outputs on ``data`` (this rank's shard under torchrun), their labels checked against its classes.

        The pass is the shared one (its plan's layers captured with it); under torchrun every rank checks its
        shard and the ranks agree (a bad label on one rank's shard fails the gate on every rank).
        """
        shard = self.shard(data)

        def local() -> Any:
            out = self.activations.outputs(model, data, batch_size=self.batch_size, device=self.device, plan=plan,
                                           shard=shard)
            out.check_labels(role, what=what)
            return out

        return ranks.together(local, sharded=shard is not None)

    def stream(self, data: Any, family: str, severity: int, *, model: Any, clip: Any, role: str,
               plan: Sequence[str] = ()) -> Any:
        """``data`` under fault ``family`` at ``severity`` as a lazy :class:`~.stream.FaultStream`, one object per
        (data, family, severity, seed, clip, model) for the session.

        An adversarial family attacks the true class: the data must be labelled (read from its first batch)
        with classes the model outputs (checked on the shared pass; ``role`` names the data's fixture).
        """
        adversarial = family in FAULT_GROUPS["adversarial"]
        source = self.variant.fault_source(data, family)

        def make() -> Any:
            if adversarial:
                first = self.first_facts(source)
                if first is not None and not first[1]:
                    raise DataError(f"fault family {family!r} attacks the true class, but the evaluation data has "
                                    "no labels. Fix: give labelled data (x, y).")
                if isinstance(model, torch.nn.Module):  # the attack's loss reads the true class
                    self.outputs(model, source, plan, role, f"fault family {family!r} (it attacks the true class)")
            return fault_stream(source, family, severity, seed=self.seed, model=model, batch_size=self.batch_size,
                                device=self.device, clip=_clip(clip))

        return self.memo("monitor fault set", (data, model if adversarial else None),
                         (family, severity, self.seed, _clip(clip), self.batch_size, str(self.device)), make)

    def fault_set(self, data: Any, family: str, severity: int, *, model: Any = None, clip: Any = (0.0, 1.0),
                  role: str = "dataset") -> Any:
        """``data`` under fault ``family`` at ``severity`` as a ``TensorDataset`` (labels kept), once per session.

        The ``fault_data`` fixture's form: the benchmark's own lazy fault set (:meth:`stream`, the same seeded
        values) read into memory once, the same object for the same arguments. ``role`` names ``data``'s
        fixture in errors.
        """
        def make() -> Any:
            return self.stream(data, family, severity, model=model, clip=clip, role=role).materialise()

        adversarial = family in FAULT_GROUPS["adversarial"]
        return self.memo("monitor fault set (tensors)", (data, model if adversarial else None),
                         (family, severity, self.seed, _clip(clip), self.batch_size, str(self.device)), make)
