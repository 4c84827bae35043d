"""Depth-safe parsing of the JSON and TOML files the plugin reads (baseline, severity, conditions, archives).

``json`` and ``tomllib`` recurse once per level of nested arrays and tables: a file nested a few
thousand levels deep (a "recursion bomb", a few kilobytes of ``[[[[...``) ends them in a raw
:class:`RecursionError` — an INTERNALERROR when it happens while pytest starts. A TOML file can
also build a deep table without any recursion in the parser (``[a.a.a.a...]``), and the recursion
then happens later, in whatever walks the value. :func:`loads_json` and :func:`loads_toml` turn
both into :class:`TooDeep`, a :class:`ValueError` like the parsers' own syntax errors, so every
caller reports it the way it reports a syntax error: naming the file.

No file the plugin reads needs more than a handful of levels (an evidence file about eight);
:data:`MAX_DEPTH` leaves ample room and stays far below Python's recursion limit.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["MAX_DEPTH", "TooDeep", "check_depth", "loads_json", "loads_toml"]

#: The deepest nesting of arrays and tables (objects) accepted in a file the plugin reads.
MAX_DEPTH = 100


class TooDeep(ValueError):
    """A JSON or TOML document nested deeper than :data:`MAX_DEPTH` levels."""

    def __init__(self, limit: int = MAX_DEPTH) -> None:
        super().__init__(f"arrays or tables are nested more than {limit} levels deep (a file this plugin reads "
                         f"never needs that many; this one may be damaged or built to crash the parser)")


def check_depth(value: Any, limit: int = MAX_DEPTH) -> Any:
    """``value`` unchanged, or :class:`TooDeep` when its lists/tuples/dicts nest deeper than ``limit``.

    Iterative (an explicit stack): it never recurses itself.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else None
        if children is None:
            continue
        if depth > limit:
            raise TooDeep(limit)
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, tuple)))
    return value


def loads_json(text: str | bytes, limit: int = MAX_DEPTH) -> Any:
    """``json.loads`` that raises :class:`TooDeep` (a ValueError) instead of RecursionError or a deep value."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(limit) from None
    return check_depth(value, limit)


def loads_toml(text: str, limit: int = MAX_DEPTH) -> dict[str, Any]:
    """``tomllib.loads`` (``tomli`` before Python 3.11) that raises :class:`TooDeep` instead of RecursionError.

    Syntax errors stay ``TOMLDecodeError`` (also a ValueError).
    """
    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
        import tomli as tomllib  # type: ignore[no-redef]
    try:
        value = tomllib.loads(text)
    except RecursionError:
        raise TooDeep(limit) from None
    return check_depth(value, limit)
