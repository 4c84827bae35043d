"""Outputs written while the run goes on (issue #30, item 7): the throttled writer, the partial JUnit file, the
``complete`` and ``shared_passes`` fields of the evidence and their schema, and a baseline refusing a killed run."""

from __future__ import annotations

import json
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from conftest import JUNIT_XSD
from pytest_dnnsafety.errors import DnnSafetyError
from pytest_dnnsafety.report.evidence import build_evidence, write_evidence
from pytest_dnnsafety.report.junit import partial_junit
from pytest_dnnsafety.report.partial import PartialWriter, Snapshot
from pytest_dnnsafety.report.run import Targets, write_partial
from pytest_dnnsafety.results import GateResult

PASS = {"model": "model", "data": "dataset", "layers": ["features.1"], "images": 2000, "seconds": 564.2,
        "startup_seconds": 1.5, "images_per_second": 2000 / 564.2, "nodeid": "tests/test_a.py::test_a",
        "marker": "min_neuron_k_activation", "worker": "gw0"}


def _row(name: str, status: str = "passed") -> GateResult:
    return GateResult(nodeid=f"tests/test_a.py::{name}", marker="min_scene_coverage", metric="coverage",
                      threshold=0.5, op=">=", status=status, value=0.75, passed=status == "passed",
                      summary=f"min_scene_coverage: 0.750 >= 0.500 ({name})", details={"task": "single-label"},
                      seconds=0.25, device="cpu")


ENV = {"pytest_dnnsafety": "0", "torch": None, "numpy": None, "pytest": "9", "python": "3.11", "platform": "x",
       "device": "cpu", "seed": 0, "workers": 0, "threads": {}, "world_size": 1, "backend": None, "inputs": {},
       "inputs_note": "", "cwd": "/"}


# ------------------------------------------------------------------------------ the throttled writer


class _Slow:
    """A write that takes ``cost`` seconds and records the snapshots it wrote."""

    def __init__(self, cost: float) -> None:
        self.cost = cost
        self.seen: list[Any] = []

    def __call__(self, snapshot: Any) -> None:
        time.sleep(self.cost)
        self.seen.append(snapshot)


def test_cheap_writes_are_never_delayed() -> None:
    write = _Slow(0.0)
    writer = PartialWriter(write, free_seconds=0.05)
    for i in range(5):
        writer.submit(i)  # type: ignore[arg-type]
    assert write.seen == [0, 1, 2, 3, 4] and writer.writes == 5


