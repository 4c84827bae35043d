"""The ``dependability gates`` terminal section: a header line and one row per gate.

Below the table, one line per shared forward pass (the session's one pass per model and data, timed apart from
the gates: ``shared forward pass model × dataset (2 layers): 2000 images in 564.20 s (3.5 images/s), first needed
by ...``).

When any gate was compared with a baseline (``GateResult.baseline``, see :mod:`.baseline`), the
table gets a ``change`` column: the signed change of the compared number (``+0.012``), ``−0.033 ✗``
for a regression, ``new`` for a gate the baseline lacks, ``inputs≠`` when the inputs changed.
"""

from __future__ import annotations

from typing import Any, Sequence

from pytest_dnnsafety.results import GateResult, format_numbers

__all__ = ["header_line", "render_table", "baseline_notes", "change_cell", "write_section", "VERDICTS"]

#: status -> (verdict text, terminal markup)
VERDICTS = {
    "passed": ("PASS", {"green": True}),
    "failed": ("FAIL", {"red": True, "bold": True}),
    "error": ("ERROR", {"red": True, "bold": True}),
    "not-evaluated": ("NOT RUN", {"yellow": True}),
    "inconclusive": ("INCONCLUSIVE", {"red": True, "bold": True}),
    "lost": ("LOST", {"red": True, "bold": True}),
}


def header_line(env: dict[str, Any]) -> str:
    return (f"pytest-dnnsafety {env.get('pytest_dnnsafety')} | torch {env.get('torch')} | "
            f"device {env.get('device')} | seed {env.get('seed')}"
            + (f" | workers {env['workers']}" if env.get("workers") else ""))


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 1)] + "…"


def _baseline(result: GateResult) -> dict[str, Any] | None:
    comparison = getattr(result, "baseline", None)
    return comparison if isinstance(comparison, dict) else None


def change_cell(comparison: dict[str, Any] | None) -> str:
    """The ``change`` column's text for one gate's baseline comparison ("" when not compared)."""
    from pytest_dnnsafety.report.baseline import format_change

    if not comparison:
        return ""
    status = comparison.get("status")
    if status == "inputs-changed":
        return "inputs≠"
    if status == "unverifiable":
        return "unverifiable"
    if status == "missing":
        return "new" if comparison.get("baseline_value") is None else "-"
    text = format_change(comparison.get("change"))
    return text + " ✗" if status == "regressed" else text


def baseline_notes(results: Sequence[GateResult]) -> list[str]:
    """One line per gate whose baseline comparison needs a reader's attention (regressed, inputs changed, unverifiable)."""
    lines = []
    for r in results:
        comparison = _baseline(r)
        if comparison and comparison.get("status") in ("regressed", "inputs-changed", "unverifiable"):
            lines.append(f"  {r.nodeid} [{r.marker}] baseline: {comparison.get('message', '')}")
    return lines


def render_table(results: Sequence[GateResult], width: int = 160) -> list[tuple[str, dict[str, bool]]]:
    """Rows as (text, markup) pairs, grouped under their test file; the verdict carries the colour.

    A ``change`` column (before the verdict) appears when any gate has a baseline comparison.
    """
    with_change = any(_baseline(r) is not None for r in results)
    head: tuple[str, ...] = ("test", "metric", "value", "bound", "threshold")
    head += ("change", "verdict") if with_change else ("verdict",)
    n = len(head)
    cells = []
    for r in results:
        verdict, markup = VERDICTS.get(r.status, (r.status.upper(), {}))
        # enough digits that a value, its bound and the threshold that differ print differently
        value, bound, limit = format_numbers(r.value, r.bound, r.threshold)
        threshold = f"{'≥' if r.op == '>=' else '≤'} {limit}"
        path, _, name = r.nodeid.partition("::")
        row: tuple[str, ...] = ("  " + (name or path), r.label, value, bound, threshold)
        row += (change_cell(_baseline(r)), verdict) if with_change else (verdict,)
        cells.append((path, row, markup))
    fixed = [max(len(head[i]), *(len(row[i]) for _, row, _ in cells)) for i in range(1, n)]
    # Test names are never cut (a reader must find the test); only pathological ones are.
    room = max(width - sum(fixed) - 2 * (n - 1) - 1, 100)
    widths = [min(max(len(head[0]), *(len(row[0]) for _, row, _ in cells)), room), *fixed]

    def line(row: Sequence[str]) -> str:
        first = _shorten(row[0], widths[0]).ljust(widths[0])
        rest = [row[1].ljust(widths[1]), *(c.rjust(w) for c, w in zip(row[2:n - 1], widths[2:n - 1])), row[n - 1]]
        return "  ".join([first, *rest])

    out: list[tuple[str, dict[str, bool]]] = [(line(head), {"bold": True})]
    current = None
    for path, row, markup in cells:
        if path != current:
            out.append((path, {}))
            current = path
        out.append((line(row), markup))
    return out


def write_section(tr: Any, rows: Sequence[GateResult], env: dict[str, Any], lost: Sequence[str], written: Any,
                  hook_errors: Sequence[str] = (), *, shared_passes: Sequence[dict[str, Any]] = (),
                  partial_error: str | None = None) -> None:
    """The ``dependability gates`` section on pytest's terminal reporter ``tr``.

    ``written`` is :class:`~pytest_dnnsafety.report.run.Written` (the paths and failed writes);
    ``hook_errors`` the ``pytest_dnnsafety_gate_result`` implementations that raised; ``shared_passes`` the
    evidence's shared forward passes; ``partial_error`` why writes during the run failed (a warning).
    """
    from pytest_dnnsafety.report.junit import pass_line

    tr.write_sep("=", "dependability gates")
    tr.write_line(header_line(env))
    for text, markup in render_table(rows):
        tr.write_line(text, **markup)
    for entry in shared_passes:
        tr.write_line(f"{pass_line(entry)} (not counted in the gates' seconds)", red=bool(entry.get("error")))
    for r in rows:
        if r.status in ("failed", "error", "inconclusive", "lost"):
            tr.write_line(f"  {r.nodeid}: {r.summary}", red=True)
    if lost:
        tr.write_line(f"{len(lost)} gated test(s) never reported a result (lost: a crashed worker?); "
                      "the run fails: " + ", ".join(lost), red=True, bold=True)
    for line in baseline_notes(rows):
        tr.write_line(line, yellow=True)
    for error in written.errors:
        tr.write_line(f"dependability evidence NOT written to {error}; the run fails", red=True, bold=True)
    for what, path in (("dependability evidence", written.evidence_path),
                       ("dependability report (HTML)", written.html_path), ("baseline", written.baseline_path)):
        if path is not None:
            tr.write_line(f"{what} written to {path}")
    if partial_error is not None:
        tr.write_line(f"dependability evidence during the run: {partial_error}", yellow=True)
    if written.step_summary_error is not None:
        tr.write_line(f"GitHub job summary not written: {written.step_summary_error}", yellow=True)
    for error in hook_errors:
        tr.write_line(f"pytest_dnnsafety_gate_result raised for {error}; the run fails", red=True, bold=True)
