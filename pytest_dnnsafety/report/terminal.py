"""The ``dependability gates`` terminal section: a header line and one row per gate."""

from __future__ import annotations

from typing import Any, Sequence

from ..results import GateResult, format_number

__all__ = ["header_line", "render_table", "VERDICTS"]

#: status -> (verdict text, terminal markup)
VERDICTS = {
    "passed": ("PASS", {"green": True}),
    "failed": ("FAIL", {"red": True, "bold": True}),
    "error": ("ERROR", {"red": True, "bold": True}),
    "not-evaluated": ("NOT RUN", {"yellow": True}),
}


def header_line(env: dict[str, Any]) -> str:
    return (f"pytest-dnnsafety {env.get('pytest_dnnsafety')} | torch {env.get('torch')} | "
            f"device {env.get('device')} | seed {env.get('seed')}"
            + (f" | workers {env['workers']}" if env.get("workers") else ""))


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else "…" + text[-(width - 1):]


def render_table(results: Sequence[GateResult], width: int = 120) -> list[tuple[str, dict[str, bool]]]:
    """Rows as (text, markup) pairs; the verdict column carries the colour."""
    head = ("test", "metric", "value", "bound", "threshold", "verdict")
    rows = []
    for r in results:
        verdict, markup = VERDICTS.get(r.status, (r.status.upper(), {}))
        threshold = f"{'≥' if r.op == '>=' else '≤'} {format_number(r.threshold)}"
        rows.append(((r.nodeid, r.marker, format_number(r.value), format_number(r.bound), threshold, verdict),
                     markup))
    fixed = [max(len(head[i]), *(len(row[i]) for row, _ in rows)) for i in range(1, 6)]
    test_width = max(len(head[0]), min(max(len(row[0]) for row, _ in rows), width - sum(fixed) - 10, 70))
    widths = [test_width, *fixed]

    def line(cells: Sequence[str]) -> str:
        first = _shorten(cells[0], widths[0]).ljust(widths[0])
        rest = [cells[1].ljust(widths[1]), *(c.rjust(w) for c, w in zip(cells[2:5], widths[2:5])), cells[5]]
        return "  ".join([first, *rest])

    out: list[tuple[str, dict[str, bool]]] = [(line(head), {"bold": True})]
    out += [(line(row), markup) for row, markup in rows]
    return out
