"""The gates as a Markdown job summary (GitHub Actions' ``$GITHUB_STEP_SUMMARY``).

GitHub renders the Markdown that a step appends to the file named by ``GITHUB_STEP_SUMMARY`` on
the run's summary page. :func:`step_summary` renders one table (test, marker, value, bound,
threshold, verdict, and the change against a baseline when there is one); verdicts are plain words
(``PASS``, ``FAIL``, ...), never emoji, so the page reads the same in any viewer and in a plain-text
mail. Run by the controller only, at the end of the run. Nothing here imports torch or pytest.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from pytest_dnnsafety.results import STATUSES, GateResult, format_numbers
from pytest_dnnsafety.report.baseline import format_change
from pytest_dnnsafety.report.terminal import VERDICTS, header_line

__all__ = ["step_summary", "append_step_summary", "write_github_step_summary", "STEP_SUMMARY_ENV"]

#: The environment variable GitHub Actions sets to the job summary file of the current step.
STEP_SUMMARY_ENV = "GITHUB_STEP_SUMMARY"

_CHANGE_WORDS = {"regressed": "regressed", "improved": "improved", "ok": ""}


def _text(text: Any) -> str:
    """Plain text on one line; ``<`` and ``&`` escaped so an error text like ``<class 'X'>`` is not read as HTML."""
    return str(text).replace("\r", " ").replace("\n", " ").replace("&", "&amp;").replace("<", "&lt;")


def _cell(text: Any) -> str:
    """A table cell: one line, pipes escaped."""
    return _text(text).replace("|", "\\|")


def _code(text: str, in_table: bool = True) -> str:
    """A code span (keeps ``[params]``, ``*``, ``_`` literal); in a table its pipes are escaped (GFM)."""
    text = str(text).replace("\r", " ").replace("\n", " ")
    fence = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    span = f"{fence}{pad}{text}{pad}{fence}"
    return span.replace("|", "\\|") if in_table else span


def _change(comparison: Mapping[str, Any] | None) -> str:
    if not comparison:
        return ""
    status = comparison.get("status")
    if status == "inputs-changed":
        return "inputs changed, not compared"
    if status == "unverifiable":
        return "unverifiable, not compared"
    if status == "missing":
        return "new" if comparison.get("baseline_value") is None else "-"
    text = format_change(comparison.get("change"))
    word = _CHANGE_WORDS.get(str(status), str(status))
    return f"{text} {word}".strip()


def step_summary(rows: Sequence[GateResult], env: Mapping[str, Any]) -> str:
    """The run's gates as Markdown: a heading, the environment line, counts and one table row per gate."""
    comparisons = [getattr(r, "baseline", None) for r in rows]
    with_change = any(isinstance(c, dict) for c in comparisons)
    counts = {status: sum(r.status == status for r in rows) for status in STATUSES}
    failing = len(rows) - counts["passed"]
    lines = ["## Dependability gates", ""]
    lines.append(_text(header_line(dict(env))) if env else "")
    lines.append("")
    verdict_counts = ", ".join(f"{n} {VERDICTS.get(s, (s.upper(),))[0]}" for s, n in counts.items() if n)
    outcome = "all gates passed" if rows and not failing else (
        f"{failing} of {len(rows)} gates did not pass" if rows else "no gates in this run")
    lines.append(f"**{outcome}** ({verdict_counts or 'none'})")
    lines.append("")
    head = ["test", "marker", "value", "bound", "threshold", "verdict"] + (["change"] if with_change else [])
    align = ["---", "---", "---:", "---:", "---:", "---"] + (["---:"] if with_change else [])
    lines.append("| " + " | ".join(head) + " |")
    lines.append("| " + " | ".join(align) + " |")
    for r, comparison in zip(rows, comparisons):
        verdict = VERDICTS.get(r.status, (r.status.upper(),))[0]
        if r.status != "passed":
            verdict = f"**{verdict}**"
        value, bound, limit = format_numbers(r.value, r.bound, r.threshold)  # differing numbers print differently
        threshold = f"{'≥' if r.op == '>=' else '≤'} {limit}"
        cells = [_code(r.nodeid), _code(r.label), value, bound, threshold, verdict]
        if with_change:
            cells.append(_cell(_change(comparison if isinstance(comparison, dict) else None)))
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for r, comparison in zip(rows, comparisons):
        if r.status != "passed" and r.summary:
            notes.append(f"- {_code(r.nodeid, False)}: {_text(r.summary)}")
        if isinstance(comparison, dict) and comparison.get("status") in ("regressed", "inputs-changed", "unverifiable"):
            notes.append(f"- {_code(r.nodeid, False)} baseline: {_text(comparison.get('message', ''))}")
    if notes:
        lines += ["", "<details><summary>Details</summary>", "", *notes, "", "</details>"]
    return "\n".join(lines) + "\n"


def append_step_summary(path: Path, text: str) -> None:
    """Append ``text`` to the job summary file (GitHub appends each step's file to the page).

    A blank line separates it from what earlier steps or tools wrote. Raises OSError when the file
    cannot be written.
    """
    path = Path(path)
    prefix = ""
    try:
        if path.stat().st_size > 0:
            prefix = "\n"
    except FileNotFoundError:
        pass
    with open(path, "a", encoding="utf-8") as out:
        out.write(prefix + (text if text.endswith("\n") else text + "\n"))


def write_github_step_summary(rows: Sequence[GateResult], env: Mapping[str, Any],
                              environ: Mapping[str, str] | None = None) -> Path | None:
    """Append the gates to ``$GITHUB_STEP_SUMMARY`` when it is set; returns the path written, or None.

    Raises OSError when the variable is set but the file cannot be written.
    """
    environ = os.environ if environ is None else environ
    target = (environ.get(STEP_SUMMARY_ENV) or "").strip()
    if not target:
        return None
    path = Path(target)
    append_step_summary(path, step_summary(rows, env))
    return path
