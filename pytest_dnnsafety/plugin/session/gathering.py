"""The part of a process that reports the run: it gathers the gates' results and hands them to the report package.

Shared by the roles that report (one process, the xdist controller, a torchrun rank; see
:mod:`pytest_dnnsafety.plugin.session`). It gathers the results each test's report carries, fails the run
when an expected gate never reported (a test that started but never finished on a worker that
died is *lost*; a test the run never reached, ``-x``, is *not evaluated*), has
:mod:`pytest_dnnsafety.report` write every output and the terminal section, and calls
``pytest_dnnsafety_gate_result`` once per gate. No output is formatted here.
"""

from __future__ import annotations

import json
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

    def writes_reports(self) -> bool:
        return True

    def workers(self) -> int:
        """pytest-xdist workers of this run, for the evidence (0: none)."""
        return 0

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
        from pytest_dnnsafety.report.run import Targets, write_outputs

        rows = self.rows = self.all_results()
        self.lost = list(dict.fromkeys(r.nodeid for r in rows if r.status == "lost"))
        self.environment = report.environment(self.settings, (r.device for r in rows), self.workers())
        option = self.config.option
        targets = Targets(evidence=self.evidence_target, html=self.html_target, baseline=self.baseline_target,
                          junitxml=getattr(option, "xmlpath", None),
                          junit_testcase_properties=bool(self.settings.value("junit_properties")),
                          junit_prefix=getattr(option, "junitprefix", None),
                          plots=self.registry.plots if isinstance(self.registry, GateRegistry) else None)
        written = self.written = write_outputs(rows, self.environment, self.lost, targets)
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

        write_section(terminalreporter, self.rows, self.environment, self.lost, self.written, self.hook_errors)
