"""The package's import graph: the layers of the package docstring, no import cycles (type-only ones included),
engine families that do not import each other, engines that import neither pytest nor ``files.loading``.

Every ``import`` and ``from ... import`` statement of every module under ``pytest_dnnsafety/`` is read with
:mod:`ast`, function-local ones included (they run too, only later); imports under ``if TYPE_CHECKING:``
never run and are left out. An import of a package's submodule is an edge to that submodule, not to its
parent package (which Python imports first, whatever the graph says).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pytest_dnnsafety"


class Edge(NamedTuple):
    source: str
    target: str
    line: int
    local: bool  # inside a function


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package)."""
    out: dict[str, tuple[Path, bool]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts.pop()
        out[".".join(parts)] = (path, package)
    return out


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, local: bool = False, typing: bool = False
             ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child) and not typing:
            for statement in child.orelse:
                yield from _imports(statement, local)
            continue
        inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, inner
        yield from _imports(child, inner, typing)


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The absolute names an import statement loads (a ``from pkg import sub`` loads ``pkg.sub``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [f"{module}.{alias.name}" for alias in node.names] + [module]


def _edges(typing: bool = False) -> list[Edge]:
    """Every import edge; ``typing``: with the imports under ``if TYPE_CHECKING:`` too."""
    modules = _modules()
    edges: list[Edge] = []
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        for node, local in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path)), typing=typing):
            targets = _targets(node, package)
            if isinstance(node, ast.ImportFrom):  # `from a import b`: a.b when it is a module, else a
                subs = [t for t in targets[:-1] if t in modules]
                targets = subs if len(subs) == len(targets) - 1 else [*subs, targets[-1]]
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                if target != name and (target in modules or not target.startswith("pytest_dnnsafety")):
                    edges.append(Edge(name, target, node.lineno, local))
    return edges


def _cycles(edges: list[Edge]) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        if edge.target.startswith("pytest_dnnsafety"):
            graph.setdefault(edge.source, set()).add(edge.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read() -> None:
    edges = _edges()
    pairs = {(e.source, e.target) for e in edges}
    assert ("pytest_dnnsafety.plugin.hooks", "pytest_dnnsafety.settings") in pairs  # from .config import ...
    assert ("pytest_dnnsafety.gates", "pytest_dnnsafety.gates.core") in pairs  # from .core import (...)
    assert any(e.local for e in edges)  # function-local imports are read
    assert _cycles([Edge("a", "b", 1, False), Edge("b", "a", 2, True)]) == []  # outside the package
    assert _cycles([Edge("pytest_dnnsafety.a", "pytest_dnnsafety.b", 1, False),
                    Edge("pytest_dnnsafety.b", "pytest_dnnsafety.a", 2, True)]) == [
        ["pytest_dnnsafety.a", "pytest_dnnsafety.b"]]


@pytest.mark.parametrize("typing", [False, True], ids=["run-time", "type-checking"])
def test_no_import_cycles(typing: bool) -> None:
    edges = _edges(typing)
    cycles = _cycles(edges)
    shown = []
    for component in cycles:
        inside = [f"{e.source}:{e.line} -> {e.target}{' (in a function)' if e.local else ''}" for e in edges
                  if e.source in component and e.target in component]
        shown.append(" | ".join(inside))
    assert not cycles, "import cycles: " + "; ".join(shown)


@pytest.mark.parametrize("forbidden", ["pytest", "_pytest", "pytest_dnnsafety.files.loading"])
def test_engines_are_pure(forbidden: str) -> None:
    """Engines are pure torch: no pytest, and the loading of settings' files is not theirs."""
    bad = [f"{e.source}:{e.line}" for e in _edges()
           if e.source.startswith("pytest_dnnsafety.engines")
           and (e.target == forbidden or e.target.startswith(forbidden + "."))]
    assert not bad, f"engine modules import {forbidden}: {', '.join(bad)}"


#: The folders of the package, bottom to top (the package docstring states the rule).
LAYERS = ("data", "files", "runtime", "stats", "engines", "scenarios", "report", "gates", "plugin")
#: Engine packages that are libraries under the families (every family may import them).
ENGINE_LIBRARIES = ("core", "perturb", "bounds")
#: The core: modules directly under the package.
CORE = ("__init__.py", "_version.py", "errors.py", "results.py", "settings.py")


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else -1


def test_each_folder_imports_only_the_folders_below_it() -> None:
    bad = [f"{e.source}:{e.line} -> {e.target}" for e in _edges(typing=True)
           if e.target.startswith("pytest_dnnsafety.") and _layer(e.target) > _layer(e.source)
           and e.source != "pytest_dnnsafety"]
    assert not bad, "imports of a higher layer: " + "; ".join(bad)
    import pytest_dnnsafety

    doc = pytest_dnnsafety.__doc__ or ""
    assert " < ".join(LAYERS) in doc, "the package docstring states the layers"


def _family(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "engines" else None


def test_engine_families_import_only_the_engine_libraries() -> None:
    bad = []
    for e in _edges(typing=True):
        source, target = _family(e.source), _family(e.target)
        if source and target and source != target and target not in ENGINE_LIBRARIES:
            bad.append(f"{e.source}:{e.line} -> {e.target}")
        if source in ENGINE_LIBRARIES and target and target != source and (
                source == "core" or target not in ENGINE_LIBRARIES):
            bad.append(f"{e.source}:{e.line} -> {e.target} (a library imports a family or a higher library)")
    assert not bad, "; ".join(bad)


def test_the_tree_is_layered() -> None:
    top = sorted(p.name for p in PACKAGE.iterdir() if p.suffix == ".py")
    assert set(top) <= set(CORE), f"modules directly under the package besides the core: {sorted(set(top) - set(CORE))}"
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert set(folders) == set(LAYERS), folders
    engines = PACKAGE / "engines"
    assert [p.name for p in engines.iterdir() if p.suffix == ".py"] == ["__init__.py"]


def test_the_tests_mirror_the_package() -> None:
    """At most 10 files at the top of tests/; test files in folders; basenames unique (they are imported by name)."""
    tests = PACKAGE.parent / "tests"
    top = [p.name for p in tests.iterdir() if p.is_file()]
    assert len(top) <= 10, top
    assert not [name for name in top if name.startswith("test_")], top
    names = [p.name for p in tests.rglob("*.py") if p.name != "conftest.py"]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    from pytest_dnnsafety.gates import BUILTIN_FAMILIES  # the gates modules that declare a FAMILY

    families = {module.rsplit(".", 1)[1] for module in BUILTIN_FAMILIES}
    assert families == {p.name for p in (tests / "families").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert families <= {p.name for p in (PACKAGE / "engines").iterdir() if p.is_dir()}
    assert families == {p.stem for p in (PACKAGE.parent / "docs" / "gates").glob("*.md")}
