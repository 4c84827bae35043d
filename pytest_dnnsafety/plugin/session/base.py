"""The state and hooks every process role shares: settings, registry, cache, the start-of-run output checks.

See :mod:`pytest_dnnsafety.plugin.session` for the roles. Nothing here formats an output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import pytest

from pytest_dnnsafety.settings import Settings
from pytest_dnnsafety.errors import DnnSafetyError
from pytest_dnnsafety.gates import GateDef
from pytest_dnnsafety.results import GateResult

__all__ = ["DnnSafetyPlugin", "unmeasured"]

#: The command-line modes in which no test runs (nothing is reported either).
_LISTING_OPTIONS = ("collectonly", "showfixtures", "show_fixtures_per_test")


def unmeasured(entry: dict[str, Any], nodeid: str, status: str, why: str, **details: Any) -> GateResult:
    """The result of a planned gate that has no measured one (not evaluated, lost, or an error before it ran).

    ``entry`` is the gate's plan entry (:meth:`~pytest_dnnsafety.gates.GateSpec.plan_entry`).
    """
    word = {"not-evaluated": "not evaluated", "lost": "lost", "error": "error"}[status]
    return GateResult(nodeid=nodeid, marker=entry["marker"], metric=entry["metric"], threshold=entry["threshold"],
                      op=entry["op"], status=status, summary=f"{entry['marker']}: {word} ({why})",
                      details={"reason": why, **details})


class DnnSafetyPlugin:
    """Per-run state and the hooks every role has; a role (:mod:`.roles`) adds its own.

    ``plan`` is nodeid -> the gates' plan entries (marker, metric, op, threshold), known before any
    test runs: from this process's collection, or from the first report of each xdist worker.
    ``results`` holds the gate results attached to the reports this process received. ``cache`` is
    the session cache the gates' services live in (see :class:`~pytest_dnnsafety.gates.GateContext`).
    """

    #: this process is a pytest-xdist worker: it runs tests and sends their gate results in its reports
    is_worker = False
    #: this process is the controller of a pytest-xdist run: it runs no test and gathers the workers' reports
    distributed = False

    def __init__(self, config: pytest.Config, settings: Settings, registry: Mapping[str, GateDef]) -> None:
        self.config = config
        self.settings = settings
        #: this run's gate markers (built-in families, conftest.py files, plugins)
        self.registry = registry
        self._threads: Any = None  # the torch thread plan, see threads_plan()
        self.cache: dict[str, Any] = {}
        self.plan: dict[str, list[dict[str, Any]]] = {}
        self.results: dict[str, list[GateResult]] = {}
        #: nodeid -> its position in the collection (the order of the reports, whatever order tests ran in)
        self.order: dict[str, int] = {}
        self.output_files: Any = ()
        # output files: checked targets at start, written paths at the end (see report.run)
        self.evidence_target: Path | None = None
        self.html_target: Path | None = None
        self.baseline_target: Path | None = None
        self.evidence_path: Path | None = None
        self.html_path: Path | None = None
        self.baseline_path: Path | None = None

    @property
    def role(self) -> str:
        """This process's role, in words."""
        return type(self).__name__

    def writes_reports(self) -> bool:
        """Whether this process writes the run's outputs (terminal section, evidence, JUnit, ...)."""
        return False

    def listing_only(self) -> bool:
        """``--collect-only``, ``--fixtures``, ``--fixtures-per-test``: no test runs."""
        return any(getattr(self.config.option, name, False) for name in _LISTING_OPTIONS)

    def pytest_report_header(self, config: pytest.Config) -> str | None:
        configured = [f"{name}={self.settings.get(name).value}" for name in ("model", "data", "scenarios", "device",
                                                                              "seed")
                      if self.settings.get(name).source != "default"]
        configured.append(self.threads_plan().header(per_worker=self.distributed))
        return f"dnnsafety: {', '.join(configured)}"

    def threads_plan(self) -> Any:
        """This process's torch thread plan (:mod:`pytest_dnnsafety.runtime.threads`), computed once (no torch import)."""
        if self._threads is None:
            from pytest_dnnsafety.runtime import threads

            self._threads = threads.plan(self.settings, self.config)
        return self._threads

    # -- start: the output paths must be usable before any test runs

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        from pytest_dnnsafety.report.paths import check_collisions, run_outputs

        self.start()
        option = self.config.option
        try:  # before any output path is touched: two outputs on one file, or one on the baseline
            self.output_files = run_outputs(self.settings, junitxml=getattr(option, "xmlpath", None),
                                            invocation_dir=Path(self.config.invocation_params.dir))
            check_collisions(self.output_files)
        except DnnSafetyError as exc:
            raise pytest.UsageError(f"pytest-dnnsafety: {exc}") from None
        if not self.writes_reports() or self.listing_only():
            return
        from pytest_dnnsafety.report.verdict import check_configured
        from pytest_dnnsafety.report.paths import prepare_output

        try:  # each output file checked writable, a stale evidence file or page removed
            self.html_target = prepare_output(self.settings, "html", "reports/dnnsafety.html")
            self.baseline_target = prepare_output(self.settings, "save_baseline", "reports/baseline.json",
                                                  remove_stale=False)
            self.evidence_target = prepare_output(self.settings, "json", "reports/dnnsafety.json")
            check_configured(self.settings)  # a baseline that cannot be read stops the run before any test
        except DnnSafetyError as exc:
            raise pytest.UsageError(f"pytest-dnnsafety: {exc}") from None

    def start(self) -> None:
        """What this role does first, before the output checks (nothing by default)."""

    def gate_done(self, nodeid: str, results: list[GateResult]) -> None:
        """A gate of ``nodeid`` finished in this process (``results``: the test's gates so far); the reporting
        part writes it out at once (:class:`~.gathering.Gathering`), a worker does nothing."""
