"""The part of a process that runs tests: it validates the gate markers, records what the gates read, evaluates them.

Shared by the roles that run tests (one process, an xdist worker, a torchrun rank; see
:mod:`pytest_dnnsafety.plugin.session`). Every gate marker is validated at collection (a bad one is a
collection error of its module); each fixture a gate reads is fingerprinted right after it is set
up (:mod:`pytest_dnnsafety.files.provenance`), so the evidence names what was evaluated even when
``conftest.py`` overrides a fixture; the gates of a test are evaluated after its body passed, and
their results ride on the test's report as a JSON string (only plain strings cross xdist workers), and so do
the session's shared forward passes each test's gates ran (timed apart from the gates: :mod:`.passes`).
"""

from __future__ import annotations

import dataclasses

import json
from typing import Any, Iterator

import pytest

from pytest_dnnsafety.errors import DnnSafetyError
from pytest_dnnsafety.gates import GateSpec, evaluate, parse_marker, resolve_optional
from pytest_dnnsafety.gates.evaluation import progress_writer
from pytest_dnnsafety.results import GateResult
from pytest_dnnsafety.plugin.session.base import DnnSafetyPlugin, unmeasured
from pytest_dnnsafety.plugin.session.passes import PassClock

__all__ = ["Evaluating", "PLUGIN_FIXTURE_SETTINGS"]

#: Settings that ask for evidence: with any of them set, the fixtures gates read are fingerprinted.
_EVIDENCE_SETTINGS = ("json", "html", "baseline", "save_baseline")

_SPECS = pytest.StashKey[list]()
_RESULTS = pytest.StashKey[list]()
_PASSES_FROM = pytest.StashKey[int]()
#: The module whose fixtures are the plugin's own (``model``, ``dataset``, ...).
_FIXTURE_MODULE = "pytest_dnnsafety.plugin.hooks"
_UNSET: Any = object()

#: The plugin's own fixtures and the settings each one loads from (for the evidence's ``inputs``).
PLUGIN_FIXTURE_SETTINGS = {
    "model": ("model", "model_factory", "predictions"),
    "dataset": ("data",),
    "scenario_table": ("scenarios", "conditions"),
    "operational_profile": ("operational_data",),
    "masks": ("masks",),
    "monitor_data": ("monitor_data",),
    "ood_data": ("ood_data",),
}


def _unwrapped(func: Any) -> Any:
    getter = getattr(func, "_get_wrapped_function", None)
    return getter() if callable(getter) else func


def _is_plugin_fixture(fixturedef: Any) -> bool:
    return getattr(_unwrapped(fixturedef.func), "__module__", None) == _FIXTURE_MODULE


def _fixturedef(item: pytest.Item, name: str) -> Any:
    """The FixtureDef that gives ``item`` its fixture ``name`` (the most specific one), or None."""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get(name) if info is not None else None
    if not defs:
        defs = item.session._fixturemanager.getfixturedefs(name, item)
    return defs[-1] if defs else None


