"""The docs navigation of the gate families is derived from their declarations (``docs/hooks.py``'s ``on_config``).

``mkdocs.yml`` keeps only a placeholder for the "Gate families" section; the build hook fills it with one
entry per built-in family, its declared title -> its docs page, in the families' order. A nav without the
placeholder is a build error naming the fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_dnnsafety.gates import builtin_registry
from test_reference_pages import _hooks  # docs/hooks.py loaded as a module

ROOT = Path(__file__).resolve().parents[2]


def test_the_placeholder_is_filled_with_every_family_in_order() -> None:
    hooks = _hooks()
    nav = [{"Home": "index.md"}, {hooks.FAMILY_SECTION: []}, {"Outputs": "outputs.md"}]
    hooks.fill_family_nav(nav)
    families = builtin_registry().families.values()
    assert nav[1][hooks.FAMILY_SECTION] == [{family.title: f"gates/{family.name}.md"} for family in families]
    assert nav[1][hooks.FAMILY_SECTION][0] == {"Scenario coverage": "gates/coverage.md"}
    assert nav[0] == {"Home": "index.md"} and nav[2] == {"Outputs": "outputs.md"}


def test_mkdocs_yml_lists_no_family_page_by_hand() -> None:
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "  - Gate families: []\n" in text
    assert "gates/coverage.md" not in text and "add-a-family.md" in text


def test_a_nav_without_the_placeholder_is_an_error() -> None:
    pytest.importorskip("mkdocs")
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="no 'Gate families' section"):
        _hooks().fill_family_nav([{"Home": "index.md"}])
