"""pytest hooks, options, markers and fixtures of pytest-dnnsafety.

Thin glue: settings live in :mod:`pytest_dnnsafety.settings`, the gate mechanism and the built-in gate families
in :mod:`pytest_dnnsafety.gates`, the plugin's own hooks in :mod:`pytest_dnnsafety.gates.hookspecs`, the per-run
state (plan, results, provenance; one class per process role) in :mod:`.session`, the fixture loaders in
:mod:`.fixtures` and :mod:`pytest_dnnsafety.files.loading`, metrics in :mod:`pytest_dnnsafety.engines`,
rendering in :mod:`pytest_dnnsafety.report`. torch is imported only when a fixture or gate needs it, so a project
that never uses the plugin pays nothing.

Gate markers come from the ``pytest_dnnsafety_register_gates`` hook: the built-in family modules
(:data:`pytest_dnnsafety.gates.BUILTIN_FAMILIES`) are registered as plugins in
``pytest_addhooks``, and every implementation (those, ``conftest.py`` files, ``-p`` modules,
installed plugins) fills this run's registry in ``pytest_configure``.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from pytest_dnnsafety.settings import SETTINGS, Settings
from pytest_dnnsafety.errors import DnnSafetyError
from pytest_dnnsafety.gates import BUILTIN_FAMILIES, GATES, GateDef, GateRegistry
from pytest_dnnsafety.plugin.session import PLUGIN_FIXTURE_SETTINGS, DnnSafetyPlugin, make_session

__all__ = ["PLUGIN_FIXTURE_SETTINGS", "DnnSafetyPlugin", "registry"]

_PLUGIN_NAME = "dnnsafety-session"
_REGISTRY = pytest.StashKey[GateRegistry]()


# ---------------------------------------------------------------------------------- hooks and options


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_dnnsafety.gates import hookspecs

    pluginmanager.add_hookspecs(hookspecs)
    for name in BUILTIN_FAMILIES:  # each family registers its gates through the hook, like any plugin
        if not pluginmanager.has_plugin(name):
            pluginmanager.register(importlib.import_module(name), name)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dnnsafety", "dependability gates (pytest-dnnsafety)")
    for setting in SETTINGS.values():
        # Declared as strings and parsed by config.py, so a bad value's error names its source.
        parser.addini(setting.ini, f"{setting.help} [{setting.kind}; env {setting.env}]", type="string",
                      default="")
        if setting.kind == "bool":
            group.addoption(setting.cli, dest=setting.dest, default=None, nargs="?", const="true",
                            metavar="true|false", help=setting.help)
        else:
            group.addoption(setting.cli, dest=setting.dest, default=None, metavar=setting.name.upper(),
                            help=setting.help)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """torchrun: refuse pytest-xdist, and let only rank 0 write JUnit (before junitxml's configure reads it).

    Ranks other than 0 also run quieter (one ``-q`` less): their tests' outcomes repeat rank 0's.
    """
    from pytest_dnnsafety.runtime import torchrun as ranks

    if not ranks.launched():
        return None
    option = config.option
    if getattr(option, "numprocesses", None) or getattr(option, "dist", "no") != "no":
        raise pytest.UsageError(
            "pytest-dnnsafety: torchrun and pytest-xdist (-n/--dist) cannot be combined: torchrun's ranks already "
            "split the gates' work and must run the same tests in the same order. Fix: drop -n/--dist under "
            "torchrun, or run pytest -n N without torchrun")
    if not ranks.is_main():
        option.xmlpath = None  # one JUnit file per run, from rank 0
        option.verbose = min(int(getattr(option, "verbose", 0) or 0), 0) - 1
    return None


def _build_registry(config: pytest.Config) -> GateRegistry:
    """This run's gates: every ``pytest_dnnsafety_register_gates`` implementation, then :func:`register_gate` ones.

    Each gate's marker is registered as it is added (``--strict-markers``), also for a plugin
    registered later (a sub-folder's ``conftest.py``): the hook is historic.
    """

    def add_marker(gate: GateDef) -> None:
        config.addinivalue_line("markers", f"{gate.signature()}: {gate.doc}")

    registry = GateRegistry(on_add=add_marker)
    try:
        config.hook.pytest_dnnsafety_register_gates.call_historic(kwargs={"registry": registry})
        for name, gate in GATES.items():  # the older register_gate() at conftest import time
            if registry.get(name) is not gate:
                registry.add(gate, source=GATES.source(name))
    except DnnSafetyError as exc:
        raise pytest.UsageError(f"pytest-dnnsafety: {exc}") from None
    return registry


def _check_hook_names(config: pytest.Config) -> None:
    """A ``pytest_dnnsafety_*`` implementation of no hook of this plugin (a misspelling) is a usage error.

    ``pytest_dnnsafety.hookimpl`` marks these implementations optional (so a conftest works with
    ``-p no:dnnsafety``), which stops pytest from reporting unknown ones: the plugin does it here,
    for the plugins and ``conftest.py`` files registered by now.
    """
    from pytest_dnnsafety.gates.hookspecs import HOOK_PREFIX

    hook = config.pluginmanager.hook
    for name in sorted(vars(hook)):
        caller = getattr(hook, name)
        if name.startswith(HOOK_PREFIX) and hasattr(caller, "has_spec") and not caller.has_spec():
            sources = ", ".join(sorted({str(getattr(impl.plugin, "__file__", impl.plugin_name))
                                        for impl in caller.get_hookimpls()}))
            known = ", ".join(n for n in sorted(vars(hook)) if n.startswith(HOOK_PREFIX) and
                              getattr(getattr(hook, n), "has_spec", lambda: False)())
            raise pytest.UsageError(
                f"pytest-dnnsafety: unknown hook {name!r} in {sources}: pytest-dnnsafety has no such hook. "
                f"Fix: rename it to one of {known}")


def pytest_configure(config: pytest.Config) -> None:
    _check_hook_names(config)
    registry = config.stash[_REGISTRY] = _build_registry(config)
    settings = Settings.from_pytest_config(config)
    try:
        settings.validate_all()
    except DnnSafetyError as exc:
        raise pytest.UsageError(f"pytest-dnnsafety: {exc}") from None
    # This process's role (one process, xdist controller or worker, torchrun rank), decided once.
    config.pluginmanager.register(make_session(config, settings, registry), _PLUGIN_NAME)


def registry(config: pytest.Config) -> GateRegistry:
    """The gate registry of a configured run."""
    return config.stash[_REGISTRY]


def _plugin(config: pytest.Config) -> DnnSafetyPlugin:
    return config.pluginmanager.get_plugin(_PLUGIN_NAME)


# ---------------------------------------------------------------------------------- fixtures


class _setup_errors:
    """Turn a DnnSafetyError in a fixture into a clean setup error (no plugin traceback)."""

    def __init__(self, fixture: str) -> None:
        self.fixture = fixture

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if exc is not None and isinstance(exc, DnnSafetyError):
            pytest.fail(f"fixture {self.fixture!r}: {exc}", pytrace=False)
        return False


@pytest.fixture(scope="session")
def dnnsafety_settings(pytestconfig: pytest.Config) -> Settings:
    """The resolved pytest-dnnsafety settings (marker > CLI > env > ini > default)."""
    return _plugin(pytestconfig).settings


@pytest.fixture(scope="session")
def model(dnnsafety_settings: Settings, request: pytest.FixtureRequest) -> Any:
    """The model under test, from ``dnnsafety_model``, in eval mode on the configured device; with
    ``dnnsafety_predictions`` set, the recorded predictions on ``dataset`` standing in for it (holding the model
    when ``dnnsafety_model`` is set too).

    Override by defining a ``model`` fixture in ``conftest.py``.
    """
    with _setup_errors("model"):
        from pytest_dnnsafety.plugin.fixtures import load_model_or_predictions
        from pytest_dnnsafety.runtime.devices import resolve_device

        return load_model_or_predictions(dnnsafety_settings, resolve_device(dnnsafety_settings.get("device")),
                                         lambda: request.getfixturevalue("dataset"))


@pytest.fixture(scope="session")
def dataset(dnnsafety_settings: Settings) -> Any:
    """The labelled evaluation data from ``dnnsafety_data`` as a ``TensorDataset(x, y)``."""
    with _setup_errors("dataset"):
        from pytest_dnnsafety.files.loading import load_dataset

        return load_dataset(dnnsafety_settings)


@pytest.fixture(scope="session")
def masks(dnnsafety_settings: Settings) -> Any:
    """Per-input segmentation masks from ``dnnsafety_masks`` as a ``(N, H, W)`` bool tensor, aligned with ``dataset``."""
    with _setup_errors("masks"):
        from pytest_dnnsafety.plugin.fixtures import load_masks

        return load_masks(dnnsafety_settings)


@pytest.fixture(scope="session")
def severity_matrix() -> Any:
    """The severity matrix of ``max_weighted_confusion`` when the marker gives no ``severity=``: define it."""
    with _setup_errors("severity_matrix"):
        from pytest_dnnsafety.errors import ConfigError

        raise ConfigError(
            "no severity matrix: the max_weighted_confusion marker gives no severity= and conftest.py defines no "
            "`severity_matrix` fixture. Fix: give severity='severity.toml' (a TOML or CSV file relative to the "
            "rootdir) or severity={'true': {'predicted': weight}}, or define a `severity_matrix` fixture returning "
            "a SeverityMatrix, a file path, a dict or a K×K tensor.")


@pytest.fixture(scope="session")
def monitor_data(dnnsafety_settings: Settings) -> Any:
    """In-distribution data that runtime monitors are fitted and calibrated on, from ``dnnsafety_monitor_data``."""
    with _setup_errors("monitor_data"):
        from pytest_dnnsafety.files.loading import load_dataset

        return load_dataset(dnnsafety_settings, "monitor_data", "monitor fitting data")


@pytest.fixture(scope="session")
def ood_data(dnnsafety_settings: Settings) -> Any:
    """Inputs of classes the model never saw (the monitors' ``novel`` fault family), from ``dnnsafety_ood_data``."""
    with _setup_errors("ood_data"):
        from pytest_dnnsafety.files.loading import load_dataset

        return load_dataset(dnnsafety_settings, "ood_data", "novel-class data")


@pytest.fixture(scope="session")
def monitors() -> Any:
    """The runtime monitors the monitor gates can name: ``{"msp": MSP(), "odin": ODIN(), "energy": Energy(),
    "detection_score": DetectionScore()}`` (the last for detectors).

    Override in ``conftest.py`` to configure them or add feature-based ones, e.g.
    ``{"energy": Energy(), "oob": OutsideTheBox(layer="classifier.1", clusters=3, enlarge=0.1)}``. Gates fit
    each monitor they use once per session on ``monitor_data``.
    """
    with _setup_errors("monitors"):
        from pytest_dnnsafety.engines.monitors import MSP, ODIN, DetectionScore, Energy

        return {"msp": MSP(), "odin": ODIN(), "energy": Energy(), "detection_score": DetectionScore()}


@pytest.fixture(scope="session")
def fault_data(pytestconfig: pytest.Config, dataset: Any, dnnsafety_settings: Settings) -> Any:
    """``fault_data(family, severity=3)``: ``dataset`` under a fault family as a ``TensorDataset``.

    The same seeded data the monitor gates use (shared through the session cache), e.g.
    ``fault_data("gaussian_noise", 3)``; adversarial families also need ``model=``.
    """
    from pytest_dnnsafety.gates.core import GateContext
    from pytest_dnnsafety.gates.shared import activation_cache
    from pytest_dnnsafety.runtime.devices import resolve_device

    cache = _plugin(pytestconfig).cache
    seed = dnnsafety_settings.get("seed").value
    batch_size = dnnsafety_settings.get("batch_size").value
    device = str(resolve_device(dnnsafety_settings.get("device")))

    def make(family: str, severity: int = 3, *, model: Any = None, clip: Any = (0.0, 1.0)) -> Any:
        with _setup_errors("fault_data"):
            from pytest_dnnsafety.engines.monitors.session import MonitorSession

            ctx = GateContext(settings=None, seed=seed, device=device,  # type: ignore[arg-type]
                              batch_size=batch_size, cache=cache)
            session = MonitorSession(ctx.memo, activation_cache(ctx), seed=seed, batch_size=batch_size, device=device)
            return session.fault_set(dataset, family, severity, model=model, clip=clip)

    return make


@pytest.fixture(scope="session")
def scenario_table(dnnsafety_settings: Settings) -> Any:
    """The scenario table from ``dnnsafety_scenarios`` and ``dnnsafety_conditions``."""
    with _setup_errors("scenario_table"):
        from pytest_dnnsafety.plugin.fixtures import load_scenario_table

        return load_scenario_table(dnnsafety_settings)


@pytest.fixture(scope="session")
def operational_profile(dnnsafety_settings: Settings) -> Any:
    """The operational profile (a Gaussian KDE) from ``dnnsafety_operational_data``.

    Override in ``conftest.py`` to use a latent space (``OperationalProfile(x, encoder=..., decoder=...)``).
    """
    with _setup_errors("operational_profile"):
        from pytest_dnnsafety.plugin.fixtures import load_operational_profile
        from pytest_dnnsafety.runtime.devices import resolve_device

        return load_operational_profile(dnnsafety_settings, resolve_device(dnnsafety_settings.get("device")))


