"""Peak RSS of a script in a fresh Python process, with the scale project's models importable.

:func:`run_script` prepends a prelude (the scale project on ``sys.path``, torch, ``resnet18`` and ``hwm()`` — the
process's peak RSS in bytes, ``VmHWM``) to ``body`` and returns the script's stdout; a non-zero exit fails the test
with its stderr. Linux only (``/proc/self/status``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = f"""
import sys
sys.path.insert(0, {str(ROOT / "benchmarks" / "scale_project")!r})
import torch
from scale_demo.models import resnet18

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
"""


def run_script(body: str, timeout: float) -> str:
    """Run :data:`PRELUDE` + ``body`` (dedented) in a fresh interpreter from the repository root; its stdout."""
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout
