"""The GitHub Actions job summary (report/markdown.py, $GITHUB_STEP_SUMMARY)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_dnnsafety.report.baseline import compare
from pytest_dnnsafety.report.markdown import append_step_summary, step_summary, write_github_step_summary
from pytest_dnnsafety.results import GateResult

ENV = {"pytest_dnnsafety": "0.1.0", "torch": "2.13.0+cpu", "device": "cpu", "seed": 1234, "workers": 0}


def gate(nodeid: str, status: str = "passed", value: float | None = 0.9, bound: float | None = None,
         op: str = ">=", marker: str = "min_scene_coverage", summary: str = "") -> GateResult:
    return GateResult(nodeid=nodeid, marker=marker, metric="m", threshold=0.8 if op == ">=" else 0.1, op=op,
                      status=status, value=value, bound=bound, passed=status == "passed",
                      summary=summary or f"{marker}: summary of {nodeid}")


def table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
            rows.append([c.strip() for c in cells])
    return rows


def test_a_table_with_clear_verdict_words_and_no_emoji() -> None:
    rows = [gate("tests/t.py::test_a"),
            gate("tests/t.py::test_b", "failed", 0.7, summary="min_scene_coverage: 0.700 < 0.800 (k=2)"),
            gate("tests/t.py::test_c", "error", None, summary="cannot compute: <class 'ValueError'> & more"),
            gate("tests/t.py::test_d", "not-evaluated", None),
            gate("tests/t.py::test_e", "inconclusive", 0.01, 0.2, "<=", "max_pmi_ub"),
            gate("tests/t.py::test_f", "lost", None)]
    text = step_summary(rows, ENV)
    assert text.startswith("## Dependability gates\n")
    assert "pytest-dnnsafety 0.1.0 | torch 2.13.0+cpu | device cpu | seed 1234" in text
    assert "**5 of 6 gates did not pass**" in text
    table = table_rows(text)
    assert table[0] == ["test", "marker", "value", "bound", "threshold", "verdict"]
    assert table[1] == ["`tests/t.py::test_a`", "`min_scene_coverage`", "0.900", "-", "≥ 0.800", "PASS"]
    assert [r[5] for r in table[1:]] == ["PASS", "**FAIL**", "**ERROR**", "**NOT RUN**", "**INCONCLUSIVE**",
                                        "**LOST**"]
    assert table[5][3] == "0.200" and table[5][4] == "≤ 0.100"
    # no emoji or other pictographs anywhere
    assert not re.search("[\U0001F300-\U0001FAFF\u2600-\u27BF\u2705\u274C]", text)
    # failing gates' summaries in a details block; HTML-like text escaped
    assert "<details><summary>Details</summary>" in text
    assert "- `tests/t.py::test_b`: min_scene_coverage: 0.700 &lt; 0.800 (k=2)" in text
    assert "&lt;class 'ValueError'> &amp; more" in text
    assert text.endswith("\n")


def test_all_passed_and_no_details() -> None:
    text = step_summary([gate("t.py::a"), gate("t.py::b")], ENV)
    assert "**all gates passed** (2 PASS)" in text
    assert "<details>" not in text


def test_pipes_in_node_ids_do_not_break_the_table() -> None:
    text = step_summary([gate("tests/t.py::test_p[a|b]")], ENV)
    table = table_rows(text)
    assert len(table[1]) == 6
    assert table[1][0] == "`tests/t.py::test_p[a\\|b]`"


def test_change_column_with_a_baseline() -> None:
    stored = {"value": 0.934, "bound": None}
    up = gate("t.py::up", value=0.946)
    up.baseline = compare(up, stored, 0.02)
    down = gate("t.py::down", "failed", value=0.901)
    down.baseline = compare(down, stored, 0.02)
    new = gate("t.py::new")
    new.baseline = compare(new, None, 0.02)
    changed = gate("t.py::changed")
    changed.baseline = {"status": "inputs-changed", "message": "inputs changed: data sha256:aa… → sha256:bb…",
                        "change": -0.1, "baseline_value": 1.0, "value": 0.9, "limit": 0.02}
    plain = gate("t.py::plain")
    text = step_summary([up, down, new, changed, plain], ENV)
    table = table_rows(text)
    assert table[0][-1] == "change"
    assert [r[-1] for r in table[1:]] == ["+0.012 improved", "−0.033 regressed", "new",
                                          "inputs changed, not compared", ""]
    assert "- `t.py::down` baseline: 0.934 → 0.901 (−0.033, max_drop 0.02): regressed" in text
    assert "- `t.py::changed` baseline: inputs changed" in text


def test_no_gates() -> None:
    text = step_summary([], ENV)
    assert "no gates in this run" in text


def test_append_keeps_earlier_content(tmp_path: Path) -> None:
    path = tmp_path / "summary.md"
    append_step_summary(path, "# Build\n")
    append_step_summary(path, "## Dependability gates")
    append_step_summary(path, "more\n")
    assert path.read_text(encoding="utf-8") == "# Build\n\n## Dependability gates\n\nmore\n"


def test_write_github_step_summary_follows_the_variable(tmp_path: Path) -> None:
    path = tmp_path / "step_summary.md"
    path.write_text("")  # GitHub creates the file empty
    assert write_github_step_summary([gate("t.py::a")], ENV, environ={}) is None
    assert write_github_step_summary([gate("t.py::a")], ENV, environ={"GITHUB_STEP_SUMMARY": "  "}) is None
    assert write_github_step_summary([gate("t.py::a")], ENV, environ={"GITHUB_STEP_SUMMARY": str(path)}) == path
    assert path.read_text(encoding="utf-8").startswith("## Dependability gates\n")


def test_write_github_step_summary_raises_oserror_for_an_unwritable_target(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        write_github_step_summary([gate("t.py::a")], ENV, environ={"GITHUB_STEP_SUMMARY": str(tmp_path)})


# ------------------------------------------------------------------------------------- end to end



@pytest.mark.slow
def test_a_run_appends_its_gates_to_github_step_summary(gate_project, monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    summary = tmp_path / "step_summary.md"
    summary.write_text("earlier step\n", encoding="utf-8")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    gate_project.tests("""
        import pytest

        @pytest.mark.min_scene_coverage(0.2, k=2)
        def test_pairs(scenario_table):
            pass

        @pytest.mark.min_scene_coverage(0.9, k=2)
        def test_too_strict(scenario_table):
            pass
    """)
    result = gate_project.run()
    result.assert_outcomes(passed=1, failed=1)
    text = summary.read_text(encoding="utf-8")
    assert text.startswith("earlier step\n\n## Dependability gates\n")
    table = table_rows(text)
    assert table[1][0] == "`test_gates.py::test_pairs`" and table[1][5] == "PASS"
    assert table[2][0] == "`test_gates.py::test_too_strict`" and table[2][5] == "**FAIL**"
    assert "0.286 &lt; 0.900" in text  # '<' escaped: GitHub renders it, no stray HTML tag


@pytest.mark.slow
def test_no_summary_file_without_the_variable(gate_project, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    gate_project.tests("""
        import pytest

        @pytest.mark.min_scene_coverage(0.2, k=2)
        def test_pairs(scenario_table):
            pass
    """)
    gate_project.run().assert_outcomes(passed=1)
    assert not list(gate_project.pytester.path.glob("**/*.md"))
