"""Add dependability results to the JUnit file that pytest's ``--junitxml`` wrote.

Run by the controller only (under xdist the workers write no JUnit), after pytest wrote the file:

* run metadata becomes suite-level ``<property>`` elements (allowed by the JUnit XSD);
* each gated testcase gets its gates' summary lines in ``<system-out>`` (before ``<system-err>``,
  as the schema orders them), each followed by its baseline comparison when there is one
  (``| baseline: 0.934 → 0.901 (−0.033, max_drop 0.02): regressed``);
* per-testcase ``<properties>`` are written only when the user opts in
  (``dnnsafety_junit_properties``), because the XSD that CI servers validate against rejects them;
* each shared forward pass (:mod:`pytest_dnnsafety.report.evidence`'s ``shared_passes``) is a suite property
  ``dnnsafety.shared_pass.<i>`` and a ``[dnnsafety] shared forward pass: ...`` line in the testcase whose gate
  needed it first (pytest's ``time`` of that testcase is its wall time and includes the pass).

While the run goes on, :func:`partial_junit` writes a JUnit file of the testcases that finished (same names,
gate lines and properties, ``dnnsafety.complete`` = ``false``) at the same path, so a killed run leaves a valid
file; pytest replaces it with its own at the end, which :func:`patch_junit` patches (atomically).
"""

from __future__ import annotations

import re
import socket
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from pytest_dnnsafety.results import GateResult, format_number

__all__ = ["junit_name", "patch_junit", "gate_line", "pass_line", "partial_junit"]


def junit_name(nodeid: str, prefix: str | None = None) -> tuple[str, str]:
    """The (classname, name) pair under which pytest's junitxml writes a test node id."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    classnames = names[:-1]
    if prefix:
        classnames.insert(0, prefix)
    return ".".join(classnames), names[-1]


def _baseline(result: GateResult) -> dict | None:
    comparison = getattr(result, "baseline", None)
    return comparison if isinstance(comparison, dict) else None


def gate_line(result: GateResult) -> str:
    """The gate's line in ``<system-out>``; with a baseline comparison, its message is appended."""
    line = f"[dnnsafety] {result.status.upper()} {result.summary}"
    comparison = _baseline(result)
    if comparison and comparison.get("message"):
        line += f" | baseline: {comparison['message']}"
    return line


def pass_line(entry: Mapping[str, Any]) -> str:
    """A shared forward pass in words: what it read, its size, time and rate, and the gate that needed it first."""
    layers = entry.get("layers") or []
    what = f"{entry.get('model') or 'model'} × {entry.get('data') or 'data'}" + (
        f" ({len(layers)} layer{'s' if len(layers) != 1 else ''})" if layers else " (outputs)")
    images = entry.get("images")
    rate = entry.get("images_per_second")
    seconds = entry.get("seconds")
    size = f"{images} images in " if isinstance(images, int) else ""
    timing = f"{seconds:.2f} s" if isinstance(seconds, (int, float)) else f"{seconds} s"
    speed = f" ({rate:.1f} images/s)" if isinstance(rate, (int, float)) else ""
    where = f"{entry.get('nodeid')} [{entry.get('marker')}]" + (f" on {entry['worker']}" if entry.get("worker") else "")
    failed = f"; failed: {entry['error']}" if entry.get("error") else ""
    return f"shared forward pass {what}: {size}{timing}{speed}, first needed by {where}{failed}"


