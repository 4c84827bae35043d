"""Gate markers: the mechanism (:mod:`.core`, :mod:`.evaluation`) and one module per built-in family.

Each family module (:mod:`.coverage`, :mod:`.neurons`, :mod:`.reliability`,
:mod:`.robustness`, :mod:`.performance`, :mod:`.confusion`, :mod:`.interpretability`, :mod:`.monitors`,
:mod:`.inspection`, :mod:`.quantification`) is a pytest plugin that
registers its gates through the ``pytest_dnnsafety_register_gates`` hook, exactly as a user's
``conftest.py`` or an installed plugin does. Adding a built-in family is one new module and one line
in :data:`BUILTIN_FAMILIES`; the plugin registers every module listed there.

:data:`GATES` is the process-wide registry of the built-in gates (plus any added with the older
:func:`register_gate`); a pytest run uses its own :class:`GateRegistry`, filled by the hook. This
package imports no torch.
"""

from __future__ import annotations

import importlib

from pytest_dnnsafety.gates.core import (  # noqa: F401  - _caller_source: the source of a register_gate call
    COMMON_SETTINGS,
    GATES,
    REGRESSION_KEYWORDS,
    REQUIRED,
    GateContext,
    GateDef,
    GateDefinitionError,
    GateRegistry,
    GateSpec,
    Param,
    check_where,
    in_range,
    is_finite,
    is_interval,
    one_of,
    parse_marker,
    _caller_source,
    resolve_optional,
)
from pytest_dnnsafety.gates.evaluation import context_for, evaluate
from pytest_dnnsafety.gates.reliability import _PMI_METHODS  # noqa: F401  - checked against stats.METHODS by the tests

__all__ = [
    "Param", "GateDef", "GateSpec", "GateContext", "GateRegistry", "GateDefinitionError", "GATES",
    "BUILTIN_FAMILIES", "REQUIRED", "COMMON_SETTINGS", "REGRESSION_KEYWORDS", "parse_marker", "evaluate",
    "context_for", "register_gate", "resolve_optional", "builtin_registry", "in_range", "one_of",
    "check_where", "is_finite", "is_interval",
]

#: The built-in gate families, each a module registering its gates through the hook.
BUILTIN_FAMILIES = (
    "pytest_dnnsafety.gates.coverage",
    "pytest_dnnsafety.gates.neurons",
    "pytest_dnnsafety.gates.reliability",
    "pytest_dnnsafety.gates.robustness",
    "pytest_dnnsafety.gates.performance",
    "pytest_dnnsafety.gates.confusion",
    "pytest_dnnsafety.gates.interpretability",
    "pytest_dnnsafety.gates.monitors",
    "pytest_dnnsafety.gates.inspection",
    "pytest_dnnsafety.gates.quantification",
    "pytest_dnnsafety.gates.detection",
)


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
