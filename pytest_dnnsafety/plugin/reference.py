"""The generated reference pages: markers and settings from the registry, the public Python names from ``__all__``.

:func:`markers_markdown` writes one section per gate marker from its
:class:`~pytest_dnnsafety.gates.core.GateDef`: what it measures and how it compares, the tasks it
supports, every keyword (:class:`~pytest_dnnsafety.gates.core.Param`: types, default, what to give),
the fixture roles and the keywords every gate takes. :func:`settings_markdown` writes the settings
table from :data:`~pytest_dnnsafety.settings.SETTINGS`. :func:`api_markdown` writes the public names of
``pytest_dnnsafety.__all__`` (kind, signature, first docstring paragraph), grouped by the layer that
defines them. :func:`undocumented` lists what has no text to show (a gate without ``doc``, a keyword
without ``doc``): the test suite requires it to be empty.

**Committed, and checked.** The pages under ``docs/reference/`` hold the generated text between
``<!-- generated: NAME ... -->`` and ``<!-- end generated: NAME -->`` comments, so the reference reads
the same in the repository as on the site. :func:`fill_generated` refills those regions (the docs
build hook ``docs/hooks.py`` calls it, so the site is generated as before),
:func:`write_reference` rewrites the pages and :func:`stale_reference` names the pages whose committed
text differs from what the code generates (a test requires none). From the repository root::

    python -m pytest_dnnsafety.plugin.reference --write docs/reference    # regenerate
    python -m pytest_dnnsafety.plugin.reference --check docs/reference    # exit status 1 when stale

Only :func:`api_markdown` imports torch (it resolves the lazily imported public names); the rest does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_dnnsafety.settings import SETTINGS
from pytest_dnnsafety.gates.core import COMMON_SETTINGS, REQUIRED, GateDef

__all__ = ["markers_markdown", "settings_markdown", "undocumented", "family_page", "api_markdown",
           "api_entries", "ApiEntry", "GENERATED", "REFERENCE_PAGES", "REGENERATE", "fill_generated",
           "write_reference", "stale_reference", "undocumented_api", "main"]

_COMMON_TEXT = {
    "seed": "seed of every random choice this gate makes (wins over `dnnsafety_seed`)",
    "device": "device of this gate's engines and model: `auto`, `cpu`, `cuda`, `cuda:N`, `mps`",
    "batch_size": "batch size of this gate's forward passes and engine updates",
    "task": "the model's task for this gate: `single-label`, `multi-label`, `detection` (default: the setting, "
            "else inferred from the data); a task the gate does not support is a collection error",
    "max_seconds": "the most seconds this gate may be estimated to take (wins over `dnnsafety_max_seconds`, default "
                   "3600; 0 or `\"none\"`: no limit): above it the gate is refused before measuring, naming the "
                   "estimate and the keywords that shrink it",
    "sample": "gate on a seeded subsample of this many inputs of the data (wins over `dnnsafety_sample`), "
              "stratified by the scenario table when the gate reads one; recorded in the evidence",
}


def _registry(registry: Mapping[str, GateDef] | None) -> Mapping[str, GateDef]:
    if registry is not None:
        return registry
    from pytest_dnnsafety.gates import builtin_registry

    return builtin_registry()


def _family_pages() -> dict[str, str]:
    """The built-in families' docs pages (``gates/<name>.md``) by family name, in the families' order."""
    from pytest_dnnsafety.gates import GATES

    return {name: family.page for name, family in GATES.families.items()}


def family_page(gate: GateDef) -> str | None:
    """The docs page (``gates/<name>.md``, as its family declares it) of a built-in gate, None for a gate from
    elsewhere."""
    from pytest_dnnsafety.gates import GATES

    for family in GATES.families.values():
        if any(member.marker == gate.marker for member in family.gates):
            return family.page
    return None


def _types(types: tuple[type, ...]) -> str:
    names = {int: "int", float: "float", str: "str", dict: "dict", bool: "bool", list: "list", tuple: "tuple",
             type(None): "None"}
    return " or ".join(names.get(t, getattr(t, "__name__", str(t))) for t in types)


def _default(value: Any) -> str:
    return "required" if value is REQUIRED else f"`{value!r}`"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def markers_markdown(registry: Mapping[str, GateDef] | None = None, *, link_prefix: str = "../") -> str:
    """Markdown: one ``## marker`` section per gate (keywords, fixtures, tasks), in registry order."""
    gates = _registry(registry)
    lines = ["| marker | compares | tasks |", "|---|---|---|"]
    for name, gate in gates.items():
        lines.append(f"| [`{name}`](#{name}) | {_cell(gate.metric)} {gate.op} threshold | {', '.join(gate.tasks)} |")
    lines.append("")
    for name, gate in gates.items():
        lines += [f"## `{name}` {{ #{name} }}", "", f"`{_cell(gate.signature())}`", ""]
        lines += [_cell(gate.doc[:1].upper() + gate.doc[1:]) + ".", ""]
        low, high = gate.threshold_range
        facts = [f"**Compares** {_cell(gate.metric)} `{gate.op}` the threshold (in [{low:g}, {high:g}])",
                 f"**tasks** {', '.join(gate.tasks)}"]
        if gate.shards:
            facts.append("**torchrun** splits its batches across the ranks")
        if gate.timed:
            facts.append("**timed**: under torchrun every rank takes rank 0's verdict")
        page = family_page(gate)
        if page:
            facts.append(f"**family page** [{page[6:-3]}]({link_prefix}{page})")
        lines += ["; ".join(facts) + ".", ""]
        if gate.params:
            lines += ["| keyword | type | default | give |", "|---|---|---|---|"]
            for p in gate.params:
                lines.append(f"| `{p.name}` | {_types(p.types)} | {_cell(_default(p.default))} | {_cell(p.doc)} |")
            lines.append("")
        lines += ["| fixture keyword | default fixture | read |", "|---|---|---|"]
        for role, fixture in gate.fixtures.items():
            if role in gate.conditional:
                option = gate.conditional[role]
                when = (f"only without `{option[1:]}=`" if option.startswith("!") else f"only with `{option}=`")
            elif role in gate.optional:
                when = (f"when `dnnsafety_{gate.optional[role]}` is configured, the fixture is overridden or the "
                        "keyword is given")
            else:
                when = "always"
            lines.append(f"| `{role}` | `{fixture}` | {when} |")
        lines += ["", f"Also `{'`, `'.join(COMMON_SETTINGS)}` (see [every gate's keywords](#every-gate)) and "
                  f"`{gate.regression_keyword}` (the largest {'drop' if gate.op == '>=' else 'rise'} allowed against "
                  "a baseline).", ""]
    lines += ["## Keywords every gate takes { #every-gate }", "", "| keyword | meaning |", "|---|---|"]
    lines += [f"| `{key}` | {_COMMON_TEXT[key]} |" for key in COMMON_SETTINGS]
    lines += ["| `max_drop` | on a `>=` gate: the largest drop of the metric allowed against the baseline |",
              "| `max_rise` | on a `<=` gate: the largest rise of the metric allowed against the baseline |", ""]
    return "\n".join(lines)


