"""Progress of long gates (pytest_dnnsafety.runtime.progress): rate limiting, TTY vs log, silence, nesting."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

from pytest_dnnsafety.runtime import progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Sink:
    def __init__(self, tty: bool = False) -> None:
        self.tty = tty
        self.out: list[str] = []

    def __call__(self, text: str) -> None:
        self.out.append(text)


def run_loop(clock: Clock, steps: int, seconds_per_step: float, unit: str = "batches") -> None:
    for i in range(steps):
        clock.advance(seconds_per_step)
        progress.tick(i + 1, steps, unit)


def test_tick_without_reporter_is_silent_and_cheap() -> None:
    assert progress._CURRENT is None
    progress.tick(1, 10, "batches")  # nothing to see, nothing raised
    progress.tick(0, 0)


def test_non_tty_prints_plain_lines_every_15_seconds_after_min_seconds() -> None:
    clock, sink = Clock(), Sink(tty=False)
    with progress.active("max_pmi_ub t::x", sink, clock=clock):
        run_loop(clock, 60, 1.0)  # 60 s of work, a tick per second
    lines = sink.out
    # first line at t=3 s (min_seconds), then t=18, 33, 48 — and the closing line
    assert len(lines) == 5, lines
    assert lines[0] == "max_pmi_ub t::x: 5% 3/60 batches, 3s elapsed, ETA 57s"
    assert lines[1].startswith("max_pmi_ub t::x: 30% 18/60 batches, 18s elapsed, ETA 42s")
    assert lines[-1] == "max_pmi_ub t::x: done after 1m00s"
    assert not any(line.startswith("\r") for line in lines)


def test_tty_rewrites_one_line_every_2_seconds_and_ends_it() -> None:
    clock, sink = Clock(), Sink(tty=True)
    with progress.active("gate", sink, clock=clock):
        run_loop(clock, 10, 1.0, unit="")
    updates = [t for t in sink.out if t.startswith("\r")]
    # t = 3, 5, 7, 9 s, then the closing line rewritten in place
    assert [u.split(":")[1].split(",")[0].strip() for u in updates[:-1]] == ["30% 3/10", "50% 5/10", "70% 7/10",
                                                                             "90% 9/10"]
    assert updates[-1].startswith("\rgate: done after 10s")
    assert sink.out[-1] == "\n"
    assert all("\n" not in t for t in sink.out[:-1])


def test_tty_pads_a_shorter_line_over_a_longer_one() -> None:
    clock, sink = Clock(), Sink(tty=True)
    with progress.active("g", sink, clock=clock, min_seconds=0, interval=0):
        clock.advance(1)
        progress.tick(5, 10, "a-very-long-unit-name")
        clock.advance(1)
        progress.tick(6, 10)
    first, second = sink.out[0], sink.out[1]
    assert len(second) == len(first)  # the longer first line is blanked out
    assert second.startswith("\rg: 60% 6/10, 2s elapsed")


def test_fast_gates_show_nothing() -> None:
    clock, sink = Clock(), Sink(tty=True)
    with progress.active("fast", sink, clock=clock):
        run_loop(clock, 20, 0.1)  # 2 s < min_seconds
    assert sink.out == []


def test_min_seconds_zero_and_interval_override() -> None:
    clock, sink = Clock(), Sink(tty=False)
    with progress.active("g", sink, clock=clock, min_seconds=0.0, interval=1.0):
        run_loop(clock, 4, 0.5)
    # shown at t=0.5, 1.5 (interval 1 s since 0.5), then the closing line
    assert [line.split(": ")[1].split(",")[0] for line in sink.out[:-1]] == ["25% 1/4 batches", "75% 3/4 batches"]
    assert sink.out[-1].startswith("g: done after")


def test_module_defaults_are_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "MIN_SECONDS", 0.0)
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.0)
    clock, sink = Clock(), Sink(tty=False)
    with progress.active("g", sink, clock=clock):
        run_loop(clock, 3, 0.01)
    assert len(sink.out) == 4


def test_unknown_total_shows_count_without_percentage_or_eta() -> None:
    clock, sink = Clock(), Sink()
    with progress.active("g", sink, clock=clock, min_seconds=0):
        clock.advance(1)
        progress.tick(7, 0, "cells")
    assert sink.out[0] == "g: 7 cells, 1s elapsed"


def test_a_new_phase_restarts_the_eta_rate() -> None:
    clock, sink = Clock(), Sink()
    with progress.active("g", sink, clock=clock, min_seconds=0, interval=0):
        run_loop(clock, 10, 10.0, unit="cells")  # slow first phase: 10 s per cell
        clock.advance(1.0)
        progress.tick(1, 100, "samples")  # phase 2 starts
        clock.advance(1.0)
        progress.tick(51, 100, "samples")  # 50 samples per second
    assert sink.out[-2] == "g: 51% 51/100 samples, 1m42s elapsed, ETA 1s"


def test_inactive_writer_none_hides_outer_reporter_for_the_block() -> None:
    clock, sink = Clock(), Sink()
    with progress.active("outer", sink, clock=clock, min_seconds=0, interval=0):
        with progress.active("inner", None) as inner:
            assert inner is None
            clock.advance(1)
            progress.tick(1, 2)
        clock.advance(1)
        progress.tick(1, 2)
    assert [line.split(":")[0] for line in sink.out] == ["outer", "outer"]


def test_nested_blocks_stack_and_restore() -> None:
    clock, sink = Clock(), Sink()
    with progress.active("outer", sink, clock=clock, min_seconds=0, interval=0) as outer:
        clock.advance(1)
        progress.tick(1, 4, "gates")
        with progress.active("inner", sink, clock=clock, min_seconds=0, interval=0) as inner:
            assert progress._CURRENT is inner
            clock.advance(1)
            progress.tick(5, 10, "batches")
        assert progress._CURRENT is outer
        clock.advance(1)
        progress.tick(2, 4, "gates")
    assert progress._CURRENT is None
    assert sink.out[0].startswith("outer: 25% 1/4 gates")
    assert sink.out[1].startswith("outer › inner: 50% 5/10 batches")
    assert sink.out[2].startswith("outer › inner: done after")
    assert sink.out[3].startswith("outer: 50% 2/4 gates")
    assert sink.out[4].startswith("outer: done after")


def test_nested_tty_block_starts_below_the_outer_line() -> None:
    clock, sink = Clock(), Sink(tty=True)
    with progress.active("outer", sink, clock=clock, min_seconds=0, interval=0):
        clock.advance(1)
        progress.tick(1, 4)
        with progress.active("inner", sink, clock=clock, min_seconds=0, interval=0):
            clock.advance(1)
            progress.tick(1, 2)
    assert sink.out[0].startswith("\router: 25%")
    assert sink.out[1] == "\n"
    assert sink.out[2].startswith("\router › inner: 50%")


def test_an_exception_restores_the_outer_reporter_and_says_stopped() -> None:
    clock, sink = Clock(), Sink()
    with pytest.raises(RuntimeError):
        with progress.active("g", sink, clock=clock, min_seconds=0):
            clock.advance(1)
            progress.tick(1, 2)
            raise RuntimeError("boom")
    assert progress._CURRENT is None
    assert sink.out[-1].startswith("g: stopped after")


def test_a_failing_writer_never_breaks_the_gate_at_finish() -> None:
    clock = Clock()
    calls = []

    def broken(text: str) -> None:
        calls.append(text)
        if len(calls) > 1:
            raise OSError("terminal gone")

    with progress.active("g", broken, clock=clock, min_seconds=0):
        clock.advance(1)
        progress.tick(1, 2)
    assert progress._CURRENT is None


def test_duration_format() -> None:
    assert progress._duration(0.4) == "0s"
    assert progress._duration(59) == "59s"
    assert progress._duration(65) == "1m05s"
    assert progress._duration(3 * 3600 + 120) == "3h02m"


# ----------------------------------------------------------------------------- writer_for


class FakeTerminal:
    def __init__(self, tty: bool) -> None:
        self.isatty = tty
        self.calls: list[tuple[str, str]] = []

    def ensure_newline(self) -> None:
        self.calls.append(("ensure_newline", ""))

    def write(self, text: str, flush: bool = False) -> None:
        self.calls.append(("write", text))

    def write_line(self, text: str) -> None:
        self.calls.append(("write_line", text))

    def flush(self) -> None:
        pass


class FakeCapture:
    def __init__(self) -> None:
        self.suspended = 0

    def global_and_fixture_disabled(self):  # noqa: ANN201
        from contextlib import contextmanager

        @contextmanager
        def cm():  # noqa: ANN202
            self.suspended += 1
            yield

        return cm()


def fake_config(verbose: int = 0, terminal: object | None = None, worker: bool = False,
                capture: object | None = None) -> object:
    plugins = {"terminalreporter": terminal, "capturemanager": capture}
    config = types.SimpleNamespace(option=types.SimpleNamespace(verbose=verbose),
                                   pluginmanager=types.SimpleNamespace(get_plugin=plugins.get))
    if worker:
        config.workerinput = {"workerid": "gw0"}
    return config


def test_writer_for_is_none_when_quiet_on_workers_and_without_terminal() -> None:
    terminal = FakeTerminal(tty=False)
    assert progress.writer_for(fake_config(verbose=-1, terminal=terminal)) is None
    assert progress.writer_for(fake_config(verbose=-2, terminal=terminal)) is None
    assert progress.writer_for(fake_config(terminal=terminal, worker=True)) is None
    assert progress.writer_for(fake_config(terminal=None)) is None
    assert progress.writer_for(fake_config(terminal=terminal)) is not None
    assert progress.writer_for(fake_config(verbose=2, terminal=terminal)) is not None


def test_writer_for_writes_lines_with_capture_suspended() -> None:
    terminal, capture = FakeTerminal(tty=False), FakeCapture()
    write = progress.writer_for(fake_config(terminal=terminal, capture=capture))
    assert write is not None and write.tty is False
    write("gate: 50%")
    assert terminal.calls == [("write_line", "gate: 50%")]
    assert capture.suspended == 1


def test_writer_for_on_a_tty_rewrites_in_place() -> None:
    class CallableBool:  # pytest's TerminalReporter.isatty is a bool that can be called
        def __init__(self, value: bool) -> None:
            self.value = value

        def __bool__(self) -> bool:
            return self.value

        def __call__(self) -> bool:
            return self.value

    terminal = FakeTerminal(tty=True)
    terminal.isatty = CallableBool(True)
    write = progress.writer_for(fake_config(terminal=terminal))
    assert write is not None and write.tty is True
    write("\rg: 10%")
    write("\rg: 20%")
    write("\n")
    assert terminal.calls == [("ensure_newline", ""), ("write", "\rg: 10%"), ("write", "\rg: 20%"),
                              ("write", "\n")]


def test_active_takes_tty_from_the_writer() -> None:
    clock, sink = Clock(), Sink(tty=True)
    with progress.active("g", sink, clock=clock, min_seconds=0) as reporter:
        assert reporter is not None and reporter.tty and reporter.interval == progress.TTY_INTERVAL
    with progress.active("g", sink, tty=False, clock=clock) as reporter:
        assert reporter is not None and not reporter.tty and reporter.interval == progress.LOG_INTERVAL


def test_module_imports_neither_torch_nor_pytest() -> None:
    code = textwrap.dedent("""
        import sys
        import pytest_dnnsafety.runtime.progress
        bad = [m for m in ("torch", "pytest", "_pytest") if m in sys.modules]
        assert not bad, bad
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- end to end (needs wiring)

