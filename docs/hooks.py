"""MkDocs build hook: fills the generated reference pages from the plugin's own registry (they cannot drift).

The reference pages (``docs/reference/``) are committed with their generated text between
``<!-- generated: NAME ... -->`` and ``<!-- end generated: NAME -->`` comments (``markers``, ``settings``,
``api``). The build refills those regions from the code
(:func:`pytest_dnnsafety.plugin.reference.fill_generated`), which gives the committed text whenever the
pages are current; ``tests/docs/test_reference_pages.py`` fails when they are not.

The "Gate families" section of the navigation is derived too (:func:`on_config`): one entry per built-in
family, its declared title -> its docs page, from the families' ``FAMILY = Family(...)`` declarations.
"""

from __future__ import annotations

from typing import Any

from pytest_dnnsafety.plugin.reference import fill_generated


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """The page's Markdown with its generated regions refilled from the code (other pages unchanged)."""
    return fill_reference(markdown)


def fill_reference(markdown: str) -> str:
    """Refill the generated regions of one page; a page without any is returned as it is."""
    if "<!-- generated: " not in markdown:
        return markdown
    return fill_generated(markdown)


#: The nav section the gate families fill; ``mkdocs.yml`` keeps it as a placeholder (an empty list).
FAMILY_SECTION = "Gate families"


def on_config(config: Any) -> Any:
    """The site's config with the gate families' navigation derived from their declarations."""
    fill_family_nav(config["nav"])
    return config


def family_nav() -> list[dict[str, str]]:
    """One nav entry per built-in gate family, in its order: its declared title -> its docs page."""
    from pytest_dnnsafety.gates import builtin_registry

    return [{family.title: family.page} for family in builtin_registry().families.values()]


def fill_family_nav(nav: list[Any]) -> None:
    """Fill the nav's :data:`FAMILY_SECTION` placeholder with :func:`family_nav` (an error when there is none)."""
    from mkdocs.exceptions import PluginError

    for entry in nav or []:
        if isinstance(entry, dict) and FAMILY_SECTION in entry:
            entry[FAMILY_SECTION] = family_nav()
            return
    raise PluginError(f"docs/hooks.py: mkdocs.yml's nav has no {FAMILY_SECTION!r} section to fill with the gate "
                      f"families. Fix: keep the placeholder `- {FAMILY_SECTION}: []` in the nav")
