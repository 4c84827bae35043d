"""pytest hooks, options, markers and fixtures of pytest-dnnsafety.

Thin glue: settings live in :mod:`.config`, gate definitions in :mod:`.gates`, loading in
:mod:`.loading`, metrics in :mod:`.engines`, rendering in :mod:`.report`. torch is imported only
when a fixture or gate needs it, so a project that never uses the plugin pays nothing.

Roles, as in pytest-cov: every process collects and validates markers; the process that runs a
test evaluates its gates and attaches the results to the test's report as a JSON string (only
plain strings cross pytest-xdist workers); the controller (the only process when xdist is off)
gathers the reports, fails the run when an expected gate never reported, writes the terminal
section, the JSON evidence and the JUnit additions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from .config import SETTINGS, Settings
from .errors import DnnSafetyError
from .gates import GATES, GateSpec, evaluate, parse_marker
from .results import GateResult

_SPECS = pytest.StashKey[list]()
_RESULTS = pytest.StashKey[list]()
_PLUGIN_NAME = "dnnsafety-session"


# ---------------------------------------------------------------------------------- options


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


def pytest_configure(config: pytest.Config) -> None:
    for gate in GATES.values():
        config.addinivalue_line("markers", f"{gate.signature()}: {gate.doc}")
    settings = Settings.from_pytest_config(config)
    try:
        settings.validate_all()
    except DnnSafetyError as exc:
        raise pytest.UsageError(f"pytest-dnnsafety: {exc}") from None
    config.pluginmanager.register(DnnSafetyPlugin(config, settings), _PLUGIN_NAME)


def _plugin(config: pytest.Config) -> "DnnSafetyPlugin":
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
def model(dnnsafety_settings: Settings) -> Any:
    """The model under test, from ``dnnsafety_model``, in eval mode on the configured device.

    Override by defining a ``model`` fixture in ``conftest.py``.
    """
    with _setup_errors("model"):
        from .loading import load_model, resolve_device

        return load_model(dnnsafety_settings, resolve_device(dnnsafety_settings.get("device")))


@pytest.fixture(scope="session")
def dataset(dnnsafety_settings: Settings) -> Any:
    """The labelled evaluation data from ``dnnsafety_data`` as a ``TensorDataset(x, y)``."""
    with _setup_errors("dataset"):
        from .loading import load_dataset

        return load_dataset(dnnsafety_settings)


@pytest.fixture(scope="session")
def scenario_table(dnnsafety_settings: Settings) -> Any:
    """The scenario table from ``dnnsafety_scenarios`` and ``dnnsafety_conditions``."""
    with _setup_errors("scenario_table"):
        from .loading import load_scenario_table

        return load_scenario_table(dnnsafety_settings)


@pytest.fixture(scope="session")
def operational_profile(dnnsafety_settings: Settings) -> Any:
    """The operational profile (a Gaussian KDE) from ``dnnsafety_operational_data``.

    Override in ``conftest.py`` to use a latent space (``OperationalProfile(x, encoder=..., decoder=...)``).
    """
    with _setup_errors("operational_profile"):
        from .loading import load_operational_profile, resolve_device

        return load_operational_profile(dnnsafety_settings, resolve_device(dnnsafety_settings.get("device")))


# ---------------------------------------------------------------------------------- the session


def _not_evaluated(spec: GateSpec, nodeid: str, why: str) -> GateResult:
    gate = spec.definition
    return GateResult(nodeid=nodeid, marker=spec.marker, metric=gate.metric, threshold=spec.threshold,
                      op=gate.op, status="not-evaluated", summary=f"{spec.marker}: not evaluated ({why})")


class DnnSafetyPlugin:
    """Per-run state and the hooks that use it."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.is_worker = hasattr(config, "workerinput")
        self.cache: dict[str, Any] = {}
        self.expected: dict[str, list[str]] = {}
        self.results: dict[str, list[GateResult]] = {}
        self.outcomes: dict[str, str] = {}
        self.lost: list[str] = []
        self.order: dict[str, int] = {}
        self.evidence_path: Path | None = None
        self.environment: dict[str, Any] | None = None

    def pytest_report_header(self, config: pytest.Config) -> str | None:
        configured = [f"{name}={self.settings.get(name).value}" for name in ("model", "data", "scenarios", "device",
                                                                              "seed")
                      if self.settings.get(name).source != "default"]
        return f"dnnsafety: {', '.join(configured)}" if configured else None

    # -- collection: validate every gate marker; a bad one is a collection error of its module

    def _prepare(self, item: pytest.Item) -> list[GateSpec]:
        specs: list[GateSpec] = []
        for mark in item.iter_markers():
            if mark.name not in GATES:
                continue
            specs.append(parse_marker(mark.name, mark.args, mark.kwargs, where=item.nodeid))
        if specs:
            names = getattr(item, "fixturenames", None)
            if names is None:
                raise DnnSafetyError(f"{item.nodeid}: gate markers work on Python test functions only.")
            for spec in specs:
                for fixture in spec.fixtures.values():
                    if fixture not in names:
                        names.append(fixture)
        item.stash[_SPECS] = specs
        return specs

    @pytest.hookimpl(wrapper=True)
    def pytest_make_collect_report(self, collector: pytest.Collector) -> Iterator[Any]:
        report = yield
        if report.passed and report.result:
            errors = []
            for node in report.result:
                if isinstance(node, pytest.Item):
                    try:
                        self._prepare(node)
                    except DnnSafetyError as exc:
                        errors.append(str(exc))
            if errors:
                report.outcome = "failed"
                report.longrepr = "pytest-dnnsafety: invalid gate marker(s):\n" + "\n".join(errors)
                report.result = []
        return report

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        if not self.order:  # every worker collects the same ids
            self.order = {nodeid: i for i, nodeid in enumerate(ids)}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.order = {item.nodeid: i for i, item in enumerate(items)}
        plan: dict[tuple[str, str], set[str]] = {}
        for item in items:
            # Markers added after collection (item.add_marker in a conftest) are validated here too;
            # items whose gates were all parsed at collection are not parsed again.
            marks = sum(m.name in GATES for m in item.iter_markers())
            if _SPECS not in item.stash or marks != len(item.stash[_SPECS]):
                try:
                    self._prepare(item)
                except DnnSafetyError as exc:
                    raise pytest.UsageError(f"pytest-dnnsafety: {exc}") from None
            for spec in item.stash[_SPECS]:
                if "layer" in spec.options and "model" in spec.fixtures and "data" in spec.fixtures:
                    plan.setdefault((spec.fixtures["model"], spec.fixtures["data"]), set()).add(spec.options["layer"])
        # Every layer the session's gates need from one (model, data) pair is captured in one pass.
        self.cache["layer_plan"] = {pair: tuple(sorted(layers)) for pair, layers in plan.items()}

    # -- running: gates are evaluated after the test body passed

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[Any]:
        specs = item.stash.get(_SPECS, None)
        if not specs:
            return (yield)
        try:
            outcome = yield
        except BaseException as exc:
            why = "test skipped" if isinstance(exc, pytest.skip.Exception) else "test body failed"
            item.stash[_RESULTS] = [_not_evaluated(spec, item.nodeid, why) for spec in specs]
            raise
        funcargs = getattr(item, "funcargs", {})
        results = [
            evaluate(spec, {role: funcargs[name] for role, name in spec.fixtures.items()},
                     self.settings, item.nodeid, self.cache)
            for spec in specs
        ]
        item.stash[_RESULTS] = results
        bad = [r for r in results if r.status != "passed"]
        if bad:
            pytest.fail("\n".join(r.summary for r in bad), pytrace=False)
        return outcome

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
        report = yield
        specs = item.stash.get(_SPECS, None)
        if specs:
            if call.when == "setup":
                report.dnnsafety_expected = json.dumps([s.marker for s in specs])
            elif call.when == "call":
                results = item.stash.get(_RESULTS, [])
                report.dnnsafety_gates = json.dumps([r.to_dict() for r in results])
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        expected = getattr(report, "dnnsafety_expected", None)
        if expected is not None:
            self.expected[report.nodeid] = json.loads(expected)
        gates = getattr(report, "dnnsafety_gates", None)
        if gates is not None:
            self.results[report.nodeid] = [GateResult.from_dict(d) for d in json.loads(gates)]
        if report.nodeid in self.expected:
            if report.failed:
                self.outcomes[report.nodeid] = "failed"
            elif report.skipped:
                self.outcomes.setdefault(report.nodeid, "skipped")
            elif report.when == "call":
                self.outcomes.setdefault(report.nodeid, "passed")

    # -- the controller's end of the run

    def all_results(self) -> list[GateResult]:
        """Every gate of the run, with a not-evaluated row for each gate that never reported."""
        rows: list[GateResult] = []
        # Collection order, whatever order xdist workers reported in.
        ordered = sorted(self.expected.items(), key=lambda kv: (self.order.get(kv[0], len(self.order)), kv[0]))
        for nodeid, markers in ordered:
            got = self.results.get(nodeid)
            if got:
                rows.extend(got)
                continue
            outcome = self.outcomes.get(nodeid)
            why = {"failed": "setup failed", "skipped": "test skipped"}.get(outcome or "", "never reported")
            for marker in markers:
                gate = GATES[marker]
                rows.append(GateResult(nodeid=nodeid, marker=marker, metric=gate.metric, threshold=float("nan"),
                                       op=gate.op, status="not-evaluated",
                                       summary=f"{marker}: not evaluated ({why})"))
        return rows

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.is_worker or not self.expected:
            return
        from . import report

        self.lost = [nodeid for nodeid in self.expected
                     if not self.results.get(nodeid) and self.outcomes.get(nodeid) not in ("failed", "skipped")]
        if self.lost and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        rows = self.all_results()
        numprocesses = getattr(self.config.option, "numprocesses", None)
        distributed = getattr(self.config.option, "dist", "no") != "no"
        workers = numprocesses if distributed and isinstance(numprocesses, int) else 0
        self.environment = report.environment(self.settings, (r.device for r in rows), workers)
        json_setting = self.settings.get("json")
        if json_setting.value is not None:
            self.evidence_path = report.write_evidence(
                self.settings.path(json_setting), report.build_evidence(rows, self.environment, self.lost))
        xmlpath = getattr(self.config.option, "xmlpath", None)
        if xmlpath and Path(xmlpath).is_file():
            env = self.environment
            props = {
                "dnnsafety.version": env["pytest_dnnsafety"],
                "dnnsafety.torch": env["torch"] or "not installed",
                "dnnsafety.device": env["device"],
                "dnnsafety.seed": env["seed"],
                "dnnsafety.gates": len(rows),
                "dnnsafety.gates_passed": sum(r.status == "passed" for r in rows),
                "dnnsafety.gates_failed": sum(r.status in ("failed", "error") for r in rows),
                "dnnsafety.gates_lost": len(self.lost),
            }
            report.patch_junit(Path(xmlpath), rows, props,
                               testcase_properties=bool(self.settings.value("junit_properties")),
                               prefix=getattr(self.config.option, "junitprefix", None))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.is_worker or not self.expected or self.environment is None:
            return
        from .report import header_line, render_table

        tr = terminalreporter
        rows = self.all_results()
        tr.write_sep("=", "dependability gates")
        tr.write_line(header_line(self.environment))
        for text, markup in render_table(rows):
            tr.write_line(text, **markup)
        for r in rows:
            if r.status in ("failed", "error"):
                tr.write_line(f"  {r.nodeid}: {r.summary}", red=True)
        if self.lost:
            tr.write_line(f"{len(self.lost)} gated test(s) never reported a result (crashed worker?); "
                          "the run fails: " + ", ".join(self.lost), red=True, bold=True)
        if self.evidence_path is not None:
            tr.write_line(f"dependability evidence written to {self.evidence_path}")
