"""The public API: every name in ``__all__`` and every name the READMEs and docs pages show resolves, lazily where it needs torch."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pytest_dnnsafety

ROOT = Path(__file__).resolve().parents[2]
READMES = [ROOT / "README.md", ROOT / "example_project" / "README.md", ROOT / "example_canvas" / "README.md",
           *sorted((ROOT / "docs").rglob("*.md"))]

#: What a conftest.py or a plugin needs to write its own gate.
GATE_API = {"GateDef", "Param", "REQUIRED", "Measurement", "GateContext", "GateSpec", "GateRegistry", "GateResult",
            "hookimpl"}


def _readme_names() -> set[str]:
    """``pytest_dnnsafety.X.Y`` references and ``from pytest_dnnsafety[.mod] import a, b`` lines of the READMEs."""
    names: set[str] = set()
    for readme in READMES:
        text = readme.read_text(encoding="utf-8")
        for match in re.finditer(r"from (pytest_dnnsafety(?:\.\w+)*) import (\([^)]*\)|[^\n#]+)", text):
            module, imported = match.group(1), match.group(2).strip("() \n")
            names.update(f"{module}.{name.split(' as ')[0].strip()}" for name in imported.split(",") if name.strip())
        names.update(m.group(0).rstrip(".") for m in re.finditer(r"(?<![\w/])pytest_dnnsafety(?:\.\w+)+", text))
    return names


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_name_in_all_is_importable() -> None:
    assert len(pytest_dnnsafety.__all__) == len(set(pytest_dnnsafety.__all__)), "duplicates in __all__"
    for name in pytest_dnnsafety.__all__:
        assert getattr(pytest_dnnsafety, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from pytest_dnnsafety import *", namespace)
    assert set(pytest_dnnsafety.__all__) <= set(namespace)
    assert sorted(dir(pytest_dnnsafety)) == sorted(pytest_dnnsafety.__all__)


def test_gate_writing_api_is_public() -> None:
    assert GATE_API <= set(pytest_dnnsafety.__all__)
    # pytest.hookimpl that marks this plugin's hooks optional (a conftest works with -p no:dnnsafety)
    assert pytest_dnnsafety.hookimpl(lambda: None).pytest_impl == pytest.hookimpl(lambda: None).pytest_impl
    from pytest_dnnsafety.gates import GateDef, Param, REQUIRED

    assert pytest_dnnsafety.GateDef is GateDef and pytest_dnnsafety.Param is Param
    assert pytest_dnnsafety.REQUIRED is REQUIRED


def test_older_gate_imports_still_work() -> None:
    from pytest_dnnsafety.gates import (COMMON_SETTINGS, GATES, GateSpec, evaluate, parse_marker,  # noqa: F401
                                        register_gate, resolve_optional)

    assert {"min_scene_coverage", "min_neuron_k_activation", "max_neuron_pattern_deviation",
            "max_pmi_ub"} <= set(GATES)


@pytest.mark.parametrize("dotted", sorted(_readme_names()) or ["pytest_dnnsafety.ScenarioTable"])
def test_names_shown_in_the_readmes_resolve(dotted: str) -> None:
    assert _resolve(dotted) is not None


def test_importing_the_package_imports_neither_torch_nor_pytest() -> None:
    code = ("import sys, pytest_dnnsafety; from pytest_dnnsafety import GateResult, Measurement; "
            "print('torch' in sys.modules, 'pytest' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    code = ("import sys; from pytest_dnnsafety import GateDef, Param, hookimpl, GateRegistry; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]