def _pass_properties(passes: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    return {f"dnnsafety.shared_pass.{i}": pass_line(entry) for i, entry in enumerate(passes)}


def _case_lines(gates: Sequence[GateResult], passes: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = [gate_line(g) for g in gates]
    lines += [f"[dnnsafety] {pass_line(p)}; not counted in the gates' seconds" for p in passes]
    return lines


def _properties(parent: ET.Element) -> ET.Element:
    props = parent.find("properties")
    if props is None:
        props = ET.Element("properties")
        parent.insert(0, props)
    return props


def _add_output(case: ET.Element, text: str) -> None:
    out = case.find("system-out")
    if out is not None:
        out.text = (out.text or "") + ("\n" if out.text else "") + text
        return
    out = ET.Element("system-out")
    out.text = text
    children = list(case)
    position = next((i for i, child in enumerate(children) if child.tag == "system-err"), len(children))
    case.insert(position, out)


def _annotate(suite: ET.Element, by_name: Mapping[tuple[str, str], list[GateResult]],
              passes: Mapping[tuple[str, str], list[Mapping[str, Any]]], testcase_properties: bool) -> int:
    annotated = 0
    for case in suite.iter("testcase"):
        key = (case.get("classname", ""), case.get("name", ""))
        gates = by_name.get(key, [])
        if not gates and not passes.get(key):
            continue
        annotated += bool(gates)
        _add_output(case, "\n".join(_case_lines(gates, passes.get(key, []))))
        if testcase_properties:
            case_props = _properties(case)
            for g in gates:
                comparison = _baseline(g) or {}
                for field, val in (("value", g.value), ("bound", g.bound), ("threshold", g.threshold),
                                   ("status", g.status), ("baseline_status", comparison.get("status")),
                                   ("baseline_change", comparison.get("change"))):
                    if val is not None:
                        shown = val if isinstance(val, str) else format_number(val)
                        ET.SubElement(case_props, "property",
                                      {"name": f"dnnsafety.{g.marker}.{field}", "value": shown})
    return annotated


def _by_name(results: Sequence[GateResult], passes: Sequence[Mapping[str, Any]], prefix: str | None
             ) -> tuple[dict[tuple[str, str], list[GateResult]], dict[tuple[str, str], list[Mapping[str, Any]]]]:
    by_name: dict[tuple[str, str], list[GateResult]] = {}
    for result in results:
        by_name.setdefault(junit_name(result.nodeid, prefix), []).append(result)
    by_pass: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for entry in passes:
        if isinstance(entry.get("nodeid"), str):
            by_pass.setdefault(junit_name(entry["nodeid"], prefix), []).append(entry)
    return by_name, by_pass


def patch_junit(
    path: Path,
    results: Sequence[GateResult],
    suite_properties: Mapping[str, str],
    *,
    testcase_properties: bool = False,
    prefix: str | None = None,
    shared_passes: Sequence[Mapping[str, Any]] = (),
) -> int:
    """Patch the JUnit file (atomically: a temporary file, then a rename); returns the number of testcases annotated."""
    from pytest_dnnsafety.report.evidence import write_text_atomic

    tree = ET.parse(path)
    root = tree.getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    by_name, by_pass = _by_name(results, shared_passes, prefix)
    annotated = 0
    for suite in suites:
        props = _properties(suite)
        for name, value in {**suite_properties, **_pass_properties(shared_passes)}.items():
            ET.SubElement(props, "property", {"name": name, "value": str(value)})
        annotated += _annotate(suite, by_name, by_pass, testcase_properties)
    text = ET.tostring(root, encoding="unicode")
    write_text_atomic(Path(path), '<?xml version="1.0" encoding="utf-8"?>\n' + text)
    return annotated


#: a finished test's outcome -> the JUnit element that says it (None: passed)
_PROBLEMS = {"failed": "failure", "error": "error", "skipped": "skipped"}


def partial_junit(
    cases: Sequence[Mapping[str, Any]],
    results: Sequence[GateResult],
    suite_properties: Mapping[str, Any],
    *,
    suite_name: str = "pytest",
    testcase_properties: bool = False,
    prefix: str | None = None,
    shared_passes: Sequence[Mapping[str, Any]] = (),
) -> str:
    """A JUnit document of the testcases that finished so far, as pytest names them, with the gates' lines.

    ``cases``: ``{"nodeid", "outcome" (passed, failed, error, skipped), "time", "message"}`` per finished test;
    the suite property ``dnnsafety.complete`` is ``false``. Valid against the JUnit XSD CI servers read.
    """
    counts = {outcome: sum(c.get("outcome") == outcome for c in cases) for outcome in ("failed", "error", "skipped")}
    total_time = sum(float(c.get("time") or 0.0) for c in cases)
    suites = ET.Element("testsuites", {"name": "pytest tests"})
    suite = ET.SubElement(suites, "testsuite", {
        "name": suite_name, "errors": str(counts["error"]), "failures": str(counts["failed"]),
        "skipped": str(counts["skipped"]), "tests": str(len(cases)), "time": f"{total_time:.3f}",
        "timestamp": datetime.now(timezone.utc).astimezone().isoformat(), "hostname": socket.gethostname()})
    props = _properties(suite)
    for name, value in {**suite_properties, "dnnsafety.complete": "false",
                        **_pass_properties(shared_passes)}.items():
        ET.SubElement(props, "property", {"name": name, "value": str(value)})
    for case in cases:
        classname, name = junit_name(str(case["nodeid"]), prefix)
        element = ET.SubElement(suite, "testcase", {"classname": classname, "name": name,
                                                    "time": f"{float(case.get('time') or 0.0):.3f}"})
        problem = _PROBLEMS.get(str(case.get("outcome")))
        if problem is not None:
            ET.SubElement(element, problem, {"message": str(case.get("message") or case.get("outcome"))})
    by_name, by_pass = _by_name(results, shared_passes, prefix)
    _annotate(suite, by_name, by_pass, testcase_properties)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"