def settings_markdown() -> str:
    """Markdown: the settings table (ini option, CLI flag, environment variable, default, meaning)."""
    lines = ["| ini option | CLI flag | environment | default | meaning |", "|---|---|---|---|---|"]
    for setting in SETTINGS.values():
        default = "—" if setting.default is None else f"`{setting.default}`"
        lines.append(f"| `{setting.ini}` | `{setting.cli}` | `{setting.env}` | {default} | {_cell(setting.help)} |")
    return "\n".join(lines) + "\n"


def undocumented(registry: Mapping[str, GateDef] | None = None) -> list[str]:
    """What the reference would show without text: gates without ``doc``, keywords without ``doc``, common settings
    without a description."""
    out = []
    for name, gate in _registry(registry).items():
        if not gate.doc.strip():
            out.append(f"{name}: no doc")
        out += [f"{name}({p.name}=...): no doc" for p in gate.params if not p.doc.strip()]
    out += [f"common keyword {key}: no text" for key in COMMON_SETTINGS if key not in _COMMON_TEXT]
    return out


# ------------------------------------------------------------------------------------------ the public Python names

#: The package's folders, bottom to top (the house plan of the package docstring); ``core`` is the root modules.
_LAYERS = ("core", "data", "files", "runtime", "stats", "engines", "scenarios", "report", "gates", "plugin")

#: The engine libraries (``engines/<library>/``): under the family packages, above ``engines/core``.
_ENGINE_LIBRARIES = ("perturb", "bounds")

