"""Outputs written while the run goes on: each finished gate reaches the evidence (and the JUnit file) as it finishes.

A run killed by a CI timeout or a SIGKILL runs no ``pytest_sessionfinish``: without these writes it would leave no
evidence at all. The reporting process (:mod:`pytest_dnnsafety.plugin.session.gathering`) hands a
:class:`Snapshot` of what finished to a :class:`PartialWriter` after each gate (one process, torchrun's rank 0) or
each test (the pytest-xdist controller: the workers' results ride on the tests' reports); the writer rewrites the
JSON evidence with ``"complete": false`` and the finished gates only, and a JUnit file of the finished testcases at
``--junitxml``'s path (pytest writes its own file there at the end of the run, which the plugin then patches).
Every write is atomic (:func:`~pytest_dnnsafety.report.evidence.write_text_atomic`: a temporary file in the same
folder, fsync'ed, renamed), so a kill at any instant leaves the previous file or the next one, never half a file.

Cost: each write rewrites the whole file (O(gates)), so writing after every gate is O(gates²) over the run. The
writer keeps that small by measuring its own writes: a write that cost ``c`` seconds is followed by the next one
no sooner than ``GAP_FACTOR × c`` later (so writing takes at most ~1/GAP_FACTOR of the run's time), except that
writes under :data:`FREE_SECONDS` are never delayed (hundreds of gates: every gate is written when it finishes).
A delayed write is made by a timer thread at the end of the gap (with the newest snapshot), also while the next
gate computes, so a finished gate reaches the files within one gap whatever happens next. Nothing here imports
torch or pytest.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from pytest_dnnsafety.results import GateResult

__all__ = ["Snapshot", "PartialWriter", "GAP_FACTOR", "FREE_SECONDS"]

#: After a write that took c seconds, the next waits until GAP_FACTOR × c have passed (writing ≤ ~5% of the run).
GAP_FACTOR = 20.0
#: A write faster than this is never delayed.
FREE_SECONDS = 0.01


@dataclass(frozen=True)
class Snapshot:
    """What finished so far: gate rows (collection order), the run's environment, the shared passes, the
    finished testcases for JUnit (``{"nodeid", "outcome", "time", "message"}``; outcome passed, failed, error or
    skipped) and the run's ``dnnsafety.*`` suite properties."""

    rows: Sequence[GateResult]
    environment: dict[str, Any]
    shared_passes: Sequence[dict[str, Any]] = ()
    cases: Sequence[dict[str, Any]] = ()
    suite_properties: dict[str, Any] = field(default_factory=dict)
    lost: Sequence[str] = ()


class PartialWriter:
    """Calls ``write(snapshot)`` for the newest snapshot, throttled by the measured cost of the writes (see the
    module docstring). ``close()`` stops it for good (before the run's final outputs are written): a delayed write
    is dropped, one in progress is waited for. A write that raises is counted in ``errors`` (the first message
    kept in ``error``) and never reaches the caller: the final write decides whether the run's outputs exist."""

    def __init__(self, write: Callable[[Snapshot], Any], *, gap_factor: float = GAP_FACTOR,
                 free_seconds: float = FREE_SECONDS, clock: Callable[[], float] = time.monotonic) -> None:
        self._write = write
        self._gap_factor = gap_factor
        self._free = free_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._pending: Snapshot | None = None
        self._timer: threading.Timer | None = None
        self._closed = False
        self._last_end = float("-inf")
        self._last_cost = 0.0
        #: writes made, their total seconds, failed writes and the first failure's message
        self.writes = 0
        self.seconds = 0.0
        self.errors = 0
        self.error: str | None = None

    def submit(self, snapshot: Snapshot) -> None:
        """Write ``snapshot`` now, or (when the last write was costly) at the end of its gap on a timer thread."""
        with self._lock:
            if self._closed:
                return
            self._pending = snapshot
            wait = self._wait()
            if wait <= 0:
                self._flush()
            elif self._timer is None:
                self._timer = threading.Timer(wait, self._on_timer)
                self._timer.daemon = True
                self._timer.start()

    def _wait(self) -> float:
        if self._last_cost <= self._free:
            return 0.0
        return self._last_end + self._gap_factor * self._last_cost - self._clock()

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
            if not self._closed and self._pending is not None:
                self._flush()

    def _flush(self) -> None:
        snapshot, self._pending = self._pending, None
        if snapshot is None:
            return
        start = self._clock()
        try:
            self._write(snapshot)
        except Exception as exc:  # noqa: BLE001 - a partial write never fails the run; the final one decides
            self.errors += 1
            if self.error is None:
                self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._last_end = self._clock()
            self._last_cost = self._last_end - start
            self.writes += 1
            self.seconds += self._last_cost

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._pending = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
