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
    "inconclusive": ("INCONCLUSIVE", {"red": True, "bold": True}),
    "lost": ("LOST", {"red": True, "bold": True}),
}


def header_line(env: dict[str, Any]) -> str:
    return (f"pytest-dnnsafety {env.get('pytest_dnnsafety')} | torch {env.get('torch')} | "
            f"device {env.get('device')} | seed {env.get('seed')}"
            + (f" | workers {env['workers']}" if env.get("workers") else ""))


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(width - 1, 1)] + "…"


def render_table(results: Sequence[GateResult], width: int = 160) -> list[tuple[str, dict[str, bool]]]:
    """Rows as (text, markup) pairs, grouped under their test file; the verdict carries the colour."""
    head = ("test", "metric", "value", "bound", "threshold", "verdict")
    cells = []
    for r in results:
        verdict, markup = VERDICTS.get(r.status, (r.status.upper(), {}))
        threshold = f"{'≥' if r.op == '>=' else '≤'} {format_number(r.threshold)}"
        path, _, name = r.nodeid.partition("::")
        cells.append((path, ("  " + (name or path), r.marker, format_number(r.value), format_number(r.bound),
                             threshold, verdict), markup))
    fixed = [max(len(head[i]), *(len(row[i]) for _, row, _ in cells)) for i in range(1, 6)]
    # Test names are never cut (a reader must find the test); only pathological ones are.
    room = max(width - sum(fixed) - 2 * 5 - 1, 100)
    widths = [min(max(len(head[0]), *(len(row[0]) for _, row, _ in cells)), room), *fixed]

    def line(row: Sequence[str]) -> str:
        first = _shorten(row[0], widths[0]).ljust(widths[0])
        rest = [row[1].ljust(widths[1]), *(c.rjust(w) for c, w in zip(row[2:5], widths[2:5])), row[5]]
        return "  ".join([first, *rest])

    out: list[tuple[str, dict[str, bool]]] = [(line(head), {"bold": True})]
    current = None
    for path, row, markup in cells:
        if path != current:
            out.append((path, {}))
            current = path
        out.append((line(row), markup))
    return out