#: Title and one sentence for each group of the API page that is not an engine family.
_GROUP_TEXT = {
    "core": ("Version, errors and results",
             "The modules at the package's root: the errors every part raises and the records a gate produces."),
    "data": ("Data and tasks", "The three tasks' data forms: detection data, its packed boxes and its collate function."),
    "files": ("Files", "Model and data loading and the checks of what a file holds."),
    "runtime": ("Runtime", "Devices, threads, memory and torchrun ranks."),
    "stats": ("Statistics", "Confidence intervals, bounds and rank statistics."),
    "engines.core": ("Engine core", "The model-output guard and the activation capture the neuron, DeepInspect and "
                     "monitor gates share."),
    "engines.perturb": ("Perturbation library", "The perturbations of the robustness families and the monitor faults."),
    "engines.bounds": ("Certified bounds", "Sound output bounds (IBP and CROWN) of a model, eager or `.pt2`."),
    "scenarios": ("Scenarios", "Operating conditions and the scenario table the coverage and per-scenario gates read."),
    "report": ("Reports", "The terminal, JSON, JUnit and HTML outputs and baselines."),
    "gates": ("Writing gates", "What a `conftest.py` or a plugin uses to add gates of its own (see "
              "[Your own gates](../custom-gates.md))."),
    "plugin": ("The pytest plugin", "Hooks, options and fixtures."),
}

#: Text for public constants whose module has no ``#:`` comment above them.
_CONSTANT_TEXT = {"__version__": "The version of the installed pytest-dnnsafety."}


@dataclasses.dataclass(frozen=True)
class ApiEntry:
    """One public name of the package as the API page shows it."""

    name: str
    kind: str        #: class, dataclass, abstract class, exception, function or constant
    module: str      #: the module that defines it
    group: str       #: the API page's group key (a layer, ``engines.<package>``)
    signature: str   #: how it is called (a class: its constructor), or how it is written (a constant)
    summary: str     #: the first paragraph of its docstring, as Markdown


class _Annotation(str):
    """An annotation kept as a string (``from __future__ import annotations``), shown without quotes."""

    def __repr__(self) -> str:
        return str(self)


