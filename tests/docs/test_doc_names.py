"""Every marker, keyword and setting the docs name exists (issue #28, item 6).

A page that shows ``@pytest.mark.min_x(0.9, foo=1)`` teaches the reader a marker and a keyword; a
misspelt or removed one would be a collection error in the reader's project. So, on every page (and the
READMEs): each marker call names a registered marker (or one the page itself registers with
``GateDef(marker=...)``) and only keywords that marker takes; each ``dnnsafety_*`` ini option,
``--dnnsafety-*`` flag and ``DNNSAFETY_*`` variable is a setting (or a name the package or the test
suite reads, such as the ``dnnsafety_settings`` fixture). On the quick start and the how-to guides also
every backticked ``min_*``/``max_*`` name is a marker or a keyword and every backticked ``name=`` is a
keyword some gate takes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pytest_dnnsafety.gates import COMMON_SETTINGS, REGRESSION_KEYWORDS, builtin_registry
from pytest_dnnsafety.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted([*DOCS.rglob("*.md"), ROOT / "README.md", ROOT / "example_project" / "README.md",
                ROOT / "example_canvas" / "README.md"])
GUIDES = sorted([DOCS / "quickstart.md", *(DOCS / "howto").glob("*.md")])
GATES = dict(builtin_registry())
SETTING_NAMES = {name for s in SETTINGS.values() for name in (s.ini, s.cli, s.env)}
EVERY_GATE = set(COMMON_SETTINGS) | set(REGRESSION_KEYWORDS.values())
#: Keyword arguments the guides show that belong to torch or Python calls, not to a gate marker.
NOT_GATE_KEYWORDS = {"collate_fn", "shuffle", "batch_size", "dynamic_shapes", "weights_only", "min"}
KEYWORDS = EVERY_GATE | {p.name for g in GATES.values() for p in g.params} | {r for g in GATES.values()
                                                                                  for r in g.fixtures}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _source_text() -> str:
    files = [*(ROOT / "pytest_dnnsafety").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def _calls(text: str) -> list[tuple[str, str | None]]:
    """``(marker, call source or None)`` for every ``pytest.mark.NAME(`` of ``text`` (None: not balanced)."""
    out = []
    for match in re.finditer(r"pytest\.mark\.(\w+)\(", text):
        depth, end = 0, None
        for index in range(match.end() - 1, min(len(text), match.end() + 2000)):
            depth += {"(": 1, ")": -1}.get(text[index], 0)
            if depth == 0:
                end = index + 1
                break
        out.append((match.group(1), None if end is None else "f" + text[match.end() - 1:end]))
    return out


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_marker_calls_name_real_markers_and_keywords(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    own = set(re.findall(r"marker=\"(\w+)\"", text))
    pytest_marks = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings", "slow"}
    for marker, call in _calls(text):
        if marker in own or marker in pytest_marks:
            continue
        assert marker in GATES, f"{_rel(page)}: @pytest.mark.{marker} is not a registered marker"
        if call is None:
            continue
        try:
            node = ast.parse(call, mode="eval").body
        except SyntaxError:
            continue  # a call with an elided argument (`...`): the marker name is still checked
        assert isinstance(node, ast.Call)
        gate = GATES[marker]
        allowed = EVERY_GATE | {p.name for p in gate.params} | set(gate.fixtures)
        for keyword in node.keywords:
            assert keyword.arg in allowed, f"{_rel(page)}: {marker}({keyword.arg}=...) is not a keyword of {marker}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_settings_named_on_pages_exist(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    names = set(re.findall(r"--dnnsafety-[a-z-]*[a-z]|\bdnnsafety_[a-z_]*[a-z]|\bDNNSAFETY_[A-Z_]*[A-Z]", text))
    unknown = sorted(names - SETTING_NAMES)
    if unknown:
        source = _source_text()
        unknown = [name for name in unknown if name not in source]
    assert not unknown, f"{_rel(page)} names settings that do not exist: {unknown}"


@pytest.mark.parametrize("page", GUIDES, ids=_rel)
def test_guides_name_only_real_markers_and_keywords(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    for name in set(re.findall(r"`((?:min|max)_\w+)", text)):
        assert name in GATES or name in KEYWORDS, f"{_rel(page)}: `{name}` is neither a marker nor a keyword"
    for name in set(re.findall(r"`(\w+)=", text)) - NOT_GATE_KEYWORDS:
        assert name in KEYWORDS, f"{_rel(page)}: `{name}=` is not a keyword of any gate"


def test_the_guides_exist() -> None:
    assert (DOCS / "quickstart.md").is_file()
    assert len(GUIDES) >= 5, [str(p) for p in GUIDES]
