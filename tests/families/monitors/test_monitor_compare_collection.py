"""``compare=`` misuse of ``min_monitor_detection`` is refused at collection, not after the work (issue #29 §3).

``compare=`` ranks the gate's monitor against others over the fault sets (Friedman test, Nemenyi CD). It needs
a monitor besides the gate's own and at least two fault sets; both follow from the marker's keywords alone, and
were refused only once the monitor had been fitted and every fault set scored. Now they are collection errors
naming the marker, the argument and the fix. A compared monitor the ``monitors`` fixture lacks can only be known
when the fixture runs: it is refused before any monitor is fitted or any data scored.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import GateProject
from pytest_dnnsafety import MSP, Energy
from pytest_dnnsafety.errors import ConfigError

MISUSE = [
    ("min_monitor_detection(0.5, monitor='energy', compare=['energy'])",
     "argument compare: compare=?'energy'? names no monitor besides monitor='energy'*Fix: *"),  # ? for [ ]
    ("min_monitor_detection(0.5, monitor='energy', compare=('energy', 'energy'))",
     "argument compare: *names no monitor besides monitor='energy'*Fix: *"),
    ("min_monitor_detection(0.5, monitor='energy', compare=['msp'], faults='gaussian_noise', severity=3)",
     "argument compare: *1 fault set (gaussian_noise s3)*at least two*Fix: *"),
    ("min_monitor_detection(0.5, monitor='energy', compare=['msp'], faults='black_frame')",
     "argument compare: *1 fault set (black_frame)*Fix: *"),
    ("min_monitor_detection(0.5, monitor='energy', compare=['msp'], faults=['novel'], severity=(1, 2))",
     "argument compare: *1 fault set (novel)*Fix: *"),
    ("min_monitor_detection(0.5, monitor='energy', compare=['msp', ''])", "argument compare: *Fix: *"),
    ("max_monitor_selective_risk(0.5, monitor='energy', compare=['msp'])", "argument compare: unknown keyword*"),
]


@pytest.mark.parametrize(("marker", "expected"), MISUSE, ids=[m for m, _ in MISUSE])
def test_compare_misuse_is_a_collection_error(gate_project: GateProject, marker: str, expected: str) -> None:
    # the fixtures would fail loudly if anything ran: a collection error runs nothing
    gate_project.write("conftest.py", """
        import pytest

        @pytest.fixture
        def monitors():
            raise AssertionError("the work ran")
    """)
    gate_project.tests(f"import pytest\n\n@pytest.mark.{marker}\ndef test_x():\n    pass\n")
    result = gate_project.run()
    assert result.ret == pytest.ExitCode.INTERRUPTED, result.stdout.str()[-2000:]
    result.stdout.fnmatch_lines([f"*@pytest.mark.{marker.split('(')[0]}: {expected}"])
    assert "the work ran" not in result.stdout.str()


USES = [
    "min_monitor_detection(0.5, monitor='energy', compare=['msp'])",  # the default faults: 13 families x 5
    "min_monitor_detection(0.5, monitor='energy', compare=['msp'], faults='gaussian_noise', severity=(2, 4))",
    "min_monitor_detection(0.5, monitor='energy', compare=['msp'], faults=['black_frame', 'novel'])",
]


@pytest.mark.parametrize("marker", USES)
def test_valid_compare_is_collected(gate_project: GateProject, marker: str) -> None:
    gate_project.tests(f"import pytest\n\n@pytest.mark.{marker}\ndef test_x():\n    pass\n")
    result = gate_project.run("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-2000:]


def test_the_severity_free_families_match_the_engine() -> None:
    from pytest_dnnsafety.engines.monitors.faults import SEVERITY_FREE
    from pytest_dnnsafety.gates.monitors import SEVERITY_FREE_NAMES

    assert SEVERITY_FREE_NAMES == SEVERITY_FREE


def test_a_compared_monitor_the_fixture_lacks_is_refused_before_any_work() -> None:
    from pytest_dnnsafety.engines.monitors.bench import MonitorBench
    from pytest_dnnsafety.engines.monitors.gating import detection

    bench = MonitorBench(None, {"monitors": {"msp": MSP(), "energy": Energy()}},  # type: ignore[arg-type]
                         roles={"monitors": "monitors", "data": "dataset", "fit_data": "monitor_data"},
                         marker="min_monitor_detection")

    def no_work(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the work ran")

    bench.sets = no_work  # type: ignore[method-assign]
    bench.fitted = no_work  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match=r"min_monitor_detection: compare= names 'nope', which is not in fixture "
                                          r"'monitors' \(it has 'msp', 'energy'\).*Fix: "):
        detection(bench, "energy", faults="noise", severity=3, clip=(0.0, 1.0), metric="mcc", aggregate="worst",
                  compare=["msp", "nope"], alpha=0.05)
