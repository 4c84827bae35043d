"""The quick start (``docs/quickstart.md``) runs as pasted (issue #28, item 6).

The page marks its code blocks with HTML comments the site does not show: ``<!-- quickstart: file PATH -->``
before a block the reader saves as ``PATH``, ``<!-- quickstart: run -->`` before the commands the reader runs,
``<!-- quickstart: output -->`` before the gate rows the run prints. This test writes the files into a fresh
pytester project, runs the commands in order (``python X`` as a subprocess, ``pytest`` in process) and
checks that every gate passes and prints the rows the page shows.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "quickstart.md"

_BLOCK = re.compile(r"<!-- quickstart: (?P<what>file (?P<path>\S+)|run|output) -->\n```[\w-]*\n(?P<body>.*?)^```",
                    re.DOTALL | re.MULTILINE)


def quickstart_blocks(text: str) -> tuple[dict[str, str], list[str], list[str]]:
    """The page's files (path -> text), its commands and its printed gate rows, in page order."""
    files: dict[str, str] = {}
    commands: list[str] = []
    output: list[str] = []
    for match in _BLOCK.finditer(text):
        body = match.group("body")
        if match.group("path"):
            files[match.group("path")] = body
        elif match.group("what") == "run":
            commands += [line.strip() for line in body.splitlines() if line.strip()]
        else:
            output += body.splitlines()
    return files, commands, output


def test_the_page_marks_its_blocks() -> None:
    text = PAGE.read_text(encoding="utf-8")
    files, commands, output = quickstart_blocks(text)
    assert text.count("<!-- quickstart: ") == len(files) + 2, "a marked block the test cannot read"
    assert {"pyproject.toml", "tests/test_gates.py"} <= set(files), sorted(files)
    assert commands and commands[-1].startswith("pytest"), commands
    assert output, "the page shows the gate rows the run prints"
    for path in files:
        assert f"`{path}`" in text, f"the page does not tell the reader to save {path}"


def test_the_quickstart_project_passes_its_gates(pytester: pytest.Pytester) -> None:
    files, commands, output = quickstart_blocks(PAGE.read_text(encoding="utf-8"))
    for relpath, body in files.items():
        target = pytester.path / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body, encoding="utf-8")
    result = None
    for command in commands:
        program, *args = command.split()
        if program == "python":
            ran = pytester.run(sys.executable, *args, timeout=60)
            assert ran.ret == 0, f"{command}:\n{ran.stdout.str()}\n{ran.stderr.str()}"
        else:
            assert program == "pytest", f"the test does not know how to run {command!r}"
            result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly", *args)
    assert result is not None
    text = result.stdout.str()
    gates = text.count(" PASS")
    assert result.ret == 0 and gates == len(re.findall(r"@pytest\.mark\.", files["tests/test_gates.py"])), text
    lines = {line.rstrip() for line in result.stdout.lines}
    for line in output:
        if line.startswith("  "):  # a gate row: exactly as printed
            assert line.rstrip() in lines, f"the page shows {line.strip()!r}; the run printed:\n{text}"
