"""The generated reference pages are committed and current (issue #28, item 6).

``docs/reference/markers.md``, ``settings.md`` and ``api.md`` hold the text the code generates
(:mod:`pytest_dnnsafety.plugin.reference`) between ``generated`` comments, so the repository shows the same
reference as the site. These tests fail when a marker, keyword, setting or public name changed and the
pages were not regenerated, and name the one command that regenerates them.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import pytest_dnnsafety
from pytest_dnnsafety.plugin.reference import (REFERENCE_PAGES, REGENERATE, api_entries, api_markdown,
                                               fill_generated, main, stale_reference, undocumented_api,
                                               write_reference)

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_pages_are_current() -> None:
    problems = stale_reference(REFERENCE)
    assert not problems, ("\n".join(problems) + "\nThe committed reference pages differ from what the code generates."
                          f" Regenerate them from the repository root with:\n    {REGENERATE}")


def test_the_api_page_lists_every_public_name_with_its_summary() -> None:
    assert undocumented_api() == [], "every public name needs a docstring (or a #: comment above a constant)"
    entries = api_entries()
    assert [e.name for e in entries] == list(pytest_dnnsafety.__all__)
    text = (REFERENCE / "api.md").read_text(encoding="utf-8")
    for entry in entries:
        assert f"### `{entry.name}`" in text, f"{entry.name} has no section on docs/reference/api.md"
        assert f"| [`{entry.name}`](#{entry.name.lower()}) |" in text, f"{entry.name} is not in the index"
    assert " at 0x" not in api_markdown(entries), "memory addresses would make the page differ on every run"


def test_a_stale_page_is_named_and_rewritten(tmp_path: Path) -> None:
    for page in REFERENCE_PAGES:
        shutil.copy(REFERENCE / page, tmp_path / page)
    generators = {"markers": lambda: "markers v2", "settings": lambda: "settings v2", "api": lambda: "api v2"}
    stale = stale_reference(tmp_path, generators)
    assert len(stale) == len(REFERENCE_PAGES) and all("differs" in line for line in stale), stale
    assert sorted(p.name for p in write_reference(tmp_path, generators)) == sorted(REFERENCE_PAGES)
    assert stale_reference(tmp_path, generators) == []
    markers = (tmp_path / "markers.md").read_text(encoding="utf-8")
    assert markers.startswith("# Marker reference") and "\n\nmarkers v2\n\n<!-- end generated: markers -->" in markers
    assert write_reference(tmp_path, generators) == [], "a second write changes nothing"


def test_a_page_without_its_region_is_reported(tmp_path: Path) -> None:
    for page in REFERENCE_PAGES:
        shutil.copy(REFERENCE / page, tmp_path / page)
    (tmp_path / "api.md").write_text("# Python API\n\nno region here\n", encoding="utf-8")
    assert any("api.md: no generated region api" in line for line in stale_reference(tmp_path))
    with pytest.raises(ValueError, match="no generated region api"):
        write_reference(tmp_path)
    with pytest.raises(ValueError, match="'nope': unknown"):
        fill_generated("<!-- generated: nope -->")


def test_the_docs_build_shows_the_committed_text() -> None:
    hooks = _hooks()
    for page in REFERENCE_PAGES:
        text = (REFERENCE / page).read_text(encoding="utf-8")
        assert hooks.on_page_markdown(text, None, None, None) == text, page
    plain = "# A page\n\nwithout generated text\n"
    assert hooks.on_page_markdown(plain, None, None, None) is plain


def test_the_command_line_checks_and_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    command = REGENERATE.split()
    assert command[:3] == ["python", "-m", "pytest_dnnsafety.plugin.reference"] and command[3] == "--write"
    settings = tmp_path / "settings.md"
    committed = (REFERENCE / "settings.md").read_text(encoding="utf-8")
    settings.write_text(committed.replace("`dnnsafety_seed`", "`dnnsafety_sed`"), encoding="utf-8")
    # as a command (only settings.md here, so nothing imports torch): stale and missing pages, exit status 1
    check = subprocess.run([sys.executable, "-m", "pytest_dnnsafety.plugin.reference", "--check", str(tmp_path)],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 1, check.stderr
    assert "settings.md: differs" in check.stderr and "api.md: missing" in check.stderr
    assert REGENERATE in check.stderr
    for page in REFERENCE_PAGES:
        if page != "settings.md":
            shutil.copy(REFERENCE / page, tmp_path / page)
    assert main(["--write", str(tmp_path)]) == 0
    assert f"rewrote {settings}" in capsys.readouterr().out
    assert settings.read_text(encoding="utf-8") == fill_generated(committed)
    assert main(["--check", str(tmp_path)]) == 0
