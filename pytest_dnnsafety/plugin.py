"""pytest hooks, options, markers and fixtures of pytest-dnnsafety.

Thin glue: settings live in :mod:`.config`, gate definitions in :mod:`.gates`, loading in
:mod:`.loading`, metrics in :mod:`.engines`, rendering in :mod:`.report`. torch is imported only
when a fixture or gate needs it, so a project that never uses the plugin pays nothing.

Roles, as in pytest-cov: every process collects and validates markers; the process that runs a
test evaluates its gates and attaches the results to the test's report as a JSON string (only
plain strings cross pytest-xdist workers); the controller (the only process when xdist is off)
gathers the reports, fails the run when an expected gate never reported, writes the terminal
section, the JSON evidence and the JUnit additions.

The controller knows every gate before it runs: without xdist from its own collection, with xdist
from the gate plan (nodeid -> marker, metric, op, threshold) that each worker attaches, as a JSON
string, to the first report it sends. A test that started but never finished on a worker that
died is *lost*; a test the run never reached (``-x``) is *not evaluated*.

Each fixture that a gate reads is fingerprinted right after it is set up (see :mod:`.provenance`),
so the evidence names what was evaluated even when ``conftest.py`` overrides a fixture.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

from .config import SETTINGS, Settings
from .errors import DnnSafetyError
from .gates import GATES, GateSpec, evaluate, parse_marker, resolve_optional
from .results import STATUSES, GateResult

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

#: The plugin's own fixtures and the settings each one loads from (for the evidence's ``inputs``).
PLUGIN_FIXTURE_SETTINGS = {
    "model": ("model", "model_factory"),
    "dataset": ("data",),
    "scenario_table": ("scenarios", "conditions"),
    "operational_profile": ("operational_data",),
}


def _unwrapped(func: Any) -> Any:
    getter = getattr(func, "_get_wrapped_function", None)
    return getter() if callable(getter) else func


def _is_plugin_fixture(fixturedef: Any) -> bool:
    return getattr(_unwrapped(fixturedef.func), "__module__", None) == __name__


def _fixturedef(item: pytest.Item, name: str) -> Any:
    """The FixtureDef that gives ``item`` its fixture ``name`` (the most specific one), or None."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get(name) if info is not None else None
    if not defs:
        defs = item.session._fixturemanager.getfixturedefs(name, item)
    return defs[-1] if defs else None


def _row(entry: dict[str, Any], nodeid: str, status: str, why: str, **details: Any) -> GateResult:
    """A gate that has no measured result (not evaluated, lost, or an error before it ran)."""
    word = {"not-evaluated": "not evaluated", "lost": "lost", "error": "error"}[status]
    return GateResult(nodeid=nodeid, marker=entry["marker"], metric=entry["metric"], threshold=entry["threshold"],
                      op=entry["op"], status=status, summary=f"{entry['marker']}: {word} ({why})",
                      details={"reason": why, **details})