def _defining_module(name: str, obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    if inspect.isclass(obj) or inspect.isroutine(obj):
        return str(module)
    import pytest_dnnsafety

    lazy: Mapping[str, str] = getattr(pytest_dnnsafety, "_LAZY", {})
    if name in lazy:
        return lazy[name]
    return "pytest_dnnsafety._version" if name == "__version__" else "pytest_dnnsafety"


def _group(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in _LAYERS:
        return "core"
    if parts[1] == "engines" and len(parts) > 2:
        return f"engines.{parts[2]}"
    return parts[1]


def _group_order(group: str) -> tuple[int, int, str]:
    layer, _, package = group.partition(".")
    if layer != "engines":
        return (_LAYERS.index(layer), 0, "")
    order = ["core", *_ENGINE_LIBRARIES, *_family_pages()]
    return (_LAYERS.index("engines"), order.index(package) if package in order else len(order), package)


def _group_heading(group: str) -> tuple[str, str]:
    if group in _GROUP_TEXT:
        return _GROUP_TEXT[group]
    package = group.partition(".")[2]
    pages = _family_pages()
    if package in pages:
        return (f"Engines: {package}", f"The engines of the [{package}](../{pages[package]}) family's gates.")
    return (f"Engines: {package}", f"The engine package `engines/{package}/`.")


def _markdown_text(text: str) -> str:
    """reST inline markup of a docstring as Markdown: roles and double backticks become code spans."""
    text = re.sub(r":[a-z]+:`~?(?:[\w.]+\.)?([\w]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return " ".join(text.split())


def _summary(name: str, obj: Any, module: str) -> str:
    if inspect.isclass(obj) or inspect.isroutine(obj):
        doc = inspect.getdoc(obj) or ""
    else:
        doc = _comment_doc(name, module) or _CONSTANT_TEXT.get(name, "")
    return _markdown_text(doc.strip().split("\n\n", 1)[0]) if doc.strip() else ""


def _comment_doc(name: str, module: str) -> str:
    """The ``#:`` comment lines right above ``name = ...`` (or ``name: T = ...``) in ``module``'s source."""
    try:
        lines = inspect.getsource(importlib.import_module(module)).splitlines()
    except (OSError, TypeError, ImportError):
        return ""
    for index, line in enumerate(lines):
        if re.match(rf"{re.escape(name)}\s*[:=]", line):
            comment: list[str] = []
            for above in reversed(lines[:index]):
                if not above.startswith("#:"):
                    break
                comment.insert(0, above[2:].strip())
            return " ".join(comment)
    return ""


def _kind(obj: Any) -> str:
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return "exception"
        if inspect.isabstract(obj):
            return "abstract class"
        return "dataclass" if dataclasses.is_dataclass(obj) else "class"
    if inspect.isroutine(obj):
        return "function"
    return "constant"


def _signature(name: str, obj: Any) -> str:
    """How ``obj`` is called (one parameter a line when long), without memory addresses; a constant: ``NAME``."""
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        bases = ", ".join(base.__name__ for base in obj.__bases__)
        return f"class {name}({bases})"
    if not (inspect.isclass(obj) or inspect.isroutine(obj)):
        return name
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return f"{name}(...)"
    params = [p.replace(annotation=_Annotation(p.annotation)) if isinstance(p.annotation, str) else p
              for p in signature.parameters.values()]
    returns = signature.return_annotation
    if inspect.isclass(obj) or returns is inspect.Signature.empty:
        tail = ""
    else:
        tail = f" -> {returns}" if isinstance(returns, str) else f" -> {inspect.formatannotation(returns)}"
    shown = _with_markers([str(p) for p in params], params)
    one_line = f"{name}({', '.join(shown)}){tail}"
    text = one_line if len(one_line) <= 100 else f"{name}(\n" + "".join(f"    {s},\n" for s in shown) + f"){tail}"
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def _with_markers(shown: list[str], params: Sequence[inspect.Parameter]) -> list[str]:
    """Insert ``/`` after positional-only and ``*`` before keyword-only parameters, as ``str(signature)`` does."""
    out: list[str] = []
    kinds = [p.kind for p in params]
    for index, (text, kind) in enumerate(zip(shown, kinds)):
        if kind is inspect.Parameter.KEYWORD_ONLY and (index == 0 or kinds[index - 1] not in (
                inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_POSITIONAL)):
            out.append("*")
        out.append(text)
        if kind is inspect.Parameter.POSITIONAL_ONLY and (index + 1 == len(kinds)
                                                            or kinds[index + 1] is not inspect.Parameter.POSITIONAL_ONLY):
            out.append("/")
    return out


def api_entries(names: Sequence[str] | None = None) -> list[ApiEntry]:
    """One :class:`ApiEntry` per public name (``pytest_dnnsafety.__all__`` by default), in ``__all__`` order."""
    import pytest_dnnsafety

    out = []
    for name in pytest_dnnsafety.__all__ if names is None else names:
        obj = getattr(pytest_dnnsafety, name)
        module = _defining_module(name, obj)
        out.append(ApiEntry(name=name, kind=_kind(obj), module=module, group=_group(module),
                            signature=_signature(name, obj), summary=_summary(name, obj, module)))
    return out


def _anchor(name: str) -> str:
    """The heading id the site and GitHub both give ``### `name```: the name in lower case."""
    return name.lower()


def api_markdown(entries: Sequence[ApiEntry] | None = None) -> str:
    """Markdown: an index of the public names, then one section per group (bottom layer first) with each name's
    kind, defining module, signature and summary."""
    entries = api_entries() if entries is None else list(entries)
    groups: dict[str, list[ApiEntry]] = {}
    for entry in entries:
        groups.setdefault(entry.group, []).append(entry)
    order = sorted(groups, key=_group_order)
    lines = ["| name | kind | group |", "|---|---|---|"]
    for group in order:
        title = _group_heading(group)[0]
        lines += [f"| [`{e.name}`](#{_anchor(e.name)}) | {e.kind} | {title} |" for e in groups[group]]
    lines.append("")
    for group in order:
        title, text = _group_heading(group)
        lines += [f"## {title}", "", text, ""]
        for entry in groups[group]:
            lines += [f"### `{entry.name}`", "", f"*{entry.kind}* in `{entry.module}`", "",
                      "```python", entry.signature, "```", ""]
            if entry.summary:
                lines += [entry.summary, ""]
    return "\n".join(lines)


def undocumented_api(entries: Sequence[ApiEntry] | None = None) -> list[str]:
    """Public names the API page would show without a summary (the test suite requires none)."""
    return [f"{e.name}: no docstring" for e in (api_entries() if entries is None else entries) if not e.summary]


# ------------------------------------------------------------------------- the committed pages and their regions

#: What fills each generated region: ``<!-- generated: NAME ... -->`` ... ``<!-- end generated: NAME -->``.
GENERATED: dict[str, Callable[[], str]] = {
    "markers": lambda: markers_markdown(),
    "settings": lambda: settings_markdown(),
    "api": lambda: api_markdown(),
}

#: The committed reference pages (``docs/reference/<page>``) and the regions each must hold.
REFERENCE_PAGES: dict[str, tuple[str, ...]] = {"markers.md": ("markers",), "settings.md": ("settings",),
                                              "api.md": ("api",)}

#: The command (from the repository root) that regenerates the committed pages.
REGENERATE = "python -m pytest_dnnsafety.plugin.reference --write docs/reference"

_REGION = re.compile(r"<!-- generated: (?P<name>\w+)(?P<note>[^>]*?)-->(?P<body>.*?<!-- end generated: (?P=name) -->)?",
                     re.DOTALL)


def fill_generated(text: str, generators: Mapping[str, Callable[[], str]] | None = None) -> str:
    """``text`` with every generated region refilled from the code (a bare start comment gets its region).

    Each region's text is generated once per call. An unknown region name is a ``ValueError`` naming it.
    """
    generators = GENERATED if generators is None else generators
    made: dict[str, str] = {}

    def refill(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in generators:
            raise ValueError(f"generated region {name!r}: unknown (known: {', '.join(sorted(generators))})")
        if name not in made:
            made[name] = generators[name]().strip("\n")
        return (f"<!-- generated: {name}; do not edit, regenerate with: {REGENERATE} -->\n\n{made[name]}\n\n"
                f"<!-- end generated: {name} -->")

    return _REGION.sub(refill, text)


def _regions(text: str) -> list[str]:
    return [match.group("name") for match in _REGION.finditer(text)]


def stale_reference(folder: str | Path, generators: Mapping[str, Callable[[], str]] | None = None) -> list[str]:
    """Why the committed pages in ``folder`` differ from what the code generates: one line per page (empty: current)."""
    folder = Path(folder)
    problems = []
    for page, regions in REFERENCE_PAGES.items():
        path = folder / page
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        text = path.read_text(encoding="utf-8")
        missing = [name for name in regions if name not in _regions(text)]
        if missing:
            problems.append(f"{path}: no generated region {', '.join(missing)} "
                            f"(add a line <!-- generated: {missing[0]} --> where it belongs)")
        elif fill_generated(text, generators) != text:
            problems.append(f"{path}: differs from the generated text")
    return problems


def write_reference(folder: str | Path, generators: Mapping[str, Callable[[], str]] | None = None) -> list[Path]:
    """Refill the generated regions of the committed pages in ``folder``; returns the pages that changed.

    A page without one of its regions is a ``ValueError`` (the prose around the regions is hand-written, so
    this never creates a page).
    """
    folder = Path(folder)
    changed = []
    for page, regions in REFERENCE_PAGES.items():
        path = folder / page
        text = path.read_text(encoding="utf-8") if path.is_file() else ""
        missing = [name for name in regions if name not in _regions(text)]
        if missing:
            raise ValueError(f"{path}: no generated region {', '.join(missing)}; "
                             f"add a line <!-- generated: {missing[0]} --> where it belongs")
        new = fill_generated(text, generators)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pytest_dnnsafety.plugin.reference --write|--check FOLDER``: regenerate or check the pages."""
    parser = argparse.ArgumentParser(prog="python -m pytest_dnnsafety.plugin.reference",
                                     description="Regenerate or check the generated reference pages.")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", metavar="FOLDER", help="refill the generated regions of the pages in FOLDER")
    action.add_argument("--check", metavar="FOLDER", help="exit with status 1 when a page in FOLDER is stale")
    args = parser.parse_args(argv)
    if args.write:
        try:
            changed = write_reference(args.write)
        except ValueError as error:
            print(error, file=sys.stderr)
            return 2
        print("\n".join(f"rewrote {path}" for path in changed) or "the reference pages are current")
        return 0
    problems = stale_reference(args.check)
    if problems:
        print("\n".join(problems) + f"\nregenerate with: {REGENERATE}", file=sys.stderr)
        return 1
    print("the reference pages are current")
    return 0


if __name__ == "__main__":  # pragma: no cover - the command line
    sys.exit(main())