def test_costly_writes_wait_their_gap_and_the_newest_snapshot_is_written_by_the_timer() -> None:
    write = _Slow(0.02)
    writer = PartialWriter(write, gap_factor=5.0, free_seconds=0.001)  # gap 0.1 s after a 0.02 s write
    writer.submit(1)  # type: ignore[arg-type]
    writer.submit(2)  # type: ignore[arg-type]
    writer.submit(3)  # type: ignore[arg-type]
    assert write.seen == [1]  # 2 and 3 wait; 2 is superseded
    deadline = time.monotonic() + 5
    while write.seen == [1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert write.seen == [1, 3]


def test_close_drops_a_delayed_write_and_errors_never_reach_the_caller() -> None:
    write = _Slow(0.02)
    writer = PartialWriter(write, gap_factor=50.0, free_seconds=0.001)
    writer.submit(1)  # type: ignore[arg-type]
    writer.submit(2)  # type: ignore[arg-type]
    writer.close()
    time.sleep(0.1)
    writer.submit(3)  # type: ignore[arg-type]
    assert write.seen == [1] and threading.active_count() >= 1

    def fails(snapshot: Any) -> None:
        raise OSError("disk full")

    failing = PartialWriter(fails)
    failing.submit(1)  # type: ignore[arg-type]
    failing.submit(2)  # type: ignore[arg-type]
    assert failing.errors == 2 and failing.error == "OSError: disk full"


# ------------------------------------------------------------------------------ the files


def test_partial_evidence_is_schema_valid_and_marked_incomplete(tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from pytest_dnnsafety.report.schemas import evidence_schema

    validator = jsonschema.Draft202012Validator(evidence_schema(),
                                                format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    snapshot = Snapshot(rows=[_row("test_a"), _row("test_b", "failed")], environment=ENV, shared_passes=[PASS],
                        cases=[{"nodeid": "tests/test_a.py::test_a", "outcome": "passed", "time": 0.3}])
    write_partial(snapshot, Targets(evidence=tmp_path / "e.json", junitxml=str(tmp_path / "junit.xml")))
    evidence = json.loads((tmp_path / "e.json").read_text())
    assert [e.message for e in validator.iter_errors(evidence)] == []
    assert evidence["complete"] is False and evidence["summary"]["total"] == 2
    assert evidence["shared_passes"][0]["images"] == 2000
    final = build_evidence([_row("test_a")], ENV, shared_passes=[PASS])
    assert final["complete"] is True and [e.message for e in validator.iter_errors(final)] == []
    broken = dict(final, shared_passes=[{k: v for k, v in PASS.items() if k != "images"}])
    assert any("images" in e.message for e in validator.iter_errors(broken))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.json", "junit.xml"]


def test_partial_junit_is_valid_against_the_xsd_with_every_outcome(tmp_path: Path) -> None:
    xmlschema = pytest.importorskip("xmlschema")
    cases = [{"nodeid": "tests/test_a.py::test_a", "outcome": "passed", "time": 0.5},
             {"nodeid": "tests/test_a.py::TestX::test_b[1-<&>]", "outcome": "failed", "time": 1.0,
              "message": "assert 1 == 2 <&>"},
             {"nodeid": "tests/test_a.py::test_c", "outcome": "skipped", "time": 0.0, "message": "no GPU"},
             {"nodeid": "tests/test_a.py::test_d", "outcome": "error", "time": 0.1, "message": "fixture failed"}]
    rows = [_row("test_a"), _row("TestX::test_b[1-<&>]", "failed")]
    text = partial_junit(cases, rows, {"dnnsafety.gates": 2}, suite_name="mine", prefix="pre",
                         shared_passes=[dict(PASS, nodeid="tests/test_a.py::test_a")])
    path = tmp_path / "junit.xml"
    path.write_text(text)
    xmlschema.XMLSchema(str(JUNIT_XSD)).validate(str(path))
    suite = ET.parse(path).getroot().find("testsuite")
    assert suite is not None and suite.get("name") == "mine"
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped"), suite.get("errors")) == ("4", "1", "1", "1")
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["dnnsafety.complete"] == "false" and props["dnnsafety.shared_pass.0"].startswith(
        "shared forward pass model × dataset (1 layer): 2000 images in 564.20 s (3.5 images/s)")
    cases_by_name = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases_by_name["test_b[1-<&>]"].get("classname") == "pre.tests.test_a.TestX"
    assert cases_by_name["test_b[1-<&>]"].find("failure").get("message") == "assert 1 == 2 <&>"
    out = cases_by_name["test_a"].findtext("system-out") or ""
    assert "[dnnsafety] PASSED min_scene_coverage" in out and "[dnnsafety] shared forward pass" in out


def test_a_baseline_from_a_killed_run_is_refused(tmp_path: Path) -> None:
    from pytest_dnnsafety.report.baseline import save_baseline

    with pytest.raises(ValueError, match="did not finish"):
        save_baseline(tmp_path / "b.json", build_evidence([_row("test_a")], ENV, complete=False))
    from pytest_dnnsafety.report.baseline import Baseline

    path = write_evidence(tmp_path / "e.json", build_evidence([_row("test_a")], ENV, complete=False))
    with pytest.raises(DnnSafetyError, match="did not finish"):
        Baseline.from_evidence(json.loads(path.read_text()), path)
    assert Baseline.from_evidence(build_evidence([_row("test_a")], ENV)).gates  # a finished run's evidence reads