def _longrepr_line(report: pytest.TestReport) -> str:
    """One line saying why a test was skipped or its setup failed."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(getattr(longrepr, "reprcrash", None), "message", None)
    text = str(crash if crash is not None else (longrepr or "")).strip()
    return text.splitlines()[-1] if text else ""


class Evaluating(DnnSafetyPlugin):
    """Collection, provenance and evaluation of the gates of the tests this process runs.

    Hooks for a role to refine: :meth:`bodies_failed` (before the gates of a test run) and
    :meth:`settle` (after each gate), used by torchrun's ranks to stay in step; :meth:`attach`
    (what the report of a test carries besides its gates), used by xdist's workers to send the plan.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._writer: Any = _UNSET
        self.gate_fixtures: set[str] = set()
        # FixtureDef -> (value, record) of its latest execution; FixtureDef -> error of a failed one
        self.fixture_records: dict[Any, tuple[Any, dict[str, Any]]] = {}
        self.fixture_errors: dict[Any, dict[str, str]] = {}
        #: the shared forward passes this process ran, timed apart from the gates
        self.passes = PassClock()

    # -- collection: validate every gate marker; a bad one is a collection error of its module

    def _overridden(self, item: pytest.Item, name: str) -> bool:
        fixturedef = _fixturedef(item, name)
        return fixturedef is not None and not _is_plugin_fixture(fixturedef)

    def _warn_unread_predictions(self, item: pytest.Item) -> None:
        """``dnnsafety_predictions`` set while the project's own ``model`` fixture replaces the plugin's: the file
        would not be read; say so once instead of gating the model silently."""
        if getattr(self, "_predictions_warned", False) or not self._overridden(item, "model"):
            return
        try:
            resolved = self.settings.get("predictions")
        except Exception:  # noqa: BLE001 - an invalid setting is reported where the fixture reads it
            return
        if resolved is None or getattr(resolved, "value", None) in (None, ""):
            return
        self._predictions_warned = True
        item.warn(pytest.PytestConfigWarning(
            f"dnnsafety_predictions={resolved.value!r} is set, but the project's own `model` fixture replaces the "
            f"plugin's, so the recorded predictions are not read (first seen at {item.nodeid}). Fix: remove the "
            "`model` fixture from conftest.py, or return RecordedPredictions.from_file(path, dataset, model=...) "
            "from it."))

    def _prepare(self, item: pytest.Item) -> list[GateSpec]:
        specs: list[GateSpec] = []
        for mark in item.iter_markers():
            if mark.name not in self.registry:
                continue
            spec = parse_marker(mark.name, mark.args, mark.kwargs, where=item.nodeid, registry=self.registry)
            if "model" in spec.fixtures.values() and hasattr(item, "_fixtureinfo"):
                self._warn_unread_predictions(item)
            if spec.optional and hasattr(item, "_fixtureinfo"):
                spec = resolve_optional(spec, self.settings, lambda name: self._overridden(item, name))
            specs.append(spec)
        if specs:
            names = getattr(item, "fixturenames", None)
            if names is None:
                raise DnnSafetyError(f"{item.nodeid}: gate markers work on Python test functions only.")
            info = getattr(item, "_fixtureinfo", None)
            if isinstance(names, list) and info is not None and dataclasses.is_dataclass(info):
                # the parametrized items of one function share one list: a marker on one pytest.param must add
                # its fixtures to that item alone, so the item gets its own copy first
                names = list(names)
                item.fixturenames = names  # type: ignore[attr-defined]
                item._fixtureinfo = dataclasses.replace(info, names_closure=names)  # type: ignore[attr-defined]
            for spec in specs:
                for fixture in spec.fixtures.values():
                    if fixture not in names:
                        names.append(fixture)
        from pytest_dnnsafety.report.paths import check_gate_outputs

        check_gate_outputs(item.nodeid, specs, self.settings.ini_dir, self.output_files)
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

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.order = {item.nodeid: i for i, item in enumerate(items)}
        plan: dict[tuple[str, str], dict[str, None]] = {}
        for item in items:
            # Markers added after collection (item.add_marker in a conftest) are validated here too;
            # items whose gates were all parsed at collection are not parsed again.
            marks = sum(m.name in self.registry for m in item.iter_markers())
            if _SPECS not in item.stash or marks != len(item.stash[_SPECS]):
                try:
                    self._prepare(item)
                except DnnSafetyError as exc:
                    raise pytest.UsageError(f"pytest-dnnsafety: {exc}") from None
            for spec in item.stash[_SPECS]:  # the layers each gate's definition declares (GateDef.layers)
                if spec.layers and "model" in spec.fixtures and "data" in spec.fixtures:
                    plan.setdefault((spec.fixtures["model"], spec.fixtures["data"]), {}).update(
                        dict.fromkeys(spec.layers))
        # Every layer the session's gates need from one (model, data) pair is captured in one pass.
        self.cache["layer_plan"] = {pair: tuple(sorted(layers)) for pair, layers in plan.items()}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        """The gate plan of the items that will run (after deselection), known before any test runs."""
        for item in session.items:
            specs = item.stash.get(_SPECS, None)
            if specs:
                self.plan[item.nodeid] = [spec.plan_entry() for spec in specs]
                self.gate_fixtures.update(name for spec in specs for name in spec.fixtures.values())
        if self.plan and not getattr(self.config.option, "collectonly", False):
            # Gates will run in this process: set torch's threads before any fixture or gate works (see .threads).
            from pytest_dnnsafety.runtime import threads

            threads.apply(self.threads_plan(), owner=self.settings)

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
        from pytest_dnnsafety.files.provenance import fingerprint, fixture_origin, setting_origin, type_name

        evidence = any(self.settings.get(name).value is not None for name in _EVIDENCE_SETTINGS)
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
                           "not_fingerprinted": "no evidence requested (dnnsafety_json, dnnsafety_html and the "
                                                "baseline settings are unset)"})
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

    def bodies_failed(self, why: str | None) -> list[tuple[int, str]]:
        """Before a test's gates: the other processes whose body of this test did not pass (rank, why).

        ``why`` is this process's reason (None: its body passed). One process: nobody else.
        """
        return []

    def settle(self, spec: GateSpec, result: GateResult) -> None:
        """After a gate was evaluated: make its verdict the run's (one process: it is already)."""

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
            item.stash[_RESULTS] = [unmeasured(spec.plan_entry(), item.nodeid, "not-evaluated", why,
                                               **({"message": message[0]} if message else {}))
                                    for spec in specs]
            if not isinstance(exc, (KeyboardInterrupt, SystemExit, pytest.exit.Exception)):
                self.bodies_failed(f"{why}: {message[0]}" if message else why)  # the others wait for it
            raise
        failed = self.bodies_failed(None)
        if failed:  # no process evaluates: the sharded gates' collectives would miss that one
            r, why = failed[0]
            item.stash[_RESULTS] = [unmeasured(spec.plan_entry(), item.nodeid, "not-evaluated", f"rank {r}: {why}")
                                    for spec in specs]
            pytest.fail(f"the test body passed here but not on rank {r} of {self.world_size()} ({why}); its "
                        "gates are not evaluated on any rank", pytrace=False)
        funcargs = getattr(item, "funcargs", {})
        if self._writer is _UNSET:
            self._writer = progress_writer(self.config)
        results: list[GateResult] = []
        item.stash[_PASSES_FROM] = len(self.passes.entries)
        for spec in specs:
            self.passes.watch(self.cache)  # a shared pass this gate triggers is timed as its own entry
            before = self.passes.gate(item.nodeid, spec.marker, spec.fixtures, funcargs)
            # What the gate reads is recorded first: the baseline comparison checks it.
            result = evaluate(spec, {role: funcargs[name] for role, name in spec.fixtures.items()},
                              self.settings, item.nodeid, self.cache, writer=self._writer,
                              inputs=self._inputs(item, spec, funcargs))
            self.passes.charge(result, before)
            results.append(result)
            self.settle(spec, result)
            self.gate_done(item.nodeid, results)  # the evidence holds it now, whatever happens next
        item.stash[_RESULTS] = results
        bad = [r for r in results if r.status != "passed"]
        if bad:
            lines = []
            for r in bad:
                lines.append(r.summary)
                lines += [f"    {frame}" for frame in r.details.get("traceback", ())]
            pytest.fail("\n".join(lines), pytrace=False)
        return outcome

    def world_size(self) -> int:
        """The processes that evaluate each gate together (1 but under torchrun)."""
        return 1

    def _not_run(self, item: pytest.Item, specs: list[GateSpec], report: pytest.TestReport) -> list[GateResult]:
        """Results for gates whose test never reached its body (setup skipped or failed)."""
        message = _longrepr_line(report)
        extra = {"message": message} if message else {}
        if report.skipped:
            return [unmeasured(s.plan_entry(), item.nodeid, "not-evaluated", "test skipped", **extra) for s in specs]
        rows = []
        for spec in specs:
            failed = [(name, self.fixture_errors[d]) for name in spec.fixtures.values()
                      if (d := _fixturedef(item, name)) is not None and d in self.fixture_errors]
            if failed:
                name, error = failed[0]
                entry = spec.plan_entry()
                row = unmeasured(entry, item.nodeid, "error", f"fixture {name!r} failed", fixture=name, **error)
                row.summary = (f"{spec.marker}: cannot compute {entry['metric']}: fixture {name!r} failed: "
                               f"{error['error']}")
                rows.append(row)
            else:
                rows.append(unmeasured(spec.plan_entry(), item.nodeid, "not-evaluated", "test setup failed", **extra))
        return rows

    def attach(self, report: pytest.TestReport) -> None:
        """What each report carries besides its test's gate results (nothing by default)."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
        report = yield
        self.attach(report)
        specs = item.stash.get(_SPECS, None)
        if specs:
            if call.when == "setup" and (report.failed or report.skipped):
                report.dnnsafety_gates = json.dumps([r.to_dict() for r in self._not_run(item, specs, report)])
            elif call.when == "call":
                results = item.stash.get(_RESULTS, [])
                report.dnnsafety_gates = json.dumps([r.to_dict() for r in results])
                passes = self.passes.since(item.stash.get(_PASSES_FROM, len(self.passes.entries)))
                if passes:
                    report.dnnsafety_passes = json.dumps(passes)
        return report
