"""MkDocs build hook: fills the generated reference pages from the plugin's own registry (they cannot drift).

A page holding ``<!-- generated: markers -->`` gets the marker reference
(:func:`pytest_dnnsafety.plugin.reference.markers_markdown`), ``<!-- generated: settings -->`` the settings table.
"""

from __future__ import annotations

from typing import Any

from pytest_dnnsafety.plugin.reference import markers_markdown, settings_markdown


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- generated: markers -->" in markdown:
        markdown = markdown.replace("<!-- generated: markers -->", markers_markdown())
    if "<!-- generated: settings -->" in markdown:
        markdown = markdown.replace("<!-- generated: settings -->", settings_markdown())
    return markdown
