"""Evidence survives a kill (issue #30, item 7): a run SIGKILLed after two gates finished leaves schema-valid JSON
evidence holding those two gates and ``"complete": false``, and a JUnit file (valid against the XSD CI servers
read) holding their testcases; a run that finishes writes ``"complete": true`` and pytest's own JUnit file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import JUNIT_XSD, GateProject

#: Two instant gates and one that blocks (it says so in a file first), registered the documented way.
CONFTEST = """
import time
from pathlib import Path

from pytest_dnnsafety import GateDef, Measurement, hookimpl


def _one(spec, fx, ctx):
    return Measurement(1.0)


def _block(spec, fx, ctx):
    Path("blocking.started").write_text("now")
    time.sleep(300)
    return Measurement(1.0)


FAST = GateDef(marker="fast_one", metric="one", op=">=", threshold_range=(0.0, 1.0), params=(), fixtures={},
               measure=_one, doc="measures 1 at once")
SLOW = GateDef(marker="blocks", metric="one", op=">=", threshold_range=(0.0, 1.0), params=(), fixtures={},
               measure=_block, doc="blocks for 5 minutes")


@hookimpl
def pytest_dnnsafety_register_gates(registry):
    registry.add(FAST)
    registry.add(SLOW)
"""

TESTS = """
import pytest


@pytest.mark.fast_one(0.5)
def test_a():
    pass


@pytest.mark.fast_one(0.5)
def test_b():
    pass


@pytest.mark.blocks(0.5)
def test_c():
    pass
"""


def _validator() -> Any:
    jsonschema = pytest.importorskip("jsonschema")
    from pytest_dnnsafety.report.schemas import evidence_schema

    return jsonschema.Draft202012Validator(evidence_schema(),
                                           format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def _gates(path: Path) -> list[str]:
    try:
        return [g["nodeid"].rpartition("::")[2] for g in json.loads(path.read_text())["gates"]]
    except (OSError, ValueError, KeyError):
        return []


def _cases(path: Path) -> list[str]:
    import xml.etree.ElementTree as ET

    try:
        return sorted(str(case.get("name")) for case in ET.parse(path).getroot().iter("testcase"))
    except (OSError, ET.ParseError):
        return []


def _kill_after_two(project: GateProject, *extra: str) -> Path:
    """Start pytest, wait until the blocking gate started and the evidence holds two gates, SIGKILL the whole run."""
    project.write("conftest.py", CONFTEST)
    project.tests(TESTS)
    project.finish()
    root = project.pytester.path
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
            "--dnnsafety-json=out/e.json", "--junitxml=out/junit.xml", *extra]
    process = subprocess.Popen(args, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               start_new_session=True)  # its own process group: xdist's workers die with it
    try:
        deadline = time.monotonic() + 120
        while not (root / "blocking.started").exists():
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            assert time.monotonic() < deadline, "the blocking gate never started"
            time.sleep(0.05)
        # the finished gates are written as they finish (within one throttle gap, at once for cheap writes)
        deadline = time.monotonic() + 10
        while ((sorted(_gates(root / "out/e.json")), _cases(root / "out/junit.xml")) !=
               (["test_a", "test_b"], ["test_a", "test_b"]) and time.monotonic() < deadline):
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    return root / "out"


@pytest.mark.parametrize("extra", [(), ("-n", "2")], ids=["serial", "xdist"])
def test_sigkill_after_two_gates_leaves_valid_evidence_and_junit(gate_project: GateProject, extra: tuple) -> None:
    if extra:
        pytest.importorskip("xdist")
    out = _kill_after_two(gate_project, *extra)
    evidence = json.loads((out / "e.json").read_text())
    assert [e for e in _validator().iter_errors(evidence)] == []
    assert evidence["complete"] is False
    assert sorted(g["nodeid"].rpartition("::")[2] for g in evidence["gates"]) == ["test_a", "test_b"]
    assert {g["status"] for g in evidence["gates"]} == {"passed"}
    assert evidence["summary"]["passed"] == evidence["summary"]["total"] == 2
    assert sorted(p.name for p in out.iterdir()) == ["e.json", "junit.xml"]  # no temporary file left

    junit = out / "junit.xml"
    xmlschema = pytest.importorskip("xmlschema")
    xmlschema.XMLSchema(str(JUNIT_XSD)).validate(str(junit))
    import xml.etree.ElementTree as ET

    root = ET.parse(junit).getroot()
    cases = {case.get("name"): case for case in root.iter("testcase")}
    assert sorted(cases) == ["test_a", "test_b"]
    assert all(case.get("classname") == "test_gates" for case in cases.values())
    assert "[dnnsafety] PASSED fast_one" in (cases["test_a"].findtext("system-out") or "")
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["dnnsafety.complete"] == "false" and props["dnnsafety.gates"] == "2"


def test_a_finished_run_says_complete_and_keeps_pytests_junit(gate_project: GateProject) -> None:
    gate_project.write("conftest.py", CONFTEST.replace("time.sleep(300)", "pass"))
    gate_project.tests(TESTS)
    gate_project.run("--dnnsafety-json=out/e.json", "--junitxml=out/junit.xml").assert_outcomes(passed=3)
    out = gate_project.pytester.path / "out"
    evidence = json.loads((out / "e.json").read_text())
    assert [e for e in _validator().iter_errors(evidence)] == []
    assert evidence["complete"] is True and evidence["summary"]["total"] == 3
    xmlschema = pytest.importorskip("xmlschema")
    xmlschema.XMLSchema(str(JUNIT_XSD)).validate(str(out / "junit.xml"))
    import xml.etree.ElementTree as ET

    root = ET.parse(out / "junit.xml").getroot()
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["dnnsafety.complete"] == "true" and props["dnnsafety.gates"] == "3"
    assert sorted(case.get("name") for case in root.iter("testcase")) == ["test_a", "test_b", "test_c"]
    assert sorted(p.name for p in out.iterdir()) == ["e.json", "junit.xml"]
