"""Rendering of gate results: terminal section, JSON evidence file, JUnit post-processing,
baseline comparison and the GitHub job summary.

:mod:`.run` writes every output of a run from one evidence dict (the session's reporting process
hands it its rows); :mod:`.verdict` gives a gate its baseline verdict.

Reports only render :class:`~pytest_dnnsafety.results.GateResult` records; they never recompute
a metric. Nothing here imports torch.
"""

from pytest_dnnsafety.report.baseline import Baseline, compare, save_baseline
from pytest_dnnsafety.report.environment import environment, file_digest
from pytest_dnnsafety.report.evidence import build_evidence, prepare_evidence_path, write_evidence
from pytest_dnnsafety.report.junit import junit_name, patch_junit
from pytest_dnnsafety.report.markdown import append_step_summary, step_summary, write_github_step_summary
from pytest_dnnsafety.report.terminal import baseline_notes, header_line, render_table

__all__ = [
    "environment",
    "file_digest",
    "build_evidence",
    "write_evidence",
    "prepare_evidence_path",
    "junit_name",
    "patch_junit",
    "header_line",
    "render_table",
    "baseline_notes",
    "Baseline",
    "compare",
    "save_baseline",
    "step_summary",
    "append_step_summary",
    "write_github_step_summary",
]