SLOW_GATE_CONFTEST = """
import time

from pytest_dnnsafety.runtime import progress
from pytest_dnnsafety.gates import GateDef, register_gate
from pytest_dnnsafety.results import Measurement


def _slow(spec, fx, ctx):
    for i in range(6):
        time.sleep(0.05)
        progress.tick(i + 1, 6, "steps")
    return Measurement(value=1.0, detail="slow gate")


register_gate(GateDef(
    marker="slow_progress_gate", metric="slow metric", op=">=", threshold_range=(0.0, 1.0), params=(),
    fixtures={}, measure=_slow, doc="a gate that takes a while and ticks"), replace=True)
"""


#: End-to-end tests that pass once the gates are wrapped in progress.active(...): remove the mark then.


@pytest.mark.slow
def test_slow_gate_shows_progress_in_the_terminal(gate_project, monkeypatch: pytest.MonkeyPatch,
                                                  request: pytest.FixtureRequest) -> None:
    from pytest_dnnsafety import gates

    request.addfinalizer(lambda: gates.GATES.pop("slow_progress_gate", None))
    monkeypatch.setattr(progress, "MIN_SECONDS", 0.0)
    monkeypatch.setattr(progress, "LOG_INTERVAL", 0.0)
    monkeypatch.setattr(progress, "TTY_INTERVAL", 0.0)
    gate_project.write("conftest.py", SLOW_GATE_CONFTEST)
    gate_project.tests("""
        import pytest

        @pytest.mark.slow_progress_gate(0.5)
        def test_slow():
            pass
    """)
    result = gate_project.run("-p", "no:xdist")
    result.assert_outcomes(passed=1)
    result.stdout.re_match_lines([r".*slow_progress_gate.*: 50% 3/6 steps, \d+s elapsed.*"])
    result.stdout.fnmatch_lines(["*slow_progress_gate*done after*"])
    # -q silences progress
    quiet = gate_project.run("-q", "-p", "no:xdist")
    quiet.assert_outcomes(passed=1)
    assert "3/6 steps" not in quiet.stdout.str()
