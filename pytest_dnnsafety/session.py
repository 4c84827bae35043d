"""The controller's and each worker's per-run state: gate plan, results, provenance, reports.

One :class:`DnnSafetyPlugin` is registered per run by :mod:`.plugin` (``pytest_configure``).

Roles, as in pytest-cov: every process collects and validates markers; the process that runs a
test evaluates its gates and attaches the results to the test's report as a JSON string (only
plain strings cross pytest-xdist workers); the controller (the only process when xdist is off)
gathers the reports, fails the run when an expected gate never reported, writes the terminal
section, the JSON evidence and the JUnit additions, and calls ``pytest_dnnsafety_gate_result``
once per gate.

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
from typing import Any, Iterator, Mapping

import pytest

from . import ranks
from .config import Settings
from .errors import DnnSafetyError
from .gates import GateDef, GateSpec, evaluate, parse_marker, resolve_optional
from .gates.evaluation import progress_writer
from .results import STATUSES, GateResult

__all__ = ["DnnSafetyPlugin", "PLUGIN_FIXTURE_SETTINGS"]

#: Settings that ask for evidence: with any of them set, the fixtures gates read are fingerprinted.
_EVIDENCE_SETTINGS = ("json", "html", "baseline", "save_baseline")

_SPECS = pytest.StashKey[list]()
_RESULTS = pytest.StashKey[list]()
#: The module whose fixtures are the plugin's own (``model``, ``dataset``, ...).
_FIXTURE_MODULE = "pytest_dnnsafety.plugin"
_UNSET: Any = object()

# ---------------------------------------------------------------------------------- the session

#: The plugin's own fixtures and the settings each one loads from (for the evidence's ``inputs``).
PLUGIN_FIXTURE_SETTINGS = {
    "model": ("model", "model_factory"),
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

    def __init__(self, config: pytest.Config, settings: Settings, registry: Mapping[str, GateDef]) -> None:
        self.config = config
        self.settings = settings
        #: this run's gate markers (built-in families, conftest.py files, plugins)
        self.registry = registry
        self._writer: Any = _UNSET
        self.is_worker = hasattr(config, "workerinput")
        self._threads: Any = None  # the torch thread plan, see threads_plan()
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
        # output files: checked targets at start, written paths at the end, failed writes
        self.evidence_target: Path | None = None
        self.html_target: Path | None = None
        self.baseline_target: Path | None = None
        self.evidence_path: Path | None = None
        self.html_path: Path | None = None
        self.baseline_path: Path | None = None
        self.output_errors: list[str] = []
        self.step_summary_error: str | None = None
        self.environment: dict[str, Any] | None = None
        self.rows: list[GateResult] = []
        self.hook_errors: list[str] = []
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
        configured.append(self.threads_plan().header(per_worker=self.distributed))
        return f"dnnsafety: {', '.join(configured)}"

    def threads_plan(self) -> Any:
        """This process's torch thread plan (:mod:`.threads`), computed once (no torch import)."""
        if self._threads is None:
            from . import threads

            self._threads = threads.plan(self.settings, self.config)
        return self._threads

    # -- start: the evidence path must be usable before any test runs

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        option = self.config.option
        if ranks.launched():  # torchrun: `cuda` is this rank's GPU before any fixture loads a model
            ranks.select_device(str(self.settings.get("device").value))
        from .report.paths import check_collisions, run_outputs

        try:  # before any output path is touched: two outputs on one file, or one on the baseline
            self.output_files = run_outputs(self.settings, junitxml=getattr(option, "xmlpath", None),
                                            invocation_dir=Path(self.config.invocation_params.dir))
            check_collisions(self.output_files)
        except DnnSafetyError as exc:
            raise pytest.UsageError(f"pytest-dnnsafety: {exc}") from None
        if self.is_worker or not ranks.is_main() or any(getattr(option, name, False) for name in
                                                        ("collectonly", "showfixtures", "show_fixtures_per_test")):
            return
        from .report.paths import prepare_output

        try:  # each output file checked writable, a stale evidence file or page removed
            self.html_target = prepare_output(self.settings, "html", "reports/dnnsafety.html")
            self.baseline_target = prepare_output(self.settings, "save_baseline", "reports/baseline.json",
                                                  remove_stale=False)
            self.evidence_target = prepare_output(self.settings, "json", "reports/dnnsafety.json")
        except DnnSafetyError as exc:
            raise pytest.UsageError(f"pytest-dnnsafety: {exc}") from None
        baseline = self.settings.get("baseline")
        if baseline.value is not None:  # a baseline that cannot be read stops the run before any test
            from .errors import ConfigError
            from .report.baseline import Baseline

            try:
                Baseline.load(self.settings.path(baseline))
            except ConfigError as exc:
                raise pytest.UsageError(f"pytest-dnnsafety: dnnsafety_baseline (from {baseline.source}): {exc}") from None

    # -- collection: validate every gate marker; a bad one is a collection error of its module

    def _overridden(self, item: pytest.Item, name: str) -> bool:
        fixturedef = _fixturedef(item, name)
        return fixturedef is not None and not _is_plugin_fixture(fixturedef)

    def _prepare(self, item: pytest.Item) -> list[GateSpec]:
        specs: list[GateSpec] = []
        for mark in item.iter_markers():
            if mark.name not in self.registry:
                continue
            spec = parse_marker(mark.name, mark.args, mark.kwargs, where=item.nodeid, registry=self.registry)
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
        from .report.paths import check_gate_outputs

        check_gate_outputs(item.nodeid, specs, self.settings.ini_dir, getattr(self, "output_files", ()))
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
            marks = sum(m.name in self.registry for m in item.iter_markers())
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
        if self.plan and not getattr(self.config.option, "collectonly", False):
            # Gates will run in this process: set torch's threads before any fixture or gate works (see .threads).
            from . import threads

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
        from .provenance import fingerprint, fixture_origin, setting_origin, type_name

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
            if ranks.active() and not isinstance(exc, (KeyboardInterrupt, SystemExit, pytest.exit.Exception)):
                self._bodies_agree(f"{why}: {message[0]}" if message else why)  # the other ranks wait for it
            raise
        if ranks.active():
            failed = self._bodies_agree(None)
            if failed:  # no rank evaluates: the sharded gates' collectives would miss that rank
                r, why = failed[0]
                item.stash[_RESULTS] = [_row(spec.plan_entry(), item.nodeid, "not-evaluated", f"rank {r}: {why}")
                                        for spec in specs]
                pytest.fail(f"the test body passed here but not on rank {r} of {ranks.world_size()} ({why}); its "
                            "gates are not evaluated on any rank", pytrace=False)
        funcargs = getattr(item, "funcargs", {})
        if self._writer is _UNSET:
            self._writer = progress_writer(self.config)
        results = []
        for spec in specs:
            # What the gate reads is recorded first: the baseline comparison checks it.
            results.append(evaluate(spec, {role: funcargs[name] for role, name in spec.fixtures.items()},
                                    self.settings, item.nodeid, self.cache, writer=self._writer,
                                    inputs=self._inputs(item, spec, funcargs)))
            if ranks.active():
                timed = spec.marker in ranks.TIMED_MARKERS or bool(getattr(spec.definition, "timed", False))
                ranks.agree_on_verdict(results[-1], timed)
        item.stash[_RESULTS] = results
        bad = [r for r in results if r.status != "passed"]
        if bad:
            lines = []
            for r in bad:
                lines.append(r.summary)
                lines += [f"    {frame}" for frame in r.details.get("traceback", ())]
            pytest.fail("\n".join(lines), pytrace=False)
        return outcome

    def _bodies_agree(self, why: str | None) -> list[tuple[int, str]]:
        """torchrun: every rank says whether its test body passed (``why`` None) before any gate runs.

        Returns the ranks whose body did not pass, with why. One collective per gated test, called
        by every rank whatever its body did, so the gates' own collectives stay in step.
        """
        ranks.ensure_group(str(self.settings.get("device").value))
        return [(r, text) for r, text in enumerate(ranks.gather(why)) if text is not None]

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
        if not ranks.is_main():  # torchrun: rank 0 writes the evidence, the summaries and the hook calls
            return
        from . import report

        rows = self.rows = self.all_results()
        self.lost = list(dict.fromkeys(r.nodeid for r in rows if r.status == "lost"))
        if self.lost and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        numprocesses = getattr(self.config.option, "numprocesses", None)
        workers = numprocesses if self.distributed and isinstance(numprocesses, int) else 0
        self.environment = report.environment(self.settings, (r.device for r in rows), workers)
        evidence = report.build_evidence(rows, self.environment, self.lost)  # one dict for every output
        outputs = [(self.evidence_target, report.write_evidence, "evidence_path"),
                   (self.html_target, _write_html, "html_path"),
                   (self.baseline_target, report.save_baseline, "baseline_path")]
        for target, write, attribute in outputs:
            if target is None:
                continue
            try:
                setattr(self, attribute, write(target, evidence))
            except (OSError, ValueError, DnnSafetyError) as exc:
                self.output_errors.append(f"{target}: {type(exc).__name__}: {exc}")
                if session.exitstatus == pytest.ExitCode.OK:
                    session.exitstatus = pytest.ExitCode.TESTS_FAILED
        try:
            report.write_github_step_summary(rows, self.environment)
        except OSError as exc:  # the job summary is a convenience: warn, never fail the gates for it
            self.step_summary_error = f"{type(exc).__name__}: {exc}"
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
        self._announce(session, rows)

    def _announce(self, session: pytest.Session, rows: list[GateResult]) -> None:
        """``pytest_dnnsafety_gate_result`` once per gate, after the reports are written.

        An implementation that raises does not stop the others' calls or lose the evidence: the
        error is shown in the terminal summary and fails the run.
        """
        hook = self.config.hook.pytest_dnnsafety_gate_result
        for row in rows:
            try:
                hook(result=row, config=self.config)
            except Exception as exc:
                self.hook_errors.append(f"{row.nodeid} {row.marker}: {type(exc).__name__}: {exc}")
        if self.hook_errors and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.is_worker or not self.plan or self.environment is None:
            return
        from .report import baseline_notes, header_line, render_table

        tr = terminalreporter
        rows = self.rows
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
        for line in baseline_notes(rows):
            tr.write_line(line, yellow=True)
        for error in self.output_errors:
            tr.write_line(f"dependability evidence NOT written to {error}; the run fails", red=True, bold=True)
        for what, path in (("dependability evidence", self.evidence_path), ("dependability report (HTML)",
                                                                            self.html_path),
                           ("baseline", self.baseline_path)):
            if path is not None:
                tr.write_line(f"{what} written to {path}")
        if self.step_summary_error is not None:
            tr.write_line(f"GitHub job summary not written: {self.step_summary_error}", yellow=True)
        for error in self.hook_errors:
            tr.write_line(f"pytest_dnnsafety_gate_result raised for {error}; the run fails", red=True, bold=True)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        ranks.close()  # the process group, if the plugin created it


def _write_html(path: Path, evidence: dict[str, Any]) -> Path:
    from .report.html import write_html

    return write_html(path, evidence)
