"""The docs site (issue #23): the marker reference is generated from the registry and covers every marker and
keyword; every family page names its markers; no page points outside the repository; the strict build passes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_dnnsafety.settings import SETTINGS
from pytest_dnnsafety.gates import COMMON_SETTINGS, builtin_registry
from pytest_dnnsafety.plugin.reference import family_page, markers_markdown, settings_markdown, undocumented

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
GATES = dict(builtin_registry())


def test_every_marker_and_keyword_is_in_the_generated_reference() -> None:
    assert undocumented() == [], "every gate and keyword needs its doc text"
    text = markers_markdown()
    for name, gate in GATES.items():
        section = text.split(f"## `{name}` {{ #{name} }}", 1)
        assert len(section) == 2, f"{name} has no section"
        body = section[1].split("\n## ", 1)[0]
        for param in gate.params:
            assert f"| `{param.name}` |" in body, f"{name}({param.name}=...) is undocumented"
        for role in gate.fixtures:
            assert f"| `{role}` |" in body, f"{name}({role}=...) is undocumented"
        assert ", ".join(gate.tasks) in body
    for key in COMMON_SETTINGS:
        assert f"| `{key}` |" in text
    settings = settings_markdown()
    for setting in SETTINGS.values():
        assert f"`{setting.ini}`" in settings and f"`{setting.cli}`" in settings


def test_every_marker_has_a_family_page_that_names_it() -> None:
    for name, gate in GATES.items():
        page = family_page(gate)
        assert page is not None, f"{name}: no family page"
        text = (DOCS / page).read_text(encoding="utf-8")
        assert name in text, f"{name} is not mentioned on {page}"
        assert f"reference/markers.md#{name}" in text, f"{page} does not link {name} to its reference entry"


def test_pages_cite_nothing_outside_the_repository() -> None:
    for path in [*DOCS.rglob("*.md"), ROOT / "README.md", ROOT / "CHANGELOG.md", *ROOT.glob("pytest_dnnsafety/**/*.py")]:
        text = path.read_text(encoding="utf-8")
        assert "../shared" not in text and "METRICS.md" not in text, path
    for path in DOCS.rglob("*.md"):
        for target in re.findall(r"\]\(([^)#\s]+)", path.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            assert (path.parent / target).resolve().is_relative_to(DOCS.resolve()), f"{path}: link {target}"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists(),
                    reason="mkdocs is not installed (pip install -e '.[docs]')")
def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    page = (tmp_path / "site" / "reference" / "markers" / "index.html").read_text(encoding="utf-8")
    assert all(f'id="{name}"' in page for name in GATES)
