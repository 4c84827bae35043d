"""Rendering of gate results: terminal section, JSON evidence file, JUnit post-processing.

Reports only render :class:`~pytest_dnnsafety.results.GateResult` records; they never recompute
a metric. Nothing here imports torch.
"""

from .environment import environment, file_digest
from .evidence import build_evidence, prepare_evidence_path, write_evidence
from .junit import junit_name, patch_junit
from .terminal import header_line, render_table

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
]
