"""Gate markers: the mechanism (:mod:`.core`, :mod:`.evaluation`, :mod:`.family`) and one module per family.

Each family module (:mod:`.coverage`, :mod:`.neurons`, :mod:`.reliability`,
:mod:`.robustness`, :mod:`.performance`, :mod:`.confusion`, :mod:`.interpretability`, :mod:`.monitors`,
:mod:`.inspection`, :mod:`.quantification`, :mod:`.detection`) declares itself once, ``FAMILY =
Family(...)``, and is a pytest plugin that registers that family through the
``pytest_dnnsafety_register_gates`` hook, exactly as a user's ``conftest.py`` or an installed plugin
does. :data:`BUILTIN_FAMILIES` is derived: the modules of this package that declare a ``FAMILY``, in
their ``order``; the plugin registers every one. Adding a built-in family is one new module.

:data:`GATES` is the process-wide registry of the built-in gates (plus any added with the older
:func:`register_gate`); a pytest run uses its own :class:`GateRegistry`, filled by the hook. This
package imports no torch.
"""

from __future__ import annotations

import importlib
import pkgutil

from pytest_dnnsafety.gates.core import COMMON_SETTINGS, GATES, REGRESSION_KEYWORDS, REQUIRED, GateContext, GateDef, GateDefinitionError, GateRegistry, GateSpec, Param, parse_marker, _caller_source, resolve_optional
from pytest_dnnsafety.gates.checks import check_where, in_range, is_finite, is_interval, one_of
from pytest_dnnsafety.gates.evaluation import context_for, evaluate
from pytest_dnnsafety.gates.family import Family
from pytest_dnnsafety.gates.reliability import _PMI_METHODS  # noqa: F401  - checked against stats.METHODS by the tests

__all__ = [
    "Param", "GateDef", "GateSpec", "GateContext", "GateRegistry", "GateDefinitionError", "GATES", "Family",
    "BUILTIN_FAMILIES", "REQUIRED", "COMMON_SETTINGS", "REGRESSION_KEYWORDS", "parse_marker", "evaluate",
    "context_for", "register_gate", "resolve_optional", "builtin_registry", "in_range", "one_of",
    "check_where", "is_finite", "is_interval",
]


def _declared_families() -> tuple[str, ...]:
    """The modules of this package that declare a ``FAMILY`` (a :class:`Family`), by its ``order``, then name."""
    found: list[tuple[int, str, str]] = []
    for info in pkgutil.iter_modules(__path__, f"{__name__}."):
        family = getattr(importlib.import_module(info.name), "FAMILY", None)
        if isinstance(family, Family):
            if f"{__name__}.{family.name}" != info.name:
                raise GateDefinitionError(f"{info.name} declares the family {family.name!r}: a built-in family's "
                                          "module is named by its one word. Fix: rename one of them")
            found.append((family.order, family.name, info.name))
    return tuple(module for _, _, module in sorted(found))


#: The built-in gate families: the modules of this package declaring a ``FAMILY``, each registering it
#: through the hook (derived: adding a built-in family is adding its module).
BUILTIN_FAMILIES = _declared_families()


def builtin_registry(registry: GateRegistry | None = None) -> GateRegistry:
    """A fresh registry (or ``registry``) holding the built-in gates (what a run registers before any user plugin)."""
    registry = GateRegistry() if registry is None else registry
    for name in BUILTIN_FAMILIES:
        importlib.import_module(name).pytest_dnnsafety_register_gates(registry=registry)
    return registry


# The built-in gates by marker name (and gates added with :func:`register_gate`): core.GATES, filled here.
builtin_registry(GATES)


def register_gate(gate: GateDef, *, replace: bool = False) -> GateDef:
    """Add a gate marker to :data:`GATES` from a ``conftest.py`` at import time (before ``pytest_configure``).

    Kept for compatibility; prefer the ``pytest_dnnsafety_register_gates`` hook. A marker that is
    already defined is an error unless ``replace=True`` (for tests that register the same gate in
    several runs). Each run adds the gates of :data:`GATES` that its hook did not register.
    """
    problems = gate.problems() if isinstance(gate, GateDef) else ["not a GateDef"]
    if problems:
        raise GateDefinitionError(f"gate {getattr(gate, 'marker', gate)!r} is malformed: " + "; ".join(problems))
    if gate.marker in GATES and GATES[gate.marker] is not gate and not replace:
        raise GateDefinitionError(f"gate marker {gate.marker!r} is already registered; pass replace=True to "
                                  "redefine it")
    GATES[gate.marker] = gate
    GATES._sources[gate.marker] = _caller_source(2)
    return gate
