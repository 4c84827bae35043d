"""Add dependability results to the JUnit file that pytest's ``--junitxml`` wrote.

Run by the controller only (under xdist the workers write no JUnit), after pytest wrote the file:

* run metadata becomes suite-level ``<property>`` elements (allowed by the JUnit XSD);
* each gated testcase gets its gates' summary lines in ``<system-out>`` (before ``<system-err>``,
  as the schema orders them), each followed by its baseline comparison when there is one
  (``| baseline: 0.934 → 0.901 (−0.033, max_drop 0.02): regressed``);
* per-testcase ``<properties>`` are written only when the user opts in
  (``dnnsafety_junit_properties``), because the XSD that CI servers validate against rejects them.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Mapping, Sequence

from pytest_dnnsafety.results import GateResult, format_number

__all__ = ["junit_name", "patch_junit", "gate_line"]


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


def patch_junit(
    path: Path,
    results: Sequence[GateResult],
    suite_properties: Mapping[str, str],
    *,
    testcase_properties: bool = False,
    prefix: str | None = None,
) -> int:
    """Patch the JUnit file in place; returns the number of testcases annotated."""
    tree = ET.parse(path)
    root = tree.getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    by_name: dict[tuple[str, str], list[GateResult]] = {}
    for result in results:
        by_name.setdefault(junit_name(result.nodeid, prefix), []).append(result)
    annotated = 0
    for suite in suites:
        props = _properties(suite)
        for name, value in suite_properties.items():
            ET.SubElement(props, "property", {"name": name, "value": str(value)})
        for case in suite.iter("testcase"):
            key = (case.get("classname", ""), case.get("name", ""))
            gates = by_name.get(key)
            if not gates:
                continue
            annotated += 1
            _add_output(case, "\n".join(gate_line(g) for g in gates))
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
    tree.write(path, encoding="utf-8", xml_declaration=True)
    return annotated
