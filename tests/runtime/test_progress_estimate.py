"""The estimate on the progress line (issue #30 item 1): shown at once for a long gate, on every line, at the end."""

from __future__ import annotations

from pytest_dnnsafety.runtime import progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_long_estimate_is_shown_at_once_and_on_every_line() -> None:
    clock, out = Clock(), []
    with progress.active("g", out.append, clock=clock, estimate=130.0):
        assert out == ["g: estimated 2m10s"]
        for i in range(40):
            clock.now += 1.0
            progress.tick(i + 1, 40, "batches")
    assert all(line.endswith("estimated 2m10s") or "estimated 2m10s)" in line for line in out)
    assert out[-1] == "g: done after 40s (estimated 2m10s)"


def test_a_short_estimate_shows_nothing_for_a_fast_gate() -> None:
    clock, out = Clock(), []
    with progress.active("g", out.append, clock=clock, estimate=0.5):
        progress.tick(1, 1)
    assert out == []


def test_without_a_writer_the_estimate_is_silent() -> None:
    with progress.active("g", None, estimate=1000.0) as reporter:
        assert reporter is None
