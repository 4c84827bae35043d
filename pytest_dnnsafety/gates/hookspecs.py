"""The hooks pytest-dnnsafety adds to pytest (loaded through ``pytest_addhooks``, as pytest-xdist does).

Implement them in a ``conftest.py`` or in an installed plugin (a ``pytest11`` entry point, or a
module given with ``-p``) with ``@pytest_dnnsafety.hookimpl`` (``pytest.hookimpl`` that marks this
plugin's hooks optional, see :func:`hookimpl`)::

    from pytest_dnnsafety import GateDef, Measurement, Param, hookimpl

    @hookimpl
    def pytest_dnnsafety_register_gates(registry):
        registry.add(GateDef(marker="max_calibration_error", ...))

    @hookimpl
    def pytest_dnnsafety_gate_result(result, config):
        post_to_dashboard(result.to_dict())
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeVar

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from pytest_dnnsafety.gates.core import GateRegistry
    from pytest_dnnsafety.results import GateResult

__all__ = ["hookspec", "hookimpl", "pytest_dnnsafety_register_gates", "pytest_dnnsafety_gate_result"]

#: ``pluggy.HookspecMarker("pytest")``: the marker of pytest hook specifications.
hookspec = pytest.hookspec

_F = TypeVar("_F", bound=Callable[..., Any])

#: The prefix of this plugin's hook names: implementations of them are optional hooks.
HOOK_PREFIX = "pytest_dnnsafety_"


def hookimpl(function: "_F | None" = None, *, hookwrapper: bool = False, optionalhook: "bool | None" = None,
             tryfirst: bool = False, trylast: bool = False, specname: "str | None" = None,
             wrapper: bool = False) -> Any:
    """``pytest.hookimpl`` (same arguments, ``@hookimpl`` and ``@hookimpl(...)``) for this plugin's hooks.

    The one difference: ``optionalhook`` defaults to True for a hook named ``pytest_dnnsafety_*``
    (the function's name, or ``specname``), the way pytest plugins mark their implementations of
    another plugin's hooks. Without it a ``conftest.py`` that registers gates ends pytest in an
    INTERNALERROR (``unknown hook 'pytest_dnnsafety_register_gates'``) whenever the plugin is not
    loaded (``-p no:dnnsafety``). Other hooks (``pytest_configure`` ...) keep pytest's default, so
    a misspelled pytest hook is still reported. A misspelled ``pytest_dnnsafety_*`` hook is reported by the plugin when it is active (a
    usage error, for the plugins and ``conftest.py`` files registered when pytest configures).
    Implement this plugin's hooks with this marker, not with ``pytest.hookimpl`` or undecorated:
    pytest would then require the hook to exist.
    """

    def mark(func: "_F") -> "_F":
        optional = optionalhook
        if optional is None:
            optional = (specname or getattr(func, "__name__", "")).startswith(HOOK_PREFIX)
        return pytest.hookimpl(func, hookwrapper=hookwrapper, optionalhook=optional, tryfirst=tryfirst,
                               trylast=trylast, specname=specname, wrapper=wrapper)

    return mark if function is None else mark(function)


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
