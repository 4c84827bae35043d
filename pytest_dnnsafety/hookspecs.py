"""The hooks pytest-dnnsafety adds to pytest (loaded through ``pytest_addhooks``, as pytest-xdist does).

Implement them in a ``conftest.py`` or in an installed plugin (a ``pytest11`` entry point, or a
module given with ``-p``) with ``@pytest_dnnsafety.hookimpl`` (the same object as ``pytest.hookimpl``)::

    from pytest_dnnsafety import GateDef, Measurement, Param, hookimpl

    @hookimpl
    def pytest_dnnsafety_register_gates(registry):
        registry.add(GateDef(marker="max_calibration_error", ...))

    @hookimpl
    def pytest_dnnsafety_gate_result(result, config):
        post_to_dashboard(result.to_dict())
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from .gates.core import GateRegistry
    from .results import GateResult

__all__ = ["hookspec", "hookimpl", "pytest_dnnsafety_register_gates", "pytest_dnnsafety_gate_result"]

#: ``pluggy.HookspecMarker("pytest")``: the marker of pytest hook specifications.
hookspec = pytest.hookspec

#: ``pluggy.HookimplMarker("pytest")`` (``pytest.hookimpl``): mark implementations of these hooks.
hookimpl = pytest.hookimpl


@hookspec(historic=True)
def pytest_dnnsafety_register_gates(registry: "GateRegistry") -> None:
    """Add gate definitions to this run's registry: ``registry.add(GateDef(...))``.

    Called once per run, in ``pytest_configure``, with every plugin registered by then: the built-in
    gate families, installed plugins, ``-p`` modules and the ``conftest.py`` files pytest loads before
    configuring (the rootdir's and those of the test paths given on the command line). The call is
    *historic*: a plugin registered later (a ``conftest.py`` in a sub-folder, loaded when collection
    reaches it) is called as soon as it registers, and its markers are known from then on, in
    every folder. Register gates used in several folders from the rootdir's ``conftest.py`` or a
    plugin, so that ``--strict-markers`` accepts them in any module.

    A marker name registered twice is a usage error naming both sources; a malformed ``GateDef``
    (marker not an identifier, op other than ``>=``/``<=``, bad threshold range, untyped params) is
    a usage error naming the problem.
    """


@hookspec
def pytest_dnnsafety_gate_result(result: "GateResult", config: pytest.Config) -> None:
    """Act on one gate's final result (e.g. post it to a dashboard).

    Called exactly once per gate of the run, on the process that writes the reports (the only
    process without pytest-xdist, the controller with it; never on a worker), at the end of the
    session after the JSON evidence and the JUnit file are written: measured gates, errors, gates
    that were not evaluated and lost gates alike. ``result`` is a
    :class:`~pytest_dnnsafety.results.GateResult` (``result.to_dict()`` gives the JSON evidence row);
    treat it as read-only.
    """
