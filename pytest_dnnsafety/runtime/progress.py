"""Progress of long gates: ``tick`` in batch loops, ``active`` around a gate, ``writer_for`` a pytest config.

Engines call :func:`tick` in their batch loops; it costs one global lookup when no reporter is
active, so it is safe in hot loops and in code that runs outside pytest. A gate is wrapped in
:func:`active`, which installs a reporter for the block::

    from pytest_dnnsafety.runtime import progress

    with progress.active(f"{marker} {nodeid}", progress.writer_for(config)):
        for i, batch in enumerate(batches):
            ...
            progress.tick(i + 1, len(batches), "batches")

What is shown: ``label: 45% 4500/10000 samples, 12s elapsed, ETA 15s``. A gate estimated before it runs
(``active(..., estimate=seconds)``) at :data:`MIN_SECONDS` or more shows ``label: estimated 2m10s`` at once,
and its lines end with ``estimated 2m10s``. Otherwise nothing for a gate that
ends within ``min_seconds`` (3 s); then at most every 2 s on a terminal (one line, rewritten in
place) or every 15 s in a CI log (plain lines), and a closing ``label: done in 27s`` line when
something was shown. A new phase (``done`` going back, or another ``total`` or ``unit``) restarts
the rate used for the ETA.

Writers take one string: text starting with ``"\\r"`` rewrites the current line (terminal mode),
``"\\n"`` ends that line, any other text is one whole line. :func:`writer_for` builds one on
pytest's terminal reporter (suspending output capture while it writes, as pytest's live logging
does); it returns None under ``-q``, on pytest-xdist workers and without a terminal reporter, and
``active(label, None)`` shows nothing.

Nested ``active`` blocks stack: the inner reporter is the one ticked, its label is shown after the
outer one's (``outer › inner``), and the outer one is restored when the inner block ends.

No torch and no pytest import here.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

__all__ = ["tick", "active", "writer_for", "Reporter", "MIN_SECONDS", "TTY_INTERVAL", "LOG_INTERVAL"]

#: Gates faster than this show nothing (seconds).
MIN_SECONDS = 3.0
#: Least time between two updates on a terminal (the line is rewritten in place).
TTY_INTERVAL = 2.0
#: Least time between two lines in a non-terminal log (CI).
LOG_INTERVAL = 15.0

Write = Callable[[str], None]

#: The reporter of the innermost active block, or None (then ``tick`` does nothing).
_CURRENT: "Reporter | None" = None


def tick(done: int, total: int, unit: str = "") -> None:
    """Report that ``done`` of ``total`` units of work are done; a no-op without an active reporter."""
    reporter = _CURRENT
    if reporter is not None:
        reporter.tick(done, total, unit)


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Reporter:
    """Rate-limited progress of one labelled block of work."""

    def __init__(self, label: str, write: Write, *, tty: bool, min_seconds: float, interval: float,
                 clock: Callable[[], float], estimate: float | None = None) -> None:
        self.label = label
        self.write = write
        self.tty = tty
        self.min_seconds = min_seconds
        self.interval = interval
        self.clock = clock
        self.start = clock()
        self.last_shown: float | None = None
        self.shown = 0  # number of updates written
        self._width = 0  # length of the line last written in terminal mode
        self._phase: tuple[int, str] | None = None  # (total, unit) of the current phase
        self._phase_start: tuple[float, int] | None = None  # (time, done) at the phase's first tick
        self._last_done = 0
        #: the gate's estimated seconds (see :mod:`pytest_dnnsafety.gates.cost`), or None
        self.estimate = estimate

    def announce(self) -> None:
        """Show the estimate at once when the gate is expected to take :attr:`min_seconds` or more."""
        if self.estimate is not None and self.estimate >= self.min_seconds:
            self.last_shown = self.clock()
            self._show(f"{self.label}: estimated {_duration(self.estimate)}")

    def tick(self, done: int, total: int, unit: str = "") -> None:
        now = self.clock()
        if self._phase != (total, unit) or done < self._last_done or self._phase_start is None:
            self._phase = (total, unit)
            self._phase_start = (now, done)
        self._last_done = done
        if now - self.start < self.min_seconds:
            return
        if self.last_shown is not None and now - self.last_shown < self.interval:
            return
        self.last_shown = now
        self._show(self.line(done, total, unit, now))

    def line(self, done: int, total: int, unit: str, now: float) -> str:
        parts = []
        if total and total > 0:
            parts.append(f"{100.0 * done / total:.0f}% {done}/{total}{' ' + unit if unit else ''}")
        else:
            parts.append(f"{done}{' ' + unit if unit else ''}")
        parts.append(f"{_duration(now - self.start)} elapsed")
        if total and total > 0 and done < total and self._phase_start is not None:
            t0, d0 = self._phase_start
            if done > d0 and now > t0:  # the rate of this phase, from its first tick
                rate = (done - d0) / (now - t0)
                parts.append(f"ETA {_duration((total - done) / rate)}")
        if self.estimate is not None:
            parts.append(f"estimated {_duration(self.estimate)}")
        return f"{self.label}: " + ", ".join(parts)

    def _show(self, text: str) -> None:
        self.shown += 1
        if self.tty:
            pad = " " * max(0, self._width - len(text))
            self._width = len(text)
            self.write("\r" + text + pad)
        else:
            self.write(text)

    def finish(self, failed: bool = False) -> None:
        """Close the progress display: a final line when anything was shown."""
        if not self.shown:
            return
        text = f"{self.label}: {'stopped' if failed else 'done'} after {_duration(self.clock() - self.start)}"
        if self.estimate is not None:
            text += f" (estimated {_duration(self.estimate)})"
        if self.tty:
            self._show(text)
            self.write("\n")
        else:
            self.write(text)


@contextmanager
def active(label: str, write: Write | None, *, tty: bool | None = None, min_seconds: float | None = None,
           interval: float | None = None, clock: Callable[[], float] | None = None,
           estimate: float | None = None) -> Iterator[Reporter | None]:
    """Install a progress reporter for the block; ``write=None`` shows nothing (and hides outer reporters).

    ``estimate``: the block's estimated seconds, shown at once when at least ``min_seconds`` and on every line.

    ``tty`` defaults to the writer's ``tty`` attribute (False for a plain function). ``min_seconds``
    defaults to :data:`MIN_SECONDS`; ``interval`` to :data:`TTY_INTERVAL` or :data:`LOG_INTERVAL`.
    ``clock`` (``time.monotonic``) is for tests.
    """
    global _CURRENT
    outer = _CURRENT
    if write is None:
        reporter = None
    else:
        tty = bool(getattr(write, "tty", False)) if tty is None else bool(tty)
        if outer is not None:
            label = f"{outer.label} › {label}"
            if outer.shown and outer.tty:
                write("\n")  # leave the outer line as it is; the inner one starts below it
                outer._width = 0
        reporter = Reporter(
            label, write, tty=tty,
            min_seconds=MIN_SECONDS if min_seconds is None else float(min_seconds),
            interval=(TTY_INTERVAL if tty else LOG_INTERVAL) if interval is None else float(interval),
            clock=clock or time.monotonic, estimate=estimate)
        try:
            reporter.announce()
        except Exception:  # progress must never break a gate
            pass
    _CURRENT = reporter
    failed = False
    try:
        yield reporter
    except BaseException:
        failed = True
        raise
    finally:
        _CURRENT = outer
        if reporter is not None:
            try:
                reporter.finish(failed)
            except Exception:  # progress must never break a gate
                pass


class _TerminalWriter:
    """Writes progress through pytest's terminal reporter, with output capture suspended."""

    def __init__(self, terminal: Any, capture: Any, tty: bool) -> None:
        self.terminal = terminal
        self.capture = capture
        self.tty = tty
        self._inline = False

    def _suspended(self) -> Any:
        if self.capture is not None and hasattr(self.capture, "global_and_fixture_disabled"):
            return self.capture.global_and_fixture_disabled()
        return _nothing()

    def __call__(self, text: str) -> None:
        with self._suspended():
            if text.startswith("\r"):
                if not self._inline:
                    self.terminal.ensure_newline()
                    self._inline = True
                self.terminal.write(text, flush=True)
            elif text == "\n":
                if self._inline:
                    self.terminal.write("\n", flush=True)
                    self._inline = False
            else:
                if self._inline:
                    self.terminal.write("\n")
                    self._inline = False
                self.terminal.write_line(text)
                self.terminal.flush()


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def writer_for(config: Any) -> Write | None:
    """A writer on pytest's terminal reporter for :func:`active`, or None where progress stays silent.

    None under ``-q``/``-qq``, on a pytest-xdist worker (its output never reaches the terminal) and
    without a terminal reporter (``-p no:terminal``). The writer's ``tty`` attribute is True when the
    terminal is a TTY (``TerminalReporter.isatty``): then one line is rewritten in place.
    """
    if getattr(getattr(config, "option", None), "verbose", 0) < 0:
        return None
    if hasattr(config, "workerinput"):
        return None
    manager = getattr(config, "pluginmanager", None)
    terminal = manager.get_plugin("terminalreporter") if manager is not None else None
    if terminal is None:
        return None
    capture = manager.get_plugin("capturemanager")
    isatty = getattr(terminal, "isatty", False)
    tty = bool(isatty() if callable(isatty) else isatty)
    return _TerminalWriter(terminal, capture, tty)
