"""The session's shared forward passes, timed as their own entries and not charged to the gate that triggered them.

Every gate that reads the model's outputs or a layer's activations gets them from the session's one
:class:`~pytest_dnnsafety.engines.core.capture.ActivationCache` (``cache["activations"]``): the first gate on a
(model, data) pair runs the pass (minutes at 224² on a CPU), every later one reads it for free. Without a
clock the first gate's ``seconds`` held the whole pass (564 s against 0.03 s for the others).
:class:`PassClock` times each pass the cache runs (wrapping the instance's ``_pass``: the one place every pass
goes through), records it as an entry (fixtures, layers, images, seconds, images/s, the gate that needed it
first, the xdist worker), and :meth:`PassClock.charge` takes the seconds of the passes a gate triggered out of
that gate's ``seconds`` into ``details["shared_pass_seconds"]``. Modules imported for the first time inside the
pass (the capture machinery, torch's lazily loaded parts) are the pass's ``startup_seconds``, outside its
``seconds``, as for a gate (:class:`~pytest_dnnsafety.gates.evaluation.ImportClock`); the gate's own clock
already counts them in its ``startup_seconds``, so they are not taken from its ``seconds`` twice. The entries travel to the reporting process
on the tests' reports (as JSON, like the gates' results). No torch import at module level: the cache is made
(and torch's capture module imported) only once torch is loaded, i.e. when a fixture could be a torch model.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any, Mapping

__all__ = ["PassClock"]

#: The cache's method every forward pass goes through (engines/core/capture.py); a test checks it exists.
PASS_METHOD = "_pass"


def _images(cache: Any, model: Any, data: Any, shard: Any) -> int | None:
    """The inputs the pass forwarded: the outputs' rows it produced, else the data's known length."""
    try:
        outputs = cache._outputs.get(cache._key(model, data, shard))
        if outputs is not None:
            return int(outputs.n_inputs)
    except Exception:  # noqa: BLE001 - a cache without those internals: fall back on the data's length
        pass
    if shard is not None and isinstance(getattr(shard, "n_local", None), int):
        return int(shard.n_local)
    from pytest_dnnsafety.data.forms import known_length

    return known_length(data)


class PassClock:
    """Times the shared passes of one process's activation cache (see the module docstring).

    ``entries``: one dict per pass (the evidence's ``shared_passes`` items, with an ``id`` unique in the run);
    ``seconds``: their total, read before and after a gate by :meth:`charge`.
    """

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.seconds = 0.0
        self._gate: tuple[str, str, dict[int, str]] = ("", "", {})
        self._watched: Any = None
        self.worker = os.environ.get("PYTEST_XDIST_WORKER") or None

    def watch(self, cache: dict[str, Any]) -> None:
        """Make sure the session cache's activation cache is timed (created first when torch is loaded)."""
        acts = cache.get("activations")
        if acts is None:
            if "torch" not in sys.modules:  # no fixture can be a torch model yet: no pass can run
                return
            from pytest_dnnsafety.engines.core.capture import ActivationCache

            acts = cache["activations"] = ActivationCache()
        if acts is self._watched or not callable(getattr(acts, PASS_METHOD, None)):
            return
        self._watched = acts
        setattr(acts, PASS_METHOD, self._timed(acts, getattr(acts, PASS_METHOD)))

    def _timed(self, acts: Any, run: Any) -> Any:
        @functools.wraps(run)
        def timed(model: Any, data: Any, layers: Any, *args: Any, **kwargs: Any) -> Any:
            from pytest_dnnsafety.gates.evaluation import ImportClock

            start = time.perf_counter()
            error: BaseException | None = None
            clock = ImportClock()  # first-time imports inside the pass are startup (the gate's startup_seconds)
            try:
                with clock:
                    return run(model, data, layers, *args, **kwargs)
            except BaseException as exc:
                error = exc
                raise
            finally:
                elapsed = time.perf_counter() - start
                startup = min(clock.seconds, elapsed)
                self._record(acts, model, data, layers, kwargs.get("shard"), elapsed - startup, startup, error)

        return timed

    def _record(self, acts: Any, model: Any, data: Any, layers: Any, shard: Any, seconds: float, startup: float,
                error: BaseException | None) -> None:
        nodeid, marker, names = self._gate
        images = None if error is not None else _images(acts, model, data, shard)
        entry: dict[str, Any] = {
            "id": f"{self.worker or 'main'}:{len(self.entries)}",
            "model": names.get(id(model)), "data": names.get(id(data)), "layers": [str(x) for x in layers],
            "images": images, "seconds": seconds, "startup_seconds": startup,
            "images_per_second": images / seconds if images is not None and seconds > 0 else None,
            "nodeid": nodeid, "marker": marker, "worker": self.worker}
        if shard is not None:
            entry["shard"] = {"rank": getattr(shard, "rank", None), "world_size": getattr(shard, "world_size", None)}
        if error is not None:
            entry["error"] = f"{type(error).__name__}: {error}"
        self.entries.append(entry)
        self.seconds += seconds

    def gate(self, nodeid: str, marker: str, fixtures: Mapping[str, str], funcargs: Mapping[str, Any]) -> float:
        """Before a gate: who would trigger a pass now (its fixtures name the model and data); the total so far."""
        self._gate = (nodeid, marker, {id(funcargs[name]): name for name in fixtures.values() if name in funcargs})
        return self.seconds

    def charge(self, result: Any, before: float) -> None:
        """After a gate: the passes it triggered leave its ``seconds`` for ``details["shared_pass_seconds"]``."""
        taken = self.seconds - before
        self._gate = ("", "", {})
        if taken <= 0:
            return
        result.seconds = max(float(result.seconds) - taken, 0.0)
        if isinstance(result.details, dict):
            result.details["shared_pass_seconds"] = taken

    def since(self, count: int) -> list[dict[str, Any]]:
        """The entries recorded after the first ``count``."""
        return self.entries[count:]
