"""The part of a process that reports the run: it gathers the gates' results and hands them to the report package.

Shared by the roles that report (one process, the xdist controller, a torchrun rank; see
:mod:`pytest_dnnsafety.plugin.session`). It gathers the results each test's report carries, fails the run
when an expected gate never reported (a test that started but never finished on a worker that
died is *lost*; a test the run never reached, ``-x``, is *not evaluated*), has
:mod:`pytest_dnnsafety.report` write every output and the terminal section, and calls
``pytest_dnnsafety_gate_result`` once per gate. No output is formatted here.

While the run goes on, each finished gate (one process, torchrun's rank 0: as it finishes; the xdist
controller: as its test's report arrives) and each finished test is handed to a
:class:`~pytest_dnnsafety.report.partial.PartialWriter`, which rewrites the JSON evidence (``"complete":
false``) and a JUnit file of the finished tests, so a run killed before its end leaves both. The writer is
closed before pytest's own JUnit file and the final outputs are written.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import pytest

from pytest_dnnsafety.gates.core import GateRegistry
from pytest_dnnsafety.results import GateResult
from pytest_dnnsafety.plugin.session.base import DnnSafetyPlugin, unmeasured

__all__ = ["Gathering"]


class Gathering(DnnSafetyPlugin):
    """The reporting process's view of each gated test.

    ``results`` (the gate results attached to a report), ``started`` / ``finished`` (logstart /
    logfinish), ``crashed`` (xdist's crash report, ``when == "???"``). From those and ``plan``,
    :meth:`all_results` gives every planned gate a verdict: measured, ``lost`` (a worker died, or
    the results never arrived) or ``not-evaluated`` (the run stopped before the test).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, str] = {}
        self.started: set[str] = set()
        self.finished: set[str] = set()
        self.crashed: dict[str, str] = {}
        self.lost: list[str] = []
        self.rows: list[GateResult] = []
        self.environment: dict[str, Any] | None = None
        self.written: Any = None  # report.run.Written, once the outputs are written
        self.output_errors: list[str] = []
        self.step_summary_error: str | None = None
        self.hook_errors: list[str] = []
        #: the shared forward passes reported so far (by their run-unique id), for every output
        self.shared_passes: dict[str, dict[str, Any]] = {}
        # while the run goes on: gates finished in tests still running, finished tests for JUnit, the writer
        self.partial: dict[str, list[GateResult]] = {}
        self.cases: dict[str, dict[str, Any]] = {}
        self._running: dict[str, dict[str, Any]] = {}
        self._partial_writer: Any = None
        self._partial_env: dict[str, Any] | None = None

    def writes_reports(self) -> bool:
        return True

    def workers(self) -> int:
        """pytest-xdist workers of this run, for the evidence (0: none)."""
        return 0

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.started.add(nodeid)

    def pytest_runtest_logfinish(self, nodeid: str, location: Any) -> None:
        self.finished.add(nodeid)
        case = self._running.pop(nodeid, None)
        if case is not None:
            self.cases[nodeid] = case
        self._write_partial()

    def gate_done(self, nodeid: str, results: list[GateResult]) -> None:
        self.partial[nodeid] = list(results)
        self._write_partial()

    def _case(self, report: pytest.TestReport) -> None:
        """The test's JUnit testcase so far (outcome, time, message), for the JUnit file written during the run."""
        from pytest_dnnsafety.plugin.session.evaluating import _longrepr_line

        case = self._running.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "passed", "time": 0.0,
                                                        "message": ""})
        case["time"] += float(getattr(report, "duration", 0.0) or 0.0)
        if case["outcome"] != "passed" or report.passed:
            return
        case["outcome"] = "skipped" if report.skipped else "failed" if report.when == "call" else "error"
        case["message"] = _longrepr_line(report)[:500]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        plan = getattr(report, "dnnsafety_plan", None)
        if plan is not None:
            for nodeid, entries in json.loads(plan).items():
                self.plan.setdefault(nodeid, entries)
        passes = getattr(report, "dnnsafety_passes", None)
        if passes is not None:
            for entry in json.loads(passes):
                self.shared_passes.setdefault(str(entry.get("id")), entry)
        if report.when in ("setup", "call", "teardown"):
            self._case(report)
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

    # -- while the run goes on: the finished gates and tests, written as they finish

    def _targets(self) -> Any:
        from pytest_dnnsafety.report.run import Targets

        option = self.config.option
        xmlpath = getattr(option, "xmlpath", None)
        return Targets(evidence=self.evidence_target, html=self.html_target, baseline=self.baseline_target,
                       junitxml=xmlpath, junit_testcase_properties=bool(self.settings.value("junit_properties")),
                       junit_prefix=getattr(option, "junitprefix", None),
                       junit_suite_name=str(self.config.getini("junit_suite_name") or "pytest"),
                       plots=self.registry.plots if isinstance(self.registry, GateRegistry) else None)

    def _passes(self) -> list[dict[str, Any]]:
        """The shared passes reported so far, and this process's own (one process: before its test's report)."""
        own = getattr(self, "passes", None)
        entries = dict(self.shared_passes)
        for entry in (own.entries if own is not None else ()):
            entries.setdefault(str(entry.get("id")), entry)
        return [{k: v for k, v in entry.items() if k != "id"} for entry in entries.values()]

    def _write_partial(self) -> None:
        """Hand what finished so far to the partial writer (made on first use; nothing when no output asks)."""
        if not self.plan or not self.writes_reports() or self.listing_only() or self.written is not None:
            return
        if self._partial_writer is None:
            from pytest_dnnsafety.report.partial import PartialWriter
            from pytest_dnnsafety.report.run import write_partial

            targets = self._targets()
            if not targets.partial():
                self._partial_writer = False
                return
            if targets.junitxml:  # pytest resolves --junitxml at configure; a test may chdir later
                from pathlib import Path

                from pytest_dnnsafety.report.evidence import remove_stale_temporaries

                targets = dataclasses.replace(targets, junitxml=os.path.abspath(targets.junitxml))
                remove_stale_temporaries(Path(targets.junitxml))
            self._partial_writer = PartialWriter(lambda snapshot: write_partial(snapshot, targets))
        if self._partial_writer is False:
            return
        self._partial_writer.submit(self._snapshot())

    def _snapshot(self) -> Any:
        from pytest_dnnsafety import report
        from pytest_dnnsafety.report.partial import Snapshot
        from pytest_dnnsafety.report.run import junit_properties

        ordered = sorted({*self.results, *self.partial}, key=lambda n: (self.order.get(n, len(self.order)), n))
        rows = [row for nodeid in ordered for row in (self.results.get(nodeid) or self.partial.get(nodeid, []))]
        if self._partial_env is None:  # the input files' digests once; the final write takes them again
            self._partial_env = report.environment(self.settings, (r.device for r in rows), self.workers())
        devices = sorted({r.device for r in rows if r.device})
        env = dict(self._partial_env, **({"device": ",".join(devices)} if devices else {}))
        cases = sorted(self.cases.values(), key=lambda c: (self.order.get(c["nodeid"], len(self.order)), c["nodeid"]))
        return Snapshot(rows=rows, environment=env, shared_passes=self._passes(), cases=[dict(c) for c in cases],
                        suite_properties=junit_properties(rows, env))

    @pytest.hookimpl(tryfirst=True, specname="pytest_sessionfinish")
    def stop_partial_writes(self, session: pytest.Session, exitstatus: int) -> None:
        """No write during the run's end: pytest writes its JUnit file, then the final outputs are written."""
        if self._partial_writer:
            self._partial_writer.close()

    # -- the end of the run

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
            rows.extend(unmeasured(entry, nodeid, status, why) for entry in entries)
        return rows

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if not self.plan or getattr(self.config.option, "collectonly", False) or not self.writes_reports():
            return
        from pytest_dnnsafety import report
        from pytest_dnnsafety.report.run import write_outputs

        if self._partial_writer:
            self._partial_writer.close()
        rows = self.rows = self.all_results()
        self.lost = list(dict.fromkeys(r.nodeid for r in rows if r.status == "lost"))
        self.environment = report.environment(self.settings, (r.device for r in rows), self.workers())
        written = self.written = write_outputs(rows, self.environment, self.lost, self._targets(),
                                               shared_passes=self._passes())
        self.evidence_path, self.html_path, self.baseline_path = (written.evidence_path, written.html_path,
                                                                  written.baseline_path)
        self.output_errors, self.step_summary_error = written.errors, written.step_summary_error
        if (self.lost or self.output_errors) and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
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
        if not self.plan or self.environment is None or self.written is None:
            return
        from pytest_dnnsafety.report.terminal import write_section

        writer = self._partial_writer or None
        write_section(terminalreporter, self.rows, self.environment, self.lost, self.written, self.hook_errors,
                      shared_passes=self._passes(),
                      partial_error=(f"{writer.errors} of {writer.writes} writes failed, the first: {writer.error}"
                                     if writer is not None and writer.errors else None))
