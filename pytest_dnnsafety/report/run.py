"""The end of a run: every output written from one evidence dict.

The process that reports a run (the only process, the pytest-xdist controller, or torchrun's rank
0) hands its gate rows here once: the JSON evidence, the HTML page and the baseline file are written
from the same evidence dict, the GitHub job summary is appended, and the JUnit file pytest wrote
gets the gates' properties. A failed write is recorded, never raised: the caller fails the run and
the terminal section names the file. While the run goes on, :func:`write_partial` writes the JSON evidence
(``"complete": false``) and a JUnit file of the finished tests from a :class:`~.partial.Snapshot` (see
:mod:`.partial`); the HTML page and the baseline are written at the end only. Nothing here imports torch or
pytest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from pytest_dnnsafety.errors import DnnSafetyError
from pytest_dnnsafety.results import STATUSES, GateResult
from pytest_dnnsafety.report.plots import PlotFn
from pytest_dnnsafety.report.partial import Snapshot

__all__ = ["Targets", "Written", "write_outputs", "write_partial", "junit_properties"]


@dataclass(frozen=True)
class Targets:
    """Where this run writes its outputs (None: not asked for), checked writable when the run started."""

    evidence: Path | None = None
    html: Path | None = None
    baseline: Path | None = None
    #: the JUnit file pytest writes (``--junitxml``), patched with the gates' properties
    junitxml: str | None = None
    #: ``dnnsafety_junit_properties``: one property per gate number on each testcase too
    junit_testcase_properties: bool = False
    junit_prefix: str | None = None
    #: the HTML page's plot table (details key -> plot function of :mod:`.plots`), from the run's gate
    #: families; None draws the built-in plots
    plots: Mapping[str, PlotFn] | None = None
    #: the JUnit ``<testsuite name>`` (pytest's ``junit_suite_name``), for the JUnit file written during the run
    junit_suite_name: str = "pytest"

    def partial(self) -> bool:
        """Whether anything is written while the run goes on (the JSON evidence or a JUnit file)."""
        return self.evidence is not None or bool(self.junitxml)


@dataclass
class Written:
    """What :func:`write_outputs` wrote: the paths, and the writes that failed."""

    evidence_path: Path | None = None
    html_path: Path | None = None
    baseline_path: Path | None = None
    #: ``"path: ErrorType: message"`` of each output that could not be written (the run fails)
    errors: list[str] = field(default_factory=list)
    #: why the GitHub job summary was not written (a warning only)
    step_summary_error: str | None = None


def _write_html(path: Path, evidence: dict[str, Any], plots: Mapping[str, PlotFn] | None = None) -> Path:
    from pytest_dnnsafety.report.html import write_html  # jinja2 and matplotlib only when a page is asked for

    return write_html(path, evidence, plots)


def junit_properties(rows: Sequence[GateResult], environment: dict[str, Any]) -> dict[str, Any]:
    """The ``dnnsafety.*`` test-suite properties of the JUnit file: versions, device, seed, gate counts."""
    props: dict[str, Any] = {
        "dnnsafety.version": environment["pytest_dnnsafety"],
        "dnnsafety.torch": environment["torch"] or "not installed",
        "dnnsafety.device": environment["device"],
        "dnnsafety.seed": environment["seed"],
        "dnnsafety.gates": len(rows),
    }
    for status in STATUSES:
        props[f"dnnsafety.gates_{status.replace('-', '_')}"] = sum(r.status == status for r in rows)
    return props


def write_partial(snapshot: Snapshot, targets: Targets) -> None:
    """The JSON evidence (``"complete": false``, the finished gates) and a JUnit file of the finished tests, each
    written atomically; raises on a failed write (:class:`~.partial.PartialWriter` counts it)."""
    from pytest_dnnsafety.report.evidence import build_evidence, write_evidence, write_text_atomic
    from pytest_dnnsafety.report.junit import partial_junit

    if targets.evidence is not None:
        write_evidence(targets.evidence, build_evidence(snapshot.rows, snapshot.environment, snapshot.lost,
                                                        complete=False, shared_passes=snapshot.shared_passes))
    if targets.junitxml:
        write_text_atomic(Path(targets.junitxml), partial_junit(
            snapshot.cases, snapshot.rows, snapshot.suite_properties, suite_name=targets.junit_suite_name,
            testcase_properties=targets.junit_testcase_properties, prefix=targets.junit_prefix,
            shared_passes=snapshot.shared_passes))


def write_outputs(rows: Sequence[GateResult], environment: dict[str, Any], lost: Sequence[str],
                  targets: Targets, shared_passes: Sequence[dict[str, Any]] = ()) -> Written:
    """Write every output of the run from one evidence dict; failures are recorded in the answer."""
    from pytest_dnnsafety.report.baseline import save_baseline
    from pytest_dnnsafety.report.evidence import build_evidence, write_evidence
    from pytest_dnnsafety.report.junit import patch_junit
    from pytest_dnnsafety.report.markdown import write_github_step_summary

    written = Written()
    evidence = build_evidence(rows, environment, lost, shared_passes=shared_passes)  # one dict for every output
    files: list[tuple[Path | None, Callable[[Path, dict[str, Any]], Path], str]] = [
        (targets.evidence, write_evidence, "evidence_path"),
        (targets.html, partial(_write_html, plots=targets.plots), "html_path"),
        (targets.baseline, save_baseline, "baseline_path"),
    ]
    for target, write, attribute in files:
        if target is None:
            continue
        try:
            setattr(written, attribute, write(target, evidence))
        except (OSError, ValueError, DnnSafetyError) as exc:
            written.errors.append(f"{target}: {type(exc).__name__}: {exc}")
    try:
        write_github_step_summary(rows, environment)
    except OSError as exc:  # the job summary is a convenience: warn, never fail the gates for it
        written.step_summary_error = f"{type(exc).__name__}: {exc}"
    if targets.junitxml and Path(targets.junitxml).is_file():
        patch_junit(Path(targets.junitxml), rows, {**junit_properties(rows, environment), "dnnsafety.complete": "true"},
                    testcase_properties=targets.junit_testcase_properties, prefix=targets.junit_prefix,
                    shared_passes=shared_passes)
    return written