def _longrepr_line(report: pytest.TestReport) -> str:
    """One line saying why a test was skipped or its setup failed."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(getattr(longrepr, "reprcrash", None), "message", None)
    text = str(crash if crash is not None else (longrepr or "")).strip()
    return text.splitlines()[-1] if text else ""


class DnnSafetyPlugin:
    """Per-run state and the hooks that use it.

    The controller's view of each gated test: ``plan`` (nodeid -> the gates' marker, metric, op and
    threshold, known at collection: from this process's collection, or from the first report of
    each xdist worker), ``results`` (the gate results a worker attached to a report), ``started`` /
    ``finished`` (logstart / logfinish) and ``crashed`` (xdist's crash report, ``when == "???"``).
    From those :meth:`all_results` gives every planned gate a verdict: measured, ``lost`` (a worker
    died, or the results never arrived) or ``not-evaluated`` (the run stopped before the test).
    """

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.is_worker = hasattr(config, "workerinput")
        self.cache: dict[str, Any] = {}
        self.plan: dict[str, list[dict[str, Any]]] = {}
        self.plan_sent = False
        self.gate_fixtures: set[str] = set()
        self.results: dict[str, list[GateResult]] = {}
        self.outcomes: dict[str, str] = {}
        self.started: set[str] = set()
        self.finished: set[str] = set()
        self.crashed: dict[str, str] = {}
        self.lost: list[str] = []
        self.order: dict[str, int] = {}
        self.evidence_target: Path | None = None
        self.evidence_path: Path | None = None
        self.evidence_error: str | None = None
        self.environment: dict[str, Any] | None = None
        # FixtureDef -> (value, record) of its latest execution; FixtureDef -> error of a failed one
        self.fixture_records: dict[Any, tuple[Any, dict[str, Any]]] = {}
        self.fixture_errors: dict[Any, dict[str, str]] = {}

    @property
    def distributed(self) -> bool:
        """This process is the controller of a pytest-xdist run."""
        return getattr(self.config.option, "dist", "no") != "no" and not self.is_worker

    def pytest_report_header(self, config: pytest.Config) -> str | None:
        configured = [f"{name}={self.settings.get(name).value}" for name in ("model", "data", "scenarios", "device",
                                                                              "seed")
                      if self.settings.get(name).source != "default"]
        return f"dnnsafety: {', '.join(configured)}" if configured else None

    # -- start: the evidence path must be usable before any test runs

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        option = self.config.option
        if self.is_worker or any(getattr(option, name, False) for name in
                                 ("collectonly", "showfixtures", "show_fixtures_per_test")):
            return
        json_setting = self.settings.get("json")
        if json_setting.value is None:
            return
        from .report import prepare_evidence_path

        path = self.settings.path(json_setting)
        try:
            prepare_evidence_path(path)
        except OSError as exc:
            problem = "is a directory" if isinstance(exc, IsADirectoryError) else f"cannot be written: {exc}"
            raise pytest.UsageError(
                f"pytest-dnnsafety: dnnsafety_json={json_setting.value!r} (from {json_setting.source}) resolves to "
                f"{path}, which {problem}. Fix: give a writable file path such as reports/dnnsafety.json "
                "(missing folders are created)."
            ) from None
        self.evidence_target = path

    # -- collection: validate every gate marker; a bad one is a collection error of its module

    def _overridden(self, item: pytest.Item, name: str) -> bool:
        fixturedef = _fixturedef(item, name)
        return fixturedef is not None and not _is_plugin_fixture(fixturedef)

    def _prepare(self, item: pytest.Item) -> list[GateSpec]:
        specs: list[GateSpec] = []
        for mark in item.iter_markers():
            if mark.name not in GATES:
                continue
            spec = parse_marker(mark.name, mark.args, mark.kwargs, where=item.nodeid)
            if spec.optional and hasattr(item, "_fixtureinfo"):
                spec = resolve_optional(spec, self.settings, lambda name: self._overridden(item, name))
            specs.append(spec)
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

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """The gate plan of the items that will run (after deselection), known before any test runs."""
        for item in session.items:
            specs = item.stash.get(_SPECS, None)
            if specs:
                self.plan[item.nodeid] = [spec.plan_entry() for spec in specs]
                self.gate_fixtures.update(name for spec in specs for name in spec.fixtures.values())

    # -- provenance: fingerprint what a gate will read as soon as its fixture returns it

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: Any) -> Iterator[Any]:
        if fixturedef.argname not in self.gate_fixtures:
            return (yield)
        try:
            value = yield
        except BaseException as exc:
            if not isinstance(exc, (pytest.skip.Exception, KeyboardInterrupt, SystemExit)):
                cause = exc.__context__ if isinstance(exc.__context__, DnnSafetyError) else exc
                self.fixture_errors[fixturedef] = {"error_type": type(cause).__name__,
                                                   "error": str(cause) or repr(cause)}
            raise
        self.fixture_errors.pop(fixturedef, None)
        self.fixture_records[fixturedef] = (value, self._describe(fixturedef, value, "at fixture setup"))
        return value

    def _describe(self, fixturedef: Any, value: Any, taken: str) -> dict[str, Any]:
        from .provenance import fingerprint, fixture_origin, setting_origin, type_name

        evidence = self.settings.get("json").value is not None
        record: dict[str, Any] = {"fixture": fixturedef.argname}
        scope = getattr(fixturedef, "scope", None)
        if _is_plugin_fixture(fixturedef):
            record["origin"] = {"kind": "plugin fixture", "scope": scope,
                                "settings": setting_origin(self.settings,
                                                           PLUGIN_FIXTURE_SETTINGS.get(fixturedef.argname, ()),
                                                           digest=evidence)}
        else:
            record["origin"] = {"kind": "user fixture", "scope": scope,
                                **fixture_origin(_unwrapped(fixturedef.func), self.config.rootpath)}
        if not evidence:
            # Hashing a large model costs seconds (and a copy to the host); only evidence needs it.
            record.update({"type": type_name(value), "digest": None,
                           "not_fingerprinted": "no evidence file requested (dnnsafety_json is unset)"})
        else:
            record.update(fingerprint(value))
            record["taken"] = taken
        return record

    def _inputs(self, item: pytest.Item, spec: GateSpec, funcargs: dict[str, Any]) -> dict[str, Any]:
        inputs: dict[str, Any] = {}
        for role, name in spec.fixtures.items():
            fixturedef = _fixturedef(item, name)
            seen = self.fixture_records.get(fixturedef) if fixturedef is not None else None
            if seen is not None and seen[0] is funcargs.get(name):
                inputs[role] = dict(seen[1])
            elif fixturedef is not None:
                inputs[role] = self._describe(fixturedef, funcargs.get(name),
                                              "at gate evaluation (the fixture's setup was not observed)")
        return inputs

    # -- running: gates are evaluated after the test body passed

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Iterator[Any]:
        specs = item.stash.get(_SPECS, None)
        if not specs:
            return (yield)
        try:
            outcome = yield
        except BaseException as exc:
            skipped = isinstance(exc, pytest.skip.Exception)
            why = "test skipped" if skipped else "test body failed"
            message = str(getattr(exc, "msg", None) or exc).strip().splitlines()[:1]
            item.stash[_RESULTS] = [_row(spec.plan_entry(), item.nodeid, "not-evaluated", why,
                                         **({"message": message[0]} if message else {}))
                                    for spec in specs]
            raise
        funcargs = getattr(item, "funcargs", {})
        results = []
        for spec in specs:
            result = evaluate(spec, {role: funcargs[name] for role, name in spec.fixtures.items()},
                              self.settings, item.nodeid, self.cache)
            result.inputs = self._inputs(item, spec, funcargs)
            results.append(result)
        item.stash[_RESULTS] = results
        bad = [r for r in results if r.status != "passed"]
        if bad:
            lines = []
            for r in bad:
                lines.append(r.summary)
                lines += [f"    {frame}" for frame in r.details.get("traceback", ())]
            pytest.fail("\n".join(lines), pytrace=False)
        return outcome

    def _not_run(self, item: pytest.Item, specs: list[GateSpec], report: pytest.TestReport) -> list[GateResult]:
        """Results for gates whose test never reached its body (setup skipped or failed)."""
        message = _longrepr_line(report)
        extra = {"message": message} if message else {}
        if report.skipped:
            return [_row(s.plan_entry(), item.nodeid, "not-evaluated", "test skipped", **extra) for s in specs]
        rows = []
        for spec in specs:
            failed = [(name, self.fixture_errors[d]) for name in spec.fixtures.values()
                      if (d := _fixturedef(item, name)) is not None and d in self.fixture_errors]
            if failed:
                name, error = failed[0]
                entry = spec.plan_entry()
                row = _row(entry, item.nodeid, "error", f"fixture {name!r} failed", fixture=name, **error)
                row.summary = (f"{spec.marker}: cannot compute {entry['metric']}: fixture {name!r} failed: "
                               f"{error['error']}")
                rows.append(row)
            else:
                rows.append(_row(spec.plan_entry(), item.nodeid, "not-evaluated", "test setup failed", **extra))
        return rows

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
        report = yield
        if self.is_worker and not self.plan_sent and self.plan:
            # The controller of an xdist run collects nothing: each worker sends its gate plan once,
            # on its first report, so even a gate whose worker dies later has its threshold known.
            report.dnnsafety_plan = json.dumps(self.plan)
            self.plan_sent = True
        specs = item.stash.get(_SPECS, None)
        if specs:
            if call.when == "setup" and (report.failed or report.skipped):
                report.dnnsafety_gates = json.dumps([r.to_dict() for r in self._not_run(item, specs, report)])
            elif call.when == "call":
                results = item.stash.get(_RESULTS, [])
                report.dnnsafety_gates = json.dumps([r.to_dict() for r in results])
        return report

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.started.add(nodeid)

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        self.finished.add(nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        plan = getattr(report, "dnnsafety_plan", None)
        if plan is not None:
            for nodeid, entries in json.loads(plan).items():
                self.plan.setdefault(nodeid, entries)
        gates = getattr(report, "dnnsafety_gates", None)
        if gates is not None:
            self.results[report.nodeid] = [GateResult.from_dict(d) for d in json.loads(gates)]
        if report.when == "???":  # pytest-xdist's report for the test a dead worker was running
            self.crashed[report.nodeid] = str(report.longrepr)
        if report.failed:
            self.outcomes[report.nodeid] = "failed"
        elif report.skipped:
            self.outcomes.setdefault(report.nodeid, "skipped")
        elif report.when == "call":
            self.outcomes.setdefault(report.nodeid, "passed")

    # -- the controller's end of the run

    def _missing(self, nodeid: str) -> tuple[str, str]:
        """(status, reason) for a planned test whose gates have no result."""
        if nodeid in self.crashed:
            return "lost", f"the worker running this test died: {self.crashed[nodeid]}"
        if nodeid in self.started and nodeid not in self.finished:
            if self.distributed:
                return "lost", "the worker running this test never reported it finished"
            return "not-evaluated", "run interrupted during this test"
        if nodeid in self.started or nodeid in self.outcomes:
            return "lost", "the test ran but its gate results never reached the controller"
        return "not-evaluated", "run stopped before this test"

    def all_results(self) -> list[GateResult]:
        """Every planned gate of the run; a gate without a result is lost or not evaluated."""
        rows: list[GateResult] = []
        # Collection order, whatever order xdist workers reported in.
        ordered = sorted(self.plan.items(), key=lambda kv: (self.order.get(kv[0], len(self.order)), kv[0]))
        for nodeid, entries in ordered:
            got = self.results.get(nodeid)
            if got:
                rows.extend(got)
                continue
            status, why = self._missing(nodeid)
            rows.extend(_row(entry, nodeid, status, why) for entry in entries)
        return rows

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.is_worker or not self.plan or getattr(self.config.option, "collectonly", False):
            return
        from . import report

        rows = self.all_results()
        self.lost = list(dict.fromkeys(r.nodeid for r in rows if r.status == "lost"))
        if self.lost and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        numprocesses = getattr(self.config.option, "numprocesses", None)
        workers = numprocesses if self.distributed and isinstance(numprocesses, int) else 0
        self.environment = report.environment(self.settings, (r.device for r in rows), workers)
        if self.evidence_target is not None:
            try:
                self.evidence_path = report.write_evidence(
                    self.evidence_target, report.build_evidence(rows, self.environment, self.lost))
            except (OSError, ValueError) as exc:
                self.evidence_error = f"{type(exc).__name__}: {exc}"
                if session.exitstatus == pytest.ExitCode.OK:
                    session.exitstatus = pytest.ExitCode.TESTS_FAILED
        xmlpath = getattr(self.config.option, "xmlpath", None)
        if xmlpath and Path(xmlpath).is_file():
            env = self.environment
            props: dict[str, Any] = {
                "dnnsafety.version": env["pytest_dnnsafety"],
                "dnnsafety.torch": env["torch"] or "not installed",
                "dnnsafety.device": env["device"],
                "dnnsafety.seed": env["seed"],
                "dnnsafety.gates": len(rows),
            }
            for status in STATUSES:
                props[f"dnnsafety.gates_{status.replace('-', '_')}"] = sum(r.status == status for r in rows)
            report.patch_junit(Path(xmlpath), rows, props,
                               testcase_properties=bool(self.settings.value("junit_properties")),
                               prefix=getattr(self.config.option, "junitprefix", None))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.is_worker or not self.plan or self.environment is None:
            return
        from .report import header_line, render_table

        tr = terminalreporter
        rows = self.all_results()
        tr.write_sep("=", "dependability gates")
        tr.write_line(header_line(self.environment))
        for text, markup in render_table(rows):
            tr.write_line(text, **markup)
        for r in rows:
            if r.status in ("failed", "error", "inconclusive", "lost"):
                tr.write_line(f"  {r.nodeid}: {r.summary}", red=True)
        if self.lost:
            tr.write_line(f"{len(self.lost)} gated test(s) never reported a result (lost: a crashed worker?); "
                          "the run fails: " + ", ".join(self.lost), red=True, bold=True)
        if self.evidence_error is not None:
            tr.write_line(f"dependability evidence NOT written to {self.evidence_target}: {self.evidence_error}; "
                          "the run fails", red=True, bold=True)
        elif self.evidence_path is not None:
            tr.write_line(f"dependability evidence written to {self.evidence_path}")
