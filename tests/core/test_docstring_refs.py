"""Cross-references in the package's docstrings (``:mod:``, ``:func:``, ``:class:``, ...) name things that exist.

After a module moves, a reference such as ``:mod:`.bounds_ops``` keeps reading well and points nowhere; this
test resolves every reference that is relative (leading dots, from the module's package) or starts with
``pytest_dnnsafety`` to a module or an attribute of one.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pytest_dnnsafety"
ROLE = re.compile(r":(mod|func|class|meth|data|attr|exc):`~?([A-Za-z_.][\w.]*)`")


def _resolves(dotted: str) -> bool:
    names = dotted.split(".")
    for i in range(len(names), 0, -1):
        try:
            obj = importlib.import_module(".".join(names[:i]))
        except ImportError:
            continue
        try:
            for name in names[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def test_every_docstring_reference_resolves() -> None:
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts[:-1]  # a module's package, or the package itself for its __init__
        text = path.read_text(encoding="utf-8")
        for match in ROLE.finditer(text):
            ref = match.group(2)
            if ref.startswith("."):
                level = len(ref) - len(ref.lstrip("."))
                base = package[: len(package) - (level - 1)]
                dotted = ".".join([*base, ref.lstrip(".")])
            elif ref.startswith("pytest_dnnsafety"):
                dotted = ref
            else:
                continue
            if not _resolves(dotted):
                line = text[: match.start()].count("\n") + 1
                broken.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {match.group(0)}")
    assert not broken, "docstring references to nothing:\n" + "\n".join(broken)
